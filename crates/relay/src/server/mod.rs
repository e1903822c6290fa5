//! `RelayServer`: bind (the configured host only, no SO_REUSEPORT), serve, drain.
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
//!
//! Layout: this file starts and stops the relay and holds what every connection shares;
//! `accept` takes connections, `caps` admits them under the connection caps, `connection`
//! serves one (TLS, HTTP/2, idleness, reset floods), `call` counts and gates each call.

mod accept;
mod call;
mod caps;
mod connection;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hyper::server::conn::http2;
use hyper_util::rt::TokioExecutor;
use tokio::net::TcpListener;
use tokio::task::{JoinHandle, JoinSet};
use tokio_rustls::TlsAcceptor;
use tonic_health::pb::health_server;

use crate::auth::{Authenticator, Verify};
use crate::error::{shutting_down, RelayError, Result};
use crate::log::{ChannelLog, LogSettings};
use crate::observe::health::{self, Health};
use crate::observe::metrics::{self, metrics};
use crate::pb::relay_server::RelayServer as GrpcServer;
use crate::retention::{self, PassReport, RetentionSettings};
use crate::service::{DirectorySettings, GateSettings, Relay, ServiceSettings};
use crate::settings::RelayConfig;
use crate::shutdown::{Phase, Shutdown};

use accept::accept;
use call::Calls;
use caps::{Admission, RateLimitedLog};

/// How long closing connections may take to flush after their GOAWAY (as in Python).
const CLOSE_GRACE: Duration = Duration::from_secs(1);
/// HTTP/2 streams a connection may open beyond the relay's cap: those get the cap's
/// RESOURCE_EXHAUSTED answer, and only past this does h2 itself refuse streams.
const STREAMS_OVER_CAP: u32 = 100;
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
            directory: DirectorySettings {
                claim_rate_per_account: config.claim_rate_per_account,
                claim_rate_per_address: config.claim_rate_per_address,
                max_pending_invitations: config.max_pending_invitations,
                welcome_ttl: retention.welcome_ttl,
            },
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

    /// Up to `limit` distinct API keys behind bound leaves, in order, after `after` (the keys
    /// whose revocation would remove leaves: `static serve` checks them in batches).
    pub async fn bound_keys(&self, after: &str, limit: usize) -> Result<Vec<String>> {
        crate::removal::bound_keys(&self.log, after, limit).await
    }

    /// A page of `account`'s channels with their rosters (the console's read: see
    /// [`crate::overview::account_channels`]).
    pub async fn account_channels(
        &self,
        account: &str,
        patterns: Option<&crate::ChannelPatterns>,
        after: i64,
        limit: usize,
    ) -> Result<crate::overview::ChannelPage> {
        crate::overview::account_channels(&self.log, account, patterns, after, limit).await
    }

    /// `account`'s application messages per minute over the last hour before `now_ms` (see
    /// [`crate::overview::account_rate`]).
    pub async fn account_rate(
        &self,
        account: &str,
        patterns: Option<&crate::ChannelPatterns>,
        now_ms: i64,
    ) -> Result<Vec<u64>> {
        crate::overview::account_rate(&self.log, account, patterns, now_ms).await
    }

    /// Proposes the removal of every leaf last bound by one of `keys` (found inactive), at
    /// most `max_proposals` in this call (docs/design.md §5.2, "Removal on revocation").
    pub async fn remove_leaves_of_keys(
        &self,
        keys: &[String],
        max_proposals: usize,
    ) -> Result<crate::removal::RemovalReport> {
        crate::removal::remove_leaves_of_keys(&self.log, keys, max_proposals).await
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
