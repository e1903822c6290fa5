//! A channel's journal of pipelined payloads: what `send_pipelined` accepted and the sender has
//! not yet encrypted into the outbox (`static_mls::outbox`), appended with one `write` per call
//! so that a killed process loses none of it.
//!
//! Recording each call in the engine's database instead (encrypting on the caller's thread,
//! one SQLite transaction per message) tripled the caller's CPU per pipelined message (144 us
//! against 51, `bench/e2e.py`); a `write` of the payload costs a few microseconds, and the
//! sender still encrypts in batches of up to 1,024 in one transaction, recording the
//! ciphertexts in the outbox in that transaction. A journal's records are then obsolete: a
//! segment (a file of at most [`SEGMENT_BYTES`] of records) is deleted once everything in it is
//! encrypted, usually well within a second, before the kernel writes it back to the disk.
//!
//! Files: `<data_dir>/outbox/<channel name, '/' as '+'>.<segment>`; a record is
//! `len: u32 LE | place: u64 LE | payload` (`len` counts place and payload). A record cut short
//! by a kill (only the last one can be: appends are serialised) is ignored: its call had not
//! returned.

use std::fs::{File, OpenOptions};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::error::{Error, Result};
use crate::sync::lock;

/// The journal's directory inside the data directory.
const DIR: &str = "outbox";
/// A segment's size past which the next record starts a new one: what the sender deletes at
/// once when it has encrypted everything in it.
const SEGMENT_BYTES: u64 = 1024 * 1024;
/// A record's header: `len` and `place`.
const HEADER: usize = 12;

fn io(what: &str, path: &Path, e: std::io::Error) -> Error {
    Error::Internal(format!("{what} {}: {e}", path.display()))
}

/// A journaled payload: its place and its bytes.
pub(crate) type Record = (i64, Vec<u8>);

/// One channel's journal (see the module docs).
pub(crate) struct Journal {
    dir: PathBuf,
    stem: String,
    segments: Mutex<Segments>,
}

struct Segments {
    /// Segments no longer written to, with the last place each holds, oldest first.
    older: Vec<(PathBuf, i64)>,
    /// The one written to, its size and the last place it holds (0: none).
    current: Option<(PathBuf, File, u64, i64)>,
    next: u64,
}

impl Journal {
    /// Opens the channel's journal under `data_dir`: the records earlier openings left, in
    /// order, as (place, payload).
    pub(crate) fn open(data_dir: &Path, channel: &str) -> Result<(Journal, Vec<Record>)> {
        let dir = data_dir.join(DIR);
        let stem = channel.replace('/', "+");
        let mut found: Vec<(u64, PathBuf)> = Vec::new();
        match std::fs::read_dir(&dir) {
            Ok(entries) => {
                for entry in entries.flatten() {
                    let name = entry.file_name();
                    let Some(segment) = name
                        .to_str()
                        .and_then(|n| n.strip_prefix(stem.as_str()))
                        .and_then(|rest| rest.strip_prefix('.'))
                        .and_then(|n| n.parse::<u64>().ok())
                    else {
                        continue;
                    };
                    found.push((segment, entry.path()));
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io("cannot read the outbox journal", &dir, e)),
        }
        found.sort();
        let mut records = Vec::new();
        let mut older = Vec::new();
        for (_, path) in &found {
            let bytes =
                std::fs::read(path).map_err(|e| io("cannot read the outbox journal", path, e))?;
            let before = records.len();
            parse(&bytes, &mut records);
            let last = records[before..].last().map_or(0, |r: &Record| r.0);
            older.push((path.clone(), last));
        }
        let next = found.last().map_or(0, |(segment, _)| segment + 1);
        let journal = Journal {
            dir,
            stem,
            segments: Mutex::new(Segments {
                older,
                current: None,
                next,
            }),
        };
        Ok((journal, records))
    }

    /// Appends `payload` at `place`, with one `write`: in the OS's hands when this returns.
    pub(crate) fn append(&self, place: i64, payload: &[u8]) -> Result<()> {
        let len = u32::try_from(8 + payload.len())
            .map_err(|_| Error::Invalid("payload too large for the outbox journal".into()))?;
        let mut record = Vec::with_capacity(HEADER + payload.len());
        record.extend_from_slice(&len.to_le_bytes());
        record.extend_from_slice(&place.to_le_bytes());
        record.extend_from_slice(payload);
        let mut segments = lock(&self.segments);
        if segments
            .current
            .as_ref()
            .is_some_and(|(_, _, size, _)| *size >= SEGMENT_BYTES)
        {
            if let Some((path, _, _, last)) = segments.current.take() {
                segments.older.push((path, last));
            }
        }
        if segments.current.is_none() {
            let mut dir = std::fs::DirBuilder::new();
            let mut options = OpenOptions::new();
            options.create(true).append(true);
            // Plaintexts: for the agent's user alone, whatever the umask.
            #[cfg(unix)]
            {
                use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _};
                dir.mode(0o700);
                options.mode(0o600);
            }
            dir.recursive(true)
                .create(&self.dir)
                .map_err(|e| io("cannot create the outbox journal", &self.dir, e))?;
            let path = self.dir.join(format!("{}.{}", self.stem, segments.next));
            let file = options
                .open(&path)
                .map_err(|e| io("cannot create the outbox journal", &path, e))?;
            segments.next += 1;
            segments.current = Some((path, file, 0, 0));
        }
        let Some((path, file, size, last)) = segments.current.as_mut() else {
            return Err(Error::Internal("no outbox journal segment".into()));
        };
        file.write_all(&record)
            .map_err(|e| io("cannot write the outbox journal", path, e))?;
        *size += record.len() as u64;
        *last = place;
        Ok(())
    }

