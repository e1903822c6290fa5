//! A channel's core: the state its workers (reader, applier, publisher, sender) and its façade
//! share — progress, shutdown, the readers' wake-ups, our own messages, timings — and the
//! waits on that progress. The workers get this and their own channel ends; none of them
//! reaches the façade ([`Channel`](crate::Channel)), which owns commits.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use tokio::sync::{watch, Notify};

use crate::config::PROGRESS_TIMEOUT;
use crate::error::{Error, Result};
use crate::receive::own::OwnMessages;
use crate::send::pipeline::Pipeline;
use crate::shared::Shared;
use crate::sync::{lock, read, seen, wait_value};
use static_mls::engine::Member;

/// Why a channel stopped.
#[derive(Debug, Clone)]
pub enum End {
    /// Closed by us.
    Closed,
    /// A commit removed us from the group (or we left).
    Removed,
    /// A failure that retrying cannot fix (auth refused, channel unknown to the relay, ...).
    Failed(Error),
}

impl End {
    fn error(&self, name: &str) -> Error {
        match self {
            End::Closed => Error::Closed(format!("channel {name:?} is closed")),
            End::Removed => Error::Ended(name.to_owned()),
            End::Failed(err) => err.clone(),
        }
    }
}

/// How far the applier has got.
#[derive(Debug, Clone, Default)]
pub struct Progress {
    /// The last seq applied (or skipped).
    pub applied_seq: u64,
    /// The group's epoch after it.
    pub epoch: u64,
    /// The channel's last seq when its subscription was last (re)established.
    pub head_seq: u64,
    /// Whether a subscription is currently established.
    pub connected: bool,
    pub ended: Option<End>,
}

/// When the latest message of a channel passed each stage, in nanoseconds of the system
/// clock (comparable across processes on one machine): what `bench/e2e.py` breaks a round
/// trip down with. Relaxed atomic stores, a few nanoseconds per message.
#[derive(Debug, Default)]
pub struct Timings {
    /// A send began (its payload was queued for encryption).
    pub send_started: AtomicU64,
    /// Its message was encrypted and handed to the publisher.
    pub send_encrypted: AtomicU64,
    /// The relay acknowledged it.
    pub send_acked: AtomicU64,
    /// Entries arrived from the relay.
    pub received: AtomicU64,
    /// They were applied (decrypted, stored in the inbox).
    pub applied: AtomicU64,
    /// A message was handed to the caller.
    pub handed_out: AtomicU64,
}

/// Now, in nanoseconds since the Unix epoch.
pub fn now_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

pub(crate) fn stamp(at: &AtomicU64) {
    at.store(now_ns(), Ordering::Relaxed);
}

/// A readiness socket for async waiting: readable whenever the channel's inbox may have gained
/// messages (or the channel ended). Event loops (trio, asyncio) wait on [`Waker::fileno`]
/// without a thread.
pub struct Waker {
    reader: UnixStream,
}

impl Waker {
    pub fn fileno(&self) -> i32 {
        use std::os::fd::AsRawFd;
        self.reader.as_raw_fd()
    }

    /// Consumes pending wake-ups (call before re-checking the inbox).
    pub fn drain(&self) {
        let mut buf = [0u8; 256];
        // Non-blocking: stops at WouldBlock (nothing left) or on any error.
        while let Ok(n) = (&self.reader).read(&mut buf) {
            if n < buf.len() {
                break;
            }
        }
    }
}

/// See the module docs.
pub(crate) struct ChannelCore {
    pub(crate) name: String,
    pub(crate) shared: Arc<Shared>,
    pub(crate) progress: watch::Sender<Progress>,
    /// Bumped whenever the inbox gains messages or the channel ends.
    signal: (Mutex<u64>, Condvar),
    wakers: Mutex<Vec<UnixStream>>,
    /// Our own messages, for the reader and the applier to pass over when they come back.
    pub(crate) own_messages: Mutex<OwnMessages>,
    pub(crate) timings: Timings,
    /// Batches the reader handed to the applier that it has not finished applying.
    pub(crate) queued: AtomicUsize,
    pub(crate) shutdown: watch::Sender<bool>,
    /// Raised by the applier when a member's proposal awaits a commit; the façade commits it.
    pub(crate) proposals: Notify,
    /// Pipelined sends (see [`Channel::send_pipelined`](crate::Channel::send_pipelined)).
    pub(crate) pipeline: Arc<Pipeline>,
    /// Held while entries are applied (by the pool or inline): a reopened channel takes it
    /// once after closing its predecessor, so two appliers never apply the same log at once.
    pub(crate) applying: Mutex<()>,
    /// The roster the commit that removed us left (the engine deleted the group): what
    /// `members` says after the removal.
    pub(crate) removed_roster: Mutex<Option<Vec<Member>>>,
    /// Request/reply's state in this process (see `request`).
    pub(crate) requests: crate::request::state::Requests,
}

