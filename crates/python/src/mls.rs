//! `static._native.mls`: the MLS engine (`static-mls`) as Python sees it: `Engine`, what it
//! made of a message (`Incoming`), and the channel-name rule with its limits.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use pyo3::prelude::*;
use pyo3::types::PyBytes;
use static_mls::{Engine as CoreEngine, Incoming as CoreIncoming};

use crate::convert::bytes;
use crate::error::{NativeError, NativeResult};
use crate::exit;

/// The ciphersuite every group uses (RFC 9420's suite 1), by its registry name.
const CIPHERSUITE: &str = "MLS_128_DHKEMX25519_AES128GCM_SHA256_Ed25519";

/// What `Engine.process_incoming` did with one message of the log.
#[pyclass(frozen, module = "static._native.mls")]
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
            CoreIncoming::Request {
                sender,
                payload,
                epoch,
                ..
            } => ("request", Some(sender), Some(payload), Some(epoch)),
            CoreIncoming::Reply {
                sender,
                payload,
                epoch,
                ..
            } => ("reply", Some(sender), Some(payload), Some(epoch)),
            CoreIncoming::Unrecognized { sender, .. } => ("unrecognized", Some(sender), None, None),
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
#[pyclass(frozen, module = "static._native.mls")]
pub(crate) struct Engine {
    inner: Mutex<Option<Arc<CoreEngine>>>,
}

impl Engine {
    /// The open core engine (`Closed` once `close` ran).
    pub(crate) fn engine(&self) -> NativeResult<Arc<CoreEngine>> {
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

/// Raises `InvalidChannelNameError` unless `name` is of the form `org/namespace/service`.
#[pyfunction]
fn validate_channel_name(name: &str) -> NativeResult<()> {
    Ok(static_mls::validate_channel_name(name)?)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("CIPHERSUITE", CIPHERSUITE)?;
    m.add("PAST_EPOCHS", static_mls::PAST_EPOCHS)?;
    m.add_class::<Engine>()?;
    m.add_class::<Incoming>()?;
    m.add(
        "MAX_CHANNEL_NAME_LENGTH",
        static_mls::MAX_CHANNEL_NAME_LENGTH,
    )?;
    m.add("CHANNEL_NAME_FORM", static_mls::CHANNEL_NAME_FORM)?;
    m.add_function(wrap_pyfunction!(validate_channel_name, m)?)?;
    Ok(())
}