    /// Everything up to `place` is in the outbox (or given up): deletes what only held that.
    pub(crate) fn forget_upto(&self, place: i64) {
        let mut segments = lock(&self.segments);
        segments.older.retain(|(path, last)| {
            // A segment that cannot be deleted is read again by the next opening, which skips
            // what the outbox already has.
            *last > place || std::fs::remove_file(path).is_err()
        });
        if let Some((_, file, size, last)) = segments.current.as_mut() {
            if *size > 0 && *last <= place && file.set_len(0).is_ok() {
                *size = 0;
            }
        }
    }
}

/// Appends the whole records of `bytes` to `records`, stopping at one cut short.
fn parse(mut bytes: &[u8], records: &mut Vec<Record>) {
    while bytes.len() >= HEADER {
        let (len, rest) = bytes.split_at(4);
        let len = u32::from_le_bytes([len[0], len[1], len[2], len[3]]) as usize;
        if len < 8 || rest.len() < len {
            return;
        }
        let (place, payload) = rest[..len].split_at(8);
        let mut le = [0; 8];
        le.copy_from_slice(place);
        records.push((i64::from_le_bytes(le), payload.to_vec()));
        bytes = &rest[len..];
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn records_survive_in_order_and_a_cut_one_is_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let (journal, found) = Journal::open(dir.path(), "a/b/c").unwrap();
        assert!(found.is_empty());
        for place in 1..=3 {
            journal.append(place, &[place as u8; 5]).unwrap();
        }
        // Another channel's journal is its own.
        Journal::open(dir.path(), "a/b/d")
            .unwrap()
            .0
            .append(1, b"x")
            .unwrap();
        drop(journal);
        let path = dir.path().join("outbox/a+b+c.0");
        let mut bytes = std::fs::read(&path).unwrap();
        bytes.extend_from_slice(&[20, 0, 0, 0, 4, 0]);
        std::fs::write(&path, bytes).unwrap();
        let (journal, found) = Journal::open(dir.path(), "a/b/c").unwrap();
        assert_eq!(
            found,
            vec![(1, vec![1; 5]), (2, vec![2; 5]), (3, vec![3; 5])]
        );
        // New records go to a new segment; what is encrypted is deleted.
        journal.append(4, b"four").unwrap();
        journal.forget_upto(3);
        assert!(!path.exists());
        let (_, found) = Journal::open(dir.path(), "a/b/c").unwrap();
        assert_eq!(found, vec![(4, b"four".to_vec())]);
        journal.forget_upto(4);
        let (_, found) = Journal::open(dir.path(), "a/b/c").unwrap();
        assert!(found.is_empty());
    }

    #[test]
    fn segments_roll_over_and_go_once_encrypted() {
        let dir = tempfile::tempdir().unwrap();
        let (journal, _) = Journal::open(dir.path(), "a/b/c").unwrap();
        let payload = vec![7; 100 * 1024];
        for place in 1..=25 {
            journal.append(place, &payload).unwrap();
        }
        let files = || {
            std::fs::read_dir(dir.path().join("outbox"))
                .unwrap()
                .count()
        };
        assert_eq!(files(), 3);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt as _;
            let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode(&dir.path().join("outbox")), 0o700);
            assert_eq!(mode(&dir.path().join("outbox/a+b+c.0")), 0o600);
        }
        journal.forget_upto(11);
        assert_eq!(files(), 2);
        journal.forget_upto(25);
        let (_, found) = Journal::open(dir.path(), "a/b/c").unwrap();
        assert!(found.is_empty());
    }
}
