//! The SQLite log's idempotency keys in generations: which generation a new entry's key goes
//! to, and in-memory Bloom filters that say which older generations may hold a key.
//!
//! Keys are SHA-256 digests (or client-given), so one unique index over every key sends each
//! publish to a random leaf of an index as large as the log: once it outgrew SQLite's page
//! cache each publish read a leaf and wrote it back to the WAL, and the relay's CPU per
//! pipelined publish went from 13 us at an empty log to 31.5 us at 400k entries (bench/relay.py
//! --log-growth, median of 3). The index leads with the generation instead (migration 0005):
//! [`GENERATION`] consecutive entries of the store share one, so a publish only touches the
//! current generation's part of the index, which stays small and cached. The unique index
//! still refuses a retry of the current generation by itself; a key of an older one is found
//! through its filter (16 bits a key: about 1 in 2,000 new keys costs one exact look-up in
//! one generation).
//!
//! Memory: 2 bytes per entry in the store; a publish checks one filter per [`GENERATION`]
//! entries (24 at 400k entries, a few hundred nanoseconds); the filters are built at open
//! from the index (one scan of it).

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;

/// Entries per generation: its part of the index (about 1 MiB) stays in SQLite's page cache
/// (2 MiB by default) beside the log's own pages.
pub(crate) const GENERATION: u64 = 16_384;
/// A publish checks every older generation's filter, so a false positive must be rare: at 10
/// bits a key (1%) the 24 generations of 400k entries sent a quarter of all publishes to an
/// uncached leaf of the index (relay CPU per publish 16 us against 12.5 at an empty log);
/// 16 bits and 11 probes make it about 0.05%.
const BITS_PER_KEY: u64 = 16;
const PROBES: u64 = 11;

/// A Bloom filter over the keys' hashes.
struct Bloom {
    bits: Vec<u64>,
}

impl Bloom {
    fn with_capacity(keys: u64) -> Bloom {
        let words = (keys.max(1) * BITS_PER_KEY).div_ceil(64);
        Bloom {
            bits: vec![0; usize::try_from(words).unwrap_or(usize::MAX)],
        }
    }

    /// The bits of `hash` in a filter of `words` words (double hashing: h1 + i * h2, each
    /// mapped onto the filter by a multiplication rather than a division).
    fn positions(words: usize, hash: u64) -> impl Iterator<Item = (usize, u64)> {
        let len = (words as u128) * 64;
        let (h1, h2) = (hash, hash.rotate_left(32) | 1);
        (0..PROBES).map(move |i| {
            let bit = ((u128::from(h1.wrapping_add(i.wrapping_mul(h2))) * len) >> 64) as u64;
            ((bit / 64) as usize, 1 << (bit % 64))
        })
    }

    fn insert(&mut self, hash: u64) {
        for (word, mask) in Self::positions(self.bits.len(), hash) {
            self.bits[word] |= mask;
        }
    }

    fn may_contain(&self, hash: u64) -> bool {
        Self::positions(self.bits.len(), hash).all(|(word, mask)| self.bits[word] & mask != 0)
    }
}

/// The generations of the log's keys: the current one (the unique index covers it) and a
/// filter for each older one.
pub(crate) struct Generations {
    /// Keyed per process: a sender cannot choose keys that all fall into the filters.
    hasher: RandomState,
    older: Vec<(u64, Bloom)>,
    current: u64,
    count: u64,
    filter: Bloom,
}

impl Generations {
    /// No keys yet: generation 0.
    pub(crate) fn new() -> Generations {
        Generations {
            hasher: RandomState::new(),
            older: Vec::new(),
            current: 0,
            count: 0,
            filter: Bloom::with_capacity(GENERATION),
        }
    }

    fn hash(&self, channel_id: i64, key: &[u8]) -> u64 {
        self.hasher.hash_one((channel_id, key))
    }

    /// The generation new entries go to.
    pub(crate) fn current(&self) -> u64 {
        self.current
    }

    /// At open, in generation order: the stored generation `generation`, of `count` keys,
    /// becomes the current one; its keys follow through [`Generations::appended`], then
    /// [`Generations::roll_if_full`].
    pub(crate) fn load(&mut self, generation: u64, count: u64) {
        let filter = Bloom::with_capacity(count.max(GENERATION));
        let previous = std::mem::replace(&mut self.filter, filter);
        if self.count > 0 {
            self.older.push((self.current, previous));
        }
        self.current = generation;
        self.count = 0;
    }

    /// Records a key appended to the current generation (after its commit).
    pub(crate) fn appended(&mut self, channel_id: i64, key: &[u8]) {
        let hash = self.hash(channel_id, key);
        self.filter.insert(hash);
        self.count += 1;
    }

    /// Starts the next generation once the current one is full (between group commits).
    pub(crate) fn roll_if_full(&mut self) {
        if self.count >= GENERATION {
            let full = std::mem::replace(&mut self.filter, Bloom::with_capacity(GENERATION));
            self.older.push((self.current, full));
            self.current += 1;
            self.count = 0;
        }
    }

    /// The older generations that may hold `key` (newest first); the current one is not
    /// among them.
    pub(crate) fn older_candidates(
        &self,
        channel_id: i64,
        key: &[u8],
    ) -> impl Iterator<Item = u64> + '_ {
        let hash = self.hash(channel_id, key);
        self.older
            .iter()
            .rev()
            .filter(move |(_, filter)| filter.may_contain(hash))
            .map(|(generation, _)| *generation)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_is_found_in_its_generation_and_rarely_elsewhere() {
        let mut generations = Generations::new();
        let key = |i: u64| i.to_be_bytes().to_vec();
        for i in 0..3 * GENERATION {
            generations.appended(1, &key(i));
            generations.roll_if_full();
        }
        assert_eq!(generations.current(), 3);
        for i in (0..3 * GENERATION).step_by(97) {
            assert!(generations
                .older_candidates(1, &key(i))
                .any(|g| g == i / GENERATION));
        }
        // Another channel's key, and keys never logged: rarely in any filter.
        let false_positives: usize = (3 * GENERATION..4 * GENERATION)
            .map(|i| generations.older_candidates(1, &key(i)).count())
            .sum::<usize>()
            + generations.older_candidates(2, &key(0)).count();
        assert!(
            false_positives < (3 * GENERATION / 40) as usize,
            "{false_positives}"
        );
    }

    #[test]
    fn loading_resumes_a_generation_that_is_not_full() {
        let mut generations = Generations::new();
        let key = |i: u64| i.to_be_bytes().to_vec();
        generations.load(0, 40_000);
        (0..40_000).for_each(|i| generations.appended(1, &key(i)));
        generations.roll_if_full();
        assert_eq!(generations.current(), 1);
        generations.load(1, 3);
        (40_000..40_003).for_each(|i| generations.appended(1, &key(i)));
        generations.roll_if_full();
        assert_eq!(generations.current(), 1);
        assert_eq!(
            generations.older_candidates(1, &key(7)).collect::<Vec<_>>(),
            [0]
        );
        // The current generation's keys are the unique index's to find.
        assert_eq!(generations.older_candidates(1, &key(40_001)).count(), 0);
        generations.appended(1, &key(50_000));
        assert_eq!(generations.current(), 1);
    }
}
