//! A [`Channel`]: its state, reading its inbox, sending (encrypting on the callers' threads)
//! and the commit protocol.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot, watch};
use tonic::{Code, Status};

use super::applier::{applier, OwnMessages};
use super::inbox::ApplierCount;
use super::pipeline::Pipeline;
use super::publisher::{publisher, Outbound, Outcome};
use super::reader::reader;
use super::{backoff_next, bounded, lock, Shared, BACKOFF_MIN, MAX_PAYLOAD, PROGRESS_TIMEOUT};
use crate::transport::{self, pb};
use static_mls::engine::{Engine, Member};
use static_mls::error::{Error, ErrorKind, Result};
use static_mls::store::Cursor;

/// Attempts at getting a commit accepted when other members keep winning the epoch.
const COMMIT_ATTEMPTS: usize = 16;

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
            End::Closed => Error::Internal(format!("channel {name:?} is closed")),
            End::Removed => Error::Mls(format!("no longer a member of channel {name:?}")),
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
    /// The channel's last seq as of the latest keep-alive.
    pub head_seq: u64,
    /// Whether a subscription is currently established.
    pub connected: bool,
    pub ended: Option<End>,
}

/// What a wait for the next message found.
#[derive(Debug)]
pub enum Next {
    Message(Vec<u8>),
    /// Nothing yet.
    Empty,
    /// The channel has ended and its inbox is empty.
    End,
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

pub(super) fn stamp(at: &AtomicU64) {
    at.store(now_ns(), Ordering::Relaxed);
}

/// A payload waiting to be encrypted (see [`Channel::send`]).
pub(super) struct Pending {
    pub(super) payload: Arc<Vec<u8>>,
    pub(super) deadline: Instant,
    pub(super) reply: oneshot::Sender<Outcome>,
}

/// Refuses a payload larger than [`MAX_PAYLOAD`].
pub(super) fn check_payload(payload: &[u8]) -> Result<()> {
    if payload.len() > MAX_PAYLOAD {
        return Err(Error::Transport(format!(
            "payload of {} bytes exceeds the maximum of {MAX_PAYLOAD} bytes per message",
            payload.len()
        )));
    }
    Ok(())
}

/// One channel of ours, with its background tasks. See the module docs.
pub struct Channel {
    pub(super) name: String,
    pub(super) shared: Arc<Shared>,
    pub(super) progress: watch::Sender<Progress>,
    /// Bumped whenever the inbox gains messages or the channel ends.
    signal: (Mutex<u64>, Condvar),
    wakers: Mutex<Vec<UnixStream>>,
    commit_lock: tokio::sync::Mutex<()>,
    /// Payloads waiting for the encryption lock; whoever holds it encrypts them all.
    encrypt_queue: Mutex<Vec<Pending>>,
    /// Held while encrypting (not while syncing to disk, so the next batch can be encrypted
    /// meanwhile).
    encrypt_lock: Mutex<()>,
    /// Batches are handed to the publisher in the order they were encrypted (receivers
    /// tolerate only a few messages out of order): (next ticket, next ticket to hand over).
    handoff: (Mutex<(u64, u64)>, Condvar),
    pub(super) outbound: mpsc::UnboundedSender<Vec<Outbound>>,
    /// Pipelined sends (see [`Channel::send_pipelined`]).
    pub(super) pipeline: Arc<Pipeline>,
    /// Our own messages, for the applier to skip when they come back.
    pub(super) own_messages: Mutex<OwnMessages>,
    pub(super) timings: Timings,
    /// Batches the reader handed to the applier thread that it has not finished applying
    /// (see [`reader`]).
    pub(super) queued: AtomicUsize,
    pub(super) shutdown: watch::Sender<bool>,
    pub(super) tasks: Mutex<Vec<tokio::task::JoinHandle<()>>>,
    pub(super) applier_thread: Mutex<Option<std::thread::JoinHandle<()>>>,
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

impl Channel {
    pub(super) fn start(shared: Arc<Shared>, name: &str) -> Result<Arc<Self>> {
        let engine = shared.engine()?;
        let cursor = engine.cursor(name)?;
        let epoch = engine.epoch(name)?;
        let applied_seq = match cursor {
            Cursor::After(seq) => seq,
            Cursor::FromEpoch(_) => 0,
        };
        let (progress, _) = watch::channel(Progress {
            applied_seq,
            epoch,
            ..Progress::default()
        });
        let (outbound, outbound_rx) = mpsc::unbounded_channel();
        let (shutdown, _) = watch::channel(false);
        let channel = Arc::new(Self {
            name: name.to_owned(),
            shared: Arc::clone(&shared),
            progress,
            signal: (Mutex::new(0), Condvar::new()),
            wakers: Mutex::new(Vec::new()),
            commit_lock: tokio::sync::Mutex::new(()),
            encrypt_queue: Mutex::new(Vec::new()),
            encrypt_lock: Mutex::new(()),
            handoff: (Mutex::new((0, 0)), Condvar::new()),
            outbound,
            own_messages: Mutex::new(OwnMessages::default()),
            timings: Timings::default(),
            queued: AtomicUsize::new(0),
            shutdown,
            tasks: Mutex::new(Vec::new()),
            applier_thread: Mutex::new(None),
            pipeline: Arc::new(Pipeline::default()),
        });
        let (entries_tx, entries_rx) = mpsc::channel(16);
        // The tasks hold the channel weakly where they can, strongly where they must finish a
        // step; all stop when `shutdown` flips.
        let (applier_done, applied_all) = oneshot::channel::<()>();
        let counted = ApplierCount::new(shared.inbox(&engine, name)?);
        let applier_thread = {
            let channel = Arc::clone(&channel);
            std::thread::Builder::new()
                .name("static-applier".into())
                .spawn(move || {
                    let _done = applier_done;
                    let _counted = counted;
                    applier(channel, entries_rx);
                })
                .map_err(|e| Error::Internal(format!("cannot start the applier thread: {e}")))?
        };
        let tasks = vec![
            shared
                .handle
                .spawn(reader(Arc::clone(&channel), cursor, entries_tx)),
            // Completes when the applier thread has finished.
            shared.handle.spawn(async move {
                let _ = applied_all.await;
            }),
            shared
                .handle
                .spawn(publisher(Arc::clone(&channel), outbound_rx)),
        ];
        *lock(&channel.tasks) = tasks;
        *lock(&channel.applier_thread) = Some(applier_thread);
        Ok(channel)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// When the latest message passed each stage (see [`Timings`]).
    pub fn timings(&self) -> &Timings {
        &self.timings
    }

    pub fn progress(&self) -> Progress {
        self.progress.borrow().clone()
    }

    /// Closed, removed or failed (set before any waiter is woken).
    pub fn is_closed(&self) -> bool {
        self.progress.borrow().ended.is_some()
    }

    pub(super) fn block_on<T>(
        &self,
        fut: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        self.shared.check_open()?;
        self.shared.handle.block_on(fut)
    }

    pub(super) fn check_usable(&self) -> Result<()> {
        self.shared.check_open()?;
        match &self.progress.borrow().ended {
            Some(end) => Err(end.error(&self.name)),
            None => Ok(()),
        }
    }

    pub(super) fn end(&self, end: End) {
        self.progress.send_modify(|p| {
            if p.ended.is_none() {
                p.ended = Some(end);
            }
            p.connected = false;
        });
        let _ = self.shutdown.send(true);
        self.notify();
        self.wake_pipeline();
    }

    /// Stops the background tasks; messages already received stay in the inbox for the next
    /// opening. Idempotent.
    pub fn close(&self) {
        self.end(End::Closed);
    }

    pub(super) fn notify(&self) {
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

    /// A readiness socket for one async waiter.
    pub fn waker(&self) -> Result<Waker> {
        let (reader, writer) = UnixStream::pair()
            .map_err(|e| Error::Internal(format!("cannot create a readiness socket: {e}")))?;
        for s in [&reader, &writer] {
            s.set_nonblocking(true)
                .map_err(|e| Error::Internal(format!("cannot set up a readiness socket: {e}")))?;
        }
        lock(&self.wakers).push(writer);
        Ok(Waker { reader })
    }

    /// Takes the next received message without waiting.
    pub fn poll_next(&self) -> Result<Next> {
        // A closed client ends its channels' iterators.
        let Ok(engine) = self.shared.engine() else {
            return Ok(Next::End);
        };
        if let Some(payload) = self.shared.inbox_take(&engine, &self.name)? {
            stamp(&self.timings.handed_out);
            return Ok(Next::Message(payload));
        }
        let ended = self.progress.borrow().ended.clone();
        match ended {
            None => Ok(Next::Empty),
            Some(end) => {
                // Messages stored before the end are still handed out.
                if let Some(payload) = self.shared.inbox_take(&engine, &self.name)? {
                    return Ok(Next::Message(payload));
                }
                match end {
                    End::Failed(_) => Err(end.error(&self.name)),
                    End::Closed | End::Removed => Ok(Next::End),
                }
            }
        }
    }

    /// Waits up to `timeout` for the next received message (blocking the calling thread).
    pub fn wait_next(&self, timeout: Duration) -> Result<Next> {
        let deadline = Instant::now() + timeout;
        loop {
            let seen = *lock(&self.signal.0);
            match self.poll_next()? {
                Next::Empty => {}
                other => return Ok(other),
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(Next::Empty);
            }
            let guard = lock(&self.signal.0);
            if *guard == seen {
                let _ = self
                    .signal
                    .1
                    .wait_timeout(guard, deadline - now)
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
            }
        }
    }

    /// How many received messages wait to be read.
    pub fn pending(&self) -> Result<u64> {
        let engine = self.shared.engine()?;
        let inbox = self.shared.inbox(&engine, &self.name)?;
        let handed = lock(&inbox).handed;
        engine.inbox_count_after(&self.name, handed)
    }

    /// Encrypts `payload` and publishes it; returns once the relay has it in the channel's log.
    ///
    /// Runs on the caller's thread up to the publishing: concurrent senders queue their
    /// payloads, and the one that gets the encryption lock encrypts everything queued in one
    /// transaction (flat combining) and hands the messages to the publisher task, which keeps
    /// one pipelined `PublishBatches` call open. Refusals are handled here: a stale epoch is
    /// caught up with and the payload encrypted again; a transient refusal (store unavailable,
    /// rate limit) is retried until the retry deadline, encrypted again too: a refused message
    /// is certainly not in the log, and resending its old bytes after later messages of ours
    /// were accepted could put it beyond the receivers' out-of-order tolerance. A message the
    /// relay did not answer for (it may be in the log) is resent with the same bytes, which the
    /// relay's idempotency makes safe.
    pub fn send(&self, payload: Vec<u8>) -> Result<()> {
        check_payload(&payload)?;
        self.check_usable()?;
        stamp(&self.timings.send_started);
        self.reach()?;
        // Our own pipelined messages queued before this one go first.
        self.pipeline.wait_drained(self)?;
        self.ensure_fresh_epoch()?;
        let payload = Arc::new(payload);
        let deadline = Instant::now() + self.shared.retry_deadline;
        let mut answer = self.encrypt_and_publish(&payload, deadline);
        let mut reencrypted = 0;
        let mut strikes = 0;
        let mut backoff = BACKOFF_MIN;
        loop {
            let outcome = answer.blocking_recv().map_err(|_| self.ended_error())?;
            let (refusal, unanswered) = match outcome {
                Outcome::Accepted => {
                    stamp(&self.timings.send_acked);
                    return Ok(());
                }
                Outcome::Failed(e) if self.awaits_proposal_commit(&e) => {
                    // A member's proposal (e.g. a leave) is pending: MLS forbids application
                    // messages until a commit covers it, which a member makes at once (see
                    // the applier). Wait for that epoch, then encrypt again.
                    let epoch = self.shared.engine()?.epoch(&self.name)?;
                    self.block_on(self.wait_epoch(epoch + 1))?;
                    if Instant::now() >= deadline {
                        return Err(e);
                    }
                    answer = self.encrypt_and_publish(&payload, deadline);
                    continue;
                }
                Outcome::Failed(e) => return Err(e),
                Outcome::Refused(refusal) => (refusal, None),
                Outcome::Unanswered(refusal, message) => (refusal, Some(message)),
            };
            let status = Status::new(Code::from(refusal.code as i32), refusal.message.clone());
            match status.code() {
                Code::FailedPrecondition if reencrypted < 3 => {
                    // Encrypted at an epoch the relay no longer accepts (the group moved on by
                    // more than its window): catch up and encrypt again.
                    reencrypted += 1;
                    self.block_on(self.wait_epoch(refusal.current_epoch))?;
                    answer = self.encrypt_and_publish(&payload, deadline);
                    continue;
                }
                Code::Unauthenticated => {
                    self.shared
                        .on_unauthenticated(&status, None, &mut strikes)?;
                }
                Code::ResourceExhausted if refusal.retry_after_ms > 0 => {
                    std::thread::sleep(Duration::from_millis(refusal.retry_after_ms));
                }
                _ if transport::is_transient(&status) && Instant::now() < deadline => {
                    std::thread::sleep(backoff);
                    backoff = backoff_next(backoff);
                }
                _ => return Err(transport::status_error("Publish", &status)),
            }
            self.check_usable()?;
            let Some(message) = unanswered else {
                answer = self.encrypt_and_publish(&payload, deadline);
                continue;
            };
            let (reply, next) = oneshot::channel();
            self.outbound
                .send(vec![Outbound {
                    message,
                    deadline,
                    reply,
                    unit: None,
                }])
                .map_err(|_| self.ended_error())?;
            answer = next;
        }
    }

    /// Makes sure the relay has answered this client once (see `Shared::reach`).
    pub(super) fn reach(&self) -> Result<()> {
        if self
            .shared
            .reached
            .load(std::sync::atomic::Ordering::Acquire)
        {
            return Ok(());
        }
        self.block_on(self.shared.reach())
    }

    /// If the machine went down while this channel was open, moves to a new epoch first (the
    /// secrets of the old one may have been used without being stored).
    pub(super) fn ensure_fresh_epoch(&self) -> Result<()> {
        if self.shared.engine()?.needs_fresh_epoch(&self.name)? {
            self.block_on(self.commit(Arc::new(|e: &Engine, name: &str| {
                Ok(if e.needs_fresh_epoch(name)? {
                    Some((e.self_update(name)?, None))
                } else {
                    None
                })
            })))?;
        }
        Ok(())
    }

    /// Whether `error` (from encrypting) is MLS refusing to send while proposals are pending.
    pub(super) fn awaits_proposal_commit(&self, error: &Error) -> bool {
        error.kind() == ErrorKind::Mls
            && self
                .shared
                .engine()
                .and_then(|e| e.has_pending_proposals(&self.name))
                .unwrap_or(false)
    }

    /// Queues `payload` for encryption, encrypts the queue if nobody else is doing it, and
    /// returns where the outcome of its publishing will come.
    fn encrypt_and_publish(
        &self,
        payload: &Arc<Vec<u8>>,
        deadline: Instant,
    ) -> oneshot::Receiver<Outcome> {
        let (reply, answer) = oneshot::channel();
        self.encrypt_and_publish_all(vec![Pending {
            payload: Arc::clone(payload),
            deadline,
            reply,
        }]);
        answer
    }

    /// Queues `pending` (kept together, in order) for encryption and encrypts the queue if
    /// nobody else is doing it; each outcome comes to its `reply`.
    pub(super) fn encrypt_and_publish_all(&self, pending: Vec<Pending>) {
        lock(&self.encrypt_queue).extend(pending);
        let encrypting = lock(&self.encrypt_lock);
        let batch = std::mem::take(&mut *lock(&self.encrypt_queue));
        if batch.is_empty() {
            // Another sender encrypted ours along with its own.
            return;
        }
        let engine = self.shared.engine();
        let encrypted = engine.as_ref().map_err(Clone::clone).and_then(|engine| {
            let refs: Vec<&[u8]> = batch.iter().map(|p| p.payload.as_slice()).collect();
            engine.encrypt_many_unsynced(&self.name, &refs)
        });
        let ticket = {
            let mut handoff = lock(&self.handoff.0);
            handoff.0 += 1;
            handoff.0 - 1
        };
        drop(encrypting);
        // Nothing leaves before the state that produced it is written (and, where a crash of
        // the machine could not be told afterwards, on disk).
        let encrypted = encrypted.and_then(|messages| {
            engine
                .as_ref()
                .map_err(Clone::clone)
                .and_then(|engine| engine.sync_before_send())
                .map(|()| messages)
        });
        let mut handoff = lock(&self.handoff.0);
        while handoff.1 != ticket {
            handoff = self
                .handoff
                .1
                .wait(handoff)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
        match encrypted {
            Ok(messages) => {
                {
                    let mut own = lock(&self.own_messages);
                    for message in &messages {
                        own.remember(message);
                    }
                }
                let items = batch
                    .into_iter()
                    .zip(messages)
                    .map(|(p, message)| Outbound {
                        message,
                        deadline: p.deadline,
                        reply: p.reply,
                        unit: None,
                    })
                    .collect();
                stamp(&self.timings.send_encrypted);
                // A publisher that is gone drops the replies: the senders see the channel's end.
                let _ = self.outbound.send(items);
            }
            Err(e) => {
                for p in batch {
                    let _ = p.reply.send(Outcome::Failed(e.clone()));
                }
            }
        }
        handoff.1 += 1;
        drop(handoff);
        self.handoff.1.notify_all();
    }

    pub(super) fn ended_error(&self) -> Error {
        match &self.progress.borrow().ended {
            Some(end) => end.error(&self.name),
            None => Error::Internal(format!("channel {:?} is closed", self.name)),
        }
    }

    /// Adds the owner of `key_package`; returns the Welcome once the commit is in the log and
    /// merged.
    pub fn add_member(&self, key_package: Vec<u8>) -> Result<Vec<u8>> {
        let welcome = self.block_on(self.commit(Arc::new(move |e: &Engine, name: &str| {
            let out = e.add_member(name, &key_package)?;
            Ok(Some((out.commit, Some(out.welcome))))
        })))?;
        welcome.ok_or_else(|| Error::Internal("the commit produced no Welcome".into()))
    }

    /// Removes the member(s) with credential identity `identity`.
    pub fn remove_member(&self, identity: Vec<u8>) -> Result<()> {
        self.block_on(self.commit(Arc::new(move |e: &Engine, name: &str| {
            Ok(Some((e.remove_member(name, &identity)?, None)))
        })))?;
        Ok(())
    }

    /// Rotates our leaf keys (post-compromise security).
    pub fn rotate_keys(&self) -> Result<()> {
        self.block_on(self.commit(Arc::new(|e: &Engine, name: &str| {
            Ok(Some((e.self_update(name)?, None)))
        })))?;
        Ok(())
    }

    /// Proposes our removal and waits until a member commits it (the channel then ends).
    pub fn leave(&self) -> Result<()> {
        self.check_usable()?;
        if self.shared.engine()?.members(&self.name)?.len() < 2 {
            return Err(Error::Mls(format!(
                "cannot leave channel {:?}: we are its only member",
                self.name
            )));
        }
        self.block_on(async {
            self.shared.reach().await?;
            let _guard = self.commit_lock.lock().await;
            for _ in 0..COMMIT_ATTEMPTS {
                let proposal = self
                    .shared
                    .blocking({
                        let name = self.name.clone();
                        move |e| e.leave(&name)
                    })
                    .await?;
                match self.publish_handshake(proposal, None).await? {
                    Published::Accepted(_) => {
                        let mut rx = self.progress.subscribe();
                        let waited = tokio::time::timeout(
                            PROGRESS_TIMEOUT,
                            rx.wait_for(|p| p.ended.is_some()),
                        )
                        .await;
                        return match waited {
                            Ok(_) => Ok(()),
                            Err(_) => Err(Error::Transport(
                                "the leave proposal is published but no member committed it yet"
                                    .into(),
                            )),
                        };
                    }
                    Published::Stale(epoch) => self.wait_epoch(epoch).await?,
                }
            }
            Err(Error::Transport(
                "the channel is too busy to leave now".into(),
            ))
        })
    }

    /// The members' identities, by leaf index.
    pub fn members(&self) -> Result<Vec<Member>> {
        self.shared.check_open()?;
        self.shared.engine()?.members(&self.name)
    }

    pub fn epoch(&self) -> Result<u64> {
        self.shared.engine()?.epoch(&self.name)
    }

    pub fn epoch_authenticator(&self) -> Result<Vec<u8>> {
        self.shared.engine()?.epoch_authenticator(&self.name)
    }

    /// Waits until the first subscription is established (or the channel failed).
    pub(super) async fn wait_connected(&self, timeout: Duration) -> Result<()> {
        let mut rx = self.progress.subscribe();
        let _ =
            tokio::time::timeout(timeout, rx.wait_for(|p| p.connected || p.ended.is_some())).await;
        let ended = self.progress.borrow().ended.clone();
        match ended {
            Some(end @ End::Failed(_)) => Err(end.error(&self.name)),
            _ => Ok(()),
        }
    }

    /// Waits until the applier has passed `seq`.
    async fn wait_applied(&self, seq: u64) -> Result<()> {
        let mut rx = self.progress.subscribe();
        let waited = tokio::time::timeout(
            PROGRESS_TIMEOUT,
            rx.wait_for(|p| p.applied_seq >= seq || p.ended.is_some()),
        )
        .await;
        if waited.is_err() {
            return Err(Error::Transport(format!(
                "the channel's log did not reach seq {seq} within {PROGRESS_TIMEOUT:?}"
            )));
        }
        let p = self.progress.borrow().clone();
        match p.ended {
            Some(end) if p.applied_seq < seq => Err(end.error(&self.name)),
            _ => Ok(()),
        }
    }

    /// Waits until the applier has reached `epoch` (the winner of a lost commit race).
    pub(super) async fn wait_epoch(&self, epoch: u64) -> Result<()> {
        let mut rx = self.progress.subscribe();
        let waited = tokio::time::timeout(
            PROGRESS_TIMEOUT,
            rx.wait_for(|p| p.epoch >= epoch || p.ended.is_some()),
        )
        .await;
        if waited.is_err() {
            return Err(Error::Transport(format!(
                "the channel did not reach epoch {epoch} within {PROGRESS_TIMEOUT:?}"
            )));
        }
        match self.progress.borrow().ended.clone() {
            Some(end) => Err(end.error(&self.name)),
            None => Ok(()),
        }
    }

    /// The commit protocol: create (via `make`), publish with the epoch fence, wait for the
    /// applier to merge its echo; on a lost race drop it, apply the winner and retry. `make`
    /// returns `None` when there is nothing to commit.
    pub(super) async fn commit(&self, make: Arc<CommitMaker>) -> Result<Option<Vec<u8>>> {
        self.check_usable()?;
        self.shared.reach().await?;
        let _guard = self.commit_lock.lock().await;
        for _ in 0..COMMIT_ATTEMPTS {
            let name = self.name.clone();
            let maker = Arc::clone(&make);
            let Some((commit, welcome)) = self.shared.blocking(move |e| maker(e, &name)).await?
            else {
                return Ok(None);
            };
            let published = self.publish_handshake(commit, welcome.clone()).await;
            match published {
                Ok(Published::Accepted(seq)) => {
                    self.wait_applied(seq).await?;
                    return Ok(welcome);
                }
                Ok(Published::Stale(epoch)) => {
                    self.clear_pending().await?;
                    self.wait_epoch(epoch).await?;
                }
                Err(e) => {
                    // Not in the log: drop it so the group can move on.
                    self.clear_pending().await?;
                    return Err(e);
                }
            }
        }
        Err(Error::Transport(format!(
            "channel {:?} is too busy: other members' commits won {COMMIT_ATTEMPTS} times in a row",
            self.name
        )))
    }

    async fn clear_pending(&self) -> Result<()> {
        let name = self.name.clone();
        self.shared
            .blocking(move |e| {
                if e.has_group(&name) {
                    e.clear_pending_commit(&name)
                } else {
                    Ok(())
                }
            })
            .await
    }

    /// Publishes a commit or proposal, retrying (with the same idempotency key) while the relay
    /// is unreachable.
    async fn publish_handshake(
        &self,
        message: Vec<u8>,
        welcome: Option<Vec<u8>>,
    ) -> Result<Published> {
        let deadline = Instant::now() + self.shared.retry_deadline;
        let mut backoff = BACKOFF_MIN;
        let mut strikes = 0;
        loop {
            let (request, token) = self
                .shared
                .request(pb::PublishRequest {
                    channel: self.name.clone(),
                    message: message.clone().into(),
                    welcome: welcome.clone().unwrap_or_default().into(),
                    idempotency_key: Default::default(),
                })
                .await?;
            match bounded(self.shared.relay.clone().publish(request)).await {
                Ok(response) => return Ok(Published::Accepted(response.into_inner().seq)),
                Err(status) => match status.code() {
                    Code::FailedPrecondition => {
                        let epoch = transport::current_epoch(&status)
                            .ok_or_else(|| transport::status_error("Publish", &status))?;
                        return Ok(Published::Stale(epoch));
                    }
                    Code::Unauthenticated => {
                        self.shared
                            .on_unauthenticated(&status, token.as_deref(), &mut strikes)?;
                    }
                    Code::ResourceExhausted if transport::retry_after(&status).is_some() => {
                        let wait = transport::retry_after(&status).unwrap_or(BACKOFF_MIN);
                        tokio::time::sleep(wait).await;
                    }
                    _ if transport::is_transient(&status) && Instant::now() < deadline => {
                        tokio::time::sleep(backoff).await;
                        backoff = backoff_next(backoff);
                    }
                    _ => return Err(transport::status_error("Publish", &status)),
                },
            }
        }
    }
}

type CommitMaker =
    dyn Fn(&Engine, &str) -> Result<Option<(Vec<u8>, Option<Vec<u8>>)>> + Send + Sync;

enum Published {
    Accepted(u64),
    Stale(u64),
}
