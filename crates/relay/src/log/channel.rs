//! One loaded channel: its head, epoch, horizon and group as memory knows them, and its ring of
//! recent entries (charged to the shared [`Cache`]).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::watch;

use super::cache::{charge, Cache, Holder};
use super::Entry;
use crate::error::{RelayError, Result};
use crate::members::{Membership, Reach};
use crate::store::{self, ChannelRow};

/// One channel, loaded.
///
/// Head and epoch only move forward: on the writer thread once a commit holding entries of
/// this channel is durable, and (PostgreSQL) when another relay's commit is NOTIFYed. On
/// SQLite they are also the writer's own view between batches.
pub struct Channel {
    pub(super) id: i64,
    pub(super) scope: String,
    pub(super) name: String,
    /// A legacy channel: the one account that reaches it.
    legacy_owner: Option<String>,
    /// Its group as memory knows it (None until loaded; always None for a legacy channel).
    members: Mutex<Option<Membership>>,
    head: AtomicU64,
    epoch: AtomicU64,
    /// The last seq retention pruned (moves forward only; on PostgreSQL, another relay's
    /// pruning is seen when a read finds the log starting later).
    horizon: AtomicU64,
    ring: Mutex<Ring>,
    head_tx: watch::Sender<u64>,
    /// When it was last named, appended to or seen in use (see [`Cache::now`]): how long it
    /// has been idle.
    pub(super) used: AtomicU64,
    cache: Arc<Cache>,
    /// When the publish of the entry [`Channel::head_submitted_seq`] was submitted here
    /// ([`metrics::now_ns`], 0 unknown): what a live delivery's latency is measured from.
    ///
    /// [`metrics::now_ns`]: crate::observe::metrics::now_ns
    pub(super) head_submitted: AtomicU64,
    pub(super) head_submitted_seq: AtomicU64,
}

impl Channel {
    pub(super) fn new(name: &str, row: ChannelRow, cache: &Arc<Cache>) -> Channel {
        Channel {
            id: row.id,
            scope: row.scope,
            name: name.to_owned(),
            legacy_owner: row.legacy_owner,
            members: Mutex::new(None),
            head: AtomicU64::new(row.head_seq),
            epoch: AtomicU64::new(row.epoch),
            horizon: AtomicU64::new(row.horizon),
            ring: Mutex::new(Ring::new(Arc::clone(cache))),
            head_tx: watch::Sender::new(row.head_seq),
            used: AtomicU64::new(cache.now()),
            cache: Arc::clone(cache),
            head_submitted: AtomicU64::new(0),
            head_submitted_seq: AtomicU64::new(0),
        }
    }

