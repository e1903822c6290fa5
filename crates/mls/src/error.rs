//! The engine's errors: one enum per family of operations (as OpenMLS has one per `MlsGroup`
//! call), wrapped by the crate's [`Error`], whose [`ErrorKind`] picks the spec prefix of its
//! `Display` (and, in `static-native`, the Python class).
//!
//! Callers match the typed variants (e.g. [`EncryptError::PendingProposals`],
//! [`GroupLookupError::UnknownGroup`]), never the strings. The messages are sentences for
//! the people reading them in Python; where OpenMLS had more to say, its own words (and its
//! error's path, for debugging) come last, in brackets.

use std::fmt::{self, Debug, Display};
use std::sync::Arc;

use openmls::prelude::Ciphersuite;

use crate::store::StoreError;
use crate::suite::{CIPHERSUITE, MAX_INPUT_LEN};

/// Which subsystem failed, by the error table (docs/sdk.md, Errors): it picks the prefix of the
/// message and the Python class. The network's kinds (transport, auth) are `static-client`'s.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// `invalid channel name:` — a name not of the form `org/namespace/service`.
    InvalidChannelName,
    /// `MLS engine error:` — a protocol failure: bad key package, invalid Welcome, undecryptable
    /// or foreign message, an operation the group state does not allow.
    Mls,
    /// `runtime error:` — an internal failure: storage, locking, a library bug.
    Internal,
}

impl ErrorKind {
    /// The spec prefix every message of this kind starts with (its trailing space included).
    pub fn prefix(self) -> &'static str {
        match self {
            Self::InvalidChannelName => "invalid channel name: ",
            Self::Mls => "MLS engine error: ",
            Self::Internal => "runtime error: ",
        }
    }
}

