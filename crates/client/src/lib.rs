//! Static's SDK client (`static-client`): an [`Engine`] (`static-mls`) plus the relay, on a
//! tokio runtime the client owns. No Python here: `static-native` is the thin PyO3 layer.
//!
//! # Architecture
//!
//! * One [`Client`] per agent process and data directory: it owns a small multi-thread tokio
//!   runtime, the [`Engine`], a lazily connecting tonic client of the relay and a token source
//!   (`tokens`).
//! * One [`Channel`] per open channel (`channel`), with three background workers:
//!   - the **reader** task (`reader`) subscribes to the channel's log (in batches of up to
//!     [`SUBSCRIBE_BATCH`] entries per response) after the last seq it has seen (or from the
//!     epoch we joined at), reconnects with backoff (also after three silent keep-alive
//!     intervals), refreshes the token on `UNAUTHENTICATED`, passes batches that are only our
//!     own messages coming back itself (when nothing before them waits to be applied), applies
//!     a lone application message itself when the applier is idle (see
//!     [`apply_batch`](applier::apply_batch)), and hands other entries to
//!   - the **applier** thread (`applier`), the one writer of the channel's group state (the
//!     reader only applies while the applier has nothing): it applies entries strictly in log
//!     order in batches through [`Engine::process_entries`], which stores the cursor and the
//!     decrypted messages (the inbox) in the same transaction as the MLS state change;
//!   - the **publisher** task (`publisher`), which keeps one `PublishBatches` call open and
//!     pipelines the messages [`Channel::send`] encrypted (on the callers' threads, concurrent
//!     callers sharing one transaction) to it, reopening the call when it fails.
//! * Commits (`add_member`, `remove_member`, `rotate_keys`, committing proposals) take the
//!   channel's commit lock, publish with the epoch fence and return once the applier has merged
//!   the echo of the commit; a stale commit is dropped, the winner applied, and it is retried.
//! * Readers of messages take them from the inbox (`inbox`; blocking with a condition
//!   variable, or async through a readiness socket per waiter, see [`Waker`]), read ahead in
//!   memory; a message is marked handed out (see [`Marks`]) before it is returned.
//!
//! This file holds what the parts share: the client's `Shared` state, the constants and
//! helpers of calls to the relay, and the [`Client`] itself.

#![forbid(unsafe_code)]

mod applier;
mod channel;
mod inbox;
mod pipeline;
mod publisher;
mod reader;
mod tokens;
pub mod transport;

use std::collections::{HashMap, VecDeque};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::runtime::{Handle, Runtime};
use tonic::{Code, Request, Status};

pub use channel::{now_ns, Channel, End, Next, Progress, Timings, Waker};
use inbox::{Inbox, Marks};
pub use pipeline::SendHandle;
use tokens::Tokens;
pub use tokens::{Token, TokenProvider};

use crate::transport::{pb, RelayClient};
use static_mls::engine::Engine;
use static_mls::error::{Error, ErrorKind, Result};

/// Largest payload [`Channel::send`] accepts: the relay's 1 MiB message limit less room for
/// the MLS framing, signature and AEAD tag.
pub const MAX_PAYLOAD: usize = 1024 * 1024 - 4 * 1024;

/// How long a call keeps retrying a relay that answered before and is now unreachable (it
/// restarts, the network dropped) before it fails.
const RETRY_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a call keeps trying a relay that never answered this client (nothing listens
/// there, a wrong port) before it fails.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

/// How patient a [`Client`] is with its relay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientOptions {
    /// How long calls try to reach a relay that never answered this client.
    pub connect_timeout: Duration,
    /// How long calls retry a relay that answered before.
    pub retry_timeout: Duration,
}

impl Default for ClientOptions {
    fn default() -> Self {
        Self {
            connect_timeout: CONNECT_TIMEOUT,
            retry_timeout: RETRY_TIMEOUT,
        }
    }
}

