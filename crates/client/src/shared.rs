//! What every channel of one client shares: the engine, the relay connection and tokens, the
//! runtime's handle, the inboxes, and the helpers of a call to the relay (auth metadata, the
//! first contact, what a refusal leads to under the retry policy).

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::runtime::Handle;
use tokio::sync::watch;
use tonic::Request;

use crate::config::ClientOptions;
use crate::error::{Error, Result};
use crate::receive::inbox::{Inbox, Marks, Message};
use crate::relay::refusal::Refusal;
use crate::relay::retry::{Retry, Step};
use crate::relay::tokens::Tokens;
use crate::relay::transport::{self, pb, HealthCheckRequest, HealthClient, RelayClient};
use crate::sync::{lock, wait_value};
use static_mls::engine::Engine;

pub(crate) struct Shared {
    /// `None` once the client is closed: the data directory is released as soon as calls in
    /// flight (which hold their own reference) finish.
    pub(crate) engine: Mutex<Option<Arc<Engine>>>,
    pub(crate) relay: RelayClient,
    /// The relay's health service, on the same connection: the first contact's probe.
    health: HealthClient,
    pub(crate) tokens: Tokens,
    pub(crate) handle: Handle,
    /// Set first thing by [`Client::close`](crate::Client::close): no new call starts.
    closed: AtomicBool,
    /// Raised with `closed`: ends every call waiting in [`Shared::block_on`].
    closing: watch::Sender<bool>,
    /// Calls in [`Shared::block_on`] (see [`Shared::wait_calls`]).
    calls: AtomicUsize,
    /// The relay's URI, for errors.
    pub(crate) endpoint: String,
    /// Whether the relay has answered this client at least once (see [`Shared::reach`]).
    reached: AtomicBool,
    pub(crate) options: ClientOptions,
    marks: Marks,
    inboxes: Mutex<HashMap<String, Arc<Mutex<Inbox>>>>,
    /// The last message a reader applied itself (see [`Shared::may_apply_inline`]).
    inline_applied: InlineApplied,
    /// The account our token names, once known (see [`Shared::account`]).
    account: Mutex<Option<String>>,
    /// The relay's external sender key, once asked (see [`Shared::relay_sender_key`]).
    relay_key: Mutex<Option<Option<Vec<u8>>>>,
}

/// A call counted in [`Shared::calls`] while it lives.
struct Call<'a>(&'a Shared);

impl<'a> Call<'a> {
    /// Counts a call, unless the client is closed. SeqCst on both sides: either the close
    /// sees the count, or the call sees the close.
    fn enter(shared: &'a Shared) -> Result<Self> {
        shared.calls.fetch_add(1, Ordering::SeqCst);
        let call = Self(shared);
        shared.check_open()?;
        Ok(call)
    }
}

