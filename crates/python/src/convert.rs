//! What every submodule's methods share: a core `Result` into a `PyResult`, bytes into
//! Python `bytes`, a received message into its Python form.

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::error::NativeError;
use static_client::Message;

/// A core result in a `PyResult` function.
pub(crate) fn native<T, E: Into<NativeError>>(result: Result<T, E>) -> PyResult<T> {
    result.map_err(|e| PyErr::from(e.into()))
}

pub(crate) fn bytes(py: Python<'_>, data: &[u8]) -> Py<PyBytes> {
    PyBytes::new(py, data).unbind()
}

/// A message as Python gets it: its payload, or with `detailed` the tuple
/// (payload, sender, account, seq, epoch).
pub(crate) fn message_object(
    py: Python<'_>,
    message: &Message,
    detailed: bool,
) -> PyResult<PyObject> {
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
