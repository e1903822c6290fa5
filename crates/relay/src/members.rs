//! Who may reach a channel: the leaves of its group bound to accounts, over its public group
//! state, as memory keeps them for a loaded channel (docs/design.md §5.2).
//!
//! Access is a lookup in [`Membership::reach`] (a hash map, on every publish and every wake-up
//! of a stream); the group state itself is only read by handshakes and bindings.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use crate::error::{RelayError, Result};
use crate::group::{GroupState, LeafInfo};
use crate::store::StoredGroup;

/// What an accepted commit does to its channel's group: stored with it, applied to memory once
/// it is durable.
pub struct GroupChange {
    /// The epoch the commit starts.
    pub epoch: u64,
    /// The next state, in its stored form.
    pub state: Vec<u8>,
    /// The leaves the commit removes: their bindings go with them.
    pub removed: Vec<u32>,
    /// The next state, parsed (taken by memory once the commit is durable).
    next: Mutex<Option<GroupState>>,
}

impl GroupChange {
    pub fn new(next: GroupState, removed: Vec<u32>) -> Result<GroupChange> {
        let state = next.to_bytes().map_err(|e| {
            eprintln!("relay: internal error: a group state could not be encoded: {e}");
            RelayError::Internal
        })?;
        Ok(GroupChange {
            epoch: next.epoch(),
            state,
            removed,
            next: Mutex::new(Some(next)),
        })
    }

    fn take_next(&self) -> Option<GroupState> {
        self.next
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }
}

impl std::fmt::Debug for GroupChange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupChange")
            .field("epoch", &self.epoch)
            .field("state_bytes", &self.state.len())
            .field("removed", &self.removed)
            .finish()
    }
}

/// How far an account reaches a channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reach {
    /// A leaf of the group is bound to it.
    Member,
    /// It was a member until the commit at this seq removed its last leaf: it may read up to
    /// that commit (to learn of its removal), and nothing else.
    Until(u64),
    /// No access.
    None,
}

/// A channel's group as memory knows it: the state at its epoch and the bound leaves.
pub struct Membership {
    state: Arc<GroupState>,
    bindings: Bindings,
}

/// Leaves bound to accounts.
#[derive(Default)]
struct Bindings {
    by_leaf: HashMap<u32, Arc<str>>,
    /// Bound leaves per account.
    counts: HashMap<Arc<str>, u32>,
    /// Accounts whose last leaf a commit removed (on this relay): that commit's seq.
    departed: HashMap<Arc<str>, u64>,
}

impl Bindings {
    fn reach(&self, account: &str) -> Reach {
        if self.counts.contains_key(account) {
            Reach::Member
        } else if let Some(seq) = self.departed.get(account) {
            Reach::Until(*seq)
        } else {
            Reach::None
        }
    }

    /// Binds `leaf` to `account` (replacing its binding).
    fn bind(&mut self, leaf: u32, account: &str) {
        self.unbind(leaf);
        let account: Arc<str> = Arc::from(account);
        self.departed.remove(&account);
        *self.counts.entry(Arc::clone(&account)).or_insert(0) += 1;
        self.by_leaf.insert(leaf, account);
    }

    /// Drops `leaf`'s binding; returns the account that lost its last leaf with it, if any.
    fn unbind(&mut self, leaf: u32) -> Option<Arc<str>> {
        let account = self.by_leaf.remove(&leaf)?;
        let count = self.counts.get_mut(&account)?;
        *count -= 1;
        if *count == 0 {
            self.counts.remove(&account);
            return Some(account);
        }
        None
    }

    /// `leaf` was removed by the commit at `seq`.
    fn remove(&mut self, leaf: u32, seq: u64) {
        if let Some(account) = self.unbind(leaf) {
            self.departed.insert(account, seq);
        }
    }

    /// See [`Membership::succeed`].
    fn succeed(&mut self, older: &Bindings, seq: Option<u64>) {
        for (account, departed) in &older.departed {
            if !self.counts.contains_key(account) {
                self.departed.insert(Arc::clone(account), *departed);
            }
        }
        let Some(seq) = seq else { return };
        for account in older.counts.keys() {
            if !self.counts.contains_key(account) {
                self.departed.entry(Arc::clone(account)).or_insert(seq);
            }
        }
    }
}

impl Membership {
    /// A new channel's group: nothing bound yet.
    pub fn new(state: GroupState) -> Membership {
        Membership {
            state: Arc::new(state),
            bindings: Bindings::default(),
        }
    }

    /// From the store; Unavailable when the stored state does not parse (never expected).
    pub(crate) fn from_stored(stored: StoredGroup) -> Result<Membership> {
        let state = GroupState::from_bytes(&stored.state).map_err(|e| {
            RelayError::Unavailable(format!(
                "the channel's stored group state is unreadable: {e}"
            ))
        })?;
        let mut bindings = Bindings::default();
        for (leaf, account) in stored.bindings {
            bindings.bind(leaf, &account);
        }
        Ok(Membership {
            state: Arc::new(state),
            bindings,
        })
    }

