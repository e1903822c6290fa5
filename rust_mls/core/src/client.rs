//! The SDK's client: an [`Engine`] plus the relay, on a tokio runtime the client owns.
//!
//! # Architecture
//!
//! * One [`Client`] per agent process and data directory: it owns a small multi-thread tokio
//!   runtime, the [`Engine`], a lazily connecting tonic client of the relay and a token source.
//! * One [`Channel`] per open channel, with three background workers:
//!   - the **reader** task subscribes to the channel's log (in batches of up to
//!     [`SUBSCRIBE_BATCH`] entries per response) after the last seq it has seen (or from the
//!     epoch we joined at), reconnects with backoff (also after three silent keep-alive
//!     intervals), refreshes the token on `UNAUTHENTICATED`, passes batches that are only our
//!     own messages coming back itself (when nothing before them waits to be applied), applies
//!     a lone application message itself when the applier is idle (see [`apply_batch`]), and
//!     hands other entries to
//!   - the **applier** thread, the one writer of the channel's group state (the reader only
//!     applies while the applier has nothing): it applies entries strictly in log order in
//!     batches through [`Engine::process_entries`], which stores the cursor and the decrypted
//!     messages (the inbox) in the same transaction as the MLS state change;
//!   - the **publisher** task, which keeps one `PublishBatches` call open and pipelines the
//!     messages [`Channel::send`] encrypted (on the callers' threads, concurrent callers sharing
//!     one transaction) to it, reopening the call when it fails.
//! * Commits (`add_member`, `remove_member`, `rotate_keys`, committing proposals) take the
//!   channel's commit lock, publish with the epoch fence and return once the applier has merged
//!   the echo of the commit; a stale commit is dropped, the winner applied, and it is retried.
//! * Readers of messages take them from the inbox (blocking with a condition variable, or
//!   async through a readiness socket per waiter, see [`Waker`]), read ahead in memory; a
//!   message is marked handed out (see [`Marks`]) before it is returned.

use std::collections::{HashMap, VecDeque};
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::runtime::{Handle, Runtime};
use tokio::sync::{mpsc, oneshot, watch};
use tonic::{Code, Request, Status};

use crate::engine::{Engine, Incoming, Member};
use crate::error::{Error, ErrorKind, Result};
use crate::store::Cursor;
use crate::transport::{self, pb, RelayClient};

/// Largest payload [`Channel::send`] accepts: the relay's 1 MiB message limit less room for
/// the MLS framing, signature and AEAD tag.
pub const MAX_PAYLOAD: usize = 1024 * 1024 - 4 * 1024;

/// A subscription that shows nothing (not even a keep-alive) for this long is considered dead.
const SILENCE: Duration = Duration::from_secs(6);
/// How long a call keeps retrying a relay that is unreachable before it fails (override:
/// environment variable `STATIC_SDK_RETRY_TIMEOUT`, in seconds).
const RETRY_DEADLINE: Duration = Duration::from_secs(30);

fn retry_deadline_from_env() -> Duration {
    std::env::var("STATIC_SDK_RETRY_TIMEOUT")
        .ok()
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|v| v.is_finite() && *v >= 0.0)
        .map_or(RETRY_DEADLINE, Duration::from_secs_f64)
}
/// How long a call waits for the channel's background processing to reach a point.
const PROGRESS_TIMEOUT: Duration = Duration::from_secs(30);
/// Attempts at getting a commit accepted when other members keep winning the epoch.
const COMMIT_ATTEMPTS: usize = 16;
/// Most entries the applier applies in one transaction.
const BATCH: usize = 512;
/// Entries per Subscribe response we ask the relay for (it sends what is available at once).
const SUBSCRIBE_BATCH: u32 = 256;
const BACKOFF_MIN: Duration = Duration::from_millis(50);
const BACKOFF_MAX: Duration = Duration::from_secs(2);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn closed_error() -> Error {
    Error::Internal("the client is closed".into())
}

// --- tokens ---------------------------------------------------------------------------------

/// A bearer token for the relay and its lifetime.
#[derive(Debug, Clone)]
pub struct Token {
    pub value: String,
    pub expires_in: Duration,
}

/// Supplies relay tokens (the Python layer exchanges the API key at `POST /v1/tokens`).
/// `fetch` blocks; it is called from a blocking thread. An [`ErrorKind::Auth`] error is final
/// (the key is invalid or revoked); any other error is retried.
pub trait TokenProvider: Send + Sync + 'static {
    fn fetch(&self) -> Result<Token>;
}

struct CachedToken {
    value: String,
    refresh_at: Instant,
}

struct Tokens {
    provider: Option<Arc<dyn TokenProvider>>,
    cached: Mutex<Option<CachedToken>>,
    refreshing: tokio::sync::Mutex<()>,
}

impl Tokens {
    fn new(provider: Option<Arc<dyn TokenProvider>>, initial: Option<Token>) -> Self {
        Self {
            provider,
            cached: Mutex::new(initial.map(Self::cache)),
            refreshing: tokio::sync::Mutex::new(()),
        }
    }

    fn cache(token: Token) -> CachedToken {
        // Refresh ahead of expiry: 30 s early, or 10% of the lifetime for short-lived tokens.
        let margin = std::cmp::min(Duration::from_secs(30), token.expires_in / 10);
        CachedToken {
            value: token.value,
            refresh_at: Instant::now() + token.expires_in.saturating_sub(margin),
        }
    }

    fn current(&self) -> Option<String> {
        lock(&self.cached)
            .as_ref()
            .filter(|t| Instant::now() < t.refresh_at)
            .map(|t| t.value.clone())
    }

    /// The token to send, refreshed if it is close to expiry; `None` for anonymous access.
    async fn get(&self) -> Result<Option<String>> {
        let Some(provider) = &self.provider else {
            return Ok(None);
        };
        if let Some(value) = self.current() {
            return Ok(Some(value));
        }
        let _one_at_a_time = self.refreshing.lock().await;
        if let Some(value) = self.current() {
            return Ok(Some(value));
        }
        let provider = Arc::clone(provider);
        let token = tokio::task::spawn_blocking(move || provider.fetch())
            .await
            .map_err(|e| Error::Internal(format!("token refresh task failed: {e}")))??;
        let value = token.value.clone();
        *lock(&self.cached) = Some(Self::cache(token));
        Ok(Some(value))
    }

    /// The relay refused `token`: the next [`Tokens::get`] fetches a new one.
    fn invalidate(&self, token: Option<&str>) {
        let mut cached = lock(&self.cached);
        if cached.as_ref().map(|t| t.value.as_str()) == token {
            *cached = None;
        }
    }

    fn anonymous(&self) -> bool {
        self.provider.is_none()
    }
}

// --- the inbox ------------------------------------------------------------------------------

/// File of the hand-out marks inside the data directory.
const MARKS_FILE: &str = "inbox.marks";
/// Inbox rows read ahead into memory at once.
const INBOX_READ_AHEAD: usize = 1024;
/// Handed-out rows deleted together.
const INBOX_PRUNE: usize = 256;

/// Per channel, the id of the last inbox row handed to the caller, 8 bytes (little endian) at
/// `8 * slot` of `<data_dir>/inbox.marks`.
///
/// Taking a message must never hand it out twice, even after a kill; deleting its row (a
/// SQLite write transaction, ~60 µs) per message was the receiving side's largest cost. A
/// write of 8 bytes to a file (~1 µs) survives a killed process just as well (it is in the
/// OS's page cache once the call returns), so a message is handed out only once its mark is
/// written, and handed-out rows are deleted in bulk later. A power loss may take back the last
/// marks (and the message is handed out again), as it may take back light SQLite commits.
struct Marks {
    file: std::fs::File,
}

impl Marks {
    fn open(data_dir: &Path) -> Result<Self> {
        let path = data_dir.join(MARKS_FILE);
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| Error::Internal(format!("cannot open {}: {e}", path.display())))?;
        Ok(Self { file })
    }

    fn offset(slot: u64) -> u64 {
        slot.saturating_mul(8)
    }

    fn read(&self, slot: u64) -> Result<i64> {
        use std::os::unix::fs::FileExt;
        let mut buf = [0u8; 8];
        match self.file.read_exact_at(&mut buf, Self::offset(slot)) {
            Ok(()) => Ok(i64::from_le_bytes(buf)),
            // Never written: nothing handed out yet.
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(0),
            Err(e) => Err(Error::Internal(format!("cannot read the inbox marks: {e}"))),
        }
    }

    fn write(&self, slot: u64, id: i64) -> Result<()> {
        use std::os::unix::fs::FileExt;
        self.file
            .write_all_at(&id.to_le_bytes(), Self::offset(slot))
            .map_err(|e| Error::Internal(format!("cannot write the inbox marks: {e}")))
    }
}

/// A channel's inbox as its readers see it: rows read ahead, and what was handed out.
struct Inbox {
    slot: u64,
    /// The last row handed out (its mark).
    handed: i64,
    /// The last row read into `ahead`.
    loaded: i64,
    ahead: VecDeque<crate::store::InboxMessage>,
    /// Whether `ahead` holds every row stored so far: the applier reads in what it stores
    /// (see [`applier`]), so a reader finding `ahead` empty need not ask the store.
    complete: bool,
    /// Rows handed out and not yet deleted.
    unpruned: usize,
    /// Appliers of the channel running (see [`ApplierCount`]): normally one, two while a
    /// closed channel's applier outlives the wait for it when the channel is reopened.
    appliers: usize,
}

/// Counts an applier thread in its channel's inbox while it runs. Rows it stored are pushed
/// into the read-ahead only while it is the only one: ids follow the order of commits, and
/// with two appliers one could push its row ahead of a row the other committed before.
struct ApplierCount(Arc<Mutex<Inbox>>);

impl ApplierCount {
    fn new(inbox: Arc<Mutex<Inbox>>) -> Self {
        lock(&inbox).appliers += 1;
        Self(inbox)
    }
}

impl Drop for ApplierCount {
    fn drop(&mut self) {
        let mut inbox = lock(&self.0);
        inbox.appliers = inbox.appliers.saturating_sub(1);
    }
}

impl Inbox {
    /// Reads the rows stored after `loaded` into `ahead`, as many as it has room for.
    fn load(&mut self, engine: &Engine, name: &str) -> Result<()> {
        let room = INBOX_READ_AHEAD.saturating_sub(self.ahead.len());
        self.complete = false;
        if room == 0 {
            return Ok(());
        }
        let rows = engine.inbox_after(name, self.loaded, room)?;
        self.complete = rows.len() < room;
        if let Some(last) = rows.last() {
            self.loaded = last.id;
        }
        self.ahead.extend(rows);
        Ok(())
    }

