//! What every submodule's methods share: a core `Result` into a `PyResult`, bytes into
//! Python `bytes`.

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::error::NativeError;

/// A core result in a `PyResult` function.
pub(crate) fn native<T, E: Into<NativeError>>(result: Result<T, E>) -> PyResult<T> {
    result.map_err(|e| PyErr::from(e.into()))
}

pub(crate) fn bytes(py: Python<'_>, data: &[u8]) -> Py<PyBytes> {
    PyBytes::new(py, data).unbind()
}
