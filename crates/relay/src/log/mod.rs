//! Channel logs: the in-memory view of each channel, the group-committing writer over a store
//! (SQLite or PostgreSQL, [`crate::store`]), reading after a cursor. Same schema on both
//! (`static/store/migrations/0002_relay.*.sql`, created by the Python store's migrations
//! before the relay opens the database).
//!
//! # Design
//!
//! * **One writer per relay.** One [`Writer`] owns the store's write side. Publishes (and
//!   channel creations) queue up in a `Mutex<VecDeque>`; whoever holds the writer takes
//!   everything queued (up to [`MAX_BATCH`]), has the store fence and number it in submission
//!   order, and store it in ONE transaction: the fsync is paid once per batch. When the writer
//!   is free and the store allows it (SQLite), the submitting task commits its own publishes
//!   right away, on its thread (sparse traffic: no hand-off at all between a publish and its
//!   delivery); otherwise the writer thread (woken through a `Condvar`) takes what queued up.
//! * **Who decides.** On SQLite the relay is the only writer of its file: memory is
//!   authoritative and the fence is decided from it, idempotency optimistically (the unique
//!   index refuses a retry; only then are keys looked up). On PostgreSQL several relays share
//!   the database: each group commit locks its channels' rows, reads their heads and the
//!   batch's keys, and decides from those (exact across relays). See the store modules.
//! * **Memory only after COMMIT.** Right after the commit, still on the committing thread, each
//!   channel's recent-entries ring gets the new entries, its head and epoch advance, its
//!   `watch` wakes the subscribers, and then the publishers' oneshots are answered. A failed
//!   transaction changes nothing in memory, and everything in it is answered with the store's
//!   error. Heads only move forward: on PostgreSQL another relay's commit (NOTIFYed) moves
//!   them too, and the ring then restarts at the next local entry (it holds consecutive seqs).
//! * **Readers pull.** A subscriber holds a cursor and reads what is after it: from the ring
//!   while the ring still reaches back to it (no store access), else from the store. A slow
//!   subscriber costs nothing but its cursor.
//! * **Memory bounded by configuration.** The rings of all channels together hold at most
//!   [`LogSettings::cache_bytes`] (the oldest entries go first, whichever their channel), and
//!   a channel nobody used for [`LogSettings::idle_unload`] is unloaded entirely (see
//!   [`Registry::unload_idle`]); it is loaded again from the store when next named.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::{oneshot, watch};

use crate::clock::now_ms;
use crate::error::{shutting_down, RelayError, Result};
use crate::fence::{Decision, Plan, Tentative};
use crate::framing::MessageHeader;
use crate::group::GroupState;
use crate::members::{GroupChange, Membership, Reach};
use crate::metrics;
use crate::store::{
    self, Append, Binding, Change, ChannelRow, Creation, Database, LogReader, LogWriter,
    NewChannel, Policy, PruneStep, RetentionRow, StoredGroup,
};
pub use crate::store::{Entry, WelcomeKey, WelcomeRecord};

/// Most publishes one group commit takes.
const MAX_BATCH: usize = 512;
/// Bytes each cached entry is charged on top of its message: its ring slot (an `Entry`, 72
/// bytes), the message's own allocation and the budget's queue item (24), rounded up. Bounds
/// the entries count too: 64 MiB holds at most 524,288 entries, however small.
const ENTRY_OVERHEAD: usize = 128;

pub struct LogSettings {
    /// The database; its relay tables exist already.
    pub database: Database,
    /// Application messages are accepted at the channel's epoch or this many before it.
    pub application_window: u64,
    /// What the rings of recent entries hold, all channels together, in bytes
    /// (`RelayConfig::cache_bytes`); 0 caches nothing (every read goes to the store).
    pub cache_bytes: usize,
    /// A channel with no publish, no subscriber and no call for this long is unloaded (its
    /// ring, group state and bindings dropped) and read again from the store when next named.
    /// Zero: never unloaded.
    pub idle_unload: Duration,
}

/// Everything the service decided about a publish before its channel is looked up.
#[derive(Debug, Clone)]
pub struct Checked {
    pub header: MessageHeader,
    pub message: Bytes,
    /// From [`crate::rules::idempotency_key`].
    pub key: Vec<u8>,
    /// Empty, or a Welcome (only with a commit) kept for its joiners.
    pub welcome: Bytes,
    /// The KeyPackageRefs the Welcome names (empty without a Welcome).
    pub welcome_refs: Vec<Vec<u8>>,
    /// Who publishes it (the caller's account, "" when anonymous).
    pub account: Arc<str>,
    /// What the channel's group made of it.
    pub group: GroupCheck,
}

/// A publish as the channel's group state judged it (see [`decide`]).
#[derive(Debug, Clone)]
pub enum GroupCheck {
    /// Nothing to check: an application message, or a legacy channel.
    Unchecked,
    /// A handshake valid at its epoch; a commit carries its change.
    Valid(Option<Arc<GroupChange>>),
    /// A handshake for another epoch than the state's: not checked, so it may only be the
    /// retry of a logged one (answered as a duplicate); otherwise refused as stale.
    OtherEpoch,
}

/// A publish's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Accepted {
    /// The entry's seq (the original one for a duplicate).
    pub seq: u64,
    /// The channel's epoch after this entry (a commit's epoch + 1).
    pub epoch: u64,
    /// The idempotency key was already in the log: nothing was appended.
    pub duplicate: bool,
}

/// Resolves once the publish is decided and (if appended) durable. A dropped sender means a
/// bug or a stopped writer: the service answers INTERNAL / UNAVAILABLE.
pub type Outcome = oneshot::Receiver<Result<Accepted>>;

/// One channel, loaded.
///
/// Head and epoch only move forward: on the writer thread once a commit holding entries of
/// this channel is durable, and (PostgreSQL) when another relay's commit is NOTIFYed. On
/// SQLite they are also the writer's own view between batches.
pub struct Channel {
    id: i64,
    scope: String,
    name: String,
    /// A legacy channel: the one account that reaches it.
    legacy_owner: Option<String>,
    /// Its group as memory knows it (None until loaded; always None for a legacy channel).
    members: Mutex<Option<Membership>>,
    head: AtomicU64,
    epoch: AtomicU64,
    /// The last seq retention pruned (moves forward only; on PostgreSQL, another relay's
    /// pruning is seen when a read finds the log starting later).
    horizon: AtomicU64,
    ring: Mutex<Ring>,
    head_tx: watch::Sender<u64>,
    /// When it was last named, appended to or seen in use (see [`Cache::now`]): how long it
    /// has been idle.
    used: AtomicU64,
    cache: Arc<Cache>,
    /// When the publish of the entry [`Channel::head_submitted_seq`] was submitted here
    /// ([`metrics::now_ns`], 0 unknown): what a live delivery's latency is measured from.
    head_submitted: AtomicU64,
    head_submitted_seq: AtomicU64,
}

impl Channel {
    fn new(name: &str, row: ChannelRow, cache: &Arc<Cache>) -> Channel {
        Channel {
            id: row.id,
            scope: row.scope,
            name: name.to_owned(),
            legacy_owner: row.legacy_owner,
            members: Mutex::new(None),
            head: AtomicU64::new(row.head_seq),
            epoch: AtomicU64::new(row.epoch),
            horizon: AtomicU64::new(row.horizon),
            ring: Mutex::new(Ring::new(Arc::clone(cache))),
            head_tx: watch::Sender::new(row.head_seq),
            used: AtomicU64::new(cache.now()),
            cache: Arc::clone(cache),
            head_submitted: AtomicU64::new(0),
            head_submitted_seq: AtomicU64::new(0),
        }
    }

