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
//! Files: `<data_dir>/journal/<channel name, '/' as '+'>.<segment>` (`outbox/` before; see
//! [`adopt_old_directory`]). A segment begins with
//! [`MAGIC`] (written with its first record, in the same `write`); a record is
//! `len: u32 | place: u64 | payload_crc: u32 | header_crc: u32 | payload` (little endian; `len`
//! counts the payload; CRC32C, `header_crc` over the 16 bytes before it). Places are 1, 2, 3,
//! ... across segments, going on from the outbox's count ([`Engine::outbox_recorded`]).
//!
//! Damage is refused (`runtime error: <file> is damaged: ...`) when the channel opens, never
//! delivered nor skipped: a record failing a checksum, a record cut short anywhere but at the
//! end of the newest segment, or places that do not follow each other (a record or a segment
//! lost, reordered or repeated) or do not follow on from the outbox's count. What a kill can
//! leave is tolerated: the newest segment's last record cut short (its call had not returned;
//! appends are serialised, so only the last one can be), or zeros in its place (what a power
//! loss may leave of a file's end); it is cut off at the opening. Whole records missing at
//! the very end of the newest segment cannot be told from what a power loss takes back (see
//! docs/sdk.md, outbox).
//!
//! The previous release's segments (no [`MAGIC`]; `len: u32 | place: u64 | payload`, `len`
//! counting place and payload, no checksum) are converted once, at the first opening, and the
//! channel's marker file (`<stem>.journal2`) then says that every segment has the new format.
//!
//! [`Engine::outbox_recorded`]: static_mls::engine::Engine::outbox_recorded

use std::fs::{File, OpenOptions};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::error::{Error, Result};
use crate::sync::lock;

/// The journal's directory inside the data directory.
const DIR: &str = "journal";
/// Its name before: the same word as the engine's unrelated outbox table.
const OLD_DIR: &str = "outbox";
/// A segment's size past which the next record starts a new one: what the sender deletes at
/// once when it has encrypted everything in it.
const SEGMENT_BYTES: u64 = 1024 * 1024;
/// A segment's first bytes. Read as the previous release's first `len`, they would count
/// ~1.3 GB: no segment of that release begins with them.
const MAGIC: &[u8; 8] = b"STJOURN2";
/// A record's header: `len`, `place`, `payload_crc`, `header_crc`.
const HEADER: usize = 20;
/// The previous release's record header: `len` and `place`.
const V1_HEADER: usize = 12;
/// The marker file's suffix: the channel's segments all have the current format.
const MARKER: &str = "journal2";

fn io(what: &str, path: &Path, e: std::io::Error) -> Error {
    Error::Internal(format!("{what} {}: {e}", path.display()))
}

