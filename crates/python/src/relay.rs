//! `static._native.relay`: `RelayServer`, the relay's data plane (`static-relay`) in the `static serve`
//! process, on a tokio runtime of its own. Python keeps what is not per message: it passes a
//! `verify(token, peer)` callable (called once per call, from a blocking thread of that
//! runtime, with the GIL), runs the revocation checks (`live_keys` / `end_streams_of_key`), and
//! decides when to stop (`shutdown`). Errors at start are `OSError`s (a setting out of its
//! bounds a `ValueError`, and so is a TLS certificate or key that cannot serve); nothing else
//! raises. `relay_settings()` is the table of tunable settings; `check_tls_files(cert, key)`
//! checks a certificate and key as the relay would load them (for `static serve`'s startup
//! checks).

use std::collections::HashMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, UNIX_EPOCH};

use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::prelude::*;

use crate::exit;
use static_relay::settings::Kind;
use static_relay::{ChannelPatterns, Database, Principal, RelayConfig, RelayError, Verify};

/// gRPC codes a `verify` callable may refuse with.
const RESOURCE_EXHAUSTED: u32 = 8;
const UNAVAILABLE: u32 = 14;
const UNAUTHENTICATED: u32 = 16;

/// The Python `verify(token, peer)` (`peer`: the caller's `ip:port`): returns `(account_id,
/// key_id, expires_at | None, channels | None)` (`channels`: the key's channel patterns, None
/// for every channel; a 3-tuple is a key without patterns), or `(code, message)` to refuse (UNAUTHENTICATED or
/// UNAVAILABLE), or `(RESOURCE_EXHAUSTED, message, retry_after_seconds)` (too many failures
/// from that address). Raising is a bug: printed, and the call gets INTERNAL.
struct PyVerifier {
    callable: Arc<Py<PyAny>>,
}

impl Verify for PyVerifier {
    fn verify(
        &self,
        token: String,
        peer: String,
    ) -> Pin<Box<dyn Future<Output = Result<Principal, RelayError>> + Send>> {
        let callable = Arc::clone(&self.callable);
        Box::pin(async move {
            // A blocking thread: the callable waits for the trio thread (the store lookup).
            tokio::task::spawn_blocking(move || {
                crate::exit::with_gil_unless_exiting(|py| call_verify(py, &callable, token, peer))
                    .unwrap_or_else(|| {
                        Err(RelayError::Unavailable(
                            "the server is shutting down".into(),
                        ))
                    })
            })
            .await
            .unwrap_or(Err(RelayError::Internal))
        })
    }
}

fn call_verify(
    py: Python<'_>,
    callable: &Py<PyAny>,
    token: String,
    peer: String,
) -> Result<Principal, RelayError> {
    let answer = callable.call1(py, (token, peer)).map_err(|err| {
        err.print(py);
        RelayError::Internal
    })?;
    // A principal: `(account_id, key_id, expires_at, channels)`; the 3-tuple of before
    // (no `channels`) still reads as a key without patterns.
    let principal = answer
        .extract::<(String, String, Option<f64>, Option<Vec<String>>)>(py)
        .or_else(|_| {
            answer
                .extract::<(String, String, Option<f64>)>(py)
                .map(|(account, key, expires)| (account, key, expires, None))
        });
    if let Ok((account_id, key_id, expires_at, channels)) = principal {
        // Checked: an expiry past what SystemTime holds (an `exp` of 1e20) panicked here.
        // Unrepresentable (negative, NaN, too far) is no deadline, as None is.
        let expires_at = expires_at
            .and_then(|at| Duration::try_from_secs_f64(at).ok())
            .and_then(|left| UNIX_EPOCH.checked_add(left));
        // Patterns the relay cannot read refuse the call: a key's restriction is never
        // dropped silently.
        let channels = match channels {
            None => None,
            Some(list) => Some(Arc::new(ChannelPatterns::parse(&list).map_err(|e| {
                RelayError::Unauthenticated(format!("the token's channels claim: {e}"))
            })?)),
        };
        return Ok(Principal {
            account_id,
            key_id,
            expires_at,
            channels,
        });
    }
    if let Ok((RESOURCE_EXHAUSTED, message, retry_after_seconds)) =
        answer.extract::<(u32, String, u64)>(py)
    {
        return Err(RelayError::ResourceExhausted {
            message,
            retry_after_ms: retry_after_seconds.saturating_mul(1000),
        });
    }
    match answer.extract::<(u32, String)>(py) {
        Ok((UNAUTHENTICATED, message)) => Err(RelayError::Unauthenticated(message)),
        Ok((UNAVAILABLE, message)) => Err(RelayError::Unavailable(message)),
        _ => {
            eprintln!("relay: verify() returned neither a principal nor a refusal");
            Err(RelayError::Internal)
        }
    }
}