    /// Takes rows the applier has just stored (in id order) straight into `ahead` if it holds
    /// every row stored before them and has room for them; otherwise returns false, and they
    /// are to be read from the store (see [`Inbox::load`]).
    fn push_stored(&mut self, rows: Vec<crate::store::InboxMessage>) -> bool {
        let follows = rows.first().is_some_and(|first| first.id > self.loaded);
        if self.appliers != 1
            || !self.complete
            || !follows
            || self.ahead.len() + rows.len() > INBOX_READ_AHEAD
        {
            return false;
        }
        if let Some(last) = rows.last() {
            self.loaded = last.id;
        }
        self.ahead.extend(rows);
        true
    }

    fn take(
        &mut self,
        engine: &Engine,
        marks: &Marks,
        name: &str,
    ) -> Result<Option<crate::store::InboxMessage>> {
        if self.ahead.is_empty() && !self.complete {
            self.load(engine, name)?;
        }
        let Some(id) = self.ahead.front().map(|m| m.id) else {
            return Ok(None);
        };
        marks.write(self.slot, id)?;
        self.handed = id;
        self.unpruned += 1;
        if self.unpruned >= INBOX_PRUNE {
            // Best effort: rows left behind are deleted by the next prune.
            if engine.inbox_prune(name, id).is_ok() {
                self.unpruned = 0;
            }
        }
        Ok(self.ahead.pop_front())
    }
}

// --- shared state ---------------------------------------------------------------------------

struct Shared {
    /// `None` once the client is closed: the data directory is released as soon as calls in
    /// flight (which hold their own reference) finish.
    engine: Mutex<Option<Arc<Engine>>>,
    relay: RelayClient,
    tokens: Tokens,
    handle: Handle,
    closed: std::sync::atomic::AtomicBool,
    retry_deadline: Duration,
    marks: Marks,
    inboxes: Mutex<HashMap<String, Arc<Mutex<Inbox>>>>,
    /// The last message a reader applied itself (see [`Shared::may_apply_inline`]).
    inline_applied: InlineApplied,
}

/// When a reader last applied a message itself and how long that took, on a monotonic clock.
struct InlineApplied {
    since: Instant,
    /// Nanoseconds from `since` to the end of the last such apply (0: none yet).
    ended: AtomicU64,
    /// How long it took, in nanoseconds.
    took: AtomicU64,
}

/// The readers apply messages themselves for at most 1 / (1 + this) of the time (see
/// [`Shared::may_apply_inline`]).
const INLINE_APPLY_SPACING: u64 = 4;

impl InlineApplied {
    fn new() -> Self {
        Self {
            since: Instant::now(),
            ended: AtomicU64::new(0),
            took: AtomicU64::new(0),
        }
    }

    fn now(&self) -> u64 {
        u64::try_from(self.since.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }
}

impl Shared {
    /// Whether a reader may apply a lone message itself (on the runtime's one worker) rather
    /// than hand it to its channel's applier thread: only if, since a reader last did, at least
    /// [`INLINE_APPLY_SPACING`] times as long has passed as that took. So sparse traffic, where
    /// the hand-over's thread wake-up is what a message waits for, is applied at once, while
    /// under load, or with many busy channels, decryption stays on the appliers (in parallel,
    /// and off the worker that serves every channel's network I/O).
    fn may_apply_inline(&self) -> bool {
        let applied = &self.inline_applied;
        let ended = applied.ended.load(Ordering::Relaxed);
        let took = applied.took.load(Ordering::Relaxed);
        ended == 0
            || applied.now().saturating_sub(ended) >= took.saturating_mul(INLINE_APPLY_SPACING)
    }

    /// Runs `apply`, a message a reader applies itself (see [`Shared::may_apply_inline`]).
    fn apply_inline<T>(&self, apply: impl FnOnce() -> T) -> T {
        let applied = &self.inline_applied;
        let started = applied.now();
        let value = apply();
        let ended = applied.now().max(1);
        applied
            .took
            .store(ended.saturating_sub(started), Ordering::Relaxed);
        applied.ended.store(ended, Ordering::Relaxed);
        value
    }

    fn engine(&self) -> Result<Arc<Engine>> {
        lock(&self.engine).clone().ok_or_else(closed_error)
    }

    /// The channel's inbox (the same for every [`Channel`] object of one name, so a reopened
    /// channel and the iterators of its closed predecessor never hand out a message twice).
    fn inbox(&self, engine: &Engine, name: &str) -> Result<Arc<Mutex<Inbox>>> {
        let mut inboxes = lock(&self.inboxes);
        if let Some(inbox) = inboxes.get(name) {
            return Ok(Arc::clone(inbox));
        }
        let slot = engine.inbox_slot(name)?;
        let handed = self.marks.read(slot)?;
        engine.inbox_prune(name, handed)?;
        let inbox = Arc::new(Mutex::new(Inbox {
            slot,
            handed,
            loaded: handed,
            ahead: VecDeque::new(),
            complete: false,
            unpruned: 0,
            appliers: 0,
        }));
        inboxes.insert(name.to_owned(), Arc::clone(&inbox));
        Ok(inbox)
    }

    /// Takes the next received message of `name`, marking it handed out.
    fn inbox_take(&self, engine: &Engine, name: &str) -> Result<Option<Vec<u8>>> {
        let inbox = self.inbox(engine, name)?;
        let mut inbox = lock(&inbox);
        Ok(inbox.take(engine, &self.marks, name)?.map(|m| m.payload))
    }

    fn check_open(&self) -> Result<()> {
        if self.closed.load(std::sync::atomic::Ordering::SeqCst) {
            Err(closed_error())
        } else {
            Ok(())
        }
    }

    /// A request carrying the auth metadata; returns the token used (to invalidate it if the
    /// relay refuses it).
    async fn request<T>(&self, message: T) -> Result<(Request<T>, Option<String>)> {
        let token = self.tokens.get().await?;
        let mut request = Request::new(message);
        if let Some(token) = &token {
            let value = format!("Bearer {token}")
                .parse()
                .map_err(|_| Error::Auth("the token is not a valid header value".into()))?;
            request.metadata_mut().insert("authorization", value);
        }
        Ok((request, token))
    }

    /// Runs a blocking engine call on tokio's blocking pool.
    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Engine) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let engine = self.engine()?;
        tokio::task::spawn_blocking(move || f(&engine))
            .await
            .map_err(|e| Error::Internal(format!("a background task failed: {e}")))?
    }

    /// Handles an `UNAUTHENTICATED` answer: a refused token is dropped so the next call fetches
    /// a fresh one; `strikes` counts refusals in a row (a fresh token refused too is final).
    fn on_unauthenticated(
        &self,
        status: &Status,
        token: Option<&str>,
        strikes: &mut u32,
    ) -> Result<()> {
        if self.tokens.anonymous() {
            return Err(Error::Auth(format!(
                "the relay requires a token ({}); pass api_key and api_url",
                status.message()
            )));
        }
        *strikes += 1;
        if *strikes > 2 {
            return Err(transport::status_error("relay", status));
        }
        self.tokens.invalidate(token);
        Ok(())
    }
}

/// How long one call may take to be answered (a relay that accepts connections but never
/// answers, or a TLS handshake that never completes, must not hang a caller).
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// Bounds one gRPC call: a call that times out is a transient failure (DEADLINE_EXCEEDED).
async fn bounded<T>(
    call: impl std::future::Future<Output = std::result::Result<T, Status>>,
) -> std::result::Result<T, Status> {
    match tokio::time::timeout(CALL_TIMEOUT, call).await {
        Ok(result) => result,
        Err(_) => Err(Status::deadline_exceeded(format!(
            "no answer from the relay within {CALL_TIMEOUT:?}"
        ))),
    }
}

fn backoff_next(current: Duration) -> Duration {
    std::cmp::min(current * 2, BACKOFF_MAX)
}

// --- the client -----------------------------------------------------------------------------

/// One agent's client: see the module docs.
pub struct Client {
    runtime: Mutex<Option<Runtime>>,
    shared: Arc<Shared>,
    channels: Mutex<HashMap<String, Arc<Channel>>>,
    identity: Vec<u8>,
    data_dir: std::path::PathBuf,
}

impl Client {
    /// Opens the engine of `identity` under `data_dir` and prepares (lazily) the connection to
    /// the relay at `endpoint`. `tokens` is `None` for anonymous access; `initial_token` saves
    /// the first fetch when the caller has just exchanged the key.
    pub fn open(
        endpoint: &str,
        data_dir: impl AsRef<Path>,
        identity: &[u8],
        tokens: Option<Arc<dyn TokenProvider>>,
        initial_token: Option<Token>,
    ) -> Result<Self> {
        let endpoint = transport::endpoint(endpoint)?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            // One worker: the connection, the readers and the publishers are light async work,
            // and on one thread they hand over to each other without waking another thread
            // (measured: a lower round trip than two workers on a 2-core machine). Encryption
            // runs on the senders' threads, decryption on each channel's applier thread.
            .worker_threads(1)
            // Token fetches and commits only.
            .max_blocking_threads(8)
            .thread_name("static-sdk")
            .enable_all()
            .build()
            .map_err(|e| Error::Internal(format!("cannot start the runtime: {e}")))?;
        let data_dir = data_dir.as_ref().to_owned();
        let engine = Arc::new(Engine::open(&data_dir, identity)?);
        // Opened under the engine's directory lock.
        let marks = Marks::open(&data_dir)?;
        // connect_lazy spawns onto the current runtime.
        let relay = {
            let _guard = runtime.enter();
            transport::connect_lazy(&endpoint)
        };
        let shared = Arc::new(Shared {
            engine: Mutex::new(Some(engine)),
            relay,
            tokens: Tokens::new(tokens, initial_token),
            handle: runtime.handle().clone(),
            closed: std::sync::atomic::AtomicBool::new(false),
            retry_deadline: retry_deadline_from_env(),
            marks,
            inboxes: Mutex::new(HashMap::new()),
            inline_applied: InlineApplied::new(),
        });
        Ok(Self {
            runtime: Mutex::new(Some(runtime)),
            shared,
            channels: Mutex::new(HashMap::new()),
            identity: identity.to_vec(),
            data_dir,
        })
    }

    pub fn identity(&self) -> &[u8] {
        &self.identity
    }

    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    fn block_on<T>(&self, fut: impl std::future::Future<Output = Result<T>>) -> Result<T> {
        self.shared.check_open()?;
        self.shared.handle.block_on(fut)
    }

    /// A fresh key package for a member to add us with.
    pub fn generate_key_package(&self) -> Result<Vec<u8>> {
        self.shared.check_open()?;
        self.shared.engine()?.generate_key_package()
    }

    /// The channels this identity is a member of under its data directory.
    pub fn channels(&self) -> Result<Vec<String>> {
        self.shared.check_open()?;
        Ok(self.shared.engine()?.group_names())
    }

