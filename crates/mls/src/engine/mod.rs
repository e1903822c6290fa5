//! The MLS engine: one client identity, its signature key and its groups (one per channel).
//!
//! Every public method is one durable, atomic step (one SQLite transaction, see
//! [`crate::store`]). Groups are guarded by one mutex each; the database connection by another,
//! always taken after the group's, so calls on different groups never deadlock.
//!
//! Commit flow (RFC 9420 needs one agreed order of commits; the relay gives it): a method that
//! creates a commit ([`Engine::add_member`], [`Engine::self_update`], [`Engine::remove_member`],
//! [`Engine::commit_pending_proposals`]) leaves it *pending*. The caller publishes it; if the
//! relay accepts it the caller calls [`Engine::merge_pending_commit`] (or simply processes the
//! echo of it from the log, which merges it), else [`Engine::clear_pending_commit`], processes
//! the winning commit and retries. Incoming messages are handed to
//! [`Engine::process_incoming`] in log order.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use openmls::prelude::tls_codec::{Deserialize as TlsDeserialize, Serialize as TlsSerialize};
use openmls::prelude::*;
use openmls::treesync::errors::LifetimeError;
use openmls_basic_credential::SignatureKeyPair;

use crate::channel_name::validate_channel_name;
use crate::crypto::{Ed25519Signer, StaticCrypto};
use crate::error::{
    decode_detail, openmls_detail, AddMemberError, CommitError, CreateGroupError, EncryptError,
    Error, ExportError, GroupLookupError, InternalError, InvalidKeyPackage, JoinError,
    KeyPackageError, LeaveError, OpenError, ProcessError, RemoveMemberError, Result,
};
use crate::storage::Scope;
use crate::store::{self, Cursor, Db, ExecCached as _, InboxMessage, StoreError};
use crate::suite::{
    CIPHERSUITE, MAX_INPUT_LEN, MAX_KEY_PACKAGE_SKEW, PAST_EPOCHS, WIRE_FORMAT_POLICY,
};

mod outbox;

/// The OpenMLS provider of every engine call.
type Provider<'a> = store::Provider<'a, StaticCrypto>;

/// A member of a group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    /// The member's leaf index in the ratchet tree.
    pub index: u32,
    /// The `identity` bytes of its basic credential.
    pub identity: Vec<u8>,
}

/// The result of [`Engine::add_member`]: a pending commit to publish and the Welcome for the
/// joiner (valid once the commit is accepted). Both are TLS-serialized `MLSMessage`s.
#[derive(Debug, Clone)]
pub struct AddMemberOutput {
    pub commit: Vec<u8>,
    pub welcome: Vec<u8>,
}

/// What the relay keeps of a channel to validate its handshakes (RFC 9750): built by it with
/// OpenMLS's `PublicGroup::from_external` from these two, each TLS-serialized.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublicState {
    /// An `MLSMessage` (wire format `group_info`) signed by our leaf, with the ratchet tree
    /// (and the external public key) in its extensions.
    pub group_info: Vec<u8>,
    /// The ratchet tree (`RatchetTree`, read back as `RatchetTreeIn`).
    pub ratchet_tree: Vec<u8>,
}

/// Our proof, for the relay, that the holder of our leaf's signature key acts for an account
/// (see [`crate::binding`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeafBinding {
    /// Our leaf's index in the ratchet tree.
    pub leaf_index: u32,
    /// Ed25519 over [`crate::binding::leaf_binding_tbs`].
    pub signature: Vec<u8>,
}

/// What [`Engine::process_incoming`] did with one message of the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Incoming {
    /// An application message of another member, decrypted.
    Application {
        sender: Vec<u8>,
        payload: Vec<u8>,
        epoch: u64,
    },
    /// Another member's commit, merged; `epoch` is the new epoch.
    Commit { sender: Option<Vec<u8>>, epoch: u64 },
    /// Our own pending commit echoed by the relay: merged; `epoch` is the new epoch.
    OwnCommit { epoch: u64 },
    /// A commit that removed us: the group's local state is deleted; `members` is the roster
    /// that commit left (without us), which the channel keeps to say so.
    Removed { epoch: u64, members: Vec<Member> },
    /// A proposal of another member, stored until a commit covers it.
    Proposal { sender: Option<Vec<u8>> },
    /// Our own application message or proposal echoed by the relay: recognised and skipped.
    Own,
}

/// The group's members, by leaf index.
fn members_of(group: &MlsGroup) -> Vec<Member> {
    group
        .members()
        .map(|m| Member {
            index: m.index.u32(),
            identity: identity_of(&m.credential).unwrap_or_default(),
        })
        .collect()
}

struct GroupSlot {
    /// `None` once the group is gone (we left or were removed).
    group: Option<MlsGroup>,
}

/// One entry of the relay's log, as [`Engine::process_entries`] takes it.
#[derive(Debug, Clone, Copy)]
pub struct LogEntry<'a> {
    pub seq: u64,
    pub message: &'a [u8],
    /// The account that published it, as the relay attests it (kept with an application
    /// message in the inbox); None when the relay did not say.
    pub account: Option<&'a str>,
}

impl<'a> LogEntry<'a> {
    /// An entry without the publishing account.
    pub fn new(seq: u64, message: &'a [u8]) -> Self {
        LogEntry {
            seq,
            message,
            account: None,
        }
    }
}

/// The outcome of one entry of [`Engine::process_entries`].
#[derive(Debug)]
pub struct Applied {
    pub seq: u64,
    pub outcome: Result<Incoming>,
    /// The inbox row an application message was stored in: lets a reader of the inbox take
    /// what was just applied without reading it back (see `static-client`).
    pub inbox_id: Option<i64>,
}

/// One MLS client over a data directory. `Send + Sync`; see the module docs.
pub struct Engine {
    identity: Vec<u8>,
    crypto: StaticCrypto,
    signer: Ed25519Signer,
    credential: CredentialWithKey,
    db: Mutex<Db>,
    groups: Mutex<HashMap<String, Arc<Mutex<GroupSlot>>>>,
    data_dir: PathBuf,
    /// The kernel's boot id at opening; `None` where the system has none. See
    /// [`Engine::sync_before_send`].
    boot_id: Option<String>,
    /// Whether some group must move to a new epoch before we encrypt in it (see
    /// [`Engine::open`]); when false (nearly always) encrypting does not look.
    fresh_epochs_needed: AtomicBool,
}

/// Where Linux keeps the id of the running boot (a new random one at every boot).
const BOOT_ID_FILE: &str = "/proc/sys/kernel/random/boot_id";

/// Overrides the boot id, for tests that simulate a machine restart.
pub const BOOT_ID_ENV: &str = "STATIC_TEST_BOOT_ID";

/// The id of the running boot of the machine, `None` when the system does not say.
fn current_boot_id() -> Option<String> {
    std::env::var(BOOT_ID_ENV)
        .ok()
        .or_else(|| std::fs::read_to_string(BOOT_ID_FILE).ok())
        .map(|id| id.trim().to_owned())
        .filter(|id| !id.is_empty())
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Nothing panics while holding these locks on purpose; if something did, the state behind
    // the lock is still the last committed one (memory is reloaded on error), so carry on.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn serialize(msg: &MlsMessageOut) -> Result<Vec<u8>> {
    msg.tls_serialize_detached().map_err(|e| {
        InternalError::Serialize {
            detail: openmls_detail(&e),
        }
        .into()
    })
}

/// Refuses empty and oversized inputs with the caller's error for each.
fn check_len<E>(bytes: &[u8], empty: E, too_large: impl FnOnce(usize) -> E) -> Result<(), E> {
    if bytes.is_empty() {
        return Err(empty);
    }
    if bytes.len() > MAX_INPUT_LEN {
        return Err(too_large(bytes.len()));
    }
    Ok(())
}

fn identity_of(credential: &Credential) -> Option<Vec<u8>> {
    BasicCredential::try_from(credential.clone())
        .ok()
        .map(|c| c.identity().to_vec())
}