/// One channel of `account_channels`, as Python receives it.
type ChannelTuple = (
    String,
    u64,
    u64,
    Option<i64>,
    (Option<u64>, Option<u64>, Option<u64>),
    usize,
    Vec<(u32, Vec<u8>, Option<String>)>,
);

struct Running {
    runtime: tokio::runtime::Runtime,
    server: static_relay::RelayServer,
}

/// A running relay; `shutdown()` stops it gracefully (dropping it aborts it).
#[pyclass(frozen, module = "static._native.relay")]
struct RelayServer {
    running: Mutex<Option<Running>>,
    port: u16,
}

impl RelayServer {
    fn with_server<T>(&self, f: impl FnOnce(&static_relay::RelayServer) -> T) -> Option<T> {
        let running = self.running.lock().unwrap_or_else(PoisonError::into_inner);
        running.as_ref().map(|r| f(&r.server))
    }

    /// Runs `f` over the relay's log on its runtime, without the GIL and without holding the
    /// server (a shutdown meanwhile is not held up); None once stopped.
    fn on_log<T, Fut>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(static_relay::log::ChannelLog) -> Fut + Send,
    ) -> Option<T>
    where
        T: Send,
        Fut: Future<Output = T>,
    {
        let (handle, log) = {
            let running = self.running.lock().unwrap_or_else(PoisonError::into_inner);
            let running = running.as_ref()?;
            (
                running.runtime.handle().clone(),
                running.server.log().clone(),
            )
        };
        Some(exit::without_gil(py, move || handle.block_on(f(log))))
    }
}

