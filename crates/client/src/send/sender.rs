//! The sender of a channel's pipelined sends: a thread that takes what is queued (journaled by
//! `send_pipelined`, see `journal`) in batches, encrypts each batch in one transaction that
//! also records the messages in the channel's outbox (`static_mls::outbox`; the journal then
//! forgets them), publishes it as one unit, waits for the batch's outcomes before it takes the
//! next, and then deletes what was settled from the outbox. So the log holds pipelined
//! messages in the order they were queued:
//!
//! * within a batch, the relay decides items in order, and its refusals only ever cut a tail
//!   off (a batch is of one epoch, so the epoch fence refuses all of it from some item on; the
//!   publish rate limit refuses the rest of a request once it refuses an item);
//! * what the relay did not answer for, or refused for now (rate limit, store unavailable), is
//!   sent again as it is, before anything queued after it (the relay's idempotency answers for
//!   a copy it already has); what it refused for its epoch is encrypted again (nothing after it
//!   is encrypted yet), unless an earlier opening encrypted it: the outbox keeps no plaintext,
//!   so such a message fails, said explicitly;
//! * a message that cannot be sent fails its handle, and so do the messages of its batch after
//!   it (nothing overtakes it). Later batches are sent as usual.
//!
//! What the channel's end (a close) leaves unsettled stays in the outbox and the journal: the
//! next opening sends it first (the outbox's with the same bytes). The thread starts with the
//! first pipelined send (or an opening that found something left) and ends after [`IDLE`]
//! without one, so only channels that pipeline hold a thread, and only while they do.

use std::sync::Arc;
use std::time::Duration;

use tonic::Code;

