//! Static's MLS engine (`static-mls`). No Python and no network here: `static-client` builds
//! the SDK's channels on it, and `static-native` (the `python/` crate) is the thin PyO3 layer.
//!
//! The product surface is [`Engine`]: one MLS client (an identity and its signature key) with
//! its groups, persisted under a data directory. Every method is safe to call from several
//! threads at once (`Engine: Send + Sync`); each group is guarded by its own mutex and every
//! state change is committed before the call returns (durably, or such that a crash of the
//! machine is detected and answered: see [`store`]).

#![forbid(unsafe_code)]

#[doc(hidden)]
pub mod bench_support;
pub mod binding;
pub mod channel_name;
pub mod crypto;
pub mod engine;
pub mod error;
pub mod outbox;
pub mod request;
pub mod store;
pub mod suite;

pub use channel_name::{validate_channel_name, CHANNEL_NAME_FORM, MAX_CHANNEL_NAME_LENGTH};
pub use engine::{
    AddMemberOutput, Applied, DirectoryKeyPackage, Engine, Incoming, LeafBinding, LogEntry, Member,
    PublicState,
};
pub use error::{
    AddMemberError, CommitError, CreateGroupError, EncryptError, Error, ErrorKind, ExportError,
    GroupLookupError, InternalError, InvalidKeyPackage, JoinError, KeyPackageError, LeaveError,
    OpenError, ProcessError, RemoveMemberError, Result,
};
pub use outbox::Outgoing;
pub use store::{Cursor, StoredCommit};
pub use suite::{
    relay_external_sender, CIPHERSUITE, PAST_EPOCHS, RELAY_SENDER_IDENTITY, WIRE_FORMAT_POLICY,
};

/// The crate version, reported by `static._native.__version__`.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