#[pymethods]
impl RelayServer {
    #[new]
    #[pyo3(signature = (
        *, host, port, database, verify, allow_anonymous, settings, tls_cert=None, tls_key=None,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        host: String,
        port: u16,
        database: String,
        verify: Option<Py<PyAny>>,
        allow_anonymous: bool,
        settings: HashMap<String, f64>,
        tls_cert: Option<PathBuf>,
        tls_key: Option<PathBuf>,
    ) -> PyResult<Self> {
        let mut config = RelayConfig::new(Database::parse(&database));
        config.host = host;
        config.port = port;
        config.allow_anonymous = allow_anonymous;
        for (name, value) in settings {
            config
                .set(&name, value)
                .map_err(|e| PyValueError::new_err(e.to_string()))?;
        }
        config.tls = match (tls_cert, tls_key) {
            (Some(cert), Some(key)) => Some(tls_config(&cert, &key)?),
            (None, None) => None,
            _ => {
                return Err(PyValueError::new_err(
                    "tls_cert and tls_key go together: give both or neither",
                ))
            }
        };
        let verifier = verify.map(|callable| {
            Arc::new(PyVerifier {
                callable: Arc::new(callable),
            }) as Arc<dyn Verify>
        });
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .thread_name("static-relay")
            .enable_all()
            .build()
            .map_err(|e| PyOSError::new_err(format!("cannot start the relay's runtime: {e}")))?;
        let server = exit::without_gil(py, || {
            runtime.block_on(static_relay::RelayServer::start(config, verifier))
        })
        .map_err(|e| match e {
            // Says which address already: "cannot listen on HOST:PORT: why".
            RelayError::Listen(why) => PyOSError::new_err(why),
            e => PyOSError::new_err(format!("cannot start the relay: {e}")),
        })?;
        let port = server.local_addr().port();
        Ok(Self {
            running: Mutex::new(Some(Running { runtime, server })),
            port,
        })
    }

    /// The port it listens on.
    #[getter]
    fn port(&self) -> u16 {
        self.port
    }

    /// None while the relay serves and its store can write, else why not (its gRPC health
    /// status). Without the GIL: a runtime thread may be logging (see `logging`).
    fn health(&self, py: Python<'_>) -> Option<String> {
        exit::without_gil(py, || {
            self.with_server(|s| s.health().err())
                .unwrap_or_else(|| Some("relay is stopped".to_owned()))
        })
    }

    /// The relay's metrics, Prometheus text format (without the GIL, as `health`).
    fn metrics(&self, py: Python<'_>) -> String {
        exit::without_gil(py, || {
            self.with_server(static_relay::RelayServer::metrics_text)
                .unwrap_or_default()
        })
    }

    /// The API keys behind live streams.
    fn live_keys(&self) -> Vec<String> {
        self.with_server(|s| s.live_keys()).unwrap_or_default()
    }

    /// Up to `limit` distinct API keys behind bound leaves, in order, after `after` (blocks
    /// without the GIL: call it from a thread). OSError when the store cannot be read.
    fn bound_keys(&self, py: Python<'_>, after: &str, limit: usize) -> PyResult<Vec<String>> {
        let after = after.to_owned();
        self.on_log(py, move |log| async move {
            static_relay::removal::bound_keys(&log, &after, limit).await
        })
        .unwrap_or(Ok(Vec::new()))
        .map_err(|e| PyOSError::new_err(e.to_string()))
    }

    /// A page of `account`'s channels (see `static_relay::overview`): `(channels, next_after)`,
    /// each channel `(name, epoch, head_seq, last_activity_ms, (max_age_seconds, max_entries,
    /// max_bytes), member_count, [(leaf_index, identity, account)])`, at most `limit` (capped)
    /// read after channel id `after`, those matching `patterns` (None: all). Blocks without the
    /// GIL: call it from a thread. None once stopped; OSError when the store cannot be read,
    /// ValueError for a pattern that does not parse.
    #[pyo3(signature = (account, patterns, after, limit))]
    fn account_channels(
        &self,
        py: Python<'_>,
        account: &str,
        patterns: Option<Vec<String>>,
        after: i64,
        limit: usize,
    ) -> PyResult<Option<(Vec<ChannelTuple>, Option<i64>)>> {
        let patterns = patterns
            .map(|list| ChannelPatterns::parse(&list))
            .transpose()
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        let account = account.to_owned();
        let Some(page) = self.on_log(py, move |log| async move {
            static_relay::overview::account_channels(
                &log,
                &account,
                patterns.as_ref(),
                after,
                limit,
            )
            .await
        }) else {
            return Ok(None);
        };
        let page = page.map_err(|e| PyOSError::new_err(e.to_string()))?;
        let channels = page
            .channels
            .into_iter()
            .map(|c| {
                let members = c
                    .members
                    .into_iter()
                    .map(|m| (m.leaf_index, m.identity, m.account))
                    .collect();
                (
                    c.name,
                    c.epoch,
                    c.head_seq,
                    c.last_activity_ms,
                    (
                        c.policy.max_age_seconds,
                        c.policy.max_entries,
                        c.policy.max_bytes,
                    ),
                    c.member_count,
                    members,
                )
            })
            .collect();
        Ok(Some((channels, page.next_after)))
    }

    /// How many application messages `account` published in each of the last 60 minutes
    /// before `now_ms` (unix ms), the oldest first, in channels matching `patterns` (None:
    /// all). Blocks without the GIL: call it from a thread. None once stopped; OSError when
    /// the store cannot be read, ValueError for a pattern that does not parse.
    #[pyo3(signature = (account, patterns, now_ms))]
    fn account_rate(
        &self,
        py: Python<'_>,
        account: &str,
        patterns: Option<Vec<String>>,
        now_ms: i64,
    ) -> PyResult<Option<Vec<u64>>> {
        let patterns = patterns
            .map(|list| ChannelPatterns::parse(&list))
            .transpose()
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        let account = account.to_owned();
        self.on_log(py, move |log| async move {
            static_relay::overview::account_rate(&log, &account, patterns.as_ref(), now_ms).await
        })
        .transpose()
        .map_err(|e| PyOSError::new_err(e.to_string()))
    }

    /// Proposes the removal of every leaf last bound by one of `keys` (found inactive), at most
    /// `max_proposals` in this call: (proposed, already proposed, skipped, failed). Blocks
    /// without the GIL: call it from a thread. OSError when the store cannot be read.
    fn remove_leaves_of_keys(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        max_proposals: usize,
    ) -> PyResult<(usize, usize, usize, usize)> {
        let report = self
            .on_log(py, move |log| async move {
                static_relay::removal::remove_leaves_of_keys(&log, &keys, max_proposals).await
            })
            .unwrap_or(Ok(static_relay::RemovalReport::default()))
            .map_err(|e| PyOSError::new_err(e.to_string()))?;
        Ok((
            report.proposed,
            report.already,
            report.skipped,
            report.failed,
        ))
    }

    /// End the live streams of `key_id` (UNAUTHENTICATED `reason`); how many there were.
    fn end_streams_of_key(&self, key_id: &str, reason: &str) -> usize {
        self.with_server(|s| s.end_streams_of_key(key_id, reason))
            .unwrap_or(0)
    }

    /// Stop gracefully (see `RelayServer::shutdown` in static-relay); blocks without the GIL.
    /// A second call does nothing.
    fn shutdown(&self, py: Python<'_>) -> PyResult<()> {
        let running = self
            .running
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let Some(Running { runtime, server }) = running else {
            return Ok(());
        };
        exit::without_gil(py, move || {
            runtime.block_on(server.shutdown());
            runtime.shutdown_timeout(Duration::from_secs(1));
        });
        Ok(())
    }
}

