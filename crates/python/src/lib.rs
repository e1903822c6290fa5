//! `static._native`: the thin PyO3 layer over `static-mls`, `static-client` and `static-relay`.
//!
//! Every call releases the GIL while the core works; the core guards its groups itself, so one
//! `Engine` is usable from many Python threads at once. Errors map to the Python classes of
//! `static._errors` in exactly one place, `From<NativeError> for PyErr` (`error`).

#![forbid(unsafe_code)]

mod error;
mod exit;
mod logging;
mod relay;

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use error::{NativeError, NativeResult, AUTH_ERROR, TRANSPORT_ERROR};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use static_client::{
    Channel as CoreChannel, Client as CoreClient, ClientOptions, Message, Next,
    SendHandle as CoreSendHandle, Token, TokenError, TokenProvider, Waker as CoreWaker,
};
use static_mls::{Engine as CoreEngine, Incoming as CoreIncoming};

/// A core result in a `PyResult` function.
fn native<T, E: Into<NativeError>>(result: Result<T, E>) -> PyResult<T> {
    result.map_err(|e| PyErr::from(e.into()))
}

fn bytes(py: Python<'_>, data: &[u8]) -> Py<PyBytes> {
    PyBytes::new(py, data).unbind()
}

/// What `Engine.process_incoming` did with one message of the log.
#[pyclass(frozen, module = "static._native")]
struct Incoming {
    /// "application", "commit", "own_commit", "removed", "proposal" or "own".
    #[pyo3(get)]
    kind: &'static str,
    #[pyo3(get)]
    sender: Option<Py<PyBytes>>,
    #[pyo3(get)]
    payload: Option<Py<PyBytes>>,
    #[pyo3(get)]
    epoch: Option<u64>,
}

#[pymethods]
impl Incoming {
    fn __repr__(&self, py: Python<'_>) -> String {
        let sender = self
            .sender
            .as_ref()
            .map(|s| String::from_utf8_lossy(s.as_bytes(py)).into_owned());
        let size = self.payload.as_ref().map(|p| p.as_bytes(py).len());
        format!(
            "Incoming(kind={:?}, sender={sender:?}, payload_len={size:?}, epoch={:?})",
            self.kind, self.epoch
        )
    }
}

impl Incoming {
    fn from_core(py: Python<'_>, incoming: CoreIncoming) -> Self {
        let (kind, sender, payload, epoch) = match incoming {
            CoreIncoming::Application {
                sender,
                payload,
                epoch,
            } => ("application", Some(sender), Some(payload), Some(epoch)),
            CoreIncoming::Commit { sender, epoch } => ("commit", sender, None, Some(epoch)),
            CoreIncoming::OwnCommit { epoch } => ("own_commit", None, None, Some(epoch)),
            CoreIncoming::Removed { epoch, .. } => ("removed", None, None, Some(epoch)),
            CoreIncoming::Proposal { sender } => ("proposal", sender, None, None),
            CoreIncoming::Own => ("own", None, None, None),
        };
        Self {
            kind,
            sender: sender.map(|s| bytes(py, &s)),
            payload: payload.map(|p| bytes(py, &p)),
            epoch,
        }
    }
}

/// One MLS client (an identity and its groups) persisted under a data directory.
#[pyclass(frozen, module = "static._native")]
struct Engine {
    inner: Mutex<Option<Arc<CoreEngine>>>,
}

impl Engine {
    fn engine(&self) -> NativeResult<Arc<CoreEngine>> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
            .ok_or_else(|| {
                NativeError::Client(static_client::Error::Closed("the engine is closed".into()))
            })
    }

    /// Runs `f` on the core engine with the GIL released.
    fn run<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&CoreEngine) -> static_mls::Result<T> + Send,
    ) -> NativeResult<T> {
        let engine = self.engine()?;
        Ok(exit::without_gil(py, move || f(&engine))?)
    }
}

#[pymethods]
impl Engine {
    #[new]
    fn new(py: Python<'_>, data_dir: PathBuf, identity: &[u8]) -> NativeResult<Self> {
        let engine = exit::without_gil(py, || CoreEngine::open(&data_dir, identity))?;
        Ok(Self {
            inner: Mutex::new(Some(Arc::new(engine))),
        })
    }

    #[getter]
    fn identity(&self, py: Python<'_>) -> NativeResult<Py<PyBytes>> {
        Ok(bytes(py, self.engine()?.identity()))
    }