impl ChannelCore {
    pub(crate) fn new(shared: Arc<Shared>, name: &str, applied_seq: u64, epoch: u64) -> Self {
        let (progress, _) = watch::channel(Progress {
            applied_seq,
            epoch,
            ..Progress::default()
        });
        let (shutdown, _) = watch::channel(false);
        Self {
            name: name.to_owned(),
            shared,
            progress,
            signal: (Mutex::new(0), Condvar::new()),
            wakers: Mutex::new(Vec::new()),
            own_messages: Mutex::new(OwnMessages::default()),
            timings: Timings::default(),
            queued: AtomicUsize::new(0),
            shutdown,
            proposals: Notify::new(),
            pipeline: Arc::new(Pipeline::default()),
            applying: Mutex::new(()),
            removed_roster: Mutex::new(None),
            requests: crate::request::state::Requests::default(),
        }
    }

    /// Closed, removed or failed (set before any waiter is woken).
    pub(crate) fn is_closed(&self) -> bool {
        read(&self.progress, |p| p.ended.is_some())
    }

    /// The current progress (a copy).
    pub(crate) fn progress(&self) -> Progress {
        read(&self.progress, Progress::clone)
    }

    /// Why the channel ended, if it did.
    pub(crate) fn ended(&self) -> Option<End> {
        read(&self.progress, |p| p.ended.clone())
    }

    pub(crate) fn check_usable(&self) -> Result<()> {
        self.shared.check_open()?;
        match self.ended() {
            Some(end) => Err(end.error(&self.name)),
            None => Ok(()),
        }
    }

    pub(crate) fn ended_error(&self) -> Error {
        self.ended().unwrap_or(End::Closed).error(&self.name)
    }

    /// Ends the channel (the first end wins) and wakes everyone who waits on it.
    pub(crate) fn end(&self, end: End) {
        self.progress.send_modify(|p| {
            if p.ended.is_none() {
                p.ended = Some(end);
            }
            p.connected = false;
        });
        let _ = self.shutdown.send(true);
        self.notify();
        self.pipeline.wake();
    }

    /// Moves the applied seq forward to `seq` (never back).
    pub(crate) fn passed(&self, seq: u64) {
        self.progress
            .send_modify(|p| p.applied_seq = p.applied_seq.max(seq));
    }

    /// Wakes the readers of the inbox.
    pub(crate) fn notify(&self) {
        {
            let mut generation = lock(&self.signal.0);
            *generation = generation.wrapping_add(1);
        }
        self.signal.1.notify_all();
        let mut wakers = lock(&self.wakers);
        // A full socket is already readable; a closed one belongs to a dropped waiter.
        wakers.retain(|w| match (&*w).write(&[1]) {
            Ok(_) => true,
            Err(e) => e.kind() == std::io::ErrorKind::WouldBlock,
        });
    }

    /// The current wake-up generation (see [`ChannelCore::wait_signal`]).
    pub(crate) fn generation(&self) -> u64 {
        *lock(&self.signal.0)
    }

