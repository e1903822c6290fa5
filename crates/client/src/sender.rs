//! The sender of a channel's pipelined sends: a thread that takes what is queued in batches,
//! encrypts each batch in one transaction and publishes it as one unit, and waits for the
//! batch's outcomes before it takes the next. So the log holds pipelined messages in the order
//! they were queued:
//!
//! * within a batch, the relay decides items in order, and its refusals only ever cut a tail
//!   off (a batch is encrypted at one epoch, so the epoch fence refuses all of it from some
//!   item on; the publish rate limit refuses the rest of a request once it refuses an item);
//! * what was refused is certainly not in the log: it is encrypted again and sent before
//!   anything queued after it; what the relay did not answer for is sent again as it is (the
//!   relay's idempotency answers for a copy it already has);
//! * a message that cannot be sent fails its handle, and so do the messages of its batch after
//!   it (nothing overtakes it). Later batches are sent as usual.
//!
//! The thread starts with the first pipelined send and ends after [`IDLE`] without one, so
//! only channels that pipeline hold a thread, and only while they do.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::oneshot;

use crate::channel_core::ChannelCore;
use crate::commit::Committer;
use crate::encrypt::{Encryptor, Pending, Trouble};
use crate::error::{Error, Result};
use crate::publisher::{Outcome, ITEM_OVERHEAD, MAX_BATCH_BYTES, MAX_BATCH_ITEMS};
use crate::retry::Retry;
use crate::sync::lock;

/// What encryption adds to a payload at most (framing, signature, AEAD tag), so that a batch
/// cut by payload size still fits in one relay request once encrypted.
const MLS_OVERHEAD: usize = 512;
/// How long the thread waits for more before it ends (a new one starts on the next send).
const IDLE: Duration = Duration::from_secs(1);

/// What the sender works with: the channel's core, its encryption and its commits.
#[derive(Clone)]
pub(crate) struct Sender {
    pub(crate) core: Arc<ChannelCore>,
    pub(crate) encryptor: Arc<Encryptor>,
    pub(crate) committer: Arc<Committer>,
}

impl Sender {
    /// Starts the sender thread unless one runs.
    pub(crate) fn start(&self) -> Result<()> {
        let mut thread = lock(&self.core.pipeline.thread);
        if thread.is_some() {
            return Ok(());
        }
        let sender = self.clone();
        *thread = Some(
            std::thread::Builder::new()
                .name("static-sender".into())
                .spawn(move || sender.run())
                .map_err(|e| Error::task("cannot start the sender thread", e))?,
        );
        Ok(())
    }

    /// Waits for the sender thread to finish (the channel has ended).
    pub(crate) fn join(core: &ChannelCore) {
        let thread = lock(&core.pipeline.thread).take();
        if let Some(thread) = thread {
            let _ = thread.join();
        }
    }

    /// The thread: takes batches off the queue, in order, until the channel ends or nothing
    /// comes for [`IDLE`].
    fn run(&self) {
        let core = &self.core;
        let pipeline = &core.pipeline;
        let _exit = Exit(core);
        loop {
            let batch = pipeline.take_batch(
                IDLE,
                || core.is_closed(),
                |payload| payload.len() + MLS_OVERHEAD + ITEM_OVERHEAD,
                |count, bytes| count <= MAX_BATCH_ITEMS && bytes <= MAX_BATCH_BYTES,
            );
            if let Some((first, payloads)) = batch {
                let outcomes = self.send_batch(&payloads);
                pipeline.settle(first, outcomes);
                continue;
            }
            if core.is_closed() {
                return;
            }
            // Idle: end, unless a send came meanwhile (checked under the slot's lock, which a
            // send takes to start a thread, so none is left without one).
            let mut slot = lock(&pipeline.thread);
            if pipeline.has_queued() {
                continue;
            }
            slot.take();
            return;
        }
    }

