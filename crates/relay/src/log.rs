//! Channel logs: the in-memory view of each channel, the group-committing writer over SQLite,
//! reading after a cursor. A port of `static/relay/_log.py` + `static/store/_channels.py`
//! (SQLite only), same schema (`static/store/migrations/0002_relay.sqlite.sql`, created by
//! the Python store's migrations before the relay opens the database).
//!
//! # Design
//!
//! * **One writer.** One [`Writer`] owns the write connection. Publishes (and channel
//!   creations) queue up in a `Mutex<VecDeque>`; whoever holds the writer takes everything
//!   queued (up to [`MAX_BATCH`]), fences and numbers it in submission order, and stores it in
//!   ONE transaction: the fsync (WAL, `synchronous=FULL`) is paid once per batch. When the
//!   writer is free, the submitting task commits its own publishes right away, on its thread
//!   (sparse traffic: no hand-off at all between a publish and its delivery, and the woken
//!   tasks run on the same worker); when it is busy, the writer thread (woken through a
//!   `Condvar`) takes what queued up meanwhile, so a tokio worker commits at most one batch.
//! * **Memory only after COMMIT.** Right after the commit, still on the committing thread, each
//!   channel's recent-entries ring gets the new entries, its head and epoch advance, its
//!   `watch` wakes the subscribers, and then the publishers' oneshots are answered: the commit
//!   to wake-up path has no further hand-off. A failed transaction changes nothing in memory
//!   (the batch was decided on a tentative copy of the heads), and everything in it is
//!   answered with the store's error.
//! * **Optimistic idempotency.** No lookup of idempotency keys up front: the unique index
//!   (channel_id, idempotency_key) refuses a retry, and only then is every key of the batch
//!   looked up and the batch decided again. A publish refused by the fence may still be the
//!   retry of a logged message: only those are looked up, after the commit.
//! * **Readers pull.** A subscriber holds a cursor and reads what is after it: from the ring
//!   while the ring still reaches back to it (no store access), else from a read-only
//!   connection on the blocking pool. A slow subscriber costs nothing but its cursor.
//! * **Checkpoints beside the commits.** A PASSIVE WAL checkpoint runs on its own thread and
//!   connection every [`CHECKPOINT_COMMITS`] group commits or [`CHECKPOINT_BYTES`] of
//!   messages, so that SQLite's autocheckpoint (the fallback) rarely runs inside a commit.
//!
//! The relay assumes it is the only writer of the relay tables (one `static serve` per
//! database); the Python API writes other tables of the same file (hence `busy_timeout`).

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;

use bytes::Bytes;
use rusqlite::Connection;
use tokio::sync::{oneshot, watch};

use crate::error::{RelayError, Result};
use crate::framing::MessageHeader;
use crate::rules::{check_fence, epoch_after};
use crate::store;

/// Most publishes one group commit takes.
const MAX_BATCH: usize = 512;
/// A channel's ring of recent entries keeps at most this many entries...
const RING_ENTRIES: usize = 2048;
/// ...and this many bytes of messages.
const RING_BYTES: usize = 8 * 1024 * 1024;
/// A background WAL checkpoint after this many group commits or message bytes, whichever
/// first: well under SQLite's autocheckpoint (1,000 pages), which would run inside a commit.
const CHECKPOINT_COMMITS: u32 = 64;
const CHECKPOINT_BYTES: usize = 1024 * 1024;
/// Idle read connections kept for the next read.
const IDLE_READERS: usize = 4;
const SHUTTING_DOWN: &str = "relay is shutting down";

