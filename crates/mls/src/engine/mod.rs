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
//!
//! Layout (by operation, as OpenMLS's `group/mls_group/`): this file holds the engine, its
//! opening and closing, and the helpers every operation shares; `creation`, `membership`,
//! `application` (encrypting), `processing` (the log in), `export` (reading a group),
//! `inbox` and `outbox` each add one family of methods.

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
use crate::request::{self, Kind, RequestId};
use crate::store::storage::Scope;
use crate::store::{self, Cursor, Db, ExecCached as _, InboxMessage, StoreError, StoredCommit};
use crate::suite::{
    CIPHERSUITE, MAX_INPUT_LEN, MAX_KEY_PACKAGE_SKEW, PAST_EPOCHS, WIRE_FORMAT_POLICY,
};

mod application;
mod creation;
mod export;
mod inbox;
mod membership;
mod outbox;
mod processing;
mod request_store;

pub use application::Framed;
pub use creation::{key_package_encryption_key, DirectoryKeyPackage};

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
    /// that commit left (without us), which the channel keeps to say so. `by_relay`: our
    /// removal was the relay's proposal, as an external sender (the API key that bound our
    /// leaf was revoked or expired: docs/design.md §5.2).
    Removed {
        epoch: u64,
        members: Vec<Member>,
        by_relay: bool,
    },
    /// A proposal of another member, stored until a commit covers it.
    Proposal { sender: Option<Vec<u8>> },
    /// Our own application message or proposal echoed by the relay: recognised and skipped.
    Own,
    /// Another member's request (see [`crate::request`]), decrypted and stored for the
    /// responder; `payload` is its body.
    Request {
        sender: Vec<u8>,
        id: RequestId,
        payload: Vec<u8>,
        epoch: u64,
    },
    /// Another member's reply to a request, decrypted; stored if it is the first reply to a
    /// request of ours still waiting for one (`kept`), dropped otherwise.
    Reply {
        sender: Vec<u8>,
        id: RequestId,
        payload: Vec<u8>,
        epoch: u64,
        kept: bool,
    },
    /// An application message whose AAD this version does not know (a later kind), or a
    /// request or reply too short for its id: dropped, never handed out as a plain message.
    Unrecognized { sender: Vec<u8>, aad: Vec<u8> },
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

