//! What the relay's "no" means to a client: one [`Refusal`], built once from a gRPC status or
//! from a batch item's protobuf refusal, so that no caller classifies codes itself.

use std::time::Duration;

use tonic::{Code, Status};

use super::transport::{pb, CURRENT_EPOCH_TRAILER, HORIZON_TRAILER, RETRY_AFTER_TRAILER};
use crate::error::Error;

/// Why the relay did not take a request, as far as the client's next step goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// A handshake (or an application message beyond the relay's window) at an epoch the
    /// channel has left: catch up to `current` and make it again.
    StaleEpoch { current: u64, message: String },
    /// Rate-limited: the same request may go again after `wait`.
    RetryAfter { wait: Duration, message: String },
    /// The relay's retention pruned the log past where this client reads from
    /// (`OUT_OF_RANGE`): `horizon` is the last seq pruned. Final: only a new Welcome helps.
    Pruned { horizon: u64, message: String },
    /// The token was refused (expired, revoked, or none given where one is needed).
    Unauthenticated { message: String },
    /// The relay or the connection is momentarily unavailable; the outcome is unknown, so a
    /// retry must be idempotent.
    Transient { code: Code, message: String },
    /// Retrying the same request cannot succeed.
    Final { code: Code, message: String },
}

/// Codes of failures that may succeed if simply retried (the connection or the server is
/// momentarily unavailable, or the call timed out).
fn is_transient(code: Code) -> bool {
    matches!(
        code,
        Code::Unavailable
            | Code::Unknown
            | Code::Cancelled
            | Code::DeadlineExceeded
            | Code::Aborted
            | Code::Internal
    )
}

impl Refusal {
    fn classify(
        code: Code,
        message: String,
        current_epoch: Option<u64>,
        retry_after: Option<Duration>,
        horizon: Option<u64>,
    ) -> Self {
        match (code, current_epoch, retry_after) {
            (Code::OutOfRange, _, _) if horizon.is_some() => Self::Pruned {
                horizon: horizon.unwrap_or_default(),
                message,
            },
            (Code::FailedPrecondition, Some(current), _) => Self::StaleEpoch { current, message },
            (Code::ResourceExhausted, _, Some(wait)) => Self::RetryAfter { wait, message },
            (Code::Unauthenticated, _, _) => Self::Unauthenticated { message },
            (code, _, _) if is_transient(code) => Self::Transient { code, message },
            (code, _, _) => Self::Final { code, message },
        }
    }