fn tls_config(cert: &Path, key: &Path) -> PyResult<Arc<static_relay::tls::ServerConfig>> {
    static_relay::tls::server_config(cert, key).map_err(|e| PyValueError::new_err(e.to_string()))
}

/// `ValueError` naming the file at fault unless the PEM certificate chain at `cert` and the
/// private key at `key` can serve TLS on the relay's port.
#[pyfunction]
fn check_tls_files(cert: PathBuf, key: PathBuf) -> PyResult<()> {
    tls_config(&cert, &key).map(drop)
}

/// The relay's tunable settings, the one table `static serve` builds its flags from:
/// `[(name, flag, kind, default, low, high, help)]`, kind `"count"`, `"real"` or `"seconds"`,
/// high `inf` for no bound.
#[pyfunction]
#[allow(clippy::type_complexity)]
fn relay_settings() -> Vec<(
    &'static str,
    &'static str,
    &'static str,
    f64,
    f64,
    f64,
    &'static str,
)> {
    RelayConfig::table()
        .into_iter()
        .map(|s| {
            let kind = match s.kind {
                Kind::Count => "count",
                Kind::Real => "real",
                Kind::Seconds => "seconds",
            };
            (s.name, s.flag, kind, s.default, s.low, s.high, s.help)
        })
        .collect()
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<RelayServer>()?;
    m.add_function(wrap_pyfunction!(relay_settings, m)?)?;
    m.add_function(wrap_pyfunction!(check_tls_files, m)?)?;
    Ok(())
}
