//! The appliers: a small pool of threads shared by all of a client's channels, which apply
//! each channel's log entries strictly in order, in batches, through
//! [`Engine::process_entries`] (the one writer of a channel's group state; it stores the
//! cursor and the decrypted messages, the inbox, in the same transaction as the state change).
//!
//! A channel is on at most one pool thread at a time (its [`ApplierQueue`] is scheduled once),
//! and takes turns with the other channels one batch at a time, so a busy channel does not
//! starve the others. Threads: [`POOL_THREADS`] per client, whatever the number of channels.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use tokio::sync::Semaphore;

use super::entry::{LogItem, APPLICATION};
use super::inbox::ApplierCount;
use crate::channel::core::{stamp, ChannelCore, End};
use crate::error::{Error, Result};
use crate::sync::lock;
use static_mls::engine::{Incoming, LogEntry};

/// Most entries the applier applies in one transaction.
const BATCH: usize = 512;
/// Batches a channel's reader may hand over before it waits for the applier.
pub(crate) const QUEUED_BATCHES: usize = 16;
/// Pool threads: decryption in parallel on a 2-core machine, and a bound whatever the number
/// of channels (a thread per channel cost 5,006 threads for 5,000 channels).
const POOL_THREADS: usize = 2;

/// Consecutive entries of the log from one Subscribe response.
pub(crate) struct Received {
    pub(crate) entries: Vec<LogItem>,
    /// When they arrived (see [`Timings`](crate::Timings)).
    pub(crate) at: u64,
}

/// Counts `.1` batches handed to the applier as applied when dropped (see
/// [`ChannelCore::queued`]).
pub(crate) struct Applying<'a>(
    pub(crate) &'a std::sync::atomic::AtomicUsize,
    pub(crate) usize,
);

impl Drop for Applying<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(self.1, Ordering::AcqRel);
    }
}

/// What waits for the pool: batches, then possibly the end the relay announced after them.
#[derive(Default)]
struct Waiting {
    batches: VecDeque<Received>,
    /// The relay ended the channel's subscription for good after these batches (e.g. it
    /// refuses us once a commit removed us): the channel fails with this once they are
    /// applied, not before, so a member removed while away still reads what it was sent
    /// before its removal and sees the removal itself.
    end: Option<Error>,
}

/// One channel's entries waiting for the pool.
pub(crate) struct ApplierQueue {
    core: Arc<ChannelCore>,
    waiting: Mutex<Waiting>,
    /// On the pool's run queue (or being applied): a channel is applied by one thread at a time.
    scheduled: AtomicBool,
    /// Room for batches: the reader takes a permit per batch, the pool gives them back.
    room: Semaphore,
    pool: Arc<Pool>,
    /// Counts this channel's applier in its inbox while it lives (see [`ApplierCount`]).
    _counted: ApplierCount,
}

impl ApplierQueue {
    pub(crate) fn new(core: Arc<ChannelCore>, pool: Arc<Pool>) -> Result<Arc<Self>> {
        let engine = core.shared.engine()?;
        let counted = ApplierCount::new(core.shared.inbox(&engine, &core.name)?);
        Ok(Arc::new(Self {
            core,
            waiting: Mutex::new(Waiting::default()),
            scheduled: AtomicBool::new(false),
            room: Semaphore::new(QUEUED_BATCHES),
            pool,
            _counted: counted,
        }))
    }

    /// Hands a batch to the pool, waiting while [`QUEUED_BATCHES`] are waiting already. False
    /// when the channel has ended.
    pub(crate) async fn hand_over(self: &Arc<Self>, received: Received) -> bool {
        match self.room.acquire().await {
            Ok(permit) => permit.forget(),
            Err(_) => return false,
        }
        if self.core.is_closed() {
            return false;
        }
        self.core.queued.fetch_add(1, Ordering::AcqRel);
        lock(&self.waiting).batches.push_back(received);
        self.schedule();
        true
    }

    /// Ends the channel with `e` once everything handed over before is applied (if applying
    /// it does not end the channel first, as the commit that removed us does).
    pub(crate) fn end_after(self: &Arc<Self>, e: Error) {
        lock(&self.waiting).end.get_or_insert(e);
        self.schedule();
    }

    fn schedule(self: &Arc<Self>) {
        if !self.scheduled.swap(true, Ordering::AcqRel) {
            self.pool.run(Arc::clone(self));
        }
    }