    /// Creates `name` on the relay and its MLS group with us as the only member.
    pub fn create_channel(&self, name: &str) -> Result<Arc<Channel>> {
        crate::validate_channel_name(name)?;
        if self.shared.engine()?.has_group(name) {
            return Err(Error::Mls(format!(
                "already a member of channel {name:?}; use open_channel to reopen it"
            )));
        }
        let shared = Arc::clone(&self.shared);
        let owned = name.to_owned();
        self.block_on(async move {
            let deadline = Instant::now() + shared.retry_deadline;
            let mut backoff = BACKOFF_MIN;
            let mut strikes = 0;
            let mut retried = false;
            loop {
                let (request, token) = shared
                    .request(pb::CreateChannelRequest {
                        channel: owned.clone(),
                    })
                    .await?;
                match bounded(shared.relay.clone().create_channel(request)).await {
                    Ok(_) => return Ok(()),
                    // Our own earlier attempt may have created it before its answer was lost.
                    Err(status) if status.code() == Code::AlreadyExists && retried => return Ok(()),
                    Err(status) if status.code() == Code::AlreadyExists => {
                        return Err(Error::Mls(format!(
                            "channel {owned:?} already exists on the relay; join it with a \
                             Welcome from one of its members"
                        )))
                    }
                    Err(status) if status.code() == Code::Unauthenticated => {
                        shared.on_unauthenticated(&status, token.as_deref(), &mut strikes)?;
                    }
                    Err(status)
                        if transport::is_transient(&status) && Instant::now() < deadline =>
                    {
                        retried = true;
                        tokio::time::sleep(backoff).await;
                        backoff = backoff_next(backoff);
                    }
                    Err(status) => return Err(transport::status_error("CreateChannel", &status)),
                }
            }
        })?;
        let owned = name.to_owned();
        self.block_on(self.shared.blocking(move |e| e.create_group(&owned)))?;
        self.start_channel(name)
    }

    /// Joins `name` from a Welcome produced by a member's `add_member`.
    pub fn join_channel(&self, name: &str, welcome: &[u8]) -> Result<Arc<Channel>> {
        crate::validate_channel_name(name)?;
        let owned = name.to_owned();
        let welcome = welcome.to_vec();
        self.block_on(
            self.shared
                .blocking(move |e| e.join_group(&owned, &welcome)),
        )?;
        let channel = self.start_channel(name)?;
        // Surface a relay that refuses the channel (another account's, or no access) now
        // rather than on the first read.
        if let Err(e) = self.block_on(channel.wait_connected(Duration::from_secs(10))) {
            // A refused channel cannot be used: forget the group so that channels() does not
            // list it. An auth failure keeps it, to be reopened once the key is fixed.
            if e.kind() != ErrorKind::Auth {
                channel.close();
                lock(&self.channels).remove(name);
                self.shared.engine()?.forget_group(name)?;
            }
            return Err(e);
        }
        Ok(channel)
    }

    /// Reopens a channel of ours (see [`Client::channels`]): processing resumes after the last
    /// entry applied before.
    pub fn open_channel(&self, name: &str) -> Result<Arc<Channel>> {
        crate::validate_channel_name(name)?;
        self.shared.check_open()?;
        if let Some(open) = lock(&self.channels).get(name) {
            if !open.is_closed() {
                return Ok(Arc::clone(open));
            }
        }
        if !self.shared.engine()?.has_group(name) {
            return Err(Error::Mls(format!("not a member of channel {name:?}")));
        }
        self.start_channel(name)
    }

    fn start_channel(&self, name: &str) -> Result<Arc<Channel>> {
        let mut channels = lock(&self.channels);
        if let Some(open) = channels.get(name) {
            if !open.is_closed() {
                return Ok(Arc::clone(open));
            }
            // A closed predecessor's tasks must be gone before new ones apply the same log.
            let tasks: Vec<_> = lock(&open.tasks).drain(..).collect();
            self.block_on(async move {
                for task in tasks {
                    let _ = tokio::time::timeout(PROGRESS_TIMEOUT, task).await;
                }
                Ok(())
            })?;
        }
        let channel = Channel::start(Arc::clone(&self.shared), name)?;
        channels.insert(name.to_owned(), Arc::clone(&channel));
        Ok(channel)
    }

    /// Stops every channel's background work, waits briefly for it, and releases the data
    /// directory. Idempotent.
    pub fn close(&self) {
        self.shared
            .closed
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let channels: Vec<_> = lock(&self.channels).drain().map(|(_, c)| c).collect();
        for channel in &channels {
            channel.close();
        }
        if let Some(runtime) = lock(&self.runtime).take() {
            runtime.shutdown_timeout(Duration::from_secs(2));
        }
        // The readers are gone with the runtime, so the appliers end after their current batch;
        // they hold the engine, which must be released before this returns.
        for channel in channels {
            if let Some(thread) = lock(&channel.applier_thread).take() {
                let _ = thread.join();
            }
        }
        // Dropping the last reference checkpoints the store and releases the directory lock.
        lock(&self.shared.engine).take();
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        self.shared
            .closed
            .store(true, std::sync::atomic::Ordering::SeqCst);
        for channel in lock(&self.channels).values() {
            channel.close();
        }
        // Never wait here: a drop may run where waiting for the runtime would deadlock.
        if let Some(runtime) = lock(&self.runtime).take() {
            runtime.shutdown_background();
        }
        lock(&self.shared.engine).take();
    }
}

// --- channels -------------------------------------------------------------------------------

/// Why a channel stopped.
#[derive(Debug, Clone)]
pub enum End {
    /// Closed by us.
    Closed,
    /// A commit removed us from the group (or we left).
    Removed,
    /// A failure that retrying cannot fix (auth refused, channel unknown to the relay, ...).
    Failed(Error),
}

impl End {
    fn error(&self, name: &str) -> Error {
        match self {
            End::Closed => Error::Internal(format!("channel {name:?} is closed")),
            End::Removed => Error::Mls(format!("no longer a member of channel {name:?}")),
            End::Failed(err) => err.clone(),
        }
    }
}

/// How far the applier has got.
#[derive(Debug, Clone, Default)]
pub struct Progress {
    /// The last seq applied (or skipped).
    pub applied_seq: u64,
    /// The group's epoch after it.
    pub epoch: u64,
    /// The channel's last seq as of the latest keep-alive.
    pub head_seq: u64,
    /// Whether a subscription is currently established.
    pub connected: bool,
    pub ended: Option<End>,
}

/// What a wait for the next message found.
#[derive(Debug)]
pub enum Next {
    Message(Vec<u8>),
    /// Nothing yet.
    Empty,
    /// The channel has ended and its inbox is empty.
    End,
}

/// When the latest message of a channel passed each stage, in nanoseconds of the system
/// clock (comparable across processes on one machine): what `bench/e2e.py` breaks a round
/// trip down with. Relaxed atomic stores, a few nanoseconds per message.
#[derive(Debug, Default)]
pub struct Timings {
    /// A send began (its payload was queued for encryption).
    pub send_started: AtomicU64,
    /// Its message was encrypted and handed to the publisher.
    pub send_encrypted: AtomicU64,
    /// The relay acknowledged it.
    pub send_acked: AtomicU64,
    /// Entries arrived from the relay.
    pub received: AtomicU64,
    /// They were applied (decrypted, stored in the inbox).
    pub applied: AtomicU64,
    /// A message was handed to the caller.
    pub handed_out: AtomicU64,
}

/// Now, in nanoseconds since the Unix epoch.
pub fn now_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

fn stamp(at: &AtomicU64) {
    at.store(now_ns(), Ordering::Relaxed);
}

/// A payload waiting to be encrypted (see [`Channel::send`]).
struct Pending {
    payload: Arc<Vec<u8>>,
    deadline: Instant,
    reply: oneshot::Sender<Outcome>,
}

/// One channel of ours, with its background tasks. See the module docs.
pub struct Channel {
    name: String,
    shared: Arc<Shared>,
    progress: watch::Sender<Progress>,
    /// Bumped whenever the inbox gains messages or the channel ends.
    signal: (Mutex<u64>, Condvar),
    wakers: Mutex<Vec<UnixStream>>,
    commit_lock: tokio::sync::Mutex<()>,
    /// Payloads waiting for the encryption lock; whoever holds it encrypts them all.
    encrypt_queue: Mutex<Vec<Pending>>,
    /// Held while encrypting (not while syncing to disk, so the next batch can be encrypted
    /// meanwhile).
    encrypt_lock: Mutex<()>,
    /// Batches are handed to the publisher in the order they were encrypted (receivers
    /// tolerate only a few messages out of order): (next ticket, next ticket to hand over).
    handoff: (Mutex<(u64, u64)>, Condvar),
    outbound: mpsc::UnboundedSender<Vec<Outbound>>,
    /// Our own messages, for the applier to skip when they come back.
    own_messages: Mutex<OwnMessages>,
    timings: Timings,
    /// Batches the reader handed to the applier thread that it has not finished applying
    /// (see [`reader`]).
    queued: AtomicUsize,
    shutdown: watch::Sender<bool>,
    tasks: Mutex<Vec<tokio::task::JoinHandle<()>>>,
    applier_thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

/// A readiness socket for async waiting: readable whenever the channel's inbox may have gained
/// messages (or the channel ended). Event loops (trio, asyncio) wait on [`Waker::fileno`]
/// without a thread.
pub struct Waker {
    reader: UnixStream,
}

impl Waker {
    pub fn fileno(&self) -> i32 {
        use std::os::fd::AsRawFd;
        self.reader.as_raw_fd()
    }