    #[getter]
    fn signature_public_key(&self, py: Python<'_>) -> NativeResult<Py<PyBytes>> {
        Ok(bytes(py, self.engine()?.signature_public_key()))
    }

    #[getter]
    fn data_dir(&self) -> NativeResult<String> {
        Ok(self.engine()?.data_dir().to_string_lossy().into_owned())
    }

    /// Releases the data directory (its lock is freed once running calls finish).
    fn close(&self, py: Python<'_>) {
        let engine = self
            .inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        exit::without_gil(py, move || drop(engine));
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) {
        self.close(py);
    }

    fn groups(&self, py: Python<'_>) -> NativeResult<Vec<String>> {
        self.run(py, |e| Ok(e.group_names()))
    }

    fn has_group(&self, py: Python<'_>, channel: &str) -> NativeResult<bool> {
        self.run(py, |e| Ok(e.has_group(channel)))
    }

    fn generate_key_package(&self, py: Python<'_>) -> NativeResult<Py<PyBytes>> {
        let kp = self.run(py, |e| e.generate_key_package())?;
        Ok(bytes(py, &kp))
    }

    fn create_group(&self, py: Python<'_>, channel: &str) -> NativeResult<()> {
        self.run(py, |e| e.create_group(channel))
    }

    fn join_group(&self, py: Python<'_>, channel: &str, welcome: &[u8]) -> NativeResult<()> {
        self.run(py, |e| e.join_group(channel, welcome))
    }

    fn add_member(
        &self,
        py: Python<'_>,
        channel: &str,
        key_package: &[u8],
    ) -> NativeResult<(Py<PyBytes>, Py<PyBytes>)> {
        let out = self.run(py, |e| e.add_member(channel, key_package))?;
        Ok((bytes(py, &out.commit), bytes(py, &out.welcome)))
    }

    fn add_members(
        &self,
        py: Python<'_>,
        channel: &str,
        key_packages: Vec<Vec<u8>>,
    ) -> NativeResult<(Py<PyBytes>, Py<PyBytes>)> {
        let out = self.run(py, |e| {
            let refs: Vec<&[u8]> = key_packages.iter().map(Vec::as_slice).collect();
            e.add_members(channel, &refs)
        })?;
        Ok((bytes(py, &out.commit), bytes(py, &out.welcome)))
    }

    fn self_update(&self, py: Python<'_>, channel: &str) -> NativeResult<Py<PyBytes>> {
        let commit = self.run(py, |e| e.self_update(channel))?;
        Ok(bytes(py, &commit))
    }

    fn remove_member(
        &self,
        py: Python<'_>,
        channel: &str,
        identity: &[u8],
    ) -> NativeResult<Py<PyBytes>> {
        let commit = self.run(py, |e| e.remove_member(channel, identity))?;
        Ok(bytes(py, &commit))
    }

    fn leave(&self, py: Python<'_>, channel: &str) -> NativeResult<Py<PyBytes>> {
        let proposal = self.run(py, |e| e.leave(channel))?;
        Ok(bytes(py, &proposal))
    }

    fn commit_pending_proposals(
        &self,
        py: Python<'_>,
        channel: &str,
    ) -> NativeResult<Option<Py<PyBytes>>> {
        let commit = self.run(py, |e| e.commit_pending_proposals(channel))?;
        Ok(commit.map(|c| bytes(py, &c)))
    }

    fn merge_pending_commit(&self, py: Python<'_>, channel: &str) -> NativeResult<u64> {
        self.run(py, |e| e.merge_pending_commit(channel))
    }

    fn clear_pending_commit(&self, py: Python<'_>, channel: &str) -> NativeResult<()> {
        self.run(py, |e| e.clear_pending_commit(channel))
    }

    fn pending_commit(&self, py: Python<'_>, channel: &str) -> NativeResult<Option<Py<PyBytes>>> {
        let commit = self.run(py, |e| e.pending_commit(channel))?;
        Ok(commit.map(|c| bytes(py, &c)))
    }

    fn has_pending_commit(&self, py: Python<'_>, channel: &str) -> NativeResult<bool> {
        self.run(py, |e| e.has_pending_commit(channel))
    }

    fn encrypt(&self, py: Python<'_>, channel: &str, payload: &[u8]) -> NativeResult<Py<PyBytes>> {
        let msg = self.run(py, |e| e.encrypt(channel, payload))?;
        Ok(bytes(py, &msg))
    }