    /// Used at `now` (see [`Cache::now`]).
    fn touch(&self, now: u64) {
        self.used.fetch_max(now, Ordering::Relaxed);
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The channel's row id in the store.
    pub(crate) fn id(&self) -> i64 {
        self.id
    }

    /// A channel created before membership (docs/design.md §5.2).
    pub fn is_legacy(&self) -> bool {
        self.legacy_owner.is_some()
    }

    fn members(&self) -> std::sync::MutexGuard<'_, Option<Membership>> {
        self.members.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// How far `account` reaches this channel as memory knows it; None when memory does not
    /// know (the group not loaded, or loaded at an older epoch than the channel's).
    fn reach_in_memory(&self, account: &str) -> Option<Reach> {
        if let Some(owner) = &self.legacy_owner {
            return Some(if owner == account {
                Reach::Member
            } else {
                Reach::None
            });
        }
        let members = self.members();
        let membership = members.as_ref()?;
        (membership.epoch() >= self.epoch()).then(|| membership.reach(account))
    }

    /// The last committed seq (0 for an empty log).
    pub fn head_seq(&self) -> u64 {
        self.head.load(Ordering::Acquire)
    }

    /// The channel's current (committed) epoch.
    /// When the publish of entry `seq` was submitted to this relay ([`metrics::now_ns`]), if
    /// it is the latest this relay appended (not another relay's, nor an older one).
    pub fn submitted_ns(&self, seq: u64) -> Option<u64> {
        let ns = self.head_submitted.load(Ordering::Acquire);
        (ns != 0 && self.head_submitted_seq.load(Ordering::Acquire) == seq).then_some(ns)
    }

    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    /// The last seq retention pruned, as this relay knows it (0: none).
    pub fn horizon(&self) -> u64 {
        self.horizon.load(Ordering::Acquire)
    }

    fn move_horizon(&self, horizon: u64) {
        self.horizon.fetch_max(horizon, Ordering::AcqRel);
    }

    /// Pruned unless the log after `cursor` is all there (as this relay knows the horizon).
    pub fn check_cursor(&self, cursor: u64) -> Result<()> {
        let horizon = self.horizon();
        if cursor < horizon {
            return Err(self.pruned(horizon, format!("after seq {cursor}")));
        }
        Ok(())
    }

    fn pruned(&self, horizon: u64, position: String) -> RelayError {
        RelayError::Pruned {
            channel: self.name.clone(),
            horizon,
            position,
        }
    }

    /// The head seq, changed after every commit that appended to this channel.
    ///
    /// The receiver starts with the current head marked as seen: subscribe BEFORE reading,
    /// then `changed().await` when [`ChannelLog::read_after`] comes back empty, and no entry
    /// committed in between is missed.
    pub fn watch_head(&self) -> watch::Receiver<u64> {
        self.head_tx.subscribe()
    }

    /// Move head and epoch forward to a commit's (never back), waking the subscribers when
    /// the head moved.
    fn advance(&self, head: u64, epoch: u64) {
        self.move_forward(head, epoch);
        self.wake();
    }

    /// Head and epoch forward, without waking anyone yet (see [`Channel::wake`]).
    fn move_forward(&self, head: u64, epoch: u64) {
        // Epoch first: whoever sees the new head sees the epoch that goes with it.
        self.epoch.fetch_max(epoch, Ordering::AcqRel);
        self.head.fetch_max(head, Ordering::AcqRel);
    }

    /// Tells the subscribers the head moved (if it did since they last heard).
    fn wake(&self) {
        let head = self.head_seq();
        self.head_tx.send_if_modified(|seen| {
            let moved = head > *seen;
            if moved {
                *seen = head;
            }
            moved
        });
    }

    fn ring(&self) -> std::sync::MutexGuard<'_, Ring> {
        self.ring.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn cache(&self) -> &Cache {
        &self.cache
    }

    /// Up to `limit` ring entries after `cursor`, and no more once `max_bytes` of messages
    /// are reached (see [`ChannelLog::read_page`]); None when the ring does not reach back.
    fn ring_after(&self, cursor: u64, limit: usize, max_bytes: usize) -> Option<Vec<Entry>> {
        let ring = self.ring();
        let first = ring.entries.front()?.seq;
        let start = usize::try_from(cursor.checked_add(1)?.checked_sub(first)?).ok()?;
        let mut bytes = 0usize;
        let page: Vec<Entry> = ring
            .entries
            .range(start.min(ring.entries.len())..)
            .take(limit)
            .take_while(|entry| {
                let more = bytes < max_bytes;
                bytes = bytes.saturating_add(entry.message.len());
                more
            })
            .cloned()
            .collect();
        (!page.is_empty()).then_some(page)
    }
}

impl store::Memory for Channel {
    fn heads(&self) -> (u64, u64) {
        (self.head_seq(), self.epoch())
    }
}

impl std::fmt::Debug for Channel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Channel")
            .field("scope", &self.scope)
            .field("name", &self.name)
            .field("head_seq", &self.head_seq())
            .field("epoch", &self.epoch())
            .finish()
    }
}

/// A channel's recent entries (consecutive seqs), charged to the [`Cache`] they share with
/// every other channel's.
struct Ring {
    entries: VecDeque<Entry>,
    /// What they are charged (see [`charge`]).
    bytes: usize,
    cache: Arc<Cache>,
}

/// What a cached entry costs the budget.
fn charge(entry: &Entry) -> usize {
    entry.message.len() + ENTRY_OVERHEAD
}

impl Ring {
    fn new(cache: Arc<Cache>) -> Ring {
        Ring {
            entries: VecDeque::new(),
            bytes: 0,
            cache,
        }
    }

    /// Caches `entry` (the budget is enforced by [`Cache::cached`], afterwards).
    fn push(&mut self, entry: Entry) {
        if self
            .entries
            .back()
            .is_some_and(|last| last.seq + 1 != entry.seq)
        {
            // Another relay appended in between (PostgreSQL): start again from here.
            self.evict_through(u64::MAX);
        }
        let charged = charge(&entry);
        self.bytes += charged;
        self.cache.charged.fetch_add(charged, Ordering::AcqRel);
        self.entries.push_back(entry);
    }

    /// Drops the entries up to `seq`, giving back what they were charged.
    fn evict_through(&mut self, seq: u64) {
        let mut freed = 0;
        while self.entries.front().is_some_and(|first| first.seq <= seq) {
            if let Some(old) = self.entries.pop_front() {
                freed += charge(&old);
            }
        }
        self.bytes -= freed;
        self.cache.release(freed);
        // A burst of small entries may have grown the ring's buffer far beyond what it holds
        // now: give that back too (amortized: only once it is mostly empty).
        if self.entries.capacity() > 64 && self.entries.len() < self.entries.capacity() / 4 {
            self.entries.shrink_to_fit();
        }
    }
}

impl Drop for Ring {
    /// Unloaded: what its entries were charged goes back to the budget.
    fn drop(&mut self) {
        self.cache.release(self.bytes);
    }
}

/// What the rings of all channels hold together, bounded in bytes; and the clock of the
/// channels' idle times.
pub(crate) struct Cache {
    limit: usize,
    /// What the rings' entries are charged now (see [`charge`]).
    charged: AtomicUsize,
    /// The cached entries in the order they were cached (the oldest first), at most
    /// `limit / ENTRY_OVERHEAD`. An item whose entry already left its ring (its channel
    /// unloaded, or restarted by another relay's append) is skipped when it comes up.
    order: Mutex<VecDeque<(Weak<Channel>, u64)>>,
    start: Instant,
}

impl Cache {
    fn new(limit: usize) -> Cache {
        Cache {
            limit,
            charged: AtomicUsize::new(0),
            order: Mutex::new(VecDeque::new()),
            start: Instant::now(),
        }
    }

