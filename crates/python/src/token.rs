//! The SDK client's token bridge: a Python callable as the core's `TokenProvider`, its
//! exceptions told apart by class (`AuthError` final, anything else retried).

use std::time::Duration;

use pyo3::prelude::*;
use static_client::{Token, TokenError, TokenProvider};

use crate::error::{ImportedClass, AUTH_ERROR, TRANSPORT_ERROR};
use crate::exit;

/// A Python callable returning `(token, expires_in_seconds)`, called (with the GIL, from a
/// blocking thread of the client's runtime) when the relay token needs refreshing. What it
/// raises is told apart by class: `AuthError` is final, anything else is retried.
pub(crate) struct PyTokenProvider {
    pub(crate) callable: Py<PyAny>,
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
                    let is = |class: &ImportedClass| {
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
