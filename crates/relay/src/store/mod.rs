//! The log's stores: thin I/O under the channel logs, over plain rows, one implementation per
//! database, same schema (`static/store/migrations/0002_relay.*.sql`, created by the Python store's
//! migrations before the relay opens the database).
//!
//! * [`LogWriter`]: the writer's side, owned by one writer at a time and blocking. It decides
//!   a group commit (through [`crate::wire::fence::decide`]) against the heads it trusts, and stores it
//!   in one transaction.
//! * [`LogReader`]: reads, shared and async.
//!
//! SQLite ([`sqlite`]) serves one relay per database file: memory is authoritative and the
//! fence is decided from it. PostgreSQL ([`postgres`]) serves several relays on one database:
//! each group commit locks its channels' rows and decides from them, and every commit is
//! NOTIFYed so that the other relays wake their subscribers. The statements both share are
//! written once ([`sql`]), as is the list of migrations ([`schema`]).
//!
//! The key-package directory and invitations ([`directory`], migration 0010) are rows of the
//! same database on connections of their own, beside the log (docs/design.md §5.5).

mod connect;
pub(crate) mod directory;
mod keys;
pub(crate) mod postgres;
pub mod schema;
mod sql;
pub(crate) mod sqlite;

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;

use bytes::Bytes;

use crate::error::{RelayError, Result};
use crate::wire::fence::{Candidate, Decision, Plan};
use crate::wire::framing::{ContentType, MessageHeader};

/// Where the relay keeps its logs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Database {
    /// A SQLite database file (WAL): one relay per file.
    Sqlite(PathBuf),
    /// A PostgreSQL URL (`postgresql://...`): any number of relays on one database.
    Postgres(String),
}

impl Database {
    /// A `postgresql://` or `postgres://` URL, else a SQLite file path.
    pub fn parse(database: &str) -> Database {
        if database.starts_with("postgresql://") || database.starts_with("postgres://") {
            Database::Postgres(database.to_owned())
        } else {
            Database::Sqlite(PathBuf::from(database))
        }
    }
}

impl From<PathBuf> for Database {
    fn from(path: PathBuf) -> Database {
        Database::Sqlite(path)
    }
}

impl From<&Path> for Database {
    fn from(path: &Path) -> Database {
        Database::Sqlite(path.to_owned())
    }
}

/// One entry of a channel's log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub seq: u64,
    /// The message's own epoch (from its header).
    pub epoch: u64,
    pub content_type: u32,
    pub message: Bytes,
    /// Who published it ("" when anonymous or logged before accounts were recorded).
    pub account: Arc<str>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WelcomeRecord {
    pub welcome: Bytes,
    pub commit_seq: u64,
    pub epoch: u64,
}

pub enum WelcomeKey {
    Digest(Vec<u8>),
    KeyPackageRef(Vec<u8>),
}

/// One row of `relay_audit` (migration 0012), as `crate::audit` makes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct AuditRow {
    pub account: String,
    pub at_ms: i64,
    pub kind: &'static str,
    pub key_id: Option<String>,
    pub channel: String,
    /// A JSON object, merged into the event.
    pub detail: String,
}

/// A retention policy. Per limit: None follows the server's default, Some(0) is no limit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Policy {
    /// Entries appended longer ago than this go.
    pub max_age_seconds: Option<u64>,
    /// Only the newest this many entries stay.
    pub max_entries: Option<u64>,
    /// Only the newest entries holding at most this many message bytes stay.
    pub max_bytes: Option<u64>,
}

impl Policy {
    /// Keep everything (the server's default policy unless configured).
    pub const KEEP_ALL: Policy = Policy {
        max_age_seconds: None,
        max_entries: None,
        max_bytes: None,
    };

    /// The limits that apply: `self`'s, else `default`'s, per limit; zeros (no limit) dropped.
    pub fn over(&self, default: &Policy) -> Policy {
        let pick = |own: Option<u64>, default: Option<u64>| own.or(default).filter(|v| *v > 0);
        Policy {
            max_age_seconds: pick(self.max_age_seconds, default.max_age_seconds),
            max_entries: pick(self.max_entries, default.max_entries),
            max_bytes: pick(self.max_bytes, default.max_bytes),
        }
    }

