//! The binding's one error type ([`NativeError`]) and its one mapping to Python
//! (`From<NativeError> for PyErr`), with the exception classes imported from `static._errors`
//! once each, as pyca/cryptography imports its own (`import_exception!` cannot name a module
//! called `static`, a Rust keyword, so the import is spelled out).

use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::PyType;

use static_client::ErrorKind;

/// Where the SDK's exception classes are defined.
const ERRORS_MODULE: &str = "static._errors";

/// One class of `static._errors`, imported on first use.
pub(crate) struct ImportedClass {
    name: &'static str,
    class: GILOnceCell<Py<PyType>>,
}

impl ImportedClass {
    const fn new(name: &'static str) -> Self {
        Self {
            name,
            class: GILOnceCell::new(),
        }
    }

    pub(crate) fn get<'py>(&self, py: Python<'py>) -> PyResult<&Bound<'py, PyType>> {
        self.class.import(py, ERRORS_MODULE, self.name)
    }

    /// An instance of the class with `message` (or why it could not be made).
    fn err(&self, message: String) -> PyErr {
        Python::with_gil(|py| match self.get(py) {
            Ok(class) => PyErr::from_type(class.clone(), message),
            Err(e) => e,
        })
    }
}

pub(crate) static MLS_ENGINE_ERROR: ImportedClass = ImportedClass::new("MLSEngineError");
pub(crate) static TRANSPORT_ERROR: ImportedClass = ImportedClass::new("TransportError");
pub(crate) static INVALID_CHANNEL_NAME_ERROR: ImportedClass =
    ImportedClass::new("InvalidChannelNameError");
pub(crate) static AUTH_ERROR: ImportedClass = ImportedClass::new("AuthError");
pub(crate) static INTERNAL_ERROR: ImportedClass = ImportedClass::new("InternalError");

/// A failure of the core on its way to Python: the engine's or the client's.
#[derive(Debug)]
pub(crate) enum NativeError {
    Engine(static_mls::Error),
    Client(static_client::Error),
    /// A string that is not an address: bad input of a pure function, so `ValueError`.
    Address(static_client::AddressError),
}

impl From<static_client::AddressError> for NativeError {
    fn from(err: static_client::AddressError) -> Self {
        Self::Address(err)
    }
}

impl From<static_mls::Error> for NativeError {
    fn from(err: static_mls::Error) -> Self {
        Self::Engine(err)
    }
}

impl From<static_client::Error> for NativeError {
    fn from(err: static_client::Error) -> Self {
        Self::Client(err)
    }
}

impl From<NativeError> for PyErr {
    fn from(err: NativeError) -> Self {
        let (kind, message) = match err {
            // The engine's errors are the client's MLS ones, with the same rows.
            NativeError::Engine(e) => {
                let e = static_client::Error::Mls(e);
                (e.kind(), e.to_string())
            }
            NativeError::Client(e) => (e.kind(), e.to_string()),
            NativeError::Address(e) => {
                return pyo3::exceptions::PyValueError::new_err(e.to_string());
            }
        };
        let class = match kind {
            ErrorKind::InvalidChannelName => &INVALID_CHANNEL_NAME_ERROR,
            ErrorKind::Mls => &MLS_ENGINE_ERROR,
            ErrorKind::Transport => &TRANSPORT_ERROR,
            ErrorKind::Auth => &AUTH_ERROR,
            ErrorKind::Internal => &INTERNAL_ERROR,
        };
        class.err(message)
    }
}

pub(crate) type NativeResult<T> = Result<T, NativeError>;
