//! The relay's one error type, mapped to a gRPC status (and its trailers) in one place,
//! [`RelayError::to_status`]. Clients and tests read the messages: their texts are part of the
//! protocol's behaviour (`tests/relay/`).

use tonic::metadata::MetadataValue;
use tonic::{Code, Status};

pub use static_proto::{CURRENT_EPOCH_TRAILER, HORIZON_TRAILER, RETRY_AFTER_TRAILER};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RelayError {
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    AlreadyExists(String),
    /// Not a member, a handshake not signed by one, a binding that does not verify, another
    /// account's org.
    #[error("{0}")]
    PermissionDenied(String),
    /// `retry_after_ms`: when to retry (rate limits), 0 when retrying will not help.
    #[error("{message}")]
    ResourceExhausted {
        message: String,
        retry_after_ms: u64,
    },
    /// The epoch fence refused a message.
    #[error("stale epoch: message epoch {message_epoch}, channel epoch {current_epoch}")]
    StaleEpoch {
        message_epoch: u64,
        current_epoch: u64,
    },
    /// A read from before the channel's horizon: the retention policy pruned what it needs.
    #[error(
        "channel '{channel}': its log up to seq {horizon} was pruned by its retention policy, \
         so it cannot be read {position}: a member this far behind must be added to the group \
         again (a new Welcome)"
    )]
    Pruned {
        channel: String,
        horizon: u64,
        /// Where the read started: "after seq N", "from epoch E".
        position: String,
    },
    #[error("{0}")]
    Unauthenticated(String),
    #[error("{0}")]
    Unavailable(String),
    #[error("{0}")]
    Unimplemented(String),
    /// The port cannot be bound ("cannot listen on HOST:PORT: why"): at startup only, never
    /// sent to a client; `static serve` prints it as it is.
    #[error("{0}")]
    Listen(String),
    /// A bug: logged where it happens; the caller sees only "internal error".
    #[error("internal error")]
    Internal,
}

impl RelayError {
    pub fn resource_exhausted(message: impl Into<String>) -> Self {
        RelayError::ResourceExhausted {
            message: message.into(),
            retry_after_ms: 0,
        }
    }

    /// A store failure, worded for clients.
    pub fn store(err: impl std::fmt::Display) -> Self {
        RelayError::Unavailable(format!("store unavailable: {err}"))
    }

    pub fn code(&self) -> Code {
        match self {
            RelayError::InvalidArgument(_) => Code::InvalidArgument,
            RelayError::NotFound(_) => Code::NotFound,
            RelayError::AlreadyExists(_) => Code::AlreadyExists,
            RelayError::PermissionDenied(_) => Code::PermissionDenied,
            RelayError::ResourceExhausted { .. } => Code::ResourceExhausted,
            RelayError::StaleEpoch { .. } => Code::FailedPrecondition,
            RelayError::Pruned { .. } => Code::OutOfRange,
            RelayError::Unauthenticated(_) => Code::Unauthenticated,
            RelayError::Unavailable(_) | RelayError::Listen(_) => Code::Unavailable,
            RelayError::Unimplemented(_) => Code::Unimplemented,
            RelayError::Internal => Code::Internal,
        }
    }

    /// The gRPC status (with the trailers the SDK reads) for this refusal.
    pub fn to_status(&self) -> Status {
        let mut status = Status::new(self.code(), self.to_string());
        let trailer = match self {
            RelayError::StaleEpoch { current_epoch, .. } => {
                Some((CURRENT_EPOCH_TRAILER, current_epoch.to_string()))
            }
            RelayError::ResourceExhausted { retry_after_ms, .. } if *retry_after_ms > 0 => {
                Some((RETRY_AFTER_TRAILER, retry_after_ms.to_string()))
            }
            RelayError::Pruned { horizon, .. } => Some((HORIZON_TRAILER, horizon.to_string())),
            _ => None,
        };
        if let Some((name, value)) = trailer {
            if let Ok(value) = MetadataValue::try_from(value.as_str()) {
                status.metadata_mut().insert(name, value);
            }
        }
        status
    }
}

impl From<RelayError> for Status {
    fn from(err: RelayError) -> Status {
        err.to_status()
    }
}

/// The log's refusal once the relay is shutting down (its writer stopped).
pub(crate) fn shutting_down() -> RelayError {
    RelayError::Unavailable(SHUTTING_DOWN.to_owned())
}

pub(crate) const SHUTTING_DOWN: &str = "relay is shutting down";

pub type Result<T, E = RelayError> = std::result::Result<T, E>;
