//! The SDK's client: an [`Engine`] plus the relay, on a tokio runtime the client owns.
//!
//! # Architecture
//!
//! * One [`Client`] per agent process and data directory: it owns a small multi-thread tokio
//!   runtime, the [`Engine`], a lazily connecting tonic client of the relay and a token source.
//! * One [`Channel`] per open channel, with three background tasks:
//!   - the **reader** subscribes to the channel's log after the last seq it has seen (or from
//!     the epoch we joined at), reconnects with backoff (also after three silent keep-alive
//!     intervals), refreshes the token on `UNAUTHENTICATED`, and hands entries to
//!   - the **applier**, the one writer of the channel's group state: it applies entries strictly
//!     in log order in batches through [`Engine::process_entries`], which stores the cursor and
//!     the decrypted messages (the inbox) in the same transaction as the MLS state change;
//!   - the **sender**, which batches concurrent [`Channel::send`] calls: one transaction
//!     encrypts the batch (one disk sync), one `PublishStream` call publishes it in order.
//! * Commits (`add_member`, `remove_member`, `rotate_keys`, committing proposals) take the
//!   channel's commit lock, publish with the epoch fence and return once the applier has merged
//!   the echo of the commit; a stale commit is dropped, the winner applied, and it is retried.
//! * Readers of messages take them out of the inbox (blocking with a condition variable, or
//!   async through a readiness socket per waiter, see [`Waker`]).

use std::collections::{HashMap, VecDeque};
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
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
/// Largest batch the applier and the sender take at once.
const BATCH: usize = 512;
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
}

