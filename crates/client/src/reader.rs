//! What a channel does with the entries its subscription brings ([`Follower`]): passes over
//! its own messages, applies a lone message itself when that is cheaper, and hands the rest
//! to the appliers, in order. The subscription itself is the client's (`subscriber`).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::applier::{apply_batch, Applied, ApplierQueue, Applying, Received};
use crate::channel_core::{now_ns, ChannelCore};
use crate::entry::{LogItem, APPLICATION};
use crate::error::Error;
use crate::sync::lock;
use crate::transport::pb;
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