    /// Used at `now` (see [`Cache::now`]).
    pub(super) fn touch(&self, now: u64) {
        self.used.fetch_max(now, Ordering::Relaxed);
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The channel's row id in the store.
    pub(crate) fn id(&self) -> i64 {
        self.id
    }

    /// A channel created before membership (docs/design.md §5.2).
    pub fn is_legacy(&self) -> bool {
        self.legacy_owner.is_some()
    }

    pub(super) fn members(&self) -> std::sync::MutexGuard<'_, Option<Membership>> {
        self.members.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// How far `account` reaches this channel as memory knows it; None when memory does not
    /// know (the group not loaded, or loaded at an older epoch than the channel's).
    pub(super) fn reach_in_memory(&self, account: &str) -> Option<Reach> {
        if let Some(owner) = &self.legacy_owner {
            return Some(if owner == account {
                Reach::Member
            } else {
                Reach::None
            });
        }
        let members = self.members();
        let membership = members.as_ref()?;
        (membership.epoch() >= self.epoch()).then(|| membership.reach(account))
    }

    /// The last committed seq (0 for an empty log).
    pub fn head_seq(&self) -> u64 {
        self.head.load(Ordering::Acquire)
    }

    /// The channel's current (committed) epoch.
    /// When the publish of entry `seq` was submitted to this relay ([`metrics::now_ns`]), if
    /// it is the latest this relay appended (not another relay's, nor an older one).
    ///
    /// [`metrics::now_ns`]: crate::observe::metrics::now_ns
    pub fn submitted_ns(&self, seq: u64) -> Option<u64> {
        let ns = self.head_submitted.load(Ordering::Acquire);
        (ns != 0 && self.head_submitted_seq.load(Ordering::Acquire) == seq).then_some(ns)
    }

    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    /// The last seq retention pruned, as this relay knows it (0: none).
    pub fn horizon(&self) -> u64 {
        self.horizon.load(Ordering::Acquire)
    }

    pub(super) fn move_horizon(&self, horizon: u64) {
        self.horizon.fetch_max(horizon, Ordering::AcqRel);
    }

    /// Pruned unless the log after `cursor` is all there (as this relay knows the horizon).
    pub fn check_cursor(&self, cursor: u64) -> Result<()> {
        let horizon = self.horizon();
        if cursor < horizon {
            return Err(self.pruned(horizon, format!("after seq {cursor}")));
        }
        Ok(())
    }

    pub(super) fn pruned(&self, horizon: u64, position: String) -> RelayError {
        RelayError::Pruned {
            channel: self.name.clone(),
            horizon,
            position,
        }
    }

    /// The head seq, changed after every commit that appended to this channel.
    ///
    /// The receiver starts with the current head marked as seen: subscribe BEFORE reading,
    /// then `changed().await` when [`ChannelLog::read_after`] comes back empty, and no entry
    /// committed in between is missed.
    ///
    /// [`ChannelLog::read_after`]: super::ChannelLog::read_after
    pub fn watch_head(&self) -> watch::Receiver<u64> {
        self.head_tx.subscribe()
    }

    /// Move head and epoch forward to a commit's (never back), waking the subscribers when
    /// the head moved.
    pub(super) fn advance(&self, head: u64, epoch: u64) {
        self.move_forward(head, epoch);
        self.wake();
    }

    /// Head and epoch forward, without waking anyone yet (see [`Channel::wake`]).
    pub(super) fn move_forward(&self, head: u64, epoch: u64) {
        // Epoch first: whoever sees the new head sees the epoch that goes with it.
        self.epoch.fetch_max(epoch, Ordering::AcqRel);
        self.head.fetch_max(head, Ordering::AcqRel);
    }

    /// Tells the subscribers the head moved (if it did since they last heard).
    pub(super) fn wake(&self) {
        let head = self.head_seq();
        self.head_tx.send_if_modified(|seen| {
            let moved = head > *seen;
            if moved {
                *seen = head;
            }
            moved
        });
    }

    pub(super) fn ring(&self) -> std::sync::MutexGuard<'_, Ring> {
        self.ring.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(super) fn cache(&self) -> &Cache {
        &self.cache
    }

    /// Up to `limit` ring entries after `cursor`, and no more once `max_bytes` of messages
    /// are reached (see [`ChannelLog::read_page`]); None when the ring does not reach back.
    ///
    /// [`ChannelLog::read_page`]: super::ChannelLog::read_page
    pub(super) fn ring_after(
        &self,
        cursor: u64,
        limit: usize,
        max_bytes: usize,
    ) -> Option<Vec<Entry>> {
        let ring = self.ring();
        let first = ring.entries.front()?.seq;
        let start = usize::try_from(cursor.checked_add(1)?.checked_sub(first)?).ok()?;
        let mut bytes = 0usize;
        let page: Vec<Entry> = ring
            .entries
            .range(start.min(ring.entries.len())..)
            .take(limit)
            .take_while(|entry| {
                let more = bytes < max_bytes;
                bytes = bytes.saturating_add(entry.message.len());
                more
            })
            .cloned()
            .collect();
        (!page.is_empty()).then_some(page)
    }
}

impl Holder for Channel {
    fn evict_through(&self, seq: u64) {
        self.ring().evict_through(seq);
    }
}

impl store::Memory for Channel {
    fn heads(&self) -> (u64, u64) {
        (self.head_seq(), self.epoch())
    }
}

impl std::fmt::Debug for Channel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Channel")
            .field("scope", &self.scope)
            .field("name", &self.name)
            .field("head_seq", &self.head_seq())
            .field("epoch", &self.epoch())
            .finish()
    }
}