    fn process_incoming(
        &self,
        py: Python<'_>,
        channel: &str,
        message: &[u8],
    ) -> NativeResult<Incoming> {
        let incoming = self.run(py, |e| e.process_incoming(channel, message))?;
        Ok(Incoming::from_core(py, incoming))
    }

    fn members(&self, py: Python<'_>, channel: &str) -> NativeResult<Vec<(u32, Py<PyBytes>)>> {
        let members = self.run(py, |e| e.members(channel))?;
        Ok(members
            .into_iter()
            .map(|m| (m.index, bytes(py, &m.identity)))
            .collect())
    }

    fn epoch(&self, py: Python<'_>, channel: &str) -> NativeResult<u64> {
        self.run(py, |e| e.epoch(channel))
    }

    fn epoch_authenticator(&self, py: Python<'_>, channel: &str) -> NativeResult<Py<PyBytes>> {
        let auth = self.run(py, |e| e.epoch_authenticator(channel))?;
        Ok(bytes(py, &auth))
    }

    /// `(group_info, ratchet_tree)`, each TLS-serialized: what the relay builds the channel's
    /// public state from.
    fn public_state(
        &self,
        py: Python<'_>,
        channel: &str,
    ) -> NativeResult<(Py<PyBytes>, Py<PyBytes>)> {
        let state = self.run(py, |e| e.public_state(channel))?;
        Ok((bytes(py, &state.group_info), bytes(py, &state.ratchet_tree)))
    }

    /// `(leaf_index, signature)`: our leaf's binding to `account`.
    fn leaf_binding(
        &self,
        py: Python<'_>,
        channel: &str,
        account: &str,
    ) -> NativeResult<(u32, Py<PyBytes>)> {
        let binding = self.run(py, |e| e.leaf_binding(channel, account))?;
        Ok((binding.leaf_index, bytes(py, &binding.signature)))
    }
}

// --- the SDK client ----------------------------------------------------------------------

/// A Python callable returning `(token, expires_in_seconds)`, called (with the GIL, from a
/// blocking thread of the client's runtime) when the relay token needs refreshing. What it
/// raises is told apart by class: `AuthError` is final, anything else is retried.
struct PyTokenProvider {
    callable: Py<PyAny>,
}

impl TokenProvider for PyTokenProvider {
    fn fetch(&self) -> Result<Token, TokenError> {
        let fetched = exit::with_gil_unless_exiting(|py| {
            let result = self
                .callable
                .call0(py)
                .and_then(|r| r.extract::<(String, f64)>(py));
            match result {
                Ok((value, expires_in)) => Ok(Token {
                    value,
                    expires_in: Duration::from_secs_f64(expires_in.clamp(0.0, 1e9)),
                }),
                Err(err) => {
                    let value = err.value(py);
                    let is = |class: &error::ImportedClass| {
                        class
                            .get(py)
                            .is_ok_and(|c| value.is_instance(c).unwrap_or(false))
                    };
                    // The message without the class's prefix (`StaticError.detail`).
                    let detail = value
                        .getattr("detail")
                        .and_then(|d| d.extract::<String>())
                        .or_else(|_| value.str().map(|s| s.to_string()))
                        .unwrap_or_else(|_| "the token provider failed".to_owned());
                    Err(if is(&AUTH_ERROR) {
                        TokenError::Refused(detail)
                    } else if is(&TRANSPORT_ERROR) {
                        TokenError::Unavailable(detail)
                    } else {
                        TokenError::Unavailable(format!("token refresh failed: {detail}"))
                    })
                }
            }
        });
        fetched.unwrap_or_else(|| Err(TokenError::Unavailable("the interpreter is exiting".into())))
    }
}

/// The SDK's native client: engine + relay transport on a runtime of its own.
#[pyclass(frozen, module = "static._native")]
struct Client {
    inner: Arc<CoreClient>,
}

