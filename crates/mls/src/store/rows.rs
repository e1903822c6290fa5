//! The reads and writes of our own tables (identity, groups, pending commits, the session,
//! fresh epochs, cursors, the inbox), each on the caller's connection and transaction.

use rusqlite::{Connection, OptionalExtension};

use super::StoreError;

/// Our pending commit as the store keeps it: its bytes, and the Welcome an add made with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredCommit {
    pub commit: Vec<u8>,
    pub welcome: Option<Vec<u8>>,
}

/// The stored identity row: (identity, signature public key).
pub(crate) type IdentityRow = (Vec<u8>, Vec<u8>);

pub(crate) fn read_identity(conn: &Connection) -> Result<Option<IdentityRow>, StoreError> {
    Ok(conn
        .query_row(
            "SELECT identity, signature_public_key FROM static_identity WHERE id = 0",
            [],
            |row| Ok((row.get(0)?, row.get(1)?)),
        )
        .optional()?)
}

pub(crate) fn write_identity(
    conn: &Connection,
    identity: &[u8],
    public: &[u8],
) -> Result<(), StoreError> {
    conn.execute(
        "INSERT INTO static_identity (id, identity, signature_public_key) VALUES (0, ?1, ?2)",
        (identity, public),
    )?;
    Ok(())
}

pub(crate) fn group_names(conn: &Connection) -> Result<Vec<String>, StoreError> {
    let mut stmt = conn.prepare("SELECT name FROM static_groups ORDER BY name")?;
    let names = stmt
        .query_map([], |row| row.get(0))?
        .collect::<Result<Vec<String>, _>>()?;
    Ok(names)
}

pub(crate) fn insert_group(conn: &Connection, name: &str) -> Result<(), StoreError> {
    conn.execute("INSERT INTO static_groups (name) VALUES (?1)", [name])?;
    Ok(())
}

pub(crate) fn delete_group(conn: &Connection, name: &str) -> Result<(), StoreError> {
    conn.execute("DELETE FROM static_groups WHERE name = ?1", [name])?;
    Ok(())
}

pub(crate) fn set_pending_commit(
    conn: &Connection,
    name: &str,
    bytes: &[u8],
    welcome: Option<&[u8]>,
) -> Result<(), StoreError> {
    conn.execute(
        "INSERT OR REPLACE INTO static_pending_commits (name, commit_bytes, welcome_bytes)
         VALUES (?1, ?2, ?3)",
        (name, bytes, welcome),
    )?;
    Ok(())
}

/// Our pending commit and the Welcome made with it, if any.
pub(crate) fn pending_commit_and_welcome(
    conn: &Connection,
    name: &str,
) -> Result<Option<StoredCommit>, StoreError> {
    Ok(conn
        .prepare_cached(
            "SELECT commit_bytes, welcome_bytes FROM static_pending_commits WHERE name = ?1",
        )?
        .query_row([name], |row| {
            Ok(StoredCommit {
                commit: row.get(0)?,
                welcome: row.get(1)?,
            })
        })
        .optional()?)
}

pub(crate) fn pending_commit(conn: &Connection, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
    Ok(conn
        .prepare_cached("SELECT commit_bytes FROM static_pending_commits WHERE name = ?1")?
        .query_row([name], |row| row.get(0))
        .optional()?)
}

pub(crate) fn clear_pending_commit(conn: &Connection, name: &str) -> Result<(), StoreError> {
    conn.execute("DELETE FROM static_pending_commits WHERE name = ?1", [name])?;
    Ok(())
}

/// The engine's last opening: (boot id, closed cleanly).
pub(crate) fn read_session(
    conn: &Connection,
) -> Result<Option<(Option<String>, bool)>, StoreError> {
    Ok(conn
        .query_row(
            "SELECT boot_id, clean FROM static_session WHERE id = 0",
            [],
            |row| Ok((row.get(0)?, row.get(1)?)),
        )
        .optional()?)
}

pub(crate) fn write_session(
    conn: &Connection,
    boot_id: Option<&str>,
    clean: bool,
) -> Result<(), StoreError> {
    conn.execute(
        "INSERT OR REPLACE INTO static_session (id, boot_id, clean) VALUES (0, ?1, ?2)",
        (boot_id, clean),
    )?;
    Ok(())
}

pub(crate) fn require_fresh_epoch(conn: &Connection, name: &str) -> Result<(), StoreError> {
    conn.execute(
        "INSERT OR IGNORE INTO static_fresh_epoch_needed (name) VALUES (?1)",
        [name],
    )?;
    Ok(())
}

pub(crate) fn fresh_epoch_needed(conn: &Connection, name: &str) -> Result<bool, StoreError> {
    Ok(conn
        .prepare_cached("SELECT 1 FROM static_fresh_epoch_needed WHERE name = ?1")?
        .query_row([name], |_| Ok(()))
        .optional()?
        .is_some())
}