fn create_config(relay_key: Option<&[u8]>) -> MlsGroupCreateConfig {
    let builder = MlsGroupCreateConfig::builder();
    let extensions = relay_key.and_then(|key| {
        Extensions::single(Extension::ExternalSenders(vec![
            crate::suite::relay_external_sender(key),
        ]))
        // Never: one extension, of a type the group context allows.
        .ok()
    });
    let builder = match extensions {
        Some(extensions) => builder.with_group_context_extensions(extensions),
        None => builder,
    };
    builder
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

fn missing_group_state(channel: &str) -> Error {
    InternalError::MissingGroupState {
        channel: channel.to_owned(),
    }
    .into()
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
        let pending = store::rows::pending_commit(conn, channel)?;
        if pending.as_deref() == Some(message) && group.pending_commit().is_some() {
            // Our own commit, accepted by the relay and echoed back.
            group
                .merge_pending_commit(provider)
                .map_err(|e| ProcessError::MergeOwn {
                    detail: openmls_detail(&e),
                })?;
            store::rows::own_commit_merged(conn, channel)?;
            return Ok(Incoming::OwnCommit {
                epoch: group.epoch().as_u64(),
            });
        }
        if group.pending_commit().is_some() && protocol.epoch() == group.epoch() {
            // Another member's commit won this epoch: ours is void.
            group
                .clear_pending_commit(provider.storage())
                .map_err(StoreError::from)?;
            store::rows::clear_pending_commit(conn, channel)?;
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
    let aad = processed.aad().to_vec();
    match processed.into_content() {
        ProcessedMessageContent::ApplicationMessage(app) => Ok(classify(
            sender.unwrap_or_default(),
            &aad,
            app.into_bytes(),
            epoch,
        )),
        ProcessedMessageContent::ProposalMessage(proposal) => {
            // An external sender (the relay, named in the group's `external_senders`) may
            // only propose removals (of leaves whose API key was revoked: docs/design.md
            // §5.2). An Add or a context change from it is not stored, so never committed by
            // our commit of pending proposals: it would let the relay add a member.
            if matches!(proposal.sender(), Sender::External(_))
                && !matches!(proposal.proposal(), Proposal::Remove(_))
            {
                return Err(ProcessError::Invalid {
                    detail: "an external sender may only propose removals".to_owned(),
                }
                .into());
            }
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
            let own = group.own_leaf_index();
            let by_relay = staged.remove_proposals().any(|queued| {
                matches!(queued.sender(), Sender::External(_))
                    && queued.remove_proposal().removed() == own
            });
            group
                .merge_staged_commit(provider, *staged)
                .map_err(|e| ProcessError::Merge {
                    detail: openmls_detail(&e),
                })?;
            let epoch = group.epoch().as_u64();
            if self_removed || !group.is_active() {
                let members = members_of(group);
                group.delete(provider.storage()).map_err(StoreError::from)?;
                store::rows::delete_group(conn, channel)?;
                Ok(Incoming::Removed {
                    epoch,
                    members,
                    by_relay,
                })
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
            store::rows::own_commit_merged(conn, channel)?;
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

/// Writes the group's message secrets if their write was deferred (see `crate::store::storage`).
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

/// An application message by its kind (its AAD, see [`crate::request`]).
fn classify(sender: Vec<u8>, aad: &[u8], payload: Vec<u8>, epoch: u64) -> Incoming {
    let kind = Kind::of(aad);
    let framed = match kind {
        Kind::Plain => {
            return Incoming::Application {
                sender,
                payload,
                epoch,
            }
        }
        Kind::Request | Kind::Reply => request::split(&payload),
        Kind::Unknown => None,
    };
    let Some((id, body)) = framed else {
        return Incoming::Unrecognized {
            sender,
            aad: aad.to_vec(),
        };
    };
    let payload = body.to_vec();
    if kind == Kind::Request {
        Incoming::Request {
            sender,
            id,
            payload,
            epoch,
        }
    } else {
        Incoming::Reply {
            sender,
            id,
            payload,
            epoch,
            kept: false,
        }
    }
}

/// Stores a decrypted application message in the inbox (with the state change that
/// decrypted it: MLS deletes the key once used); its inbox row id, `None` for anything else.
/// A request goes to the responder's table, a reply to its request's row (see
/// [`crate::request`]), in the same transaction.
fn keep_for_caller(
    conn: &rusqlite::Connection,
    channel: &str,
    entry: &LogEntry<'_>,
    incoming: &mut Incoming,
) -> Result<Option<i64>> {
    match incoming {
        Incoming::Request {
            sender,
            id,
            payload,
            epoch,
        } => {
            let received = received(entry, sender, id, payload, *epoch);
            request::store_request(conn, channel, &received)?;
            return Ok(None);
        }
        Incoming::Reply {
            sender,
            id,
            payload,
            epoch,
            kept,
        } => {
            let received = received(entry, sender, id, payload, *epoch);
            *kept = request::store_reply(conn, channel, &received)?;
            return Ok(None);
        }
        _ => {}
    }
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
    store::rows::inbox_push(conn, channel, &message)?;
    Ok(Some(conn.last_insert_rowid()))
}

/// A request or reply of `entry`, as stored.
fn received(
    entry: &LogEntry<'_>,
    sender: &[u8],
    id: &RequestId,
    payload: &[u8],
    epoch: u64,
) -> request::Received {
    request::Received {
        row: 0,
        id: *id,
        seq: entry.seq,
        sender: sender.to_vec(),
        payload: payload.to_vec(),
        epoch,
        account: entry.account.map(str::to_owned),
    }
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
            Ok(mut incoming) => {
                let inbox_id = keep_for_caller(conn, channel, entry, &mut incoming)?;
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
            store::rows::set_cursor(conn, channel, Cursor::After(seq))?;
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
                match store::rows::read_identity(conn)? {
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
                        store::rows::write_identity(conn, identity, signer.public())?;
                        signer
                    }
                };
            let mut groups = HashMap::new();
            for name in store::rows::group_names(conn)? {
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
            let sends_lost = match store::rows::read_session(conn)? {
                Some((Some(previous), false)) => boot_id.as_deref() != Some(previous.as_str()),
                _ => false,
            };
            if sends_lost {
                for name in groups.keys() {
                    store::rows::require_fresh_epoch(conn, name)?;
                }
            }
            store::rows::write_session(conn, boot_id.as_deref(), false)?;
            let fresh_epochs_needed = store::rows::any_fresh_epoch_needed(conn)?;
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
        store::files::record_identity(&data_dir, identity, signer.public())?;
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

    /// Runs `f` on the open database.
    pub(crate) fn with_db<T>(&self, f: impl FnOnce(&Db) -> Result<T>) -> Result<T> {
        f(&lock(&self.db))
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
            // A call that deferred the message secrets (see `crate::store::storage`) writes them once
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
            let _ = db.transaction(|conn| {
                store::rows::write_session(conn, self.boot_id.as_deref(), true)
            });
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
