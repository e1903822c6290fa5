//! A channel's inbox as its readers see it: the hand-out [`Marks`], the read-ahead
//! ([`Inbox`]) and what a reader takes from it ([`Message`]).

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};
use crate::sync::lock;
use static_mls::engine::Engine;

/// A message another member sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub payload: Vec<u8>,
    /// The sender's identity, as MLS authenticated it (its leaf's credential).
    pub sender: Vec<u8>,
    /// The account that published it, as the relay attests it ("" for an anonymous caller);
    /// None when unknown (received from a relay of an older release).
    pub account: Option<String>,
    /// Its place in the channel's log.
    pub seq: u64,
    /// The epoch it was sent in.
    pub epoch: u64,
}

impl From<static_mls::store::InboxMessage> for Message {
    fn from(m: static_mls::store::InboxMessage) -> Self {
        Self {
            payload: m.payload,
            sender: m.sender,
            account: m.account,
            seq: m.seq,
            epoch: m.epoch,
        }
    }
}

/// File of the hand-out marks inside the data directory.
const MARKS_FILE: &str = "inbox.marks";
/// Inbox rows read ahead into memory at once.
const INBOX_READ_AHEAD: usize = 1024;
/// Handed-out rows deleted together.
const INBOX_PRUNE: usize = 256;

/// Per channel, the id of the last inbox row handed to the caller, in `<data_dir>/inbox.marks`.
///
/// Taking a message must never hand it out twice, even after a kill; deleting its row (a
/// SQLite write transaction, ~60 µs) per message was the receiving side's largest cost. A
/// write of 16 bytes to a file (~1 µs) survives a killed process just as well (it is in the
/// OS's page cache once the call returns), so a message is handed out only once its mark is
/// written, and handed-out rows are deleted in bulk later. A power loss may take back the last
/// marks (and the message is handed out again), as it may take back light SQLite commits.
///
/// A damaged or lost file must not hand out again what was read (or skip what was not), so
/// the file is checked, and refused with `runtime error:` naming it: it begins with
/// [`MARKS_MAGIC`] and a random id of its own, which the store records; each channel's slot
/// (at `HEADER + 16 * slot`) holds the row id and a checksum of (file id, slot, row id), and
/// gets its first mark before the store records the slot (see
/// [`Engine::inbox_slot`](static_mls::engine::Engine::inbox_slot)). So a missing file, a
/// file of another directory, one cut short or a damaged mark is told from a new channel.
/// The file of the previous release (8 bytes per slot, no header; nothing recorded in the
/// store) is converted once.
pub(crate) struct Marks {
    file: std::fs::File,
    path: PathBuf,
    file_id: [u8; FILE_ID_LEN],
}

/// The file's first bytes, then its id.
const MARKS_MAGIC: &[u8; 8] = b"STMARKS2";
const FILE_ID_LEN: usize = 16;
const HEADER: u64 = 32;
/// A slot: the row id and its checksum, little endian.
const SLOT: u64 = 16;

/// FNV-1a (64 bits): a fixed checksum of the slot (the standard library's hasher may change
/// between Rust releases, and a file outlives them).
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in parts.iter().flat_map(|p| p.iter()) {
        hash ^= u64::from(*byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    hash
}

fn damaged(path: &Path, what: &str) -> Error {
    Error::Internal(format!(
        "{} is damaged: {what}; without it, messages already handed out cannot be told from \
         unread ones. Restore it together with mls.sqlite3 from a backup",
        path.display()
    ))
}

fn io_error(path: &Path, what: &str, e: &std::io::Error) -> Error {
    Error::Internal(format!("cannot {what} {}: {e}", path.display()))
}

/// A new file id: unique, not secret (RandomState is seeded randomly per process).
fn new_file_id() -> [u8; FILE_ID_LEN] {
    use std::hash::{BuildHasher, Hasher};
    let mut id = [0u8; FILE_ID_LEN];
    for chunk in id.chunks_mut(8) {
        let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
        hasher.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
        );
        chunk.copy_from_slice(&hasher.finish().to_le_bytes()[..chunk.len()]);
    }
    id
}