fn damaged(path: &Path, what: &str) -> Error {
    Error::Internal(format!(
        "{} is damaged: {what}; its channel's unsent pipelined messages cannot be told. \
         Restore the data directory from a backup, or remove the file to give them up",
        path.display()
    ))
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

/// How a segment's bytes end, once parsed.
#[derive(Debug, PartialEq, Eq)]
enum Ending {
    /// With a whole record.
    Whole,
    /// With what a kill (or a power loss) leaves: cut off at this length.
    Torn(u64),
}

impl Journal {
    /// Opens the channel's journal under `data_dir`: the records earlier openings left after
    /// `recorded` (the outbox's count, see the module docs), in order, as (place, payload).
    /// Damage is refused, naming the file.
    pub(crate) fn open(
        data_dir: &Path,
        channel: &str,
        recorded: i64,
    ) -> Result<(Journal, Vec<Record>)> {
        let dir = data_dir.join(DIR);
        let stem = channel.replace('/', "+");
        let marker = dir.join(format!("{stem}.{MARKER}"));
        let mut found: Vec<(u64, PathBuf)> = Vec::new();
        let mut marked = false;
        match std::fs::read_dir(&dir) {
            Ok(entries) => {
                for entry in entries {
                    let entry = entry.map_err(|e| io("cannot read the outbox journal", &dir, e))?;
                    let name = entry.file_name();
                    let Some(rest) = name
                        .to_str()
                        .and_then(|n| n.strip_prefix(stem.as_str()))
                        .and_then(|rest| rest.strip_prefix('.'))
                    else {
                        continue;
                    };
                    if rest == MARKER {
                        marked = true;
                    } else if let Ok(segment) = rest.parse::<u64>() {
                        found.push((segment, entry.path()));
                    }
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io("cannot read the outbox journal", &dir, e)),
        }
        found.sort();
        let mut records = Vec::new();
        let mut older = Vec::new();
        let newest = found.last().map(|(segment, _)| *segment);
        let mut places = Places::new(recorded);
        for (segment, path) in &found {
            let bytes =
                std::fs::read(path).map_err(|e| io("cannot read the outbox journal", path, e))?;
            let is_newest = Some(*segment) == newest;
            let before = records.len();
            let v1 = !bytes.is_empty() && !bytes.starts_with(MAGIC);
            // The first write of a segment, cut short inside the magic.
            let torn_magic = is_newest
                && !bytes.is_empty()
                && bytes.len() < MAGIC.len()
                && MAGIC.starts_with(&bytes);
            if torn_magic {
                cut(path, 0)?;
            } else if v1 && !marked {
                parse_v1(&bytes, &mut records);
                convert(path, &records[before..])?;
            } else if v1 {
                return Err(damaged(path, "it does not begin as a journal segment"));
            } else if let Ending::Torn(at) =
                parse(&bytes, is_newest, &mut records).map_err(|what| damaged(path, &what))?
            {
                cut(path, at)?;
            }
            places.check(path, &records[before..])?;
            let last = records[before..].last().map_or(0, |r: &Record| r.0);
            older.push((path.clone(), last));
        }
        if !marked && !found.is_empty() {
            mark(&marker)?;
        }
        let next = newest.map_or(0, |segment| segment + 1);
        let journal = Journal {
            dir,
            stem,
            segments: Mutex::new(Segments {
                older,
                current: None,
                next,
            }),
        };
        // Segments the outbox already covers (a deletion a crash interrupted).
        journal.forget_upto(recorded);
        records.retain(|(place, _)| *place > recorded);
        Ok((journal, records))
    }

    /// Appends `payload` at `place`, with one `write`: in the OS's hands when this returns.
    pub(crate) fn append(&self, place: i64, payload: &[u8]) -> Result<()> {
        let len = u32::try_from(payload.len())
            .map_err(|_| Error::Invalid("payload too large for the outbox journal".into()))?;
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
            let path = self.dir.join(format!("{}.{}", self.stem, segments.next));
            let file = create(&self.dir, &path, false)?;
            if segments.next == 0 {
                // The channel's first segment: its marker goes with it (a directory made by
                // this release has no segment of the previous one).
                mark(&self.dir.join(format!("{}.{MARKER}", self.stem)))?;
            }
            segments.next += 1;
            segments.current = Some((path, file, 0, 0));
        }
        let Some((path, file, size, last)) = segments.current.as_mut() else {
            return Err(Error::Internal("no outbox journal segment".into()));
        };
        let mut record = Vec::with_capacity(MAGIC.len() + HEADER + payload.len());
        if *size == 0 {
            record.extend_from_slice(MAGIC);
        }
        encode(&mut record, place, len, payload);
        match file.write_all(&record) {
            Ok(()) => {
                *size += record.len() as u64;
                *last = place;
                Ok(())
            }
            // A part written would read as damage: it is taken back.
            Err(e) if file.set_len(*size).is_ok() => {
                Err(io("cannot write the outbox journal", path, e))
            }
            Err(e) => {
                let failed = io("cannot write the outbox journal", path, e);
                // Or, if it cannot be, the segment is left (the next record starts another).
                if let Some((path, _, _, last)) = segments.current.take() {
                    segments.older.push((path, last));
                }
                Err(failed)
            }
        }
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

/// Appends the record of `payload` at `place` to `out`.
fn encode(out: &mut Vec<u8>, place: i64, len: u32, payload: &[u8]) {
    let start = out.len();
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&place.to_le_bytes());
    out.extend_from_slice(&crc32c::crc32c(payload).to_le_bytes());
    let header_crc = crc32c::crc32c(&out[start..]);
    out.extend_from_slice(&header_crc.to_le_bytes());
    out.extend_from_slice(payload);
}

fn le_u32(bytes: &[u8], at: usize) -> u32 {
    let mut le = [0; 4];
    le.copy_from_slice(&bytes[at..at + 4]);
    u32::from_le_bytes(le)
}

fn le_i64(bytes: &[u8], at: usize) -> i64 {
    let mut le = [0; 8];
    le.copy_from_slice(&bytes[at..at + 8]);
    i64::from_le_bytes(le)
}

/// Appends the records of a segment (`bytes`, beginning with [`MAGIC`]) to `records`. A record
/// cut short, or zeros, at its end are tolerated in the `newest` segment only (see the module
/// docs); any other fault is refused, with what it is.
fn parse(bytes: &[u8], newest: bool, records: &mut Vec<Record>) -> Result<Ending, String> {
    let mut at = MAGIC.len();
    while at < bytes.len() {
        let rest = &bytes[at..];
        let torn = || {
            if newest {
                Ok(Ending::Torn(at as u64))
            } else {
                Err(format!(
                    "the record at byte {at} is cut short, in a segment that is not the newest"
                ))
            }
        };
        if rest.len() < HEADER {
            return torn();
        }
        if crc32c::crc32c(&rest[..16]) != le_u32(rest, 16) {
            if rest.iter().all(|b| *b == 0) {
                return torn();
            }
            return Err(format!(
                "the header of the record at byte {at} fails its checksum"
            ));
        }
        let len = le_u32(rest, 0) as usize;
        let place = le_i64(rest, 4);
        let Some(payload) = rest.get(HEADER..HEADER + len) else {
            return torn();
        };
        if crc32c::crc32c(payload) != le_u32(rest, 12) {
            return Err(format!(
                "the payload of the record at byte {at} (message {place}) fails its checksum"
            ));
        }
        records.push((place, payload.to_vec()));
        at += HEADER + len;
    }
    Ok(Ending::Whole)
}

/// Appends the whole records of a segment of the previous release to `records`, stopping at
/// one cut short (that release's rule).
fn parse_v1(mut bytes: &[u8], records: &mut Vec<Record>) {
    while bytes.len() >= V1_HEADER {
        let len = le_u32(bytes, 0) as usize;
        let Some(record) = bytes.get(4..4 + len).filter(|_| len >= 8) else {
            return;
        };
        records.push((le_i64(record, 0), record[8..].to_vec()));
        bytes = &bytes[4 + len..];
    }
}

/// The places of the records still owed (after the outbox's count), as the segments are read:
/// they must go on from that count, one by one. Records the outbox already holds are passed
/// over (a deletion that failed may leave a gap among those, harmlessly).
struct Places {
    recorded: i64,
    next: i64,
}

impl Places {
    fn new(recorded: i64) -> Self {
        Self {
            recorded,
            next: recorded.saturating_add(1),
        }
    }

    /// Checks `records` (one segment's, `path`).
    fn check(&mut self, path: &Path, records: &[Record]) -> Result<()> {
        for &(place, _) in records {
            if self.next == self.recorded.saturating_add(1) && place <= self.recorded {
                continue;
            }
            if place != self.next {
                let what = if self.next == self.recorded.saturating_add(1) {
                    format!(
                        "the outbox holds messages up to {}, and the journal goes on at message \
                         {place} (records are missing)",
                        self.recorded
                    )
                } else {
                    format!(
                        "message {place} follows message {} (a record lost, moved or repeated)",
                        self.next - 1
                    )
                };
                return Err(damaged(path, &what));
            }
            self.next = place.saturating_add(1);
        }
        Ok(())
    }
}

/// Makes the journal's directory and opens (`truncate`: replaces) a segment for appending.
fn create(dir: &Path, path: &Path, truncate: bool) -> Result<File> {
    let mut builder = std::fs::DirBuilder::new();
    let mut options = OpenOptions::new();
    if truncate {
        options.write(true).create(true).truncate(true);
    } else {
        options.create(true).append(true);
    }
    // Plaintexts: for the agent's user alone, whatever the umask.
    #[cfg(unix)]
    {
        use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _};
        builder.mode(0o700);
        options.mode(0o600);
    }
    builder
        .recursive(true)
        .create(dir)
        .map_err(|e| io("cannot create the outbox journal", dir, e))?;
    options
        .open(path)
        .map_err(|e| io("cannot create the outbox journal", path, e))
}

/// Records that the channel's segments all have the current format.
fn mark(marker: &Path) -> Result<()> {
    let dir = marker.parent().unwrap_or(marker);
    create(dir, marker, false).map(drop)
}

/// Cuts what a kill left at the end of a segment, so that it is whole for later openings.
fn cut(path: &Path, at: u64) -> Result<()> {
    OpenOptions::new()
        .write(true)
        .open(path)
        .and_then(|file| file.set_len(at))
        .map_err(|e| io("cannot repair the outbox journal", path, e))
}

/// Rewrites a segment of the previous release in the current format (to a file beside it,
/// then renamed over it: a kill leaves one or the other, whole).
fn convert(path: &Path, records: &[Record]) -> Result<()> {
    let mut bytes = MAGIC.to_vec();
    for (place, payload) in records {
        let len = u32::try_from(payload.len())
            .map_err(|_| damaged(path, "a record is longer than any payload"))?;
        encode(&mut bytes, *place, len, payload);
    }
    let mut name = path.as_os_str().to_owned();
    name.push(".new");
    let new = PathBuf::from(name);
    let dir = path.parent().unwrap_or(path);
    create(dir, &new, true)?
        .write_all(&bytes)
        .map_err(|e| io("cannot convert the outbox journal", &new, e))?;
    std::fs::rename(&new, path).map_err(|e| io("cannot convert the outbox journal", path, e))
}

/// Moves a journal directory of an earlier release (`<data_dir>/outbox`) to its name now, once,
/// when the client opens `data_dir` (under the engine's lock of it, before any channel opens: no
/// journal can be written meanwhile).
pub(crate) fn adopt_old_directory(data_dir: &Path) -> Result<()> {
    let old = data_dir.join(OLD_DIR);
    let dir = data_dir.join(DIR);
    if !old.is_dir() || dir.exists() {
        return Ok(());
    }
    std::fs::rename(&old, &dir)
        .and_then(|()| File::open(data_dir)?.sync_all())
        .map_err(|e| io("cannot move the journal to its new directory", &old, e))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const CHANNEL: &str = "a/b/c";

    /// A journal of `n` records of 5 bytes each (places 1..=n), closed; its segment's path.
    fn journal_of(dir: &Path, n: i64) -> PathBuf {
        let (journal, found) = Journal::open(dir, CHANNEL, 0).unwrap();
        assert!(found.is_empty());
        for place in 1..=n {
            journal.append(place, &[place as u8; 5]).unwrap();
        }
        dir.join("journal/a+b+c.0")
    }

    fn records(n: i64) -> Vec<Record> {
        (1..=n).map(|p| (p, vec![p as u8; 5])).collect()
    }

    /// Where record `i` (from 0) of [`journal_of`]'s segment begins.
    fn at(i: usize) -> usize {
        MAGIC.len() + i * (HEADER + 5)
    }

    fn refused(dir: &Path, recorded: i64, path: &Path) -> String {
        let e = Journal::open(dir, CHANNEL, recorded)
            .map(|_| ())
            .unwrap_err();
        let text = e.to_string();
        assert!(text.starts_with("runtime error: "), "{text}");
        assert!(
            text.contains(&format!("{} is damaged", path.display())),
            "{text}"
        );
        text
    }

    #[test]
    fn records_survive_in_order_and_a_torn_last_one_is_cut_off() {
        let dir = tempfile::tempdir().unwrap();
        let path = journal_of(dir.path(), 3);
        // Another channel's journal is its own.
        Journal::open(dir.path(), "a/b/d", 0)
            .unwrap()
            .0
            .append(1, b"x")
            .unwrap();
        // A kill in the middle of the 4th append: its call never returned.
        let whole = std::fs::read(&path).unwrap();
        for cut_at in 1..HEADER + 5 {
            let mut bytes = whole.clone();
            let mut fourth = Vec::new();
            encode(&mut fourth, 4, 5, &[4; 5]);
            bytes.extend_from_slice(&fourth[..cut_at]);
            std::fs::write(&path, &bytes).unwrap();
            let (_, found) = Journal::open(dir.path(), CHANNEL, 0).unwrap();
            assert_eq!(found, records(3), "cut at {cut_at}");
            // Cut off, so that the segment is whole for the openings after.
            assert_eq!(std::fs::read(&path).unwrap(), whole);
        }
        // Zeros where the last record should be (what a power loss may leave).
        let mut bytes = whole.clone();
        bytes.extend_from_slice(&[0; 40]);
        std::fs::write(&path, &bytes).unwrap();
        let (journal, found) = Journal::open(dir.path(), CHANNEL, 0).unwrap();
        assert_eq!(found, records(3));
        // New records go to a new segment; what is encrypted is deleted.
        journal.append(4, b"four").unwrap();
        journal.forget_upto(3);
        assert!(!path.exists());
        let (_, found) = Journal::open(dir.path(), CHANNEL, 3).unwrap();
        assert_eq!(found, vec![(4, b"four".to_vec())]);
        journal.forget_upto(4);
        let (_, found) = Journal::open(dir.path(), CHANNEL, 4).unwrap();
        assert!(found.is_empty());
    }

    #[test]
    fn a_byte_changed_anywhere_is_refused_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = journal_of(dir.path(), 3);
        let whole = std::fs::read(&path).unwrap();
        for i in 0..whole.len() {
            for flip in [0x01, 0x80, 0xff] {
                let mut bytes = whole.clone();
                bytes[i] ^= flip;
                std::fs::write(&path, &bytes).unwrap();
                refused(dir.path(), 0, &path);
            }
        }
        // As it was, it is read again.
        std::fs::write(&path, &whole).unwrap();
        assert_eq!(Journal::open(dir.path(), CHANNEL, 0).unwrap().1, records(3));
    }

    #[test]
    fn a_length_field_damaged_or_cut_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = journal_of(dir.path(), 3);
        let whole = std::fs::read(&path).unwrap();
        // The second record's length made longer than the file (which a torn append would
        // look like without the header's checksum), or shorter.
        for len in [0u32, 4, 6, 1000, u32::MAX] {
            let mut bytes = whole.clone();
            bytes[at(1)..at(1) + 4].copy_from_slice(&len.to_le_bytes());
            std::fs::write(&path, &bytes).unwrap();
            let text = refused(dir.path(), 0, &path);
            assert!(
                text.contains(&format!("record at byte {}", at(1))),
                "{text}"
            );
        }
        // A segment that is not the newest, cut in its last record's length field.
        std::fs::write(&path, &whole[..at(2) + 2]).unwrap();
        std::fs::write(dir.path().join("journal/a+b+c.1"), b"").unwrap();
        let text = refused(dir.path(), 0, &path);
        assert!(text.contains("cut short"), "{text}");
    }

    #[test]
    fn records_reordered_repeated_or_missing_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = journal_of(dir.path(), 3);
        let whole = std::fs::read(&path).unwrap();
        let record = |i: usize| &whole[at(i)..at(i + 1)];
        let segment = |order: &[usize]| {
            let mut bytes = MAGIC.to_vec();
            for &i in order {
                bytes.extend_from_slice(record(i));
            }
            bytes
        };
        for order in [
            &[0, 2, 1][..],
            &[0, 1, 1, 2],
            &[0, 1, 2, 2],
            &[0, 2],
            &[1, 2],
        ] {
            std::fs::write(&path, segment(order)).unwrap();
            refused(dir.path(), 0, &path);
        }
        // The outbox's count says where the journal goes on: records it holds may be left
        // (a deletion that failed), but none it does not hold may be missing.
        std::fs::write(&path, segment(&[1, 2])).unwrap();
        assert_eq!(
            Journal::open(dir.path(), CHANNEL, 1).unwrap().1,
            records(3)[1..]
        );
        std::fs::write(&path, segment(&[2])).unwrap();
        refused(dir.path(), 1, &path);
        // A segment lost between two others.
        std::fs::write(&path, segment(&[0])).unwrap();
        std::fs::write(dir.path().join("journal/a+b+c.2"), segment(&[2])).unwrap();
        refused(dir.path(), 0, &dir.path().join("journal/a+b+c.2"));
        std::fs::write(dir.path().join("journal/a+b+c.1"), segment(&[1])).unwrap();
        assert_eq!(Journal::open(dir.path(), CHANNEL, 0).unwrap().1, records(3));
    }

    #[test]
    fn the_previous_releases_journal_is_converted_once() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("journal")).unwrap();
        let v1 = |places: std::ops::RangeInclusive<i64>| {
            let mut bytes = Vec::new();
            for place in places {
                bytes.extend_from_slice(&13u32.to_le_bytes());
                bytes.extend_from_slice(&place.to_le_bytes());
                bytes.extend_from_slice(&[place as u8; 5]);
            }
            bytes
        };
        let (first, second) = (
            dir.path().join("journal/a+b+c.3"),
            dir.path().join("journal/a+b+c.4"),
        );
        std::fs::write(&first, v1(1..=2)).unwrap();
        // Its last segment cut short by a kill, as that release left it.
        let mut bytes = v1(3..=4);
        bytes.extend_from_slice(&[13, 0, 0]);
        std::fs::write(&second, bytes).unwrap();
        let (journal, found) = Journal::open(dir.path(), CHANNEL, 0).unwrap();
        assert_eq!(found, records(4));
        for path in [&first, &second] {
            assert!(std::fs::read(path).unwrap().starts_with(MAGIC));
        }
        journal.append(5, &[5; 5]).unwrap();
        assert!(dir.path().join("journal/a+b+c.5").exists());
        drop(journal);
        assert_eq!(Journal::open(dir.path(), CHANNEL, 0).unwrap().1, records(5));
        // Converted: a segment in the old format now is damage.
        std::fs::write(&first, v1(1..=2)).unwrap();
        refused(dir.path(), 0, &first);
    }

    #[test]
    fn segments_roll_over_and_go_once_encrypted() {
        let dir = tempfile::tempdir().unwrap();
        let (journal, _) = Journal::open(dir.path(), CHANNEL, 0).unwrap();
        let payload = vec![7; 100 * 1024];
        for place in 1..=25 {
            journal.append(place, &payload).unwrap();
        }
        let segments = || {
            std::fs::read_dir(dir.path().join("journal"))
                .unwrap()
                .filter(|e| {
                    !e.as_ref()
                        .unwrap()
                        .file_name()
                        .to_str()
                        .unwrap()
                        .ends_with(MARKER)
                })
                .count()
        };
        assert_eq!(segments(), 3);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt as _;
            let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode(&dir.path().join("journal")), 0o700);
            assert_eq!(mode(&dir.path().join("journal/a+b+c.0")), 0o600);
        }
        journal.forget_upto(11);
        assert_eq!(segments(), 2);
        journal.forget_upto(25);
        // The segment written to was emptied (not deleted: it is still open for appending),
        // and takes records again (with its magic). Not reopened in between: an opening
        // deletes empty segments, which only the channel's sole opening may.
        assert_eq!(segments(), 1);
        assert_eq!(
            std::fs::metadata(dir.path().join("journal/a+b+c.2"))
                .unwrap()
                .len(),
            0
        );
        journal.append(26, b"x").unwrap();
        drop(journal);
        assert_eq!(
            Journal::open(dir.path(), CHANNEL, 25).unwrap().1,
            vec![(26, b"x".to_vec())]
        );
    }

    #[test]
    fn an_earlier_releases_journal_directory_is_adopted_with_its_records() {
        let dir = tempfile::tempdir().unwrap();
        let (journal, _) = Journal::open(dir.path(), CHANNEL, 0).unwrap();
        journal.append(1, b"kept").unwrap();
        drop(journal);
        std::fs::rename(dir.path().join(DIR), dir.path().join(OLD_DIR)).unwrap();
        adopt_old_directory(dir.path()).unwrap();
        assert!(!dir.path().join(OLD_DIR).exists());
        let (_, found) = Journal::open(dir.path(), CHANNEL, 0).unwrap();
        assert_eq!(found.len(), 1);
        // Once adopted (or when there is none), nothing more happens.
        adopt_old_directory(dir.path()).unwrap();
        assert!(dir.path().join(DIR).is_dir());
    }
}