/// A channel's recent entries (consecutive seqs), charged to the [`Cache`] they share with
/// every other channel's.
pub(super) struct Ring {
    pub(super) entries: VecDeque<Entry>,
    /// What they are charged (see [`charge`]).
    bytes: usize,
    cache: Arc<Cache>,
}

impl Ring {
    fn new(cache: Arc<Cache>) -> Ring {
        Ring {
            entries: VecDeque::new(),
            bytes: 0,
            cache,
        }
    }

    /// Caches `entry` (the budget is enforced by [`Cache::cached`], afterwards).
    pub(super) fn push(&mut self, entry: Entry) {
        if self
            .entries
            .back()
            .is_some_and(|last| last.seq + 1 != entry.seq)
        {
            // Another relay appended in between (PostgreSQL): start again from here.
            self.evict_through(u64::MAX);
        }
        let charged = charge(&entry);
        self.bytes += charged;
        self.cache.charged.fetch_add(charged, Ordering::AcqRel);
        self.entries.push_back(entry);
    }

    /// Drops the entries up to `seq`, giving back what they were charged.
    pub(super) fn evict_through(&mut self, seq: u64) {
        let mut freed = 0;
        while self.entries.front().is_some_and(|first| first.seq <= seq) {
            if let Some(old) = self.entries.pop_front() {
                freed += charge(&old);
            }
        }
        self.bytes -= freed;
        self.cache.release(freed);
        // A burst of small entries may have grown the ring's buffer far beyond what it holds
        // now: give that back too (amortized: only once it is mostly empty).
        if self.entries.capacity() > 64 && self.entries.len() < self.entries.capacity() / 4 {
            self.entries.shrink_to_fit();
        }
    }
}

impl Drop for Ring {
    /// Unloaded: what its entries were charged goes back to the budget.
    fn drop(&mut self) {
        self.cache.release(self.bytes);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::super::cache::ENTRY_OVERHEAD;
    use super::super::test_entry as entry;
    use super::*;

    fn channel(id: i64, cache: &Arc<Cache>) -> Arc<Channel> {
        let row = ChannelRow::created(id);
        Arc::new(Channel::new(&format!("org/ns/c{id}"), row, cache))
    }

    fn cache(channel: &Arc<Channel>, seq: u64, size: usize) {
        channel.ring().push(entry(seq, size));
        channel.cache().cached(channel, seq);
    }

    fn seqs(channel: &Channel) -> Vec<u64> {
        channel.ring().entries.iter().map(|e| e.seq).collect()
    }

    #[test]
    fn a_ring_page_stops_at_its_bytes() {
        let budget = Arc::new(Cache::new(1024 * 1024));
        let a = channel(1, &budget);
        for seq in 1..=10 {
            cache(&a, seq, 100);
        }
        let page =
            |page: Option<Vec<Entry>>| page.unwrap().iter().map(|e| e.seq).collect::<Vec<_>>();
        // Entries come while the page holds less than the bytes: the one reaching them too.
        assert_eq!(page(a.ring_after(0, 10, 250)), [1, 2, 3]);
        assert_eq!(page(a.ring_after(0, 10, 300)), [1, 2, 3]);
        assert_eq!(page(a.ring_after(4, 2, 1000)), [5, 6]);
        // The first entry always comes.
        assert_eq!(page(a.ring_after(0, 10, 1)), [1]);
    }

    #[test]
    fn another_relays_append_restarts_the_ring() {
        let budget = Arc::new(Cache::new(1024 * 1024));
        let a = channel(1, &budget);
        cache(&a, 1, 10);
        cache(&a, 2, 10);
        cache(&a, 5, 10);
        assert_eq!(seqs(&a), [5]);
        assert_eq!(budget.charged.load(Ordering::Acquire), 10 + ENTRY_OVERHEAD);
    }

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
        assert_eq!(budget.queued(), 6);
        budget.forget_unloaded();
        assert_eq!(budget.queued(), 1);
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
        assert!(budget.queued() <= 100);
        // No budget: nothing is cached at all.
        let none = Arc::new(Cache::new(0));
        let b = channel(2, &none);
        cache(&b, 1, 10);
        assert!(seqs(&b).is_empty());
        assert_eq!(none.charged.load(Ordering::Acquire), 0);
    }
}