    /// A failed call's status (its trailers carry the current epoch and the wait).
    pub fn from_status(status: &Status) -> Self {
        if let Some(message) = super::transport::tls_failure(status) {
            return Self::Final {
                code: status.code(),
                message,
            };
        }
        let trailer = |name: &str| -> Option<u64> {
            status
                .metadata()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.trim().parse().ok())
        };
        Self::classify(
            status.code(),
            status.message().to_owned(),
            trailer(CURRENT_EPOCH_TRAILER),
            trailer(RETRY_AFTER_TRAILER).map(Duration::from_millis),
            trailer(HORIZON_TRAILER),
        )
    }

    /// One refused item of a `PublishBatches` answer.
    pub fn from_pb(refusal: &pb::Refusal) -> Self {
        // A code this client does not know (a newer relay's) is not retried blindly.
        let Some(code) = i32::try_from(refusal.code)
            .ok()
            .filter(|c| (0..=16).contains(c))
            .map(Code::from)
        else {
            return Self::Final {
                code: Code::Unknown,
                message: refusal.message.clone(),
            };
        };
        Self::classify(
            code,
            refusal.message.clone(),
            (code == Code::FailedPrecondition).then_some(refusal.current_epoch),
            (refusal.retry_after_ms > 0).then(|| Duration::from_millis(refusal.retry_after_ms)),
            (code == Code::OutOfRange).then_some(refusal.horizon_seq),
        )
    }

    /// A transient failure the client itself observed (no answer in time, a call that ended).
    pub fn transient(code: Code, message: impl Into<String>) -> Self {
        Self::Transient {
            code,
            message: message.into(),
        }
    }

    pub fn code(&self) -> Code {
        match self {
            Self::StaleEpoch { .. } => Code::FailedPrecondition,
            Self::Pruned { .. } => Code::OutOfRange,
            Self::RetryAfter { .. } => Code::ResourceExhausted,
            Self::Unauthenticated { .. } => Code::Unauthenticated,
            Self::Transient { code, .. } | Self::Final { code, .. } => *code,
        }
    }

    pub fn message(&self) -> &str {
        match self {
            Self::StaleEpoch { message, .. }
            | Self::Pruned { message, .. }
            | Self::RetryAfter { message, .. }
            | Self::Unauthenticated { message }
            | Self::Transient { message, .. }
            | Self::Final { message, .. } => message,
        }
    }

    /// The error of `call` when this refusal ends it.
    pub fn into_error(self, call: &str) -> Error {
        match self {
            Self::Unauthenticated { message } => {
                Error::Auth(format!("the relay refused the credentials: {message}"))
            }
            // Not a member, another account's org, a binding that does not verify, a channel
            // outside the key's patterns (`static_proto::patterns::OUTSIDE_CHANNELS`, naming
            // them): the relay's text says which.
            Self::Final {
                code: Code::PermissionDenied,
                message,
            } => Error::Auth(format!("{call}: {message}")),
            Self::Transient { code, message } => {
                Error::Unreachable(format!("{call}: {message} ({code:?})"))
            }
            // Said in the client's words too: what happened, and the one way back.
            Self::Pruned { horizon, message } => Error::refused(
                Code::OutOfRange,
                format!(
                    "{call}: the relay pruned this channel's history up to seq {horizon} \
                     (its retention policy) before this member had read it, so it cannot \
                     catch up; to rejoin, have a member add it to the group again (a new \
                     Welcome). The relay said: {message} (OutOfRange)"
                ),
            ),
            other => {
                let code = other.code();
                Error::refused(code, format!("{call}: {} ({code:?})", other.message()))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(code: Code, trailers: &[(&'static str, &str)]) -> Status {
        let mut status = Status::new(code, "why");
        for (name, value) in trailers {
            status
                .metadata_mut()
                .insert(*name, value.parse().expect("ascii"));
        }
        status
    }

    #[test]
    fn statuses_are_classified_by_code_and_trailers() {
        let stale = status(Code::FailedPrecondition, &[(CURRENT_EPOCH_TRAILER, "7")]);
        assert!(matches!(
            Refusal::from_status(&stale),
            Refusal::StaleEpoch { current: 7, .. }
        ));
        // Without the epoch, a precondition failure is final.
        let bare = status(Code::FailedPrecondition, &[]);
        assert!(matches!(Refusal::from_status(&bare), Refusal::Final { .. }));
        let limited = status(Code::ResourceExhausted, &[(RETRY_AFTER_TRAILER, "250")]);
        assert_eq!(
            Refusal::from_status(&limited),
            Refusal::RetryAfter {
                wait: Duration::from_millis(250),
                message: "why".into()
            }
        );
        // Too large: no wait helps.
        let large = status(Code::ResourceExhausted, &[]);
        assert!(matches!(
            Refusal::from_status(&large),
            Refusal::Final { .. }
        ));
        assert!(matches!(
            Refusal::from_status(&status(Code::Unauthenticated, &[])),
            Refusal::Unauthenticated { .. }
        ));
        for code in [Code::Unavailable, Code::DeadlineExceeded, Code::Internal] {
            assert!(matches!(
                Refusal::from_status(&status(code, &[])),
                Refusal::Transient { .. }
            ));
        }
        for code in [Code::NotFound, Code::InvalidArgument, Code::AlreadyExists] {
            assert!(matches!(
                Refusal::from_status(&status(code, &[])),
                Refusal::Final { .. }
            ));
        }
    }

    #[test]
    fn a_pruned_history_is_final_and_says_how_to_rejoin() {
        let pruned = status(Code::OutOfRange, &[(HORIZON_TRAILER, "42")]);
        let refusal = Refusal::from_status(&pruned);
        assert!(matches!(refusal, Refusal::Pruned { horizon: 42, .. }));
        let e = refusal.into_error("Subscribe").to_string();
        assert!(
            e.starts_with("transport error: Subscribe: the relay pruned"),
            "{e}"
        );
        assert!(
            e.contains("up to seq 42") && e.contains("add it to the group again"),
            "{e}"
        );
        let ended = pb::Refusal {
            code: Code::OutOfRange as u32,
            message: "why".into(),
            current_epoch: 0,
            retry_after_ms: 0,
            horizon_seq: 7,
        };
        assert!(matches!(
            Refusal::from_pb(&ended),
            Refusal::Pruned { horizon: 7, .. }
        ));
    }

    #[test]
    fn batch_refusals_are_classified_like_statuses() {
        let pb = |code: Code, current_epoch, retry_after_ms| pb::Refusal {
            code: code as u32,
            message: "why".into(),
            current_epoch,
            retry_after_ms,
            horizon_seq: 0,
        };
        assert!(matches!(
            Refusal::from_pb(&pb(Code::FailedPrecondition, 3, 0)),
            Refusal::StaleEpoch { current: 3, .. }
        ));
        assert!(matches!(
            Refusal::from_pb(&pb(Code::ResourceExhausted, 0, 10)),
            Refusal::RetryAfter { .. }
        ));
        assert!(matches!(
            Refusal::from_pb(&pb(Code::ResourceExhausted, 0, 0)),
            Refusal::Final { .. }
        ));
        // An unknown code from a newer relay is not retried blindly.
        let odd = pb::Refusal {
            code: 999,
            ..pb(Code::Ok, 0, 0)
        };
        assert!(matches!(Refusal::from_pb(&odd), Refusal::Final { .. }));
    }

    #[test]
    fn a_channel_outside_the_keys_patterns_is_an_auth_error_naming_them() {
        use static_proto::patterns::{ChannelPatterns, OUTSIDE_CHANNELS};
        let patterns = ChannelPatterns::parse(&["acme/ops/*"]).expect("valid");
        let refused = Status::permission_denied(patterns.refusal("acme/x/y"));
        let e = Refusal::from_status(&refused).into_error("CreateChannel");
        assert_eq!(
            e.to_string(),
            "auth error: CreateChannel: channel acme/x/y is outside this key's channels \
             (acme/ops/*)"
        );
        assert!(e.to_string().contains(OUTSIDE_CHANNELS));
        // A batch item's refusal reads the same.
        let item = pb::Refusal {
            code: Code::PermissionDenied as u32,
            message: patterns.refusal("acme/x/y"),
            current_epoch: 0,
            retry_after_ms: 0,
            horizon_seq: 0,
        };
        assert_eq!(
            Refusal::from_pb(&item).into_error("Publish").kind(),
            crate::error::ErrorKind::Auth
        );
    }

    #[test]
    fn final_refusals_become_errors_of_their_row() {
        use crate::error::ErrorKind;
        let kind = |r: Refusal| r.into_error("Publish").kind();
        assert_eq!(
            kind(Refusal::Unauthenticated {
                message: "x".into()
            }),
            ErrorKind::Auth
        );
        assert_eq!(
            kind(Refusal::Final {
                code: Code::PermissionDenied,
                message: "x".into()
            }),
            ErrorKind::Auth
        );
        assert_eq!(
            kind(Refusal::transient(Code::Unavailable, "x")),
            ErrorKind::Transport
        );
        let e = Refusal::Final {
            code: Code::NotFound,
            message: "no such channel".into(),
        }
        .into_error("Subscribe");
        assert_eq!(
            e.to_string(),
            "transport error: Subscribe: no such channel (NotFound)"
        );
    }
}
