//! Who may reach a channel: the leaves of its group bound to accounts, over its public group
//! state, as memory keeps them for a loaded channel (docs/design.md §5.2).
//!
//! Access is a lookup in [`Membership::reach`] (a hash map, on every publish and every wake-up
//! of a stream); the group state is only needed by handshakes, bindings and rosters, so it is
//! loaded only for those (a channel that is only followed holds its bindings alone).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use crate::error::{RelayError, Result};
use crate::group::{GroupState, LeafInfo};
use crate::store::AuditRow;
use crate::store::{StoredBinding, StoredGroup};

/// What an accepted commit does to its channel's group: stored with it, applied to memory once
/// it is durable.
pub struct GroupChange {
    /// The epoch the commit starts.
    pub epoch: u64,
    /// The next state, in its stored form.
    pub state: Vec<u8>,
    /// The leaves the commit removes: their bindings go with them.
    pub removed: Vec<u32>,
    /// The leaves the commit adds (its Welcome's joiners).
    pub added: Vec<u32>,
    /// The next state, parsed (taken by memory once the commit is durable).
    next: Mutex<Option<GroupState>>,
    /// Its audit rows (`member.added`, `member.removed`), stored with it.
    audit: Vec<AuditRow>,
}

impl GroupChange {
    pub fn new(next: GroupState, removed: Vec<u32>, added: Vec<u32>) -> Result<GroupChange> {
        let state = next.to_bytes().map_err(|e| {
            ::log::error!(target: "static.relay", "internal error: a group state could not be encoded: {e}");
            RelayError::Internal
        })?;
        Ok(GroupChange {
            epoch: next.epoch(),
            state,
            removed,
            added,
            next: Mutex::new(Some(next)),
            audit: Vec::new(),
        })
    }

    /// With the audit rows the store writes with this commit.
    pub(crate) fn with_audit(mut self, audit: Vec<AuditRow>) -> GroupChange {
        self.audit = audit;
        self
    }

    pub(crate) fn audit(&self) -> &[AuditRow] {
        &self.audit
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

/// A channel's group as memory knows it: its epoch, the bound leaves, and the group state at
/// that epoch once something needed it.
pub struct Membership {
    epoch: u64,
    /// Loaded when first needed (see the module's notes).
    state: Option<Arc<GroupState>>,
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
    /// From the store's rows: the current ones bound, the removed ones' accounts departed
    /// (unless bound by another leaf), each up to the last commit that removed one of theirs.
    fn from_stored(stored: Vec<StoredBinding>) -> Bindings {
        let mut bindings = Bindings::default();
        let mut removed = Vec::new();
        for row in stored {
            match row.removed_seq {
                None => bindings.bind(row.leaf, &row.account),
                Some(seq) => removed.push((row.account, seq)),
            }
        }
        for (account, seq) in removed {
            if !bindings.counts.contains_key(account.as_str()) {
                let departed = bindings.departed.entry(Arc::from(account)).or_insert(seq);
                *departed = (*departed).max(seq);
            }
        }
        bindings
    }

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
}

impl Membership {
    /// A new channel's group at `epoch`, nothing bound yet, its state left in the store until
    /// something needs it (a channel that is only created and followed holds no tree;
    /// `bench/channels.py`, 3,000 channels: 5.5 KiB of relay memory per channel with it, 3.4
    /// without).
    pub fn new(epoch: u64) -> Membership {
        Membership {
            epoch,
            state: None,
            bindings: Bindings::default(),
        }
    }

    /// From the store (its state parsed if it was read); Unavailable when the stored state
    /// does not parse (never expected).
    pub(crate) fn from_stored(stored: StoredGroup) -> Result<Membership> {
        let state = stored.state.as_deref().map(parse_state).transpose()?;
        let bindings = Bindings::from_stored(stored.bindings);
        Ok(Membership {
            epoch: stored.epoch,
            state: state.map(Arc::new),
            bindings,
        })
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The group state, if loaded.
    pub fn state(&self) -> Option<Arc<GroupState>> {
        self.state.clone()
    }

    /// The state as the store has it at this epoch (read when first needed).
    pub(crate) fn set_state(&mut self, stored: &[u8]) -> Result<Arc<GroupState>> {
        let state = Arc::new(parse_state(stored)?);
        if state.epoch() == self.epoch {
            self.state = Some(Arc::clone(&state));
        }
        Ok(state)
    }

    pub fn reach(&self, account: &str) -> Reach {
        self.bindings.reach(account)
    }

    /// The account bound to `leaf`, if any.
    pub fn bound(&self, leaf: u32) -> Option<Arc<str>> {
        self.bindings.by_leaf.get(&leaf).cloned()
    }

    /// Binds `leaf` to `account` (replacing its binding).
    pub fn bind(&mut self, leaf: u32, account: &str) {
        self.bindings.bind(leaf, account);
    }

    /// The bindings as the store has them now (another relay may have bound leaves or
    /// committed removals), keeping what this relay knows of departed accounts.
    pub(crate) fn rebind(&mut self, stored: Vec<StoredBinding>) {
        let known = std::mem::take(&mut self.bindings.departed);
        self.bindings = Bindings::from_stored(stored);
        for (account, seq) in known {
            if !self.bindings.counts.contains_key(&account) {
                let departed = self.bindings.departed.entry(account).or_insert(seq);
                *departed = (*departed).max(seq);
            }
        }
    }

    /// A commit at `seq` carrying `change` is durable: the next state, and the removed leaves'
    /// bindings gone (their accounts, if that was their last leaf, reach up to `seq`).
    pub fn apply(&mut self, change: &GroupChange, seq: u64) -> Result<()> {
        let next = match change.take_next() {
            Some(next) => next,
            // Applied once only; a second time (never expected) re-reads the stored form.
            None => parse_state(&change.state)?,
        };
        self.epoch = next.epoch();
        self.state = Some(Arc::new(next));
        for leaf in &change.removed {
            self.bindings.remove(*leaf, seq);
        }
        Ok(())
    }

    /// The current leaves, each with the account bound to it.
    /// (None until the state is loaded.)
    pub fn members(&self) -> Option<Vec<(LeafInfo, Option<Arc<str>>)>> {
        let members = self
            .state
            .as_ref()?
            .members()
            .into_iter()
            .map(|leaf| {
                let account = self.bindings.by_leaf.get(&leaf.leaf_index).cloned();
                (leaf, account)
            })
            .collect();
        Some(members)
    }
}

/// A stored group state, parsed: Unavailable when it does not parse (never expected).
fn parse_state(stored: &[u8]) -> Result<GroupState> {
    GroupState::from_bytes(stored).map_err(|e| {
        RelayError::Unavailable(format!(
            "the channel's stored group state is unreadable: {e}"
        ))
    })
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
    fn the_stores_rows_give_members_and_departures() {
        let row = |leaf, account: &str, removed_seq| StoredBinding {
            leaf,
            account: account.to_owned(),
            removed_seq,
        };
        let m = Bindings::from_stored(vec![
            row(0, "a", None),
            row(1, "b", Some(7)),
            row(2, "b", Some(9)),
            row(3, "a", Some(4)),
            row(4, "c", Some(5)),
            row(5, "c", None),
        ]);
        assert_eq!(m.reach("a"), Reach::Member);
        // Departed at the last commit that removed one of its leaves.
        assert_eq!(m.reach("b"), Reach::Until(9));
        // A removed leaf does not count against a leaf still bound.
        assert_eq!(m.reach("c"), Reach::Member);
        assert_eq!(m.reach("d"), Reach::None);
    }
}
