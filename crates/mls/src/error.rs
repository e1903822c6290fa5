//! The one error type of the core. Its [`ErrorKind`] picks the Python class (and the spec
//! prefix) in exactly one place, the `From<Error> for PyErr` of `static-native`.

/// What went wrong, by the subsystem named in the spec's error table (SPEC §7).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// `invalid channel name:` — a name not of the form `org/namespace/service`.
    InvalidChannelName,
    /// `MLS engine error:` — a protocol failure: bad key package, invalid Welcome, undecryptable
    /// or foreign message, an operation the group state does not allow.
    Mls,
    /// `transport error:` — the relay is unreachable, a gRPC call failed, or the relay refused
    /// a request for a reason other than authentication.
    Transport,
    /// `auth error:` — the API key is invalid, revoked or expired, or the relay refused the token.
    Auth,
    /// `runtime error:` — an internal failure: storage, locking, a library bug.
    Internal,
}

/// An error of the core. `Display` starts with the spec prefix of its kind.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    #[error("invalid channel name: {0}")]
    InvalidChannelName(String),
    #[error("MLS engine error: {0}")]
    Mls(String),
    #[error("transport error: {0}")]
    Transport(String),
    #[error("auth error: {0}")]
    Auth(String),
    #[error("runtime error: {0}")]
    Internal(String),
}

impl Error {
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::InvalidChannelName(_) => ErrorKind::InvalidChannelName,
            Self::Mls(_) => ErrorKind::Mls,
            Self::Transport(_) => ErrorKind::Transport,
            Self::Auth(_) => ErrorKind::Auth,
            Self::Internal(_) => ErrorKind::Internal,
        }
    }

    /// The message without its prefix.
    pub fn detail(&self) -> &str {
        match self {
            Self::InvalidChannelName(d)
            | Self::Mls(d)
            | Self::Transport(d)
            | Self::Auth(d)
            | Self::Internal(d) => d,
        }
    }

    pub(crate) fn mls(context: &str, err: impl std::fmt::Debug) -> Self {
        Self::Mls(format!("{context}: {err:?}"))
    }
}

impl From<crate::store::StoreError> for Error {
    fn from(err: crate::store::StoreError) -> Self {
        Self::Internal(err.to_string())
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