    /// Consumes pending wake-ups (call before re-checking the inbox).
    pub fn drain(&self) {
        let mut buf = [0u8; 256];
        // Non-blocking: stops at WouldBlock (nothing left) or on any error.
        while let Ok(n) = (&self.reader).read(&mut buf) {
            if n < buf.len() {
                break;
            }
        }
    }
}

impl Channel {
    fn start(shared: Arc<Shared>, name: &str) -> Result<Arc<Self>> {
        let engine = shared.engine()?;
        let cursor = engine.cursor(name)?;
        let epoch = engine.epoch(name)?;
        let applied_seq = match cursor {
            Cursor::After(seq) => seq,
            Cursor::FromEpoch(_) => 0,
        };
        let (progress, _) = watch::channel(Progress {
            applied_seq,
            epoch,
            ..Progress::default()
        });
        let (outbound, outbound_rx) = mpsc::unbounded_channel();
        let (shutdown, _) = watch::channel(false);
        let channel = Arc::new(Self {
            name: name.to_owned(),
            shared: Arc::clone(&shared),
            progress,
            signal: (Mutex::new(0), Condvar::new()),
            wakers: Mutex::new(Vec::new()),
            commit_lock: tokio::sync::Mutex::new(()),
            encrypt_queue: Mutex::new(Vec::new()),
            encrypt_lock: Mutex::new(()),
            handoff: (Mutex::new((0, 0)), Condvar::new()),
            outbound,
            own_messages: Mutex::new(OwnMessages::default()),
            timings: Timings::default(),
            queued: AtomicUsize::new(0),
            shutdown,
            tasks: Mutex::new(Vec::new()),
            applier_thread: Mutex::new(None),
        });
        let (entries_tx, entries_rx) = mpsc::channel(16);
        // The tasks hold the channel weakly where they can, strongly where they must finish a
        // step; all stop when `shutdown` flips.
        let (applier_done, applied_all) = oneshot::channel::<()>();
        let counted = ApplierCount::new(shared.inbox(&engine, name)?);
        let applier_thread = {
            let channel = Arc::clone(&channel);
            std::thread::Builder::new()
                .name("static-applier".into())
                .spawn(move || {
                    let _done = applier_done;
                    let _counted = counted;
                    applier(channel, entries_rx);
                })
                .map_err(|e| Error::Internal(format!("cannot start the applier thread: {e}")))?
        };
        let tasks = vec![
            shared
                .handle
                .spawn(reader(Arc::clone(&channel), cursor, entries_tx)),
            // Completes when the applier thread has finished.
            shared.handle.spawn(async move {
                let _ = applied_all.await;
            }),
            shared
                .handle
                .spawn(publisher(Arc::clone(&channel), outbound_rx)),
        ];
        *lock(&channel.tasks) = tasks;
        *lock(&channel.applier_thread) = Some(applier_thread);
        Ok(channel)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// When the latest message passed each stage (see [`Timings`]).
    pub fn timings(&self) -> &Timings {
        &self.timings
    }

    pub fn progress(&self) -> Progress {
        self.progress.borrow().clone()
    }

    /// Closed, removed or failed (set before any waiter is woken).
    pub fn is_closed(&self) -> bool {
        self.progress.borrow().ended.is_some()
    }

    fn block_on<T>(&self, fut: impl std::future::Future<Output = Result<T>>) -> Result<T> {
        self.shared.check_open()?;
        self.shared.handle.block_on(fut)
    }

    fn check_usable(&self) -> Result<()> {
        self.shared.check_open()?;
        match &self.progress.borrow().ended {
            Some(end) => Err(end.error(&self.name)),
            None => Ok(()),
        }
    }

    fn end(&self, end: End) {
        self.progress.send_modify(|p| {
            if p.ended.is_none() {
                p.ended = Some(end);
            }
            p.connected = false;
        });
        let _ = self.shutdown.send(true);
        self.notify();
    }

    /// Stops the background tasks; messages already received stay in the inbox for the next
    /// opening. Idempotent.
    pub fn close(&self) {
        self.end(End::Closed);
    }

    fn notify(&self) {
        {
            let mut generation = lock(&self.signal.0);
            *generation = generation.wrapping_add(1);
        }
        self.signal.1.notify_all();
        let mut wakers = lock(&self.wakers);
        // A full socket is already readable; a closed one belongs to a dropped waiter.
        wakers.retain(|w| match (&*w).write(&[1]) {
            Ok(_) => true,
            Err(e) => e.kind() == std::io::ErrorKind::WouldBlock,
        });
    }

    /// A readiness socket for one async waiter.
    pub fn waker(&self) -> Result<Waker> {
        let (reader, writer) = UnixStream::pair()
            .map_err(|e| Error::Internal(format!("cannot create a readiness socket: {e}")))?;
        for s in [&reader, &writer] {
            s.set_nonblocking(true)
                .map_err(|e| Error::Internal(format!("cannot set up a readiness socket: {e}")))?;
        }
        lock(&self.wakers).push(writer);
        Ok(Waker { reader })
    }

    /// Takes the next received message without waiting.
    pub fn poll_next(&self) -> Result<Next> {
        // A closed client ends its channels' iterators.
        let Ok(engine) = self.shared.engine() else {
            return Ok(Next::End);
        };
        if let Some(payload) = self.shared.inbox_take(&engine, &self.name)? {
            stamp(&self.timings.handed_out);
            return Ok(Next::Message(payload));
        }
        let ended = self.progress.borrow().ended.clone();
        match ended {
            None => Ok(Next::Empty),
            Some(end) => {
                // Messages stored before the end are still handed out.
                if let Some(payload) = self.shared.inbox_take(&engine, &self.name)? {
                    return Ok(Next::Message(payload));
                }
                match end {
                    End::Failed(_) => Err(end.error(&self.name)),
                    End::Closed | End::Removed => Ok(Next::End),
                }
            }
        }
    }

    /// Waits up to `timeout` for the next received message (blocking the calling thread).
    pub fn wait_next(&self, timeout: Duration) -> Result<Next> {
        let deadline = Instant::now() + timeout;
        loop {
            let seen = *lock(&self.signal.0);
            match self.poll_next()? {
                Next::Empty => {}
                other => return Ok(other),
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(Next::Empty);
            }
            let guard = lock(&self.signal.0);
            if *guard == seen {
                let _ = self
                    .signal
                    .1
                    .wait_timeout(guard, deadline - now)
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
            }
        }
    }

    /// How many received messages wait to be read.
    pub fn pending(&self) -> Result<u64> {
        let engine = self.shared.engine()?;
        let inbox = self.shared.inbox(&engine, &self.name)?;
        let handed = lock(&inbox).handed;
        engine.inbox_count_after(&self.name, handed)
    }

    /// Encrypts `payload` and publishes it; returns once the relay has it in the channel's log.
    ///
    /// Runs on the caller's thread up to the publishing: concurrent senders queue their
    /// payloads, and the one that gets the encryption lock encrypts everything queued in one
    /// transaction (flat combining) and hands the messages to the publisher task, which keeps
    /// one pipelined `PublishBatches` call open. Refusals are handled here: a stale epoch is
    /// caught up with and the payload encrypted again; a transient refusal (store unavailable,
    /// rate limit) is retried until the retry deadline, encrypted again too: a refused message
    /// is certainly not in the log, and resending its old bytes after later messages of ours
    /// were accepted could put it beyond the receivers' out-of-order tolerance. A message the
    /// relay did not answer for (it may be in the log) is resent with the same bytes, which the
    /// relay's idempotency makes safe.
    pub fn send(&self, payload: Vec<u8>) -> Result<()> {
        if payload.len() > MAX_PAYLOAD {
            return Err(Error::Transport(format!(
                "payload of {} bytes exceeds the maximum of {MAX_PAYLOAD} bytes per message",
                payload.len()
            )));
        }
        self.check_usable()?;
        stamp(&self.timings.send_started);
        if self.shared.engine()?.needs_fresh_epoch(&self.name)? {
            // The machine went down while this channel was open: move to a new epoch first.
            self.block_on(self.commit(Arc::new(|e: &Engine, name: &str| {
                Ok(if e.needs_fresh_epoch(name)? {
                    Some((e.self_update(name)?, None))
                } else {
                    None
                })
            })))?;
        }
        let payload = Arc::new(payload);
        let deadline = Instant::now() + self.shared.retry_deadline;
        let mut answer = self.encrypt_and_publish(&payload, deadline);
        let mut reencrypted = 0;
        let mut strikes = 0;
        let mut backoff = BACKOFF_MIN;
        loop {
            let outcome = answer.blocking_recv().map_err(|_| self.ended_error())?;
            let (refusal, unanswered) = match outcome {
                Outcome::Accepted => {
                    stamp(&self.timings.send_acked);
                    return Ok(());
                }
                Outcome::Failed(e) if self.awaits_proposal_commit(&e) => {
                    // A member's proposal (e.g. a leave) is pending: MLS forbids application
                    // messages until a commit covers it, which a member makes at once (see
                    // the applier). Wait for that epoch, then encrypt again.
                    let epoch = self.shared.engine()?.epoch(&self.name)?;
                    self.block_on(self.wait_epoch(epoch + 1))?;
                    if Instant::now() >= deadline {
                        return Err(e);
                    }
                    answer = self.encrypt_and_publish(&payload, deadline);
                    continue;
                }
                Outcome::Failed(e) => return Err(e),
                Outcome::Refused(refusal) => (refusal, None),
                Outcome::Unanswered(refusal, message) => (refusal, Some(message)),
            };
            let status = Status::new(Code::from(refusal.code as i32), refusal.message.clone());
            match status.code() {
                Code::FailedPrecondition if reencrypted < 3 => {
                    // Encrypted at an epoch the relay no longer accepts (the group moved on by
                    // more than its window): catch up and encrypt again.
                    reencrypted += 1;
                    self.block_on(self.wait_epoch(refusal.current_epoch))?;
                    answer = self.encrypt_and_publish(&payload, deadline);
                    continue;
                }
                Code::Unauthenticated => {
                    self.shared
                        .on_unauthenticated(&status, None, &mut strikes)?;
                }
                Code::ResourceExhausted if refusal.retry_after_ms > 0 => {
                    std::thread::sleep(Duration::from_millis(refusal.retry_after_ms));
                }
                _ if transport::is_transient(&status) && Instant::now() < deadline => {
                    std::thread::sleep(backoff);
                    backoff = backoff_next(backoff);
                }
                _ => return Err(transport::status_error("Publish", &status)),
            }
            self.check_usable()?;
            let Some(message) = unanswered else {
                answer = self.encrypt_and_publish(&payload, deadline);
                continue;
            };
            let (reply, next) = oneshot::channel();
            self.outbound
                .send(vec![Outbound {
                    message,
                    deadline,
                    reply,
                }])
                .map_err(|_| self.ended_error())?;
            answer = next;
        }
    }

    /// Whether `error` (from encrypting) is MLS refusing to send while proposals are pending.
    fn awaits_proposal_commit(&self, error: &Error) -> bool {
        error.kind() == ErrorKind::Mls
            && self
                .shared
                .engine()
                .and_then(|e| e.has_pending_proposals(&self.name))
                .unwrap_or(false)
    }

    /// Queues `payload` for encryption, encrypts the queue if nobody else is doing it, and
    /// returns where the outcome of its publishing will come.
    fn encrypt_and_publish(
        &self,
        payload: &Arc<Vec<u8>>,
        deadline: Instant,
    ) -> oneshot::Receiver<Outcome> {
        let (reply, answer) = oneshot::channel();
        lock(&self.encrypt_queue).push(Pending {
            payload: Arc::clone(payload),
            deadline,
            reply,
        });
        let encrypting = lock(&self.encrypt_lock);
        let batch = std::mem::take(&mut *lock(&self.encrypt_queue));
        if batch.is_empty() {
            // Another sender encrypted ours along with its own.
            return answer;
        }
        let engine = self.shared.engine();
        let encrypted = engine.as_ref().map_err(Clone::clone).and_then(|engine| {
            let refs: Vec<&[u8]> = batch.iter().map(|p| p.payload.as_slice()).collect();
            engine.encrypt_many_unsynced(&self.name, &refs)
        });
        let ticket = {
            let mut handoff = lock(&self.handoff.0);
            handoff.0 += 1;
            handoff.0 - 1
        };
        drop(encrypting);
        // Nothing leaves before the state that produced it is written (and, where a crash of
        // the machine could not be told afterwards, on disk).
        let encrypted = encrypted.and_then(|messages| {
            engine
                .as_ref()
                .map_err(Clone::clone)
                .and_then(|engine| engine.sync_before_send())
                .map(|()| messages)
        });
        let mut handoff = lock(&self.handoff.0);
        while handoff.1 != ticket {
            handoff = self
                .handoff
                .1
                .wait(handoff)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
        match encrypted {
            Ok(messages) => {
                {
                    let mut own = lock(&self.own_messages);
                    for message in &messages {
                        own.remember(message);
                    }
                }
                let items = batch
                    .into_iter()
                    .zip(messages)
                    .map(|(p, message)| Outbound {
                        message,
                        deadline: p.deadline,
                        reply: p.reply,
                    })
                    .collect();
                stamp(&self.timings.send_encrypted);
                // A publisher that is gone drops the replies: the senders see the channel's end.
                let _ = self.outbound.send(items);
            }
            Err(e) => {
                for p in batch {
                    let _ = p.reply.send(Outcome::Failed(e.clone()));
                }
            }
        }
        handoff.1 += 1;
        drop(handoff);
        self.handoff.1.notify_all();
        answer
    }

    fn ended_error(&self) -> Error {
        match &self.progress.borrow().ended {
            Some(end) => end.error(&self.name),
            None => Error::Internal(format!("channel {:?} is closed", self.name)),
        }
    }

    /// Adds the owner of `key_package`; returns the Welcome once the commit is in the log and
    /// merged.
    pub fn add_member(&self, key_package: Vec<u8>) -> Result<Vec<u8>> {
        let welcome = self.block_on(self.commit(Arc::new(move |e: &Engine, name: &str| {
            let out = e.add_member(name, &key_package)?;
            Ok(Some((out.commit, Some(out.welcome))))
        })))?;
        welcome.ok_or_else(|| Error::Internal("the commit produced no Welcome".into()))
    }

    /// Removes the member(s) with credential identity `identity`.
    pub fn remove_member(&self, identity: Vec<u8>) -> Result<()> {
        self.block_on(self.commit(Arc::new(move |e: &Engine, name: &str| {
            Ok(Some((e.remove_member(name, &identity)?, None)))
        })))?;
        Ok(())
    }

    /// Rotates our leaf keys (post-compromise security).
    pub fn rotate_keys(&self) -> Result<()> {
        self.block_on(self.commit(Arc::new(|e: &Engine, name: &str| {
            Ok(Some((e.self_update(name)?, None)))
        })))?;
        Ok(())
    }

    /// Proposes our removal and waits until a member commits it (the channel then ends).
    pub fn leave(&self) -> Result<()> {
        self.check_usable()?;
        if self.shared.engine()?.members(&self.name)?.len() < 2 {
            return Err(Error::Mls(format!(
                "cannot leave channel {:?}: we are its only member",
                self.name
            )));
        }
        self.block_on(async {
            let _guard = self.commit_lock.lock().await;
            for _ in 0..COMMIT_ATTEMPTS {
                let proposal = self
                    .shared
                    .blocking({
                        let name = self.name.clone();
                        move |e| e.leave(&name)
                    })
                    .await?;
                match self.publish_handshake(proposal, None).await? {
                    Published::Accepted(_) => {
                        let mut rx = self.progress.subscribe();
                        let waited = tokio::time::timeout(
                            PROGRESS_TIMEOUT,
                            rx.wait_for(|p| p.ended.is_some()),
                        )
                        .await;
                        return match waited {
                            Ok(_) => Ok(()),
                            Err(_) => Err(Error::Transport(
                                "the leave proposal is published but no member committed it yet"
                                    .into(),
                            )),
                        };
                    }
                    Published::Stale(epoch) => self.wait_epoch(epoch).await?,
                }
            }
            Err(Error::Transport(
                "the channel is too busy to leave now".into(),
            ))
        })
    }

    /// The members' identities, by leaf index.
    pub fn members(&self) -> Result<Vec<Member>> {
        self.shared.check_open()?;
        self.shared.engine()?.members(&self.name)
    }

    pub fn epoch(&self) -> Result<u64> {
        self.shared.engine()?.epoch(&self.name)
    }

    pub fn epoch_authenticator(&self) -> Result<Vec<u8>> {
        self.shared.engine()?.epoch_authenticator(&self.name)
    }

    /// Waits until the first subscription is established (or the channel failed).
    async fn wait_connected(&self, timeout: Duration) -> Result<()> {
        let mut rx = self.progress.subscribe();
        let _ =
            tokio::time::timeout(timeout, rx.wait_for(|p| p.connected || p.ended.is_some())).await;
        let ended = self.progress.borrow().ended.clone();
        match ended {
            Some(end @ End::Failed(_)) => Err(end.error(&self.name)),
            _ => Ok(()),
        }
    }

    /// Waits until the applier has passed `seq`.
    async fn wait_applied(&self, seq: u64) -> Result<()> {
        let mut rx = self.progress.subscribe();
        let waited = tokio::time::timeout(
            PROGRESS_TIMEOUT,
            rx.wait_for(|p| p.applied_seq >= seq || p.ended.is_some()),
        )
        .await;
        if waited.is_err() {
            return Err(Error::Transport(format!(
                "the channel's log did not reach seq {seq} within {PROGRESS_TIMEOUT:?}"
            )));
        }
        let p = self.progress.borrow().clone();
        match p.ended {
            Some(end) if p.applied_seq < seq => Err(end.error(&self.name)),
            _ => Ok(()),
        }
    }

    /// Waits until the applier has reached `epoch` (the winner of a lost commit race).
    async fn wait_epoch(&self, epoch: u64) -> Result<()> {
        let mut rx = self.progress.subscribe();
        let waited = tokio::time::timeout(
            PROGRESS_TIMEOUT,
            rx.wait_for(|p| p.epoch >= epoch || p.ended.is_some()),
        )
        .await;
        if waited.is_err() {
            return Err(Error::Transport(format!(
                "the channel did not reach epoch {epoch} within {PROGRESS_TIMEOUT:?}"
            )));
        }
        match self.progress.borrow().ended.clone() {
            Some(end) => Err(end.error(&self.name)),
            None => Ok(()),
        }
    }

    /// The commit protocol: create (via `make`), publish with the epoch fence, wait for the
    /// applier to merge its echo; on a lost race drop it, apply the winner and retry. `make`
    /// returns `None` when there is nothing to commit.
    async fn commit(&self, make: Arc<CommitMaker>) -> Result<Option<Vec<u8>>> {
        self.check_usable()?;
        let _guard = self.commit_lock.lock().await;
        for _ in 0..COMMIT_ATTEMPTS {
            let name = self.name.clone();
            let maker = Arc::clone(&make);
            let Some((commit, welcome)) = self.shared.blocking(move |e| maker(e, &name)).await?
            else {
                return Ok(None);
            };
            let published = self.publish_handshake(commit, welcome.clone()).await;
            match published {
                Ok(Published::Accepted(seq)) => {
                    self.wait_applied(seq).await?;
                    return Ok(welcome);
                }
                Ok(Published::Stale(epoch)) => {
                    self.clear_pending().await?;
                    self.wait_epoch(epoch).await?;
                }
                Err(e) => {
                    // Not in the log: drop it so the group can move on.
                    self.clear_pending().await?;
                    return Err(e);
                }
            }
        }
        Err(Error::Transport(format!(
            "channel {:?} is too busy: other members' commits won {COMMIT_ATTEMPTS} times in a row",
            self.name
        )))
    }

    async fn clear_pending(&self) -> Result<()> {
        let name = self.name.clone();
        self.shared
            .blocking(move |e| {
                if e.has_group(&name) {
                    e.clear_pending_commit(&name)
                } else {
                    Ok(())
                }
            })
            .await
    }

    /// Publishes a commit or proposal, retrying (with the same idempotency key) while the relay
    /// is unreachable.
    async fn publish_handshake(
        &self,
        message: Vec<u8>,
        welcome: Option<Vec<u8>>,
    ) -> Result<Published> {
        let deadline = Instant::now() + self.shared.retry_deadline;
        let mut backoff = BACKOFF_MIN;
        let mut strikes = 0;
        loop {
            let (request, token) = self
                .shared
                .request(pb::PublishRequest {
                    channel: self.name.clone(),
                    message: message.clone(),
                    welcome: welcome.clone().unwrap_or_default(),
                    idempotency_key: Vec::new(),
                })
                .await?;
            match bounded(self.shared.relay.clone().publish(request)).await {
                Ok(response) => return Ok(Published::Accepted(response.into_inner().seq)),
                Err(status) => match status.code() {
                    Code::FailedPrecondition => {
                        let epoch = transport::current_epoch(&status)
                            .ok_or_else(|| transport::status_error("Publish", &status))?;
                        return Ok(Published::Stale(epoch));
                    }
                    Code::Unauthenticated => {
                        self.shared
                            .on_unauthenticated(&status, token.as_deref(), &mut strikes)?;
                    }
                    Code::ResourceExhausted if transport::retry_after(&status).is_some() => {
                        let wait = transport::retry_after(&status).unwrap_or(BACKOFF_MIN);
                        tokio::time::sleep(wait).await;
                    }
                    _ if transport::is_transient(&status) && Instant::now() < deadline => {
                        tokio::time::sleep(backoff).await;
                        backoff = backoff_next(backoff);
                    }
                    _ => return Err(transport::status_error("Publish", &status)),
                },
            }
        }
    }
}

type CommitMaker =
    dyn Fn(&Engine, &str) -> Result<Option<(Vec<u8>, Option<Vec<u8>>)>> + Send + Sync;

enum Published {
    Accepted(u64),
    Stale(u64),
}

// --- background tasks -------------------------------------------------------------------------

/// Subscribes to the channel's log and forwards entries, in order, to the applier.
async fn reader(channel: Arc<Channel>, cursor: Cursor, entries: mpsc::Sender<Received>) {
    let mut shutdown = channel.shutdown.subscribe();
    let mut start = cursor;
    let mut backoff = BACKOFF_MIN;
    let mut strikes = 0;
    let shared = Arc::clone(&channel.shared);
    loop {
        if *shutdown.borrow() {
            return;
        }
        let start_field = match start {
            Cursor::After(seq) => pb::subscribe_request::Start::AfterSeq(seq),
            Cursor::FromEpoch(epoch) => pb::subscribe_request::Start::FromEpoch(epoch),
        };
        let request = shared
            .request(pb::SubscribeRequest {
                channel: channel.name.clone(),
                start: Some(start_field),
                max_batch: SUBSCRIBE_BATCH,
            })
            .await;
        let (request, token) = match request {
            Ok(r) => r,
            Err(e) if e.kind() == ErrorKind::Auth => {
                channel.end(End::Failed(e));
                return;
            }
            Err(_) => {
                // The token endpoint is unreachable: keep trying.
                if sleep_or_shutdown(&mut shutdown, backoff).await {
                    return;
                }
                backoff = backoff_next(backoff);
                continue;
            }
        };
        let mut relay = shared.relay.clone();
        let subscribed = tokio::select! {
            _ = shutdown.changed() => return,
            r = bounded(relay.subscribe(request)) => r,
        };
        let failure = match subscribed {
            Ok(response) => {
                let mut stream = response.into_inner();
                loop {
                    let item = tokio::select! {
                        _ = shutdown.changed() => return,
                        r = tokio::time::timeout(SILENCE, stream.message()) => r,
                    };
                    match item {
                        Err(_silent) => break None,
                        Ok(Ok(None)) => break None,
                        Ok(Err(status)) => break Some(status),
                        Ok(Ok(Some(response))) => {
                            backoff = BACKOFF_MIN;
                            strikes = 0;
                            // Live once the relay sends something (it opens with a keep-alive;
                            // a refusal may come after the response headers).
                            channel
                                .progress
                                .send_if_modified(|p| !std::mem::replace(&mut p.connected, true));
                            let batch = match response.item {
                                Some(pb::subscribe_response::Item::Entry(entry)) => vec![entry],
                                Some(pb::subscribe_response::Item::Entries(batch)) => batch.entries,
                                Some(pb::subscribe_response::Item::KeepAlive(k)) => {
                                    channel.progress.send_if_modified(|p| {
                                        let changed = p.head_seq != k.head_seq;
                                        p.head_seq = k.head_seq;
                                        changed
                                    });
                                    continue;
                                }
                                None => continue,
                            };
                            let seen = match start {
                                Cursor::After(seq) => seq,
                                Cursor::FromEpoch(_) => 0,
                            };
                            let batch: Vec<(u64, u32, Vec<u8>)> = batch
                                .into_iter()
                                .filter(|entry| entry.seq > seen)
                                .map(|entry| (entry.seq, entry.content_type, entry.message))
                                .collect();
                            let Some(&(last, _, _)) = batch.last() else {
                                continue;
                            };
                            start = Cursor::After(last);
                            // Our own messages coming back (every send of ours does) need no
                            // engine: when the applier has applied everything before them,
                            // they are passed here, without waking it.
                            if channel.queued.load(Ordering::Acquire) == 0
                                && lock(&channel.own_messages).take_all(&batch)
                            {
                                channel
                                    .progress
                                    .send_modify(|p| p.applied_seq = p.applied_seq.max(last));
                                continue;
                            }
                            // A lone application message while the applier is idle (nothing
                            // handed to it is unapplied) is applied right here: waking the
                            // applier's thread costs tens of microseconds on a quiet machine,
                            // and the message's reader waits for that too. Only a lone message
                            // (one decryption, ~0.1-0.2 ms on this runtime's worker), never a
                            // batch or a handshake, and only in sparse traffic (see
                            // `may_apply_inline`); the order holds, as the applier has nothing.
                            if batch.len() == 1
                                && batch[0].1 == APPLICATION
                                && channel.queued.load(Ordering::Acquire) == 0
                                && shared.may_apply_inline()
                            {
                                channel.queued.fetch_add(1, Ordering::AcqRel);
                                let _applied = Applying(&channel.queued, 1);
                                let applied =
                                    shared.apply_inline(|| apply_batch(&channel, batch, now_ns()));
                                if applied == Applied::ChannelEnded {
                                    return;
                                }
                                continue;
                            }
                            let received = Received {
                                entries: batch,
                                at: now_ns(),
                            };
                            channel.queued.fetch_add(1, Ordering::AcqRel);
                            if entries.send(received).await.is_err() {
                                return;
                            }
                        }
                    }
                }
            }
            Err(status) => Some(status),
        };
        channel.progress.send_modify(|p| p.connected = false);
        if let Some(status) = failure {
            match status.code() {
                Code::Unauthenticated => {
                    if let Err(e) =
                        shared.on_unauthenticated(&status, token.as_deref(), &mut strikes)
                    {
                        channel.end(End::Failed(e));
                        return;
                    }
                    continue;
                }
                Code::NotFound => {
                    let e = Error::Transport(format!(
                        "channel {:?} is not on the relay for this account ({})",
                        channel.name,
                        status.message()
                    ));
                    channel.end(End::Failed(e));
                    return;
                }
                Code::InvalidArgument | Code::PermissionDenied | Code::Unimplemented => {
                    let e = transport::status_error("Subscribe", &status);
                    channel.end(End::Failed(e));
                    return;
                }
                _ => {}
            }
        }
        if sleep_or_shutdown(&mut shutdown, backoff).await {
            return;
        }
        backoff = backoff_next(backoff);
    }
}

/// Sleeps unless the channel shuts down first (then returns true).
async fn sleep_or_shutdown(shutdown: &mut watch::Receiver<bool>, wait: Duration) -> bool {
    tokio::select! {
        _ = shutdown.changed() => true,
        _ = tokio::time::sleep(wait) => *shutdown.borrow(),
    }
}

/// Consecutive entries of the log from one Subscribe response: (seq, content type, message).
struct Received {
    entries: Vec<(u64, u32, Vec<u8>)>,
    /// When they arrived (see [`Timings`]).
    at: u64,
}

/// The relay's content type of application messages.
const APPLICATION: u32 = 1;
/// Our own messages remembered for the applier to skip: at most this many, of at most
/// [`OWN_MESSAGE_BYTES`] each.
const OWN_MESSAGES: usize = 4096;
const OWN_MESSAGE_BYTES: usize = 16 * 1024;

/// The application messages we encrypted and that may still come back from the relay (it
/// sends everyone's messages to every subscriber, ours included), by the last 8 bytes of
/// their ciphertext (the end of the AEAD tag: random).
#[derive(Default)]
struct OwnMessages {
    by_tag: HashMap<[u8; 8], Vec<u8>>,
}

impl OwnMessages {
    fn key(message: &[u8]) -> Option<[u8; 8]> {
        message
            .len()
            .checked_sub(8)
            .and_then(|start| message.get(start..))
            .and_then(|tail| tail.try_into().ok())
    }

    fn remember(&mut self, message: &[u8]) {
        if message.len() > OWN_MESSAGE_BYTES {
            return;
        }
        if self.by_tag.len() >= OWN_MESSAGES {
            // Messages that never came back (refused, or sent while not subscribed): forget
            // them all; this only costs the engine's time.
            self.by_tag.clear();
        }
        if let Some(key) = Self::key(message) {
            self.by_tag.insert(key, message.to_vec());
        }
    }

    /// Whether every entry of `batch` is an application message of ours (byte for byte),
    /// forgetting them if so; otherwise nothing changes.
    fn take_all(&mut self, batch: &[(u64, u32, Vec<u8>)]) -> bool {
        let ours = |(_, kind, message): &(u64, u32, Vec<u8>)| {
            *kind == APPLICATION
                && Self::key(message)
                    .and_then(|key| self.by_tag.get(&key))
                    .is_some_and(|m| m == message)
        };
        if self.by_tag.is_empty() || !batch.iter().all(ours) {
            return false;
        }
        for (_, _, message) in batch {
            self.take(message);
        }
        true
    }

    /// Whether `message` is one of ours (byte for byte), forgetting it.
    fn take(&mut self, message: &[u8]) -> bool {
        let Some(key) = Self::key(message) else {
            return false;
        };
        if self.by_tag.get(&key).is_some_and(|m| m == message) {
            self.by_tag.remove(&key);
            true
        } else {
            false
        }
    }
}

/// Counts `.1` batches handed to the applier as applied when dropped (see [`Channel::queued`]).
struct Applying<'a>(&'a AtomicUsize, usize);

impl Drop for Applying<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(self.1, Ordering::AcqRel);
    }
}

