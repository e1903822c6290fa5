//! Locking without poisoning, reading a `watch` without keeping its lock, and joining a thread
//! by a deadline.
//!
//! A panic on one thread must not make every later call fail, so [`lock`] ignores poisoning.
//!
//! A `watch::Ref` (what `borrow`, `borrow_and_update` and `wait_for` return) is a read guard
//! of the watch's `RwLock`. Kept alive while the same thread reads the watch again, it
//! deadlocks as soon as a writer queues between the two reads: the second reader waits for the
//! writer, the writer for the first reader (`rotate_keys` hung so, issue 28). So no `Ref`
//! outlives its statement: the client reads watches only through [`read`], [`seen`] and
//! [`wait_value`], which hand out owned values and drop the guard inside. Clippy refuses the
//! `watch` methods that return a `Ref` anywhere else in this crate (`clippy.toml`).
#![allow(clippy::disallowed_methods)]

use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::watch;

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// `f` of the watched value; the watch's lock is held only while `f` runs.
pub(crate) fn read<T, R>(watched: &watch::Sender<T>, f: impl FnOnce(&T) -> R) -> R {
    f(&watched.borrow())
}

/// `f` of a receiver's current value, marking it seen; the lock is held only while `f` runs.
pub(crate) fn seen<T, R>(rx: &mut watch::Receiver<T>, f: impl FnOnce(&T) -> R) -> R {
    f(&rx.borrow_and_update())
}

/// Waits until `ready` holds for the watched value and returns that value (a clone: the
/// watch's lock is released before this returns); `None` once the sender is gone.
pub(crate) async fn wait_value<T: Clone>(
    rx: &mut watch::Receiver<T>,
    ready: impl FnMut(&T) -> bool,
) -> Option<T> {
    rx.wait_for(ready).await.ok().map(|value| value.clone())
}

/// Joins `thread` if it ends before `deadline`; otherwise leaves it to end on its own.
pub(crate) fn join_within(thread: std::thread::JoinHandle<()>, deadline: Instant) {
    while !thread.is_finished() {
        if Instant::now() >= deadline {
            return;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let _ = thread.join();
}