fn group_id_of(channel: &str) -> GroupId {
    GroupId::from_slice(channel.as_bytes())
}

fn create_config() -> MlsGroupCreateConfig {
    MlsGroupCreateConfig::builder()
        .ciphersuite(CIPHERSUITE)
        .use_ratchet_tree_extension(true)
        .max_past_epochs(PAST_EPOCHS)
        .wire_format_policy(WIRE_FORMAT_POLICY)
        .build()
}

/// The configuration of every group of ours: also what [`create_config`] gives a new group.
fn join_config() -> MlsGroupJoinConfig {
    MlsGroupJoinConfig::builder()
        .use_ratchet_tree_extension(true)
        .max_past_epochs(PAST_EPOCHS)
        .wire_format_policy(WIRE_FORMAT_POLICY)
        .build()
}

/// Moves a group stored by an earlier version (handshakes sent encrypted) to
/// [`WIRE_FORMAT_POLICY`], persisted. Such groups were made with [`join_config`] but for the
/// policy (the engine's configuration has been otherwise unchanged), so they get it whole.
fn migrate_wire_format(group: &mut MlsGroup, provider: &Provider<'_>) -> Result<()> {
    if group.configuration().wire_format_policy() == WIRE_FORMAT_POLICY {
        return Ok(());
    }
    group
        .set_configuration(provider.storage(), &join_config())
        .map_err(StoreError::from)?;
    Ok(())
}

/// Parses a key package sent as an `MLSMessage` or as a bare `KeyPackage`.
fn parse_key_package(bytes: &[u8]) -> Result<KeyPackageIn, InvalidKeyPackage> {
    if let Ok(msg) = MlsMessageIn::tls_deserialize_exact(bytes) {
        return match msg.extract() {
            MlsMessageBodyIn::KeyPackage(kp) => Ok(kp),
            _ => Err(InvalidKeyPackage::NotAKeyPackage),
        };
    }
    KeyPackageIn::tls_deserialize_exact(bytes).map_err(|e| InvalidKeyPackage::Malformed {
        detail: decode_detail(&e),
    })
}

fn missing_group_state(channel: &str) -> Error {
    InternalError::MissingGroupState {
        channel: channel.to_owned(),
    }
    .into()
}

/// Whether OpenMLS refused because a commit of ours is pending.
fn is_pending_commit(state: &MlsGroupStateError) -> bool {
    matches!(state, MlsGroupStateError::PendingCommit)
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Parses and validates a key package of our ciphersuite. A `not_before` at most
/// [`MAX_KEY_PACKAGE_SKEW`] in the future is waited out (OpenMLS requires it in the past).
fn validate_key_package(crypto: &StaticCrypto, bytes: &[u8]) -> Result<KeyPackage> {
    let invalid = |reason| Error::from(AddMemberError::InvalidKeyPackage(reason));
    check_len(bytes, InvalidKeyPackage::Empty, |len| {
        InvalidKeyPackage::TooLarge { len }
    })
    .map_err(invalid)?;
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        validate_key_package_inner(crypto, bytes).map_err(invalid)
    }))
    .unwrap_or_else(|_| {
        Err(InternalError::Panic {
            what: "validating a key package",
        }
        .into())
    })
}

fn validate_key_package_inner(
    crypto: &StaticCrypto,
    bytes: &[u8],
) -> Result<KeyPackage, InvalidKeyPackage> {
    let mut waited = false;
    loop {
        let kp_in = parse_key_package(bytes)?;
        match kp_in.validate(crypto, ProtocolVersion::Mls10) {
            Ok(kp) => {
                if kp.ciphersuite() != CIPHERSUITE {
                    return Err(InvalidKeyPackage::Ciphersuite {
                        found: kp.ciphersuite(),
                    });
                }
                return Ok(kp);
            }
            Err(KeyPackageVerifyError::LifetimeError(LifetimeError::NotValidYet {
                not_before,
                ..
            })) if !waited => {
                let ahead = not_before.saturating_sub(now_secs());
                if Duration::from_secs(ahead) > MAX_KEY_PACKAGE_SKEW {
                    return Err(InvalidKeyPackage::NotValidYet {
                        not_before,
                        now: now_secs(),
                    });
                }
                // Sleep until the second `not_before` has fully begun.
                let target = UNIX_EPOCH + Duration::from_secs(not_before);
                if let Ok(d) = target.duration_since(SystemTime::now()) {
                    std::thread::sleep(d + Duration::from_millis(5));
                }
                waited = true;
            }
            Err(e) => {
                return Err(InvalidKeyPackage::Verify {
                    detail: openmls_detail(&e),
                })
            }
        }
    }
}

/// The identity in a key package's basic credential (empty if it has none).
fn key_package_identity(kp: &KeyPackage) -> Vec<u8> {
    identity_of(kp.leaf_node().credential()).unwrap_or_default()
}

/// Refuses, before OpenMLS does in its own words, to add a signature key that is already a
/// member's, or twice in one commit (MLS allows one leaf per signature key); and, which MLS
/// allows but the relay's access rule does not (one identity, one leaf), an identity
/// (credential) that is already a member's or twice in one commit.
fn refuse_members_twice(
    group: &MlsGroup,
    channel: &str,
    key_packages: &[KeyPackage],
) -> Result<(), AddMemberError> {
    let members: Vec<openmls::group::Member> = group.members().collect();
    for (i, kp) in key_packages.iter().enumerate() {
        let leaf = kp.leaf_node();
        let key = leaf.signature_key().as_slice();
        let earlier = &key_packages[..i];
        if members.iter().any(|m| m.signature_key.as_slice() == key) {
            return Err(AddMemberError::AlreadyInGroup {
                identity: key_package_identity(kp),
                channel: channel.to_owned(),
            });
        }
        if earlier
            .iter()
            .any(|other| other.leaf_node().signature_key().as_slice() == key)
        {
            return Err(AddMemberError::DuplicateKeyPackage {
                identity: key_package_identity(kp),
            });
        }
        // Credentials compared whole (type and content): the identity as the relay sees it.
        if members.iter().any(|m| &m.credential == leaf.credential()) {
            return Err(AddMemberError::IdentityTaken {
                identity: key_package_identity(kp),
                channel: channel.to_owned(),
            });
        }
        if earlier
            .iter()
            .any(|other| other.leaf_node().credential() == leaf.credential())
        {
            return Err(AddMemberError::DuplicateIdentity {
                identity: key_package_identity(kp),
            });
        }
    }
    Ok(())
}

/// Why a Welcome is refused, in words: above all, a Welcome for someone else's key package.
fn welcome_error<S: std::fmt::Debug + std::fmt::Display>(err: WelcomeError<S>) -> JoinError {
    match err {
        WelcomeError::NoMatchingKeyPackage => JoinError::NotForUs,
        err => JoinError::Invalid {
            detail: openmls_detail(&err),
        },
    }
}

fn check_payload(payload: &[u8]) -> Result<(), EncryptError> {
    if payload.len() > MAX_INPUT_LEN {
        return Err(EncryptError::PayloadTooLarge { len: payload.len() });
    }
    Ok(())
}

/// One application message, serialized.
fn create_message(
    group: &mut MlsGroup,
    provider: &Provider<'_>,
    signer: &Ed25519Signer,
    channel: &str,
    payload: &[u8],
) -> Result<Vec<u8>> {
    // Encrypting advances our ratchet of the current epoch and nothing else (OpenMLS's
    // `encrypt` takes `message_secrets_mut()`): the past epochs' part is not rewritten.
    let _scope = provider.storage().scoped(Scope::CurrentEpoch);
    let msg = group
        .create_message(provider, signer, payload)
        .map_err(|e| match e {
            CreateMessageError::GroupStateError(MlsGroupStateError::PendingProposal) => {
                EncryptError::PendingProposals {
                    channel: channel.to_owned(),
                }
            }
            e => EncryptError::Create {
                channel: channel.to_owned(),
                detail: openmls_detail(&e),
            },
        })?;
    serialize(&msg)
}