    /// Publishes `payloads` in order (see the module docs); the outcome of each.
    fn send_batch(&self, payloads: &[Arc<Vec<u8>>]) -> Vec<Result<()>> {
        let core = &self.core;
        let mut outcomes: Vec<Option<Result<()>>> = vec![None; payloads.len()];
        let fail_rest = |outcomes: &mut Vec<Option<Result<()>>>, e: &Error| {
            for outcome in outcomes.iter_mut().filter(|o| o.is_none()) {
                *outcome = Some(Err(e.clone()));
            }
        };
        if let Err(e) = self.committer.ensure_fresh_epoch() {
            fail_rest(&mut outcomes, &e);
            return finish(outcomes);
        }
        let mut retry = Retry::within(core.shared.options.retry_timeout);
        let deadline = retry
            .deadline()
            .unwrap_or_else(|| std::time::Instant::now() + core.shared.options.retry_timeout);
        let mut todo: Vec<Todo> = (0..payloads.len())
            .map(|index| Todo { index, bytes: None })
            .collect();
        let mut reencrypted = 0;
        while !todo.is_empty() {
            if let Err(e) = core.check_usable() {
                fail_rest(&mut outcomes, &e);
                break;
            }
            let answers = self.publish(payloads, &mut todo, deadline);
            // The first trouble decides what happens to the rest.
            let mut trouble: Option<Trouble> = None;
            let mut next = Vec::with_capacity(todo.len());
            for (item, answer) in todo.drain(..).zip(answers) {
                let again = Todo {
                    index: item.index,
                    bytes: None,
                };
                match answer.blocking_recv() {
                    Ok(Outcome::Accepted) => outcomes[item.index] = Some(Ok(())),
                    Ok(Outcome::Refused(refusal)) => {
                        trouble.get_or_insert(Trouble::Refused(refusal));
                        next.push(again);
                    }
                    Ok(Outcome::Unanswered(message)) => next.push(Todo {
                        index: item.index,
                        bytes: Some(message),
                    }),
                    Ok(Outcome::Failed(e)) => {
                        trouble.get_or_insert(Trouble::Failed(e));
                        next.push(again);
                    }
                    Err(_) => {
                        trouble.get_or_insert(Trouble::Failed(core.ended_error()));
                        next.push(item);
                    }
                }
            }
            todo = next;
            let Some(trouble) = trouble else {
                // Only unanswered ones (if any): sent again as they are.
                continue;
            };
            if let Err(e) = self
                .encryptor
                .recover(trouble, &mut retry, &mut reencrypted)
            {
                fail_rest(&mut outcomes, &e);
                break;
            }
        }
        finish(outcomes)
    }

    /// Hands `todo` to the publisher in order, as consecutive runs: messages to send again as
    /// they are go straight to it, the others are encrypted first (one transaction per run).
    fn publish(
        &self,
        payloads: &[Arc<Vec<u8>>],
        todo: &mut [Todo],
        deadline: std::time::Instant,
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
                let messages = run.iter_mut().filter_map(|t| t.bytes.take()).collect();
                answers.extend(self.encryptor.republish(messages, deadline));
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
                self.encryptor.encrypt_and_publish_all(pending);
            }
            run_start = run_end;
        }
        answers
    }
}

/// Fails what the sender leaves unsettled when the channel ended or the thread panicked.
struct Exit<'a>(&'a ChannelCore);

impl Drop for Exit<'_> {
    fn drop(&mut self) {
        let core = self.0;
        if core.is_closed() {
            core.pipeline.stop(core.ended_error());
        } else if std::thread::panicking() {
            core.pipeline
                .stop(Error::Internal("the sender thread failed".into()));
        }
    }
}

/// One message of a batch still to be published: `bytes` when it must go again exactly as
/// it went (the relay did not answer for it), `None` when it is to be encrypted (again).
struct Todo {
    index: usize,
    bytes: Option<Vec<u8>>,
}

fn finish(outcomes: Vec<Option<Result<()>>>) -> Vec<Result<()>> {
    outcomes
        .into_iter()
        .map(|o| o.unwrap_or_else(|| Err(Error::Internal("a pipelined send was lost".into()))))
        .collect()
}