    /// Applies what is queued, a batch (up to [`BATCH`] entries) at a time, for as long as
    /// no other channel waits for a thread; then goes to the back of the run queue if more is
    /// left. Staying on the thread saves a hand-over (a thread wake-up) per batch when the
    /// channel is alone: pipelined receiving was ~7% slower handing over after every batch.
    fn turn(self: &Arc<Self>) {
        loop {
            if self.core.is_closed() {
                self.drop_queued();
                return;
            }
            let (first_at, batch, taken) = {
                let mut waiting = lock(&self.waiting);
                let Some(first) = waiting.batches.pop_front() else {
                    // Taken under the lock that saw no batch: every batch handed over before
                    // the end was applied.
                    let end = waiting.end.take();
                    drop(waiting);
                    if let Some(e) = end {
                        self.core.end(End::Failed(e));
                        self.drop_queued();
                        return;
                    }
                    self.scheduled.store(false, Ordering::Release);
                    // A batch (or the end) handed over after the pop and before the flag came
                    // down.
                    if lock(&self.waiting).has_work() {
                        self.schedule();
                    }
                    return;
                };
                let at = first.at;
                let mut batch = first.entries;
                let mut taken = 1;
                while batch.len() < BATCH {
                    match waiting.batches.pop_front() {
                        Some(more) => {
                            batch.extend(more.entries);
                            taken += 1;
                        }
                        None => break,
                    }
                }
                (at, batch, taken)
            };
            {
                // Counted as applied once the batch is (whatever happens to it).
                let _applied = Applying(&self.core.queued, taken);
                let ended = apply_batch(&self.core, batch, first_at) == Applied::ChannelEnded;
                self.room.add_permits(taken);
                if ended {
                    self.drop_queued();
                    return;
                }
            }
            if self.pool.has_waiting() {
                self.scheduled.store(false, Ordering::Release);
                if lock(&self.waiting).has_work() {
                    self.schedule();
                }
                return;
            }
        }
    }

    /// The channel ended: nothing more is applied, and readers waiting for room see the end.
    fn drop_queued(&self) {
        let dropped = std::mem::take(&mut lock(&self.waiting).batches).len();
        let _applied = Applying(&self.core.queued, dropped);
        self.room.close();
    }
}

impl Waiting {
    fn has_work(&self) -> bool {
        !self.batches.is_empty() || self.end.is_some()
    }
}

/// The client's applier threads and their run queue of channels.
pub(crate) struct Pool {
    ready: Mutex<PoolState>,
    wake: Condvar,
}

#[derive(Default)]
struct PoolState {
    queue: VecDeque<Arc<ApplierQueue>>,
    stopping: bool,
}

impl Pool {
    /// A pool without threads, for the tests: what is handed to it waits until the test runs
    /// [`Pool::work`] itself, so that an order is certain rather than a race.
    #[cfg(test)]
    pub(crate) fn threadless() -> Arc<Self> {
        Arc::new(Self {
            ready: Mutex::new(PoolState::default()),
            wake: Condvar::new(),
        })
    }

