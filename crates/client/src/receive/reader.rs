//! What a channel does with the entries its subscription brings ([`Follower`]): passes over
//! its own messages, applies a lone message itself when that is cheaper, and hands the rest
//! to the appliers, in order. The subscription itself is the client's (`subscriber`).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::applier::{apply_batch, Applied, ApplierQueue, Applying, Received};
use super::entry::{LogItem, APPLICATION};
use crate::channel::core::{now_ns, ChannelCore};
use crate::error::Error;
use crate::relay::transport::pb;
use crate::sync::lock;
use static_mls::store::Cursor;

/// One channel as its subscription sees it: where it is in the log, and where entries go.
pub(crate) struct Follower {
    pub(crate) core: Arc<ChannelCore>,
    applier: Arc<ApplierQueue>,
    /// Where the subscription (re)starts: after the last seq seen, or the epoch we joined at.
    cursor: Cursor,
}

impl Follower {
    pub(crate) fn new(core: Arc<ChannelCore>, applier: Arc<ApplierQueue>, cursor: Cursor) -> Self {
        Self {
            core,
            applier,
            cursor,
        }
    }

    pub(crate) fn cursor(&self) -> Cursor {
        self.cursor
    }

    /// The relay sent something: the subscription is live.
    pub(crate) fn live(&self, head_seq: Option<u64>) {
        self.core
            .progress
            .send_if_modified(|p| !std::mem::replace(&mut p.connected, true));
        if let Some(head) = head_seq {
            self.core.progress.send_if_modified(|p| {
                let changed = p.head_seq != head;
                p.head_seq = head;
                changed
            });
        }
    }

    /// The subscription dropped (it is being made again).
    pub(crate) fn disconnected(&self) {
        self.core.progress.send_modify(|p| p.connected = false);
    }

    /// The relay refused to follow this channel for good: the channel fails, once what the
    /// relay sent before is applied (see [`ApplierQueue::end_after`]).
    pub(crate) fn fail(&self, e: Error) {
        self.applier.end_after(e);
    }

    /// Consecutive entries from the relay. False once the channel has ended.
    pub(crate) async fn entries(&mut self, entries: Vec<pb::Entry>) -> bool {
        let core = &self.core;
        let seen = match self.cursor {
            Cursor::After(seq) => seq,
            Cursor::FromEpoch(_) => 0,
        };
        let batch: Vec<LogItem> = entries
            .into_iter()
            .filter(|entry| entry.seq > seen)
            .map(|entry| LogItem {
                seq: entry.seq,
                kind: entry.content_type,
                message: Vec::from(entry.message),
                account: entry.account,
            })
            .collect();
        let Some(last) = batch.last().map(|item| item.seq) else {
            return true;
        };
        self.cursor = Cursor::After(last);
        // Our own messages coming back (every send of ours does) need no engine: when the
        // applier has applied everything before them, they are passed here, without waking it.
        if core.queued.load(Ordering::Acquire) == 0 && lock(&core.own_messages).take_all(&batch) {
            core.passed(last);
            return true;
        }
        // A lone application message while nothing waits to be applied is applied right here:
        // waking an applier thread costs tens of microseconds on a quiet machine, and the
        // message's reader waits for that too. Only a lone message (one decryption, ~0.1-0.2 ms
        // on this runtime's worker), never a batch or a handshake, and only in sparse traffic
        // (see `Shared::may_apply_inline`); the order holds, as nothing is queued.
        if batch.len() == 1
            && batch[0].kind == APPLICATION
            && core.queued.load(Ordering::Acquire) == 0
            && core.shared.may_apply_inline()
        {
            core.queued.fetch_add(1, Ordering::AcqRel);
            let _applied = Applying(&core.queued, 1);
            let applied = core
                .shared
                .apply_inline(|| apply_batch(core, batch, now_ns()));
            return applied != Applied::ChannelEnded;
        }
        self.applier
            .hand_over(Received {
                entries: batch,
                at: now_ns(),
            })
            .await
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use static_mls::engine::Engine;

    use super::*;
    use crate::channel::core::End;
    use crate::receive::applier::Pool;
    use crate::shared::Shared;
    use crate::sync::read;

    /// The relay's final refusal arrives right behind the entries it sent before (as it does
    /// for a member a commit removed while away, reopening): it must wait for them, so that
    /// the member reads the messages and the removal ends the channel (not the refusal). A
    /// threadless pool holds the entries, so the order is certain, not a race.
    #[test]
    fn a_final_refusal_waits_for_the_entries_before_it() {
        let dirs = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let name = "acct/space/room";
        let alice = Engine::open(dirs.0.path(), b"alice").unwrap();
        let bob = Arc::new(Engine::open(dirs.1.path(), b"bob").unwrap());
        alice.create_group(name).unwrap();
        let added = alice
            .add_member(name, &bob.generate_key_package().unwrap())
            .unwrap();
        alice.merge_pending_commit(name).unwrap();
        bob.join_group(name, &added.welcome).unwrap();
        // Seq 1 was the add; then 3 messages and the commit removing bob (kind 3).
        let items: Vec<LogItem> = [b"one", b"two", b"six"]
            .iter()
            .map(|payload| (APPLICATION, alice.encrypt(name, &payload[..]).unwrap()))
            .chain([(3, alice.remove_member(name, b"bob").unwrap())])
            .zip(2..)
            .map(|((kind, message), seq)| LogItem {
                seq,
                kind,
                message,
                account: String::new(),
            })
            .collect();
        alice.merge_pending_commit(name).unwrap();

        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let shared = Shared::offline(Arc::clone(&bob), dirs.1.path(), &runtime);
        let epoch = bob.epoch(name).unwrap();
        let core = Arc::new(ChannelCore::new(shared, name, 1, epoch));
        let pool = Pool::threadless();
        let queue = ApplierQueue::new(Arc::clone(&core), Arc::clone(&pool)).unwrap();
        let ended = || read(&core.progress, |p| p.ended.clone());

        assert!(runtime.block_on(queue.hand_over(Received {
            entries: items,
            at: now_ns(),
        })));
        // As the subscription hands over the refusal (see `subscriber`).
        Follower::new(Arc::clone(&core), Arc::clone(&queue), Cursor::After(5))
            .fail(Error::Internal("refused: no longer a member".into()));
        // Nothing is applied yet, and the refusal has not overtaken the entries.
        assert!(ended().is_none(), "{:?}", ended());
        pool.stop();
        pool.work();
        assert!(matches!(ended(), Some(End::Removed)), "{:?}", ended());
        assert_eq!(bob.inbox_count_after(name, 0).unwrap(), 3);
        // The group is gone from the engine; the channel still says at which epoch it went.
        assert_eq!(
            read(&core.progress, |p| p.epoch),
            alice.epoch(name).unwrap()
        );
        let roster = lock(&core.removed_roster).clone().unwrap();
        assert_eq!(roster, alice.members(name).unwrap());
        assert!(roster.iter().all(|m| m.identity != b"bob"));
    }
}