    /// Milliseconds since the log opened.
    fn now(&self) -> u64 {
        u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn release(&self, bytes: usize) {
        self.charged.fetch_sub(bytes, Ordering::AcqRel);
    }

    /// Entry `seq` of `channel` was just cached: the oldest entries (of any channel) go until
    /// the rings are within the budget again. On the writer only (it alone caches entries).
    fn cached(&self, channel: &Arc<Channel>, seq: u64) {
        let mut order = self.order.lock().unwrap_or_else(PoisonError::into_inner);
        order.push_back((Arc::downgrade(channel), seq));
        let most_items = self.limit / ENTRY_OVERHEAD;
        while self.charged.load(Ordering::Acquire) > self.limit || order.len() > most_items {
            let Some((oldest, seq)) = order.pop_front() else {
                break;
            };
            // Gone: it was unloaded, and its ring gave its charge back then.
            if let Some(oldest) = oldest.upgrade() {
                oldest.ring().evict_through(seq);
            }
        }
        if order.capacity() > 64 && order.len() < order.capacity() / 4 {
            order.shrink_to_fit();
        }
    }

    /// Forgets the items of unloaded channels: each would otherwise keep its channel's
    /// allocation (a few hundred bytes, though not what it held) until it came up.
    fn forget_unloaded(&self) {
        let mut order = self.order.lock().unwrap_or_else(PoisonError::into_inner);
        order.retain(|(channel, _)| channel.strong_count() > 0);
        if order.capacity() > 64 && order.len() < order.capacity() / 4 {
            order.shrink_to_fit();
        }
    }
}

/// The loaded channels, by name and by id; shared with the store (PostgreSQL moves their
/// heads on other relays' commits).
pub(crate) struct Registry {
    state: Mutex<RegistryState>,
    cache: Arc<Cache>,
}

#[derive(Default)]
struct RegistryState {
    /// scope -> name -> channel (nested: looked up by `&str`, no key built per lookup). The
    /// scope is the row's: '' for the channel holding its name, 'legacy:<account>' for a
    /// legacy channel another one shadows.
    by_name: HashMap<String, HashMap<String, Arc<Channel>>>,
    /// The names a legacy channel shadows (read at open; no new ones are ever made).
    shadowed: HashSet<String>,
    by_id: HashMap<i64, Arc<Channel>>,
    /// Loads in flight (their rows read, their channels not yet here)...
    loading: usize,
    /// ...and the heads announced meanwhile for channels not here (by another relay's commit,
    /// or as they were when unloaded), so that none is missed between reading a row and
    /// remembering its channel. Emptied when no load is in flight.
    announced: HashMap<i64, (u64, u64)>,
}

impl store::Heads for Registry {
    fn loaded_ids(&self) -> Vec<i64> {
        Registry::loaded_ids(self)
    }