pub(crate) fn any_fresh_epoch_needed(conn: &Connection) -> Result<bool, StoreError> {
    Ok(conn
        .query_row(
            "SELECT 1 FROM static_fresh_epoch_needed LIMIT 1",
            [],
            |_| Ok(()),
        )
        .optional()?
        .is_some())
}

/// Our pending commit was merged: it is gone, and the group is at an epoch of its own making.
pub(crate) fn own_commit_merged(conn: &Connection, name: &str) -> Result<(), StoreError> {
    clear_pending_commit(conn, name)?;
    conn.prepare_cached("DELETE FROM static_fresh_epoch_needed WHERE name = ?1")?
        .execute([name])?;
    Ok(())
}

/// Where a channel's processing resumes in the relay's log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cursor {
    /// Entries after this seq (0: from the beginning).
    After(u64),
    /// No entry applied yet since joining at this epoch: entries from the start of the epoch.
    FromEpoch(u64),
}

/// A count or seq as SQLite's INTEGER stores it (saturating: none comes near 2^63).
pub(crate) fn to_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// A stored INTEGER back as a count or seq (a negative one, never written, reads as 0).
pub(crate) fn to_u64(v: i64) -> u64 {
    u64::try_from(v).unwrap_or(0)
}

/// The API key that last bound our leaf of `name` on the relay, if recorded.
pub(crate) fn bound_key(conn: &Connection, name: &str) -> Result<Option<String>, StoreError> {
    Ok(conn
        .prepare_cached("SELECT key_id FROM static_bound_keys WHERE name = ?1")?
        .query_row([name], |row| row.get(0))
        .optional()?)
}

pub(crate) fn set_bound_key(conn: &Connection, name: &str, key_id: &str) -> Result<(), StoreError> {
    conn.prepare_cached("INSERT OR REPLACE INTO static_bound_keys (name, key_id) VALUES (?1, ?2)")?
        .execute((name, key_id))?;
    Ok(())
}

pub(crate) fn set_cursor(conn: &Connection, name: &str, cursor: Cursor) -> Result<(), StoreError> {
    let (seq, epoch) = match cursor {
        Cursor::After(seq) => (Some(to_i64(seq)), 0),
        Cursor::FromEpoch(epoch) => (None, to_i64(epoch)),
    };
    conn.prepare_cached(
        "INSERT OR REPLACE INTO static_cursors (name, seq, join_epoch) VALUES (?1, ?2, ?3)",
    )?
    .execute((name, seq, epoch))?;
    Ok(())
}

pub(crate) fn cursor(conn: &Connection, name: &str) -> Result<Cursor, StoreError> {
    let row: Option<(Option<i64>, i64)> = conn
        .query_row(
            "SELECT seq, join_epoch FROM static_cursors WHERE name = ?1",
            [name],
            |row| Ok((row.get(0)?, row.get(1)?)),
        )
        .optional()?;
    Ok(match row {
        Some((Some(seq), _)) => Cursor::After(to_u64(seq)),
        Some((None, epoch)) => Cursor::FromEpoch(to_u64(epoch)),
        // A group created before cursors existed: replay the whole log (what cannot be
        // decrypted any more is skipped).
        None => Cursor::After(0),
    })
}

pub(crate) fn inbox_push(
    conn: &Connection,
    name: &str,
    message: &InboxMessage,
) -> Result<(), StoreError> {
    conn.prepare_cached(
        "INSERT INTO static_inbox (name, seq, sender, payload, epoch, account)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
    )?
    .execute((
        name,
        to_i64(message.seq),
        &message.sender,
        &message.payload,
        to_i64(message.epoch),
        message.account.as_deref(),
    ))?;
    Ok(())
}

/// One received message waiting in the inbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InboxMessage {
    /// The row's id: increasing in arrival order, never reused (0 before it is stored).
    pub id: i64,
    /// Its place in the channel's log.
    pub seq: u64,
    /// The sender's identity (its credential), as MLS authenticated it.
    pub sender: Vec<u8>,
    pub payload: Vec<u8>,
    /// The epoch it was sent in.
    pub epoch: u64,
    /// The account that published it, as the relay attests it ("" when anonymous); None when
    /// unknown (a relay of an older release, a row stored by an older version).
    pub account: Option<String>,
}

fn inbox_row(row: &rusqlite::Row<'_>) -> rusqlite::Result<InboxMessage> {
    Ok(InboxMessage {
        id: row.get(0)?,
        seq: to_u64(row.get(1)?),
        sender: row.get(2)?,
        payload: row.get(3)?,
        epoch: to_u64(row.get(4)?),
        account: row.get(5)?,
    })
}