/// Applies the log's entries in order, in batches: the one writer of the group's state.
///
/// Runs on a thread of its own rather than as a task handing each batch to tokio's blocking
/// pool: a batch then costs one wake-up (the reader's hand-over) instead of three. It ends when
/// the reader does (the channel's shutdown, or the runtime's).
fn applier(channel: Arc<Channel>, mut entries: mpsc::Receiver<Received>) {
    let shutdown = channel.shutdown.subscribe();
    loop {
        let Some(first) = entries.blocking_recv() else {
            return;
        };
        if *shutdown.borrow() {
            return;
        }
        let received_at = first.at;
        let mut batch = first.entries;
        let mut taken = 1;
        while batch.len() < BATCH {
            match entries.try_recv() {
                Ok(more) => {
                    batch.extend(more.entries);
                    taken += 1;
                }
                Err(_) => break,
            }
        }
        // Counted as applied once the batch is (or the applier ends).
        let _applied = Applying(&channel.queued, taken);
        if apply_batch(&channel, batch, received_at) == Applied::ChannelEnded {
            return;
        }
    }
}

/// What [`apply_batch`] leaves behind.
#[derive(Debug, PartialEq, Eq)]
enum Applied {
    Continue,
    /// The channel ended (we were removed, or the store failed): nothing more is applied.
    ChannelEnded,
}

