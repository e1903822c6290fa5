//! Pipelined sends: [`Channel::send_pipelined`] queues a payload and returns a [`SendHandle`]
//! at once; the channel's **sender** thread (started on first use) takes what is queued in
//! batches, encrypts each batch in one transaction and publishes it as one unit, and waits for
//! the batch's outcomes before it takes the next. So the log holds pipelined messages in the
//! order they were queued:
//!
//! * within a batch, the relay decides items in order, and its refusals only ever cut a tail
//!   off (a batch is encrypted at one epoch, so the epoch fence refuses all of it from some
//!   item on; the publish rate limit refuses the rest of a request once it refuses an item);
//! * what was refused is certainly not in the log: it is encrypted again and sent before
//!   anything queued after it; what the relay did not answer for is sent again as it is (the
//!   relay's idempotency answers for a copy it already has);
//! * a message that cannot be sent fails its handle, and so do the messages of its batch after
//!   it (nothing overtakes it). Later batches are sent as usual.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;
use tonic::{Code, Status};

use super::channel::{check_payload, Channel, Pending};
use super::publisher::{Outbound, Outcome, ITEM_OVERHEAD, MAX_BATCH_BYTES, MAX_BATCH_ITEMS};
use super::{backoff_next, lock, BACKOFF_MIN};
use crate::transport;
use static_mls::error::{Error, Result};

/// Most messages queued and not yet taken by the sender; `send_pipelined` waits beyond it.
const MAX_QUEUED: usize = 8192;
/// Most payload bytes queued and not yet taken by the sender.
const MAX_QUEUED_BYTES: usize = 64 * 1024 * 1024;
/// How often a waiter looks whether the channel ended meanwhile.
const RECHECK: Duration = Duration::from_millis(100);
/// What encryption adds to a payload at most (framing, signature, AEAD tag), so that a batch
/// cut by payload size still fits in one relay request once encrypted.
const MLS_OVERHEAD: usize = 512;
/// Times a batch is encrypted again for a stale epoch before it fails.
const REENCRYPTIONS: usize = 3;

/// A channel's pipelined sends: tickets 0, 1, 2, ... in the order of `send_pipelined`.
#[derive(Default)]
pub(super) struct Pipeline {
    state: Mutex<State>,
    /// Signalled when messages are queued or settled, or the sender stops.
    changed: Condvar,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

#[derive(Default)]
struct State {
    /// Queued, not yet taken by the sender: tickets `taken`, `taken + 1`, ...
    queue: VecDeque<Arc<Vec<u8>>>,
    queued_bytes: usize,
    taken: u64,
    /// Tickets handed out.
    submitted: u64,
    /// Tickets below this are settled: in the log, or failed (see `failures`).
    settled: u64,
    failures: BTreeMap<u64, Error>,
    /// Failures below this were reported by a flush.
    reported: u64,
    /// The sender thread stopped (the channel ended): nothing more is taken.
    stopped: Option<Error>,
}

impl Pipeline {
    fn state(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    fn wait<'a>(&self, guard: MutexGuard<'a, State>, timeout: Duration) -> MutexGuard<'a, State> {
        self.changed
            .wait_timeout(guard, timeout)
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .0
    }

    /// Waits (for as long as the channel lives) until what was queued so far is settled.
    pub(super) fn wait_drained(&self, channel: &Channel) -> Result<()> {
        let mut state = self.state();
        let target = state.submitted;
        while state.settled < target {
            if state.stopped.is_some() {
                break;
            }
            channel.check_usable()?;
            state = self.wait(state, RECHECK);
        }
        Ok(())
    }

    /// Settles tickets `first..first + outcomes.len()`.
    fn settle(&self, first: u64, outcomes: Vec<Result<()>>) {
        let mut state = self.state();
        let count = outcomes.len() as u64;
        for (ticket, outcome) in (first..).zip(outcomes) {
            if let Err(e) = outcome {
                state.failures.insert(ticket, e);
            }
        }
        state.settled = state.settled.max(first + count);
        drop(state);
        self.changed.notify_all();
    }
}

/// One pipelined send (see [`Channel::send_pipelined`]).
pub struct SendHandle {
    pipeline: Arc<Pipeline>,
    ticket: u64,
}