#[pymethods]
impl Client {
    #[new]
    #[pyo3(signature = (
        endpoint, data_dir, identity, token_provider=None, initial_token=None,
        connect_timeout=None, retry_timeout=None, ca_file=None,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        endpoint: &str,
        data_dir: PathBuf,
        identity: &[u8],
        token_provider: Option<Py<PyAny>>,
        initial_token: Option<(String, f64)>,
        connect_timeout: Option<f64>,
        retry_timeout: Option<f64>,
        ca_file: Option<PathBuf>,
    ) -> PyResult<Self> {
        let mut options = ClientOptions::from_env();
        options.ca_file = ca_file;
        if let Some(seconds) = connect_timeout {
            options.connect_timeout = seconds_arg("connect_timeout", seconds)?;
        }
        if let Some(seconds) = retry_timeout {
            options.retry_timeout = seconds_arg("retry_timeout", seconds)?;
        }
        let provider = token_provider
            .map(|callable| Arc::new(PyTokenProvider { callable }) as Arc<dyn TokenProvider>);
        let initial = initial_token.map(|(value, expires_in)| Token {
            value,
            expires_in: Duration::from_secs_f64(expires_in.clamp(0.0, 1e9)),
        });
        let client = exit::without_gil(py, || {
            CoreClient::open(endpoint, &data_dir, identity, provider, initial, options)
        });
        Ok(Self {
            inner: Arc::new(native(client)?),
        })
    }

    #[getter]
    fn identity(&self, py: Python<'_>) -> Py<PyBytes> {
        bytes(py, self.inner.identity())
    }

    #[getter]
    fn data_dir(&self) -> String {
        self.inner.data_dir().to_string_lossy().into_owned()
    }

    fn generate_key_package(&self, py: Python<'_>) -> PyResult<Py<PyBytes>> {
        let inner = Arc::clone(&self.inner);
        let kp = native(exit::without_gil(py, move || inner.generate_key_package()))?;
        Ok(bytes(py, &kp))
    }

    fn channels(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        let inner = Arc::clone(&self.inner);
        native(exit::without_gil(py, move || inner.channels()))
    }

    fn create_channel(&self, py: Python<'_>, name: &str) -> PyResult<Channel> {
        let inner = Arc::clone(&self.inner);
        let channel = native(exit::without_gil(py, move || inner.create_channel(name)))?;
        Ok(Channel {
            inner: channel,
            _client: Arc::clone(&self.inner),
        })
    }

    fn join_channel(&self, py: Python<'_>, name: &str, welcome: &[u8]) -> PyResult<Channel> {
        let inner = Arc::clone(&self.inner);
        let channel = native(exit::without_gil(py, move || {
            inner.join_channel(name, welcome)
        }))?;
        Ok(Channel {
            inner: channel,
            _client: Arc::clone(&self.inner),
        })
    }

    fn open_channel(&self, py: Python<'_>, name: &str) -> PyResult<Channel> {
        let inner = Arc::clone(&self.inner);
        let channel = native(exit::without_gil(py, move || inner.open_channel(name)))?;
        Ok(Channel {
            inner: channel,
            _client: Arc::clone(&self.inner),
        })
    }

    /// Stops all background work and releases the data directory.
    fn close(&self, py: Python<'_>) {
        let inner = Arc::clone(&self.inner);
        exit::without_gil(py, move || inner.close());
    }
}

/// A timeout argument in seconds (finite, >= 0).
fn seconds_arg(name: &str, seconds: f64) -> PyResult<Duration> {
    if seconds.is_finite() && seconds >= 0.0 {
        Ok(Duration::from_secs_f64(seconds.min(1e9)))
    } else {
        Err(pyo3::exceptions::PyValueError::new_err(format!(
            "{name} must be a finite number of seconds >= 0"
        )))
    }
}

/// Waits with `wait(slice)` in slices of at most 50 ms with the GIL released, checking for
/// signals (Ctrl-C) between slices, until it answers `Some` or `timeout` (forever if None)
/// passes.
fn wait_in_slices<T: Send>(
    py: Python<'_>,
    timeout: Option<f64>,
    wait: impl Fn(Duration) -> static_client::Result<Option<T>> + Sync,
) -> PyResult<Option<T>> {
    let timeout = timeout.map(|t| seconds_arg("timeout", t)).transpose()?;
    let deadline = timeout.map(|t| Instant::now() + t);
    loop {
        let mut slice = Duration::from_millis(50);
        if let Some(deadline) = deadline {
            slice = slice.min(deadline.saturating_duration_since(Instant::now()));
        }
        if let Some(done) = native(exit::without_gil(py, || wait(slice)))? {
            return Ok(Some(done));
        }
        py.check_signals()?;
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Ok(None);
        }
    }
}