/// Applies one batch of consecutive entries: the applier's work, also done by the reader
/// itself for a lone application message when the applier is idle (see [`reader`]).
fn apply_batch(
    channel: &Arc<Channel>,
    mut batch: Vec<(u64, u32, Vec<u8>)>,
    received_at: u64,
) -> Applied {
    let passed = batch.last().map(|&(seq, _, _)| seq);
    {
        // Our own application messages come back from the relay too; applying one changes
        // nothing (the engine recognises and skips it), so those we recognise byte for byte
        // are not even handed to it. The stored cursor may then lag behind our own last
        // messages: after a restart they are applied again, to the same effect.
        let mut own = lock(&channel.own_messages);
        if !own.by_tag.is_empty() {
            batch.retain(|(_, kind, message)| !(*kind == APPLICATION && own.take(message)));
        }
    }
    if batch.is_empty() {
        if let Some(seq) = passed {
            channel
                .progress
                .send_modify(|p| p.applied_seq = p.applied_seq.max(seq));
        }
        return Applied::Continue;
    }
    let name = &channel.name;
    let applied = channel.shared.engine().and_then(|e| {
        let refs: Vec<(u64, &[u8])> = batch.iter().map(|(s, _, m)| (*s, m.as_slice())).collect();
        let applied = e.process_entries(name, &refs)?;
        let epoch = e.epoch(name).ok();
        Ok((applied, epoch))
    });
    let (applied, epoch) = match applied {
        Ok(v) => v,
        Err(e) => {
            channel.end(End::Failed(e));
            return Applied::ChannelEnded;
        }
    };
    let mut proposals = false;
    let mut removed = false;
    let mut last = passed;
    // The messages just stored in the inbox, for its read-ahead.
    let mut stored = Vec::new();
    for a in applied {
        last = last.max(Some(a.seq));
        match a.outcome {
            Ok(Incoming::Application {
                sender, payload, ..
            }) => {
                if let Some(id) = a.inbox_id {
                    stored.push(crate::store::InboxMessage {
                        id,
                        seq: a.seq,
                        sender,
                        payload,
                    });
                }
            }
            Ok(Incoming::Proposal { .. }) => proposals = true,
            Ok(Incoming::Removed { .. }) => removed = true,
            Ok(_) => {}
            // Not for us (sent before we joined, or undecryptable): skipped, as RFC 9420
            // members do; the cursor moved past it.
            Err(_) => {}
        }
    }
    channel.progress.send_modify(|p| {
        if let Some(seq) = last {
            p.applied_seq = p.applied_seq.max(seq);
        }
        if let Some(epoch) = epoch {
            p.epoch = epoch;
        }
    });
    if !stored.is_empty() {
        // What was just stored goes into the inbox's read-ahead here, once per batch,
        // rather than being read on the readers' threads, once per wake-up; and as it is
        // (reading it back cost ~50 us a batch, a sixth of applying one message).
        if let Ok(engine) = channel.shared.engine() {
            if let Ok(inbox) = channel.shared.inbox(&engine, &channel.name) {
                let mut inbox = lock(&inbox);
                if !inbox.push_stored(stored) {
                    // On failure the readers read the store themselves.
                    let _ = inbox.load(&engine, &channel.name);
                }
            }
        }
        // Only batches with messages for us: our own messages come back too.
        channel
            .timings
            .received
            .store(received_at, Ordering::Relaxed);
        stamp(&channel.timings.applied);
        channel.notify();
    }
    if removed {
        channel.end(End::Removed);
        return Applied::ChannelEnded;
    }
    if proposals {
        // A member asked to leave: commit it (whoever wins the epoch does it for all).
        let ch = Arc::clone(channel);
        channel.shared.handle.spawn(async move {
            let _ = ch
                .commit(Arc::new(|e: &Engine, name: &str| {
                    Ok(e.commit_pending_proposals(name)?.map(|c| (c, None)))
                }))
                .await;
        });
    }
    Applied::Continue
}