pub struct LogSettings {
    /// The SQLite database file (WAL); its relay tables exist already.
    pub db_path: PathBuf,
    /// Application messages are accepted at the channel's epoch or this many before it.
    pub application_window: u64,
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

/// One entry of a channel's log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub seq: u64,
    /// The message's own epoch (from its header).
    pub epoch: u64,
    pub content_type: u32,
    pub message: Bytes,
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

/// Resolves once the publish is decided and (if appended) durable. A dropped sender means a
/// bug or a stopped writer: the service answers INTERNAL / UNAVAILABLE.
pub type Outcome = oneshot::Receiver<Result<Accepted>>;

/// One channel, loaded: authoritative in memory while the relay runs.
///
/// Head and epoch change only on the writer thread, once a commit holding entries of this
/// channel is durable; between batches they are also the writer's own view.
pub struct Channel {
    id: i64,
    scope: String,
    name: String,
    head: AtomicU64,
    epoch: AtomicU64,
    ring: Mutex<Ring>,
    head_tx: watch::Sender<u64>,
}

impl Channel {
    fn new(scope: &str, name: &str, row: store::ChannelRow) -> Channel {
        Channel {
            id: row.id,
            scope: scope.to_owned(),
            name: name.to_owned(),
            head: AtomicU64::new(row.head_seq),
            epoch: AtomicU64::new(row.epoch),
            ring: Mutex::new(Ring::default()),
            head_tx: watch::Sender::new(row.head_seq),
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The scope (account id, or "" for anonymous callers) the channel is named in.
    pub fn scope(&self) -> &str {
        &self.scope
    }

    /// The last committed seq (0 for an empty log).
    pub fn head_seq(&self) -> u64 {
        self.head.load(Ordering::Acquire)
    }

    /// The channel's current (committed) epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    /// The head seq, changed after every commit that appended to this channel.
    ///
    /// The receiver starts with the current head marked as seen: subscribe BEFORE reading,
    /// then `changed().await` when [`ChannelLog::read_after`] comes back empty, and no entry
    /// committed in between is missed.
    pub fn watch_head(&self) -> watch::Receiver<u64> {
        self.head_tx.subscribe()
    }

    fn ring(&self) -> std::sync::MutexGuard<'_, Ring> {
        self.ring.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Up to `limit` ring entries after `cursor`; None when the ring does not reach back.
    fn ring_after(&self, cursor: u64, limit: usize) -> Option<Vec<Entry>> {
        let ring = self.ring();
        let first = ring.entries.front()?.seq;
        let start = usize::try_from(cursor.checked_add(1)?.checked_sub(first)?).ok()?;
        let page: Vec<Entry> = ring
            .entries
            .range(start.min(ring.entries.len())..)
            .take(limit)
            .cloned()
            .collect();
        (!page.is_empty()).then_some(page)
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

/// A channel's recent entries (consecutive seqs), bounded in count and bytes.
#[derive(Default)]
struct Ring {
    entries: VecDeque<Entry>,
    bytes: usize,
}

impl Ring {
    fn push(&mut self, entry: Entry) {
        self.bytes += entry.message.len();
        self.entries.push_back(entry);
        while self.entries.len() > RING_ENTRIES || self.bytes > RING_BYTES {
            match self.entries.pop_front() {
                Some(old) => self.bytes -= old.message.len(),
                None => break,
            }
        }
    }
}

/// The relay's channels: load, create, publish (group-committed), read. Cheap to clone.
#[derive(Clone)]
pub struct ChannelLog {
    inner: Arc<Inner>,
}

struct Inner {
    /// scope -> name -> channel (nested: looked up by `&str`, no key built per lookup).
    channels: Mutex<HashMap<String, HashMap<String, Arc<Channel>>>>,
    queue: Arc<Queue>,
    /// None once the writer thread stopped (closed).
    writer: Arc<Mutex<Option<Writer>>>,
    readers: Arc<Readers>,
    /// The checkpointer's state (owned by the writer), read by the tests.
    #[cfg_attr(not(test), allow(dead_code))]
    checkpoints: Arc<CheckpointShared>,
}

impl Drop for Inner {
    /// Dropped without [`ChannelLog::close`]: the writer still commits what was submitted,
    /// then stops (nobody waits for it).
    fn drop(&mut self) {
        self.queue.close();
    }
}

impl ChannelLog {
    /// Open the database and start the writer (and its background checkpoints).
    pub fn open(settings: LogSettings) -> Result<ChannelLog> {
        let path = settings.db_path;
        let conn = store::open_writer(&path).map_err(RelayError::store)?;
        let readers = Arc::new(Readers {
            idle: Mutex::new(vec![store::open_reader(&path).map_err(RelayError::store)?]),
            path: path.clone(),
        });
        let checkpointer =
            Checkpointer::start(store::open_checkpointer(&path).map_err(RelayError::store)?)?;
        let checkpoints = Arc::clone(&checkpointer.shared);
        let queue = Arc::new(Queue {
            state: Mutex::new(QueueState::default()),
            wake: Condvar::new(),
            stopped: watch::Sender::new(false),
        });
        let writer = Arc::new(Mutex::new(Some(Writer {
            conn,
            window: settings.application_window,
            checkpointer,
            commits_since_checkpoint: 0,
            bytes_since_checkpoint: 0,
            publishes: Vec::with_capacity(MAX_BATCH),
            creates: Vec::new(),
        })));
        let (their_queue, their_writer) = (Arc::clone(&queue), Arc::clone(&writer));
        std::thread::Builder::new()
            .name("static-relay-writer".into())
            .spawn(move || {
                // Declared first, dropped last: signals the stop once the writer (and its
                // connection and checkpointer) are gone, even if it panicked.
                let _stopped = StopGuard(Arc::clone(&their_queue));
                run_writer(&their_queue, &their_writer);
            })
            .map_err(RelayError::store)?;
        Ok(ChannelLog {
            inner: Arc::new(Inner {
                channels: Mutex::new(HashMap::new()),
                queue,
                writer,
                readers,
                checkpoints,
            }),
        })
    }

    /// Create `name` at epoch 0 in `scope`: AlreadyExists("channel 'NAME' already exists").
    pub async fn create(&self, scope: &str, name: &str) -> Result<Arc<Channel>> {
        let (tx, rx) = oneshot::channel();
        let job = Job::Create {
            scope: scope.to_owned(),
            name: name.to_owned(),
            tx,
        };
        if let Err(refused) = self.push(vec![job]) {
            refused.into_iter().for_each(Job::refuse);
        }
        let id = rx.await.map_err(|_| shutting_down())??;
        let row = store::ChannelRow {
            id,
            epoch: 0,
            head_seq: 0,
        };
        Ok(self.remember(scope, name, row))
    }

    /// The channel `name` of `scope`: NotFound("no channel 'NAME'") when it does not exist.
    pub async fn channel(&self, scope: &str, name: &str) -> Result<Arc<Channel>> {
        if let Some(channel) = self.loaded(scope, name) {
            return Ok(channel);
        }
        let (s, n) = (scope.to_owned(), name.to_owned());
        let row = self
            .read(move |conn| store::load_channel(conn, &s, &n))
            .await?
            .ok_or_else(|| RelayError::NotFound(format!("no channel '{name}'")))?;
        Ok(self.remember(scope, name, row))
    }

    /// The channel if it is in memory already (no store access).
    pub fn loaded(&self, scope: &str, name: &str) -> Option<Arc<Channel>> {
        let channels = self.channels();
        channels.get(scope)?.get(name).cloned()
    }

    /// The channel just loaded or created, unless another load got there first: then that
    /// one, so that each channel has one `Channel` (its row was read when nobody could write
    /// to it: nothing appends to a channel before it is in this map).
    fn remember(&self, scope: &str, name: &str, row: store::ChannelRow) -> Arc<Channel> {
        let mut channels = self.channels();
        let names = channels.entry(scope.to_owned()).or_default();
        if let Some(existing) = names.get(name) {
            return Arc::clone(existing);
        }
        let channel = Arc::new(Channel::new(scope, name, row));
        names.insert(name.to_owned(), Arc::clone(&channel));
        channel
    }

    fn channels(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<String, HashMap<String, Arc<Channel>>>> {
        self.inner
            .channels
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
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
        let head = channel.head_seq();
        if cursor >= head || limit == 0 {
            return Ok(Vec::new());
        }
        if let Some(page) = channel.ring_after(cursor, limit) {
            return Ok(page);
        }
        let id = channel.id;
        let page = self
            .read(move |conn| store::read(conn, id, cursor, limit))
            .await?;
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
            return Ok(0);
        }
        let id = channel.id;
        // Beyond SQLite's integers: no such epoch (rather than a failed conversion).
        let start = if epoch <= channel.epoch() {
            self.read(move |conn| store::epoch_start(conn, id, epoch))
                .await?
        } else {
            None
        };
        start.ok_or_else(|| {
            RelayError::NotFound(format!(
                "channel '{}' has no epoch {epoch} (it is at {})",
                channel.name,
                channel.epoch()
            ))
        })
    }

    pub async fn fetch_welcome(
        &self,
        channel: &Channel,
        key: WelcomeKey,
    ) -> Result<Option<WelcomeRecord>> {
        let id = channel.id;
        self.read(move |conn| store::fetch_welcome(conn, id, &key))
            .await
    }

    /// Commit everything submitted so far, then stop the writer (shutdown). Publishes and
    /// creations submitted afterwards are refused: Unavailable("relay is shutting down").
    pub async fn close(&self) {
        self.inner.queue.close();
        let mut stopped = self.inner.queue.stopped.subscribe();
        // The sender lives in the queue, which we hold: this only ends once stopped.
        let _ = stopped.wait_for(|stopped| *stopped).await;
        self.inner
            .readers
            .idle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
    }

    /// Runs `read` on a read connection, on the blocking pool.
    async fn read<T, F>(&self, read: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
    {
        let readers = Arc::clone(&self.inner.readers);
        match tokio::task::spawn_blocking(move || readers.run(read)).await {
            Ok(result) => result.map_err(RelayError::store),
            Err(err) if err.is_cancelled() => Err(shutting_down()),
            // A panic in a read: a bug.
            Err(_) => Err(RelayError::Internal),
        }
    }

    /// Background checkpoints run so far (for the tests).
    #[cfg(test)]
    fn checkpoints(&self) -> u64 {
        let (state, _) = &*self.inner.checkpoints;
        state.lock().unwrap_or_else(PoisonError::into_inner).runs
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
                    tx,
                }),
                rx,
            )
        })
        .unzip()
}

fn shutting_down() -> RelayError {
    RelayError::Unavailable(SHUTTING_DOWN.to_owned())
}

/// Read connections, opened when needed and kept (a few) for the next read.
struct Readers {
    path: PathBuf,
    idle: Mutex<Vec<Connection>>,
}

impl Readers {
    fn run<T>(&self, read: impl FnOnce(&Connection) -> rusqlite::Result<T>) -> rusqlite::Result<T> {
        let idle = self
            .idle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop();
        let conn = match idle {
            Some(conn) => conn,
            None => store::open_reader(&self.path)?,
        };
        let result = read(&conn);
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        if idle.len() < IDLE_READERS {
            idle.push(conn);
        }
        result
    }
}

// -- the queue --------------------------------------------------------------------------------

struct Publish {
    channel: Arc<Channel>,
    checked: Checked,
    tx: oneshot::Sender<Result<Accepted>>,
}

enum Job {
    Publish(Publish),
    Create {
        scope: String,
        name: String,
        tx: oneshot::Sender<Result<i64>>,
    },
}

impl Job {
    fn refuse(self) {
        // A receiver gone (its caller cancelled) needs no answer.
        match self {
            Job::Publish(p) => {
                let _ = p.tx.send(Err(shutting_down()));
            }
            Job::Create { tx, .. } => {
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

/// What the writer decided for one publish of a batch.
enum Decision {
    Append {
        seq: u64,
        channel_epoch: u64,
        starts_epoch: bool,
    },
    Duplicate {
        seq: u64,
        channel_epoch: u64,
    },
    Refused(RelayError),
}

/// A channel's head and epoch as a batch would leave them.
struct Tentative {
    /// A publish of the batch on this channel (for its `Arc<Channel>`).
    index: usize,
    head: u64,
    epoch: u64,
}

type Create = (String, String, oneshot::Sender<Result<i64>>);

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
    conn: Connection,
    window: u64,
    checkpointer: Checkpointer,
    commits_since_checkpoint: u32,
    bytes_since_checkpoint: usize,
    /// Scratch space of [`Writer::commit`], kept to reuse its allocations.
    publishes: Vec<Publish>,
    creates: Vec<Create>,
}

impl Writer {
    /// Commit `jobs` (taken from the queue, in order): the publishes in one group commit.
    fn commit(&mut self, jobs: impl IntoIterator<Item = Job>) {
        let mut publishes = std::mem::take(&mut self.publishes);
        let mut creates = std::mem::take(&mut self.creates);
        for job in jobs {
            match job {
                Job::Publish(p) => publishes.push(p),
                Job::Create { scope, name, tx } => creates.push((scope, name, tx)),
            }
        }
        if !publishes.is_empty() {
            self.publish(&mut publishes);
        }
        // Rare, each in its own small transaction, after the publishes (which wait for
        // nothing else). A publish never depends on a create of its batch: a channel is
        // handed out only once created.
        for (scope, name, tx) in creates.drain(..) {
            let _ = tx.send(self.create(&scope, &name));
        }
        self.publishes = publishes;
        self.creates = creates;
    }

    fn create(&mut self, scope: &str, name: &str) -> Result<i64> {
        match store::create_channel(&mut self.conn, scope, name) {
            Ok(Some(id)) => {
                self.count_commit(0);
                Ok(id)
            }
            Ok(None) => Err(RelayError::AlreadyExists(format!(
                "channel '{name}' already exists"
            ))),
            Err(err) => Err(RelayError::store(err)),
        }
    }

    /// One group commit of `batch` (emptied): decide, store, publish to memory, answer.
    fn publish(&mut self, batch: &mut Vec<Publish>) {
        let mut looked_up = false;
        let mut plan = decide(batch, None, self.window);
        let mut stored = self.store(batch, &plan);
        if matches!(&stored, Err(err) if store::is_constraint(err)) {
            // A retried publish hit the unique index: find the batch's keys in the log and
            // decide again (the failed transaction was rolled back).
            looked_up = true;
            stored = self.find_keys(batch).and_then(|found| {
                plan = decide(batch, Some(&found), self.window);
                self.store(batch, &plan)
            });
        }
        if let Err(err) = stored {
            // Nothing was stored and memory is untouched; a duplicate found within the batch
            // would point at an entry that does not exist, and a refusal may be a retry we
            // could not look up: the whole batch gets the store's error.
            let err = RelayError::store(err);
            for p in batch.drain(..) {
                let _ = p.tx.send(Err(err.clone()));
            }
            return;
        }
        self.committed(batch, &plan);
        // Answers: publishers, in order; a refusal may be a retry of a message logged before
        // (possibly now stale), which the optimistic path did not look up: after the others.
        let mut refused = Vec::new();
        for (p, decision) in batch.drain(..).zip(plan.decisions) {
            let answer = match decision {
                Decision::Append {
                    seq, channel_epoch, ..
                } => Ok(Accepted {
                    seq,
                    epoch: channel_epoch,
                    duplicate: false,
                }),
                Decision::Duplicate { seq, channel_epoch } => Ok(Accepted {
                    seq,
                    epoch: channel_epoch,
                    duplicate: true,
                }),
                Decision::Refused(err) if !looked_up => {
                    refused.push((p, err));
                    continue;
                }
                Decision::Refused(err) => Err(err),
            };
            let _ = p.tx.send(answer);
        }
        for (p, err) in refused {
            let answer = match store::find_key(&self.conn, p.channel.id, &p.checked.key) {
                Ok(Some((seq, channel_epoch))) => Ok(Accepted {
                    seq,
                    epoch: channel_epoch,
                    duplicate: true,
                }),
                Ok(None) => Err(err),
                Err(store_err) => Err(RelayError::store(store_err)),
            };
            let _ = p.tx.send(answer);
        }
    }

    /// The batch's keys already in the log: per publish, the (seq, channel_epoch) holding it.
    fn find_keys(&self, batch: &[Publish]) -> rusqlite::Result<Vec<Option<(u64, u64)>>> {
        batch
            .iter()
            .map(|p| store::find_key(&self.conn, p.channel.id, &p.checked.key))
            .collect()
    }

    /// Stores the plan's entries and heads in one transaction (none when nothing is appended).
    fn store(&mut self, batch: &[Publish], plan: &Plan) -> rusqlite::Result<()> {
        let entries: Vec<store::NewEntry<'_>> = batch
            .iter()
            .zip(&plan.decisions)
            .filter_map(|(p, decision)| match *decision {
                Decision::Append {
                    seq,
                    channel_epoch,
                    starts_epoch,
                } => Some(store::NewEntry {
                    channel_id: p.channel.id,
                    seq,
                    epoch: p.checked.header.epoch,
                    content_type: p.checked.header.content_type as u32,
                    channel_epoch,
                    starts_epoch,
                    key: &p.checked.key,
                    message: &p.checked.message,
                    welcome: &p.checked.welcome,
                    welcome_refs: &p.checked.welcome_refs,
                }),
                _ => None,
            })
            .collect();
        if entries.is_empty() {
            return Ok(());
        }
        let heads = plan
            .changed(batch)
            .map(|(channel, t)| (channel.id, t.head, t.epoch));
        store::append(&mut self.conn, &entries, heads)
    }

    /// The batch is durable: rings, heads and epochs, then the subscribers' wake-ups.
    fn committed(&mut self, batch: &[Publish], plan: &Plan) {
        let (mut appended, mut bytes) = (false, 0);
        for (p, decision) in batch.iter().zip(&plan.decisions) {
            if let Decision::Append { seq, .. } = *decision {
                appended = true;
                bytes += p.checked.message.len();
                p.channel.ring().push(Entry {
                    seq,
                    epoch: p.checked.header.epoch,
                    content_type: p.checked.header.content_type as u32,
                    message: p.checked.message.clone(),
                });
            }
        }
        if !appended {
            return;
        }
        for (channel, t) in plan.changed(batch) {
            // Epoch first: whoever sees the new head sees the epoch that goes with it.
            channel.epoch.store(t.epoch, Ordering::Release);
            channel.head.store(t.head, Ordering::Release);
            channel.head_tx.send_replace(t.head);
        }
        self.count_commit(bytes);
    }

    fn count_commit(&mut self, bytes: usize) {
        self.commits_since_checkpoint += 1;
        self.bytes_since_checkpoint += bytes;
        if self.commits_since_checkpoint >= CHECKPOINT_COMMITS
            || self.bytes_since_checkpoint >= CHECKPOINT_BYTES
        {
            self.commits_since_checkpoint = 0;
            self.bytes_since_checkpoint = 0;
            self.checkpointer.request();
        }
    }
}

/// The writer's decisions for a batch: per publish, and the channels' tentative heads.
struct Plan {
    decisions: Vec<Decision>,
    tentative: HashMap<i64, Tentative>,
}

impl Plan {
    /// The channels the batch appends to, with their new head and epoch.
    fn changed<'a>(
        &'a self,
        batch: &'a [Publish],
    ) -> impl Iterator<Item = (&'a Channel, &'a Tentative)> + 'a {
        self.tentative.values().filter_map(move |t| {
            let channel = &*batch.get(t.index)?.channel;
            (t.head != channel.head_seq()).then_some((channel, t))
        })
    }
}

/// Fence and number `batch` in order, on tentative copies of its channels' heads and epochs.
/// `found`: per publish, where its key already is in the log (None: not looked up). A key
/// seen earlier in the batch (or found) answers as a duplicate of that entry, before the
/// fence: a retry is never refused.
fn decide(batch: &[Publish], found: Option<&[Option<(u64, u64)>]>, window: u64) -> Plan {
    let mut tentative: HashMap<i64, Tentative> = HashMap::new();
    let mut seen: HashMap<(i64, &[u8]), (u64, u64)> = HashMap::new();
    if let Some(found) = found {
        for (p, place) in batch.iter().zip(found) {
            if let Some(place) = place {
                seen.insert((p.channel.id, &p.checked.key), *place);
            }
        }
    }
    let decisions = batch
        .iter()
        .enumerate()
        .map(|(index, p)| {
            let channel = &p.channel;
            let t = tentative.entry(channel.id).or_insert_with(|| Tentative {
                index,
                head: channel.head_seq(),
                epoch: channel.epoch(),
            });
            let key = (channel.id, p.checked.key.as_slice());
            if let Some(&(seq, channel_epoch)) = seen.get(&key) {
                return Decision::Duplicate { seq, channel_epoch };
            }
            if let Err(err) = check_fence(&p.checked.header, t.epoch, window) {
                return Decision::Refused(err);
            }
            let new_epoch = epoch_after(&p.checked.header, t.epoch);
            let starts_epoch = new_epoch != t.epoch;
            t.head += 1;
            t.epoch = new_epoch;
            seen.insert(key, (t.head, new_epoch));
            Decision::Append {
                seq: t.head,
                channel_epoch: new_epoch,
                starts_epoch,
            }
        })
        .collect();
    Plan {
        decisions,
        tentative,
    }
}

// -- background checkpoints -------------------------------------------------------------------

/// Runs PASSIVE WAL checkpoints on its own thread and connection when the writer asks.
struct Checkpointer {
    shared: Arc<CheckpointShared>,
    thread: Option<JoinHandle<()>>,
}

type CheckpointShared = (Mutex<CheckpointState>, Condvar);

#[derive(Default)]
struct CheckpointState {
    due: bool,
    stop: bool,
    runs: u64,
}

impl Checkpointer {
    fn start(conn: Connection) -> Result<Checkpointer> {
        let shared = Arc::new((Mutex::new(CheckpointState::default()), Condvar::new()));
        let theirs = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("static-relay-checkpoint".into())
            .spawn(move || Self::run(&conn, &theirs))
            .map_err(RelayError::store)?;
        Ok(Checkpointer {
            shared,
            thread: Some(thread),
        })
    }