/// Outcome codes of `Channel.poll_next` / `Channel.next_message`.
const NEXT_MESSAGE: u8 = 0;
const NEXT_EMPTY: u8 = 1;
const NEXT_END: u8 = 2;

/// A message as Python gets it: its payload, or with `detailed` the tuple
/// (payload, sender, account, seq, epoch).
fn message_object(py: Python<'_>, message: &Message, detailed: bool) -> PyResult<PyObject> {
    let payload = bytes(py, &message.payload);
    if !detailed {
        return Ok(payload.into_any());
    }
    let fields = (
        payload,
        bytes(py, &message.sender),
        message.account.clone(),
        message.seq,
        message.epoch,
    );
    Ok(fields.into_pyobject(py)?.into_any().unbind())
}

fn next_tuple(py: Python<'_>, next: Next, detailed: bool) -> PyResult<(u8, Option<PyObject>)> {
    Ok(match next {
        Next::Message(message) => (NEXT_MESSAGE, Some(message_object(py, &message, detailed)?)),
        Next::Empty => (NEXT_EMPTY, None),
        Next::End => (NEXT_END, None),
    })
}

/// One open channel of a `Client`.
#[pyclass(frozen, module = "static._native")]
struct Channel {
    inner: Arc<CoreChannel>,
    /// Keeps the client open while the channel (or one of its iterators) lives, even when
    /// the program kept no reference to the client: dropping the last one closes it.
    _client: Arc<CoreClient>,
}

#[pymethods]
impl Channel {
    #[getter]
    fn name(&self) -> String {
        self.inner.name().to_owned()
    }

    #[getter]
    fn closed(&self) -> bool {
        self.inner.is_closed()
    }

    /// (applied_seq, epoch, head_seq, connected)
    fn progress(&self) -> (u64, u64, u64, bool) {
        let p = self.inner.progress();
        (p.applied_seq, p.epoch, p.head_seq, p.connected)
    }

    /// When the latest message passed each stage, in ns of the system clock: (send started,
    /// encrypted, acknowledged, entries received, applied, handed out). For benchmarks.
    fn timings(&self) -> (u64, u64, u64, u64, u64, u64) {
        let t = self.inner.timings();
        let get = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
        (
            get(&t.send_started),
            get(&t.send_encrypted),
            get(&t.send_acked),
            get(&t.received),
            get(&t.applied),
            get(&t.handed_out),
        )
    }

    fn send(&self, py: Python<'_>, payload: &[u8]) -> PyResult<()> {
        let inner = Arc::clone(&self.inner);
        native(exit::without_gil(py, move || inner.send(payload.to_vec())))
    }

    /// Queues `payload` on the channel's pipeline (see `Channel::send_pipelined` in the core);
    /// None when `block` is false and the pipeline is full.
    #[pyo3(signature = (payload, block=true))]
    fn send_pipelined(
        &self,
        py: Python<'_>,
        payload: &[u8],
        block: bool,
    ) -> PyResult<Option<SendHandle>> {
        let inner = Arc::clone(&self.inner);
        let payload = payload.to_vec();
        let handle = if block {
            native(exit::without_gil(py, move || {
                inner.send_pipelined(payload, true)
            }))?
        } else {
            // Never waits (one write to the journal): no need to release the GIL.
            native(inner.send_pipelined(payload, false))?
        };
        Ok(handle.map(|inner| SendHandle { inner }))
    }

    /// How many messages `send_pipelined` ever accepted on this channel (its outbox's count).
    fn pipelined_count(&self) -> u64 {
        self.inner.pipelined_count()
    }

    /// Waits until every pipelined send so far is settled; false on timeout.
    #[pyo3(signature = (timeout=None))]
    fn flush(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        let target = self.inner.pipelined();
        let flushed = wait_in_slices(py, timeout, |slice| {
            Ok(self.inner.flush_until(target, slice)?.then_some(()))
        })?;
        Ok(flushed.is_some())
    }

    fn add_member(&self, py: Python<'_>, key_package: &[u8]) -> PyResult<Py<PyBytes>> {
        let inner = Arc::clone(&self.inner);
        let welcome = native(exit::without_gil(py, move || {
            inner.add_member(key_package.to_vec())
        }))?;
        Ok(bytes(py, &welcome))
    }