    fn advance(&self, id: i64, head: u64, epoch: u64) {
        Registry::advance(self, id, head, epoch);
    }
}

impl Registry {
    /// No channel loaded yet; their rings hold at most `cache_bytes` together.
    fn new(cache_bytes: usize) -> Registry {
        Registry {
            state: Mutex::default(),
            cache: Arc::new(Cache::new(cache_bytes)),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, RegistryState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The channel `name` as `account` reaches it, if loaded. For a shadowed name only the
    /// account's own legacy channel is looked up here: whether it has one, the store knows.
    fn loaded(&self, account: &str, name: &str) -> Option<Arc<Channel>> {
        let state = self.lock();
        let channel = if state.shadowed.contains(name) {
            let scope = legacy_scope(account);
            state.by_name.get(&scope)?.get(name)
        } else {
            state.by_name.get("")?.get(name)
        }?;
        channel.touch(self.cache.now());
        Some(Arc::clone(channel))
    }

    fn set_shadowed(&self, names: Vec<String>) {
        self.lock().shadowed = names.into_iter().collect();
    }

    /// A committed head (and the epoch after it) of channel `id`, from any relay.
    pub(crate) fn advance(&self, id: i64, head: u64, epoch: u64) {
        let mut state = self.lock();
        if let Some(channel) = state.by_id.get(&id) {
            channel.advance(head, epoch);
        } else if state.loading > 0 {
            state.announce(id, head, epoch);
        }
    }

    /// Unloads the channels that nothing but the registry holds (no call, stream or publish
    /// in flight) and that nobody used for `idle`; returns how many. Their memory (ring, group
    /// state, bindings) is freed here, outside the registry's lock.
    ///
    /// Exact on both stores: a channel is only unloaded once no publish holds it, so whatever
    /// memory knew of it is durable (heads and group move in memory only after COMMIT), and a
    /// load reads its row again. A load in flight may have read its row before a commit that
    /// this unload outlived: it gets the unloaded channel's head and epoch (`announced`).
    pub(crate) fn unload_idle(&self, idle: Duration) -> usize {
        let now = self.cache.now();
        let idle = u64::try_from(idle.as_millis()).unwrap_or(u64::MAX);
        let mut unloaded = Vec::new();
        {
            let mut guard = self.lock();
            let state = &mut *guard;
            state.by_id.retain(|_, channel| {
                // Two references, `by_name`'s and this one: nobody else holds it, and nobody
                // can take one meanwhile (they are only cloned from here, under this lock).
                if Arc::strong_count(channel) > 2 {
                    channel.touch(now);
                    return true;
                }
                if now.saturating_sub(channel.used.load(Ordering::Relaxed)) < idle {
                    return true;
                }
                unloaded.push(Arc::clone(channel));
                false
            });
            for channel in &unloaded {
                if let Some(names) = state.by_name.get_mut(&channel.scope) {
                    names.remove(&channel.name);
                    if names.is_empty() {
                        state.by_name.remove(&channel.scope);
                    }
                }
                if state.loading > 0 {
                    state.announce(channel.id, channel.head_seq(), channel.epoch());
                }
            }
            if !unloaded.is_empty() {
                shrink(&mut state.by_id);
                shrink(&mut state.by_name);
                if let Some(names) = state.by_name.get_mut("") {
                    shrink(names);
                }
            }
        }
        let count = unloaded.len();
        if count > 0 {
            drop(unloaded);
            self.cache.forget_unloaded();
        }
        count
    }

    /// How many channels are loaded.
    fn loaded_count(&self) -> usize {
        self.lock().by_id.len()
    }

    /// The loaded channel `id`.
    fn by_id(&self, id: i64) -> Option<Arc<Channel>> {
        self.lock().by_id.get(&id).cloned()
    }

    /// The ids of the loaded channels.
    pub(crate) fn loaded_ids(&self) -> Vec<i64> {
        self.lock().by_id.keys().copied().collect()
    }

    /// Marks a load in flight until the guard is dropped.
    fn loading(self: &Arc<Self>) -> Loading {
        self.lock().loading += 1;
        Loading(Arc::clone(self))
    }

    /// The channel just loaded or created, unless another load got there first: then that
    /// one, so that each channel has one `Channel`. Heads announced since its row was read
    /// are applied.
    fn remember(&self, name: &str, row: ChannelRow) -> Arc<Channel> {
        let mut state = self.lock();
        let id = row.id;
        let existing = state
            .by_name
            .get(&row.scope)
            .and_then(|names| names.get(name));
        let channel = match existing {
            Some(existing) => Arc::clone(existing),
            None => {
                let scope = row.scope.clone();
                let channel = Arc::new(Channel::new(name, row, &self.cache));
                state
                    .by_name
                    .entry(scope)
                    .or_default()
                    .insert(name.to_owned(), Arc::clone(&channel));
                state.by_id.insert(id, Arc::clone(&channel));
                channel
            }
        };
        if let Some((head, epoch)) = state.announced.remove(&id) {
            channel.advance(head, epoch);
        }
        channel.touch(self.cache.now());
        channel
    }
}

impl RegistryState {
    fn announce(&mut self, id: i64, head: u64, epoch: u64) {
        let seen = self.announced.entry(id).or_insert((head, epoch));
        *seen = (seen.0.max(head), seen.1.max(epoch));
    }
}

/// Gives back a map's room once it holds far fewer than it could (after an unload).
fn shrink<K: std::hash::Hash + Eq, V>(map: &mut HashMap<K, V>) {
    if map.capacity() > 64 && map.len() < map.capacity() / 4 {
        map.shrink_to_fit();
    }
}

/// The row scope of `account`'s legacy channels that another channel's name shadows.
fn legacy_scope(account: &str) -> String {
    format!("legacy:{account}")
}

/// A load in flight (see [`Registry::announced`]).
struct Loading(Arc<Registry>);

impl Drop for Loading {
    fn drop(&mut self) {
        let mut state = self.0.lock();
        state.loading -= 1;
        if state.loading == 0 {
            state.announced.clear();
        }
    }
}

/// The relay's channels: load, create, publish (group-committed), read. Cheap to clone.
#[derive(Clone)]
pub struct ChannelLog {
    inner: Arc<Inner>,
}

struct Inner {
    registry: Arc<Registry>,
    queue: Arc<Queue>,
    /// None once the writer thread stopped (closed).
    writer: Arc<Mutex<Option<Writer>>>,
    /// Whether submitters may commit on their own thread (see [`LogWriter::commits_inline`]).
    commits_inline: bool,
    /// Several relays share the database (PostgreSQL): memory may be behind on bindings.
    shared: bool,
    reader: Arc<dyn LogReader>,
}

impl Drop for Inner {
    /// Dropped without [`ChannelLog::close`]: the writer still commits what was submitted,
    /// then stops (nobody waits for it).
    fn drop(&mut self) {
        self.queue.close();
    }
}

impl ChannelLog {
    /// Open the database and start the writer.
    pub async fn open(settings: LogSettings) -> Result<ChannelLog> {
        let registry = Arc::new(Registry::new(settings.cache_bytes));
        let heads: Arc<dyn store::Heads> = Arc::clone(&registry) as Arc<dyn store::Heads>;
        let opened = store::open(&settings.database, heads).await?;
        let queue = Arc::new(Queue {
            state: Mutex::new(QueueState::default()),
            wake: Condvar::new(),
            stopped: watch::Sender::new(false),
        });
        let commits_inline = opened.writer.commits_inline();
        let writer = Arc::new(Mutex::new(Some(Writer {
            store: opened.writer,
            window: settings.application_window,
            publishes: Vec::with_capacity(MAX_BATCH),
            others: Vec::new(),
        })));
        let (their_queue, their_writer) = (Arc::clone(&queue), Arc::clone(&writer));
        let spawned = std::thread::Builder::new()
            .name("static-relay-writer".into())
            .spawn(move || {
                // Declared first, dropped last: signals the stop once the writer (and its
                // store) are gone, even if it panicked.
                let _stopped = StopGuard(Arc::clone(&their_queue));
                run_writer(&their_queue, &their_writer);
            });
        if let Err(err) = spawned {
            opened.reader.close();
            return Err(RelayError::store(err));
        }
        match opened.reader.shadowed_names().await {
            Ok(names) => registry.set_shadowed(names),
            Err(err) => {
                queue.close();
                opened.reader.close();
                return Err(err);
            }
        }
        if !settings.idle_unload.is_zero() {
            tokio::spawn(unload_idle_channels(
                Arc::clone(&registry),
                settings.idle_unload,
                queue.stopped.subscribe(),
            ));
        }
        Ok(ChannelLog {
            inner: Arc::new(Inner {
                registry,
                queue,
                writer,
                commits_inline,
                shared: !commits_inline,
                reader: opened.reader,
            }),
        })
    }

    /// Create channel `name` at epoch 0 for `account`, from the creator's group `state` whose
    /// leaf `leaf` is bound to `account`: AlreadyExists("channel 'NAME' already exists"),
    /// PermissionDenied("org 'ORG' belongs to another account").
    pub async fn create(
        &self,
        name: &str,
        account: &str,
        state: GroupState,
        leaf: u32,
    ) -> Result<Arc<Channel>> {
        let org = name.split('/').next().unwrap_or(name);
        let stored = state.to_bytes().map_err(|e| {
            ::log::error!(target: "static.relay", "internal error: a group state could not be encoded: {e}");
            RelayError::Internal
        })?;
        let _loading = self.inner.registry.loading();
        let (tx, rx) = oneshot::channel();
        let job = Job::Create(CreateJob {
            name: name.to_owned(),
            org: org.to_owned(),
            account: account.to_owned(),
            state: stored,
            leaf,
            tx,
        });
        if let Err(refused) = self.push(vec![job]) {
            refused.into_iter().for_each(Job::refuse);
        }
        let id = rx.await.map_err(|_| shutting_down())??;
        let row = ChannelRow {
            id,
            epoch: 0,
            head_seq: 0,
            scope: String::new(),
            legacy_owner: None,
            horizon: 0,
        };
        let channel = self.inner.registry.remember(name, row);
        let mut membership = Membership::new(0);
        membership.bind(leaf, account);
        *channel.members() = Some(membership);
        Ok(channel)
    }

    /// The channel `name` as `account` reaches it (its own legacy channel of that name if
    /// another's shadows it): NotFound("no channel 'NAME'") when it does not exist.
    pub async fn channel(&self, account: &str, name: &str) -> Result<Arc<Channel>> {
        if let Some(channel) = self.loaded(account, name) {
            return Ok(channel);
        }
        let _loading = self.inner.registry.loading();
        let row = self
            .inner
            .reader
            .load_channel(account, name)
            .await?
            .ok_or_else(|| RelayError::NotFound(format!("no channel '{name}'")))?;
        Ok(self.inner.registry.remember(name, row))
    }

    /// The channel if it is in memory already (no store access).
    pub fn loaded(&self, account: &str, name: &str) -> Option<Arc<Channel>> {
        self.inner.registry.loaded(account, name)
    }

    /// Unloads now the channels nobody holds and nobody used for `idle` (what the log does
    /// by itself every so often, see [`LogSettings::idle_unload`]); returns how many.
    pub fn unload_idle(&self, idle: Duration) -> usize {
        self.inner.registry.unload_idle(idle)
    }

    /// How many channels are loaded.
    pub fn loaded_channels(&self) -> usize {
        self.inner.registry.loaded_count()
    }

    /// What the rings of recent entries hold now, all channels together (messages and
    /// bookkeeping, as charged against [`LogSettings::cache_bytes`]).
    pub fn cached_bytes(&self) -> usize {
        self.inner.registry.cache.charged.load(Ordering::Acquire)
    }

    /// Loads the channel's group from the store into memory when it was not loaded or is
    /// behind the channel's epoch; with `again` (another relay may have bound a leaf) the
    /// bindings of a current group are read again (a cheap query: the state is not).
    async fn load_members(&self, channel: &Channel, again: bool) -> Result<()> {
        let current = channel
            .members()
            .as_ref()
            .map(|m| m.epoch())
            .filter(|epoch| *epoch >= channel.epoch());
        if let Some(epoch) = current {
            if !again {
                return Ok(());
            }
            let bindings = self.inner.reader.bindings(channel.id).await?;
            if let Some(m) = channel.members().as_mut().filter(|m| m.epoch() == epoch) {
                m.rebind(bindings);
            }
            return Ok(());
        }
        let stored = self.stored_group(channel, false).await?;
        let loaded = Membership::from_stored(stored)?;
        let mut members = channel.members();
        // Another load or a commit may have got further meanwhile: keep the newest.
        if members.as_ref().is_none_or(|m| m.epoch() <= loaded.epoch()) {
            *members = Some(loaded);
        }
        Ok(())
    }

    /// How far `account` reaches `channel`: a legacy channel by its owner, any other by an
    /// account with a bound leaf. Memory answers; the store only when memory is behind (or,
    /// with several relays on one database, before a refusal: another relay may have bound a
    /// leaf since).
    pub async fn reach(&self, channel: &Channel, account: &str) -> Result<Reach> {
        match channel.reach_in_memory(account) {
            // A legacy channel's owner is in its row: there is nothing more to read.
            Some(reach) if channel.is_legacy() => return Ok(reach),
            Some(Reach::None) if self.inner.shared => {}
            Some(reach) => return Ok(reach),
            None => {}
        }
        self.load_members(channel, true).await?;
        // As just read: another relay's commit may have moved the epoch on meanwhile, and a
        // member must not be refused for that (the next look reloads).
        let members = channel.members();
        Ok(members.as_ref().map_or(Reach::None, |m| m.reach(account)))
    }

    async fn stored_group(&self, channel: &Channel, with_state: bool) -> Result<StoredGroup> {
        self.inner
            .reader
            .load_group(channel.id, with_state)
            .await?
            .ok_or_else(|| {
                RelayError::Unavailable(format!("channel '{}' has no group state", channel.name))
            })
    }

    /// The channel's group state at its current epoch (None for a legacy channel), read from
    /// the store the first time something needs it.
    pub async fn group(&self, channel: &Channel) -> Result<Option<Arc<GroupState>>> {
        if channel.is_legacy() {
            return Ok(None);
        }
        self.load_members(channel, false).await?;
        if let Some(state) = channel.members().as_ref().and_then(Membership::state) {
            return Ok(Some(state));
        }
        let stored = self.stored_group(channel, true).await?;
        let mut members = channel.members();
        match members.as_mut() {
            Some(m) if m.epoch() == stored.epoch => {
                let bytes = stored.state.unwrap_or_default();
                Ok(Some(m.set_state(&bytes)?))
            }
            // Memory moved on meanwhile (or was dropped): take what the store has.
            _ => {
                let loaded = Membership::from_stored(stored)?;
                let state = loaded.state();
                if members.as_ref().is_none_or(|m| m.epoch() <= loaded.epoch()) {
                    *members = Some(loaded);
                }
                Ok(state)
            }
        }
    }

    /// The channel's members with the accounts bound to them, and the epoch.
    pub async fn members_of(
        &self,
        channel: &Channel,
    ) -> Result<(u64, Vec<(crate::group::LeafInfo, Option<Arc<str>>)>)> {
        if self.inner.shared {
            self.load_members(channel, true).await?;
        }
        self.group(channel).await?;
        let members = channel.members();
        Ok(members
            .as_ref()
            .and_then(|m| Some((m.epoch(), m.members()?)))
            .unwrap_or_default())
    }

    /// The proposals accepted at `epoch` of `channel`, in log order.
    pub async fn proposals(&self, channel: &Channel, epoch: u64) -> Result<Vec<Bytes>> {
        self.inner.reader.proposals(channel.id, epoch).await
    }

    /// Binds `leaf` to `account` if `channel` is still at `epoch`; false when it moved on
    /// (check the proof against the new tree and try again).
    pub async fn bind(
        &self,
        channel: &Channel,
        epoch: u64,
        leaf: u32,
        account: &str,
    ) -> Result<bool> {
        let (tx, rx) = oneshot::channel();
        let job = Job::Bind {
            channel_id: channel.id,
            epoch,
            leaf,
            account: account.to_owned(),
            tx,
        };
        if let Err(refused) = self.push(vec![job]) {
            refused.into_iter().for_each(Job::refuse);
        }
        let bound = rx.await.map_err(|_| shutting_down())??;
        if bound {
            let mut members = channel.members();
            match members.as_mut() {
                Some(m) if m.epoch() == epoch => m.bind(leaf, account),
                // Memory moved on, or never loaded: read it again when next needed.
                _ => *members = None,
            }
        }
        Ok(bound)
    }

    /// Queue publishes (already checked, their channels loaded) for the next group commit,
    /// in order; one [`Outcome`] per item, in the same order. Items submitted together (and
    /// with others arriving meanwhile) share a durable commit; entries become visible to
    /// readers and are answered only after it.
    pub fn submit(&self, items: Vec<(Arc<Channel>, Checked)>) -> Vec<Outcome> {
        let (jobs, outcomes) = publish_jobs(items);
        if let Err(refused) = self.push(jobs) {
            refused.into_iter().for_each(Job::refuse);
        }
        outcomes
    }

    /// [`ChannelLog::submit`] for a caller that has more publishes at hand right away (the
    /// next requests of a pipelined call): these go to the writer thread, which commits them
    /// together with what follows, instead of a commit of their own on the caller's thread.
    pub fn submit_more(&self, items: Vec<(Arc<Channel>, Checked)>) -> Vec<Outcome> {
        let (jobs, outcomes) = publish_jobs(items);
        match self.inner.queue.push(jobs) {
            Ok(()) => self.inner.queue.notify_writer(),
            Err(refused) => refused.into_iter().for_each(Job::refuse),
        }
        outcomes
    }

    /// Queue `jobs`, then commit them right here if the writer is free (see the module's
    /// design notes), else leave them to the writer thread.
    fn push(&self, jobs: Vec<Job>) -> std::result::Result<(), Vec<Job>> {
        let queue = &self.inner.queue;
        queue.push(jobs)?;
        if !self.inner.commits_inline {
            queue.notify_writer();
            return Ok(());
        }
        match self.inner.writer.try_lock() {
            Ok(mut writer) => match writer.as_mut() {
                Some(writer) => {
                    let mut batch = Vec::new();
                    queue.take_now(&mut batch);
                    writer.commit(batch);
                    // More than one batch was queued (a large request): the rest is the
                    // writer thread's, which nobody else may wake.
                    if queue.has_jobs() {
                        queue.notify_writer();
                    }
                }
                // Stopped: the writer thread refused (or will refuse) what is queued.
                None => queue.notify_writer(),
            },
            // Busy (committing, here or on its thread): the writer thread takes them next.
            Err(_) => queue.notify_writer(),
        }
        Ok(())
    }

    /// Up to `limit` consecutive entries after `cursor` (empty when `cursor` is the head):
    /// from memory when recent, else from the store. Unavailable on store failure or a gap.
    pub async fn read_after(
        &self,
        channel: &Channel,
        cursor: u64,
        limit: usize,
    ) -> Result<Vec<Entry>> {
        self.read_page(channel, cursor, limit, usize::MAX).await
    }

    /// [`ChannelLog::read_after`], and no entry more once the page's messages reach
    /// `max_bytes` (the first entry always comes: a page holds at most `max_bytes` and one
    /// message). What a subscriber holds is bounded by it, whatever the messages' size.
    pub async fn read_page(
        &self,
        channel: &Channel,
        cursor: u64,
        limit: usize,
        max_bytes: usize,
    ) -> Result<Vec<Entry>> {
        let head = channel.head_seq();
        channel.check_cursor(cursor)?;
        if cursor >= head || limit == 0 {
            return Ok(Vec::new());
        }
        if let Some(page) = channel.ring_after(cursor, limit, max_bytes) {
            return Ok(page);
        }
        let page = self
            .inner
            .reader
            .read(channel.id, cursor, limit, max_bytes)
            .await?;
        if page.first().is_none_or(|e| e.seq != cursor + 1) {
            // Pruned meanwhile (here, or by another relay on PostgreSQL)?
            self.refresh_horizon(channel).await?;
            channel.check_cursor(cursor)?;
        }
        if page.is_empty() {
            // Never expected: the head advances only after a commit.
            return Err(RelayError::Unavailable(format!(
                "log ends before seq {head}"
            )));
        }
        for (expected, entry) in (cursor + 1..).zip(&page) {
            if entry.seq != expected {
                // Never expected: the log is gap-free.
                return Err(RelayError::Unavailable(format!(
                    "log gap after seq {}",
                    expected - 1
                )));
            }
        }
        Ok(page)
    }

    /// The seq after which `epoch` starts: NotFound("channel 'NAME' has no epoch E (it is at
    /// C)") when the channel never had it.
    pub async fn start_of_epoch(&self, channel: &Channel, epoch: u64) -> Result<u64> {
        if epoch == 0 {
            let horizon = channel.horizon();
            if horizon > 0 {
                return Err(channel.pruned(horizon, "from epoch 0".to_owned()));
            }
            return Ok(0);
        }
        // Asked of the store even beyond the epoch in memory: on PostgreSQL another relay may
        // have moved the channel on a moment ago. Beyond the store's integers: no such epoch.
        let start = if i64::try_from(epoch).is_ok() {
            self.inner.reader.epoch_start(channel.id, epoch).await?
        } else {
            None
        };
        if let Some(start) = start {
            if start < channel.horizon() {
                return Err(channel.pruned(channel.horizon(), format!("from epoch {epoch}")));
            }
            return Ok(start);
        }
        // Pruning drops the starts of the epochs it went past.
        if epoch <= channel.epoch() {
            self.refresh_horizon(channel).await?;
            if channel.horizon() > 0 {
                return Err(channel.pruned(channel.horizon(), format!("from epoch {epoch}")));
            }
        }
        Err(RelayError::NotFound(format!(
            "channel '{}' has no epoch {epoch} (it is at {})",
            channel.name,
            channel.epoch()
        )))
    }

    /// Reads the channel's horizon again (another relay may have pruned).
    async fn refresh_horizon(&self, channel: &Channel) -> Result<()> {
        if let Some(row) = self.inner.reader.retention_row(channel.id).await? {
            channel.move_horizon(row.horizon);
        }
        Ok(())
    }

    /// The channel's retention as stored.
    pub(crate) async fn retention_row(&self, channel: &Channel) -> Result<RetentionRow> {
        let row = self
            .inner
            .reader
            .retention_row(channel.id)
            .await?
            .ok_or_else(|| RelayError::NotFound(format!("no channel '{}'", channel.name)))?;
        channel.move_horizon(row.horizon);
        Ok(row)
    }

    /// The account owning `org`.
    pub(crate) async fn org_owner(&self, org: &str) -> Result<Option<String>> {
        self.inner.reader.org_owner(org).await
    }

    pub(crate) async fn retention_rows(
        &self,
        after_id: i64,
        limit: usize,
    ) -> Result<Vec<RetentionRow>> {
        self.inner.reader.retention_rows(after_id, limit).await
    }

    pub(crate) async fn first_since(
        &self,
        channel_id: i64,
        after_seq: u64,
        up_to: u64,
        since_ms: i64,
    ) -> Result<Option<u64>> {
        self.inner
            .reader
            .first_since(channel_id, after_seq, up_to, since_ms)
            .await
    }

    pub(crate) async fn bytes_cut(
        &self,
        channel_id: i64,
        after_seq: u64,
        max_bytes: u64,
    ) -> Result<Option<u64>> {
        self.inner
            .reader
            .bytes_cut(channel_id, after_seq, max_bytes)
            .await
    }

    /// Whether some Welcome was created before `created_before` or used before `used_before`.
    pub(crate) async fn welcomes_due(&self, created_before: i64, used_before: i64) -> Result<bool> {
        self.inner
            .reader
            .welcomes_due(created_before, used_before)
            .await
    }

    pub(crate) async fn welcome_floor(&self, channel_id: i64) -> Result<Option<u64>> {
        self.inner.reader.welcome_floor(channel_id).await
    }

    /// Runs a writer job that is not a publish (on the writer thread: never on the caller's,
    /// so that a prune step does not block a runtime worker) and waits for its answer.
    async fn run_job<T>(&self, job: Job, rx: oneshot::Receiver<Result<T>>) -> Result<T> {
        match self.inner.queue.push(vec![job]) {
            Ok(()) => self.inner.queue.notify_writer(),
            Err(refused) => refused.into_iter().for_each(Job::refuse),
        }
        rx.await.map_err(|_| shutting_down())?
    }

    /// One prune step (see [`LogWriter::prune`]); the channel's horizon moves in memory too.
    pub(crate) async fn prune(&self, step: PruneStep) -> Result<()> {
        let (tx, rx) = oneshot::channel();
        self.run_job(Job::Prune { step, tx }, rx).await?;
        if let Some(channel) = self.inner.registry.by_id(step.channel_id) {
            channel.move_horizon(step.to);
        }
        Ok(())
    }

    /// Expires up to `limit` Welcomes (created before `created_before`, or used before
    /// `used_before`, unix ms): how many went.
    pub(crate) async fn expire_welcomes(
        &self,
        created_before: i64,
        used_before: i64,
        limit: usize,
    ) -> Result<usize> {
        let (tx, rx) = oneshot::channel();
        let job = Job::ExpireWelcomes {
            created_before,
            used_before,
            limit,
            tx,
        };
        self.run_job(job, rx).await
    }

    /// A readiness probe: one small write transaction by the log's writer (between two group
    /// commits), so that a store that cannot write is seen (the gRPC health service).
    pub(crate) async fn probe(&self) -> Result<()> {
        let (tx, rx) = oneshot::channel();
        self.run_job(Job::Probe { tx }, rx).await
    }

    /// Sets the channel's retention policy.
    pub(crate) async fn set_retention(&self, channel: &Channel, policy: Policy) -> Result<()> {
        let (tx, rx) = oneshot::channel();
        let job = Job::SetRetention {
            channel_id: channel.id,
            policy,
            tx,
        };
        self.run_job(job, rx).await
    }

    pub async fn fetch_welcome(
        &self,
        channel: &Channel,
        key: WelcomeKey,
    ) -> Result<Option<WelcomeRecord>> {
        self.inner.reader.fetch_welcome(channel.id, key).await
    }

    /// Commit everything submitted so far, then stop the writer (shutdown). Publishes and
    /// creations submitted afterwards are refused: Unavailable("relay is shutting down").
    pub async fn close(&self) {
        self.inner.queue.close();
        let mut stopped = self.inner.queue.stopped.subscribe();
        // The sender lives in the queue, which we hold: this only ends once stopped.
        let _ = stopped.wait_for(|stopped| *stopped).await;
        self.inner.reader.close();
    }
}

/// Unloads the channels idle for `idle`, checking every quarter of it (so a channel goes at
/// most 1.25 `idle` after its last use), until the writer stops.
async fn unload_idle_channels(
    registry: Arc<Registry>,
    idle: Duration,
    mut stopped: watch::Receiver<bool>,
) {
    let every = (idle / 4).clamp(Duration::from_millis(10), Duration::from_secs(15));
    loop {
        tokio::select! {
            _ = stopped.wait_for(|stopped| *stopped) => return,
            () = tokio::time::sleep(every) => {}
        }
        if registry.unload_idle(idle) > 0 {
            // What they held is free but still resident (glibc's arenas): give it back, off
            // the runtime's workers, one trim at a time (see `crate::memory`).
            let _ = tokio::task::spawn_blocking(crate::memory::give_back).await;
        }
    }
}

/// The writer's jobs for `items`, and the outcomes their submitter waits on.
fn publish_jobs(items: Vec<(Arc<Channel>, Checked)>) -> (Vec<Job>, Vec<Outcome>) {
    items
        .into_iter()
        .map(|(channel, checked)| {
            let (tx, rx) = oneshot::channel();
            (
                Job::Publish(Publish {
                    channel,
                    checked,
                    submitted: metrics::now_ns(),
                    tx,
                }),
                rx,
            )
        })
        .unzip()
}

// -- the queue --------------------------------------------------------------------------------

pub(crate) struct Publish {
    pub channel: Arc<Channel>,
    pub checked: Checked,
    /// When it was submitted ([`metrics::now_ns`]): publish-to-ack and -delivery start here.
    submitted: u64,
    tx: oneshot::Sender<Result<Accepted>>,
}

enum Job {
    Publish(Publish),
    Create(CreateJob),
    Bind {
        channel_id: i64,
        epoch: u64,
        leaf: u32,
        account: String,
        tx: oneshot::Sender<Result<bool>>,
    },
    Prune {
        step: PruneStep,
        tx: oneshot::Sender<Result<()>>,
    },
    ExpireWelcomes {
        created_before: i64,
        used_before: i64,
        limit: usize,
        tx: oneshot::Sender<Result<usize>>,
    },
    SetRetention {
        channel_id: i64,
        policy: Policy,
        tx: oneshot::Sender<Result<()>>,
    },
    /// A readiness probe: one small write (see [`ChannelLog::probe`]).
    Probe {
        tx: oneshot::Sender<Result<()>>,
    },
}

struct CreateJob {
    name: String,
    org: String,
    account: String,
    state: Vec<u8>,
    leaf: u32,
    tx: oneshot::Sender<Result<i64>>,
}

impl Job {
    fn refuse(self) {
        // A receiver gone (its caller cancelled) needs no answer.
        match self {
            Job::Publish(p) => {
                let _ = p.tx.send(Err(shutting_down()));
            }
            Job::Create(create) => {
                let _ = create.tx.send(Err(shutting_down()));
            }
            Job::Bind { tx, .. } => {
                let _ = tx.send(Err(shutting_down()));
            }
            Job::Prune { tx, .. } | Job::SetRetention { tx, .. } | Job::Probe { tx } => {
                let _ = tx.send(Err(shutting_down()));
            }
            Job::ExpireWelcomes { tx, .. } => {
                let _ = tx.send(Err(shutting_down()));
            }
        }
    }
}

/// What tokio tasks hand the writer thread.
struct Queue {
    state: Mutex<QueueState>,
    wake: Condvar,
    /// Set once the writer has stopped (its connection and checkpointer closed).
    stopped: watch::Sender<bool>,
}

#[derive(Default)]
struct QueueState {
    jobs: VecDeque<Job>,
    closing: bool,
    /// The writer sleeps on the condvar: only then is a notify (a futex wake) needed.
    writer_waiting: bool,
}

impl Queue {
    fn lock(&self) -> std::sync::MutexGuard<'_, QueueState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Queue `jobs` for the writer, or give them back once closing.
    fn push(&self, jobs: Vec<Job>) -> std::result::Result<(), Vec<Job>> {
        let mut state = self.lock();
        if state.closing {
            return Err(jobs);
        }
        state.jobs.extend(jobs);
        Ok(())
    }

    /// Wake the writer thread if it sleeps (a futex wake only then).
    fn notify_writer(&self) {
        let wake = std::mem::replace(&mut self.lock().writer_waiting, false);
        if wake {
            self.wake.notify_one();
        }
    }

    fn has_jobs(&self) -> bool {
        !self.lock().jobs.is_empty()
    }

    /// Moves up to [`MAX_BATCH`] queued jobs into `batch`, without waiting.
    fn take_now(&self, batch: &mut Vec<Job>) {
        let mut state = self.lock();
        let n = state.jobs.len().min(MAX_BATCH);
        batch.extend(state.jobs.drain(..n));
    }

    fn close(&self) {
        self.lock().closing = true;
        self.wake.notify_one();
    }

    /// Waits until jobs are queued; false once closing and nothing is left.
    fn wait_for_jobs(&self) -> bool {
        let mut state = self.lock();
        loop {
            if !state.jobs.is_empty() {
                return true;
            }
            if state.closing {
                return false;
            }
            state.writer_waiting = true;
            state = self
                .wake
                .wait(state)
                .unwrap_or_else(PoisonError::into_inner);
            state.writer_waiting = false;
        }
    }
}

/// Dropped when the writer thread ends (normally or by a panic): refuses what is still queued
/// and tells [`ChannelLog::close`].
struct StopGuard(Arc<Queue>);

impl Drop for StopGuard {
    fn drop(&mut self) {
        let left: Vec<Job> = {
            let mut state = self.0.lock();
            state.closing = true;
            state.jobs.drain(..).collect()
        };
        left.into_iter().for_each(Job::refuse);
        self.0.stopped.send_replace(true);
    }
}

// -- the writer -------------------------------------------------------------------------------

/// The writer thread: commits what the submitters could not (the writer was busy), until
/// closed; then closes the writer (its connection and checkpointer).
fn run_writer(queue: &Queue, writer: &Mutex<Option<Writer>>) {
    let lock = || writer.lock().unwrap_or_else(PoisonError::into_inner);
    let mut batch = Vec::with_capacity(MAX_BATCH);
    while queue.wait_for_jobs() {
        let mut held = lock();
        let Some(writer) = held.as_mut() else { break };
        // Possibly nothing: a submitter committed it meanwhile.
        queue.take_now(&mut batch);
        if !batch.is_empty() {
            writer.commit(batch.drain(..));
        }
    }
    lock().take();
}

struct Writer {
    store: Box<dyn LogWriter>,
    window: u64,
    /// Scratch space of [`Writer::commit`], kept to reuse its allocations.
    publishes: Vec<Publish>,
    others: Vec<Job>,
}

impl Writer {
    /// Commit `jobs` (taken from the queue, in order): the publishes in one group commit.
    fn commit(&mut self, jobs: impl IntoIterator<Item = Job>) {
        let mut publishes = std::mem::take(&mut self.publishes);
        let mut others = std::mem::take(&mut self.others);
        for job in jobs {
            match job {
                Job::Publish(p) => publishes.push(p),
                other => others.push(other),
            }
        }
        if !publishes.is_empty() {
            self.publish(&mut publishes);
        }
        // Rare, each in its own small transaction, after the publishes (which wait for
        // nothing else). A publish never depends on a create of its batch: a channel is
        // handed out only once created. A binding decided after the batch's commits sees
        // their epoch (and is refused if one moved the channel on).
        for job in others.drain(..) {
            match job {
                Job::Create(create) => {
                    let result = self.create(&create);
                    let _ = create.tx.send(result);
                }
                Job::Bind {
                    channel_id,
                    epoch,
                    leaf,
                    account,
                    tx,
                } => {
                    let binding = Binding {
                        channel_id,
                        epoch,
                        leaf,
                        account: &account,
                        now_ms: now_ms(),
                    };
                    let _ = tx.send(self.store.bind(&binding));
                }
                Job::Prune { step, tx } => {
                    let _ = tx.send(self.store.prune(&step));
                }
                Job::ExpireWelcomes {
                    created_before,
                    used_before,
                    limit,
                    tx,
                } => {
                    let _ = tx.send(
                        self.store
                            .expire_welcomes(created_before, used_before, limit),
                    );
                }
                Job::SetRetention {
                    channel_id,
                    policy,
                    tx,
                } => {
                    let _ = tx.send(self.store.set_retention(channel_id, &policy));
                }
                Job::Probe { tx } => {
                    let _ = tx.send(self.store.probe(now_ms()));
                }
                Job::Publish(_) => {}
            }
        }
        self.publishes = publishes;
        self.others = others;
    }

    fn create(&mut self, create: &CreateJob) -> Result<i64> {
        let channel = NewChannel {
            name: &create.name,
            org: &create.org,
            account: &create.account,
            state: &create.state,
            leaf: create.leaf,
        };
        match self.store.create_channel(&channel)? {
            Creation::Done(id) => Ok(id),
            Creation::NameTaken => Err(RelayError::AlreadyExists(format!(
                "channel '{}' already exists",
                create.name
            ))),
            Creation::OrgTaken => Err(RelayError::PermissionDenied(format!(
                "org '{}' belongs to another account",
                create.org
            ))),
        }
    }

    /// One group commit of `batch` (emptied): decide and store, publish to memory, answer.
    fn publish(&mut self, batch: &mut Vec<Publish>) {
        let metrics = metrics::metrics();
        let started = Instant::now();
        let appended = self.store.append(&appends(batch), self.window);
        metrics
            .store_commit
            .observe(started.elapsed().as_secs_f64());
        let plan = match appended {
            Ok(plan) => plan,
            Err(err) => {
                // Once per failed group commit (each publisher's call is refused as well).
                metrics.store_failures.inc();
                ::log::error!(
                    target: "static.relay",
                    "store failure: a group commit of {} publishes failed: {err}",
                    batch.len()
                );
                // Nothing was stored and memory is untouched.
                for p in batch.drain(..) {
                    let _ = p.tx.send(Err(err.clone()));
                }
                return;
            }
        };
        committed(batch, &plan);
        // Answers before wake-ups: what a publisher was told is already readable (heads moved
        // above), and its answer does not wait behind the deliveries it causes.
        let changed: Vec<Arc<Channel>> = changed(batch, &plan)
            .map(|(channel, _)| Arc::clone(channel))
            .collect();
        for (p, decision) in batch.drain(..).zip(plan.decisions) {
            let answer = match decision {
                Decision::Append {
                    seq,
                    channel_epoch,
                    starts_epoch,
                } => {
                    let kind = if starts_epoch {
                        metrics.commits.inc();
                        "commit"
                    } else {
                        "application"
                    };
                    metrics.published.with_label_values(&[kind]).inc();
                    Ok(Accepted {
                        seq,
                        epoch: channel_epoch,
                        duplicate: false,
                    })
                }
                Decision::Duplicate { seq, channel_epoch } => {
                    metrics.published.with_label_values(&["duplicate"]).inc();
                    Ok(Accepted {
                        seq,
                        epoch: channel_epoch,
                        duplicate: true,
                    })
                }
                Decision::Refused(err) => Err(err),
            };
            metrics
                .publish_to_ack
                .observe(metrics::since_ns(p.submitted).as_secs_f64());
            let _ = p.tx.send(answer);
        }
        for channel in changed {
            channel.wake();
        }
    }
}

/// The channels `plan` appends to, with their new head and epoch.
fn changed<'a>(
    batch: &'a [Publish],
    plan: &'a Plan,
) -> impl Iterator<Item = (&'a Arc<Channel>, &'a Tentative)> + 'a {
    plan.changed()
        .filter_map(|(_, t)| Some((&batch.get(t.index)?.channel, t)))
}

/// The publishes of `batch` as the store decides and appends them.
fn appends(batch: &[Publish]) -> Vec<Append<'_>> {
    batch
        .iter()
        .map(|p| {
            let change = match &p.checked.group {
                GroupCheck::Valid(Some(change)) => Some(Change {
                    epoch: change.epoch,
                    state: &change.state,
                    removed: &change.removed,
                    added: &change.added,
                }),
                _ => None,
            };
            Append {
                channel_id: p.channel.id(),
                memory: &*p.channel,
                legacy: p.channel.is_legacy(),
                header: &p.checked.header,
                key: &p.checked.key,
                message: &p.checked.message,
                welcome: &p.checked.welcome,
                welcome_refs: &p.checked.welcome_refs,
                account: &p.checked.account,
                other_epoch: matches!(p.checked.group, GroupCheck::OtherEpoch),
                change,
            }
        })
        .collect()
}

