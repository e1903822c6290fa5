//! `RelayServer`: bind (the configured host only, no SO_REUSEPORT), serve, drain.
//! A port of `static/relay/_serve.py`.
//!
//! Connections are served with hyper's HTTP/2 server directly (gRPC needs nothing else), so
//! that the relay keeps what the Python transport did per connection: a cap on concurrent
//! calls answered with RESOURCE_EXHAUSTED (not a SETTINGS limit clients would queue behind),
//! a budget of stream resets (HTTP/2 rapid reset), TCP_NODELAY, and a drain it controls; and
//! bounds on the connections themselves: a connection that holds no call for
//! `idle_timeout` (silent, preface only, or done) is closed, and connections are capped
//! overall and per client address (a refused one is closed as soon as it is accepted).
//! With TLS (`RelayConfig::tls`), the handshake runs in the connection's task, after its
//! admission: a peer that never completes it holds its place in the caps only until
//! `tls_handshake_timeout`, and one that speaks plaintext fails at its first bytes.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::{poll_fn, Future};
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::server::conn::http2;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use tokio::task::{JoinHandle, JoinSet};
use tokio_rustls::TlsAcceptor;
use tonic::body::Body;
use tonic::codegen::Service as _;
use tonic::Status;
use tonic_health::pb::health_server;

use crate::access::CallRecord;
use crate::auth::{Authenticator, Verify};
use crate::error::{shutting_down, RelayError, Result};
use crate::health::{self, Health};
use crate::log::{ChannelLog, LogSettings};
use crate::metrics::{self, metrics};
use crate::pb::relay_server::RelayServer as GrpcServer;
use crate::retention::{self, PassReport, RetentionSettings};
use crate::rules::client_key;
use crate::rules::TokenBucket;
use crate::service::{self, GateSettings, Peer, Relay, ServiceSettings};
use crate::settings::RelayConfig;
use crate::shutdown::{Phase, Shutdown, Watch};

/// How long closing connections may take to flush after their GOAWAY (as in Python).
const CLOSE_GRACE: Duration = Duration::from_secs(1);
/// HTTP/2 streams a connection may open beyond the relay's cap: those get the cap's
/// RESOURCE_EXHAUSTED answer, and only past this does h2 itself refuse streams.
const STREAMS_OVER_CAP: u32 = 100;
/// At most one line per this interval about refused connections or failing accepts: a flood
/// of them must not flood the log (20,000 idle connections once filled it with `accept
/// failed: Too many open files`).
const LOG_EVERY: Duration = Duration::from_secs(10);
/// What h2 may buffer per stream ahead of the peer's window, beyond the chunk it is given
/// (hyper's default is 400 KiB): part of what a subscriber that stops reading holds
/// (`docs/design.md` §5).
pub const SEND_BUFFER_BYTES: usize = 256 * 1024;

/// A running relay. Dropping it without [`RelayServer::shutdown`] aborts it.
pub struct RelayServer {
    local_addr: SocketAddr,
    log: ChannelLog,
    auth: Arc<Authenticator>,
    shutdown: Shutdown,
    calls: Arc<Calls>,
    /// The accept loop; it hands back the connections' tasks when it stops.
    acceptor: Option<JoinHandle<JoinSet<()>>>,
    graceful_timeout: Duration,
    retention: RetentionSettings,
    pruner: Option<JoinHandle<()>>,
    health: Arc<Health>,
    prober: Option<JoinHandle<()>>,
}

