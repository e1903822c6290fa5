//! The cache budget: what the rings of all channels hold together, in bytes, and what each
//! entry is charged against it; also the clock of the channels' idle times.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Instant;

use super::channel::Channel;
use super::Entry;

/// Bytes each cached entry is charged on top of its message: its ring slot (an `Entry`, 72
/// bytes), the message's own allocation and the budget's queue item (24), rounded up. Bounds
/// the entries count too: 64 MiB holds at most 524,288 entries, however small.
pub(super) const ENTRY_OVERHEAD: usize = 128;

/// What a cached entry costs the budget.
pub(super) fn charge(entry: &Entry) -> usize {
    entry.message.len() + ENTRY_OVERHEAD
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
    order: Mutex<VecDeque<(Weak<Channel>, u64)>>,
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
    pub(super) fn cached(&self, channel: &Arc<Channel>, seq: u64) {
        let mut order = self.order.lock().unwrap_or_else(PoisonError::into_inner);
        order.push_back((Arc::downgrade(channel), seq));
        let most_items = self.limit / ENTRY_OVERHEAD;
        while self.charged.load(Ordering::Acquire) > self.limit || order.len() > most_items {
            let Some((oldest, seq)) = order.pop_front() else {
                break;
            };
            // Gone: it was unloaded, and its ring gave its charge back then.
            if let Some(oldest) = oldest.upgrade() {
                oldest.ring().evict_through(seq);
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
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::super::channel::tests::{cache, channel, seqs};
    use super::*;

    #[test]
    fn the_rings_share_one_budget_the_oldest_entries_go_first() {
        let per = 1000 + ENTRY_OVERHEAD;
        let budget = Arc::new(Cache::new(10 * per));
        let (a, b) = (channel(1, &budget), channel(2, &budget));
        for seq in 1..=6 {
            cache(&a, seq, 1000);
        }
        for seq in 1..=4 {
            cache(&b, seq, 1000);
        }
        assert_eq!(budget.charged.load(Ordering::Acquire), 10 * per);
        // Over the budget: a's oldest go, whichever channel caches.
        cache(&b, 5, 1000);
        cache(&b, 6, 1000);
        assert_eq!(seqs(&a), [3, 4, 5, 6]);
        assert_eq!(seqs(&b), [1, 2, 3, 4, 5, 6]);
        assert_eq!(budget.charged.load(Ordering::Acquire), 10 * per);
        // The ring reaches back to cursor 2 only: older cursors read the store.
        assert!(a.ring_after(1, 10, usize::MAX).is_none());
        let page = a.ring_after(2, 3, usize::MAX).unwrap();
        assert_eq!(page.iter().map(|e| e.seq).collect::<Vec<_>>(), [3, 4, 5]);
        assert!(a.ring_after(6, 10, usize::MAX).is_none());

        // One entry larger than the whole budget leaves nothing cached anywhere.
        cache(&a, 7, 11 * per);
        assert!(seqs(&a).is_empty() && seqs(&b).is_empty());
        assert_eq!(budget.charged.load(Ordering::Acquire), 0);
        assert!(a.ring_after(6, 10, usize::MAX).is_none());

        // An unloaded channel gives its charge back; its queued items are skipped later.
        for seq in 8..=12 {
            cache(&a, seq, 1000);
        }
        cache(&b, 7, 1000);
        drop(a);
        assert_eq!(budget.charged.load(Ordering::Acquire), per);
        assert_eq!(budget.order.lock().unwrap().len(), 6);
        budget.forget_unloaded();
        assert_eq!(budget.order.lock().unwrap().len(), 1);
        for seq in 8..=16 {
            cache(&b, seq, 1000);
        }
        assert_eq!(seqs(&b), (7..=16).collect::<Vec<_>>());
        assert_eq!(budget.charged.load(Ordering::Acquire), 10 * per);
    }

    #[test]
    fn tiny_entries_are_bounded_in_count_too() {
        let budget = Arc::new(Cache::new(100 * ENTRY_OVERHEAD));
        let a = channel(1, &budget);
        for seq in 1..=1000 {
            cache(&a, seq, 0);
        }
        assert_eq!(a.ring().entries.len(), 100);
        assert!(budget.order.lock().unwrap().len() <= 100);
        // No budget: nothing is cached at all.
        let none = Arc::new(Cache::new(0));
        let b = channel(2, &none);
        cache(&b, 1, 10);
        assert!(seqs(&b).is_empty());
        assert_eq!(none.charged.load(Ordering::Acquire), 0);
    }
}