    fn remove_member(&self, py: Python<'_>, identity: &[u8]) -> PyResult<()> {
        let inner = Arc::clone(&self.inner);
        native(exit::without_gil(py, move || {
            inner.remove_member(identity.to_vec())
        }))
    }

    fn rotate_keys(&self, py: Python<'_>) -> PyResult<()> {
        let inner = Arc::clone(&self.inner);
        native(exit::without_gil(py, move || inner.rotate_keys()))
    }

    fn leave(&self, py: Python<'_>) -> PyResult<()> {
        let inner = Arc::clone(&self.inner);
        native(exit::without_gil(py, move || inner.leave()))
    }

    fn members(&self, py: Python<'_>) -> PyResult<Vec<Py<PyBytes>>> {
        let inner = Arc::clone(&self.inner);
        let members = native(exit::without_gil(py, move || inner.members()))?;
        Ok(members.iter().map(|m| bytes(py, &m.identity)).collect())
    }

    /// The members as the relay attests them: (epoch, [(leaf_index, identity, account)]).
    #[allow(clippy::type_complexity)]
    fn roster(&self, py: Python<'_>) -> PyResult<(u64, Vec<(u32, Py<PyBytes>, Option<String>)>)> {
        let inner = Arc::clone(&self.inner);
        let (epoch, members) = native(exit::without_gil(py, move || inner.roster()))?;
        let members = members
            .into_iter()
            .map(|m| (m.leaf_index, bytes(py, &m.identity), m.account))
            .collect();
        Ok((epoch, members))
    }

    fn epoch(&self, py: Python<'_>) -> PyResult<u64> {
        let inner = Arc::clone(&self.inner);
        native(exit::without_gil(py, move || inner.epoch()))
    }

    fn epoch_authenticator(&self, py: Python<'_>) -> PyResult<Py<PyBytes>> {
        let inner = Arc::clone(&self.inner);
        let auth = native(exit::without_gil(py, move || inner.epoch_authenticator()))?;
        Ok(bytes(py, &auth))
    }

    fn pending(&self, py: Python<'_>) -> PyResult<u64> {
        let inner = Arc::clone(&self.inner);
        native(exit::without_gil(py, move || inner.pending()))
    }

    /// The next message without waiting: (0, payload), (1, None) nothing yet, (2, None) ended
    /// (with `detailed`, the payload is the tuple (payload, sender, account, seq, epoch)).
    #[pyo3(signature = (detailed=false))]
    fn poll_next(&self, py: Python<'_>, detailed: bool) -> PyResult<(u8, Option<PyObject>)> {
        let inner = Arc::clone(&self.inner);
        let next = native(exit::without_gil(py, move || inner.poll_next()))?;
        next_tuple(py, next, detailed)
    }

    /// Waits for the next message (up to `timeout` seconds, forever if None) in slices of at
    /// most 50 ms with the GIL released, checking for signals (Ctrl-C) between slices.
    #[pyo3(signature = (timeout=None, detailed=false))]
    fn next_message(
        &self,
        py: Python<'_>,
        timeout: Option<f64>,
        detailed: bool,
    ) -> PyResult<(u8, Option<PyObject>)> {
        let deadline = timeout.map(|t| Instant::now() + Duration::from_secs_f64(t.clamp(0.0, 1e9)));
        loop {
            let mut slice = Duration::from_millis(50);
            if let Some(deadline) = deadline {
                slice = slice.min(deadline.saturating_duration_since(Instant::now()));
            }
            let inner = Arc::clone(&self.inner);
            let next = native(exit::without_gil(py, move || inner.wait_next(slice)))?;
            if !matches!(next, Next::Empty) {
                return next_tuple(py, next, detailed);
            }
            py.check_signals()?;
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Ok((NEXT_EMPTY, None));
            }
        }
    }

    /// The next message, waiting as long as it takes (like `next_message(None)`), or None once
    /// the channel has ended: what `MessageIterator.__next__` calls, without a tuple per
    /// message.
    #[pyo3(signature = (detailed=false))]
    fn next_payload(&self, py: Python<'_>, detailed: bool) -> PyResult<Option<PyObject>> {
        loop {
            let inner = Arc::clone(&self.inner);
            let next = native(exit::without_gil(py, move || {
                inner.wait_next(Duration::from_millis(50))
            }))?;
            match next {
                Next::Message(message) => {
                    return Ok(Some(message_object(py, &message, detailed)?));
                }
                Next::End => return Ok(None),
                Next::Empty => py.check_signals()?,
            }
        }
    }

    /// A readiness socket for one async waiter.
    fn waker(&self) -> PyResult<Waker> {
        Ok(Waker {
            inner: native(self.inner.waker())?,
        })
    }

    fn close(&self, py: Python<'_>) {
        let inner = Arc::clone(&self.inner);
        exit::without_gil(py, move || inner.close());
    }
}

