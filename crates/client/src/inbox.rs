//! A channel's inbox as its readers see it: the hand-out [`Marks`] and the read-ahead
//! ([`Inbox`]).

use std::collections::VecDeque;
use std::path::Path;
use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};
use crate::sync::lock;
use static_mls::engine::Engine;

/// File of the hand-out marks inside the data directory.
const MARKS_FILE: &str = "inbox.marks";
/// Inbox rows read ahead into memory at once.
const INBOX_READ_AHEAD: usize = 1024;
/// Handed-out rows deleted together.
const INBOX_PRUNE: usize = 256;

/// Per channel, the id of the last inbox row handed to the caller, 8 bytes (little endian) at
/// `8 * slot` of `<data_dir>/inbox.marks`.
///
/// Taking a message must never hand it out twice, even after a kill; deleting its row (a
/// SQLite write transaction, ~60 µs) per message was the receiving side's largest cost. A
/// write of 8 bytes to a file (~1 µs) survives a killed process just as well (it is in the
/// OS's page cache once the call returns), so a message is handed out only once its mark is
/// written, and handed-out rows are deleted in bulk later. A power loss may take back the last
/// marks (and the message is handed out again), as it may take back light SQLite commits.
pub(crate) struct Marks {
    file: std::fs::File,
}

impl Marks {
    pub(crate) fn open(data_dir: &Path) -> Result<Self> {
        let path = data_dir.join(MARKS_FILE);
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| Error::Internal(format!("cannot open {}: {e}", path.display())))?;
        Ok(Self { file })
    }

    fn offset(slot: u64) -> u64 {
        slot.saturating_mul(8)
    }

    pub(crate) fn read(&self, slot: u64) -> Result<i64> {
        use std::os::unix::fs::FileExt;
        let mut buf = [0u8; 8];
        match self.file.read_exact_at(&mut buf, Self::offset(slot)) {
            Ok(()) => Ok(i64::from_le_bytes(buf)),
            // Never written: nothing handed out yet.
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(0),
            Err(e) => Err(Error::Internal(format!("cannot read the inbox marks: {e}"))),
        }
    }

    fn write(&self, slot: u64, id: i64) -> Result<()> {
        use std::os::unix::fs::FileExt;
        self.file
            .write_all_at(&id.to_le_bytes(), Self::offset(slot))
            .map_err(|e| Error::Internal(format!("cannot write the inbox marks: {e}")))
    }
}

/// A channel's inbox as its readers see it: rows read ahead, and what was handed out.
pub(crate) struct Inbox {
    pub(crate) slot: u64,
    /// The last row handed out (its mark).
    pub(crate) handed: i64,
    /// The last row read into `ahead`.
    pub(crate) loaded: i64,
    pub(crate) ahead: VecDeque<static_mls::store::InboxMessage>,
    /// Whether `ahead` holds every row stored so far: the applier puts in what it stores (see
    /// `applier::apply_batch`), so a reader finding `ahead` empty need not ask the store.
    pub(crate) complete: bool,
    /// Rows handed out and not yet deleted.
    pub(crate) unpruned: usize,
    /// Appliers of the channel alive (see [`ApplierCount`]): normally one, two while a closed
    /// channel's queue is still referenced when the channel is reopened.
    pub(crate) appliers: usize,
}

/// Counts a channel's applier (its queue on the pool) in its inbox while it lives. Rows it
/// stored are pushed into the read-ahead only while it is the only one: ids follow the order
/// of commits, and with two appliers one could push its row ahead of a row the other
/// committed before.
pub(crate) struct ApplierCount(Arc<Mutex<Inbox>>);

impl ApplierCount {
    pub(crate) fn new(inbox: Arc<Mutex<Inbox>>) -> Self {
        lock(&inbox).appliers += 1;
        Self(inbox)
    }
}

impl Drop for ApplierCount {
    fn drop(&mut self) {
        let mut inbox = lock(&self.0);
        inbox.appliers = inbox.appliers.saturating_sub(1);
    }
}

impl Inbox {
    /// Reads the rows stored after `loaded` into `ahead`, as many as it has room for.
    pub(crate) fn load(&mut self, engine: &Engine, name: &str) -> Result<()> {
        let room = INBOX_READ_AHEAD.saturating_sub(self.ahead.len());
        self.complete = false;
        if room == 0 {
            return Ok(());
        }
        let rows = engine.inbox_after(name, self.loaded, room)?;
        self.complete = rows.len() < room;
        if let Some(last) = rows.last() {
            self.loaded = last.id;
        }
        self.ahead.extend(rows);
        Ok(())
    }

    /// Takes rows the applier has just stored (in id order) straight into `ahead` if it holds
    /// every row stored before them and has room for them; otherwise returns false, and they
    /// are to be read from the store (see [`Inbox::load`]).
    pub(crate) fn push_stored(&mut self, rows: Vec<static_mls::store::InboxMessage>) -> bool {
        let follows = rows.first().is_some_and(|first| first.id > self.loaded);
        if self.appliers != 1
            || !self.complete
            || !follows
            || self.ahead.len() + rows.len() > INBOX_READ_AHEAD
        {
            return false;
        }
        if let Some(last) = rows.last() {
            self.loaded = last.id;
        }
        self.ahead.extend(rows);
        true
    }