    fn run(conn: &Connection, shared: &CheckpointShared) {
        let (state, wake) = shared;
        let mut guard = state.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            if guard.stop {
                return;
            }
            if !guard.due {
                guard = wake.wait(guard).unwrap_or_else(PoisonError::into_inner);
                continue;
            }
            guard.due = false;
            drop(guard);
            // Best effort: a failure leaves the WAL to the next run or SQLite's autocheckpoint.
            let _ = store::checkpoint(conn);
            guard = state.lock().unwrap_or_else(PoisonError::into_inner);
            guard.runs += 1;
        }
    }

    /// Asks for a checkpoint (one already due or running covers it).
    fn request(&self) {
        let (state, wake) = &*self.shared;
        state.lock().unwrap_or_else(PoisonError::into_inner).due = true;
        wake.notify_one();
    }
}

impl Drop for Checkpointer {
    fn drop(&mut self) {
        let (state, wake) = &*self.shared;
        state.lock().unwrap_or_else(PoisonError::into_inner).stop = true;
        wake.notify_one();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::framing::ContentType;

    const SCHEMA: &str = include_str!("../../../static/store/migrations/0002_relay.sqlite.sql");

    fn entry(seq: u64, size: usize) -> Entry {
        Entry {
            seq,
            epoch: 0,
            content_type: 1,
            message: Bytes::from(vec![0u8; size]),
        }
    }

    fn channel() -> Channel {
        let row = store::ChannelRow {
            id: 1,
            epoch: 0,
            head_seq: 0,
        };
        Channel::new("scope", "org/ns/service", row)
    }

    #[test]
    fn the_ring_is_bounded_by_count_and_bytes() {
        let channel = channel();
        for seq in 1..=2100 {
            channel.ring().push(entry(seq, 10));
        }
        assert_eq!(channel.ring().entries.len(), RING_ENTRIES);
        assert_eq!(channel.ring().bytes, RING_ENTRIES * 10);
        // 2100 - 2048 entries fell out: the ring reaches back to cursor 52.
        assert!(channel.ring_after(51, 10).is_none());
        let page = channel.ring_after(52, 3).unwrap();
        assert_eq!(page.iter().map(|e| e.seq).collect::<Vec<_>>(), [53, 54, 55]);
        assert!(channel.ring_after(2100, 10).is_none());

        let channel = super::tests::channel();
        for seq in 1..=3 {
            channel.ring().push(entry(seq, 3 * 1024 * 1024));
        }
        assert_eq!(channel.ring().entries.len(), 2);
        assert_eq!(channel.ring_after(1, 10).unwrap().len(), 2);
        // An entry larger than the whole ring leaves it empty: readers go to the store.
        channel.ring().push(entry(4, RING_BYTES + 1));
        let ring = channel.ring();
        assert_eq!((ring.entries.len(), ring.bytes), (0, 0));
        drop(ring);
        assert!(channel.ring_after(3, 10).is_none());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn checkpoints_run_beside_the_writer() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("static.sqlite3");
        Connection::open(&path)
            .unwrap()
            .execute_batch(SCHEMA)
            .unwrap();
        let log = ChannelLog::open(LogSettings {
            db_path: path,
            application_window: 0,
        })
        .unwrap();
        let channel = log.create("", "org/ns/service").await.unwrap();
        assert_eq!(log.checkpoints(), 0);
        for epoch in 0..u64::from(CHECKPOINT_COMMITS) {
            let message = Bytes::from(format!("commit {epoch}"));
            let checked = Checked {
                header: MessageHeader {
                    wire_format: 2,
                    group_id: b"g".to_vec(),
                    epoch,
                    content_type: ContentType::Commit,
                },
                key: message.to_vec(),
                message,
                welcome: Bytes::new(),
                welcome_refs: Vec::new(),
            };
            let outcome = log.submit(vec![(channel.clone(), checked)]);
            for o in outcome {
                o.await.unwrap().unwrap();
            }
        }
        // The create and 64 group commits: one checkpoint requested, on its own thread.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while log.checkpoints() == 0 && std::time::Instant::now() < deadline {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        assert_eq!(log.checkpoints(), 1);
        log.close().await;
    }
}