/// One pipelined send.
#[pyclass(frozen, module = "static._native")]
struct SendHandle {
    inner: CoreSendHandle,
}

#[pymethods]
impl SendHandle {
    fn done(&self) -> bool {
        self.inner.done()
    }

    /// True once the message is in the log (raises its failure instead); false on timeout.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        let done = wait_in_slices(py, timeout, |slice| {
            Ok(self.inner.wait(slice)?.then_some(()))
        })?;
        Ok(done.is_some())
    }
}

/// A socket that becomes readable when the channel's inbox may have gained messages.
#[pyclass(frozen, module = "static._native")]
struct Waker {
    inner: CoreWaker,
}

#[pymethods]
impl Waker {
    fn fileno(&self) -> i32 {
        self.inner.fileno()
    }

    fn drain(&self) {
        self.inner.drain();
    }
}

/// Raises `InvalidChannelNameError` unless `name` is of the form `org/namespace/service`.
#[pyfunction]
fn validate_channel_name(name: &str) -> NativeResult<()> {
    Ok(static_mls::validate_channel_name(name)?)
}

/// Bench support: `n` key packages of distinct throwaway identities.
#[pyfunction]
fn _synthetic_key_packages(py: Python<'_>, n: usize) -> NativeResult<Vec<Py<PyBytes>>> {
    let kps = exit::without_gil(py, || static_mls::bench_support::synthetic_key_packages(n))?;
    Ok(kps.iter().map(|kp| bytes(py, kp)).collect())
}

/// Bench support: (encrypt ns, decrypt ns) per message, measured inside Rust.
#[pyfunction]
fn _bench_rust_encrypt_decrypt(
    py: Python<'_>,
    sender: &Engine,
    receiver: &Engine,
    channel: &str,
    payload_len: usize,
    iterations: u32,
) -> NativeResult<(f64, f64)> {
    let (s, r) = (sender.engine()?, receiver.engine()?);
    Ok(exit::without_gil(py, || {
        static_mls::bench_support::encrypt_decrypt_ns(&s, &r, channel, payload_len, iterations)
    })?)
}

/// Bench support: one Ed25519 sign + verify of `payload_len` bytes, in ns, measured in Rust.
#[pyfunction]
fn _bench_ed25519_sign_verify_ns(
    py: Python<'_>,
    payload_len: usize,
    iterations: u32,
) -> NativeResult<f64> {
    Ok(exit::without_gil(py, || {
        static_mls::bench_support::ed25519_sign_verify_ns(payload_len, iterations)
    })?)
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", static_mls::VERSION)?;
    m.add(
        "CIPHERSUITE",
        "MLS_128_DHKEMX25519_AES128GCM_SHA256_Ed25519",
    )?;
    m.add("PAST_EPOCHS", static_mls::PAST_EPOCHS)?;
    m.add_class::<Engine>()?;
    m.add_class::<Incoming>()?;
    m.add_class::<Client>()?;
    m.add_class::<Channel>()?;
    m.add_class::<Waker>()?;
    m.add_class::<SendHandle>()?;
    m.add("MAX_PAYLOAD", static_client::MAX_PAYLOAD)?;
    m.add(
        "MAX_CHANNEL_NAME_LENGTH",
        static_mls::MAX_CHANNEL_NAME_LENGTH,
    )?;
    m.add("CHANNEL_NAME_FORM", static_mls::CHANNEL_NAME_FORM)?;
    m.add_function(wrap_pyfunction!(validate_channel_name, m)?)?;
    m.add_function(wrap_pyfunction!(_synthetic_key_packages, m)?)?;
    m.add_function(wrap_pyfunction!(_bench_rust_encrypt_decrypt, m)?)?;
    m.add_function(wrap_pyfunction!(_bench_ed25519_sign_verify_ns, m)?)?;
    relay::register(m)?;
    logging::register(m)?;
    exit::register(m)?;
    Ok(())
}