fn unknown_group(channel: &str) -> Error {
    GroupLookupError::UnknownGroup {
        channel: channel.to_owned(),
    }
    .into()
}

/// A protocol message (PublicMessage or PrivateMessage) parsed from an `MLSMessage`.
fn parse_protocol_message(bytes: &[u8]) -> Result<ProtocolMessage, ProcessError> {
    check_len(bytes, ProcessError::Empty, |len| ProcessError::TooLarge {
        len,
    })?;
    std::panic::catch_unwind(|| parse_protocol_message_inner(bytes)).unwrap_or_else(|_| {
        Err(ProcessError::Malformed {
            detail: "the decoder panicked".into(),
        })
    })
}

fn parse_protocol_message_inner(bytes: &[u8]) -> Result<ProtocolMessage, ProcessError> {
    let msg = MlsMessageIn::tls_deserialize_exact(bytes).map_err(|e| ProcessError::Malformed {
        detail: decode_detail(&e),
    })?;
    msg.try_into_protocol_message()
        .map_err(|_| ProcessError::NotProtocolMessage)
}

fn changes_epoch(incoming: &Incoming) -> bool {
    matches!(
        incoming,
        Incoming::Commit { .. } | Incoming::OwnCommit { .. } | Incoming::Removed { .. }
    )
}

/// Parses a protocol message and checks it belongs to `channel`.
fn parse_for_channel(channel: &str, message: &[u8]) -> Result<ProtocolMessage> {
    let protocol = parse_protocol_message(message)?;
    if protocol.group_id().as_slice() != channel.as_bytes() {
        return Err(ProcessError::WrongGroup {
            group: String::from_utf8_lossy(protocol.group_id().as_slice()).into_owned(),
            channel: channel.to_owned(),
        }
        .into());
    }
    Ok(protocol)
}

/// Applies one message of the log to the group inside the caller's transaction.
fn apply_message(
    channel: &str,
    group: &mut MlsGroup,
    provider: &Provider<'_>,
    conn: &rusqlite::Connection,
    protocol: ProtocolMessage,
    message: &[u8],
) -> Result<Incoming> {
    let is_commit = protocol.content_type() == ContentType::Commit;
    if is_commit {
        let pending = store::pending_commit(conn, channel)?;
        if pending.as_deref() == Some(message) && group.pending_commit().is_some() {
            // Our own commit, accepted by the relay and echoed back.
            group
                .merge_pending_commit(provider)
                .map_err(|e| ProcessError::MergeOwn {
                    detail: openmls_detail(&e),
                })?;
            store::own_commit_merged(conn, channel)?;
            return Ok(Incoming::OwnCommit {
                epoch: group.epoch().as_u64(),
            });
        }
        if group.pending_commit().is_some() && protocol.epoch() == group.epoch() {
            // Another member's commit won this epoch: ours is void.
            group
                .clear_pending_commit(provider.storage())
                .map_err(StoreError::from)?;
            store::clear_pending_commit(conn, channel)?;
        }
    }
    // An application message of the current epoch (or a later one, which OpenMLS decrypts
    // with the current secrets, and refuses) changes only the current epoch's secrets: the
    // past epochs' part is not rewritten. Anything else may change anything.
    let scope = if protocol.content_type() == ContentType::Application
        && protocol.epoch() >= group.epoch()
    {
        Scope::CurrentEpoch
    } else {
        Scope::All
    };
    let scoped = provider.storage().scoped(scope);
    let processed = group.process_message(provider, protocol);
    drop(scoped);
    let processed = processed.map_err(|e| match e {
        // Our own commit as a PublicMessage (readable to us, unlike our PrivateMessages)
        // that is not the pending one: said as for the encrypted kind.
        ProcessMessageError::InvalidCommit(StageCommitError::OwnCommitMismatch) => {
            ProcessError::UnknownOwnCommit
        }
        e => ProcessError::Invalid {
            detail: openmls_detail(&e),
        },
    })?;
    let epoch = processed.epoch().as_u64();
    let sender = identity_of(processed.credential());
    let from_us = processed.sender() == &Sender::Member(group.own_leaf_index());
    match processed.into_content() {
        ProcessedMessageContent::ApplicationMessage(app) => Ok(Incoming::Application {
            sender: sender.unwrap_or_default(),
            payload: app.into_bytes(),
            epoch,
        }),
        ProcessedMessageContent::ProposalMessage(proposal) => {
            // Our own proposals (now PublicMessages, so verified like anyone's) are in the
            // store since we made them; storing again is a no-op (keyed by reference).
            group
                .store_pending_proposal(provider.storage(), *proposal)
                .map_err(StoreError::from)?;
            if from_us {
                Ok(Incoming::Own)
            } else {
                Ok(Incoming::Proposal { sender })
            }
        }
        ProcessedMessageContent::ExternalJoinProposalMessage(_) => {
            Err(ProcessError::ExternalJoinProposal.into())
        }
        ProcessedMessageContent::StagedCommitMessage(staged) => {
            let self_removed = staged.self_removed();
            group
                .merge_staged_commit(provider, *staged)
                .map_err(|e| ProcessError::Merge {
                    detail: openmls_detail(&e),
                })?;
            let epoch = group.epoch().as_u64();
            if self_removed || !group.is_active() {
                let members = members_of(group);
                group.delete(provider.storage()).map_err(StoreError::from)?;
                store::delete_group(conn, channel)?;
                Ok(Incoming::Removed { epoch, members })
            } else {
                Ok(Incoming::Commit { sender, epoch })
            }
        }
        ProcessedMessageContent::OwnPendingCommit => {
            group
                .merge_pending_commit(provider)
                .map_err(|e| ProcessError::MergeOwn {
                    detail: openmls_detail(&e),
                })?;
            store::own_commit_merged(conn, channel)?;
            Ok(Incoming::OwnCommit {
                epoch: group.epoch().as_u64(),
            })
        }
        ProcessedMessageContent::OwnPrivateMessage if is_commit => {
            Err(ProcessError::UnknownOwnCommit.into())
        }
        ProcessedMessageContent::OwnPrivateMessage => Ok(Incoming::Own),
        #[allow(unreachable_patterns)]
        _ => Err(ProcessError::Unsupported.into()),
    }
}

/// Writes the group's message secrets if their write was deferred (see `crate::storage`).
fn write_deferred_message_secrets(group: &mut MlsGroup, provider: &Provider<'_>) -> Result<()> {
    if let Some(scope) = provider.storage().end_deferral() {
        // OpenMLS has no "store the message secrets" call; setting the (unchanged) past-epoch
        // policy writes them, and the join config, as they are in memory (in the widest scope
        // of the writes deferred: the policy itself is unchanged).
        let _scope = provider.storage().scoped(scope);
        let policy = group.past_epoch_deletion_policy().clone();
        group
            .set_past_epoch_deletion_policy(provider, policy)
            .map_err(|e| InternalError::StoreMessageSecrets {
                detail: openmls_detail(&e),
            })?;
    }
    Ok(())
}

/// Stores a decrypted application message in the inbox (with the state change that
/// decrypted it: MLS deletes the key once used); its inbox row id, `None` for anything else.
fn keep_for_caller(
    conn: &rusqlite::Connection,
    channel: &str,
    entry: &LogEntry<'_>,
    incoming: &Incoming,
) -> Result<Option<i64>> {
    let Incoming::Application {
        sender,
        payload,
        epoch,
    } = incoming
    else {
        return Ok(None);
    };
    let message = store::InboxMessage {
        id: 0,
        seq: entry.seq,
        sender: sender.clone(),
        payload: payload.clone(),
        epoch: *epoch,
        account: entry.account.map(str::to_owned),
    };
    store::inbox_push(conn, channel, &message)?;
    Ok(Some(conn.last_insert_rowid()))
}