/// An error of the engine. `Display` is the spec prefix of its [`ErrorKind`] followed by
/// [`Error::detail`].
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    #[error("invalid channel name: {0}")]
    InvalidChannelName(String),
    /// The channel's group is not here, or is here already.
    #[error("MLS engine error: {0}")]
    Lookup(#[from] GroupLookupError),
    /// [`crate::Engine::generate_key_package`].
    #[error("MLS engine error: {0}")]
    KeyPackage(#[from] KeyPackageError),
    /// [`crate::Engine::create_group`].
    #[error("MLS engine error: {0}")]
    CreateGroup(#[from] CreateGroupError),
    /// [`crate::Engine::join_group`].
    #[error("MLS engine error: {0}")]
    Join(#[from] JoinError),
    /// [`crate::Engine::add_member`], [`crate::Engine::add_members`].
    #[error("MLS engine error: {0}")]
    AddMember(#[from] AddMemberError),
    /// [`crate::Engine::remove_member`].
    #[error("MLS engine error: {0}")]
    RemoveMember(#[from] RemoveMemberError),
    /// [`crate::Engine::self_update`], [`crate::Engine::commit_pending_proposals`],
    /// [`crate::Engine::merge_pending_commit`].
    #[error("MLS engine error: {0}")]
    Commit(#[from] CommitError),
    /// [`crate::Engine::leave`].
    #[error("MLS engine error: {0}")]
    Leave(#[from] LeaveError),
    /// [`crate::Engine::public_state`], [`crate::Engine::leaf_binding`].
    #[error("MLS engine error: {0}")]
    Export(#[from] ExportError),
    /// [`crate::Engine::encrypt`], [`crate::Engine::encrypt_many`],
    /// [`crate::Engine::encrypt_many_unsynced`].
    #[error("MLS engine error: {0}")]
    Encrypt(#[from] EncryptError),
    /// [`crate::Engine::process_incoming`], each entry of [`crate::Engine::process_entries`].
    #[error("MLS engine error: {0}")]
    Process(#[from] ProcessError),
    /// [`crate::Engine::open`], beyond the store's own failures.
    #[error("runtime error: {0}")]
    Open(#[from] OpenError),
    /// The database or the data directory (locked, another identity's, I/O, SQLite).
    #[error("runtime error: {0}")]
    Store(Arc<StoreError>),
    /// A failure that is no caller's doing: a library bug, a state the store lost.
    #[error("runtime error: {0}")]
    Internal(#[from] InternalError),
}

impl Error {
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::InvalidChannelName(_) => ErrorKind::InvalidChannelName,
            Self::Lookup(_)
            | Self::KeyPackage(_)
            | Self::CreateGroup(_)
            | Self::Join(_)
            | Self::AddMember(_)
            | Self::RemoveMember(_)
            | Self::Commit(_)
            | Self::Leave(_)
            | Self::Export(_)
            | Self::Encrypt(_)
            | Self::Process(_) => ErrorKind::Mls,
            Self::Open(_) | Self::Store(_) | Self::Internal(_) => ErrorKind::Internal,
        }
    }

    /// The message without its prefix.
    pub fn detail(&self) -> String {
        let inner: &dyn Display = match self {
            Self::InvalidChannelName(d) => d,
            Self::Lookup(e) => e,
            Self::KeyPackage(e) => e,
            Self::CreateGroup(e) => e,
            Self::Join(e) => e,
            Self::AddMember(e) => e,
            Self::RemoveMember(e) => e,
            Self::Commit(e) => e,
            Self::Leave(e) => e,
            Self::Export(e) => e,
            Self::Encrypt(e) => e,
            Self::Process(e) => e,
            Self::Open(e) => e,
            Self::Store(e) => e,
            Self::Internal(e) => e,
        };
        inner.to_string()
    }

    /// Whether this is MLS refusing to encrypt until a commit covers the pending proposals.
    pub fn is_pending_proposals(&self) -> bool {
        matches!(self, Self::Encrypt(EncryptError::PendingProposals { .. }))
    }

    /// Whether the call named a channel whose group we do not have (never had, left, removed).
    pub fn is_unknown_group(&self) -> bool {
        matches!(self, Self::Lookup(GroupLookupError::UnknownGroup { .. }))
    }
}

impl From<StoreError> for Error {
    fn from(err: StoreError) -> Self {
        Self::Store(Arc::new(err))
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Finding the group of a channel: every call that names one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GroupLookupError {
    /// We have no group for this channel: never joined, left, removed, or forgotten.
    #[error("not a member of channel {channel:?}")]
    UnknownGroup { channel: String },
    /// Creating or joining a channel whose group we already have.
    #[error("already a member of channel {channel:?}")]
    AlreadyMember { channel: String },
}

/// Generating our own key package.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyPackageError {
    #[error("cannot create a key package: {detail}")]
    Create { detail: String },
}

/// Why a key package received from someone else is refused (before anything is committed).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidKeyPackage {
    #[error("it is empty")]
    Empty,
    #[error("it is too large ({len} bytes, at most {MAX_INPUT_LEN})")]
    TooLarge { len: usize },
    #[error("the MLSMessage is not a key package")]
    NotAKeyPackage,
    #[error("it is malformed: {detail}")]
    Malformed { detail: String },
    #[error("its ciphersuite {found:?} is not {CIPHERSUITE:?}")]
    Ciphersuite { found: Ciphersuite },
    /// Its `not_before` is further in the future than the engine waits out.
    #[error("it is not valid before {not_before} (now {now}, in seconds since 1970)")]
    NotValidYet { not_before: u64, now: u64 },
    /// It does not verify: bad signature, expired, unsupported capabilities...
    #[error("it does not verify: {detail}")]
    Verify { detail: String },
}

/// Creating a channel's group.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CreateGroupError {
    #[error("cannot create the group of channel {channel:?}: {detail}")]
    Create { channel: String, detail: String },
}

/// Joining a channel from a Welcome.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JoinError {
    #[error("the Welcome is empty")]
    Empty,
    #[error("the Welcome is too large ({len} bytes, at most {MAX_INPUT_LEN})")]
    TooLarge { len: usize },
    #[error("the MLSMessage is not a Welcome")]
    NotAWelcome,
    #[error("malformed Welcome: {detail}")]
    Malformed { detail: String },
    #[error("the Welcome's ciphersuite {found:?} is not {CIPHERSUITE:?}")]
    Ciphersuite { found: Ciphersuite },
    /// None of the Welcome's secrets is for one of our (unused) key packages.
    #[error(
        "this Welcome is not addressed to this client: none of its key packages are ours (it \
         was made for another agent's key package, or ours was already used)"
    )]
    NotForUs,
    /// The Welcome is for another group than the channel named.
    #[error("the Welcome is for group {group:?}, not channel {channel:?}")]
    WrongChannel { group: String, channel: String },
    #[error("invalid Welcome: {detail}")]
    Invalid { detail: String },
}

/// Adding members (a commit and its Welcome).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AddMemberError {
    #[error("no key packages to add")]
    NoKeyPackages,
    #[error("invalid key package: {0}")]
    InvalidKeyPackage(InvalidKeyPackage),
    /// The key package's signature key is already a member's (MLS allows one leaf per key).
    #[error(
        "cannot add {}: a member with this signature key is already in channel {channel:?}",
        bytes_repr(identity)
    )]
    AlreadyInGroup { identity: Vec<u8>, channel: String },
    /// Two of the key packages of one call share a signature key.
    #[error(
        "cannot add {} twice in one commit (two key packages with one signature key)",
        bytes_repr(identity)
    )]
    DuplicateKeyPackage { identity: Vec<u8> },
    /// The key package's identity (credential) is another member's, under another signature
    /// key: the relay grants a channel's access by identity, so one identity holds one leaf.
    #[error(
        "cannot add {}: a member with this identity is already in channel {channel:?} (remove \
         it first to add this key package in its place)",
        bytes_repr(identity)
    )]
    IdentityTaken { identity: Vec<u8>, channel: String },
    /// Two of the key packages of one call have one identity (under different signature keys).
    #[error(
        "cannot add {} twice in one commit (two key packages with one identity)",
        bytes_repr(identity)
    )]
    DuplicateIdentity { identity: Vec<u8> },
    /// A commit of ours is pending already: merge it or clear it first.
    #[error("a commit of ours is already pending in channel {channel:?}; merge or clear it first")]
    PendingCommit { channel: String },
    #[error("cannot add to channel {channel:?}: {detail}")]
    Commit { channel: String, detail: String },
}