    pub(crate) fn take(
        &mut self,
        engine: &Engine,
        marks: &Marks,
        name: &str,
    ) -> Result<Option<static_mls::store::InboxMessage>> {
        if self.ahead.is_empty() && !self.complete {
            self.load(engine, name)?;
        }
        let Some(id) = self.ahead.front().map(|m| m.id) else {
            return Ok(None);
        };
        marks.write(self.slot, id)?;
        self.handed = id;
        self.unpruned += 1;
        if self.unpruned >= INBOX_PRUNE {
            // Best effort: rows left behind are deleted by the next prune.
            if engine.inbox_prune(name, id).is_ok() {
                self.unpruned = 0;
            }
        }
        Ok(self.ahead.pop_front())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use static_mls::engine::{Incoming, LogEntry};

    /// Alice and Bob in one channel, and what Bob's applier stores of Alice's `payloads`
    /// (entries from `first_seq` on), as it hands them to the inbox.
    fn applied_rows(
        alice: &Engine,
        bob: &Engine,
        name: &str,
        first_seq: u64,
        payloads: &[&[u8]],
    ) -> Result<Vec<static_mls::store::InboxMessage>> {
        let messages: Vec<Vec<u8>> = payloads
            .iter()
            .map(|p| alice.encrypt(name, p))
            .collect::<static_mls::Result<_>>()?;
        let entries: Vec<LogEntry<'_>> = (first_seq..)
            .zip(&messages)
            .map(|(seq, m)| LogEntry {
                seq,
                message: m,
                account: Some("account-a"),
            })
            .collect();
        let mut rows = Vec::new();
        for a in bob.process_entries(name, &entries)? {
            if let (
                Ok(Incoming::Application {
                    sender,
                    payload,
                    epoch,
                }),
                Some(id),
            ) = (a.outcome, a.inbox_id)
            {
                rows.push(static_mls::store::InboxMessage {
                    id,
                    seq: a.seq,
                    sender,
                    payload,
                    epoch,
                    account: Some("account-a".to_owned()),
                });
            }
        }
        Ok(rows)
    }

    #[test]
    fn applied_messages_reach_the_read_ahead_as_stored_in_order_once() -> Result<()> {
        let dir = tempfile::tempdir().map_err(|e| Error::Internal(e.to_string()))?;
        let name = "test/inbox/push";
        let alice = Engine::open(dir.path().join("alice"), b"alice")?;
        let bob = Engine::open(dir.path().join("bob"), b"bob")?;
        let marks = Marks::open(&dir.path().join("bob"))?;
        alice.create_group(name)?;
        let added = alice.add_member(name, &bob.generate_key_package()?)?;
        alice.merge_pending_commit(name)?;
        bob.join_group(name, &added.welcome)?;
        let mut inbox = Inbox {
            slot: bob.inbox_slot(name)?,
            handed: 0,
            loaded: 0,
            ahead: VecDeque::new(),
            complete: false,
            unpruned: 0,
            appliers: 1,
        };

        // Not known to hold everything yet: refused, read from the store instead.
        let first = applied_rows(&alice, &bob, name, 2, &[b"one"])?;
        assert!(!inbox.push_stored(first));
        inbox.load(&bob, name)?;
        assert!(inbox.complete);
        // From then on the rows go in as stored: the same rows the store holds.
        let more = applied_rows(&alice, &bob, name, 3, &[b"two", b"three"])?;
        assert_eq!(more, bob.inbox_after(name, inbox.loaded, 10)?);
        assert!(inbox.push_stored(more.clone()));
        // Rows it already has are refused (never handed out twice).
        assert!(!inbox.push_stored(more));
        let mut taken = Vec::new();
        while let Some(m) = inbox.take(&bob, &marks, name)? {
            taken.push(m.payload);
        }
        assert_eq!(taken, [&b"one"[..], b"two", b"three"]);
        assert_eq!(bob.inbox_count_after(name, inbox.handed)?, 0);

        // No room: refused, and the rows come from the store once there is.
        inbox.ahead.extend(
            (0..INBOX_READ_AHEAD).map(|i| static_mls::store::InboxMessage {
                id: 0,
                seq: i as u64,
                sender: Vec::new(),
                payload: Vec::new(),
                epoch: 0,
                account: None,
            }),
        );
        let late = applied_rows(&alice, &bob, name, 5, &[b"four"])?;
        assert!(!inbox.push_stored(late.clone()));
        inbox.ahead.clear();
        // Two appliers (a reopened channel's and its predecessor's): refused.
        inbox.appliers = 2;
        assert!(!inbox.push_stored(late.clone()));
        inbox.appliers = 1;
        assert!(inbox.push_stored(late));
        Ok(())
    }

    #[test]
    fn marks_survive_reopening() -> Result<()> {
        let dir = tempfile::tempdir().map_err(|e| Error::Internal(e.to_string()))?;
        let marks = Marks::open(dir.path())?;
        assert_eq!(marks.read(3)?, 0);
        marks.write(3, 42)?;
        marks.write(0, 7)?;
        drop(marks);
        let marks = Marks::open(dir.path())?;
        assert_eq!((marks.read(0)?, marks.read(1)?, marks.read(3)?), (7, 0, 42));
        Ok(())
    }
}
