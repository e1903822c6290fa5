//! `static._native.client`'s request/reply: a request of ours waiting for its reply
//! (`PendingRequest`), and what `Channel`'s request methods share (a received request as a
//! tuple, a request id from Python).

use std::sync::Arc;

use pyo3::prelude::*;
use static_client::{Message, NextRequest, Outstanding, Request, RequestId};

use crate::convert::{bytes, message_object, native};
use crate::exit;
use crate::waiting::{wait_in_slices, NEXT_EMPTY, NEXT_END, NEXT_MESSAGE};

/// A request of ours waiting for its reply (see `Channel::request` in the core). Dropping it
/// leaves the request recorded: a later `request` with the same payload takes it over.
#[pyclass(frozen, module = "static._native.client")]
pub(crate) struct PendingRequest {
    pub(crate) inner: Arc<Outstanding>,
}

#[pymethods]
impl PendingRequest {
    #[getter]
    fn id(&self, py: Python<'_>) -> Py<pyo3::types::PyBytes> {
        bytes(py, &self.inner.id())
    }

    /// The reply as (payload, sender, account, seq, epoch) if it came (handed out once), else
    /// None; raises once the channel has ended.
    fn poll(&self, py: Python<'_>) -> PyResult<Option<PyObject>> {
        let inner = Arc::clone(&self.inner);
        let reply = native(exit::without_gil(py, move || inner.poll()))?;
        reply.map(|m| reply_object(py, &m)).transpose()
    }

    /// Waits up to `timeout` seconds (forever if None) for the reply, in slices of at most
    /// 50 ms with the GIL released, answering Ctrl-C; None on timeout.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<PyObject>> {
        let reply = wait_in_slices(py, timeout, |slice| self.inner.wait(slice))?;
        reply.map(|m| reply_object(py, &m)).transpose()
    }
}

fn reply_object(py: Python<'_>, message: &Message) -> PyResult<PyObject> {
    message_object(py, message, true)
}

/// A received request as Python gets it: (id, payload, sender, account, seq, epoch).
fn request_object(py: Python<'_>, request: &Request) -> PyResult<PyObject> {
    let fields = (
        bytes(py, &request.id),
        bytes(py, &request.payload),
        bytes(py, &request.sender),
        request.account.clone(),
        request.seq,
        request.epoch,
    );
    Ok(fields.into_pyobject(py)?.into_any().unbind())
}

/// `(code, request fields or None)`, codes as `poll_next`'s.
pub(crate) fn next_request_tuple(
    py: Python<'_>,
    next: NextRequest,
) -> PyResult<(u8, Option<PyObject>)> {
    Ok(match next {
        NextRequest::Request(request) => (NEXT_MESSAGE, Some(request_object(py, &request)?)),
        NextRequest::Empty => (NEXT_EMPTY, None),
        NextRequest::End => (NEXT_END, None),
    })
}

/// Waits for the next request (up to `timeout`, forever if None) in slices of at most 50 ms
/// with the GIL released, answering Ctrl-C.
pub(crate) fn next_request(
    py: Python<'_>,
    channel: &Arc<static_client::Channel>,
    timeout: Option<f64>,
) -> PyResult<(u8, Option<PyObject>)> {
    let next = wait_in_slices(py, timeout, |slice| {
        Ok(match channel.wait_request(slice)? {
            NextRequest::Empty => None,
            other => Some(other),
        })
    })?;
    next_request_tuple(py, next.unwrap_or(NextRequest::Empty))
}

/// A request id from Python (16 bytes).
pub(crate) fn request_id(id: &[u8]) -> PyResult<RequestId> {
    native(RequestId::try_from(id).map_err(|_| {
        static_client::Error::Invalid(format!(
            "a request id is {} bytes, not {}",
            std::mem::size_of::<RequestId>(),
            id.len()
        ))
    }))
}