/// Removing a member (a commit).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RemoveMemberError {
    #[error("{} is not a member of channel {channel:?}", bytes_repr(identity))]
    NotAMember { identity: Vec<u8>, channel: String },
    #[error("cannot remove ourselves from channel {channel:?}; leave instead")]
    RemoveSelf { channel: String },
    #[error("a commit of ours is already pending in channel {channel:?}; merge or clear it first")]
    PendingCommit { channel: String },
    #[error(
        "cannot remove {} from channel {channel:?}: {detail}",
        bytes_repr(identity)
    )]
    Commit {
        identity: Vec<u8>,
        channel: String,
        detail: String,
    },
}

/// Our other commits: a self-update, a commit of the pending proposals, merging our pending
/// commit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CommitError {
    #[error("a commit of ours is already pending in channel {channel:?}; merge or clear it first")]
    PendingCommit { channel: String },
    #[error("there is no pending commit to merge in channel {channel:?}")]
    NoPendingCommit { channel: String },
    #[error("cannot update our keys in channel {channel:?}: {detail}")]
    SelfUpdate { channel: String, detail: String },
    #[error("cannot commit the pending proposals of channel {channel:?}: {detail}")]
    PendingProposals { channel: String, detail: String },
    #[error("cannot merge our pending commit in channel {channel:?}: {detail}")]
    Merge { channel: String, detail: String },
}

/// Proposing our own removal.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LeaveError {
    #[error("cannot leave channel {channel:?}: {detail}")]
    Propose { channel: String, detail: String },
}

/// Exporting what the relay is given of a channel: its public state
/// ([`crate::Engine::public_state`]) and our leaf binding ([`crate::Engine::leaf_binding`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExportError {
    #[error("cannot export the group info of channel {channel:?}: {detail}")]
    GroupInfo { channel: String, detail: String },
    /// Our own leaf is not in the tree (no group we hold should be like this).
    #[error("our leaf is missing from the tree of channel {channel:?}")]
    NoOwnLeaf { channel: String },
}

/// Encrypting application messages.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EncryptError {
    #[error("payload too large ({len} bytes, at most {MAX_INPUT_LEN})")]
    PayloadTooLarge { len: usize },
    /// MLS forbids application messages while proposals are pending: a commit covering them
    /// (ours, [`crate::Engine::commit_pending_proposals`], or another member's) comes first.
    #[error(
        "cannot encrypt in channel {channel:?} while proposals are pending: a commit must cover \
         them first"
    )]
    PendingProposals { channel: String },
    /// The machine went down while the engine was open (see [`crate::Engine::open`]).
    #[error(
        "cannot encrypt in channel {channel:?} before a commit of ours: the machine went down \
         while it was open, so messages it sent at this epoch may be unknown to it (rotate_keys \
         moves the channel to a new epoch)"
    )]
    FreshEpochNeeded { channel: String },
    #[error("cannot encrypt in channel {channel:?}: {detail}")]
    Create { channel: String, detail: String },
}

/// Processing one message of the channel's log. The entry is skipped; the group is unchanged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProcessError {
    #[error("the message is empty")]
    Empty,
    #[error("the message is too large ({len} bytes, at most {MAX_INPUT_LEN})")]
    TooLarge { len: usize },
    #[error("malformed MLS message: {detail}")]
    Malformed { detail: String },
    #[error("the MLSMessage is not a PublicMessage or PrivateMessage")]
    NotProtocolMessage,
    #[error("the message belongs to group {group:?}, not channel {channel:?}")]
    WrongGroup { group: String, channel: String },
    /// Refused by MLS: not decryptable for us (from before we joined, or a replay), a bad
    /// signature, a commit that does not apply...
    #[error("cannot process the message: {detail}")]
    Invalid { detail: String },
    #[error("external join proposals are not accepted")]
    ExternalJoinProposal,
    #[error("our own commit came back but it is not our pending commit")]
    UnknownOwnCommit,
    #[error("cannot merge the commit: {detail}")]
    Merge { detail: String },
    #[error("cannot merge our pending commit: {detail}")]
    MergeOwn { detail: String },
    #[error("unsupported message content")]
    Unsupported,
}

