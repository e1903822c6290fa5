//! Sending's first half, on the callers' threads: concurrent senders queue their payloads and
//! the one that gets the encryption lock encrypts everything queued in one transaction (flat
//! combining), then hands the messages to the publisher in encryption order. Also what a send
//! does after a refusal, shared by blocking and pipelined sends.

use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use tokio::sync::{mpsc, oneshot};

use super::publisher::{Destination, Outbound, Outcome};
use crate::channel::core::{stamp, ChannelCore};
use crate::config::REENCRYPTIONS;
use crate::error::{Error, Result};
use crate::relay::refusal::Refusal;
use crate::relay::retry::Retry;
use crate::sync::lock;
use static_mls::engine::Framed;

/// How a message is framed beyond its payload: its authenticated data (empty for a plain
/// message, a kind byte for request/reply) and its idempotency key (empty: the relay's
/// default).
#[derive(Clone, Default)]
pub(crate) struct Framing {
    pub(crate) aad: &'static [u8],
    pub(crate) key: Vec<u8>,
}

/// A payload waiting to be encrypted.
pub(crate) struct Pending {
    pub(crate) payload: Arc<Vec<u8>>,
    pub(crate) framing: Framing,
    pub(crate) deadline: Instant,
    pub(crate) reply: oneshot::Sender<Outcome>,
}

/// What went wrong with one attempt at sending a message.
pub(crate) enum Trouble {
    /// The relay refused it: certainly not in the log.
    Refused(Refusal),
    /// It could not be encrypted or published.
    Failed(Error),
}

/// A channel's encryption and hand-over to the publisher.
pub(crate) struct Encryptor {
    core: Arc<ChannelCore>,
    /// Payloads waiting for the encryption lock; whoever holds it encrypts them all.
    queue: Mutex<Vec<Pending>>,
    /// Held while encrypting (not while syncing to disk, so the next batch can be encrypted
    /// meanwhile).
    encrypting: Mutex<()>,
    /// Batches are handed to the publisher in the order they were encrypted (receivers
    /// tolerate only a few messages out of order): (next ticket, next ticket to hand over).
    handoff: (Mutex<(u64, u64)>, Condvar),
    outbound: mpsc::UnboundedSender<Vec<Outbound>>,
}

impl Encryptor {
    pub(crate) fn new(
        core: Arc<ChannelCore>,
        outbound: mpsc::UnboundedSender<Vec<Outbound>>,
    ) -> Self {
        Self {
            core,
            queue: Mutex::new(Vec::new()),
            encrypting: Mutex::new(()),
            handoff: (Mutex::new((0, 0)), Condvar::new()),
            outbound,
        }
    }

    fn destination(&self) -> Arc<dyn Destination> {
        Arc::clone(&self.core) as Arc<dyn Destination>
    }

    /// Queues `payload` for encryption, encrypts the queue if nobody else is doing it, and
    /// returns where the outcome of its publishing will come.
    pub(crate) fn encrypt_and_publish(
        &self,
        payload: &Arc<Vec<u8>>,
        framing: &Framing,
        deadline: Instant,
    ) -> oneshot::Receiver<Outcome> {
        let (reply, answer) = oneshot::channel();
        self.encrypt_and_publish_all(vec![Pending {
            payload: Arc::clone(payload),
            framing: framing.clone(),
            deadline,
            reply,
        }]);
        answer
    }

    /// Hands already encrypted messages (that the relay did not answer for) to the publisher
    /// again, as they are: the relay's idempotency answers for a copy it already has.
    pub(crate) fn republish(
        &self,
        messages: Vec<Vec<u8>>,
        key: &[u8],
        deadline: Instant,
    ) -> Vec<oneshot::Receiver<Outcome>> {
        let mut answers = Vec::with_capacity(messages.len());
        let items = messages
            .into_iter()
            .map(|message| {
                let (reply, answer) = oneshot::channel();
                answers.push(answer);
                Outbound {
                    channel: self.destination(),
                    message,
                    key: key.to_vec(),
                    deadline,
                    reply,
                    unit: None,
                }
            })
            .collect();
        // A publisher that is gone drops the replies: the senders see the channel's end.
        let _ = self.outbound.send(items);
        answers
    }

    /// Queues `pending` (kept together, in order) for encryption and encrypts the queue if
    /// nobody else is doing it; each outcome comes to its `reply`.
    pub(crate) fn encrypt_and_publish_all(&self, pending: Vec<Pending>) {
        lock(&self.queue).extend(pending);
        let encrypting = lock(&self.encrypting);
        let batch = std::mem::take(&mut *lock(&self.queue));
        if batch.is_empty() {
            // Another sender encrypted ours along with its own.
            return;
        }
        let core = &self.core;
        let engine = core.shared.engine();
        let encrypted = engine.as_ref().map_err(Clone::clone).and_then(|engine| {
            let items: Vec<Framed<'_>> = batch
                .iter()
                .map(|p| (p.framing.aad, p.payload.as_slice()))
                .collect();
            Ok(engine.encrypt_framed_unsynced(&core.name, &items)?)
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
            let engine = engine.as_ref().map_err(Clone::clone)?;
            engine.sync_before_send()?;
            Ok(messages)
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
                    let mut own = lock(&core.own_messages);
                    for message in &messages {
                        own.remember(message);
                    }
                }
                let items = batch
                    .into_iter()
                    .zip(messages)
                    .map(|(p, message)| Outbound {
                        channel: self.destination(),
                        message,
                        key: p.framing.key,
                        deadline: p.deadline,
                        reply: p.reply,
                        unit: None,
                    })
                    .collect();
                stamp(&core.timings.send_encrypted);
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

    /// Gets ready to send again after `trouble` (on a caller's or the sender's thread): waits
    /// for the epoch a refusal or a pending proposal calls for, or as the retry policy says;
    /// the error that ends the send otherwise. `reencrypted` counts the stale-epoch refusals
    /// of this send.
    pub(crate) fn recover(
        &self,
        trouble: Trouble,
        retry: &mut Retry,
        reencrypted: &mut usize,
    ) -> Result<()> {
        let core = &self.core;
        match trouble {
            Trouble::Failed(Error::Mls(e)) if e.is_pending_proposals() => {
                // A member's proposal (e.g. a leave) is pending: MLS forbids application
                // messages until a commit covers it, which a member makes at once (see the
                // applier). Wait for that epoch, then encrypt again.
                let epoch = core.shared.engine()?.epoch(&core.name)?;
                core.block_on(core.wait_epoch(epoch + 1))?;
                if retry.expired() {
                    return Err(e.into());
                }
                Ok(())
            }
            Trouble::Failed(e) => Err(e),
            Trouble::Refused(Refusal::StaleEpoch { current, .. })
                if *reencrypted < REENCRYPTIONS =>
            {
                // Encrypted at an epoch the relay no longer accepts (the group moved on by
                // more than its window): catch up and encrypt again.
                *reencrypted += 1;
                core.block_on(core.wait_epoch(current))
            }
            Trouble::Refused(refusal) => {
                let wait = core.shared.after(retry, refusal, None, "Publish")?;
                if !wait.is_zero() {
                    // Woken early by the channel's end, which the next attempt reports.
                    core.block_on(async {
                        core.sleep_or_shutdown(wait).await;
                        Ok(())
                    })?;
                }
                core.check_usable()
            }
        }
    }
}
