//! The relay's Prometheus metrics: one registry for the process, rendered as text by
//! [`render`] (`static._native.relay.RelayServer.metrics()`, appended to the HTTP port's `/metrics`).
//!
//! Labels are bounded: a gRPC method is one of the relay's own (anything else is `other`), a
//! code one of gRPC's 17. No channel name, account or peer is ever a label. Updating a metric is
//! a few atomic operations (no lock, no allocation), so it stays under the noise of a publish
//! (`bench/e2e.py`, docs/design.md "Observability").

use std::sync::LazyLock;
use std::time::{Duration, Instant};

use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts,
    Registry, TextEncoder,
};
use tonic::Code;

/// Latency buckets, seconds: 100 us to 10 s (a publish acks in ~0.3 ms, a store commit takes
/// 0.1-10 ms, a stream may live for hours: its calls land in +Inf).
const BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0,
];

/// The relay's gRPC methods (and the health service's): the only values of the `method`
/// label, so that a client naming any path cannot grow the registry.
pub const METHODS: &[&str] = &[
    "CreateChannel",
    "BindLeaf",
    "ListMembers",
    "Publish",
    "PublishStream",
    "PublishBatches",
    "Subscribe",
    "SubscribeMany",
    "FetchWelcome",
    "SetRetention",
    "GetRetention",
    "OfferKeyPackages",
    "SetInvitationPolicy",
    "ClaimKeyPackage",
    "Invite",
    "ListInvitations",
    "OpenInvitation",
    "SettleInvitation",
    "GetRelayInfo",
    "Health/Check",
    "Health/Watch",
];

/// The `method` label of a request path: `/static.relay.v1.Relay/Publish` -> `Publish`,
/// `/grpc.health.v1.Health/Check` -> `Health/Check`, anything else `other`.
pub fn method_label(path: &str) -> &'static str {
    let (service, method) = path
        .trim_start_matches('/')
        .rsplit_once('/')
        .unwrap_or(("", ""));
    let name = if service == tonic_health::pb::health_server::SERVICE_NAME {
        match method {
            "Check" => "Health/Check",
            "Watch" => "Health/Watch",
            _ => "other",
        }
    } else if service == crate::pb::relay_server::SERVICE_NAME {
        METHODS
            .iter()
            .find(|m| **m == method)
            .copied()
            .unwrap_or("other")
    } else {
        "other"
    };
    name
}

/// The `code` label of a gRPC status code (`OK`, `NOT_FOUND`, ...).
pub fn code_label(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

/// Every metric of the relay.
pub struct Metrics {
    registry: Registry,
    /// Calls ended, by method and code.
    pub calls: IntCounterVec,
    /// How long calls took (a stream: its whole life), by method.
    pub call_seconds: HistogramVec,
    /// Refusals, by code: calls that ended with one, and refused items of PublishBatches.
    pub refusals: IntCounterVec,
    /// Publishes decided by the log: appended (`kind` application or commit) or duplicate.
    pub published: IntCounterVec,
    /// MLS commits appended (each moves a channel's epoch).
    pub commits: IntCounter,
    /// Entries sent to subscribers (Subscribe and SubscribeMany).
    pub delivered: IntCounter,
    /// From a publish's submission to the log until its answer (durable).
    pub publish_to_ack: Histogram,
    /// From the submission of the newest entry of a page to the page's send to a live
    /// subscriber (one observation per page).
    pub publish_to_delivery: Histogram,
    /// One group commit of the log's writer (its store transaction).
    pub store_commit: Histogram,
    /// Failed store transactions of the writer.
    pub store_failures: IntCounter,
    pub connections: IntGauge,
    /// Live streaming calls (Subscribe, SubscribeMany).
    pub streams: IntGauge,
    pub channels_loaded: IntGauge,
    pub cached_bytes: IntGauge,
}

fn counter_vec(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    let metric = IntCounterVec::new(Opts::new(name, help), labels).unwrap_or_else(|e| bad(name, e));
    register(registry, name, metric)
}

fn histogram(registry: &Registry, name: &str, help: &str) -> Histogram {
    let opts = HistogramOpts::new(name, help).buckets(BUCKETS.to_vec());
    let metric = Histogram::with_opts(opts).unwrap_or_else(|e| bad(name, e));
    register(registry, name, metric)
}

fn gauge(registry: &Registry, name: &str, help: &str) -> IntGauge {
    let metric = IntGauge::new(name, help).unwrap_or_else(|e| bad(name, e));
    register(registry, name, metric)
}

fn counter(registry: &Registry, name: &str, help: &str) -> IntCounter {
    let metric = IntCounter::new(name, help).unwrap_or_else(|e| bad(name, e));
    register(registry, name, metric)
}

fn register<M: prometheus::core::Collector + Clone + 'static>(
    registry: &Registry,
    name: &str,
    metric: M,
) -> M {
    if let Err(e) = registry.register(Box::new(metric.clone())) {
        bad(name, e);
    }
    metric
}