    pub fn epoch(&self) -> u64 {
        self.state.epoch()
    }

    pub fn state(&self) -> Arc<GroupState> {
        Arc::clone(&self.state)
    }

    pub fn reach(&self, account: &str) -> Reach {
        self.bindings.reach(account)
    }

    /// Binds `leaf` to `account` (replacing its binding).
    pub fn bind(&mut self, leaf: u32, account: &str) {
        self.bindings.bind(leaf, account);
    }

    /// This membership, loaded from the store, replaces `older` (memory's): what this relay
    /// knew of accounts that `older` reached and this one does not bind carries over. Those
    /// departed before stay so; those bound at an older epoch are departed at `seq`, the first
    /// commit after it (commits since, another relay's, removed their last leaf: that one,
    /// unless several came at once). At the same epoch nothing was committed in between: only
    /// departures carry over (as in [`Membership::rebind`]).
    pub fn succeed(&mut self, older: &Membership, seq: Option<u64>) {
        let seq = seq.filter(|_| older.epoch() < self.epoch());
        self.bindings.succeed(&older.bindings, seq);
    }

    /// The bindings as the store has them now (another relay may have bound leaves), keeping
    /// what this relay knows of departed accounts.
    pub fn rebind(&mut self, stored: Vec<(u32, String)>) {
        let departed = std::mem::take(&mut self.bindings.departed);
        self.bindings = Bindings::default();
        for (leaf, account) in stored {
            self.bindings.bind(leaf, &account);
        }
        for (account, seq) in departed {
            if !self.bindings.counts.contains_key(&account) {
                self.bindings.departed.insert(account, seq);
            }
        }
    }

    /// A commit at `seq` carrying `change` is durable: the next state, and the removed leaves'
    /// bindings gone (their accounts, if that was their last leaf, reach up to `seq`).
    pub fn apply(&mut self, change: &GroupChange, seq: u64) -> Result<()> {
        let next = match change.take_next() {
            Some(next) => next,
            // Applied once only; a second time (never expected) re-reads the stored form.
            None => GroupState::from_bytes(&change.state).map_err(|e| {
                RelayError::Unavailable(format!("a group state does not parse: {e}"))
            })?,
        };
        self.state = Arc::new(next);
        for leaf in &change.removed {
            self.bindings.remove(*leaf, seq);
        }
        Ok(())
    }

    /// The current leaves, each with the account bound to it.
    pub fn members(&self) -> Vec<(LeafInfo, Option<Arc<str>>)> {
        self.state
            .members()
            .into_iter()
            .map(|leaf| {
                let account = self.bindings.by_leaf.get(&leaf.leaf_index).cloned();
                (leaf, account)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reach_follows_the_bound_leaves() {
        let mut m = Bindings::default();
        m.bind(0, "a");
        m.bind(1, "b");
        m.bind(2, "b");
        assert_eq!(m.reach("a"), Reach::Member);
        assert_eq!(m.reach("b"), Reach::Member);
        assert_eq!(m.reach("c"), Reach::None);
        // Rebinding leaf 0 to another account takes it from the first.
        m.bind(0, "c");
        assert_eq!(m.reach("a"), Reach::None);
        m.remove(1, 7);
        assert_eq!(m.reach("b"), Reach::Member);
        m.remove(2, 9);
        assert_eq!(m.reach("b"), Reach::Until(9));
        // Bound again (a new leaf of the same account): a member again.
        m.bind(4, "b");
        assert_eq!(m.reach("b"), Reach::Member);
        m.remove(99, 10);
        assert_eq!(m.reach("c"), Reach::Member);
    }

    #[test]
    fn a_newer_group_keeps_who_the_older_one_reached() {
        let mut older = Bindings::default();
        older.bind(0, "a");
        older.bind(1, "b");
        older.bind(2, "c");
        older.remove(2, 5);
        // Loaded from the store after commits elsewhere: b's leaf is gone, a's is not.
        let newer = || {
            let mut newer = Bindings::default();
            newer.bind(0, "a");
            newer
        };
        let mut later = newer();
        later.succeed(&older, Some(8));
        assert_eq!(later.reach("a"), Reach::Member);
        assert_eq!(later.reach("b"), Reach::Until(8));
        assert_eq!(later.reach("c"), Reach::Until(5));
        assert_eq!(later.reach("d"), Reach::None);
        // At the same epoch (no commit in between): b's binding went without one.
        let mut same = newer();
        same.succeed(&older, None);
        assert_eq!(same.reach("b"), Reach::None);
        assert_eq!(same.reach("c"), Reach::Until(5));
        // Memory that already knew gets the same answers when it is replaced again.
        let mut again = newer();
        again.succeed(&later, None);
        assert_eq!(again.reach("b"), Reach::Until(8));
    }
}