/// Publishes encrypted messages on one long-lived `PublishBatches` call, pipelined: batches
/// go out while earlier ones are in flight, and each message's result goes back to its sender.
/// Failures of the call itself (connection lost, token expired, relay restarting) are handled
/// here: the call is reopened and the messages in flight are sent again with the same bytes
/// (the relay's idempotency answers those it already has). Refusals of single messages go to
/// their senders, who decide (see [`Channel::send`]).
async fn publisher(channel: Arc<Channel>, mut incoming: mpsc::UnboundedReceiver<Vec<Outbound>>) {
    let mut shutdown = channel.shutdown.subscribe();
    let shared = Arc::clone(&channel.shared);
    let mut queue: VecDeque<Outbound> = VecDeque::new();
    let mut inflight: VecDeque<InFlight> = VecDeque::new();
    let mut inflight_bytes = 0usize;
    let mut call: Option<BatchCall> = None;
    let mut backoff = BACKOFF_MIN;
    let mut strikes = 0;
    // When the oldest batch in flight must have been answered by.
    let mut answer_by = Instant::now();
    loop {
        while let Ok(more) = incoming.try_recv() {
            queue.extend(more);
        }
        // Send what may go now.
        let mut failure: Option<(Status, Option<String>)> = None;
        while !queue.is_empty()
            && inflight.len() < MAX_INFLIGHT_BATCHES
            && inflight_bytes < MAX_INFLIGHT_BYTES
        {
            if call.is_none() {
                match open_batch_call(&shared).await {
                    Ok(opened) => call = Some(opened),
                    Err(OpenFailure::Status(status, token)) => {
                        failure = Some((status, token));
                        break;
                    }
                    Err(OpenFailure::Final(e)) => {
                        for item in queue.drain(..) {
                            item.fail(e.clone());
                        }
                        break;
                    }
                    Err(OpenFailure::Token) => {
                        // The token endpoint is unreachable for now.
                        expire(&mut queue, "Publish: cannot get a relay token in time");
                        if sleep_or_shutdown(&mut shutdown, backoff).await {
                            return;
                        }
                        backoff = backoff_next(backoff);
                        break;
                    }
                }
            }
            let Some(open) = call.as_mut() else { break };
            let batch = take_batch(&mut queue);
            let request = pb::PublishBatchRequest {
                requests: batch
                    .items
                    .iter()
                    .map(|o| pb::PublishRequest {
                        channel: channel.name.clone(),
                        message: o.message.clone(),
                        welcome: Vec::new(),
                        idempotency_key: Vec::new(),
                    })
                    .collect(),
            };
            if inflight.is_empty() {
                answer_by = Instant::now() + CALL_TIMEOUT;
            }
            inflight_bytes += batch.bytes;
            inflight.push_back(batch);
            if open.requests.send(request).is_err() {
                // The call is over; its status comes from the response stream.
                failure = Some(match bounded(open.responses.message()).await {
                    Err(status) => (status, open.token.clone()),
                    _ => (
                        Status::unavailable("the publish call ended"),
                        open.token.clone(),
                    ),
                });
                break;
            }
        }
        if failure.is_none() {
            let can_send = !queue.is_empty()
                && inflight.len() < MAX_INFLIGHT_BATCHES
                && inflight_bytes < MAX_INFLIGHT_BYTES;
            let waiting = !inflight.is_empty();
            tokio::select! {
                biased;
                _ = shutdown.changed() => return,
                r = async {
                    match call.as_mut() {
                        Some(open) => open.responses.message().await,
                        None => std::future::pending().await,
                    }
                }, if call.is_some() => match r {
                    Ok(Some(response)) => {
                        backoff = BACKOFF_MIN;
                        strikes = 0;
                        answer_by = Instant::now() + CALL_TIMEOUT;
                        match inflight.pop_front() {
                            Some(batch) => {
                                inflight_bytes -= batch.bytes;
                                batch.answer(response.results);
                            }
                            None => {
                                let token = call.as_ref().and_then(|c| c.token.clone());
                                failure = Some((
                                    Status::internal("an answer to no batch of ours"),
                                    token,
                                ));
                            }
                        }
                    }
                    Ok(None) if !waiting => call = None,
                    Ok(None) => {
                        let token = call.as_ref().and_then(|c| c.token.clone());
                        failure = Some((Status::unavailable("the publish call ended early"), token));
                    }
                    Err(_) if !waiting => call = None,
                    Err(status) => {
                        let token = call.as_ref().and_then(|c| c.token.clone());
                        failure = Some((status, token));
                    }
                },
                more = incoming.recv(), if !can_send => match more {
                    Some(more) => queue.extend(more),
                    None => return,
                },
                _ = tokio::time::sleep_until(answer_by.into()), if waiting => {
                    let token = call.as_ref().and_then(|c| c.token.clone());
                    failure = Some((
                        Status::deadline_exceeded(format!(
                            "no answer from the relay within {CALL_TIMEOUT:?}"
                        )),
                        token,
                    ));
                }
                // Nothing to wait for: only after waiting out an unreachable token endpoint,
                // with messages to send.
                else => {}
            }
        }
        let Some((status, token)) = failure else {
            continue;
        };
        // The call failed: what was in flight goes back to the front of the queue, in order,
        // to be sent again on a new call.
        call = None;
        inflight_bytes = 0;
        let mut requeued = 0;
        while let Some(batch) = inflight.pop_back() {
            for item in batch.items.into_iter().rev() {
                queue.push_front(item);
                requeued += 1;
            }
        }
        match status.code() {
            Code::Unauthenticated => {
                if let Err(e) = shared.on_unauthenticated(&status, token.as_deref(), &mut strikes) {
                    for item in queue.drain(..) {
                        item.fail(e.clone());
                    }
                }
            }
            Code::ResourceExhausted if transport::retry_after(&status).is_some() => {
                let wait = transport::retry_after(&status).unwrap_or(BACKOFF_MIN);
                if sleep_or_shutdown(&mut shutdown, wait).await {
                    return;
                }
            }
            _ if transport::is_transient(&status) => {
                expire(
                    &mut queue,
                    &format!("Publish: {} ({:?})", status.message(), status.code()),
                );
                if sleep_or_shutdown(&mut shutdown, backoff).await {
                    return;
                }
                backoff = backoff_next(backoff);
            }
            // A refusal of the call itself that retrying will not fix: what was sent on it
            // fails, what was not yet sent goes on a new call (all of it fails when the call
            // could not even be opened).
            _ => {
                let e = transport::status_error("Publish", &status);
                let failed = if requeued == 0 { queue.len() } else { requeued };
                for item in queue.drain(..failed.min(queue.len())) {
                    item.fail(e.clone());
                }
            }
        }
    }
}

/// Fails the queued messages whose retry deadline has passed.
fn expire(queue: &mut VecDeque<Outbound>, why: &str) {
    let now = Instant::now();
    if queue.iter().all(|o| o.deadline > now) {
        return;
    }
    let (late, on_time): (VecDeque<_>, VecDeque<_>) =
        queue.drain(..).partition(|o| o.deadline <= now);
    *queue = on_time;
    for item in late {
        item.fail(Error::Transport(why.to_owned()));
    }
}

/// Most batches of one `PublishBatches` call awaiting their answer.
const MAX_INFLIGHT_BATCHES: usize = 32;
/// Most message bytes awaiting their answer on one call.
const MAX_INFLIGHT_BYTES: usize = 8 * 1024 * 1024;
/// Items per batch (the relay's limit).
const MAX_BATCH_ITEMS: usize = 1024;
/// Message bytes per batch: the relay reads requests of at most 1 MiB; leave room for the
/// framing of each item. A larger single message goes alone.
const MAX_BATCH_BYTES: usize = 1024 * 1024 - 64 * 1024;
/// Framing of one item in a batch request, beyond its message (channel name, tags).
const ITEM_OVERHEAD: usize = 256;

/// One encrypted message on its way to the relay.
struct Outbound {
    message: Vec<u8>,
    /// Until when failures of the call are retried for it.
    deadline: Instant,
    reply: oneshot::Sender<Outcome>,
}

impl Outbound {
    fn fail(self, e: Error) {
        let _ = self.reply.send(Outcome::Failed(e));
    }
}

/// What became of one published message.
enum Outcome {
    /// In the channel's log.
    Accepted,
    /// Refused by the relay: certainly not in the log.
    Refused(pb::Refusal),
    /// Not answered for (it may be in the log): the message comes back to be resent as it is.
    Unanswered(pb::Refusal, Vec<u8>),
    /// Not published, and retrying will not help.
    Failed(Error),
}

/// A batch sent and not yet answered.
struct InFlight {
    items: Vec<Outbound>,
    bytes: usize,
}