/// Up to `limit` messages of the channel's inbox after row `after_id`, oldest first (a read:
/// no transaction needed).
pub(crate) fn inbox_after(
    conn: &Connection,
    name: &str,
    after_id: i64,
    limit: usize,
) -> Result<Vec<InboxMessage>, StoreError> {
    let mut stmt = conn.prepare_cached(
        "SELECT id, seq, sender, payload, epoch, account FROM static_inbox
         WHERE name = ?1 AND id > ?2 ORDER BY id LIMIT ?3",
    )?;
    let rows = stmt
        .query_map(
            (name, after_id, i64::try_from(limit).unwrap_or(i64::MAX)),
            inbox_row,
        )?
        .collect::<Result<Vec<_>, _>>()?;
    Ok(rows)
}

/// Removes and returns the oldest message of the channel's inbox (for users of the engine
/// alone; the SDK's client hands messages out through [`inbox_after`] and its marks).
pub(crate) fn inbox_take(
    conn: &Connection,
    name: &str,
) -> Result<Option<InboxMessage>, StoreError> {
    Ok(conn
        .prepare_cached(
            "DELETE FROM static_inbox WHERE id = (
                 SELECT id FROM static_inbox WHERE name = ?1 ORDER BY id LIMIT 1
             ) RETURNING id, seq, sender, payload, epoch, account",
        )?
        .query_row([name], inbox_row)
        .optional()?)
}

/// Deletes the channel's inbox rows up to `upto_id` (messages already handed out).
pub(crate) fn inbox_prune(
    conn: &Connection,
    name: &str,
    upto_id: i64,
) -> Result<usize, StoreError> {
    Ok(conn
        .prepare_cached("DELETE FROM static_inbox WHERE name = ?1 AND id <= ?2")?
        .execute((name, upto_id))?)
}

/// How many messages of the channel's inbox come after row `after_id`.
pub(crate) fn inbox_count_after(
    conn: &Connection,
    name: &str,
    after_id: i64,
) -> Result<u64, StoreError> {
    let n: i64 = conn.query_row(
        "SELECT count(*) FROM static_inbox WHERE name = ?1 AND id > ?2",
        (name, after_id),
        |row| row.get(0),
    )?;
    Ok(to_u64(n))
}

/// The channel's slot in the hand-out marks file (see `static-client`), assigned on first use
/// and kept for good. A new slot is given to `init` (which writes its first mark) before it is
/// recorded, so every recorded slot has a mark: a slot of the file without one is damage.
pub(crate) fn inbox_slot(
    conn: &Connection,
    name: &str,
    init: impl FnOnce(u64) -> Result<(), StoreError>,
) -> Result<u64, StoreError> {
    conn.execute_batch(crate::store::schema::INBOX_SLOTS_TABLE)?;
    let known: Option<i64> = conn
        .query_row(
            "SELECT slot FROM static_inbox_slots WHERE name = ?1",
            [name],
            |row| row.get(0),
        )
        .optional()?;
    if let Some(slot) = known {
        return Ok(to_u64(slot));
    }
    let slot: i64 = conn.query_row(
        "SELECT COALESCE(MAX(slot) + 1, 0) FROM static_inbox_slots",
        [],
        |row| row.get(0),
    )?;
    init(to_u64(slot))?;
    conn.execute(
        "INSERT INTO static_inbox_slots (name, slot) VALUES (?1, ?2)",
        (name, slot),
    )?;
    Ok(to_u64(slot))
}

/// How many slots the hand-out marks file has (see [`inbox_slot`]), and the file's id if the
/// client recorded one ([`record_inbox_marks`]).
pub(crate) fn inbox_marks(conn: &Connection) -> Result<(u64, Option<Vec<u8>>), StoreError> {
    conn.execute_batch(crate::store::schema::INBOX_SLOTS_TABLE)?;
    let slots: i64 = conn.query_row(
        "SELECT COALESCE(MAX(slot) + 1, 0) FROM static_inbox_slots",
        [],
        |row| row.get(0),
    )?;
    let file_id = conn
        .query_row(
            "SELECT file_id FROM static_inbox_marks WHERE id = 0",
            [],
            |row| row.get(0),
        )
        .optional()?;
    Ok((to_u64(slots), file_id))
}

/// Records the id of the hand-out marks file (see [`inbox_marks`]).
pub(crate) fn record_inbox_marks(conn: &Connection, file_id: &[u8]) -> Result<(), StoreError> {
    conn.execute_batch(crate::store::schema::INBOX_SLOTS_TABLE)?;
    conn.execute(
        "INSERT OR REPLACE INTO static_inbox_marks (id, file_id) VALUES (0, ?1)",
        [file_id],
    )?;
    Ok(())
}