impl Marks {
    /// Opens the file of `engine`'s data directory, checked against what the store recorded
    /// (see [`Marks`]); creates it for a new directory, converts the previous release's.
    pub(crate) fn open(data_dir: &Path, engine: &Engine) -> Result<Self> {
        use std::os::unix::fs::FileExt;
        let path = data_dir.join(MARKS_FILE);
        let (slots, recorded) = engine.inbox_marks()?;
        let file = match std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
        {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                // The previous release made the file before any slot.
                if recorded.is_some() || slots > 0 {
                    return Err(damaged(&path, "it is missing"));
                }
                return Self::create(data_dir, engine, &[]);
            }
            Err(e) => return Err(io_error(&path, "open", &e)),
        };
        let mut header = [0u8; HEADER as usize];
        let len = file
            .metadata()
            .map_err(|e| io_error(&path, "read", &e))?
            .len();
        let whole = file.read_exact_at(&mut header, 0).is_ok();
        if !whole || &header[..8] != MARKS_MAGIC {
            if recorded.is_some() {
                return Err(damaged(&path, "its header is not that of a marks file"));
            }
            // The previous release's file: 8 bytes per slot, a slot never written reads 0.
            let mut old = Vec::new();
            for slot in 0..slots {
                let mut id = [0u8; 8];
                old.push(match file.read_exact_at(&mut id, slot * 8) {
                    Ok(()) => i64::from_le_bytes(id),
                    Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => 0,
                    Err(e) => return Err(io_error(&path, "read", &e)),
                });
            }
            return Self::create(data_dir, engine, &old);
        }
        let mut file_id = [0u8; FILE_ID_LEN];
        file_id.copy_from_slice(&header[8..8 + FILE_ID_LEN]);
        match recorded {
            Some(id) if id != file_id => {
                return Err(damaged(
                    &path,
                    "it is not the file of this directory's mls.sqlite3 (another id)",
                ))
            }
            Some(_) => {}
            // Made, and the process ended before the store recorded it.
            None => engine.record_inbox_marks(&file_id)?,
        }
        if len < HEADER + slots * SLOT {
            return Err(damaged(
                &path,
                &format!("it was cut short ({len} bytes for {slots} channels' marks)"),
            ));
        }
        if let Ok(perms) = file.metadata().map(|m| m.permissions()) {
            use std::os::unix::fs::PermissionsExt;
            if perms.mode() & 0o777 != static_mls::store::FILE_MODE {
                file.set_permissions(std::fs::Permissions::from_mode(
                    static_mls::store::FILE_MODE,
                ))
                .map_err(|e| io_error(&path, "set the mode of", &e))?;
            }
        }
        Ok(Self {
            file,
            path,
            file_id,
        })
    }

    /// Writes a new file holding `marks` (slot by slot), synced, in place of any other (a
    /// crash leaves the old file or the new one), and records its id in the store.
    fn create(data_dir: &Path, engine: &Engine, marks: &[i64]) -> Result<Self> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let path = data_dir.join(MARKS_FILE);
        let temporary = data_dir.join(format!("{MARKS_FILE}.tmp"));
        let file_id = new_file_id();
        let mut bytes = Vec::with_capacity(HEADER as usize + marks.len() * SLOT as usize);
        bytes.extend_from_slice(MARKS_MAGIC);
        bytes.extend_from_slice(&file_id);
        bytes.resize(HEADER as usize, 0);
        for (slot, id) in (0u64..).zip(marks) {
            bytes.extend_from_slice(&Self::slot_bytes(&file_id, slot, *id));
        }
        let written = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(static_mls::store::FILE_MODE)
            .open(&temporary)
            .and_then(|mut file| {
                file.write_all(&bytes)?;
                file.sync_all()
            })
            .and_then(|()| std::fs::rename(&temporary, &path))
            .and_then(|()| std::fs::File::open(data_dir)?.sync_all());
        written.map_err(|e| io_error(&path, "write", &e))?;
        engine.record_inbox_marks(&file_id)?;
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| io_error(&path, "open", &e))?;
        Ok(Self {
            file,
            path,
            file_id,
        })
    }

    fn offset(slot: u64) -> u64 {
        slot.saturating_mul(SLOT).saturating_add(HEADER)
    }

    fn slot_bytes(file_id: &[u8; FILE_ID_LEN], slot: u64, id: i64) -> [u8; SLOT as usize] {
        // Never 0: a slot of zeros (a hole, a zeroed block) is no mark.
        let check = fnv1a(&[file_id, &slot.to_le_bytes(), &id.to_le_bytes()]) | 1;
        let mut bytes = [0u8; SLOT as usize];
        bytes[..8].copy_from_slice(&id.to_le_bytes());
        bytes[8..].copy_from_slice(&check.to_le_bytes());
        bytes
    }

    pub(crate) fn read(&self, slot: u64) -> Result<i64> {
        use std::os::unix::fs::FileExt;
        let mut buf = [0u8; SLOT as usize];
        match self.file.read_exact_at(&mut buf, Self::offset(slot)) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                return Err(damaged(
                    &self.path,
                    &format!("it was cut short (no mark in slot {slot})"),
                ))
            }
            Err(e) => return Err(io_error(&self.path, "read", &e)),
        }
        let mut id = [0u8; 8];
        id.copy_from_slice(&buf[..8]);
        let id = i64::from_le_bytes(id);
        if Self::slot_bytes(&self.file_id, slot, id) != buf {
            return Err(damaged(
                &self.path,
                &format!("the mark in slot {slot} does not match its checksum"),
            ));
        }
        Ok(id)
    }

    pub(crate) fn write(&self, slot: u64, id: i64) -> Result<()> {
        self.write_at(slot, id)
            .map_err(|e| io_error(&self.path, "write", &e))
    }

    /// The first mark of a new slot (nothing handed out), written before the store records the
    /// slot (see [`Engine::inbox_slot`]).
    pub(crate) fn init(&self, slot: u64) -> Result<(), static_mls::store::StoreError> {
        self.write_at(slot, 0)
            .map_err(|source| static_mls::store::StoreError::Io {
                path: self.path.clone(),
                source,
            })
    }

    fn write_at(&self, slot: u64, id: i64) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt;
        self.file.write_all_at(
            &Self::slot_bytes(&self.file_id, slot, id),
            Self::offset(slot),
        )
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
        let marks = Marks::open(&dir.path().join("bob"), &bob)?;
        alice.create_group(name)?;
        let added = alice.add_member(name, &bob.generate_key_package()?)?;
        alice.merge_pending_commit(name)?;
        bob.join_group(name, &added.welcome)?;
        let mut inbox = Inbox {
            slot: bob.inbox_slot(name, |slot| marks.init(slot))?,
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

    /// The file's bytes, as a test damages them.
    fn marks_bytes(dir: &Path) -> Vec<u8> {
        std::fs::read(dir.join(MARKS_FILE)).unwrap_or_default()
    }

    fn expect_damaged(result: Result<impl std::fmt::Debug>, what: &str) {
        match result {
            Err(Error::Internal(message)) => {
                assert!(message.contains("inbox.marks is damaged"), "{message}");
                assert!(message.contains(what), "{message}");
            }
            other => panic!("expected damage ({what}), got {other:?}"),
        }
    }

    #[test]
    fn marks_survive_reopening_and_damage_is_refused() -> Result<()> {
        let dir = tempfile::tempdir().map_err(|e| Error::Internal(e.to_string()))?;
        let path = dir.path();
        let engine = Engine::open(path, b"alice")?;
        let marks = Marks::open(path, &engine)?;
        let slots: Vec<u64> = (0..4)
            .map(|i| engine.inbox_slot(&format!("a/b/c{i}"), |slot| marks.init(slot)))
            .collect::<static_mls::Result<_>>()?;
        assert_eq!(slots, [0, 1, 2, 3]);
        assert_eq!(marks.read(3)?, 0);
        marks.write(3, 42)?;
        marks.write(0, 7)?;
        drop(marks);
        let marks = Marks::open(path, &engine)?;
        assert_eq!((marks.read(0)?, marks.read(1)?, marks.read(3)?), (7, 0, 42));
        drop(marks);
        let good = marks_bytes(path);

        // A flipped bit in a mark.
        let mut flipped = good.clone();
        flipped[(HEADER + 3 * SLOT) as usize] ^= 4;
        std::fs::write(path.join(MARKS_FILE), &flipped)
            .map_err(|e| Error::Internal(e.to_string()))?;
        expect_damaged(Marks::open(path, &engine)?.read(3), "slot 3");
        // A zeroed mark (never a valid one).
        let mut zeroed = good.clone();
        zeroed[(HEADER + SLOT) as usize..(HEADER + 2 * SLOT) as usize].fill(0);
        std::fs::write(path.join(MARKS_FILE), &zeroed)
            .map_err(|e| Error::Internal(e.to_string()))?;
        expect_damaged(Marks::open(path, &engine)?.read(1), "slot 1");
        // Cut short, emptied, its header damaged, deleted, another directory's.
        for (bytes, what) in [
            (good[..good.len() - 1].to_vec(), "cut short"),
            (Vec::new(), "header"),
            ([b"X".as_slice(), &good[1..]].concat(), "header"),
        ] {
            std::fs::write(path.join(MARKS_FILE), &bytes)
                .map_err(|e| Error::Internal(e.to_string()))?;
            expect_damaged(Marks::open(path, &engine).map(|_| ()), what);
        }
        std::fs::remove_file(path.join(MARKS_FILE)).map_err(|e| Error::Internal(e.to_string()))?;
        expect_damaged(Marks::open(path, &engine).map(|_| ()), "missing");
        let other = tempfile::tempdir().map_err(|e| Error::Internal(e.to_string()))?;
        let stranger = Engine::open(other.path(), b"bob")?;
        drop(Marks::open(other.path(), &stranger)?);
        std::fs::copy(other.path().join(MARKS_FILE), path.join(MARKS_FILE))
            .map_err(|e| Error::Internal(e.to_string()))?;
        expect_damaged(Marks::open(path, &engine).map(|_| ()), "another id");
        // Restored: as before.
        std::fs::write(path.join(MARKS_FILE), &good).map_err(|e| Error::Internal(e.to_string()))?;
        let marks = Marks::open(path, &engine)?;
        assert_eq!((marks.read(0)?, marks.read(3)?), (7, 42));
        Ok(())
    }

    #[test]
    fn the_previous_release_file_is_converted() -> Result<()> {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().map_err(|e| Error::Internal(e.to_string()))?;
        let path = dir.path();
        let engine = Engine::open(path, b"alice")?;
        // As the previous release left it: slots recorded, no file id, 8 bytes per slot (a
        // slot it never wrote is past the end), the umask's mode.
        for i in 0..3 {
            engine.inbox_slot(&format!("a/b/c{i}"), |_| Ok(()))?;
        }
        let old: Vec<u8> = [5i64, 9].iter().flat_map(|id| id.to_le_bytes()).collect();
        std::fs::write(path.join(MARKS_FILE), &old).map_err(|e| Error::Internal(e.to_string()))?;
        std::fs::set_permissions(
            path.join(MARKS_FILE),
            std::fs::Permissions::from_mode(0o644),
        )
        .map_err(|e| Error::Internal(e.to_string()))?;
        let marks = Marks::open(path, &engine)?;
        assert_eq!((marks.read(0)?, marks.read(1)?, marks.read(2)?), (5, 9, 0));
        let mode = std::fs::metadata(path.join(MARKS_FILE))
            .map_err(|e| Error::Internal(e.to_string()))?
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        // Converted for good: from now on a missing or damaged file is refused.
        drop(marks);
        assert_eq!(&marks_bytes(path)[..8], MARKS_MAGIC);
        std::fs::write(path.join(MARKS_FILE), &old).map_err(|e| Error::Internal(e.to_string()))?;
        expect_damaged(Marks::open(path, &engine).map(|_| ()), "header");
        Ok(())
    }
}
