//! The applier thread, the one writer of a channel's group state, and what it skips (our own
//! messages coming back).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::mpsc;

use super::channel::{stamp, Channel, End};
use super::lock;
use super::reader::Received;
use static_mls::engine::{Engine, Incoming};

/// Most entries the applier applies in one transaction.
const BATCH: usize = 512;

/// The relay's content type of application messages.
pub(super) const APPLICATION: u32 = 1;
/// Our own messages remembered for the applier to skip: at most this many, of at most
/// [`OWN_MESSAGE_BYTES`] each.
const OWN_MESSAGES: usize = 4096;
const OWN_MESSAGE_BYTES: usize = 16 * 1024;

/// The application messages we encrypted and that may still come back from the relay (it
/// sends everyone's messages to every subscriber, ours included), by the last 8 bytes of
/// their ciphertext (the end of the AEAD tag: random).
#[derive(Default)]
pub(super) struct OwnMessages {
    by_tag: HashMap<[u8; 8], Vec<u8>>,
}

impl OwnMessages {
    fn key(message: &[u8]) -> Option<[u8; 8]> {
        message
            .len()
            .checked_sub(8)
            .and_then(|start| message.get(start..))
            .and_then(|tail| tail.try_into().ok())
    }

    pub(super) fn remember(&mut self, message: &[u8]) {
        if message.len() > OWN_MESSAGE_BYTES {
            return;
        }
        if self.by_tag.len() >= OWN_MESSAGES {
            // Messages that never came back (refused, or sent while not subscribed): forget
            // them all; this only costs the engine's time.
            self.by_tag.clear();
        }
        if let Some(key) = Self::key(message) {
            self.by_tag.insert(key, message.to_vec());
        }
    }

    /// Whether every entry of `batch` is an application message of ours (byte for byte),
    /// forgetting them if so; otherwise nothing changes.
    pub(super) fn take_all(&mut self, batch: &[(u64, u32, Vec<u8>)]) -> bool {
        let ours = |(_, kind, message): &(u64, u32, Vec<u8>)| {
            *kind == APPLICATION
                && Self::key(message)
                    .and_then(|key| self.by_tag.get(&key))
                    .is_some_and(|m| m == message)
        };
        if self.by_tag.is_empty() || !batch.iter().all(ours) {
            return false;
        }
        for (_, _, message) in batch {
            self.take(message);
        }
        true
    }

    /// Whether `message` is one of ours (byte for byte), forgetting it.
    fn take(&mut self, message: &[u8]) -> bool {
        let Some(key) = Self::key(message) else {
            return false;
        };
        if self.by_tag.get(&key).is_some_and(|m| m == message) {
            self.by_tag.remove(&key);
            true
        } else {
            false
        }
    }
}

/// Counts `.1` batches handed to the applier as applied when dropped (see [`Channel::queued`]).
pub(super) struct Applying<'a>(pub(super) &'a AtomicUsize, pub(super) usize);

impl Drop for Applying<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(self.1, Ordering::AcqRel);
    }
}

/// Applies the log's entries in order, in batches: the one writer of the group's state.
///
/// Runs on a thread of its own rather than as a task handing each batch to tokio's blocking
/// pool: a batch then costs one wake-up (the reader's hand-over) instead of three. It ends when
/// the reader does (the channel's shutdown, or the runtime's).
pub(super) fn applier(channel: Arc<Channel>, mut entries: mpsc::Receiver<Received>) {
    let shutdown = channel.shutdown.subscribe();
    loop {
        let Some(first) = entries.blocking_recv() else {
            return;
        };
        if *shutdown.borrow() {
            return;
        }
        let received_at = first.at;
        let mut batch = first.entries;
        let mut taken = 1;
        while batch.len() < BATCH {
            match entries.try_recv() {
                Ok(more) => {
                    batch.extend(more.entries);
                    taken += 1;
                }
                Err(_) => break,
            }
        }
        // Counted as applied once the batch is (or the applier ends).
        let _applied = Applying(&channel.queued, taken);
        if apply_batch(&channel, batch, received_at) == Applied::ChannelEnded {
            return;
        }
    }
}

/// What [`apply_batch`] leaves behind.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Applied {
    Continue,
    /// The channel ended (we were removed, or the store failed): nothing more is applied.
    ChannelEnded,
}

