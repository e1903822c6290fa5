//! The state of a channel's pipelined sends: tickets 0, 1, 2, ... in the order of
//! [`Channel::send_pipelined`](crate::Channel::send_pipelined), the queue the sender takes
//! batches from, what is settled and what failed, and the [`SendHandle`] callers wait on.
//! The sender itself (what publishes the batches) is `sender`.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::sync::lock;

/// Most messages queued and not yet taken by the sender; `send_pipelined` waits beyond it.
const MAX_QUEUED: usize = 8192;
/// Most payload bytes queued and not yet taken by the sender.
const MAX_QUEUED_BYTES: usize = 64 * 1024 * 1024;
/// How often a waiter looks whether the channel ended meanwhile.
pub(crate) const RECHECK: Duration = Duration::from_millis(100);

/// See the module docs.
#[derive(Default)]
pub(crate) struct Pipeline {
    state: Mutex<State>,
    /// Signalled when messages are queued or settled, or the sender stops.
    changed: Condvar,
    /// The sender thread, while one runs.
    pub(crate) thread: Mutex<Option<std::thread::JoinHandle<()>>>,
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
    /// The channel ended: nothing more is taken.
    stopped: Option<Error>,
}

/// What [`Pipeline::submit`] did.
pub(crate) enum Submitted {
    Queued(SendHandle),
    /// The pipeline is full and the caller would not wait.
    Full,
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

    /// Wakes every waiter to look at the channel's state.
    pub(crate) fn wake(&self) {
        self.changed.notify_all();
    }

    /// Queues `payload`, waiting while the pipeline is full unless `block` is false;
    /// `usable` says whether the channel may still send (checked while waiting).
    pub(crate) fn submit(
        self: &Arc<Self>,
        payload: Vec<u8>,
        block: bool,
        usable: impl Fn() -> Result<()>,
    ) -> Result<Submitted> {
        let mut state = self.state();
        while state.queue.len() >= MAX_QUEUED
            || (state.queued_bytes >= MAX_QUEUED_BYTES && !state.queue.is_empty())
        {
            if !block {
                return Ok(Submitted::Full);
            }
            if let Some(e) = &state.stopped {
                return Err(e.clone());
            }
            state = self.wait(state, RECHECK);
            usable()?;
        }
        if let Some(e) = &state.stopped {
            return Err(e.clone());
        }
        let ticket = state.submitted;
        state.submitted += 1;
        state.queued_bytes += payload.len();
        state.queue.push_back(Arc::new(payload));
        drop(state);
        self.changed.notify_all();
        Ok(Submitted::Queued(SendHandle {
            pipeline: Arc::clone(self),
            ticket,
        }))
    }

    /// How many messages were queued so far.
    pub(crate) fn submitted(&self) -> u64 {
        self.state().submitted
    }

    /// Waits (while `usable` holds) until what was queued so far is settled.
    pub(crate) fn wait_drained(&self, usable: impl Fn() -> Result<()>) -> Result<()> {
        let mut state = self.state();
        let target = state.submitted;
        while state.settled < target {
            if state.stopped.is_some() {
                break;
            }
            usable()?;
            state = self.wait(state, RECHECK);
        }
        Ok(())
    }

    /// Waits up to `timeout` until the first `target` messages are settled: `Ok(true)` then,
    /// or the first of them that failed since the last flush; `Ok(false)` if some are still on
    /// their way.
    pub(crate) fn flush_until(&self, target: u64, timeout: Duration) -> Result<bool> {
        let deadline = Instant::now() + timeout;
        let mut state = self.state();
        loop {
            if state.settled >= target {
                break;
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(false);
            }
            state = self.wait(state, deadline - now);
        }
        let from = state.reported;
        state.reported = state.reported.max(target);
        match state.failures.range(from..target).next() {
            Some((_, e)) => Err(e.clone()),
            None => Ok(true),
        }
    }

    /// The next batch for the sender (its first ticket and payloads, cut by `fits(count,
    /// bytes)`), waiting up to `idle` for one; `None` when none came or the channel `ended`.
    pub(crate) fn take_batch(
        &self,
        idle: Duration,
        ended: impl Fn() -> bool,
        size: impl Fn(&[u8]) -> usize,
        fits: impl Fn(usize, usize) -> bool,
    ) -> Option<(u64, Vec<Arc<Vec<u8>>>)> {
        let deadline = Instant::now() + idle;
        let mut state = self.state();
        while state.queue.is_empty() {
            let now = Instant::now();
            if ended() || now >= deadline {
                return None;
            }
            state = self.wait(state, RECHECK.min(deadline - now));
        }
        if ended() {
            return None;
        }
        let first = state.taken;
        let mut batch = Vec::new();
        let mut bytes = 0;
        while let Some(next) = state.queue.front() {
            let item = size(next);
            if !batch.is_empty() && !fits(batch.len() + 1, bytes + item) {
                break;
            }
            bytes += item;
            if let Some(payload) = state.queue.pop_front() {
                state.queued_bytes -= payload.len();
                batch.push(payload);
            }
        }
        state.taken += batch.len() as u64;
        drop(state);
        // Room for more.
        self.changed.notify_all();
        Some((first, batch))
    }

    /// Whether messages wait to be taken.
    pub(crate) fn has_queued(&self) -> bool {
        !self.state().queue.is_empty()
    }

    /// Settles tickets `first..first + outcomes.len()`.
    pub(crate) fn settle(&self, first: u64, outcomes: Vec<Result<()>>) {
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

    /// The channel ended: every unsettled message fails with `e`, and nothing more is taken.
    pub(crate) fn stop(&self, e: Error) {
        let mut state = self.state();
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
        self.changed.notify_all();
    }
}

/// One pipelined send (see [`Channel::send_pipelined`](crate::Channel::send_pipelined)).
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