    /// Blocks until the generation moves past `seen` or `timeout` passes.
    pub(crate) fn wait_signal(&self, seen: u64, timeout: Duration) {
        let guard = lock(&self.signal.0);
        if *guard == seen {
            let _ = self
                .signal
                .1
                .wait_timeout(guard, timeout)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
    }

    /// A readiness socket for one async waiter.
    pub(crate) fn waker(&self) -> Result<Waker> {
        let failed = |e| Error::task("cannot set up a readiness socket", e);
        let (reader, writer) = UnixStream::pair().map_err(failed)?;
        for s in [&reader, &writer] {
            s.set_nonblocking(true).map_err(failed)?;
        }
        lock(&self.wakers).push(writer);
        Ok(Waker { reader })
    }

    /// Sleeps unless the channel shuts down first (then returns true).
    pub(crate) async fn sleep_or_shutdown(&self, wait: Duration) -> bool {
        let mut shutdown = self.shutdown.subscribe();
        if seen(&mut shutdown, |down| *down) {
            return true;
        }
        tokio::select! {
            _ = shutdown.changed() => true,
            _ = tokio::time::sleep(wait) => seen(&mut shutdown, |down| *down),
        }
    }

    /// Waits until the first subscription is established (or the channel failed).
    pub(crate) async fn wait_connected(&self, timeout: Duration) -> Result<()> {
        let mut rx = self.progress.subscribe();
        let _ = tokio::time::timeout(
            timeout,
            wait_value(&mut rx, |p| p.connected || p.ended.is_some()),
        )
        .await;
        match self.ended() {
            Some(end @ End::Failed(_)) => Err(end.error(&self.name)),
            _ => Ok(()),
        }
    }

    /// Waits until the applier has passed `seq`.
    pub(crate) async fn wait_applied(&self, seq: u64) -> Result<()> {
        self.wait_until(
            |p| p.applied_seq >= seq,
            || format!("the channel's log did not reach seq {seq}"),
        )
        .await
    }

    /// Waits until the applier has reached `epoch` (the winner of a lost commit race).
    pub(crate) async fn wait_epoch(&self, epoch: u64) -> Result<()> {
        self.wait_until(
            |p| p.epoch >= epoch,
            || format!("the channel did not reach epoch {epoch}"),
        )
        .await
    }

    /// Waits up to [`PROGRESS_TIMEOUT`] until the progress is `reached`; the channel's end
    /// if it ended before.
    async fn wait_until(
        &self,
        reached: impl Fn(&Progress) -> bool,
        not_reached: impl Fn() -> String,
    ) -> Result<()> {
        let mut rx = self.progress.subscribe();
        // The progress that satisfied the wait, as a copy: the watch's lock is released before
        // anything else reads it (see `sync`).
        let waited = tokio::time::timeout(
            PROGRESS_TIMEOUT,
            wait_value(&mut rx, |p| reached(p) || p.ended.is_some()),
        )
        .await;
        let p = match waited {
            Ok(Some(p)) => p,
            // The sender lives in the core, which outlives this call.
            Ok(None) => return Err(self.ended_error()),
            Err(_) => {
                return Err(Error::Unreachable(format!(
                    "{} within {PROGRESS_TIMEOUT:?}",
                    not_reached()
                )))
            }
        };
        match p.ended {
            Some(end) if !reached(&p) => Err(end.error(&self.name)),
            _ => Ok(()),
        }
    }

    /// Runs `fut` on the client's runtime from a thread outside it (a caller's, the sender's),
    /// until it is done or the client closes (see [`Shared::block_on`]).
    pub(crate) fn block_on<T>(
        &self,
        fut: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        self.shared.block_on(fut)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
pub(crate) mod tests {
    use std::sync::atomic::AtomicBool;
    use std::sync::mpsc;

    use super::*;
    use static_mls::engine::Engine;

    /// A runtime of one worker, as the tests of a channel's core run on.
    pub(crate) fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap()
    }

    /// A channel core on a throwaway engine; its relay (nobody listens there) is never dialled.
    pub(crate) fn core(
        runtime: &tokio::runtime::Runtime,
        dir: &std::path::Path,
    ) -> Arc<ChannelCore> {
        let engine = Arc::new(Engine::open(dir, b"waiter").unwrap());
        let shared = Shared::offline(engine, dir, runtime);
        Arc::new(ChannelCore::new(shared, "org/ns/waiter", 0, 0))
    }

    /// Issue 28: a writer that queues on the progress watch just as a wait ends must not hang
    /// the waiter. The predicate of a wait runs under the watch's read lock; this one, the
    /// first time it holds, starts a writer on another thread and gives it time to queue on
    /// that lock: the interleaving that hung `rotate_keys`. A waiter that kept the `Ref` of
    /// `wait_for` and read the watch again then waited for the writer, which waited for the
    /// `Ref`, for ever; so the wait runs on a thread, and the test fails if it is not done
    /// within a few seconds.
    #[test]
    fn a_writer_queued_as_a_wait_ends_does_not_hang_it() {
        let runtime = runtime();
        let dir = tempfile::tempdir().unwrap();
        let core = core(&runtime, dir.path());
        let (done, finished) = mpsc::channel();
        let handle = runtime.handle().clone();
        let waiter = Arc::clone(&core);
        std::thread::spawn(move || {
            let writer_started = AtomicBool::new(false);
            let writer = Mutex::new(None);
            let reached = |p: &Progress| {
                if !writer_started.swap(true, Ordering::SeqCst) {
                    let core = Arc::clone(&waiter);
                    *lock(&writer) = Some(std::thread::spawn(move || core.passed(7)));
                    // Time for the writer to queue behind our read lock.
                    std::thread::sleep(Duration::from_millis(300));
                }
                p.applied_seq < 7
            };
            let waited = handle.block_on(waiter.wait_until(reached, || "seq 0".into()));
            let writer = lock(&writer).take();
            let _ = done.send((waited, writer.map(std::thread::JoinHandle::join)));
        });
        let (waited, writer) = finished
            .recv_timeout(Duration::from_secs(10))
            .expect("the wait deadlocked with the writer that queued behind it");
        assert!(waited.is_ok(), "{waited:?}");
        assert!(matches!(writer, Some(Ok(()))));
        assert_eq!(core.progress().applied_seq, 7);
    }
}