/// Applies one batch of consecutive entries: the applier's work, also done by the reader
/// itself for a lone application message when the applier is idle (see
/// [`reader`](super::reader::reader)).
pub(super) fn apply_batch(
    channel: &Arc<Channel>,
    mut batch: Vec<(u64, u32, Vec<u8>)>,
    received_at: u64,
) -> Applied {
    let passed = batch.last().map(|&(seq, _, _)| seq);
    {
        // Our own application messages come back from the relay too; applying one changes
        // nothing (the engine recognises and skips it), so those we recognise byte for byte
        // are not even handed to it. The stored cursor may then lag behind our own last
        // messages: after a restart they are applied again, to the same effect.
        let mut own = lock(&channel.own_messages);
        if !own.by_tag.is_empty() {
            batch.retain(|(_, kind, message)| !(*kind == APPLICATION && own.take(message)));
        }
    }
    if batch.is_empty() {
        if let Some(seq) = passed {
            channel
                .progress
                .send_modify(|p| p.applied_seq = p.applied_seq.max(seq));
        }
        return Applied::Continue;
    }
    let name = &channel.name;
    let applied = channel.shared.engine().and_then(|e| {
        let refs: Vec<(u64, &[u8])> = batch.iter().map(|(s, _, m)| (*s, m.as_slice())).collect();
        let applied = e.process_entries(name, &refs)?;
        let epoch = e.epoch(name).ok();
        Ok((applied, epoch))
    });
    let (applied, epoch) = match applied {
        Ok(v) => v,
        Err(e) => {
            channel.end(End::Failed(e));
            return Applied::ChannelEnded;
        }
    };
    let mut proposals = false;
    let mut removed = false;
    let mut last = passed;
    // The messages just stored in the inbox, for its read-ahead.
    let mut stored = Vec::new();
    for a in applied {
        last = last.max(Some(a.seq));
        match a.outcome {
            Ok(Incoming::Application {
                sender, payload, ..
            }) => {
                if let Some(id) = a.inbox_id {
                    stored.push(static_mls::store::InboxMessage {
                        id,
                        seq: a.seq,
                        sender,
                        payload,
                    });
                }
            }
            Ok(Incoming::Proposal { .. }) => proposals = true,
            Ok(Incoming::Removed { .. }) => removed = true,
            Ok(_) => {}
            // Not for us (sent before we joined, or undecryptable): skipped, as RFC 9420
            // members do; the cursor moved past it.
            Err(_) => {}
        }
    }
    channel.progress.send_modify(|p| {
        if let Some(seq) = last {
            p.applied_seq = p.applied_seq.max(seq);
        }
        if let Some(epoch) = epoch {
            p.epoch = epoch;
        }
    });
    if !stored.is_empty() {
        // What was just stored goes into the inbox's read-ahead here, once per batch,
        // rather than being read on the readers' threads, once per wake-up; and as it is
        // (reading it back cost ~50 us a batch, a sixth of applying one message).
        if let Ok(engine) = channel.shared.engine() {
            if let Ok(inbox) = channel.shared.inbox(&engine, &channel.name) {
                let mut inbox = lock(&inbox);
                if !inbox.push_stored(stored) {
                    // On failure the readers read the store themselves.
                    let _ = inbox.load(&engine, &channel.name);
                }
            }
        }
        // Only batches with messages for us: our own messages come back too.
        channel
            .timings
            .received
            .store(received_at, Ordering::Relaxed);
        stamp(&channel.timings.applied);
        channel.notify();
    }
    if removed {
        channel.end(End::Removed);
        return Applied::ChannelEnded;
    }
    if proposals {
        // A member asked to leave: commit it (whoever wins the epoch does it for all).
        let ch = Arc::clone(channel);
        channel.shared.handle.spawn(async move {
            let _ = ch
                .commit(Arc::new(|e: &Engine, name: &str| {
                    Ok(e.commit_pending_proposals(name)?.map(|c| (c, None)))
                }))
                .await;
        });
    }
    Applied::Continue
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_messages_are_recognised_byte_for_byte() {
        let mut own = OwnMessages::default();
        let ours: Vec<u8> = (0..100).collect();
        own.remember(&ours);
        own.remember(b"short");
        let mut same_tag = vec![7u8; 100];
        same_tag[92..].copy_from_slice(&ours[92..]);
        assert!(!own.take(&same_tag));
        assert!(!own.take(b"tiny"));
        assert!(own.take(&ours));
        assert!(!own.take(&ours));
        own.remember(&vec![0; OWN_MESSAGE_BYTES + 1]);
        assert!(own.by_tag.is_empty());
    }

    #[test]
    fn a_batch_is_taken_as_ours_only_if_every_entry_is() {
        let mut own = OwnMessages::default();
        let (a, b) = (vec![1u8; 100], vec![2u8; 100]);
        own.remember(&a);
        own.remember(&b);
        let entry = |m: &Vec<u8>| (1, APPLICATION, m.clone());
        // One stranger (or a commit) in the batch: nothing is forgotten.
        assert!(!own.take_all(&[entry(&a), entry(&vec![3u8; 100])]));
        assert!(!own.take_all(&[entry(&a), (2, APPLICATION + 1, b.clone())]));
        assert_eq!(own.by_tag.len(), 2);
        assert!(own.take_all(&[entry(&a), entry(&b)]));
        assert!(own.by_tag.is_empty());
        assert!(!own.take_all(&[entry(&a)]));
    }

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