impl SendHandle {
    /// Whether the message is in the log or has failed.
    pub fn done(&self) -> bool {
        self.pipeline.state().settled > self.ticket
    }

    /// Waits up to `timeout` for the message: `Ok(true)` once it is in the channel's log, its
    /// failure if it could not be sent, `Ok(false)` if it is still on its way.
    pub fn wait(&self, timeout: Duration) -> Result<bool> {
        let deadline = Instant::now() + timeout;
        let mut state = self.pipeline.state();
        loop {
            if state.settled > self.ticket {
                return match state.failures.get(&self.ticket) {
                    Some(e) => Err(e.clone()),
                    None => Ok(true),
                };
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(false);
            }
            state = self.pipeline.wait(state, deadline - now);
        }
    }
}

impl Channel {
    /// Queues `payload` to be encrypted and published in order after what this channel's
    /// pipeline already holds, and returns at once (see the module docs). Waits while the
    /// pipeline is full, unless `block` is false: then `Ok(None)` (also while the relay has
    /// not answered this client yet, since reaching it may take up to the connect timeout).
    pub fn send_pipelined(
        self: &Arc<Self>,
        payload: Vec<u8>,
        block: bool,
    ) -> Result<Option<SendHandle>> {
        check_payload(&payload)?;
        self.check_usable()?;
        if !self
            .shared
            .reached
            .load(std::sync::atomic::Ordering::Acquire)
        {
            if !block {
                return Ok(None);
            }
            self.reach()?;
        }
        let pipeline = &self.pipeline;
        let mut state = pipeline.state();
        while state.queue.len() >= MAX_QUEUED
            || (state.queued_bytes >= MAX_QUEUED_BYTES && !state.queue.is_empty())
        {
            if !block {
                return Ok(None);
            }
            if let Some(e) = &state.stopped {
                return Err(e.clone());
            }
            state = pipeline.wait(state, RECHECK);
            self.check_usable()?;
        }
        if let Some(e) = &state.stopped {
            return Err(e.clone());
        }
        let ticket = state.submitted;
        state.submitted += 1;
        state.queued_bytes += payload.len();
        state.queue.push_back(Arc::new(payload));
        drop(state);
        pipeline.changed.notify_all();
        self.start_sender()?;
        Ok(Some(SendHandle {
            pipeline: Arc::clone(pipeline),
            ticket,
        }))
    }

    /// How many messages were queued with [`Channel::send_pipelined`] so far.
    pub fn pipelined(&self) -> u64 {
        self.pipeline.state().submitted
    }

    /// Waits up to `timeout` until the first `target` pipelined messages are settled:
    /// `Ok(true)` then, or the first of them that failed since the last flush; `Ok(false)` if
    /// some are still on their way.
    pub fn flush_until(&self, target: u64, timeout: Duration) -> Result<bool> {
        let pipeline = &self.pipeline;
        let deadline = Instant::now() + timeout;
        let mut state = pipeline.state();
        loop {
            if state.settled >= target {
                break;
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(false);
            }
            state = pipeline.wait(state, deadline - now);
        }
        let from = state.reported;
        state.reported = state.reported.max(target);
        match state.failures.range(from..target).next() {
            Some((_, e)) => Err(e.clone()),
            None => Ok(true),
        }
    }

    /// Starts the sender thread unless it runs.
    fn start_sender(self: &Arc<Self>) -> Result<()> {
        let mut thread = lock(&self.pipeline.thread);
        if thread.is_some() {
            return Ok(());
        }
        let channel = Arc::clone(self);
        *thread = Some(
            std::thread::Builder::new()
                .name("static-sender".into())
                .spawn(move || sender(&channel))
                .map_err(|e| Error::Internal(format!("cannot start the sender thread: {e}")))?,
        );
        Ok(())
    }

    /// Waits for the sender thread to finish (the channel has ended).
    pub(super) fn join_sender(&self) {
        if let Some(thread) = lock(&self.pipeline.thread).take() {
            let _ = thread.join();
        }
    }

    /// Wakes the sender (and every waiter) to look at the channel's state.
    pub(super) fn wake_pipeline(&self) {
        self.pipeline.changed.notify_all();
    }
}