impl ClientOptions {
    /// The defaults, overridden by the environment variables `STATIC_SDK_CONNECT_TIMEOUT` and
    /// `STATIC_SDK_RETRY_TIMEOUT` (seconds) where they hold a number >= 0.
    pub fn from_env() -> Self {
        let seconds = |name: &str| {
            std::env::var(name)
                .ok()
                .and_then(|v| v.trim().parse::<f64>().ok())
                .filter(|v| v.is_finite() && *v >= 0.0)
                .map(|v| Duration::from_secs_f64(v.min(1e9)))
        };
        let defaults = Self::default();
        Self {
            connect_timeout: seconds("STATIC_SDK_CONNECT_TIMEOUT")
                .unwrap_or(defaults.connect_timeout),
            retry_timeout: seconds("STATIC_SDK_RETRY_TIMEOUT").unwrap_or(defaults.retry_timeout),
        }
    }
}
/// How long a call waits for the channel's background processing to reach a point.
const PROGRESS_TIMEOUT: Duration = Duration::from_secs(30);
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

// --- shared state ---------------------------------------------------------------------------

struct Shared {
    /// `None` once the client is closed: the data directory is released as soon as calls in
    /// flight (which hold their own reference) finish.
    engine: Mutex<Option<Arc<Engine>>>,
    relay: RelayClient,
    tokens: Tokens,
    handle: Handle,
    closed: std::sync::atomic::AtomicBool,
    /// The relay's URI, for errors.
    endpoint: String,
    /// Whether the relay has answered this client at least once (see [`Shared::reach`]).
    reached: std::sync::atomic::AtomicBool,
    connect_timeout: Duration,
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

    /// Makes sure the relay has answered this client once: the first time, probes it (a
    /// FetchWelcome that cannot match: any answer from the relay will do) for up to the
    /// connect timeout, so that a wrong address fails fast instead of being retried like a
    /// relay that restarts. Free once it has answered.
    async fn reach(&self) -> Result<()> {
        use std::sync::atomic::Ordering::{Acquire, Release};
        if self.reached.load(Acquire) {
            return Ok(());
        }
        let started = Instant::now();
        let mut backoff = BACKOFF_MIN;
        loop {
            let (request, _) = self
                .request(pb::FetchWelcomeRequest {
                    channel: String::new(),
                    key: Some(pb::fetch_welcome_request::Key::WelcomeSha256(
                        vec![0; 32].into(),
                    )),
                })
                .await?;
            let left = self.connect_timeout.saturating_sub(started.elapsed());
            let answer = tokio::time::timeout(
                left.max(Duration::from_millis(100)),
                self.relay.clone().fetch_welcome(request),
            )
            .await;
            let status = match answer {
                Ok(Ok(_)) => None,
                Ok(Err(status)) if !transport::is_transient(&status) => None,
                Ok(Err(status)) => Some(status.message().to_owned()),
                Err(_) => Some("no answer".to_owned()),
            };
            let Some(why) = status else {
                self.reached.store(true, Release);
                return Ok(());
            };
            let left = self.connect_timeout.saturating_sub(started.elapsed());
            if left.is_zero() {
                return Err(Error::Transport(format!(
                    "cannot reach the relay at {} ({why}; gave up after {:?}: a relay that \
                     never answered is tried for connect_timeout, STATIC_SDK_CONNECT_TIMEOUT)",
                    self.endpoint, self.connect_timeout
                )));
            }
            tokio::time::sleep(backoff.min(left)).await;
            backoff = backoff_next(backoff);
        }
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
    /// the first fetch when the caller has just exchanged the key; `options` (see
    /// [`ClientOptions::from_env`]) says how patient calls are with the relay.
    pub fn open(
        endpoint: &str,
        data_dir: impl AsRef<Path>,
        identity: &[u8],
        tokens: Option<Arc<dyn TokenProvider>>,
        initial_token: Option<Token>,
        options: ClientOptions,
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
            endpoint: endpoint.uri().to_string(),
            reached: std::sync::atomic::AtomicBool::new(false),
            connect_timeout: options.connect_timeout,
            retry_deadline: options.retry_timeout,
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
        static_mls::validate_channel_name(name)?;
        if self.shared.engine()?.has_group(name) {
            return Err(Error::Mls(format!(
                "already a member of channel {name:?}; use open_channel to reopen it"
            )));
        }
        let shared = Arc::clone(&self.shared);
        let owned = name.to_owned();
        self.block_on(async move {
            shared.reach().await?;
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
        static_mls::validate_channel_name(name)?;
        // Before the Welcome is used up: it cannot be processed twice.
        self.block_on(self.shared.reach())?;
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
        static_mls::validate_channel_name(name)?;
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
            channel.join_sender();
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
