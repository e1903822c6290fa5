//! Threads blocked in the extension must not take the GIL back once the interpreter exits.
//!
//! From Python 3.11 to 3.13, a thread that takes the GIL after finalization has begun is ended
//! with `pthread_exit`, whose forced unwinding through Rust frames aborts the process ("FATAL:
//! exception not rethrown", exit code 134): the fate of a daemon thread iterating
//! `channel.messages()` when the program ends. So an `atexit` hook (run before finalization
//! begins) raises [`EXITING`]; from then on a thread that comes back from a call without the GIL
//! parks for good instead of taking the GIL back (the process is about to end), and Rust threads
//! that would call into Python give up. A thread that was already on its way back when the flag
//! rose is counted in [`RETURNING`], and the hook waits (without the GIL) until it holds the GIL
//! again: so no thread is caught between the two. The thread running the hook (the one that
//! finalizes) is never parked.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::OnceLock;
use std::thread::ThreadId;
use std::time::{Duration, Instant};

use pyo3::prelude::*;

/// Raised by the `atexit` hook.
static EXITING: AtomicBool = AtomicBool::new(false);
/// Threads between "done without the GIL" and "holding it again" (and Rust threads in Python).
static RETURNING: AtomicUsize = AtomicUsize::new(0);
/// The thread that ran the hook: it finalizes the interpreter, so it must keep going.
static EXIT_THREAD: OnceLock<ThreadId> = OnceLock::new();
/// How long the hook waits for threads already on their way back into Python (a token refresh
/// in Python may take a moment; anything longer is left to its fate).
const RETURN_WAIT: Duration = Duration::from_secs(5);

fn exiting_elsewhere() -> bool {
    EXITING.load(SeqCst) && EXIT_THREAD.get() != Some(&std::thread::current().id())
}

/// Counts the current thread in [`RETURNING`], unless the interpreter is exiting: then returns
/// false (and counts nothing). SeqCst on both sides: either the hook sees the count, or this
/// thread sees the flag.
fn enter() -> bool {
    RETURNING.fetch_add(1, SeqCst);
    if exiting_elsewhere() {
        RETURNING.fetch_sub(1, SeqCst);
        return false;
    }
    true
}

fn leave() {
    RETURNING.fetch_sub(1, SeqCst);
}

/// `py.allow_threads(f)`, except that once the interpreter exits the thread parks for good
/// instead of taking the GIL back. Every call of the extension that releases the GIL uses this.
pub fn without_gil<T, F>(py: Python<'_>, f: F) -> T
where
    F: Send + FnOnce() -> T,
    T: Send,
{
    let out = py.allow_threads(move || {
        let out = f();
        if !enter() {
            loop {
                std::thread::park();
            }
        }
        out
    });
    leave();
    out
}

/// `Python::with_gil(f)` for threads of our own (a runtime's), or `None` once the interpreter
/// exits.
pub fn with_gil_unless_exiting<T>(f: impl for<'py> FnOnce(Python<'py>) -> T) -> Option<T> {
    if !enter() {
        return None;
    }
    let out = Python::with_gil(f);
    leave();
    Some(out)
}

/// The `atexit` hook (registered when the module is imported).
#[pyfunction]
fn _at_exit(py: Python<'_>) {
    let _ = EXIT_THREAD.set(std::thread::current().id());
    EXITING.store(true, SeqCst);
    py.allow_threads(|| {
        let deadline = Instant::now() + RETURN_WAIT;
        while RETURNING.load(SeqCst) > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
    });
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let hook = wrap_pyfunction!(_at_exit, m)?;
    m.add_function(hook.clone())?;
    m.py().import("atexit")?.call_method1("register", (hook,))?;
    Ok(())
}