/// Fails whatever the sender leaves unsettled when it stops, however it stops.
struct Stopping<'a>(&'a Channel);

impl Drop for Stopping<'_> {
    fn drop(&mut self) {
        let channel = self.0;
        let e = channel.ended_error();
        let mut state = channel.pipeline.state();
        let first = state.settled;
        let last = state.submitted;
        for ticket in first..last {
            state.failures.insert(ticket, e.clone());
        }
        state.queue.clear();
        state.queued_bytes = 0;
        state.taken = last;
        state.settled = last;
        state.stopped = Some(e);
        drop(state);
        channel.pipeline.changed.notify_all();
    }
}

/// The sender thread: takes batches off the queue, in order, until the channel ends.
fn sender(channel: &Channel) {
    let _stopping = Stopping(channel);
    while let Some((first, payloads)) = take_batch(channel) {
        let outcomes = send_batch(channel, &payloads);
        channel.pipeline.settle(first, outcomes);
    }
}

/// The next batch (its first ticket and payloads), waiting for one; `None` once the channel
/// ended.
fn take_batch(channel: &Channel) -> Option<(u64, Vec<Arc<Vec<u8>>>)> {
    let pipeline = &channel.pipeline;
    let mut state = pipeline.state();
    while state.queue.is_empty() {
        if channel.is_closed() {
            return None;
        }
        state = pipeline.wait(state, RECHECK);
    }
    if channel.is_closed() {
        return None;
    }
    let first = state.taken;
    let mut batch = Vec::new();
    let mut bytes = 0;
    while let Some(next) = state.queue.front() {
        let size = next.len() + MLS_OVERHEAD + ITEM_OVERHEAD;
        if !batch.is_empty() && (batch.len() >= MAX_BATCH_ITEMS || bytes + size > MAX_BATCH_BYTES) {
            break;
        }
        bytes += size;
        if let Some(payload) = state.queue.pop_front() {
            state.queued_bytes -= payload.len();
            batch.push(payload);
        }
    }
    state.taken += batch.len() as u64;
    drop(state);
    // Room for more.
    pipeline.changed.notify_all();
    Some((first, batch))
}

/// One message of a batch still to be published: `bytes` when it must go again exactly as
/// it went (the relay did not answer for it), `None` when it is to be encrypted (again).
struct Todo {
    index: usize,
    bytes: Option<Vec<u8>>,
}