/// The batch is durable: rings, heads and epochs (the subscribers are woken once the
/// publishers are answered).
fn committed(batch: &[Publish], plan: &Plan) {
    for (p, decision) in batch.iter().zip(&plan.decisions) {
        if let Decision::Append { seq, .. } = *decision {
            p.channel.ring().push(Entry {
                seq,
                epoch: p.checked.header.epoch,
                content_type: p.checked.header.content_type as u32,
                // A copy of its own: the request's bytes may be a slice of a larger receive
                // buffer, which the ring would otherwise keep whole (uncounted).
                message: Bytes::copy_from_slice(&p.checked.message),
                account: Arc::clone(&p.checked.account),
            });
            p.channel.cache().cached(&p.channel, seq);
            p.channel
                .head_submitted
                .store(p.submitted, Ordering::Release);
            p.channel.head_submitted_seq.store(seq, Ordering::Release);
            if let GroupCheck::Valid(Some(change)) = &p.checked.group {
                // Before the epoch moves (below): whoever sees the new epoch finds the group
                // that goes with it.
                let mut members = p.channel.members();
                let applied = members.as_mut().map(|m| m.apply(change, seq));
                if !matches!(applied, Some(Ok(()))) {
                    // Not loaded, or unreadable: the store has it.
                    *members = None;
                }
            }
        }
    }
    for (channel, t) in changed(batch, plan) {
        channel.move_forward(t.head, t.epoch);
        channel.touch(channel.cache().now());
    }
}