impl Shared {
    fn engine(&self) -> Result<Arc<Engine>> {
        lock(&self.engine).clone().ok_or_else(closed_error)
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
            .worker_threads(2)
            .max_blocking_threads(16)
            .thread_name("static-sdk")
            .enable_all()
            .build()
            .map_err(|e| Error::Internal(format!("cannot start the runtime: {e}")))?;
        let data_dir = data_dir.as_ref().to_owned();
        let engine = Arc::new(Engine::open(&data_dir, identity)?);
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
        self.block_on(channel.wait_connected(Duration::from_secs(10)))?;
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
        for channel in channels {
            channel.close();
        }
        if let Some(runtime) = lock(&self.runtime).take() {
            runtime.shutdown_timeout(Duration::from_secs(2));
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

struct SendJob {
    payload: Vec<u8>,
    reply: oneshot::Sender<Result<()>>,
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
    sends: mpsc::UnboundedSender<SendJob>,
    shutdown: watch::Sender<bool>,
    tasks: Mutex<Vec<tokio::task::JoinHandle<()>>>,
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
        let (sends, send_rx) = mpsc::unbounded_channel();
        let (shutdown, _) = watch::channel(false);
        let channel = Arc::new(Self {
            name: name.to_owned(),
            shared: Arc::clone(&shared),
            progress,
            signal: (Mutex::new(0), Condvar::new()),
            wakers: Mutex::new(Vec::new()),
            commit_lock: tokio::sync::Mutex::new(()),
            sends,
            shutdown,
            tasks: Mutex::new(Vec::new()),
        });
        let (entries_tx, entries_rx) = mpsc::channel(4 * BATCH);
        // The tasks hold the channel weakly where they can, strongly where they must finish a
        // step; all stop when `shutdown` flips.
        let tasks = vec![
            shared
                .handle
                .spawn(reader(Arc::clone(&channel), cursor, entries_tx)),
            shared
                .handle
                .spawn(applier(Arc::clone(&channel), entries_rx)),
            shared.handle.spawn(sender(Arc::clone(&channel), send_rx)),
        ];
        *lock(&channel.tasks) = tasks;
        Ok(channel)
    }

    pub fn name(&self) -> &str {
        &self.name
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
        if let Some(message) = engine.inbox_take(&self.name)? {
            return Ok(Next::Message(message.payload));
        }
        let ended = self.progress.borrow().ended.clone();
        match ended {
            None => Ok(Next::Empty),
            Some(end) => {
                // Messages stored before the end are still handed out.
                if let Some(message) = engine.inbox_take(&self.name)? {
                    return Ok(Next::Message(message.payload));
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
        self.shared.engine()?.inbox_len(&self.name)
    }

    /// Encrypts `payload` and publishes it; returns once the relay has it in the channel's log.
    pub fn send(&self, payload: Vec<u8>) -> Result<()> {
        if payload.len() > MAX_PAYLOAD {
            return Err(Error::Transport(format!(
                "payload of {} bytes exceeds the maximum of {MAX_PAYLOAD} bytes per message",
                payload.len()
            )));
        }
        self.check_usable()?;
        let (reply, answer) = oneshot::channel();
        self.sends
            .send(SendJob { payload, reply })
            .map_err(|_| self.ended_error())?;
        self.block_on(async move { answer.await.map_err(|_| self.ended_error())? })
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
async fn reader(channel: Arc<Channel>, cursor: Cursor, entries: mpsc::Sender<(u64, Vec<u8>)>) {
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
                max_batch: 0,
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
                            for entry in batch {
                                let seen = match start {
                                    Cursor::After(seq) => seq,
                                    Cursor::FromEpoch(_) => 0,
                                };
                                if entry.seq <= seen {
                                    continue;
                                }
                                start = Cursor::After(entry.seq);
                                if entries.send((entry.seq, entry.message)).await.is_err() {
                                    return;
                                }
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

/// Applies the log's entries in order, in batches: the one writer of the group's state.
async fn applier(channel: Arc<Channel>, mut entries: mpsc::Receiver<(u64, Vec<u8>)>) {
    let mut shutdown = channel.shutdown.subscribe();
    loop {
        let first = tokio::select! {
            _ = shutdown.changed() => return,
            e = entries.recv() => e,
        };
        let Some(first) = first else { return };
        let mut batch = vec![first];
        while batch.len() < BATCH {
            match entries.try_recv() {
                Ok(e) => batch.push(e),
                Err(_) => break,
            }
        }
        let name = channel.name.clone();
        let applied = channel
            .shared
            .blocking(move |e| {
                let refs: Vec<(u64, &[u8])> =
                    batch.iter().map(|(s, m)| (*s, m.as_slice())).collect();
                let applied = e.process_entries(&name, &refs)?;
                let epoch = e.epoch(&name).ok();
                Ok((applied, epoch))
            })
            .await;
        let (applied, epoch) = match applied {
            Ok(v) => v,
            Err(e) => {
                channel.end(End::Failed(e));
                return;
            }
        };
        let mut messages = false;
        let mut proposals = false;
        let mut removed = false;
        let mut last = None;
        for a in &applied {
            last = Some(a.seq);
            match &a.outcome {
                Ok(Incoming::Application { .. }) => messages = true,
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
        if messages {
            channel.notify();
        }
        if removed {
            channel.end(End::Removed);
            return;
        }
        if proposals {
            // A member asked to leave: commit it (whoever wins the epoch does it for all).
            let ch = Arc::clone(&channel);
            channel.shared.handle.spawn(async move {
                let _ = ch
                    .commit(Arc::new(|e: &Engine, name: &str| {
                        Ok(e.commit_pending_proposals(name)?.map(|c| (c, None)))
                    }))
                    .await;
            });
        }
    }
}

/// Encrypts and publishes [`Channel::send`] payloads in batches, in submission order.
async fn sender(channel: Arc<Channel>, mut jobs: mpsc::UnboundedReceiver<SendJob>) {
    let mut shutdown = channel.shutdown.subscribe();
    loop {
        let first = tokio::select! {
            _ = shutdown.changed() => return,
            j = jobs.recv() => j,
        };
        let Some(first) = first else { return };
        let mut batch = vec![first];
        while batch.len() < BATCH {
            match jobs.try_recv() {
                Ok(j) => batch.push(j),
                Err(_) => break,
            }
        }
        let results = publish_payloads(&channel, &batch).await;
        for (job, result) in batch.into_iter().zip(results) {
            let _ = job.reply.send(result);
        }
    }
}

/// Encrypts the payloads in one transaction and publishes them in order; one result each.
async fn publish_payloads(channel: &Channel, jobs: &[SendJob]) -> Vec<Result<()>> {
    let mut results: Vec<Option<Result<()>>> = (0..jobs.len()).map(|_| None).collect();
    // (job index, encrypted message) still to publish, in order.
    let mut queue: VecDeque<(usize, Vec<u8>)>;
    let encrypt = |indices: Vec<usize>| {
        let payloads: Vec<Vec<u8>> = indices.iter().map(|&i| jobs[i].payload.clone()).collect();
        let name = channel.name.clone();
        async move {
            let messages = channel
                .shared
                .blocking(move |e| {
                    let refs: Vec<&[u8]> = payloads.iter().map(Vec::as_slice).collect();
                    e.encrypt_many(&name, &refs)
                })
                .await?;
            Ok::<_, Error>(indices.into_iter().zip(messages).collect::<VecDeque<_>>())
        }
    };
    match encrypt((0..jobs.len()).collect()).await {
        Ok(q) => queue = q,
        Err(e) => {
            return jobs.iter().map(|_| Err(e.clone())).collect();
        }
    }
    let deadline = Instant::now() + channel.shared.retry_deadline;
    let mut backoff = BACKOFF_MIN;
    let mut strikes = 0;
    let mut reencrypted = 0;
    while !queue.is_empty() {
        let (accepted, failure) = match publish_batch(channel, &queue).await {
            Ok(outcome) => outcome,
            Err(e) if e.kind() == ErrorKind::Auth || Instant::now() >= deadline => {
                for (i, _) in queue.drain(..) {
                    results[i] = Some(Err(e.clone()));
                }
                continue;
            }
            Err(_) => {
                // The token endpoint is unreachable for now.
                tokio::time::sleep(backoff).await;
                backoff = backoff_next(backoff);
                continue;
            }
        };
        for _ in 0..accepted {
            if let Some((i, _)) = queue.pop_front() {
                results[i] = Some(Ok(()));
            }
        }
        let Some((status, token)) = failure else {
            continue;
        };
        let fail_front = |queue: &mut VecDeque<(usize, Vec<u8>)>,
                          results: &mut Vec<Option<Result<()>>>,
                          e: Error| {
            if let Some((i, _)) = queue.pop_front() {
                results[i] = Some(Err(e));
            }
        };
        let fail_all = |queue: &mut VecDeque<(usize, Vec<u8>)>,
                        results: &mut Vec<Option<Result<()>>>,
                        e: &Error| {
            for (i, _) in queue.drain(..) {
                results[i] = Some(Err(e.clone()));
            }
        };
        match status.code() {
            Code::Unauthenticated => {
                if let Err(e) =
                    channel
                        .shared
                        .on_unauthenticated(&status, token.as_deref(), &mut strikes)
                {
                    fail_all(&mut queue, &mut results, &e);
                }
            }
            Code::FailedPrecondition if reencrypted < 3 => {
                // Encrypted at an epoch the relay no longer accepts (the group moved on by
                // more than its window): catch up and encrypt again.
                reencrypted += 1;
                let epoch = transport::current_epoch(&status).unwrap_or(0);
                if let Err(e) = channel.wait_epoch(epoch).await {
                    fail_all(&mut queue, &mut results, &e);
                    continue;
                }
                let indices: Vec<usize> = queue.drain(..).map(|(i, _)| i).collect();
                match encrypt(indices.clone()).await {
                    Ok(q) => queue = q,
                    Err(e) => {
                        for i in indices {
                            results[i] = Some(Err(e.clone()));
                        }
                    }
                }
            }
            Code::ResourceExhausted if transport::retry_after(&status).is_some() => {
                tokio::time::sleep(transport::retry_after(&status).unwrap_or(BACKOFF_MIN)).await;
            }
            _ if transport::is_transient(&status) && Instant::now() < deadline => {
                tokio::time::sleep(backoff).await;
                backoff = backoff_next(backoff);
            }
            _ if transport::is_transient(&status) => {
                let e = transport::status_error("Publish", &status);
                fail_all(&mut queue, &mut results, &e);
            }
            // Refused for itself (too large, malformed): fail that message, go on with the rest.
            _ => fail_front(
                &mut queue,
                &mut results,
                transport::status_error("Publish", &status),
            ),
        }
    }
    results
        .into_iter()
        .map(|r| r.unwrap_or_else(|| Err(Error::Internal("a message was not sent".into()))))
        .collect()
}

/// Publishes the queued messages in order; returns how many were accepted and, if the call
/// ended early, its status and the token it used.
async fn publish_batch(
    channel: &Channel,
    queue: &VecDeque<(usize, Vec<u8>)>,
) -> Result<(usize, Option<(Status, Option<String>)>)> {
    let shared = &channel.shared;
    if queue.len() == 1 {
        let Some((_, message)) = queue.front() else {
            return Ok((0, None));
        };
        let request = shared
            .request(pb::PublishRequest {
                channel: channel.name.clone(),
                message: message.clone(),
                welcome: Vec::new(),
                idempotency_key: Vec::new(),
            })
            .await;
        let (request, token) = request?;
        return Ok(match bounded(shared.relay.clone().publish(request)).await {
            Ok(_) => (1, None),
            Err(status) => (0, Some((status, token))),
        });
    }
    let requests: Vec<pb::PublishRequest> = queue
        .iter()
        .map(|(_, message)| pb::PublishRequest {
            channel: channel.name.clone(),
            message: message.clone(),
            welcome: Vec::new(),
            idempotency_key: Vec::new(),
        })
        .collect();
    let request = shared.request(tokio_stream::iter(requests)).await;
    let (request, token) = request?;
    let mut stream = match bounded(shared.relay.clone().publish_stream(request)).await {
        Ok(response) => response.into_inner(),
        Err(status) => return Ok((0, Some((status, token)))),
    };
    let mut accepted = 0;
    loop {
        match bounded(stream.message()).await {
            Ok(Some(_)) => accepted += 1,
            Ok(None) if accepted >= queue.len() => return Ok((accepted, None)),
            Ok(None) => {
                return Ok((
                    accepted,
                    Some((Status::unknown("the publish stream ended early"), token)),
                ))
            }
            Err(status) => return Ok((accepted, Some((status, token)))),
        }
    }
}