/// What [`apply_entries_fast`] did.
struct FastBatch {
    applied: Vec<Applied>,
    removed: bool,
    epoch_changed: bool,
}

/// The common case of [`Engine::process_entries`]: every entry applies. Without a savepoint
/// per entry, with the message secrets written once (deferred), and the cursor set once.
/// If an entry fails, everything this did is rolled back, the group reloaded, and `None`
/// returned: the caller then goes entry by entry (a failed entry is skipped there, and its
/// partial effects undone, which needs each entry's state on disk).
fn apply_entries_fast(
    channel: &str,
    group: &mut MlsGroup,
    provider: &Provider<'_>,
    conn: &rusqlite::Connection,
    entries: &[LogEntry<'_>],
) -> Result<Option<FastBatch>> {
    conn.exec_cached("SAVEPOINT batch")
        .map_err(StoreError::from)?;
    if entries.len() > 1 {
        provider.storage().defer_message_secrets();
    }
    let mut batch = FastBatch {
        applied: Vec::with_capacity(entries.len()),
        removed: false,
        epoch_changed: false,
    };
    let mut last = None;
    let mut failed = false;
    for entry in entries {
        let (seq, message) = (entry.seq, entry.message);
        let outcome = parse_for_channel(channel, message)
            .and_then(|protocol| apply_message(channel, group, provider, conn, protocol, message));
        match outcome {
            Ok(incoming) => {
                let inbox_id = keep_for_caller(conn, channel, entry, &incoming)?;
                batch.removed = matches!(incoming, Incoming::Removed { .. });
                batch.epoch_changed |= changes_epoch(&incoming);
                last = Some(seq);
                batch.applied.push(Applied {
                    seq,
                    outcome: Ok(incoming),
                    inbox_id,
                });
                if batch.removed {
                    break;
                }
            }
            Err(err) if err.kind() == crate::ErrorKind::Internal => return Err(err),
            Err(_) => {
                failed = true;
                break;
            }
        }
    }
    if failed {
        // Nothing owed any more: the deferred writes are rolled back with the rest.
        provider.storage().end_deferral();
        conn.execute_batch("ROLLBACK TO batch; RELEASE batch")
            .map_err(StoreError::from)?;
        *group = MlsGroup::load(provider.storage(), &group_id_of(channel))
            .map_err(StoreError::from)?
            .ok_or_else(|| missing_group_state(channel))?;
        return Ok(None);
    }
    if !batch.removed {
        write_deferred_message_secrets(group, provider)?;
        if let Some(seq) = last {
            store::set_cursor(conn, channel, Cursor::After(seq))?;
        }
    }
    conn.exec_cached("RELEASE batch")
        .map_err(StoreError::from)?;
    Ok(Some(batch))
}

impl Engine {
    /// Opens (or creates) the engine of `identity` under `data_dir`. The directory is locked
    /// for the life of the engine; a data_dir created for another identity is refused.
    ///
    /// Sends skip the disk sync where the machine has a boot id (see
    /// [`Engine::sync_before_send`]). In exchange, the opening records the boot id and, on a
    /// clean close, that every commit is on disk; opening after the machine went down while
    /// the engine was open (another boot id, not closed cleanly) means sends that were not on
    /// disk yet may be lost, which would make encrypting again reuse their generations' keys and
    /// nonces: every group is then marked to need a commit of ours (a new epoch, fresh secrets)
    /// before we encrypt in it again.
    pub fn open(data_dir: impl AsRef<Path>, identity: &[u8]) -> Result<Self> {
        Self::open_with_boot_id(data_dir, identity, current_boot_id())
    }

    /// [`Engine::open`] as if the machine's boot id were `boot_id` (tests simulate restarts).
    #[doc(hidden)]
    pub fn open_with_boot_id(
        data_dir: impl AsRef<Path>,
        identity: &[u8],
        boot_id: Option<String>,
    ) -> Result<Self> {
        let data_dir = data_dir.as_ref().to_owned();
        if identity.is_empty() {
            return Err(OpenError::EmptyIdentity.into());
        }
        let db = Db::open(&data_dir)?;
        let crypto = StaticCrypto::default();
        let opened = db.transaction(|conn| -> Result<_> {
            let provider = Provider::new(&crypto, conn);
            let signer =
                match store::read_identity(conn)? {
                    Some((stored, public)) => {
                        if stored != identity {
                            return Err(StoreError::WrongIdentity {
                                path: data_dir.clone(),
                                stored: String::from_utf8_lossy(&stored).into_owned(),
                                requested: String::from_utf8_lossy(identity).into_owned(),
                            }
                            .into());
                        }
                        SignatureKeyPair::read(
                            provider.storage(),
                            &public,
                            CIPHERSUITE.signature_algorithm(),
                        )
                        .ok_or(OpenError::MissingSignatureKey)?
                    }
                    None => {
                        let signer = SignatureKeyPair::new(CIPHERSUITE.signature_algorithm())
                            .map_err(|e| OpenError::KeyGeneration {
                                detail: openmls_detail(&e),
                            })?;
                        signer.store(provider.storage()).map_err(StoreError::from)?;
                        store::write_identity(conn, identity, signer.public())?;
                        signer
                    }
                };
            let mut groups = HashMap::new();
            for name in store::group_names(conn)? {
                let mut group = MlsGroup::load(provider.storage(), &group_id_of(&name))
                    .map_err(StoreError::from)?
                    .ok_or_else(|| missing_group_state(&name))?;
                migrate_wire_format(&mut group, &provider)?;
                groups.insert(name, Arc::new(Mutex::new(GroupSlot { group: Some(group) })));
            }
            let signer =
                Ed25519Signer::from_key_pair(&signer).map_err(|e| OpenError::BadSignatureKey {
                    detail: e.to_string(),
                })?;
            // Committed durably (like all of this transaction) before any send of this opening.
            let sends_lost = match store::read_session(conn)? {
                Some((Some(previous), false)) => boot_id.as_deref() != Some(previous.as_str()),
                _ => false,
            };
            if sends_lost {
                for name in groups.keys() {
                    store::require_fresh_epoch(conn, name)?;
                }
            }
            store::write_session(conn, boot_id.as_deref(), false)?;
            let fresh_epochs_needed = store::any_fresh_epoch_needed(conn)?;
            Ok((signer, groups, fresh_epochs_needed))
        });
        // A state SQLite finds damaged, or that lost what it must hold, names its file.
        let (signer, groups, fresh_epochs_needed) = opened.map_err(|e| match e {
            Error::Store(e) if e.is_damage() => StoreError::Damaged {
                path: db.path.clone(),
                detail: e.to_string(),
            }
            .into(),
            e @ (Error::Open(OpenError::MissingSignatureKey)
            | Error::Internal(InternalError::MissingGroupState { .. })) => StoreError::Damaged {
                path: db.path.clone(),
                detail: e.detail(),
            }
            .into(),
            e => e,
        })?;
        store::record_identity(&data_dir, identity, signer.public())?;
        let credential = CredentialWithKey {
            credential: BasicCredential::new(identity.to_vec()).into(),
            signature_key: signer.public().into(),
        };
        Ok(Self {
            identity: identity.to_vec(),
            crypto,
            signer,
            credential,
            db: Mutex::new(db),
            groups: Mutex::new(groups),
            data_dir,
            boot_id,
            fresh_epochs_needed: AtomicBool::new(fresh_epochs_needed),
        })
    }

    pub fn identity(&self) -> &[u8] {
        &self.identity
    }

    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    /// The Ed25519 public key this identity signs with (stable across reopenings).
    pub fn signature_public_key(&self) -> &[u8] {
        self.signer.public()
    }

    /// The channels this engine is a member of, sorted.
    pub fn group_names(&self) -> Vec<String> {
        let mut names: Vec<String> = lock(&self.groups)
            .iter()
            .filter(|(_, slot)| lock(slot).group.is_some())
            .map(|(name, _)| name.clone())
            .collect();
        names.sort();
        names
    }

    pub fn has_group(&self, channel: &str) -> bool {
        lock(&self.groups)
            .get(channel)
            .is_some_and(|slot| lock(slot).group.is_some())
    }

    /// A fresh key package (an `MLSMessage`), its private keys stored until a Welcome uses it.
    pub fn generate_key_package(&self) -> Result<Vec<u8>> {
        let db = lock(&self.db);
        db.transaction(|conn| {
            let provider = Provider::new(&self.crypto, conn);
            let bundle = KeyPackage::builder()
                .build(
                    CIPHERSUITE,
                    &provider,
                    &self.signer,
                    self.credential.clone(),
                )
                .map_err(|e| KeyPackageError::Create {
                    detail: openmls_detail(&e),
                })?;
            serialize(&MlsMessageOut::from(bundle.key_package().clone()))
        })
    }

    /// Creates the group of `channel` (group id = the name's UTF-8 bytes) with us as its only
    /// member, at epoch 0.
    pub fn create_group(&self, channel: &str) -> Result<()> {
        validate_channel_name(channel)?;
        let slot = self.new_slot(channel)?;
        let slot = lock(&slot);
        let db = lock(&self.db);
        let group = db.transaction(|conn| {
            let provider = Provider::new(&self.crypto, conn);
            let group = MlsGroup::new_with_group_id(
                &provider,
                &self.signer,
                &create_config(),
                group_id_of(channel),
                self.credential.clone(),
            )
            .map_err(|e| CreateGroupError::Create {
                channel: channel.to_owned(),
                detail: openmls_detail(&e),
            })?;
            store::insert_group(conn, channel)?;
            store::set_cursor(conn, channel, Cursor::After(0))?;
            Ok::<_, Error>(group)
        });
        self.install_group(slot, channel, group)
    }

    /// Joins `channel` from a Welcome (an `MLSMessage`, or a bare Welcome) that must be for
    /// that channel and carry the ratchet tree.
    pub fn join_group(&self, channel: &str, welcome: &[u8]) -> Result<()> {
        validate_channel_name(channel)?;
        check_len(welcome, JoinError::Empty, |len| JoinError::TooLarge { len })?;
        let welcome = match MlsMessageIn::tls_deserialize_exact(welcome) {
            Ok(msg) => match msg.extract() {
                MlsMessageBodyIn::Welcome(w) => w,
                _ => return Err(JoinError::NotAWelcome.into()),
            },
            Err(_) => {
                Welcome::tls_deserialize_exact(welcome).map_err(|e| JoinError::Malformed {
                    detail: decode_detail(&e),
                })?
            }
        };
        if welcome.ciphersuite() != CIPHERSUITE {
            return Err(JoinError::Ciphersuite {
                found: welcome.ciphersuite(),
            }
            .into());
        }
        let slot = self.new_slot(channel)?;
        let slot = lock(&slot);
        let db = lock(&self.db);
        let expected = group_id_of(channel);
        let group = db.transaction(|conn| {
            let provider = Provider::new(&self.crypto, conn);
            let wrong_channel = |group: &GroupId| JoinError::WrongChannel {
                group: String::from_utf8_lossy(group.as_slice()).into_owned(),
                channel: channel.to_owned(),
            };
            let processed = ProcessedWelcome::new_from_welcome(&provider, &join_config(), welcome)
                .map_err(welcome_error)?;
            let claimed = processed.unverified_group_info().group_id().clone();
            if claimed != expected {
                return Err(wrong_channel(&claimed).into());
            }
            let staged = processed
                .into_staged_welcome(&provider, None)
                .map_err(welcome_error)?;
            if staged.group_context().group_id() != &expected {
                return Err(wrong_channel(staged.group_context().group_id()).into());
            }
            let group = staged
                .into_group(&provider)
                .map_err(|e| JoinError::Invalid {
                    detail: openmls_detail(&e),
                })?;
            store::insert_group(conn, channel)?;
            store::set_cursor(conn, channel, Cursor::FromEpoch(group.epoch().as_u64()))?;
            Ok(group)
        });
        self.install_group(slot, channel, group)
    }

    /// Adds the owner of `key_package` (an `MLSMessage` or a bare `KeyPackage`): returns the
    /// pending commit and the Welcome (ratchet tree included).
    pub fn add_member(&self, channel: &str, key_package: &[u8]) -> Result<AddMemberOutput> {
        self.add_members(channel, &[key_package])
    }

    /// Adds several members in one commit (one Welcome for all of them).
    ///
    /// The commit carries no update path unless a proposal it covers needs one (RFC 9420
    /// §12.4: an Add does not): a path costs N - 1 HPKE encryptions and grows the commit with
    /// the tree (42.8 KB and 48.6 ms at N=512 against 464 B for mls-rs, which sends none
    /// either). Our leaf is therefore not refreshed by adds; [`Engine::self_update`] is what
    /// does that (see docs/design.md, "Add commits without a path").
    pub fn add_members(&self, channel: &str, key_packages: &[&[u8]]) -> Result<AddMemberOutput> {
        if key_packages.is_empty() {
            return Err(AddMemberError::NoKeyPackages.into());
        }
        let key_packages = key_packages
            .iter()
            .map(|kp| validate_key_package(&self.crypto, kp))
            .collect::<Result<Vec<_>>>()?;
        self.with_group(channel, |group, provider, conn| {
            refuse_members_twice(group, channel, &key_packages)?;
            let (commit, welcome, _) = group
                .add_members_without_update(provider, &self.signer, &key_packages)
                .map_err(|e| match e {
                    AddMembersError::GroupStateError(ref s) if is_pending_commit(s) => {
                        AddMemberError::PendingCommit {
                            channel: channel.to_owned(),
                        }
                    }
                    AddMembersError::CreateCommitError(
                        CreateCommitError::ProposalValidationError(
                            ProposalValidationError::DuplicateSignatureKey,
                        ),
                    ) if key_packages.len() == 1 => AddMemberError::AlreadyInGroup {
                        identity: key_package_identity(&key_packages[0]),
                        channel: channel.to_owned(),
                    },
                    e => AddMemberError::Commit {
                        channel: channel.to_owned(),
                        detail: openmls_detail(&e),
                    },
                })?;
            let commit = serialize(&commit)?;
            store::set_pending_commit(conn, channel, &commit)?;
            Ok(AddMemberOutput {
                commit,
                welcome: serialize(&welcome)?,
            })
        })
    }

    /// Rotates our leaf keys (a commit with a path): returns the pending commit.
    pub fn self_update(&self, channel: &str) -> Result<Vec<u8>> {
        self.with_group(channel, |group, provider, conn| {
            let bundle = group
                .self_update(provider, &self.signer, LeafNodeParameters::default())
                .map_err(|e| match e {
                    SelfUpdateError::GroupStateError(ref s) if is_pending_commit(s) => {
                        CommitError::PendingCommit {
                            channel: channel.to_owned(),
                        }
                    }
                    e => CommitError::SelfUpdate {
                        channel: channel.to_owned(),
                        detail: openmls_detail(&e),
                    },
                })?;
            let commit = serialize(bundle.commit())?;
            store::set_pending_commit(conn, channel, &commit)?;
            Ok(commit)
        })
    }

    /// Removes the member(s) whose credential identity is `identity`: returns the pending
    /// commit. Removing ourselves is refused (use [`Engine::leave`]).
    pub fn remove_member(&self, channel: &str, identity: &[u8]) -> Result<Vec<u8>> {
        self.with_group(channel, |group, provider, conn| {
            let own = group.own_leaf_index();
            let targets: Vec<LeafNodeIndex> = group
                .members()
                .filter(|m| identity_of(&m.credential).as_deref() == Some(identity))
                .map(|m| m.index)
                .collect();
            if targets.is_empty() {
                return Err(RemoveMemberError::NotAMember {
                    identity: identity.to_vec(),
                    channel: channel.to_owned(),
                }
                .into());
            }
            if targets.contains(&own) {
                return Err(RemoveMemberError::RemoveSelf {
                    channel: channel.to_owned(),
                }
                .into());
            }
            let (commit, _, _) = group
                .remove_members(provider, &self.signer, &targets)
                .map_err(|e| match e {
                    RemoveMembersError::GroupStateError(ref s) if is_pending_commit(s) => {
                        RemoveMemberError::PendingCommit {
                            channel: channel.to_owned(),
                        }
                    }
                    e => RemoveMemberError::Commit {
                        identity: identity.to_vec(),
                        channel: channel.to_owned(),
                        detail: openmls_detail(&e),
                    },
                })?;
            let commit = serialize(&commit)?;
            store::set_pending_commit(conn, channel, &commit)?;
            Ok(commit)
        })
    }

    /// Proposes our own removal: returns the proposal to publish. Another member commits it
    /// ([`Engine::commit_pending_proposals`]); processing that commit deletes our state.
    pub fn leave(&self, channel: &str) -> Result<Vec<u8>> {
        self.with_group(channel, |group, provider, _| {
            let proposal =
                group
                    .leave_group(provider, &self.signer)
                    .map_err(|e| LeaveError::Propose {
                        channel: channel.to_owned(),
                        detail: openmls_detail(&e),
                    })?;
            serialize(&proposal)
        })
    }

    /// Deletes our local state of `channel`: for a group joined from a Welcome whose channel
    /// the relay refuses us, which could never be used and must not be listed as ours.
    pub fn forget_group(&self, channel: &str) -> Result<()> {
        self.with_group(channel, |group, provider, conn| {
            group.delete(provider.storage()).map_err(StoreError::from)?;
            store::delete_group(conn, channel)?;
            Ok(())
        })?;
        self.drop_group(channel);
        Ok(())
    }

    /// Commits the proposals received so far (e.g. a member's leave); `None` if there are none.
    pub fn commit_pending_proposals(&self, channel: &str) -> Result<Option<Vec<u8>>> {
        self.with_group(channel, |group, provider, conn| {
            if !group.has_pending_proposals() {
                return Ok(None);
            }
            let (commit, _, _) = group
                .commit_to_pending_proposals(provider, &self.signer)
                .map_err(|e| match e {
                    CommitToPendingProposalsError::GroupStateError(ref s)
                        if is_pending_commit(s) =>
                    {
                        CommitError::PendingCommit {
                            channel: channel.to_owned(),
                        }
                    }
                    e => CommitError::PendingProposals {
                        channel: channel.to_owned(),
                        detail: openmls_detail(&e),
                    },
                })?;
            let commit = serialize(&commit)?;
            store::set_pending_commit(conn, channel, &commit)?;
            Ok(Some(commit))
        })
    }

    /// The bytes of our pending commit, if any.
    pub fn pending_commit(&self, channel: &str) -> Result<Option<Vec<u8>>> {
        self.with_group_read(channel, |_| Ok(()))?;
        let db = lock(&self.db);
        Ok(store::pending_commit(&db.conn, channel)?)
    }

    /// Applies our pending commit (the relay accepted it).
    pub fn merge_pending_commit(&self, channel: &str) -> Result<u64> {
        let epoch = self.with_group(channel, |group, provider, conn| {
            if group.pending_commit().is_none() {
                return Err(CommitError::NoPendingCommit {
                    channel: channel.to_owned(),
                }
                .into());
            }
            group
                .merge_pending_commit(provider)
                .map_err(|e| CommitError::Merge {
                    channel: channel.to_owned(),
                    detail: openmls_detail(&e),
                })?;
            store::own_commit_merged(conn, channel)?;
            Ok(group.epoch().as_u64())
        })?;
        self.checkpoint();
        Ok(epoch)
    }

    /// Drops our pending commit (the relay refused it). A no-op without one.
    pub fn clear_pending_commit(&self, channel: &str) -> Result<()> {
        self.with_group(channel, |group, provider, conn| {
            group
                .clear_pending_commit(provider.storage())
                .map_err(StoreError::from)?;
            store::clear_pending_commit(conn, channel)?;
            Ok(())
        })
    }

    /// Encrypts an application message (a PrivateMessage in an `MLSMessage`).
    pub fn encrypt(&self, channel: &str, payload: &[u8]) -> Result<Vec<u8>> {
        check_payload(payload)?;
        self.with_group(channel, |group, provider, conn| {
            self.check_may_encrypt(group, conn, channel)?;
            create_message(group, provider, &self.signer, channel, payload)
        })
    }

    /// Processes the next message of the channel's log (public or private framing).
    pub fn process_incoming(&self, channel: &str, message: &[u8]) -> Result<Incoming> {
        let protocol = parse_for_channel(channel, message)?;
        let mut removed = false;
        let result = self.with_group(channel, |group, provider, conn| {
            let incoming = apply_message(channel, group, provider, conn, protocol, message)?;
            removed = matches!(incoming, Incoming::Removed { .. });
            Ok(incoming)
        });
        self.after_processing(channel, removed, result.as_ref().is_ok_and(changes_epoch));
        result
    }

    /// Applies entries of the channel's log in order, in ONE transaction: each entry's
    /// MLS state change, the channel's cursor (the last seq applied) and, for application
    /// messages, the decrypted payload in the inbox land together, so a crash can neither lose
    /// a decrypted message nor apply an entry twice. An entry that cannot be processed (not
    /// decryptable for us, malformed, from before we joined) is skipped with its error (its
    /// partial effects rolled back); a storage failure fails the whole batch. Processing stops
    /// after a commit that removed us.
    pub fn process_entries(&self, channel: &str, entries: &[LogEntry<'_>]) -> Result<Vec<Applied>> {
        let mut removed = false;
        let mut epoch_changed = false;
        // Not synced to disk (synchronous=NORMAL): everything it writes (state, cursor, inbox)
        // commits atomically, survives a killed process, and after a power loss the entries it
        // lost are applied again from the relay's log.
        let result = self.with_group_durability(channel, false, |group, provider, conn| {
            if let Some(out) = apply_entries_fast(channel, group, provider, conn, entries)? {
                removed = out.removed;
                epoch_changed = out.epoch_changed;
                return Ok(out.applied);
            }
            let mut out = Vec::with_capacity(entries.len());
            for entry in entries {
                let (seq, message) = (entry.seq, entry.message);
                conn.exec_cached("SAVEPOINT entry")
                    .map_err(StoreError::from)?;
                let outcome = parse_for_channel(channel, message).and_then(|protocol| {
                    apply_message(channel, group, provider, conn, protocol, message)
                });
                match outcome {
                    Ok(incoming) => {
                        let inbox_id = keep_for_caller(conn, channel, entry, &incoming)?;
                        removed = matches!(incoming, Incoming::Removed { .. });
                        epoch_changed |= changes_epoch(&incoming);
                        if !removed {
                            store::set_cursor(conn, channel, Cursor::After(seq))?;
                        }
                        conn.exec_cached("RELEASE entry")
                            .map_err(StoreError::from)?;
                        out.push(Applied {
                            seq,
                            outcome: Ok(incoming),
                            inbox_id,
                        });
                        if removed {
                            break;
                        }
                    }
                    Err(err) if err.kind() == crate::ErrorKind::Internal => return Err(err),
                    Err(err) => {
                        conn.execute_batch("ROLLBACK TO entry; RELEASE entry")
                            .map_err(StoreError::from)?;
                        // OpenMLS may have changed the in-memory group before failing: reload
                        // it from the rolled-back store.
                        *group = MlsGroup::load(provider.storage(), &group_id_of(channel))
                            .map_err(StoreError::from)?
                            .ok_or_else(|| missing_group_state(channel))?;
                        store::set_cursor(conn, channel, Cursor::After(seq))?;
                        out.push(Applied {
                            seq,
                            outcome: Err(err),
                            inbox_id: None,
                        });
                    }
                }
            }
            Ok(out)
        });
        self.after_processing(channel, removed, epoch_changed && result.is_ok());
        result
    }

    /// Encrypts several application messages in one durable transaction (one disk sync for
    /// the batch): all or none.
    pub fn encrypt_many(&self, channel: &str, payloads: &[&[u8]]) -> Result<Vec<Vec<u8>>> {
        self.encrypt_with_durability(channel, payloads, true)
    }

    /// [`Engine::encrypt_many`] whose transaction does not wait for the disk: the caller MUST
    /// call [`Engine::sync_before_send`] before any returned message leaves the process (a
    /// message sent from a state a power loss could take back would let a later message reuse
    /// its generation, and so its key and nonce, unless that loss is detected). Lets a sender
    /// encrypt the next batch while the previous one is being synced.
    pub fn encrypt_many_unsynced(&self, channel: &str, payloads: &[&[u8]]) -> Result<Vec<Vec<u8>>> {
        self.encrypt_with_durability(channel, payloads, false)
    }

    /// Waits until every transaction committed so far is on disk: syncs the write-ahead log,
    /// which holds every commit not yet checkpointed (checkpoints sync the database file).
    pub fn sync(&self) -> Result<()> {
        store::sync_wal(&self.data_dir.join(store::DB_FILE)).map_err(Into::into)
    }

    /// What a sender calls between [`Engine::encrypt_many_unsynced`] and sending the
    /// messages. Where the machine has a boot id this does not wait for the disk: the messages
    /// are written (a killed process loses nothing) and a power loss or crash of the machine is
    /// detected at the next opening, which then requires a new epoch before encrypting again
    /// (see [`Engine::open`]). Elsewhere it is [`Engine::sync`].
    pub fn sync_before_send(&self) -> Result<()> {
        if self.boot_id.is_some() {
            Ok(())
        } else {
            self.sync()
        }
    }

    /// Whether we must commit (e.g. [`Engine::self_update`]) before encrypting in `channel`:
    /// only after the machine went down while the engine was open (see [`Engine::open`]).
    pub fn needs_fresh_epoch(&self, channel: &str) -> Result<bool> {
        if !self.fresh_epochs_needed.load(Ordering::Relaxed) {
            return Ok(false);
        }
        let db = lock(&self.db);
        Ok(store::fresh_epoch_needed(&db.conn, channel)?)
    }

    /// Refuses to encrypt where MLS forbids it (proposals pending: said here, in words the
    /// caller can match, rather than by OpenMLS's refusal) or where our sending generations of
    /// the epoch may have been lost.
    fn check_may_encrypt(
        &self,
        group: &MlsGroup,
        conn: &rusqlite::Connection,
        channel: &str,
    ) -> Result<()> {
        if group.has_pending_proposals() {
            return Err(EncryptError::PendingProposals {
                channel: channel.to_owned(),
            }
            .into());
        }
        if self.fresh_epochs_needed.load(Ordering::Relaxed)
            && store::fresh_epoch_needed(conn, channel)?
        {
            return Err(EncryptError::FreshEpochNeeded {
                channel: channel.to_owned(),
            }
            .into());
        }
        Ok(())
    }

    fn encrypt_with_durability(
        &self,
        channel: &str,
        payloads: &[&[u8]],
        durable: bool,
    ) -> Result<Vec<Vec<u8>>> {
        self.encrypt_then(channel, payloads, durable, |_, _, messages| Ok(messages))
    }

    /// Encrypts `payloads` in one transaction and hands the messages, with their epoch, to
    /// `record`, inside that transaction (the outbox records them there: `crate::outbox`).
    pub(crate) fn encrypt_then<T>(
        &self,
        channel: &str,
        payloads: &[&[u8]],
        durable: bool,
        record: impl FnOnce(&rusqlite::Connection, u64, Vec<Vec<u8>>) -> Result<T>,
    ) -> Result<T> {
        for payload in payloads {
            check_payload(payload)?;
        }
        self.with_group_durability(channel, durable, |group, provider, conn| {
            self.check_may_encrypt(group, conn, channel)?;
            // One write of the ratchet state for the batch, not one per message (the
            // transaction commits it before any ciphertext is returned).
            if payloads.len() > 1 {
                provider.storage().defer_message_secrets();
            }
            let messages = payloads
                .iter()
                .map(|payload| create_message(group, provider, &self.signer, channel, payload))
                .collect::<Result<Vec<_>>>()?;
            record(conn, group.epoch().as_u64(), messages)
        })
    }

    /// Runs `f` on the open database.
    pub(crate) fn with_db<T>(&self, f: impl FnOnce(&Db) -> Result<T>) -> Result<T> {
        f(&lock(&self.db))
    }

    /// Where the channel's processing resumes in the relay's log.
    pub fn cursor(&self, channel: &str) -> Result<Cursor> {
        self.with_group_read(channel, |_| Ok(()))?;
        let db = lock(&self.db);
        Ok(store::cursor(&db.conn, channel)?)
    }

    /// Removes and returns the oldest received message of the channel (see
    /// [`crate::store::Db::light_transaction`] for its durability). For users of the engine
    /// alone: the SDK's client reads with [`Engine::inbox_after`] and marks what it hands out.
    pub fn inbox_take(&self, channel: &str) -> Result<Option<InboxMessage>> {
        let db = lock(&self.db);
        db.light_transaction(|conn| Ok(store::inbox_take(conn, channel)?))
    }

    /// Up to `limit` received messages of the channel after inbox row `after_id`, oldest
    /// first. Reading leaves them stored: the caller records what it handed out (see
    /// `static-client`) and prunes with [`Engine::inbox_prune`].
    pub fn inbox_after(
        &self,
        channel: &str,
        after_id: i64,
        limit: usize,
    ) -> Result<Vec<InboxMessage>> {
        let db = lock(&self.db);
        Ok(store::inbox_after(&db.conn, channel, after_id, limit)?)
    }

    /// Deletes the channel's inbox rows up to `upto_id` (handed out already), in a light
    /// transaction (see [`crate::store::Db::light_transaction`]).
    pub fn inbox_prune(&self, channel: &str, upto_id: i64) -> Result<()> {
        let db = lock(&self.db);
        db.light_transaction(|conn| Ok(store::inbox_prune(conn, channel, upto_id).map(|_| ())?))
    }

    /// How many received messages of the channel come after inbox row `after_id`.
    pub fn inbox_count_after(&self, channel: &str, after_id: i64) -> Result<u64> {
        let db = lock(&self.db);
        Ok(store::inbox_count_after(&db.conn, channel, after_id)?)
    }

    /// The channel's slot in the client's hand-out marks file; `init` writes a new slot's
    /// first mark before the slot is recorded (see [`store::inbox_slot`]).
    pub fn inbox_slot(
        &self,
        channel: &str,
        init: impl FnOnce(u64) -> std::result::Result<(), StoreError>,
    ) -> Result<u64> {
        let db = lock(&self.db);
        db.transaction(|conn| Ok(store::inbox_slot(conn, channel, init)?))
    }

    /// How many slots the client's hand-out marks file has, and the file's recorded id (see
    /// [`store::inbox_marks`]).
    pub fn inbox_marks(&self) -> Result<(u64, Option<Vec<u8>>)> {
        let db = lock(&self.db);
        db.transaction(|conn| Ok(store::inbox_marks(conn)?))
    }

    /// Records the id of the client's hand-out marks file.
    pub fn record_inbox_marks(&self, file_id: &[u8]) -> Result<()> {
        let db = lock(&self.db);
        db.transaction(|conn| Ok(store::record_inbox_marks(conn, file_id)?))
    }

    fn after_processing(&self, channel: &str, removed: bool, epoch_changed: bool) {
        if removed {
            self.drop_group(channel);
        }
        if epoch_changed {
            self.checkpoint();
        }
    }

    /// The members of the group, by leaf index.
    pub fn members(&self, channel: &str) -> Result<Vec<Member>> {
        self.with_group_read(channel, |group| Ok(members_of(group)))
    }

    /// The group's current epoch.
    pub fn epoch(&self, channel: &str) -> Result<u64> {
        self.with_group_read(channel, |group| Ok(group.epoch().as_u64()))
    }

    /// The epoch authenticator: equal for all members in the same epoch of the same group
    /// (compare it out of band to detect a fork).
    pub fn epoch_authenticator(&self, channel: &str) -> Result<Vec<u8>> {
        self.with_group_read(channel, |group| {
            Ok(group.epoch_authenticator().as_slice().to_vec())
        })
    }

    /// Whether the group holds proposals no commit has covered yet (MLS forbids sending
    /// application messages until one does).
    pub fn has_pending_proposals(&self, channel: &str) -> Result<bool> {
        self.with_group_read(channel, |group| Ok(group.has_pending_proposals()))
    }

    /// The channel's public state at its current epoch (our pending commit, if any, not
    /// applied), for the relay: see [`PublicState`].
    pub fn public_state(&self, channel: &str) -> Result<PublicState> {
        self.with_group_read(channel, |group| {
            let group_info = group
                .export_group_info(&self.crypto, &self.signer, true)
                .map_err(|e| ExportError::GroupInfo {
                    channel: channel.to_owned(),
                    detail: openmls_detail(&e),
                })?;
            let ratchet_tree = group
                .export_ratchet_tree()
                .tls_serialize_detached()
                .map_err(|e| InternalError::Serialize {
                    detail: openmls_detail(&e),
                })?;
            Ok(PublicState {
                group_info: serialize(&group_info)?,
                ratchet_tree,
            })
        })
    }

    /// Our leaf binding to `account` in `channel` (see [`crate::binding`]), over our leaf's
    /// current encryption key: a commit that changes it (ours, e.g. [`Engine::self_update`])
    /// calls for a new binding.
    pub fn leaf_binding(&self, channel: &str, account: &str) -> Result<LeafBinding> {
        self.with_group_read(channel, |group| {
            let own = group.own_leaf_index();
            // `members()` is the public way to our leaf's encryption key bytes.
            let encryption_key = group
                .members()
                .find(|m| m.index == own)
                .map(|m| m.encryption_key)
                .ok_or_else(|| ExportError::NoOwnLeaf {
                    channel: channel.to_owned(),
                })?;
            let tbs =
                crate::binding::leaf_binding_tbs(channel.as_bytes(), account, &encryption_key);
            Ok(LeafBinding {
                leaf_index: own.u32(),
                signature: self.signer.sign_bytes(&tbs),
            })
        })
    }

    /// Whether the group has a pending (unmerged) commit of ours.
    pub fn has_pending_commit(&self, channel: &str) -> Result<bool> {
        self.with_group_read(channel, |group| Ok(group.pending_commit().is_some()))
    }

    /// Truncates the WAL now (also done after each epoch change).
    pub fn checkpoint(&self) {
        // Best effort: a failure only delays the truncation to the next checkpoint.
        let _ = lock(&self.db).checkpoint();
    }

    // --- internals -------------------------------------------------------------------------

    fn slot(&self, channel: &str) -> Result<Arc<Mutex<GroupSlot>>> {
        lock(&self.groups)
            .get(channel)
            .cloned()
            .ok_or_else(|| unknown_group(channel))
    }

    /// Reserves the slot of a new group; refused if we already are a member.
    fn new_slot(&self, channel: &str) -> Result<Arc<Mutex<GroupSlot>>> {
        let mut groups = lock(&self.groups);
        if let Some(existing) = groups.get(channel) {
            if lock(existing).group.is_some() {
                return Err(GroupLookupError::AlreadyMember {
                    channel: channel.to_owned(),
                }
                .into());
            }
        }
        let slot = Arc::new(Mutex::new(GroupSlot { group: None }));
        groups.insert(channel.to_owned(), Arc::clone(&slot));
        Ok(slot)
    }

    fn forget_empty_slot(&self, channel: &str) {
        let mut groups = lock(&self.groups);
        if groups
            .get(channel)
            .is_some_and(|slot| lock(slot).group.is_none())
        {
            groups.remove(channel);
        }
    }

    /// Puts a group just created or joined into the slot made for it; on failure the slot goes.
    fn install_group(
        &self,
        mut slot: MutexGuard<'_, GroupSlot>,
        channel: &str,
        group: Result<MlsGroup>,
    ) -> Result<()> {
        match group {
            Ok(group) => {
                slot.group = Some(group);
                Ok(())
            }
            Err(e) => {
                drop(slot);
                self.forget_empty_slot(channel);
                Err(e)
            }
        }
    }

    fn drop_group(&self, channel: &str) {
        if let Some(slot) = lock(&self.groups).remove(channel) {
            lock(&slot).group = None;
        }
    }

    fn with_group_read<T>(
        &self,
        channel: &str,
        f: impl FnOnce(&MlsGroup) -> Result<T>,
    ) -> Result<T> {
        let slot = self.slot(channel)?;
        let slot = lock(&slot);
        match slot.group.as_ref() {
            Some(group) => f(group),
            None => Err(unknown_group(channel)),
        }
    }

    /// Runs `f` on the group in one transaction; on failure the in-memory group is reloaded
    /// from the (rolled back) store so memory matches disk.
    fn with_group<T>(
        &self,
        channel: &str,
        f: impl FnOnce(&mut MlsGroup, &Provider<'_>, &rusqlite::Connection) -> Result<T>,
    ) -> Result<T> {
        self.with_group_durability(channel, true, f)
    }

    /// [`Engine::with_group`] with a choice of durability: `durable == false` commits without
    /// syncing the log (see [`crate::store::Db::light_transaction`]): atomic and safe
    /// against the process being killed, but a power loss may take back the last commits.
    /// For changes that can be redone from the relay's log (applying entries), and for
    /// encryption followed by [`Engine::sync_before_send`] (a lost ratchet advance would reuse
    /// a key and nonce: either it is synced, or its loss is detected at the next opening). A
    /// later durable commit syncs the earlier light ones too (the WAL is written in order).
    fn with_group_durability<T>(
        &self,
        channel: &str,
        durable: bool,
        f: impl FnOnce(&mut MlsGroup, &Provider<'_>, &rusqlite::Connection) -> Result<T>,
    ) -> Result<T> {
        let slot = self.slot(channel)?;
        let mut slot = lock(&slot);
        let Some(group) = slot.group.as_mut() else {
            return Err(unknown_group(channel));
        };
        let db = lock(&self.db);
        let body = |conn: &rusqlite::Connection| {
            let provider = Provider::new(&self.crypto, conn);
            let value = f(group, &provider, conn)?;
            // A call that deferred the message secrets (see `crate::storage`) writes them once
            // now, inside the transaction: committed with everything else or not at all.
            write_deferred_message_secrets(group, &provider)?;
            Ok(value)
        };
        let result = if durable {
            db.transaction(body)
        } else {
            db.light_transaction(body)
        };
        if result.is_err() {
            let provider = Provider::new(&self.crypto, &db.conn);
            match MlsGroup::load(provider.storage(), &group_id_of(channel)) {
                Ok(Some(fresh)) => *group = fresh,
                Ok(None) => slot.group = None,
                Err(e) => {
                    return Err(InternalError::Reload {
                        channel: channel.to_owned(),
                        detail: e.to_string(),
                    }
                    .into())
                }
            }
        }
        result
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.checkpoint();
        // Everything on disk, then recorded as such (durably): the next opening need not
        // suspect lost sends, whatever happens to the machine meanwhile.
        if self.sync().is_ok() {
            let db = lock(&self.db);
            let _ =
                db.transaction(|conn| store::write_session(conn, self.boot_id.as_deref(), true));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn engine_is_send_sync() {
        assert_send_sync::<Engine>();
    }
}