    /// Starts the pool's threads.
    pub(crate) fn start() -> Result<(Arc<Self>, Vec<std::thread::JoinHandle<()>>)> {
        let pool = Arc::new(Self {
            ready: Mutex::new(PoolState::default()),
            wake: Condvar::new(),
        });
        let threads = (0..POOL_THREADS)
            .map(|_| {
                let pool = Arc::clone(&pool);
                std::thread::Builder::new()
                    .name("static-applier".into())
                    .spawn(move || pool.work())
                    .map_err(|e| Error::task("cannot start an applier thread", e))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((pool, threads))
    }

    /// Whether a channel waits for a thread.
    fn has_waiting(&self) -> bool {
        !lock(&self.ready).queue.is_empty()
    }

    fn run(&self, queue: Arc<ApplierQueue>) {
        lock(&self.ready).queue.push_back(queue);
        self.wake.notify_one();
    }

    /// Ends the threads once the channels on the run queue have had their turn.
    pub(crate) fn stop(&self) {
        lock(&self.ready).stopping = true;
        self.wake.notify_all();
    }

    pub(crate) fn work(&self) {
        loop {
            let next = {
                let mut ready = lock(&self.ready);
                loop {
                    if let Some(next) = ready.queue.pop_front() {
                        break Some(next);
                    }
                    if ready.stopping {
                        break None;
                    }
                    ready = self
                        .wake
                        .wait(ready)
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                }
            };
            let Some(next) = next else { return };
            next.turn();
        }
    }
}

/// What [`apply_batch`] leaves behind.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Applied {
    Continue,
    /// The channel ended (we were removed, or the store failed): nothing more is applied.
    ChannelEnded,
}

/// Applies one batch of consecutive entries: the pool's work, also done by the reader itself
/// for a lone application message when nothing is queued (see `reader`).
pub(crate) fn apply_batch(
    core: &ChannelCore,
    mut batch: Vec<LogItem>,
    received_at: u64,
) -> Applied {
    let _applying = lock(&core.applying);
    if core.is_closed() {
        // Nothing is applied once the channel ended (closed, removed, failed).
        return Applied::ChannelEnded;
    }
    let passed = batch.last().map(|item| item.seq);
    {
        // Our own application messages come back from the relay too; applying one changes
        // nothing (the engine recognises and skips it), so those we recognise byte for byte
        // are not even handed to it. The stored cursor may then lag behind our own last
        // messages: after a restart they are applied again, to the same effect.
        let mut own = lock(&core.own_messages);
        if !own.is_empty() {
            batch.retain(|item| !(item.kind == APPLICATION && own.take(&item.message)));
        }
    }
    if batch.is_empty() {
        if let Some(seq) = passed {
            core.passed(seq);
        }
        return Applied::Continue;
    }
    let name = &core.name;
    let applied = core.shared.engine().and_then(|e| {
        let refs: Vec<LogEntry<'_>> = batch
            .iter()
            .map(|item| LogEntry {
                seq: item.seq,
                message: &item.message,
                account: Some(&item.account),
            })
            .collect();
        let applied = e.process_entries(name, &refs)?;
        let epoch = e.epoch(name).ok();
        Ok((applied, epoch))
    });
    let (applied, epoch) = match applied {
        Ok(v) => v,
        Err(e) => {
            core.end(End::Failed(e));
            return Applied::ChannelEnded;
        }
    };
    let mut proposals = false;
    let mut wake = false;
    let mut removed = false;
    let mut removed_by_relay = false;
    let mut removed_at = None;
    let mut last = passed;
    // The messages just stored in the inbox, for its read-ahead.
    let mut stored = Vec::new();
    for a in applied {
        last = last.max(Some(a.seq));
        match a.outcome {
            Ok(Incoming::Application {
                sender,
                payload,
                epoch,
            }) => {
                if let Some(id) = a.inbox_id {
                    let account = batch
                        .iter()
                        .find(|item| item.seq == a.seq)
                        .map(|item| item.account.clone());
                    stored.push(static_mls::store::InboxMessage {
                        id,
                        seq: a.seq,
                        sender,
                        payload,
                        epoch,
                        account,
                    });
                }
            }
            Ok(Incoming::Proposal { .. }) => proposals = true,
            // A request for the responders, or the reply a requester waits for: stored by the
            // engine (see `request`); the waiters look.
            Ok(Incoming::Request { .. } | Incoming::Reply { kept: true, .. }) => wake = true,
            Ok(Incoming::Unrecognized { sender, aad }) => log::warn!(
                "channel {name:?}: dropped a message of {} with an unknown kind (AAD {aad:02x?}): \
                 a later version's?",
                String::from_utf8_lossy(&sender)
            ),
            Ok(Incoming::Removed {
                epoch,
                members,
                by_relay,
            }) => {
                removed = true;
                // Our key was revoked or expired: an auth error, not a plain removal.
                removed_by_relay |= by_relay;
                // The engine deleted the group: the channel keeps the removal's epoch and
                // roster.
                removed_at = Some(epoch);
                *lock(&core.removed_roster) = Some(members);
            }
            Ok(_) => {}
            // Not for us (sent before we joined, or undecryptable): skipped, as RFC 9420
            // members do; the cursor moved past it.
            Err(_) => {}
        }
    }
    core.progress.send_modify(|p| {
        if let Some(seq) = last {
            p.applied_seq = p.applied_seq.max(seq);
        }
        if let Some(epoch) = epoch.or(removed_at) {
            p.epoch = epoch;
        }
        // In the same update as the removal's epoch: a call waiting for an epoch (a send
        // behind a pending proposal) must see the removal with it, not reach the deleted
        // group first (it then failed with the engine's "not a member" instead of "no longer
        // a member"). `core.end` below does the rest.
        if removed && p.ended.is_none() {
            p.ended = Some(removal(name, removed_by_relay));
        }
    });
    if !stored.is_empty() {
        // What was just stored goes into the inbox's read-ahead here, once per batch,
        // rather than being read on the readers' threads, once per wake-up; and as it is
        // (reading it back cost ~50 us a batch, a sixth of applying one message).
        if let Ok(engine) = core.shared.engine() {
            if let Ok(inbox) = core.shared.inbox(&engine, &core.name) {
                let mut inbox = lock(&inbox);
                if !inbox.push_stored(stored) {
                    // On failure the readers read the store themselves.
                    let _ = inbox.load(&engine, &core.name);
                }
            }
        }
        // Only batches with messages for us: our own messages come back too.
        core.timings.received.store(received_at, Ordering::Relaxed);
        stamp(&core.timings.applied);
        core.notify();
    } else if wake {
        core.notify();
    }
    if removed {
        core.end(removal(name, removed_by_relay));
        return Applied::ChannelEnded;
    }
    if proposals {
        // A member asked to leave: the façade commits it (whoever wins the epoch does it for
        // all).
        core.proposals.notify_one();
    }
    Applied::Continue
}

/// How a removal ends the channel: a member's commit ends it; the relay's proposal (the API key
/// that bound our leaf was revoked or expired) fails it with an auth error.
fn removal(name: &str, by_relay: bool) -> End {
    if by_relay {
        End::Failed(Error::Auth(format!(
            "channel {name:?}: removed by the relay, as the API key that bound this agent was \
             revoked or expired"
        )))
    } else {
        End::Removed
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use super::*;

    #[test]
    fn batches_count_as_applied_once_the_applier_is_done_with_them() {
        let queued = AtomicUsize::new(3);
        {
            let _applying = Applying(&queued, 2);
            assert_eq!(queued.load(Ordering::Acquire), 3);
        }
        assert_eq!(queued.load(Ordering::Acquire), 1);
    }
}