impl InFlight {
    /// Hands each item its result.
    fn answer(self, results: Vec<pb::PublishResult>) {
        let mut results = results.into_iter();
        for item in self.items {
            let outcome = match results.next().and_then(|r| r.outcome) {
                Some(pb::publish_result::Outcome::Accepted(_)) => Outcome::Accepted,
                Some(pb::publish_result::Outcome::Refused(refusal)) => Outcome::Refused(refusal),
                // A short answer: treated as a transient failure, retried with the same bytes.
                None => Outcome::Unanswered(
                    pb::Refusal {
                        code: Code::Unavailable as u32,
                        message: "the relay did not answer for this message".into(),
                        current_epoch: 0,
                        retry_after_ms: 0,
                    },
                    item.message,
                ),
            };
            let _ = item.reply.send(outcome);
        }
    }
}

/// Takes the next batch off the queue: up to [`MAX_BATCH_ITEMS`] items and
/// [`MAX_BATCH_BYTES`], at least one.
fn take_batch(queue: &mut VecDeque<Outbound>) -> InFlight {
    let mut items = Vec::with_capacity(queue.len().min(MAX_BATCH_ITEMS));
    let mut bytes = 0;
    while let Some(next) = queue.front() {
        let size = next.message.len() + ITEM_OVERHEAD;
        if !items.is_empty() && (items.len() >= MAX_BATCH_ITEMS || bytes + size > MAX_BATCH_BYTES) {
            break;
        }
        bytes += size;
        if let Some(item) = queue.pop_front() {
            items.push(item);
        }
    }
    InFlight { items, bytes }
}

/// An open `PublishBatches` call.
struct BatchCall {
    requests: mpsc::UnboundedSender<pb::PublishBatchRequest>,
    responses: tonic::Streaming<pb::PublishBatchResponse>,
    token: Option<String>,
}

enum OpenFailure {
    /// The relay refused or failed the call.
    Status(Status, Option<String>),
    /// No token for now (the token endpoint is unreachable): retried.
    Token,
    /// No token, final (the key is refused).
    Final(Error),
}

async fn open_batch_call(shared: &Shared) -> std::result::Result<BatchCall, OpenFailure> {
    let (requests, stream) = mpsc::unbounded_channel();
    let (request, token) = match shared
        .request(tokio_stream::wrappers::UnboundedReceiverStream::new(stream))
        .await
    {
        Ok(r) => r,
        Err(e) if e.kind() == ErrorKind::Auth => return Err(OpenFailure::Final(e)),
        Err(_) => return Err(OpenFailure::Token),
    };
    match bounded(shared.relay.clone().publish_batches(request)).await {
        Ok(response) => Ok(BatchCall {
            requests,
            responses: response.into_inner(),
            token,
        }),
        Err(status) => Err(OpenFailure::Status(status, token)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outbound(len: usize) -> (Outbound, oneshot::Receiver<Outcome>) {
        let (reply, answer) = oneshot::channel();
        let item = Outbound {
            message: vec![0; len],
            deadline: Instant::now() + Duration::from_secs(30),
            reply,
        };
        (item, answer)
    }

    #[test]
    fn batches_respect_the_relay_limits() {
        let mut queue: VecDeque<Outbound> = (0..3000).map(|_| outbound(10).0).collect();
        assert_eq!(take_batch(&mut queue).items.len(), MAX_BATCH_ITEMS);
        assert_eq!(queue.len(), 3000 - MAX_BATCH_ITEMS);

        let mut queue: VecDeque<Outbound> = (0..40).map(|_| outbound(100_000).0).collect();
        let batch = take_batch(&mut queue);
        assert!(batch.bytes <= MAX_BATCH_BYTES);
        assert_eq!(
            batch.items.len(),
            MAX_BATCH_BYTES / (100_000 + ITEM_OVERHEAD)
        );

        // A message larger than a batch goes alone.
        let mut queue: VecDeque<Outbound> = [outbound(MAX_PAYLOAD).0, outbound(10).0].into();
        assert_eq!(take_batch(&mut queue).items.len(), 1);
        assert_eq!(take_batch(&mut queue).items.len(), 1);
        assert!(queue.is_empty());
    }

    #[test]
    fn answers_go_to_their_senders_in_order() {
        let (items, mut answers): (Vec<_>, Vec<_>) = (0..3).map(|_| outbound(1)).unzip();
        let accepted = pb::PublishResult {
            outcome: Some(pb::publish_result::Outcome::Accepted(
                pb::PublishResponse::default(),
            )),
        };
        let refused = pb::PublishResult {
            outcome: Some(pb::publish_result::Outcome::Refused(pb::Refusal {
                code: Code::FailedPrecondition as u32,
                current_epoch: 7,
                ..pb::Refusal::default()
            })),
        };
        // The third gets no result: it may be in the log, so it is resent with its bytes.
        InFlight { items, bytes: 0 }.answer(vec![accepted, refused]);
        assert!(matches!(answers[0].try_recv(), Ok(Outcome::Accepted)));
        assert!(matches!(
            answers[1].try_recv(),
            Ok(Outcome::Refused(r)) if r.current_epoch == 7
        ));
        assert!(matches!(
            answers[2].try_recv(),
            Ok(Outcome::Unanswered(r, m)) if r.code == Code::Unavailable as u32 && m.len() == 1
        ));
    }

    #[test]
    fn own_messages_are_recognised_byte_for_byte() {
        let mut own = OwnMessages::default();
        let ours: Vec<u8> = (0..100).collect();
        own.remember(&ours);
        own.remember(b"short");
        let mut same_tag = vec![7u8; 100];
        same_tag[92..].copy_from_slice(&ours[92..]);
        assert!(!own.take(&same_tag));
        assert!(!own.take(b"tiny"));
        assert!(own.take(&ours));
        assert!(!own.take(&ours));
        own.remember(&vec![0; OWN_MESSAGE_BYTES + 1]);
        assert!(own.by_tag.is_empty());
    }

    /// Alice and Bob in one channel, and what Bob's applier stores of Alice's `payloads`
    /// (entries from `first_seq` on), as it hands them to the inbox.
    fn applied_rows(
        alice: &Engine,
        bob: &Engine,
        name: &str,
        first_seq: u64,
        payloads: &[&[u8]],
    ) -> Result<Vec<crate::store::InboxMessage>> {
        let messages: Vec<Vec<u8>> = payloads
            .iter()
            .map(|p| alice.encrypt(name, p))
            .collect::<Result<_>>()?;
        let entries: Vec<(u64, &[u8])> = (first_seq..)
            .zip(messages.iter().map(Vec::as_slice))
            .collect();
        let mut rows = Vec::new();
        for a in bob.process_entries(name, &entries)? {
            if let (
                Ok(Incoming::Application {
                    sender, payload, ..
                }),
                Some(id),
            ) = (a.outcome, a.inbox_id)
            {
                rows.push(crate::store::InboxMessage {
                    id,
                    seq: a.seq,
                    sender,
                    payload,
                });
            }
        }
        Ok(rows)
    }

    #[test]
    fn applied_messages_reach_the_read_ahead_as_stored_in_order_once() -> Result<()> {
        let dir = tempfile::tempdir().map_err(|e| Error::Internal(e.to_string()))?;
        let name = "test/inbox/push";
        let alice = Engine::open(dir.path().join("alice"), b"alice")?;
        let bob = Engine::open(dir.path().join("bob"), b"bob")?;
        let marks = Marks::open(&dir.path().join("bob"))?;
        alice.create_group(name)?;
        let added = alice.add_member(name, &bob.generate_key_package()?)?;
        alice.merge_pending_commit(name)?;
        bob.join_group(name, &added.welcome)?;
        let mut inbox = Inbox {
            slot: bob.inbox_slot(name)?,
            handed: 0,
            loaded: 0,
            ahead: VecDeque::new(),
            complete: false,
            unpruned: 0,
            appliers: 1,
        };

        // Not known to hold everything yet: refused, read from the store instead.
        let first = applied_rows(&alice, &bob, name, 2, &[b"one"])?;
        assert!(!inbox.push_stored(first));
        inbox.load(&bob, name)?;
        assert!(inbox.complete);
        // From then on the rows go in as stored: the same rows the store holds.
        let more = applied_rows(&alice, &bob, name, 3, &[b"two", b"three"])?;
        assert_eq!(more, bob.inbox_after(name, inbox.loaded, 10)?);
        assert!(inbox.push_stored(more.clone()));
        // Rows it already has are refused (never handed out twice).
        assert!(!inbox.push_stored(more));
        let mut taken = Vec::new();
        while let Some(m) = inbox.take(&bob, &marks, name)? {
            taken.push(m.payload);
        }
        assert_eq!(taken, [&b"one"[..], b"two", b"three"]);
        assert_eq!(bob.inbox_count_after(name, inbox.handed)?, 0);

        // No room: refused, and the rows come from the store once there is.
        inbox
            .ahead
            .extend((0..INBOX_READ_AHEAD).map(|i| crate::store::InboxMessage {
                id: 0,
                seq: i as u64,
                sender: Vec::new(),
                payload: Vec::new(),
            }));
        let late = applied_rows(&alice, &bob, name, 5, &[b"four"])?;
        assert!(!inbox.push_stored(late.clone()));
        inbox.ahead.clear();
        // Two appliers (a reopened channel's and its predecessor's): refused.
        inbox.appliers = 2;
        assert!(!inbox.push_stored(late.clone()));
        inbox.appliers = 1;
        assert!(inbox.push_stored(late));
        Ok(())
    }

    #[test]
    fn a_batch_is_taken_as_ours_only_if_every_entry_is() {
        let mut own = OwnMessages::default();
        let (a, b) = (vec![1u8; 100], vec![2u8; 100]);
        own.remember(&a);
        own.remember(&b);
        let entry = |m: &Vec<u8>| (1, APPLICATION, m.clone());
        // One stranger (or a commit) in the batch: nothing is forgotten.
        assert!(!own.take_all(&[entry(&a), entry(&vec![3u8; 100])]));
        assert!(!own.take_all(&[entry(&a), (2, APPLICATION + 1, b.clone())]));
        assert_eq!(own.by_tag.len(), 2);
        assert!(own.take_all(&[entry(&a), entry(&b)]));
        assert!(own.by_tag.is_empty());
        assert!(!own.take_all(&[entry(&a)]));
    }

    #[test]
    fn batches_count_as_applied_once_the_applier_is_done_with_them() {
        let queued = AtomicUsize::new(3);
        {
            let _applying = Applying(&queued, 2);
            assert_eq!(queued.load(Ordering::Acquire), 3);
        }
        assert_eq!(queued.load(Ordering::Acquire), 1);
    }

    #[test]
    fn marks_survive_reopening() -> Result<()> {
        let dir = tempfile::tempdir().map_err(|e| Error::Internal(e.to_string()))?;
        let marks = Marks::open(dir.path())?;
        assert_eq!(marks.read(3)?, 0);
        marks.write(3, 42)?;
        marks.write(0, 7)?;
        drop(marks);
        let marks = Marks::open(dir.path())?;
        assert_eq!((marks.read(0)?, marks.read(1)?, marks.read(3)?), (7, 0, 42));
        Ok(())
    }
}