    /// No limit applies (after [`Policy::over`]).
    pub fn keeps_all(&self) -> bool {
        self.max_age_seconds.is_none() && self.max_entries.is_none() && self.max_bytes.is_none()
    }
}

/// One bounded prune of one channel (see [`crate::store::LogWriter::prune`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PruneStep {
    pub channel_id: i64,
    /// The horizon the step was planned from.
    pub horizon: u64,
    /// The new horizon: entries up to it go.
    pub to: u64,
}

/// A read's answer, awaited on the relay's runtime.
pub(crate) type StoreFuture<T> = Pin<Box<dyn Future<Output = Result<T>> + Send>>;

/// A channel's row.
#[derive(Debug, Clone)]
pub(crate) struct ChannelRow {
    pub id: i64,
    pub epoch: u64,
    pub head_seq: u64,
    /// `''` for the channel holding its name, `'legacy:<account>'` for a legacy channel whose
    /// name another account's older channel holds (see the 0003 migration).
    pub scope: String,
    /// A legacy channel (created before membership): the one account that reaches it.
    pub legacy_owner: Option<String>,
    /// The last seq its retention pruned (0: none).
    pub horizon: u64,
}

impl ChannelRow {
    /// The row of channel `id` just created: nothing in it yet, holding its name.
    pub fn created(id: i64) -> ChannelRow {
        ChannelRow {
            id,
            epoch: 0,
            head_seq: 0,
            scope: String::new(),
            legacy_owner: None,
            horizon: 0,
        }
    }
}

/// One of an account's channels as the console lists it ([`LogReader::account_channels`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccountChannelRow {
    pub id: i64,
    pub name: String,
    pub epoch: u64,
    pub head_seq: u64,
    /// As the channel sets it (None per limit: the server's default).
    pub policy: Policy,
    /// When its newest entry was appended (unix ms); None when it holds none (pruned, or
    /// nothing sent) or only entries from before appended_at was recorded.
    pub last_activity_ms: Option<i64>,
}

/// What the pruner needs of a channel's row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RetentionRow {
    pub id: i64,
    pub head_seq: u64,
    pub horizon: u64,
    /// As the channel sets it (None per limit: the server's default).
    pub policy: Policy,
}

/// A channel to create: at epoch 0, its org claimed for (or owned by) `account`, its group
/// state stored, and the creator's leaf bound to `account`.
pub(crate) struct NewChannel<'a> {
    pub name: &'a str,
    pub org: &'a str,
    pub account: &'a str,
    pub state: &'a [u8],
    pub leaf: u32,
    /// Audit rows written with the channel (`channel.created`).
    pub audit: &'a [AuditRow],
    /// The `org.claimed` row, written only when this create claims the org.
    pub claimed: Option<&'a AuditRow>,
    /// The API key that proved the creator's binding (None when anonymous).
    pub key_id: Option<&'a str>,
}

/// What creating a channel came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Creation {
    Done(i64),
    /// The name is taken.
    NameTaken,
    /// The org belongs to another account.
    OrgTaken,
}

/// A channel's group as stored: its epoch, the bound leaves, and its state at that epoch
/// (when asked for).
#[derive(Debug, Clone)]
pub(crate) struct StoredGroup {
    pub epoch: u64,
    /// Read only when asked for.
    pub state: Option<Vec<u8>>,
    pub bindings: Vec<StoredBinding>,
}

/// A leaf bound to an account, or an account's departure: its leaf `leaf` was the last one
/// removed, by the commit at `removed_seq` (kept whoever binds that leaf index later).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StoredBinding {
    pub leaf: u32,
    pub account: String,
    pub removed_seq: Option<u64>,
}

/// A binding to store (see [`LogWriter::bind`]).
pub(crate) struct Binding<'a> {
    pub channel_id: i64,
    /// The epoch whose tree the proof was checked against.
    pub epoch: u64,
    pub leaf: u32,
    pub account: &'a str,
    /// The API key that proved it (None when anonymous).
    pub key_id: Option<&'a str>,
    /// Unix ms (a Welcome used by this binding is marked used then).
    pub now_ms: i64,
}

/// The writer's side of a store: one owner at a time (the writer), blocking calls.
pub(crate) trait LogWriter: Send {
    /// A tokio worker may run this writer's calls itself (blocking it for one commit). False
    /// for a writer that drives a runtime of its own, which must not run inside another.
    fn commits_inline(&self) -> bool;

