//! The job queue: what the submitters (tokio tasks) hand the writer thread, publishes and the
//! rarer jobs, and its stop.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, PoisonError};

use tokio::sync::{oneshot, watch};

use super::channel::Channel;
use super::{Accepted, Checked, Outcome, MAX_BATCH};
use crate::error::{shutting_down, Result};
use crate::observe::metrics;
use crate::store::AuditRow;
use crate::store::{Policy, PruneStep};

/// The writer's jobs for `items`, and the outcomes their submitter waits on.
pub(super) fn publish_jobs(items: Vec<(Arc<Channel>, Checked)>) -> (Vec<Job>, Vec<Outcome>) {
    items
        .into_iter()
        .map(|(channel, checked)| {
            let (tx, rx) = oneshot::channel();
            (
                Job::Publish(Publish {
                    channel,
                    checked,
                    submitted: metrics::now_ns(),
                    tx,
                }),
                rx,
            )
        })
        .unzip()
}

pub(crate) struct Publish {
    pub channel: Arc<Channel>,
    pub checked: Checked,
    /// When it was submitted ([`metrics::now_ns`]): publish-to-ack and -delivery start here.
    pub(super) submitted: u64,
    pub(super) tx: oneshot::Sender<Result<Accepted>>,
}

pub(super) enum Job {
    Publish(Publish),
    Create(CreateJob),
    Bind {
        channel_id: i64,
        epoch: u64,
        leaf: u32,
        account: String,
        key_id: Option<String>,
        tx: oneshot::Sender<Result<bool>>,
    },
    Prune {
        step: PruneStep,
        tx: oneshot::Sender<Result<()>>,
    },
    ExpireWelcomes {
        created_before: i64,
        used_before: i64,
        limit: usize,
        tx: oneshot::Sender<Result<usize>>,
    },
    SetRetention {
        channel_id: i64,
        policy: Policy,
        /// Its `retention.changed` row (None: an anonymous caller's).
        audit: Option<AuditRow>,
        tx: oneshot::Sender<Result<()>>,
    },
    /// A readiness probe: one small write (see [`ChannelLog::probe`]).
    ///
    /// [`ChannelLog::probe`]: super::ChannelLog::probe
    Probe {
        tx: oneshot::Sender<Result<()>>,
    },
}

pub(super) struct CreateJob {
    pub(super) name: String,
    pub(super) org: String,
    pub(super) account: String,
    pub(super) state: Vec<u8>,
    pub(super) leaf: u32,
    /// Its `channel.created` row, and the `org.claimed` one (written if it claims the org).
    pub(super) audit: Vec<AuditRow>,
    pub(super) claimed: Option<AuditRow>,
    pub(super) key_id: Option<String>,
    pub(super) tx: oneshot::Sender<Result<i64>>,
}

impl Job {
    pub(super) fn refuse(self) {
        // A receiver gone (its caller cancelled) needs no answer.
        match self {
            Job::Publish(p) => {
                let _ = p.tx.send(Err(shutting_down()));
            }
            Job::Create(create) => {
                let _ = create.tx.send(Err(shutting_down()));
            }
            Job::Bind { tx, .. } => {
                let _ = tx.send(Err(shutting_down()));
            }
            Job::Prune { tx, .. } | Job::SetRetention { tx, .. } | Job::Probe { tx } => {
                let _ = tx.send(Err(shutting_down()));
            }
            Job::ExpireWelcomes { tx, .. } => {
                let _ = tx.send(Err(shutting_down()));
            }
        }
    }
}

/// What tokio tasks hand the writer thread.
pub(super) struct Queue {
    pub(super) state: Mutex<QueueState>,
    pub(super) wake: Condvar,
    /// Set once the writer has stopped (its connection and checkpointer closed).
    pub(super) stopped: watch::Sender<bool>,
}

#[derive(Default)]
pub(super) struct QueueState {
    jobs: VecDeque<Job>,
    closing: bool,
    /// The writer sleeps on the condvar: only then is a notify (a futex wake) needed.
    writer_waiting: bool,
}

impl Queue {
    fn lock(&self) -> std::sync::MutexGuard<'_, QueueState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Queue `jobs` for the writer, or give them back once closing.
    pub(super) fn push(&self, jobs: Vec<Job>) -> std::result::Result<(), Vec<Job>> {
        let mut state = self.lock();
        if state.closing {
            return Err(jobs);
        }
        state.jobs.extend(jobs);
        Ok(())
    }

    /// Wake the writer thread if it sleeps (a futex wake only then).
    pub(super) fn notify_writer(&self) {
        let wake = std::mem::replace(&mut self.lock().writer_waiting, false);
        if wake {
            self.wake.notify_one();
        }
    }

    pub(super) fn has_jobs(&self) -> bool {
        !self.lock().jobs.is_empty()
    }

    /// Moves up to [`MAX_BATCH`] queued jobs into `batch`, without waiting.
    pub(super) fn take_now(&self, batch: &mut Vec<Job>) {
        let mut state = self.lock();
        let n = state.jobs.len().min(MAX_BATCH);
        batch.extend(state.jobs.drain(..n));
    }

    pub(super) fn close(&self) {
        self.lock().closing = true;
        self.wake.notify_one();
    }

    /// Waits until jobs are queued; false once closing and nothing is left.
    pub(super) fn wait_for_jobs(&self) -> bool {
        let mut state = self.lock();
        loop {
            if !state.jobs.is_empty() {
                return true;
            }
            if state.closing {
                return false;
            }
            state.writer_waiting = true;
            state = self
                .wake
                .wait(state)
                .unwrap_or_else(PoisonError::into_inner);
            state.writer_waiting = false;
        }
    }
}

/// Dropped when the writer thread ends (normally or by a panic): refuses what is still queued
/// and tells [`ChannelLog::close`].
///
/// [`ChannelLog::close`]: super::ChannelLog::close
pub(super) struct StopGuard(pub(super) Arc<Queue>);

impl Drop for StopGuard {
    fn drop(&mut self) {
        let left: Vec<Job> = {
            let mut state = self.0.lock();
            state.closing = true;
            state.jobs.drain(..).collect()
        };
        left.into_iter().for_each(Job::refuse);
        self.0.stopped.send_replace(true);
    }
}
