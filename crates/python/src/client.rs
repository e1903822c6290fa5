//! `static._native.client`: the SDK's native client (`static-client`): `Client`, its open
//! `Channel`s, a pipelined send's `SendHandle`, and the `Waker` async waiters poll.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pyo3::prelude::*;
use pyo3::types::PyBytes;
use static_client::{
    Address, Channel as CoreChannel, Client as CoreClient, ClientOptions, Invitation, Next,
    SendHandle as CoreSendHandle, Token, TokenProvider, Waker as CoreWaker,
};

use crate::convert::{bytes, message_object, native};
use crate::exit;
use crate::request::{self, PendingRequest};
use crate::token::PyTokenProvider;
use crate::waiting::{seconds_arg, wait_in_slices, NEXT_EMPTY, NEXT_END, NEXT_MESSAGE};

/// The SDK's native client: engine + relay transport on a runtime of its own.
#[pyclass(frozen, module = "static._native.client")]
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

    /// Our address: (account, identity).
    fn address(&self, py: Python<'_>) -> PyResult<(String, Py<PyBytes>)> {
        let inner = Arc::clone(&self.inner);
        let address = native(exit::without_gil(py, move || inner.address()))?;
        Ok((address.account, bytes(py, &address.identity)))
    }

    fn keep_key_packages(&self, py: Python<'_>) -> PyResult<()> {
        let inner = Arc::clone(&self.inner);
        native(exit::without_gil(py, move || inner.keep_key_packages()))
    }

    fn allow_invitations(&self, py: Python<'_>, accounts: Vec<String>) -> PyResult<()> {
        let inner = Arc::clone(&self.inner);
        native(exit::without_gil(py, move || {
            inner.allow_invitations(accounts)
        }))
    }

    /// Our pending invitations after `after_id`, each (id, channel, inviter identity, inviter
    /// account, created at ms, expires at ms); when none is pending, the relay holds the call up
    /// to `wait` seconds (at most 20) for one to come.
    #[pyo3(signature = (after_id, wait=0.0))]
    fn list_invitations(
        &self,
        py: Python<'_>,
        after_id: u64,
        wait: f64,
    ) -> PyResult<Vec<InvitationFields>> {
        let wait = seconds_arg("wait", wait)?;
        let inner = Arc::clone(&self.inner);
        let listed = native(exit::without_gil(py, move || {
            inner.list_invitations(after_id, wait)
        }))?;
        Ok(listed
            .into_iter()
            .map(|i: Invitation| {
                (
                    i.id,
                    i.channel,
                    bytes(py, &i.inviter_identity),
                    i.inviter_account,
                    i.created_at_ms,
                    i.expires_at_ms,
                )
            })
            .collect())
    }

    fn accept_invitation(&self, py: Python<'_>, id: u64, channel: &str) -> PyResult<Channel> {
        let inner = Arc::clone(&self.inner);
        let joined = native(exit::without_gil(py, move || {
            inner.accept_invitation(id, channel)
        }))?;
        Ok(Channel {
            inner: joined,
            _client: Arc::clone(&self.inner),
        })
    }

    fn decline_invitation(&self, py: Python<'_>, id: u64) -> PyResult<()> {
        let inner = Arc::clone(&self.inner);
        native(exit::without_gil(py, move || inner.decline_invitation(id)))
    }

    /// Stops all background work and releases the data directory.
    fn close(&self, py: Python<'_>) {
        let inner = Arc::clone(&self.inner);
        exit::without_gil(py, move || inner.close());
    }
}

/// An invitation as Python gets it (see `Client.list_invitations`).
type InvitationFields = (u64, String, Py<PyBytes>, String, u64, u64);

/// Splits a printed address into (account, identity); ValueError when it is not one.
#[pyfunction]
fn parse_address(py: Python<'_>, text: &str) -> PyResult<(String, Py<PyBytes>)> {
    let address = native(Address::parse(text))?;
    Ok((address.account, bytes(py, &address.identity)))
}

/// The printed form of the address (account, identity).
#[pyfunction]
fn format_address(account: String, identity: Vec<u8>) -> String {
    Address { account, identity }.to_string()
}

fn next_tuple(py: Python<'_>, next: Next, detailed: bool) -> PyResult<(u8, Option<PyObject>)> {
    Ok(match next {
        Next::Message(message) => (NEXT_MESSAGE, Some(message_object(py, &message, detailed)?)),
        Next::Empty => (NEXT_EMPTY, None),
        Next::End => (NEXT_END, None),
    })
}

/// One open channel of a `Client`.
#[pyclass(frozen, module = "static._native.client")]
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

    /// Invites the address (account, identity) into the channel.
    fn invite(&self, py: Python<'_>, account: String, identity: Vec<u8>) -> PyResult<()> {
        let inner = Arc::clone(&self.inner);
        let address = Address { account, identity };
        native(exit::without_gil(py, move || inner.invite(&address)))
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

    /// Sends a request (see `Channel::request` in the core) and returns it waiting for its
    /// reply.
    fn request(&self, py: Python<'_>, payload: &[u8]) -> PyResult<PendingRequest> {
        let inner = Arc::clone(&self.inner);
        let pending = native(exit::without_gil(py, move || {
            inner.request(payload.to_vec())
        }))?;
        Ok(PendingRequest {
            inner: Arc::new(pending),
        })
    }

    /// Replies to the request `id` (blocking until the reply is in the log).
    fn reply(&self, py: Python<'_>, id: &[u8], payload: &[u8]) -> PyResult<()> {
        let id = request::request_id(id)?;
        let inner = Arc::clone(&self.inner);
        native(exit::without_gil(py, move || {
            inner.reply(id, payload.to_vec())
        }))
    }

    /// The next request received without waiting: (0, (id, payload, sender, account, seq,
    /// epoch)), (1, None) nothing yet, (2, None) ended.
    fn poll_request(&self, py: Python<'_>) -> PyResult<(u8, Option<PyObject>)> {
        let inner = Arc::clone(&self.inner);
        let next = native(exit::without_gil(py, move || inner.poll_request()))?;
        request::next_request_tuple(py, next)
    }

    /// The next request, waiting up to `timeout` seconds (forever if None), answering Ctrl-C.
    #[pyo3(signature = (timeout=None))]
    fn next_request(
        &self,
        py: Python<'_>,
        timeout: Option<f64>,
    ) -> PyResult<(u8, Option<PyObject>)> {
        request::next_request(py, &self.inner, timeout)
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
#[pyclass(frozen, module = "static._native.client")]
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
#[pyclass(frozen, module = "static._native.client")]
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

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Client>()?;
    m.add_function(wrap_pyfunction!(parse_address, m)?)?;
    m.add_function(wrap_pyfunction!(format_address, m)?)?;
    m.add_class::<Channel>()?;
    m.add_class::<Waker>()?;
    m.add_class::<SendHandle>()?;
    m.add_class::<PendingRequest>()?;
    m.add("MAX_PAYLOAD", static_client::MAX_PAYLOAD)?;
    Ok(())
}