use super::encrypt::{Encryptor, Trouble};
use super::pipeline::Queued;
use super::publisher::{Outcome, ITEM_OVERHEAD, MAX_BATCH_BYTES, MAX_BATCH_ITEMS};
use crate::channel::commit::Committer;
use crate::channel::core::{stamp, ChannelCore};
use crate::error::{Error, Result};
use crate::relay::refusal::Refusal;
use crate::relay::retry::Retry;
use crate::sync::{join_within, lock};

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

    /// Waits until `deadline` for the sender thread to finish (the channel has ended).
    pub(crate) fn join(core: &ChannelCore, deadline: std::time::Instant) {
        let thread = lock(&core.pipeline.thread).take();
        if let Some(thread) = thread {
            join_within(thread, deadline);
        }
    }

    /// The thread: takes batches off the queue, in order, until the channel ends or nothing
    /// comes for [`IDLE`].
    fn run(&self) {
        let core = &self.core;
        let pipeline = &core.pipeline;
        let _exit = Exit(core);
        // The outbox place up to which the relay settled what we sent, not yet deleted: that
        // goes with the next batch's encryption, or now if nothing waits.
        let mut owed: Option<i64> = None;
        loop {
            if owed.is_some() && !pipeline.has_queued() {
                self.delete_settled(&mut owed);
            }
            let batch = pipeline.take_batch(
                IDLE,
                || core.is_closed(),
                |count, bytes| {
                    count <= MAX_BATCH_ITEMS && bytes + count * ITEM_OVERHEAD <= MAX_BATCH_BYTES
                },
            );
            if let Some((first, mut batch)) = batch {
                let outcomes = self.send_batch(&mut batch, &mut owed);
                self.forget_settled(&batch, &outcomes, &mut owed);
                pipeline.settle(first, outcomes);
                continue;
            }
            if core.is_closed() {
                self.delete_settled(&mut owed);
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

    /// Publishes `batch` in order (see the module docs); the outcome of each.
    fn send_batch(&self, batch: &mut [Queued], owed: &mut Option<i64>) -> Vec<Result<()>> {
        let core = &self.core;
        let mut outcomes: Vec<Option<Result<()>>> = vec![None; batch.len()];
        let fail_rest = |outcomes: &mut Vec<Option<Result<()>>>, e: &Error| {
            for outcome in outcomes.iter_mut().filter(|o| o.is_none()) {
                *outcome = Some(Err(e.clone()));
            }
        };
        let mut retry = Retry::within(core.shared.options.retry_timeout);
        let deadline = retry
            .deadline()
            .unwrap_or_else(|| std::time::Instant::now() + core.shared.options.retry_timeout);
        if batch.first().is_some_and(|q| q.outgoing.is_none()) {
            if let Err(e) = self.encrypt(batch, owed, &mut retry) {
                fail_rest(&mut outcomes, &e);
            }
        }
        let mut todo: Vec<usize> = (0..batch.len())
            .filter(|&i| outcomes[i].is_none())
            .collect();
        let mut reencrypted = 0;
        while !todo.is_empty() {
            if let Err(e) = core.check_usable() {
                fail_rest(&mut outcomes, &e);
                break;
            }
            let messages: Vec<Vec<u8>> = todo
                .iter()
                .filter_map(|&i| batch[i].outgoing.as_ref().map(|o| o.message.clone()))
                .collect();
            {
                let mut own = lock(&core.own_messages);
                for message in &messages {
                    own.remember(message);
                }
            }
            let answers = self.encryptor.republish(messages, &[], deadline);
            // The first trouble decides what happens to the rest.
            let mut trouble: Option<Trouble> = None;
            let mut next = Vec::with_capacity(todo.len());
            for (&i, answer) in todo.iter().zip(answers) {
                match answer.blocking_recv() {
                    Ok(Outcome::Accepted) => outcomes[i] = Some(Ok(())),
                    Ok(Outcome::Unanswered(_)) => next.push(i),
                    Ok(Outcome::Refused(refusal)) => {
                        trouble.get_or_insert(Trouble::Refused(refusal));
                        next.push(i);
                    }
                    Ok(Outcome::Failed(e)) => {
                        trouble.get_or_insert(Trouble::Failed(e));
                        next.push(i);
                    }
                    Err(_) => {
                        trouble.get_or_insert(Trouble::Failed(core.ended_error()));
                        next.push(i);
                    }
                }
            }
            todo = next;
            let Some(trouble) = trouble else {
                // Only unanswered ones (if any): sent again as they are.
                continue;
            };
            let stale = matches!(trouble, Trouble::Refused(Refusal::StaleEpoch { .. }));
            let recovered = self
                .encryptor
                .recover(trouble, &mut retry, &mut reencrypted)
                .and_then(|()| {
                    if stale {
                        self.encrypt_again(batch, &mut todo, &mut outcomes)
                    } else {
                        Ok(())
                    }
                });
            if let Err(e) = recovered {
                fail_rest(&mut outcomes, &e);
                break;
            }
        }
        outcomes
            .into_iter()
            .map(|o| o.unwrap_or_else(|| Err(Error::Internal("a pipelined send was lost".into()))))
            .collect()
    }

    /// Encrypts `batch` (payloads not yet encrypted) in one transaction that records the
    /// messages in the outbox, after which the journal forgets them. Waits for the commit a
    /// pending proposal calls for (see [`Encryptor::recover`]).
    fn encrypt(
        &self,
        batch: &mut [Queued],
        owed: &mut Option<i64>,
        retry: &mut Retry,
    ) -> Result<()> {
        let core = &self.core;
        self.committer.ensure_fresh_epoch()?;
        let engine = core.shared.engine()?;
        let places: Vec<i64> = batch.iter().map(|q| q.place).collect();
        let payloads: Vec<&[u8]> = batch
            .iter()
            .filter_map(|q| q.payload.as_deref().map(Vec::as_slice))
            .collect();
        let encrypted = loop {
            match engine.encrypt_to_outbox(&core.name, *owed, &places, &payloads) {
                Ok(encrypted) => {
                    *owed = None;
                    break encrypted;
                }
                Err(e) => self
                    .encryptor
                    .recover(Trouble::Failed(e.into()), retry, &mut 0)?,
            }
        };
        // Nothing leaves before the state that produced it is written.
        engine.sync_before_send()?;
        for (queued, outgoing) in batch.iter_mut().zip(encrypted) {
            queued.outgoing = Some(outgoing);
        }
        stamp(&core.timings.send_encrypted);
        if let (Some(journal), Some(last)) = (core.pipeline.journal.get(), places.last()) {
            journal.forget_upto(*last);
        }
        Ok(())
    }

    /// After a stale-epoch refusal, once our group has caught up: encrypts the refused
    /// messages (`todo`) again at the current epoch, in order and in one transaction that
    /// replaces their bytes in the outbox (nothing queued after them is encrypted yet). A
    /// message an earlier opening encrypted has no plaintext here: it fails.
    fn encrypt_again(
        &self,
        batch: &mut [Queued],
        todo: &mut Vec<usize>,
        outcomes: &mut [Option<Result<()>>],
    ) -> Result<()> {
        let core = &self.core;
        let engine = core.shared.engine()?;
        let current = engine.epoch(&core.name)?;
        todo.retain(|&i| {
            let kept = batch[i].payload.is_some();
            if !kept {
                outcomes[i] = Some(Err(unsendable(&batch[i], current)));
            }
            kept
        });
        let places: Vec<i64> = todo.iter().map(|&i| batch[i].place).collect();
        let payloads: Vec<&[u8]> = todo
            .iter()
            .filter_map(|&i| batch[i].payload.as_deref().map(Vec::as_slice))
            .collect();
        let fresh = engine.reencrypt_outbox(&core.name, &places, &payloads)?;
        engine.sync_before_send()?;
        for (&i, outgoing) in todo.iter().zip(fresh) {
            batch[i].outgoing = Some(outgoing);
        }
        Ok(())
    }

    /// Marks what `batch` settled for deletion from the outbox (`owed`) and forgets it in the
    /// journal: everything up to the first message the channel's close left unsent (that
    /// stays for the next opening).
    fn forget_settled(&self, batch: &[Queued], outcomes: &[Result<()>], owed: &mut Option<i64>) {
        let settled = outcomes
            .iter()
            .position(|o| matches!(o, Err(Error::Closed(_))))
            .unwrap_or(outcomes.len());
        let Some(last) = settled.checked_sub(1).and_then(|i| batch.get(i)) else {
            return;
        };
        *owed = Some(last.place);
        if let Some(journal) = self.core.pipeline.journal.get() {
            journal.forget_upto(last.place);
        }
    }

    /// Deletes what the relay settled from the outbox, in a transaction of its own.
    fn delete_settled(&self, owed: &mut Option<i64>) {
        let Some(upto) = owed.take() else { return };
        if let Ok(engine) = self.core.shared.engine() {
            // A failure leaves them to be sent again by the next opening, which the relay's
            // idempotency answers for.
            let _ = engine.outbox_settled(&self.core.name, upto);
        }
    }
}

/// The failure of a message recorded by an earlier opening whose epoch the relay no longer
/// accepts.
fn unsendable(queued: &Queued, current: u64) -> Error {
    Error::refused(
        Code::FailedPrecondition,
        format!(
            "a pipelined message encrypted before the channel was last opened (at epoch {}) \
             cannot be sent: the channel is at epoch {current}, beyond the relay's window of \
             past epochs, and the outbox keeps no plaintext to encrypt it again",
            queued.outgoing.as_ref().map_or(0, |o| o.epoch)
        ),
    )
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
