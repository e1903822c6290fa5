//! The cache budget: what the rings of all channels hold together, in bytes, and what each
//! entry is charged against it; also the clock of the channels' idle times.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Instant;

use super::Entry;

/// Bytes each cached entry is charged on top of its message: its ring slot (an `Entry`, 72
/// bytes), the message's own allocation and the budget's queue item (24), rounded up. Bounds
/// the entries count too: 64 MiB holds at most 524,288 entries, however small.
pub(super) const ENTRY_OVERHEAD: usize = 128;

/// What a cached entry costs the budget.
pub(super) fn charge(entry: &Entry) -> usize {
    entry.message.len() + ENTRY_OVERHEAD
}

/// What holds cached entries (a channel's ring): told to let go of the oldest ones. The budget
/// knows its holders only through this, so that the channel (which charges the budget) and the
/// budget (which evicts from the channel) do not import each other.
pub(super) trait Holder: Send + Sync {
    /// Drops the cached entries up to `seq`, giving their charge back.
    fn evict_through(&self, seq: u64);
}

/// What the rings of all channels hold together, bounded in bytes; and the clock of the
/// channels' idle times.
pub(crate) struct Cache {
    limit: usize,
    /// What the rings' entries are charged now (see [`charge`]).
    pub(super) charged: AtomicUsize,
    /// The cached entries in the order they were cached (the oldest first), at most
    /// `limit / ENTRY_OVERHEAD`. An item whose entry already left its ring (its channel
    /// unloaded, or restarted by another relay's append) is skipped when it comes up.
    order: Mutex<VecDeque<(Weak<dyn Holder>, u64)>>,
    start: Instant,
}

impl Cache {
    pub(super) fn new(limit: usize) -> Cache {
        Cache {
            limit,
            charged: AtomicUsize::new(0),
            order: Mutex::new(VecDeque::new()),
            start: Instant::now(),
        }
    }

    /// Milliseconds since the log opened.
    pub(super) fn now(&self) -> u64 {
        u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    pub(super) fn release(&self, bytes: usize) {
        self.charged.fetch_sub(bytes, Ordering::AcqRel);
    }

    /// Entry `seq` of `channel` was just cached: the oldest entries (of any channel) go until
    /// the rings are within the budget again. On the writer only (it alone caches entries).
    pub(super) fn cached<H: Holder + 'static>(&self, channel: &Arc<H>, seq: u64) {
        let holder: Weak<H> = Arc::downgrade(channel);
        let holder: Weak<dyn Holder> = holder;
        let mut order = self.order.lock().unwrap_or_else(PoisonError::into_inner);
        order.push_back((holder, seq));
        let most_items = self.limit / ENTRY_OVERHEAD;
        while self.charged.load(Ordering::Acquire) > self.limit || order.len() > most_items {
            let Some((oldest, seq)) = order.pop_front() else {
                break;
            };
            // Gone: it was unloaded, and its ring gave its charge back then.
            if let Some(oldest) = oldest.upgrade() {
                oldest.evict_through(seq);
            }
        }
        if order.capacity() > 64 && order.len() < order.capacity() / 4 {
            order.shrink_to_fit();
        }
    }

    /// Forgets the items of unloaded channels: each would otherwise keep its channel's
    /// allocation (a few hundred bytes, though not what it held) until it came up.
    pub(super) fn forget_unloaded(&self) {
        let mut order = self.order.lock().unwrap_or_else(PoisonError::into_inner);
        order.retain(|(channel, _)| channel.strong_count() > 0);
        if order.capacity() > 64 && order.len() < order.capacity() / 4 {
            order.shrink_to_fit();
        }
    }

    /// The items queued for eviction (for the tests).
    #[cfg(test)]
    pub(super) fn queued(&self) -> usize {
        self.order
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }
}