/// An application entry of `size` zero bytes at epoch 0 (for the tests).
#[cfg(test)]
pub(crate) fn test_entry(seq: u64, size: usize) -> Entry {
    Entry {
        seq,
        epoch: 0,
        content_type: 1,
        message: Bytes::from(vec![0u8; size]),
        account: Arc::from(""),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::test_entry as entry;
    use super::*;

    fn channel(id: i64, cache: &Arc<Cache>) -> Arc<Channel> {
        let row = ChannelRow {
            id,
            epoch: 0,
            head_seq: 0,
            scope: String::new(),
            legacy_owner: None,
            horizon: 0,
        };
        Arc::new(Channel::new(&format!("org/ns/c{id}"), row, cache))
    }

    fn cache(channel: &Arc<Channel>, seq: u64, size: usize) {
        channel.ring().push(entry(seq, size));
        channel.cache().cached(channel, seq);
    }

    fn seqs(channel: &Channel) -> Vec<u64> {
        channel.ring().entries.iter().map(|e| e.seq).collect()
    }

    #[test]
    fn the_rings_share_one_budget_the_oldest_entries_go_first() {
        let per = 1000 + ENTRY_OVERHEAD;
        let budget = Arc::new(Cache::new(10 * per));
        let (a, b) = (channel(1, &budget), channel(2, &budget));
        for seq in 1..=6 {
            cache(&a, seq, 1000);
        }
        for seq in 1..=4 {
            cache(&b, seq, 1000);
        }
        assert_eq!(budget.charged.load(Ordering::Acquire), 10 * per);
        // Over the budget: a's oldest go, whichever channel caches.
        cache(&b, 5, 1000);
        cache(&b, 6, 1000);
        assert_eq!(seqs(&a), [3, 4, 5, 6]);
        assert_eq!(seqs(&b), [1, 2, 3, 4, 5, 6]);
        assert_eq!(budget.charged.load(Ordering::Acquire), 10 * per);
        // The ring reaches back to cursor 2 only: older cursors read the store.
        assert!(a.ring_after(1, 10, usize::MAX).is_none());
        let page = a.ring_after(2, 3, usize::MAX).unwrap();
        assert_eq!(page.iter().map(|e| e.seq).collect::<Vec<_>>(), [3, 4, 5]);
        assert!(a.ring_after(6, 10, usize::MAX).is_none());

        // One entry larger than the whole budget leaves nothing cached anywhere.
        cache(&a, 7, 11 * per);
        assert!(seqs(&a).is_empty() && seqs(&b).is_empty());
        assert_eq!(budget.charged.load(Ordering::Acquire), 0);
        assert!(a.ring_after(6, 10, usize::MAX).is_none());

        // An unloaded channel gives its charge back; its queued items are skipped later.
        for seq in 8..=12 {
            cache(&a, seq, 1000);
        }
        cache(&b, 7, 1000);
        drop(a);
        assert_eq!(budget.charged.load(Ordering::Acquire), per);
        assert_eq!(budget.order.lock().unwrap().len(), 6);
        budget.forget_unloaded();
        assert_eq!(budget.order.lock().unwrap().len(), 1);
        for seq in 8..=16 {
            cache(&b, seq, 1000);
        }
        assert_eq!(seqs(&b), (7..=16).collect::<Vec<_>>());
        assert_eq!(budget.charged.load(Ordering::Acquire), 10 * per);
    }

    #[test]
    fn tiny_entries_are_bounded_in_count_too() {
        let budget = Arc::new(Cache::new(100 * ENTRY_OVERHEAD));
        let a = channel(1, &budget);
        for seq in 1..=1000 {
            cache(&a, seq, 0);
        }
        assert_eq!(a.ring().entries.len(), 100);
        assert!(budget.order.lock().unwrap().len() <= 100);
        // No budget: nothing is cached at all.
        let none = Arc::new(Cache::new(0));
        let b = channel(2, &none);
        cache(&b, 1, 10);
        assert!(seqs(&b).is_empty());
        assert_eq!(none.charged.load(Ordering::Acquire), 0);
    }

    #[test]
    fn a_ring_page_stops_at_its_bytes() {
        let budget = Arc::new(Cache::new(1024 * 1024));
        let a = channel(1, &budget);
        for seq in 1..=10 {
            cache(&a, seq, 100);
        }
        let page =
            |page: Option<Vec<Entry>>| page.unwrap().iter().map(|e| e.seq).collect::<Vec<_>>();
        // Entries come while the page holds less than the bytes: the one reaching them too.
        assert_eq!(page(a.ring_after(0, 10, 250)), [1, 2, 3]);
        assert_eq!(page(a.ring_after(0, 10, 300)), [1, 2, 3]);
        assert_eq!(page(a.ring_after(4, 2, 1000)), [5, 6]);
        // The first entry always comes.
        assert_eq!(page(a.ring_after(0, 10, 1)), [1]);
    }

    /// A load that read its row before a commit, while the channel was unloaded after that
    /// commit: it gets the unloaded channel's head and epoch, not its row's.
    #[test]
    fn a_load_in_flight_gets_the_head_of_a_channel_unloaded_meanwhile() {
        let registry = Arc::new(Registry::new(1024 * 1024));
        let row = |head_seq, epoch| ChannelRow {
            id: 7,
            epoch,
            head_seq,
            scope: String::new(),
            legacy_owner: None,
            horizon: 0,
        };
        let stale = row(3, 1);
        let loaded = registry.remember("org/ns/c", row(3, 1));
        loaded.advance(5, 2);
        drop(loaded);
        let loading = registry.loading();
        assert_eq!(registry.unload_idle(Duration::ZERO), 1);
        let again = registry.remember("org/ns/c", stale);
        assert_eq!((again.head_seq(), again.epoch()), (5, 2));
        drop((again, loading));
        // No load in flight: nothing is remembered of what was unloaded.
        assert_eq!(registry.unload_idle(Duration::ZERO), 1);
        assert!(registry.lock().announced.is_empty());
        let fresh = registry.remember("org/ns/c", row(9, 4));
        assert_eq!((fresh.head_seq(), fresh.epoch()), (9, 4));
    }

    #[test]
    fn another_relays_append_restarts_the_ring() {
        let budget = Arc::new(Cache::new(1024 * 1024));
        let a = channel(1, &budget);
        cache(&a, 1, 10);
        cache(&a, 2, 10);
        cache(&a, 5, 10);
        assert_eq!(seqs(&a), [5]);
        assert_eq!(budget.charged.load(Ordering::Acquire), 10 + ENTRY_OVERHEAD);
    }
}
