//! How the binding's blocking calls wait: timeouts checked, waits cut in slices with the GIL
//! released and Ctrl-C answered between them, and the outcome codes of a wait for an item.

use std::time::{Duration, Instant};

use pyo3::prelude::*;

use crate::convert::native;
use crate::exit;

/// A timeout argument in seconds (finite, >= 0).
pub(crate) fn seconds_arg(name: &str, seconds: f64) -> PyResult<Duration> {
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
pub(crate) fn wait_in_slices<T: Send>(
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
pub(crate) const NEXT_MESSAGE: u8 = 0;
pub(crate) const NEXT_EMPTY: u8 = 1;
pub(crate) const NEXT_END: u8 = 2;