    /// Create a channel (its epoch-0 row, its group state and the creator's binding too), in
    /// one transaction.
    fn create_channel(&mut self, channel: &NewChannel<'_>) -> Result<Creation>;

    /// Bind a leaf to an account, if the channel is still at `binding.epoch` (false: it moved
    /// on, check the proof against the new tree). Replaces the leaf's earlier binding. A
    /// Welcome whose every added leaf is now bound is marked used (at `binding.now_ms`).
    fn bind(&mut self, binding: &Binding<'_>) -> Result<bool>;

    /// Decide `batch` (fence, numbers, duplicates) and store what it appends, in one
    /// transaction. The plan is final: a refusal in it is not the retry of a logged message.
    /// On error nothing was stored.
    fn append(&mut self, batch: &[Append<'_>], window: u64) -> Result<Plan>;

    /// One bounded prune of one channel, in one transaction: its entries after
    /// `step.horizon` up to `step.to` go, its horizon moves to `step.to` (never back), the
    /// epoch starts before it and the proposals of its past epochs go too.
    fn prune(&mut self, step: &PruneStep) -> Result<()>;

    /// Deletes up to `limit` Welcomes created before `created_before` or used before
    /// `used_before` (unix ms), with their refs and leaves; how many went.
    fn expire_welcomes(
        &mut self,
        created_before: i64,
        used_before: i64,
        limit: usize,
    ) -> Result<usize>;

    /// Sets a channel's retention policy (and writes its audit row, in one transaction).
    fn set_retention(
        &mut self,
        channel_id: i64,
        policy: &Policy,
        audit: Option<&AuditRow>,
    ) -> Result<()>;
    /// A readiness probe: one small write transaction (this relay's row of `relay_health`,
    /// stamped `now_ms`), so that a store that cannot write is seen.
    fn probe(&mut self, now_ms: i64) -> Result<()>;
}

/// The readers' side of a store: shared, async.
pub(crate) trait LogReader: Send + Sync {
    /// The channel `name` as `account` reaches it: its legacy channel of that name if it has
    /// one that another channel's name shadows, else the channel holding the name.
    fn load_channel(&self, account: &str, name: &str) -> StoreFuture<Option<ChannelRow>>;
    /// The channel's group (None for a legacy channel).
    fn load_group(&self, channel_id: i64, with_state: bool) -> StoreFuture<Option<StoredGroup>>;
    /// The channel's bound leaves.
    fn bindings(&self, channel_id: i64) -> StoreFuture<Vec<StoredBinding>>;
    /// The proposals accepted in `epoch`, in log order.
    fn proposals(&self, channel_id: i64, epoch: u64) -> StoreFuture<Vec<Bytes>>;
    /// The names some legacy channel shadows (read once, at open: no new ones are made).
    fn shadowed_names(&self) -> StoreFuture<Vec<String>>;
    /// Up to `limit` entries after `after_seq`, in order, and no entry more once their
    /// messages reach `max_bytes` (the first always comes).
    fn read(
        &self,
        channel_id: i64,
        after_seq: u64,
        limit: usize,
        max_bytes: usize,
    ) -> StoreFuture<Vec<Entry>>;
    /// The seq after which `epoch` starts, None when the channel never reached it.
    fn epoch_start(&self, channel_id: i64, epoch: u64) -> StoreFuture<Option<u64>>;
    fn fetch_welcome(&self, channel_id: i64, key: WelcomeKey)
        -> StoreFuture<Option<WelcomeRecord>>;
    /// Up to `limit` channels with an id above `after_id`, in id order, as the pruner sees
    /// them.
    fn retention_rows(&self, after_id: i64, limit: usize) -> StoreFuture<Vec<RetentionRow>>;
    /// One channel as the pruner sees it.
    fn retention_row(&self, channel_id: i64) -> StoreFuture<Option<RetentionRow>>;
    /// The first seq in `(after_seq, up_to]` appended at or after `since_ms` (unix ms).
    fn first_since(
        &self,
        channel_id: i64,
        after_seq: u64,
        up_to: u64,
        since_ms: i64,
    ) -> StoreFuture<Option<u64>>;
    /// The newest seq after `after_seq` whose entry and those after it hold more than
    /// `max_bytes` of messages (what a byte limit prunes up to), None when all fit.
    fn bytes_cut(
        &self,
        channel_id: i64,
        after_seq: u64,
        max_bytes: u64,
    ) -> StoreFuture<Option<u64>>;
    /// Whether some Welcome was created before `created_before` or used before `used_before`
    /// (unix ms).
    fn welcomes_due(&self, created_before: i64, used_before: i64) -> StoreFuture<bool>;
    /// The oldest commit seq of the channel's Welcomes still kept.
    fn welcome_floor(&self, channel_id: i64) -> StoreFuture<Option<u64>>;
    /// The account owning `org`.
    fn org_owner(&self, org: &str) -> StoreFuture<Option<String>>;
    /// Up to `limit` distinct keys behind bindings, in order, after `after`.
    fn bound_keys(&self, after: String, limit: usize) -> StoreFuture<Vec<String>>;
    /// Up to `limit` leaves bound by `key_id`: (channel name, leaf index).
    fn leaves_of_key(&self, key_id: String, limit: usize) -> StoreFuture<Vec<(String, u32)>>;
    /// Up to `limit` channels (not legacy) with a leaf bound to `account`, by id after
    /// `after_id` (the console's list; migration 0014's index).
    fn account_channels(
        &self,
        account: String,
        after_id: i64,
        limit: usize,
    ) -> StoreFuture<Vec<AccountChannelRow>>;
    /// How many entries of `content_type` `account` published since `since_ms` (unix ms), per
    /// channel and minute: (channel name, minute since the Unix epoch, count), at most `limit`
    /// rows, minutes without any left out.
    fn account_rate(
        &self,
        account: String,
        since_ms: i64,
        content_type: u32,
        limit: usize,
    ) -> StoreFuture<Vec<(String, i64, u64)>>;
    /// Stop background work and drop idle connections (shutdown).
    fn close(&self);
}

/// An opened store: its writer and its readers.
pub(crate) struct Opened {
    pub writer: Box<dyn LogWriter>,
    pub reader: Arc<dyn LogReader>,
    /// The key-package directory and invitations.
    pub directory: Arc<dyn directory::Directory>,
    /// The relay's external sender key pair, as the database keeps it.
    pub external_sender: SenderKey,
}

/// The relay's Ed25519 key pair as an MLS external sender (migration 0013): raw public and
/// private keys, as OpenMLS's `SignatureKeyPair` holds them.
#[derive(Clone)]
pub(crate) struct SenderKey {
    pub public: Vec<u8>,
    pub private: Vec<u8>,
}

impl std::fmt::Debug for SenderKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SenderKey")
            .field("public", &self.public)
            .finish_non_exhaustive()
    }
}

impl SenderKey {
    /// A new key pair, offered to the database (which keeps the first one offered).
    pub fn generate() -> Result<SenderKey> {
        use openmls_traits::crypto::OpenMlsCrypto as _;
        let (private, public) = openmls_rust_crypto::RustCrypto::default()
            .signature_key_gen(openmls::prelude::SignatureScheme::ED25519)
            .map_err(|e| {
                RelayError::store(format!("cannot make the relay's signature key: {e:?}"))
            })?;
        Ok(SenderKey { public, private })
    }
}

/// What a store shared with other relays (PostgreSQL) tells of their commits: registered
/// when it opens, called from its listener (as a store's handlers are registered with it).
pub(crate) trait Heads: Send + Sync + 'static {
    /// The channels loaded here, whose heads are worth telling.
    fn loaded_ids(&self) -> Vec<i64>;
    /// A committed head (and the epoch after it) of channel `id`, from any relay.
    fn advance(&self, id: i64, head: u64, epoch: u64);
}

/// Open `database`; `heads` hears of the other relays' commits (PostgreSQL wakes the loaded
/// channels with them).
pub(crate) async fn open(database: &Database, heads: Arc<dyn Heads>) -> Result<Opened> {
    match database {
        Database::Sqlite(path) => sqlite::open(path),
        Database::Postgres(url) => postgres::open(url, heads).await,
    }
}

/// A channel's head as memory holds it: `(head_seq, epoch)`, read when a batch is decided.
pub(crate) trait Memory: Sync {
    fn heads(&self) -> (u64, u64);
}

/// A commit's change to its channel's group, as stored with it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Change<'a> {
    /// The epoch the commit starts.
    pub epoch: u64,
    /// The next state, in its stored form.
    pub state: &'a [u8],
    /// The leaves the commit removes.
    pub removed: &'a [u32],
    /// The leaves the commit adds (its Welcome's joiners).
    pub added: &'a [u32],
    /// Its audit rows (`member.added`, `member.removed`), written with it.
    pub audit: &'a [AuditRow],
}