/// The definitions above are constants: a bad one is a bug caught by the first test.
fn bad(name: &str, e: prometheus::Error) -> ! {
    panic!("relay metric {name}: {e}")
}

impl Metrics {
    fn new() -> Metrics {
        let r = Registry::new();
        let call_seconds = HistogramVec::new(
            HistogramOpts::new(
                "static_relay_call_seconds",
                "Relay gRPC calls: how long each took (a stream, its whole life), by method",
            )
            .buckets(BUCKETS.to_vec()),
            &["method"],
        )
        .unwrap_or_else(|e| bad("static_relay_call_seconds", e));
        Metrics {
            calls: counter_vec(
                &r,
                "static_relay_calls_total",
                "Relay gRPC calls ended, by method and gRPC code",
                &["method", "code"],
            ),
            call_seconds: register(&r, "static_relay_call_seconds", call_seconds),
            refusals: counter_vec(
                &r,
                "static_relay_refusals_total",
                "Relay refusals by gRPC code: calls ended with one, and refused batch items",
                &["code"],
            ),
            published: counter_vec(
                &r,
                "static_relay_publishes_total",
                "Publishes decided by the log: appended (application, commit) or duplicate",
                &["kind"],
            ),
            commits: counter(
                &r,
                "static_relay_commits_total",
                "MLS commits appended (each moves its channel's epoch)",
            ),
            delivered: counter(
                &r,
                "static_relay_deliveries_total",
                "Entries sent to subscribers",
            ),
            publish_to_ack: histogram(
                &r,
                "static_relay_publish_to_ack_seconds",
                "From a publish's submission to the log until its answer (durable)",
            ),
            publish_to_delivery: histogram(
                &r,
                "static_relay_publish_to_delivery_seconds",
                "From the submission of a page's newest entry to the page's send to a live \
                 subscriber",
            ),
            store_commit: histogram(
                &r,
                "static_relay_store_commit_seconds",
                "The relay log writer's store transactions (one group commit each)",
            ),
            store_failures: counter(
                &r,
                "static_relay_store_failures_total",
                "The relay log writer's failed store transactions",
            ),
            connections: gauge(&r, "static_relay_connections", "Relay connections served"),
            streams: gauge(
                &r,
                "static_relay_streams",
                "Live relay streams (Subscribe, SubscribeMany)",
            ),
            channels_loaded: gauge(
                &r,
                "static_relay_channels_loaded",
                "Channels the relay holds in memory",
            ),
            cached_bytes: gauge(
                &r,
                "static_relay_cached_bytes",
                "Bytes of recent entries the relay caches (bounded by --relay-cache-bytes)",
            ),
            registry: r,
        }
    }
}

static METRICS: LazyLock<Metrics> = LazyLock::new(Metrics::new);
/// The origin of [`now_ns`].
static ORIGIN: LazyLock<Instant> = LazyLock::new(Instant::now);

/// The process's relay metrics.
pub fn metrics() -> &'static Metrics {
    &METRICS
}

/// A monotonic time in ns, to keep in an atomic (0 is never returned: it means "unset").
pub fn now_ns() -> u64 {
    u64::try_from(ORIGIN.elapsed().as_nanos())
        .unwrap_or(u64::MAX)
        .max(1)
}

/// The time since `ns` (a [`now_ns`]).
pub fn since_ns(ns: u64) -> Duration {
    Duration::from_nanos(now_ns().saturating_sub(ns))
}

/// The relay's metrics in Prometheus's text format.
pub fn render() -> String {
    let families = METRICS.registry.gather();
    let mut out = Vec::new();
    // Encoding gathered families into a Vec cannot fail but for a bug in the definitions.
    if let Err(e) = TextEncoder::new().encode(&families, &mut out) {
        ::log::error!(target: "static.relay", "encoding the relay's metrics failed: {e}");
    }
    String::from_utf8(out).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_bounded() {
        assert_eq!(method_label("/static.relay.v1.Relay/Publish"), "Publish");
        assert_eq!(method_label("/grpc.health.v1.Health/Check"), "Health/Check");
        assert_eq!(method_label("/static.relay.v1.Relay/Nope"), "other");
        assert_eq!(method_label("/x/y/z"), "other");
        assert_eq!(method_label(""), "other");
    }

    #[test]
    fn it_renders() {
        metrics().calls.with_label_values(&["Publish", "OK"]).inc();
        metrics().commits.inc();
        let text = render();
        assert!(text.contains("static_relay_calls_total{code=\"OK\",method=\"Publish\"}"));
        assert!(text.contains("static_relay_commits_total"));
    }
}