/// Publishes `payloads` in order (see the module docs); the outcome of each.
fn send_batch(channel: &Channel, payloads: &[Arc<Vec<u8>>]) -> Vec<Result<()>> {
    let mut outcomes: Vec<Option<Result<()>>> = vec![None; payloads.len()];
    let fail_rest = |outcomes: &mut Vec<Option<Result<()>>>, e: &Error| {
        for outcome in outcomes.iter_mut().filter(|o| o.is_none()) {
            *outcome = Some(Err(e.clone()));
        }
    };
    if let Err(e) = channel.ensure_fresh_epoch() {
        fail_rest(&mut outcomes, &e);
        return finish(outcomes);
    }
    let deadline = Instant::now() + channel.shared.retry_deadline;
    let mut todo: Vec<Todo> = (0..payloads.len())
        .map(|index| Todo { index, bytes: None })
        .collect();
    let mut reencrypted = 0;
    let mut strikes = 0;
    let mut backoff = BACKOFF_MIN;
    while !todo.is_empty() {
        if let Err(e) = channel.check_usable() {
            fail_rest(&mut outcomes, &e);
            break;
        }
        let answers = publish(channel, payloads, &mut todo, deadline);
        // The first trouble decides what happens to the rest.
        let mut trouble: Option<Trouble> = None;
        let mut next = Vec::with_capacity(todo.len());
        for (item, answer) in todo.drain(..).zip(answers) {
            match answer.blocking_recv() {
                Ok(Outcome::Accepted) => outcomes[item.index] = Some(Ok(())),
                Ok(Outcome::Refused(refusal)) => {
                    trouble.get_or_insert(Trouble::Refused(refusal));
                    next.push(Todo {
                        index: item.index,
                        bytes: None,
                    });
                }
                Ok(Outcome::Unanswered(_, message)) => next.push(Todo {
                    index: item.index,
                    bytes: Some(message),
                }),
                Ok(Outcome::Failed(e)) => {
                    trouble.get_or_insert(Trouble::Failed(e));
                    next.push(Todo {
                        index: item.index,
                        bytes: None,
                    });
                }
                Err(_) => {
                    trouble.get_or_insert(Trouble::Failed(channel.ended_error()));
                    next.push(item);
                }
            }
        }
        todo = next;
        let Some(trouble) = trouble else {
            // Only unanswered ones (if any): sent again as they are.
            continue;
        };
        let handled = match trouble {
            Trouble::Failed(e) if channel.awaits_proposal_commit(&e) => {
                // A member's proposal is pending: a commit covering it comes at once (see
                // `Channel::send`).
                channel
                    .shared
                    .engine()
                    .and_then(|engine| engine.epoch(&channel.name))
                    .and_then(|epoch| channel.block_on(channel.wait_epoch(epoch + 1)))
                    .and_then(|()| {
                        if Instant::now() < deadline {
                            Ok(())
                        } else {
                            Err(e)
                        }
                    })
            }
            Trouble::Failed(e) => Err(e),
            Trouble::Refused(refusal) => {
                let status = Status::new(Code::from(refusal.code as i32), refusal.message.clone());
                match status.code() {
                    Code::FailedPrecondition if reencrypted < REENCRYPTIONS => {
                        reencrypted += 1;
                        channel.block_on(channel.wait_epoch(refusal.current_epoch))
                    }
                    Code::Unauthenticated => {
                        channel
                            .shared
                            .on_unauthenticated(&status, None, &mut strikes)
                    }
                    Code::ResourceExhausted if refusal.retry_after_ms > 0 => {
                        std::thread::sleep(Duration::from_millis(refusal.retry_after_ms));
                        Ok(())
                    }
                    _ if transport::is_transient(&status) && Instant::now() < deadline => {
                        std::thread::sleep(backoff);
                        backoff = backoff_next(backoff);
                        Ok(())
                    }
                    _ => Err(transport::status_error("Publish", &status)),
                }
            }
        };
        if let Err(e) = handled {
            fail_rest(&mut outcomes, &e);
            break;
        }
    }
    finish(outcomes)
}

/// What went wrong first in a round of a batch.
enum Trouble {
    Refused(crate::transport::pb::Refusal),
    Failed(Error),
}

fn finish(outcomes: Vec<Option<Result<()>>>) -> Vec<Result<()>> {
    outcomes
        .into_iter()
        .map(|o| o.unwrap_or_else(|| Err(Error::Internal("a pipelined send was lost".into()))))
        .collect()
}

/// Hands `todo` to the publisher in order, as consecutive runs: messages to send again as
/// they are go straight to it, the others are encrypted first (one transaction per run).
fn publish(
    channel: &Channel,
    payloads: &[Arc<Vec<u8>>],
    todo: &mut [Todo],
    deadline: Instant,
) -> Vec<oneshot::Receiver<Outcome>> {
    let mut answers = Vec::with_capacity(todo.len());
    let mut run_start = 0;
    while run_start < todo.len() {
        let as_is = todo[run_start].bytes.is_some();
        let run_end = todo[run_start..]
            .iter()
            .position(|t| t.bytes.is_some() != as_is)
            .map_or(todo.len(), |n| run_start + n);
        let run = &mut todo[run_start..run_end];
        if as_is {
            let items = run
                .iter_mut()
                .filter_map(|t| t.bytes.take())
                .map(|message| {
                    let (reply, answer) = oneshot::channel();
                    answers.push(answer);
                    Outbound {
                        message,
                        deadline,
                        reply,
                        unit: None,
                    }
                })
                .collect();
            // A publisher that is gone drops the replies: the channel's end is seen.
            let _ = channel.outbound.send(items);
        } else {
            let pending = run
                .iter()
                .map(|t| {
                    let (reply, answer) = oneshot::channel();
                    answers.push(answer);
                    Pending {
                        payload: Arc::clone(&payloads[t.index]),
                        deadline,
                        reply,
                    }
                })
                .collect();
            channel.encrypt_and_publish_all(pending);
        }
        run_start = run_end;
    }
    answers
}
