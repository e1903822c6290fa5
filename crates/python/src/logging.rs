//! Rust's `log` records (the relay's) into Python's `logging`: one logger per target
//! (`static.relay`, `static.relay.access`, else the Rust module path with dots), so that
//! `static serve --log-level/--log-format` govern both languages and both write one stderr.
//!
//! `init_logging(level)` installs the bridge once and sets the level below which records are
//! dropped in Rust (one atomic load: no GIL, no formatting). A record that passes takes the GIL
//! through `exit::with_gil_unless_exiting` (dropped once the interpreter exits, see `exit`),
//! not pyo3-log's `Python::with_gil`, which would abort a runtime thread logging during
//! finalization. Python calls into the relay that wait on its locks release the GIL first
//! (`relay`), so a runtime thread logging while it holds one cannot deadlock with them.

use log::{LevelFilter, Log, Metadata, Record};
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;

use crate::exit;

/// `logging.getLogger`, looked up once.
static GET_LOGGER: GILOnceCell<Py<PyAny>> = GILOnceCell::new();

struct Bridge;

/// Python's level number of a Rust level (TRACE is below DEBUG, as Python has none).
fn python_level(level: log::Level) -> u32 {
    match level {
        log::Level::Error => 40,
        log::Level::Warn => 30,
        log::Level::Info => 20,
        log::Level::Debug => 10,
        log::Level::Trace => 5,
    }
}

/// The Python logger's name for a record's target.
fn logger_name(target: &str) -> String {
    if target.starts_with("static") {
        target
            .replace("::", ".")
            .replace("static_relay", "static.relay")
    } else {
        target.replace("::", ".")
    }
}

fn emit(py: Python<'_>, record: &Record<'_>) -> PyResult<()> {
    let get_logger = GET_LOGGER.get_or_try_init(py, || {
        Ok::<_, PyErr>(py.import("logging")?.getattr("getLogger")?.unbind())
    })?;
    let logger = get_logger.call1(py, (logger_name(record.target()),))?;
    let level = python_level(record.level());
    // The message is passed as the format's only argument: a '%' in it is not a format.
    logger.call_method1(py, "log", (level, "%s", record.args().to_string()))?;
    Ok(())
}

impl Log for Bridge {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        metadata.level() <= log::max_level()
    }

    fn log(&self, record: &Record<'_>) {
        if !self.enabled(record.metadata()) {
            return;
        }
        exit::with_gil_unless_exiting(|py| {
            if let Err(err) = emit(py, record) {
                // Logging must never fail a caller: Python's own handlers report their errors.
                err.print(py);
            }
        });
    }

    fn flush(&self) {}
}

/// Sends the relay's log records at `level` (a Python level number) and above to Python's
/// `logging`. Called by `static serve` once it configured logging; again to change the level.
#[pyfunction]
fn init_logging(level: u32) {
    // Installed once per process; a second call only moves the level.
    let _ = log::set_logger(&Bridge);
    log::set_max_level(match level {
        0..=5 => LevelFilter::Trace,
        6..=10 => LevelFilter::Debug,
        11..=20 => LevelFilter::Info,
        21..=30 => LevelFilter::Warn,
        31..=40 => LevelFilter::Error,
        _ => LevelFilter::Off,
    });
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(init_logging, m)?)?;
    Ok(())
}