impl Drop for Call<'_> {
    fn drop(&mut self) {
        self.0.calls.fetch_sub(1, Ordering::SeqCst);
    }
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
    /// For the tests: `engine` (its inbox marks opened in `dir`) with a relay nobody listens at,
    /// which is never dialled.
    #[cfg(test)]
    pub(crate) fn offline(
        engine: Arc<Engine>,
        dir: &std::path::Path,
        runtime: &tokio::runtime::Runtime,
    ) -> Arc<Self> {
        let marks = Marks::open(dir, &engine).expect("the inbox marks open");
        let endpoint = transport::endpoint("http://127.0.0.1:9", None).expect("an endpoint");
        let relay = {
            let _guard = runtime.enter();
            transport::connect_lazy(&endpoint)
        };
        Arc::new(Self::new(
            engine,
            relay,
            Tokens::new(None, None),
            runtime.handle().clone(),
            endpoint.uri().to_string(),
            ClientOptions::default(),
            marks,
        ))
    }

    pub(crate) fn new(
        engine: Arc<Engine>,
        (relay, health): (RelayClient, HealthClient),
        tokens: Tokens,
        handle: Handle,
        endpoint: String,
        options: ClientOptions,
        marks: Marks,
    ) -> Self {
        Self {
            engine: Mutex::new(Some(engine)),
            relay,
            health,
            tokens,
            handle,
            closed: AtomicBool::new(false),
            closing: watch::Sender::new(false),
            calls: AtomicUsize::new(0),
            endpoint,
            reached: AtomicBool::new(false),
            options,
            marks,
            inboxes: Mutex::new(HashMap::new()),
            inline_applied: InlineApplied::new(),
            account: Mutex::new(None),
            relay_key: Mutex::new(None),
        }
    }

    /// Whether a reader may apply a lone message itself (on the runtime's one worker) rather
    /// than hand it to its channel's applier: only if, since a reader last did, at least
    /// [`INLINE_APPLY_SPACING`] times as long has passed as that took. So sparse traffic, where
    /// the hand-over's thread wake-up is what a message waits for, is applied at once, while
    /// under load, or with many busy channels, decryption stays on the appliers (in parallel,
    /// and off the worker that serves every channel's network I/O).
    pub(crate) fn may_apply_inline(&self) -> bool {
        let applied = &self.inline_applied;
        let ended = applied.ended.load(Ordering::Relaxed);
        let took = applied.took.load(Ordering::Relaxed);
        ended == 0
            || applied.now().saturating_sub(ended) >= took.saturating_mul(INLINE_APPLY_SPACING)
    }

    /// Runs `apply`, a message a reader applies itself (see [`Shared::may_apply_inline`]).
    pub(crate) fn apply_inline<T>(&self, apply: impl FnOnce() -> T) -> T {
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

    pub(crate) fn closed_error() -> Error {
        Error::Closed("the client is closed".into())
    }

    pub(crate) fn engine(&self) -> Result<Arc<Engine>> {
        lock(&self.engine).clone().ok_or_else(Self::closed_error)
    }

    pub(crate) fn check_open(&self) -> Result<()> {
        if self.closed.load(Ordering::SeqCst) {
            Err(Self::closed_error())
        } else {
            Ok(())
        }
    }

    /// Raised when the client closes (background tasks of its own end on it).
    pub(crate) fn closing(&self) -> watch::Receiver<bool> {
        self.closing.subscribe()
    }

    /// The client is closing: no call starts any more, and the calls waiting in
    /// [`Shared::block_on`] end now.
    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        self.closing.send_replace(true);
    }

    /// Runs `fut` on the client's runtime from a thread outside it (a caller's, the sender's),
    /// until it is done or the client closes: then it is dropped (on this thread, the runtime
    /// still running) and the call fails with `runtime error:`. So a call never outlives the
    /// close it raced (whose timers would panic on a runtime shut down under them).
    pub(crate) fn block_on<T>(&self, fut: impl Future<Output = Result<T>>) -> Result<T> {
        let _call = Call::enter(self)?;
        let mut closing = self.closing.subscribe();
        self.handle.block_on(async move {
            tokio::select! {
                biased;
                _ = wait_value(&mut closing, |closing| *closing) => Err(Error::Closed(
                    "the client was closed while the call was in progress".into(),
                )),
                out = fut => out,
            }
        })
    }

    /// Waits up to `timeout` until no call is in [`Shared::block_on`] (after
    /// [`Shared::close`], they are all on their way out); whether none is.
    pub(crate) fn wait_calls(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while self.calls.load(Ordering::SeqCst) > 0 {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        true
    }

    /// The channel's inbox (the same for every [`Channel`](crate::Channel) object of one name,
    /// so a reopened channel and the iterators of its closed predecessor never hand out a
    /// message twice).
    pub(crate) fn inbox(&self, engine: &Engine, name: &str) -> Result<Arc<Mutex<Inbox>>> {
        let mut inboxes = lock(&self.inboxes);
        if let Some(inbox) = inboxes.get(name) {
            return Ok(Arc::clone(inbox));
        }
        // A new channel's first mark is written before its slot is recorded.
        let slot = engine.inbox_slot(name, |slot| self.marks.init(slot))?;
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
    pub(crate) fn inbox_take(&self, engine: &Engine, name: &str) -> Result<Option<Message>> {
        let inbox = self.inbox(engine, name)?;
        let mut inbox = lock(&inbox);
        Ok(inbox.take(engine, &self.marks, name)?.map(Message::from))
    }

    /// Whether the relay has answered this client at least once.
    pub(crate) fn reached(&self) -> bool {
        self.reached.load(Ordering::Acquire)
    }

    /// Takes the relay as answered (tests of a client that never dials it).
    #[cfg(test)]
    pub(crate) fn assume_reached(&self) {
        self.reached.store(true, Ordering::Release);
    }

    /// Makes sure the relay has answered this client once: the first time, probes it (a
    /// health Check, which is never a refusal: any answer from the relay will do, NOT_SERVING
    /// included) for up to the connect timeout, so that a wrong address fails fast instead of
    /// being retried like a relay that restarts. With our token, so that one that cannot be
    /// had fails here as it would on the first call. Free once it has answered.
    pub(crate) async fn reach(&self) -> Result<()> {
        if self.reached() {
            return Ok(());
        }
        let mut retry = Retry::within(self.options.connect_timeout);
        loop {
            let probe = HealthCheckRequest {
                service: String::new(),
            };
            let refusal = match self.request(probe).await {
                Ok((request, _)) => {
                    let left = retry.deadline().map_or(Duration::ZERO, |d| {
                        d.saturating_duration_since(Instant::now())
                    });
                    let answer = tokio::time::timeout(
                        left.max(Duration::from_millis(100)),
                        self.health.clone().check(request),
                    )
                    .await;
                    match answer {
                        Ok(Ok(_)) => None,
                        Ok(Err(status)) => match Refusal::from_status(&status) {
                            transient @ Refusal::Transient { .. } => Some(transient),
                            // Not an answer: our TLS handshake failed, for good.
                            refusal if transport::tls_failure(&status).is_some() => {
                                let call = format!("connecting to {}", self.endpoint);
                                return Err(refusal.into_error(&call));
                            }
                            // Any other answer comes from the relay.
                            _ => None,
                        },
                        Err(_) => Some(Refusal::transient(
                            tonic::Code::DeadlineExceeded,
                            "no answer",
                        )),
                    }
                }
                // No token for now (the API is unreachable): tried again like the relay.
                Err(Error::Unreachable(why)) => {
                    Some(Refusal::transient(tonic::Code::Unavailable, why))
                }
                Err(e) => return Err(e),
            };
            let Some(refusal) = refusal else {
                self.reached.store(true, Ordering::Release);
                return Ok(());
            };
            match retry.step(&refusal) {
                Step::Wait(wait) if !wait.is_zero() => tokio::time::sleep(wait).await,
                _ => {
                    return Err(Error::Unreachable(format!(
                        "cannot reach the relay at {} ({}; gave up after {:?}: a relay that \
                         never answered is tried for connect_timeout, \
                         STATIC_SDK_CONNECT_TIMEOUT)",
                        self.endpoint,
                        refusal.message(),
                        self.options.connect_timeout
                    )))
                }
            }
        }
    }

    /// The account our token names ("" when anonymous), which a leaf binding names; retried
    /// under `retry` while no token can be had (the API unreachable), like a call.
    pub(crate) async fn account(&self, retry: &mut Retry, call: &str) -> Result<String> {
        if let Some(account) = lock(&self.account).clone() {
            return Ok(account);
        }
        loop {
            match self.tokens.account().await {
                Ok(account) => {
                    *lock(&self.account) = Some(account.clone());
                    return Ok(account);
                }
                Err(Error::Unreachable(why)) => {
                    let refusal = Refusal::transient(tonic::Code::Unavailable, why);
                    let wait = self.after(retry, refusal, None, call)?;
                    tokio::time::sleep(wait).await;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// The relay's signature key as an external sender (GetRelayInfo, asked once), which a
    /// channel we create names in its `external_senders` extension, so that the relay may
    /// propose the removal of leaves whose key was revoked (docs/design.md §5.2). None from a
    /// relay that predates it (UNIMPLEMENTED): the channel is created without it.
    pub(crate) async fn relay_sender_key(&self) -> Result<Option<Vec<u8>>> {
        if let Some(key) = lock(&self.relay_key).clone() {
            return Ok(key);
        }
        let mut retry = Retry::within(self.options.retry_timeout);
        let answer = self
            .call(
                "GetRelayInfo",
                &mut retry,
                || pb::GetRelayInfoRequest {},
                |mut relay, request| async move { relay.get_relay_info(request).await },
                |refusal| refusal.code() == tonic::Code::Unimplemented,
            )
            .await?;
        let key = match answer {
            Ok(info) if info.external_sender_identity[..] == *static_mls::RELAY_SENDER_IDENTITY => {
                Some(info.external_sender_signature_key.to_vec()).filter(|key| !key.is_empty())
            }
            Ok(_) | Err(_) => None,
        };
        *lock(&self.relay_key) = Some(key.clone());
        Ok(key)
    }

    /// Binds our leaf in `channel` to our account on the relay (after joining from a Welcome:
    /// until then the account has no access; see `proto/relay.proto`, BindLeaf).
    pub(crate) async fn bind_leaf(&self, channel: &str) -> Result<()> {
        let mut retry = Retry::within(self.options.retry_timeout);
        let account = self.account(&mut retry, "BindLeaf").await?;
        let owned = channel.to_owned();
        let binding = self
            .blocking(move |e| Ok(e.leaf_binding(&owned, &account)?))
            .await?;
        let answer = self
            .call(
                "BindLeaf",
                &mut retry,
                || pb::BindLeafRequest {
                    channel: channel.to_owned(),
                    binding: Some(pb::LeafBinding {
                        leaf_index: binding.leaf_index,
                        signature: binding.signature.clone().into(),
                    }),
                },
                |mut relay, request| async move { relay.bind_leaf(request).await },
                |_| false,
            )
            .await?;
        answer
            .map(|_| ())
            .map_err(|refusal| refusal.into_error("BindLeaf"))?;
        self.record_bound_key(channel).await;
        Ok(())
    }

    /// Records the API key that just bound our leaf of `channel` (best effort: a failure
    /// only means one more BindLeaf at the next opening).
    pub(crate) async fn record_bound_key(&self, channel: &str) {
        if let Ok(Some(key_id)) = self.tokens.key_id().await {
            // On the blocking pool: the engine's lock may be held by a long commit.
            let channel = channel.to_owned();
            let _ = self
                .blocking(move |e| Ok(e.set_bound_key(&channel, &key_id)?))
                .await;
        }
    }

    /// Binds our leaf of `channel` again when our API key is not the one that last bound it
    /// (an agent restarted with a rolled key): the relay proposes the removal of leaves whose
    /// binding's key is revoked, and the old key's end must not remove us (docs/design.md
    /// §5.2, "Removal on revocation"). Best effort: a refusal is logged, the channel opens.
    pub(crate) async fn rebind_if_key_changed(&self, channel: &str) {
        let Ok(Some(key_id)) = self.tokens.key_id().await else {
            return;
        };
        let owned = channel.to_owned();
        let bound = self.blocking(move |e| Ok(e.bound_key(&owned)?)).await;
        if bound.ok().flatten().as_deref() == Some(key_id.as_str()) {
            return;
        }
        if let Err(e) = self.bind_leaf(channel).await {
            log::warn!("channel {channel:?}: could not bind our leaf with our new API key: {e}");
        }
    }

    /// A request carrying the auth metadata; returns the token used (to drop it if the relay
    /// refuses it).
    pub(crate) async fn request<T>(&self, message: T) -> Result<(Request<T>, Option<String>)> {
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
    pub(crate) async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Engine) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let engine = self.engine()?;
        tokio::task::spawn_blocking(move || f(&engine))
            .await
            .map_err(|e| Error::task("a background task failed", e))?
    }

    /// Makes a unary call to the relay with `message` until it is answered, `refused` says a
    /// refusal is the caller's to handle (it is returned), or the retry policy gives up. A
    /// token provider that cannot give a token for now counts as a transient failure.
    pub(crate) async fn call<M, R, Fut>(
        &self,
        name: &str,
        retry: &mut Retry,
        message: impl Fn() -> M,
        send: impl Fn(RelayClient, Request<M>) -> Fut,
        refused: impl Fn(&Refusal) -> bool,
    ) -> Result<std::result::Result<R, Refusal>>
    where
        Fut: std::future::Future<Output = std::result::Result<tonic::Response<R>, tonic::Status>>,
    {
        loop {
            let (refusal, token) = match self.request(message()).await {
                Ok((request, token)) => {
                    match crate::relay::transport::bounded(send(self.relay.clone(), request)).await
                    {
                        Ok(response) => return Ok(Ok(response.into_inner())),
                        Err(status) => (Refusal::from_status(&status), token),
                    }
                }
                Err(Error::Unreachable(why)) => {
                    (Refusal::transient(tonic::Code::Unavailable, why), None)
                }
                Err(e) => return Err(e),
            };
            if refused(&refusal) {
                return Ok(Err(refusal));
            }
            let wait = self.after(retry, refusal, token.as_deref(), name)?;
            tokio::time::sleep(wait).await;
        }
    }

    /// [`Shared::call`] under a fresh retry policy, for a call whose every refusal is its
    /// error.
    pub(crate) async fn unary<M, R, Fut>(
        &self,
        name: &str,
        message: impl Fn() -> M,
        send: impl Fn(RelayClient, Request<M>) -> Fut,
    ) -> Result<R>
    where
        Fut: std::future::Future<Output = std::result::Result<tonic::Response<R>, tonic::Status>>,
    {
        let mut retry = Retry::within(self.options.retry_timeout);
        self.call(name, &mut retry, message, send, |_| false)
            .await?
            .map_err(|refusal| refusal.into_error(name))
    }

    /// What a loop does after `refusal` of `call` under `retry`: the wait before its next
    /// attempt (a refused `token` is dropped first, so the next attempt fetches a fresh one),
    /// or the error that ends it.
    pub(crate) fn after(
        &self,
        retry: &mut Retry,
        refusal: Refusal,
        token: Option<&str>,
        call: &str,
    ) -> Result<Duration> {
        match retry.step(&refusal) {
            Step::Wait(wait) => Ok(wait),
            Step::Refresh if self.tokens.anonymous() => Err(Error::Auth(format!(
                "the relay requires a token ({}); pass api_key and api_url",
                refusal.message()
            ))),
            Step::Refresh => {
                self.tokens.invalidate(token);
                Ok(Duration::ZERO)
            }
            Step::GiveUp => Err(refusal.into_error(call)),
        }
    }
}
