//! The client's one error type: what a call of the SDK's core can fail with, by cause.
//!
//! Each variant names a cause (the MLS engine, the relay's refusal, an unreachable relay,
//! credentials, a closed client or channel, ...); [`Error::kind`] folds them onto the rows of
//! the error table (docs/sdk.md, Errors), which the Python binding maps to its classes in one
//! place.
//! `Display` begins with that row's prefix, as the spec requires.

use tonic::Code;

/// The rows of the error table (docs/sdk.md, Errors): what picks the Python class and the prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// `invalid channel name:`
    InvalidChannelName,
    /// `MLS engine error:`
    Mls,
    /// `transport error:`
    Transport,
    /// `auth error:`
    Auth,
    /// `runtime error:`
    Internal,
}

/// An error of the client.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// The MLS engine failed (its error says which operation, and carries its own prefix).
    #[error(transparent)]
    Mls(#[from] static_mls::Error),
    /// The group's state does not allow the call (already or no longer a member, the only
    /// member leaving, a name taken on the relay).
    #[error("MLS engine error: {0}")]
    Group(String),
    /// The relay refused the request for good (retrying would not help).
    #[error("transport error: {detail}")]
    Refused { code: Code, detail: String },
    /// The relay could not be reached, or kept failing, within the retry policy.
    #[error("transport error: {0}")]
    Unreachable(String),
    /// The API key or the relay token was refused.
    #[error("auth error: {0}")]
    Auth(String),
    /// The call's input is out of bounds (a payload over the maximum).
    #[error("transport error: {0}")]
    Invalid(String),
    /// The client or the channel was closed by us.
    #[error("runtime error: {0}")]
    Closed(String),
    /// A commit removed us from the channel (or we left it).
    #[error("MLS engine error: no longer a member of channel {0:?}")]
    Ended(String),
    /// An internal failure (a background task died, a thread could not start).
    #[error("runtime error: {0}")]
    Internal(String),
}

impl Error {
    /// The spec's row of this error.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::Mls(e) => match e.kind() {
                static_mls::ErrorKind::InvalidChannelName => ErrorKind::InvalidChannelName,
                static_mls::ErrorKind::Mls => ErrorKind::Mls,
                _ => ErrorKind::Internal,
            },
            Self::Group(_) | Self::Ended(_) => ErrorKind::Mls,
            Self::Refused { .. } | Self::Unreachable(_) | Self::Invalid(_) => ErrorKind::Transport,
            Self::Auth(_) => ErrorKind::Auth,
            Self::Closed(_) | Self::Internal(_) => ErrorKind::Internal,
        }
    }

    pub(crate) fn refused(code: Code, detail: impl Into<String>) -> Self {
        Self::Refused {
            code,
            detail: detail.into(),
        }
    }

    /// A background task or thread that failed to start or to finish.
    pub(crate) fn task(what: &str, e: impl std::fmt::Display) -> Self {
        Self::Internal(format!("{what}: {e}"))
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_error_begins_with_the_prefix_of_its_kind() {
        let prefix = |kind| match kind {
            ErrorKind::InvalidChannelName => "invalid channel name: ",
            ErrorKind::Mls => "MLS engine error: ",
            ErrorKind::Transport => "transport error: ",
            ErrorKind::Auth => "auth error: ",
            ErrorKind::Internal => "runtime error: ",
        };
        let errors = [
            Error::from(static_mls::validate_channel_name("a/b").expect_err("two components")),
            Error::Group("x".into()),
            Error::refused(Code::NotFound, "x"),
            Error::Unreachable("x".into()),
            Error::Auth("x".into()),
            Error::Invalid("x".into()),
            Error::Closed("x".into()),
            Error::Ended("a/b/c".into()),
            Error::Internal("x".into()),
        ];
        for e in errors {
            assert!(e.to_string().starts_with(prefix(e.kind())), "{e}");
        }
    }
}