impl RelayServer {
    /// Open the log, bind and start serving on the current tokio runtime.
    pub async fn start(
        config: RelayConfig,
        verifier: Option<Arc<dyn Verify>>,
    ) -> Result<RelayServer> {
        // Bound first: a port that is taken leaves no writer behind to stop.
        let listeners = bind(&config.host, config.port).await?;
        let local_addr = match listeners.first().map(TcpListener::local_addr) {
            Some(Ok(addr)) => addr,
            Some(Err(e)) => return Err(cannot_listen(&config, &e)),
            None => return Err(cannot_listen(&config, &"no address to listen on")),
        };
        let log = ChannelLog::open(LogSettings {
            database: config.database.clone(),
            application_window: config.application_window,
            cache_bytes: config.cache_bytes,
            idle_unload: config.idle_unload,
        })
        .await?;
        // The first probe before anything is served: SERVING only once the store wrote.
        let health = Health::new().await;
        health.probe(&log).await;
        let auth = Authenticator::new(
            verifier,
            config.allow_anonymous,
            config.max_streams_per_account,
        );
        let shutdown = Shutdown::new();
        let retention = RetentionSettings::from(&config);
        let settings = ServiceSettings {
            max_message_bytes: config.max_message_bytes,
            keepalive_interval: config.keepalive_interval,
            publish_rate_per_agent: config.publish_rate_per_agent,
            max_subscriptions_per_stream: config.max_subscriptions_per_stream,
            max_follows_per_account: config.max_follows_per_account,
            default_policy: retention.default_policy,
            stream_buffer_bytes: config.stream_buffer_bytes,
            gate: GateSettings {
                max_group_size: config.max_group_size,
                create_rate: config.create_rate_per_account,
                org_claims_per_minute: config.org_claims_per_minute,
                checks_per_account: config.group_checks_per_account,
            },
        };
        let transport_limit = settings.transport_limit();
        let relay = Relay::new(log.clone(), Arc::clone(&auth), settings, shutdown.clone());
        let grpc = GrpcServer::new(relay).max_decoding_message_size(transport_limit);

        let mut http = http2::Builder::new(TokioExecutor::new());
        http.max_concurrent_streams(
            config
                .max_streams_per_connection
                .saturating_add(STREAMS_OVER_CAP),
        )
        // Streams reset before they were even accepted: h2 answers a burst of these with
        // GOAWAY(ENHANCE_YOUR_CALM) itself; later resets are counted by `Connection`.
        .max_pending_accept_reset_streams(usize::try_from(config.reset_burst).unwrap_or(usize::MAX))
        .max_send_buf_size(SEND_BUFFER_BYTES);

        let calls = Arc::new(Calls::default());
        let shared = Arc::new(Shared {
            grpc,
            http,
            calls: Arc::clone(&calls),
            shutdown: shutdown.clone(),
            transport_limit,
            max_streams: config.max_streams_per_connection,
            reset_burst: f64::from(config.reset_burst),
            reset_rate: config.reset_rate_per_second,
            idle_timeout: config.idle_timeout,
            admission: Mutex::new(Admission::default()),
            max_connections: config.max_connections,
            max_per_address: config.max_connections_per_address,
            tls: config.tls.clone().map(TlsAcceptor::from),
            tls_handshake_timeout: config.tls_handshake_timeout,
            handshakes_failed: Mutex::new(RateLimitedLog::new("TLS handshakes failed")),
            health: health.service(),
        });
        let acceptor = tokio::spawn(accept(listeners, shared, shutdown.watch()));
        let prober = tokio::spawn(health::run(
            Arc::clone(&health),
            log.clone(),
            config.health_interval,
            shutdown.watch(),
        ));
        let pruner = tokio::spawn(retention::run(
            log.clone(),
            retention.clone(),
            shutdown.watch(),
        ));
        Ok(RelayServer {
            local_addr,
            log,
            auth,
            shutdown,
            calls,
            acceptor: Some(acceptor),
            graceful_timeout: config.graceful_timeout,
            retention,
            pruner: Some(pruner),
            health,
            prober: Some(prober),
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The channels' log (what is loaded and cached: for the tests and benchmarks).
    pub fn log(&self) -> &ChannelLog {
        &self.log
    }

    /// Runs one pass of the pruner now (as the background task does every
    /// `retention.prune_interval`): for tests and tools.
    pub async fn prune_now(&self) -> Result<PassReport> {
        retention::pass(&self.log, &self.retention).await
    }

    /// Ok while the relay serves and its store can write, else why not (its gRPC health
    /// status; `/readyz`).
    pub fn health(&self) -> std::result::Result<(), String> {
        self.health.status()
    }

    /// The relay's metrics in Prometheus's text format (the gauges read now).
    pub fn metrics_text(&self) -> String {
        let m = metrics();
        m.channels_loaded
            .set(i64::try_from(self.log.loaded_channels()).unwrap_or(i64::MAX));
        m.cached_bytes
            .set(i64::try_from(self.log.cached_bytes()).unwrap_or(i64::MAX));
        metrics::render()
    }

    /// The API keys behind live streams (for the revocation checks).
    pub fn live_keys(&self) -> Vec<String> {
        self.auth.live_keys()
    }

    /// End every live stream of `key_id` with UNAUTHENTICATED `reason`; how many there were.
    pub fn end_streams_of_key(&self, key_id: &str, reason: &str) -> usize {
        self.auth
            .end_streams_of_key(key_id, &RelayError::Unauthenticated(reason.to_owned()))
    }

    /// Graceful stop: stop accepting, end live subscriptions with UNAVAILABLE "relay is
    /// shutting down", let in-flight calls finish within `graceful_timeout`, close every
    /// connection, commit what was submitted, close the store.
    pub async fn shutdown(mut self) {
        self.health.drain().await;
        self.shutdown.advance(Phase::Draining);
        let connections = match self.acceptor.take() {
            Some(acceptor) => match acceptor.await {
                Ok(connections) => Some(connections),
                Err(e) => {
                    ::log::error!(target: "static.relay", "the accept loop failed: {e}");
                    None
                }
            },
            None => None,
        };
        // New calls are refused from here on; streaming calls stop reading and end.
        self.shutdown.advance(Phase::Refusing);
        self.auth.end_all(&shutting_down());
        self.calls
            .wait_idle(tokio::time::Instant::now() + self.graceful_timeout)
            .await;
        // h2 sends nothing after its GOAWAY: that comes once the calls are done (or late).
        self.shutdown.advance(Phase::Closing);
        if let Some(mut connections) = connections {
            let closed = async { while connections.join_next().await.is_some() {} };
            if tokio::time::timeout(CLOSE_GRACE, closed).await.is_err() {
                connections.abort_all();
                while connections.join_next().await.is_some() {}
            }
        }
        // The pruner stops between two steps (a step under way is the writer's to finish).
        self.shutdown.advance(Phase::Stopped);
        if let Some(pruner) = self.pruner.take() {
            let _ = pruner.await;
        }
        if let Some(prober) = self.prober.take() {
            let _ = prober.await;
        }
        self.log.close().await;
    }
}

impl Drop for RelayServer {
    fn drop(&mut self) {
        // Not shut down: the accept loop goes, and with it (its JoinSet) every connection.
        if let Some(acceptor) = self.acceptor.take() {
            acceptor.abort();
        }
        if let Some(pruner) = self.pruner.take() {
            pruner.abort();
        }
        if let Some(prober) = self.prober.take() {
            prober.abort();
        }
    }
}

fn cannot_listen(config: &RelayConfig, err: &dyn std::fmt::Display) -> RelayError {
    RelayError::Listen(format!(
        "cannot listen on {}: {}",
        host_port(&config.host, config.port),
        plain(&err.to_string())
    ))
}

/// `host:port`, `[v6]:port` for an IPv6 address (as `static serve` writes addresses).
fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// An OS error as a person reads it: "address already in use", not "Address already in use
/// (os error 98)".
fn plain(text: &str) -> String {
    let text = text
        .rfind(" (os error ")
        .map_or(text, |at| &text[..at])
        .trim();
    let mut chars = text.chars();
    match chars.next() {
        Some(first) => first.to_lowercase().chain(chars).collect(),
        None => String::new(),
    }
}

/// Listeners on every address of `host` (one port for all), nothing else: no SO_REUSEPORT,
/// so a second relay cannot share the port.
async fn bind(host: &str, port: u16) -> Result<Vec<TcpListener>> {
    let failed = |e: &dyn std::fmt::Display| {
        RelayError::Listen(format!(
            "cannot listen on {}: {}",
            host_port(host, port),
            plain(&e.to_string())
        ))
    };
    let mut addrs: Vec<SocketAddr> = tokio::net::lookup_host((host, port))
        .await
        .map_err(|e| failed(&e))?
        .collect();
    addrs.dedup();
    let mut listeners = Vec::with_capacity(addrs.len());
    let mut port = port;
    for addr in addrs {
        let listener = TcpListener::bind(SocketAddr::new(addr.ip(), port))
            .await
            .map_err(|e| failed(&e))?;
        if port == 0 {
            port = listener.local_addr().map_err(|e| failed(&e))?.port();
        }
        listeners.push(listener);
    }
    Ok(listeners)
}

/// What every connection shares.
struct Shared {
    grpc: GrpcServer<Relay>,
    http: http2::Builder<TokioExecutor>,
    calls: Arc<Calls>,
    shutdown: Shutdown,
    transport_limit: usize,
    max_streams: u32,
    reset_burst: f64,
    reset_rate: f64,
    idle_timeout: Duration,
    admission: Mutex<Admission>,
    max_connections: usize,
    max_per_address: usize,
    /// TLS on the port, or None for plaintext.
    tls: Option<TlsAcceptor>,
    tls_handshake_timeout: Duration,
    handshakes_failed: Mutex<RateLimitedLog>,
    /// The gRPC health service (no token, not refused while draining: it says NOT_SERVING).
    health: health_server::HealthServer<tonic_health::server::HealthService>,
}

/// The connections being served: how many, and from which addresses.
#[derive(Default)]
struct Admission {
    total: usize,
    per_address: HashMap<IpAddr, usize>,
}

/// A served connection's place in the caps, given back when it is dropped.
struct Admitted {
    shared: Arc<Shared>,
    address: IpAddr,
}

impl Shared {
    /// A place for a connection from `address`, or None when a cap is reached.
    fn admit(self: &Arc<Self>, address: IpAddr) -> Option<Admitted> {
        let mut admission = self
            .admission
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if admission.total >= self.max_connections {
            return None;
        }
        let held = admission.per_address.entry(address).or_insert(0);
        if *held >= self.max_per_address {
            return None;
        }
        *held += 1;
        admission.total += 1;
        metrics().connections.inc();
        Some(Admitted {
            shared: Arc::clone(self),
            address,
        })
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let mut admission = self
            .shared
            .admission
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        admission.total = admission.total.saturating_sub(1);
        metrics().connections.dec();
        if let Some(held) = admission.per_address.get_mut(&self.address) {
            *held = held.saturating_sub(1);
            if *held == 0 {
                admission.per_address.remove(&self.address);
            }
        }
    }
}

/// A log line at most every [`LOG_EVERY`], saying how many times it happened meanwhile.
struct RateLimitedLog {
    what: &'static str,
    last: Option<Instant>,
    unsaid: u64,
}

impl RateLimitedLog {
    fn new(what: &'static str) -> Self {
        RateLimitedLog {
            what,
            last: None,
            unsaid: 0,
        }
    }

    fn note(&mut self, detail: &dyn std::fmt::Display) {
        self.unsaid += 1;
        let now = Instant::now();
        if self
            .last
            .is_some_and(|last| now.saturating_duration_since(last) < LOG_EVERY)
        {
            return;
        }
        let times = if self.unsaid == 1 {
            String::new()
        } else {
            format!(" ({} times since the last report)", self.unsaid)
        };
        ::log::warn!(target: "static.relay", "{}: {detail}{times}", self.what);
        self.last = Some(now);
        self.unsaid = 0;
    }
}

/// Accepts until the drain; returns the connections' tasks (dropping them aborts them).
async fn accept(listeners: Vec<TcpListener>, shared: Arc<Shared>, mut phase: Watch) -> JoinSet<()> {
    let mut connections = JoinSet::new();
    let mut refused = RateLimitedLog::new("refused connections");
    let mut failed = RateLimitedLog::new("accept failed");
    loop {
        tokio::select! {
            () = phase.reached(Phase::Draining) => return connections,
            Some(done) = connections.join_next(), if !connections.is_empty() => {
                if let Err(e) = done {
                    if e.is_panic() {
                        ::log::error!(target: "static.relay", "a connection's task panicked: {e}");
                    }
                }
            }
            accepted = accept_any(&listeners) => match accepted {
                Ok((stream, peer)) => {
                    let address = client_key(peer.ip());
                    let Some(admitted) = shared.admit(address) else {
                        // Closed at once (dropped): a refusal costs an accept and a close.
                        drop(stream);
                        refused.note(&format_args!(
                            "over the caps ({} connections, {} per address), the last from {}",
                            shared.max_connections, shared.max_per_address, address
                        ));
                        continue;
                    };
                    let phase = phase.clone();
                    connections.spawn(serve(stream, peer, admitted, phase));
                }
                Err(e) => {
                    // E.g. out of file descriptors: wait, then go on.
                    failed.note(&e);
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
        }
    }
}

async fn accept_any(listeners: &[TcpListener]) -> std::io::Result<(TcpStream, SocketAddr)> {
    poll_fn(|cx| {
        for listener in listeners {
            if let Poll::Ready(accepted) = listener.poll_accept(cx) {
                return Poll::Ready(accepted);
            }
        }
        Poll::Pending
    })
    .await
}

/// One connection: its TLS handshake first when the port has TLS, then HTTP/2.
async fn serve(stream: TcpStream, peer: SocketAddr, admitted: Admitted, mut phase: Watch) {
    // Small answers must leave at once (the latency target), not wait for Nagle.
    if let Err(e) = stream.set_nodelay(true) {
        ::log::warn!(target: "static.relay", "TCP_NODELAY on {peer}: {e}");
    }
    let Some(acceptor) = admitted.shared.tls.clone() else {
        return serve_http(stream, peer, admitted, phase).await;
    };
    let timeout = admitted.shared.tls_handshake_timeout;
    let handshake = tokio::select! {
        done = tokio::time::timeout(timeout, acceptor.accept(stream)) => done,
        // A connection still shaking hands holds no call: it goes with the drain.
        () = phase.reached(Phase::Draining) => return,
    };
    let failure = match handshake {
        Ok(Ok(tls)) => return serve_http(tls, peer, admitted, phase).await,
        Ok(Err(e)) => e.to_string(),
        Err(_) => format!("no handshake within {timeout:?}"),
    };
    // Dropping the stream closes it. Rate-limited: plaintext or stalled peers must not
    // flood the log.
    admitted
        .shared
        .handshakes_failed
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .note(&format_args!("the last from {}: {failure}", peer.ip()));
}

/// One connection's HTTP/2, until the peer leaves, it floods resets, it holds no call for the
/// idle timeout, or the relay closes it.
async fn serve_http<S>(stream: S, peer: SocketAddr, admitted: Admitted, mut phase: Watch)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let shared = Arc::clone(&admitted.shared);
    let connection = Arc::new(Connection {
        peer: Peer(Arc::from(format!("{}:{}", peer.ip(), peer.port()))),
        active: AtomicU32::new(0),
        resets: Mutex::new(TokenBucket::full(
            shared.reset_rate,
            shared.reset_burst,
            Instant::now(),
        )),
        flooded: Notify::new(),
        quiet_since: Mutex::new(Instant::now()),
    });
    let gate = CallGate {
        shared: Arc::clone(&shared),
        connection: Arc::clone(&connection),
    };
    let conn = shared.http.serve_connection(TokioIo::new(stream), gate);
    tokio::pin!(conn);
    let mut going_away = false;
    // The idle timer; once the connection is closed for idleness, the deadline of its
    // GOAWAY (a peer that sent nothing, or only the preface, never answers it).
    let timer = tokio::time::sleep(shared.idle_timeout);
    tokio::pin!(timer);
    let mut idle_closing = false;
    let flooded = loop {
        tokio::select! {
            served = conn.as_mut() => match served {
                Ok(()) => return,
                Err(e) => break is_reset_flood(&e),
            },
            () = connection.flooded.notified() => break true,
            () = phase.reached(Phase::Closing), if !going_away => {
                going_away = true;
                conn.as_mut().graceful_shutdown();
            }
            () = &mut timer => {
                let now = Instant::now();
                if idle_closing {
                    if connection.active.load(Ordering::Acquire) == 0 {
                        // Dropping the connection closes its socket.
                        return;
                    }
                    // A call that came just before the GOAWAY finishes first.
                    timer.as_mut().reset((now + CLOSE_GRACE).into());
                    continue;
                }
                match connection.idle_until(shared.idle_timeout) {
                    Some(deadline) if deadline <= now => {
                        idle_closing = true;
                        if !going_away {
                            going_away = true;
                            conn.as_mut().graceful_shutdown();
                        }
                        timer.as_mut().reset((now + CLOSE_GRACE).into());
                    }
                    Some(deadline) => timer.as_mut().reset(deadline.into()),
                    None => timer.as_mut().reset((now + shared.idle_timeout).into()),
                }
            }
        }
    };
    if flooded {
        // Dropping the connection closes its socket and ends its calls.
        ::log::warn!(
            target: "static.relay",
            "closing {}: too many stream resets",
            connection.peer.0
        );
    }
}

/// Whether h2 closed the connection for too many resets (its GOAWAY(ENHANCE_YOUR_CALM)).
fn is_reset_flood(err: &hyper::Error) -> bool {
    let mut source = std::error::Error::source(err);
    while let Some(e) = source {
        if let Some(h2) = e.downcast_ref::<h2::Error>() {
            return h2.is_go_away()
                && !h2.is_remote()
                && h2.reason() == Some(h2::Reason::ENHANCE_YOUR_CALM);
        }
        source = e.source();
    }
    false
}

/// The calls in flight across every connection (what a shutdown waits for).
#[derive(Default)]
struct Calls {
    active: AtomicUsize,
    idle: Notify,
}

impl Calls {
    /// Until no call is in flight, or `deadline`.
    async fn wait_idle(&self, deadline: tokio::time::Instant) {
        loop {
            let idle = self.idle.notified();
            tokio::pin!(idle);
            // Registered before the count is read: a last call ending now is not missed.
            idle.as_mut().enable();
            if self.active.load(Ordering::Acquire) == 0 {
                return;
            }
            if tokio::time::timeout_at(deadline, idle).await.is_err() {
                return;
            }
        }
    }
}

/// One connection's bookkeeping.
struct Connection {
    peer: Peer,
    /// Calls in flight on this connection.
    active: AtomicU32,
    /// Streams the peer may reset (after they were accepted) before the connection is
    /// closed: a burst, then a rate (HTTP/2 rapid reset).
    resets: Mutex<TokenBucket>,
    flooded: Notify,
    /// Since when no call is in flight (the connection's start before its first call).
    quiet_since: Mutex<Instant>,
}

impl Connection {
    /// When the connection becomes idle for `timeout` if no call comes; None while calls
    /// are in flight.
    fn idle_until(&self, timeout: Duration) -> Option<Instant> {
        let quiet_since = || {
            *self
                .quiet_since
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
        };
        let before = quiet_since();
        if self.active.load(Ordering::Acquire) != 0 {
            return None;
        }
        // A call that ended in between set the time before its count went to 0: read again.
        Some(before.max(quiet_since()) + timeout)
    }

    fn quiet_now(&self) {
        *self
            .quiet_since
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Instant::now();
    }

    fn reset(&self) {
        let wait = self
            .resets
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take(Instant::now(), 1.0);
        if !wait.is_zero() {
            self.flooded.notify_one();
        }
    }
}

/// A call in flight: counted on its connection and the server until its response is done.
/// Dropped before that, the peer reset the stream (or went away).
struct CallSlot {
    shared: Arc<Shared>,
    connection: Arc<Connection>,
    finished: bool,
}

impl CallSlot {
    /// A slot for a new call, or None when the connection has its cap of calls in flight.
    fn open(shared: &Arc<Shared>, connection: &Arc<Connection>) -> Option<CallSlot> {
        let before = connection.active.fetch_add(1, Ordering::AcqRel);
        if before >= shared.max_streams {
            connection.active.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        shared.calls.active.fetch_add(1, Ordering::AcqRel);
        Some(CallSlot {
            shared: Arc::clone(shared),
            connection: Arc::clone(connection),
            finished: false,
        })
    }
}

impl Drop for CallSlot {
    fn drop(&mut self) {
        // The time first, then the count: the idle timer never sees 0 calls with an old time.
        self.connection.quiet_now();
        self.connection.active.fetch_sub(1, Ordering::AcqRel);
        if self.shared.calls.active.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.shared.calls.idle.notify_waiters();
        }
        if !self.finished {
            self.connection.reset();
        }
    }
}

/// The per-connection HTTP service in front of the gRPC one: the cap of calls, the drain,
/// the peer's address, and the relay's texts for what tonic refuses by itself.
#[derive(Clone)]
struct CallGate {
    shared: Arc<Shared>,
    connection: Arc<Connection>,
}

type ResponseFuture = Pin<
    Box<dyn Future<Output = std::result::Result<http::Response<CountedBody>, Infallible>> + Send>,
>;

impl hyper::service::Service<http::Request<Incoming>> for CallGate {
    type Response = http::Response<CountedBody>;
    type Error = Infallible;
    type Future = ResponseFuture;

    fn call(&self, mut request: http::Request<Incoming>) -> ResponseFuture {
        let method = metrics::method_label(request.uri().path());
        let record = CallRecord::new(method, Arc::clone(&self.connection.peer.0));
        if method.starts_with("Health/") {
            // Health calls need no token, hold no call slot (a Watch must not hold the drain
            // up) and are answered while draining (NOT_SERVING).
            let mut health = self.shared.health.clone();
            return Box::pin(async move {
                let response = match health.call(request).await {
                    Ok(response) => response,
                    Err(never) => match never {},
                };
                Ok(counted(response, None, record))
            });
        }
        if self.shared.shutdown.reached(Phase::Refusing) {
            return refuse(&shutting_down(), record);
        }
        let Some(slot) = CallSlot::open(&self.shared, &self.connection) else {
            return refuse(
                &RelayError::resource_exhausted(format!(
                    "too many concurrent streams on this connection (limit {})",
                    self.shared.max_streams
                )),
                record,
            );
        };
        request
            .extensions_mut()
            .insert(self.connection.peer.clone());
        request.extensions_mut().insert(record.who());
        let mut grpc = self.shared.grpc.clone();
        let limit = self.shared.transport_limit;
        Box::pin(async move {
            let response = match grpc.call(request).await {
                Ok(response) => response,
                Err(never) => match never {},
            };
            let response = reworded(response, limit);
            Ok(counted(response, Some(slot), record))
        })
    }
}

/// The response with its call counted (`slot`) and recorded (`record`) until it is done; a
/// trailers-only answer (a refusal) is recorded at once.
fn counted(
    response: http::Response<Body>,
    slot: Option<CallSlot>,
    mut record: CallRecord,
) -> http::Response<CountedBody> {
    let record = if record.finish_with(response.headers()) {
        None
    } else {
        Some(record)
    };
    response.map(|body| CountedBody {
        inner: body,
        slot,
        record,
    })
}

fn refuse(error: &RelayError, record: CallRecord) -> ResponseFuture {
    let response = error.to_status().into_http::<Body>();
    Box::pin(std::future::ready(Ok(counted(response, None, record))))
}

/// A trailers-only answer tonic made by itself while reading the request (too large, not
/// protobuf), with the relay's status and text instead.
fn reworded(response: http::Response<Body>, limit: usize) -> http::Response<Body> {
    match response
        .extensions()
        .get::<Status>()
        .and_then(|status| service::transport_error(status, limit))
    {
        Some(error) => error.to_status().into_http(),
        None => response,
    }
}

/// A response body that keeps its call counted until it is done.
struct CountedBody {
    inner: Body,
    slot: Option<CallSlot>,
    /// Until the call's status is seen (its trailers).
    record: Option<CallRecord>,
}

impl CountedBody {
    fn finish(&mut self) {
        if let Some(slot) = &mut self.slot {
            slot.finished = true;
        }
    }
}

impl HttpBody for CountedBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<std::result::Result<Frame<Bytes>, Status>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(None) | Poll::Ready(Some(Err(_))) => self.finish(),
            Poll::Ready(Some(Ok(frame))) if frame.is_trailers() => {
                if let (Some(record), Some(trailers)) = (&mut self.record, frame.trailers_ref()) {
                    record.finish_with(trailers);
                }
                self.finish();
            }
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for CountedBody {
    fn drop(&mut self) {
        // A trailers-only answer is done without ever being polled.
        if self.inner.is_end_stream() {
            self.finish();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bind_errors_name_the_address_in_plain_words() {
        assert_eq!(
            plain("Address already in use (os error 98)"),
            "address already in use"
        );
        assert_eq!(host_port("::1", 80), "[::1]:80");
        assert_eq!(host_port("127.0.0.1", 80), "127.0.0.1:80");
    }

    #[test]
    fn an_ipv6_client_counts_by_its_64() {
        let key = |s: &str| client_key(s.parse().unwrap_or(IpAddr::V4(0.into())));
        assert_eq!(key("2001:db8:1:2:3:4:5:6"), key("2001:db8:1:2:ffff::1"));
        assert_ne!(key("2001:db8:1:2::1"), key("2001:db8:1:3::1"));
        assert_eq!(key("::ffff:10.0.0.1"), key("10.0.0.1"));
        assert_ne!(key("10.0.0.1"), key("10.0.0.2"));
    }

    fn send_sync<T: Send + Sync>(_: &T) {}
    fn send<T: Send>(_: &T) {}

    /// The Python binding keeps the server in a pyclass and drives its futures on its
    /// runtime: all of it must be Send (and the server Sync).
    #[allow(dead_code)]
    fn the_binding_can_hold_and_drive_it(config: RelayConfig, server: RelayServer) {
        send_sync(&server);
        send(&RelayServer::start(config, None));
        send(&server.shutdown());
    }
}