/// A publish of a group commit, as the store decides and appends it.
pub(crate) struct Append<'a> {
    pub channel_id: i64,
    /// Its channel's head in memory.
    pub memory: &'a dyn Memory,
    /// A legacy channel (it keeps no proposals).
    pub legacy: bool,
    pub header: &'a MessageHeader,
    /// Its idempotency key.
    pub key: &'a [u8],
    pub message: &'a [u8],
    /// Empty, or the Welcome kept with this commit.
    pub welcome: &'a [u8],
    pub welcome_refs: &'a [Vec<u8>],
    /// Who publishes it.
    pub account: &'a str,
    /// A handshake its group state could not check (another epoch): only a retry may pass.
    pub other_epoch: bool,
    /// A commit's change to the channel's group.
    pub change: Option<Change<'a>>,
}

impl Append<'_> {
    /// What the decision ([`crate::wire::fence::decide`]) needs of it.
    pub(crate) fn candidate(&self) -> Candidate<'_> {
        Candidate {
            channel_id: self.channel_id,
            key: self.key,
            header: self.header,
            other_epoch: self.other_epoch,
        }
    }
}

/// Decide `batch` (see [`crate::wire::fence::decide`]) from the heads `base` gives per publish.
pub(crate) fn decide(
    batch: &[Append<'_>],
    base: impl Fn(&Append<'_>) -> (u64, u64),
    found: Option<&[Option<(u64, u64)>]>,
    window: u64,
) -> Plan {
    crate::wire::fence::decide(
        batch.iter().map(Append::candidate),
        |index| batch.get(index).map_or((0, 0), &base),
        found,
        window,
    )
}

/// The heads the SQLite writer (and PostgreSQL's fast path) decides from: memory's.
pub(crate) fn in_memory(append: &Append<'_>) -> (u64, u64) {
    append.memory.heads()
}

/// The `(id, head_seq, epoch)` of each channel `plan` appends to.
pub(crate) fn new_heads(plan: &Plan) -> impl Iterator<Item = (i64, u64, u64)> + '_ {
    plan.changed().map(|(id, t)| (id, t.head, t.epoch))
}

/// One entry a group commit appends.
pub(crate) struct NewEntry<'a> {
    pub channel_id: i64,
    pub seq: u64,
    pub epoch: u64,
    pub content_type: u32,
    /// The channel's epoch once this entry is appended.
    pub channel_epoch: u64,
    /// A commit that starts `channel_epoch`.
    pub starts_epoch: bool,
    pub key: &'a [u8],
    pub message: &'a [u8],
    /// Empty, or the Welcome kept with this commit.
    pub welcome: &'a [u8],
    pub welcome_refs: &'a [Vec<u8>],
    /// The leaves the Welcome's commit added (the Welcome is used once all are bound).
    pub welcome_leaves: &'a [u32],
    /// Who published it.
    pub account: &'a str,
    /// A proposal to keep for the commits of its epoch.
    pub keep_proposal: bool,
    /// A commit's change to the channel's group.
    pub change: Option<Change<'a>>,
}

/// The entries `plan` appends, in order.
pub(crate) fn new_entries<'a>(batch: &[Append<'a>], plan: &Plan) -> Vec<NewEntry<'a>> {
    batch
        .iter()
        .zip(&plan.decisions)
        .filter_map(|(p, decision)| match *decision {
            Decision::Append {
                seq,
                channel_epoch,
                starts_epoch,
            } => Some(NewEntry {
                channel_id: p.channel_id,
                seq,
                epoch: p.header.epoch,
                content_type: p.header.content_type as u32,
                channel_epoch,
                starts_epoch,
                key: p.key,
                message: p.message,
                welcome: p.welcome,
                welcome_refs: p.welcome_refs,
                welcome_leaves: p.change.map_or(&[], |change| change.added),
                account: p.account,
                keep_proposal: p.header.content_type == ContentType::Proposal && !p.legacy,
                change: p.change,
            }),
            _ => None,
        })
        .collect()
}
