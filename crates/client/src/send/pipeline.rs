//! The state of a channel's pipelined sends: tickets 0, 1, 2, ... in the order of
//! [`Channel::send_pipelined`](crate::Channel::send_pipelined) (and, first, what an earlier
//! opening left in the outbox and the journal), each with its place in the channel's outbox,
//! the queue the sender takes batches from, what is settled and what failed, and the
//! [`SendHandle`] callers wait on. The sender itself (what encrypts and publishes the batches)
//! is `sender`.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use static_mls::Outgoing;

use super::journal::Journal;
use crate::error::{Error, Result};
use crate::sync::lock;

/// Most messages queued and not yet taken by the sender; `send_pipelined` waits beyond it.
const MAX_QUEUED: usize = 8192;
/// Most bytes (messages and the plaintexts kept beside them) queued and not yet taken by the
/// sender.
const MAX_QUEUED_BYTES: usize = 64 * 1024 * 1024;
/// How often a waiter looks whether the channel ended meanwhile.
pub(crate) const RECHECK: Duration = Duration::from_millis(100);

/// See the module docs.
#[derive(Default)]
pub(crate) struct Pipeline {
    state: Mutex<State>,
    /// Held while a payload is journaled and queued, so that places and tickets follow the
    /// journal's order.
    recording: Mutex<()>,
    /// The channel's journal, once the channel has opened it.
    pub(crate) journal: OnceLock<Journal>,
    /// Signalled when messages are queued or settled, or the sender stops.
    changed: Condvar,
    /// The sender thread, while one runs.
    pub(crate) thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

/// What the sender encrypts (if it is not yet) and publishes: one message.
pub(crate) struct Queued {
    /// Its place in the channel's outbox.
    pub(crate) place: i64,
    /// Its plaintext, to encrypt it (again, if the relay refuses its epoch); None for a message
    /// an earlier opening encrypted (the outbox keeps ciphertexts only).
    pub(crate) payload: Option<Arc<Vec<u8>>>,
    /// The message, once encrypted into the outbox.
    pub(crate) outgoing: Option<Outgoing>,
}

/// What encryption adds to a payload at most (framing, signature, AEAD tag), so that a batch
/// cut by payload size still fits in one relay request once encrypted.
pub(crate) const MLS_OVERHEAD: usize = 512;

impl Queued {
    fn bytes(&self) -> usize {
        self.outgoing.as_ref().map_or(0, |o| o.message.len())
            + self.payload.as_ref().map_or(0, |p| p.len())
    }

    /// Its size on the wire, at most.
    fn wire_size(&self) -> usize {
        match (&self.outgoing, &self.payload) {
            (Some(o), _) => o.message.len(),
            (None, Some(p)) => p.len() + MLS_OVERHEAD,
            (None, None) => 0,
        }
    }

    /// The epoch it was encrypted in; None while it is not.
    fn epoch(&self) -> Option<u64> {
        self.outgoing.as_ref().map(|o| o.epoch)
    }
}

#[derive(Default)]
struct State {
    /// Queued, not yet taken by the sender: tickets `taken`, `taken + 1`, ...
    queue: VecDeque<Queued>,
    queued_bytes: usize,
    /// The outbox place of the next payload queued.
    next_place: i64,
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

    /// Waits while the pipeline is full unless `block` is false (then `Ok(false)`); `usable`
    /// says whether the channel may still send (checked while waiting).
    pub(crate) fn wait_for_room(
        &self,
        block: bool,
        usable: impl Fn() -> Result<()>,
    ) -> Result<bool> {
        let mut state = self.state();
        while state.queue.len() >= MAX_QUEUED
            || (state.queued_bytes >= MAX_QUEUED_BYTES && !state.queue.is_empty())
        {
            if !block {
                return Ok(false);
            }
            if let Some(e) = &state.stopped {
                return Err(e.clone());
            }
            state = self.wait(state, RECHECK);
            usable()?;
        }
        match &state.stopped {
            Some(e) => Err(e.clone()),
            None => Ok(true),
        }
    }

    /// Records `payload` at the next place with `record` (the journal) and queues it, under
    /// the recording lock. Call [`Pipeline::wait_for_room`] first: concurrent callers may
    /// overshoot the bounds by one message each.
    pub(crate) fn submit(
        self: &Arc<Self>,
        payload: Vec<u8>,
        record: impl FnOnce(i64, &[u8]) -> Result<()>,
    ) -> Result<SendHandle> {
        let _recording = lock(&self.recording);
        let place = self.state().next_place;
        record(place, &payload)?;
        let ticket = self.push(Queued {
            place,
            payload: Some(Arc::new(payload)),
            outgoing: None,
        });
        Ok(SendHandle {
            pipeline: Arc::clone(self),
            ticket,
        })
    }

    /// Queues what an earlier opening left, before anything else: the outbox's messages, then
    /// the journal's payloads not yet encrypted; places go on after `last_place`.
    pub(crate) fn preload(
        &self,
        outbox: Vec<Outgoing>,
        journaled: Vec<(i64, Vec<u8>)>,
        last_place: i64,
    ) {
        self.state().next_place = last_place + 1;
        for outgoing in outbox {
            self.push(Queued {
                place: outgoing.id,
                payload: None,
                outgoing: Some(outgoing),
            });
        }
        for (place, payload) in journaled {
            self.push(Queued {
                place,
                payload: Some(Arc::new(payload)),
                outgoing: None,
            });
        }
    }

    /// How many messages `send_pipelined` ever accepted on the channel (its last place).
    pub(crate) fn last_place(&self) -> i64 {
        self.state().next_place - 1
    }

    /// Queues `item`: its ticket.
    fn push(&self, item: Queued) -> u64 {
        let mut state = self.state();
        let ticket = state.submitted;
        state.submitted += 1;
        state.next_place = state.next_place.max(item.place + 1);
        if let Some(e) = state.stopped.clone() {
            // The channel ended meanwhile: the message stays in the journal, for the next
            // opening to send.
            state.failures.insert(ticket, e);
            state.taken = state.submitted;
            state.settled = state.submitted;
        } else {
            state.queued_bytes += item.bytes();
            state.queue.push_back(item);
        }
        drop(state);
        self.changed.notify_all();
        ticket
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

    /// The next batch for the sender (its first ticket and messages, either all to encrypt or
    /// all encrypted at one epoch, cut by `fits(count, bytes)`), waiting up to `idle` for one;
    /// `None` when none came or the channel `ended`.
    pub(crate) fn take_batch(
        &self,
        idle: Duration,
        ended: impl Fn() -> bool,
        fits: impl Fn(usize, usize) -> bool,
    ) -> Option<(u64, Vec<Queued>)> {
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
        let epoch = state.queue.front().map(Queued::epoch);
        let mut batch = Vec::new();
        let mut bytes = 0;
        while let Some(next) = state.queue.front() {
            let item = next.wire_size();
            // One epoch per batch: the relay's epoch fence then refuses a tail of it at most.
            if !batch.is_empty()
                && (!fits(batch.len() + 1, bytes + item) || Some(next.epoch()) != epoch)
            {
                break;
            }
            bytes += item;
            if let Some(queued) = state.queue.pop_front() {
                state.queued_bytes -= queued.bytes();
                batch.push(queued);
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