/// Opening the engine, beyond the store's failures ([`Error::Store`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OpenError {
    #[error("identity must not be empty")]
    EmptyIdentity,
    #[error("the stored signature key is missing")]
    MissingSignatureKey,
    #[error("the stored signature key is unusable: {detail}")]
    BadSignatureKey { detail: String },
    #[error("cannot generate a signature key: {detail}")]
    KeyGeneration { detail: String },
}

/// Failures that are no caller's doing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InternalError {
    #[error("cannot serialize an MLS message: {detail}")]
    Serialize { detail: String },
    #[error("cannot store the message secrets: {detail}")]
    StoreMessageSecrets { detail: String },
    #[error("the state of group {channel:?} is missing from the store")]
    MissingGroupState { channel: String },
    #[error("cannot reload group {channel:?} after a failure: {detail}")]
    Reload { channel: String, detail: String },
    #[error("panic while {what}")]
    Panic { what: &'static str },
    /// The crypto provider could not give random bytes or a hash (request/reply's ids).
    #[error("the crypto provider failed: {detail}")]
    Crypto { detail: String },
    /// A measurement of `bench_support` could not be set up.
    #[error("benchmark setup failed: {detail}")]
    Bench { detail: String },
}

/// What OpenMLS said, in its words and then its error's path (for debugging), once where
/// they are the same.
pub(crate) fn openmls_detail(err: &(impl Display + Debug)) -> String {
    let (words, path) = (err.to_string(), format!("{err:?}"));
    if words == path {
        format!("[openmls: {path}]")
    } else {
        format!("{words} [openmls: {path}]")
    }
}

/// Why bytes did not decode as the TLS structure expected.
pub(crate) fn decode_detail(err: &impl Debug) -> String {
    format!("the bytes do not decode [tls_codec: {err:?}]")
}

/// `bytes` as Python's `repr` shows them (`b'alice'`): identities are bytes in the SDK.
pub fn bytes_repr(bytes: &[u8]) -> String {
    struct Repr<'a>(&'a [u8]);
    impl Display for Repr<'_> {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            // Python quotes with `"` when that avoids escaping a `'`.
            let quote = if self.0.contains(&b'\'') && !self.0.contains(&b'"') {
                '"'
            } else {
                '\''
            };
            write!(f, "b{quote}")?;
            for &b in self.0 {
                match b {
                    b'\\' => f.write_str("\\\\")?,
                    b'\t' => f.write_str("\\t")?,
                    b'\n' => f.write_str("\\n")?,
                    b'\r' => f.write_str("\\r")?,
                    _ if char::from(b) == quote => write!(f, "\\{quote}")?,
                    0x20..=0x7e => write!(f, "{}", char::from(b))?,
                    _ => write!(f, "\\x{b:02x}")?,
                }
            }
            write!(f, "{quote}")
        }
    }
    Repr(bytes).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_is_the_kind_prefix_then_the_detail() {
        let errors: Vec<Error> = vec![
            Error::InvalidChannelName("'x'".into()),
            GroupLookupError::UnknownGroup {
                channel: "a/b/c".into(),
            }
            .into(),
            EncryptError::PayloadTooLarge { len: 1 }.into(),
            AddMemberError::IdentityTaken {
                identity: b"bob".to_vec(),
                channel: "a/b/c".into(),
            }
            .into(),
            ExportError::NoOwnLeaf {
                channel: "a/b/c".into(),
            }
            .into(),
            StoreError::Panic("boom".into()).into(),
            InternalError::Panic { what: "testing" }.into(),
            OpenError::EmptyIdentity.into(),
        ];
        for err in errors {
            assert_eq!(
                err.to_string(),
                format!("{}{}", err.kind().prefix(), err.detail())
            );
        }
    }

    #[test]
    fn bytes_repr_is_pythons() {
        assert_eq!(bytes_repr(b"alice"), "b'alice'");
        assert_eq!(bytes_repr(b"it's"), "b\"it's\"");
        assert_eq!(bytes_repr(b"'\""), "b'\\'\"'");
        assert_eq!(bytes_repr(b"a\\b\n\x00\xff"), "b'a\\\\b\\n\\x00\\xff'");
    }
}
