//! The relay's tables in SQLite (`static/store/migrations/0002_relay.sqlite.sql`): a port of
//! `static/store/_channels.py`. Thin I/O only: the log (`log.rs`) decides sequence numbers,
//! epochs and idempotency; this module reads and writes what it decided, a whole group commit
//! in one transaction. Every statement goes through the connection's statement cache.

use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use rusqlite::{params, Connection, ErrorCode, OpenFlags, OptionalExtension, TransactionBehavior};
use sha2::{Digest, Sha256};

use crate::log::{Entry, WelcomeKey, WelcomeRecord};

/// The Python API writes accounts and keys into the same database file: wait for it.
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);
const STATEMENT_CACHE: usize = 32;

const INSERT_ENTRY: &str = "INSERT INTO relay_entries (channel_id, seq, epoch, content_type, \
     channel_epoch, idempotency_key, message) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)";
const UPDATE_HEAD: &str = "UPDATE relay_channels SET head_seq = ?2, epoch = ?3 WHERE id = ?1";
const INSERT_EPOCH: &str =
    "INSERT INTO relay_epochs (channel_id, epoch, start_seq) VALUES (?1, ?2, ?3)";
const INSERT_WELCOME: &str = "INSERT INTO relay_welcomes (channel_id, digest, commit_seq, \
     epoch, welcome) VALUES (?1, ?2, ?3, ?4, ?5) ON CONFLICT (channel_id, digest) DO NOTHING";
const INSERT_WELCOME_REF: &str = "INSERT INTO relay_welcome_refs (channel_id, \
     key_package_ref, digest) VALUES (?1, ?2, ?3) ON CONFLICT (channel_id, key_package_ref) \
     DO UPDATE SET digest = excluded.digest";
const FIND_KEY: &str = "SELECT seq, channel_epoch FROM relay_entries \
     WHERE channel_id = ?1 AND idempotency_key = ?2";
const CREATE_CHANNEL: &str =
    "INSERT INTO relay_channels (scope, name) VALUES (?1, ?2) RETURNING id";
const LOAD_CHANNEL: &str =
    "SELECT id, epoch, head_seq FROM relay_channels WHERE scope = ?1 AND name = ?2";
const READ: &str = "SELECT seq, epoch, content_type, message FROM relay_entries \
     WHERE channel_id = ?1 AND seq > ?2 ORDER BY seq LIMIT ?3";
const EPOCH_START: &str = "SELECT start_seq FROM relay_epochs WHERE channel_id = ?1 AND epoch = ?2";
const WELCOME_BY_REF: &str = "SELECT digest FROM relay_welcome_refs \
     WHERE channel_id = ?1 AND key_package_ref = ?2";
const WELCOME_BY_DIGEST: &str = "SELECT welcome, commit_seq, epoch FROM relay_welcomes \
     WHERE channel_id = ?1 AND digest = ?2";

/// The writer's connection: WAL, and `synchronous=FULL` so that a commit is on disk (the WAL
/// synced) before anything is answered. The database must exist (with its relay tables).
pub(crate) fn open_writer(path: &Path) -> rusqlite::Result<Connection> {
    let conn = open(path, OpenFlags::SQLITE_OPEN_READ_WRITE)?;
    conn.execute_batch(
        "PRAGMA journal_mode=WAL;
         PRAGMA synchronous=FULL;",
    )?;
    // Fail at open rather than at the first publish when the tables are missing.
    for sql in [
        INSERT_ENTRY,
        UPDATE_HEAD,
        INSERT_EPOCH,
        INSERT_WELCOME,
        INSERT_WELCOME_REF,
        FIND_KEY,
        CREATE_CHANNEL,
    ] {
        conn.prepare_cached(sql)?;
    }
    Ok(conn)
}

/// A connection for reads (a read-only handle: it never takes the write lock).
pub(crate) fn open_reader(path: &Path) -> rusqlite::Result<Connection> {
    open(path, OpenFlags::SQLITE_OPEN_READ_ONLY)
}

/// The background checkpoints' connection. The checkpoint syncs the database file before the
/// WAL may be reused (`synchronous=FULL`).
pub(crate) fn open_checkpointer(path: &Path) -> rusqlite::Result<Connection> {
    let conn = open(path, OpenFlags::SQLITE_OPEN_READ_WRITE)?;
    conn.execute_batch("PRAGMA synchronous=FULL;")?;
    Ok(conn)
}

fn open(path: &Path, access: OpenFlags) -> rusqlite::Result<Connection> {
    // No CREATE: the Python store's migrations made the file; a wrong path fails here.
    let flags = access | OpenFlags::SQLITE_OPEN_URI | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let conn = Connection::open_with_flags(path, flags)?;
    conn.busy_timeout(BUSY_TIMEOUT)?;
    conn.set_prepared_statement_cache_capacity(STATEMENT_CACHE);
    conn.execute_batch("PRAGMA foreign_keys=ON;")?;
    Ok(conn)
}

/// A PASSIVE checkpoint: neither waits for nor blocks the writer.
pub(crate) fn checkpoint(conn: &Connection) -> rusqlite::Result<()> {
    conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(()))
}

/// A constraint refused the statement (for the log: a unique index; for a channel: its name).
pub(crate) fn is_constraint(err: &rusqlite::Error) -> bool {
    matches!(err, rusqlite::Error::SqliteFailure(e, _) if e.code == ErrorCode::ConstraintViolation)
}

/// A channel's row.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ChannelRow {
    pub id: i64,
    pub epoch: u64,
    pub head_seq: u64,
}

/// Create `name` at epoch 0 in `scope` (its epoch-0 row too); None when it exists already.
pub(crate) fn create_channel(
    conn: &mut Connection,
    scope: &str,
    name: &str,
) -> rusqlite::Result<Option<i64>> {
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let inserted = tx
        .prepare_cached(CREATE_CHANNEL)?
        .query_row(params![scope, name], |row| row.get::<_, i64>(0));
    let id = match inserted {
        Ok(id) => id,
        // Dropping `tx` rolls back.
        Err(err) if is_constraint(&err) => return Ok(None),
        Err(err) => return Err(err),
    };
    tx.prepare_cached(INSERT_EPOCH)?
        .execute(params![id, 0i64, 0i64])?;
    tx.commit()?;
    Ok(Some(id))
}

pub(crate) fn load_channel(
    conn: &Connection,
    scope: &str,
    name: &str,
) -> rusqlite::Result<Option<ChannelRow>> {
    conn.prepare_cached(LOAD_CHANNEL)?
        .query_row(params![scope, name], |row| {
            Ok(ChannelRow {
                id: row.get(0)?,
                epoch: row.get(1)?,
                head_seq: row.get(2)?,
            })
        })
        .optional()
}

/// One entry a group commit appends.
pub(crate) struct NewEntry<'a> {
    pub channel_id: i64,
    pub seq: u64,
    pub epoch: u64,
    pub content_type: u32,
    /// The channel's epoch once this entry is appended.
    pub channel_epoch: u64,
    /// A commit that starts `channel_epoch`.
    pub starts_epoch: bool,
    pub key: &'a [u8],
    pub message: &'a [u8],
    /// Empty, or the Welcome kept with this commit.
    pub welcome: &'a [u8],
    pub welcome_refs: &'a [Vec<u8>],
}

/// One group commit in one transaction: the entries (with their epoch starts and Welcomes),
/// then each channel's new `(id, head_seq, epoch)`.
pub(crate) fn append(
    conn: &mut Connection,
    entries: &[NewEntry<'_>],
    heads: impl Iterator<Item = (i64, u64, u64)>,
) -> rusqlite::Result<()> {
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    {
        let mut insert = tx.prepare_cached(INSERT_ENTRY)?;
        for e in entries {
            insert.execute(params![
                e.channel_id,
                e.seq,
                e.epoch,
                e.content_type,
                e.channel_epoch,
                e.key,
                e.message
            ])?;
            if e.starts_epoch {
                tx.prepare_cached(INSERT_EPOCH)?.execute(params![
                    e.channel_id,
                    e.channel_epoch,
                    e.seq
                ])?;
            }
            if !e.welcome.is_empty() {
                let digest = Sha256::digest(e.welcome);
                let digest = digest.as_slice();
                tx.prepare_cached(INSERT_WELCOME)?.execute(params![
                    e.channel_id,
                    digest,
                    e.seq,
                    e.channel_epoch,
                    e.welcome
                ])?;
                let mut insert_ref = tx.prepare_cached(INSERT_WELCOME_REF)?;
                for r in e.welcome_refs {
                    insert_ref.execute(params![e.channel_id, r, digest])?;
                }
            }
        }
        let mut update = tx.prepare_cached(UPDATE_HEAD)?;
        for (id, head_seq, epoch) in heads {
            update.execute(params![id, head_seq, epoch])?;
        }
    }
    tx.commit()
}

/// The entry holding `key` in the channel's log: its (seq, channel_epoch).
pub(crate) fn find_key(
    conn: &Connection,
    channel_id: i64,
    key: &[u8],
) -> rusqlite::Result<Option<(u64, u64)>> {
    conn.prepare_cached(FIND_KEY)?
        .query_row(params![channel_id, key], |row| {
            Ok((row.get(0)?, row.get(1)?))
        })
        .optional()
}

/// Up to `limit` entries after `after_seq`, in order.
pub(crate) fn read(
    conn: &Connection,
    channel_id: i64,
    after_seq: u64,
    limit: usize,
) -> rusqlite::Result<Vec<Entry>> {
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let mut stmt = conn.prepare_cached(READ)?;
    let rows = stmt.query_map(params![channel_id, after_seq, limit], |row| {
        Ok(Entry {
            seq: row.get(0)?,
            epoch: row.get(1)?,
            content_type: row.get(2)?,
            message: Bytes::from(row.get::<_, Vec<u8>>(3)?),
        })
    })?;
    rows.collect()
}

/// The seq after which `epoch` starts, None when the channel never reached it.
pub(crate) fn epoch_start(
    conn: &Connection,
    channel_id: i64,
    epoch: u64,
) -> rusqlite::Result<Option<u64>> {
    conn.prepare_cached(EPOCH_START)?
        .query_row(params![channel_id, epoch], |row| row.get(0))
        .optional()
}

pub(crate) fn fetch_welcome(
    conn: &Connection,
    channel_id: i64,
    key: &WelcomeKey,
) -> rusqlite::Result<Option<WelcomeRecord>> {
    let digest = match key {
        WelcomeKey::Digest(digest) => digest.clone(),
        WelcomeKey::KeyPackageRef(key_package_ref) => {
            let found = conn
                .prepare_cached(WELCOME_BY_REF)?
                .query_row(params![channel_id, key_package_ref], |row| {
                    row.get::<_, Vec<u8>>(0)
                })
                .optional()?;
            match found {
                Some(digest) => digest,
                None => return Ok(None),
            }
        }
    };
    conn.prepare_cached(WELCOME_BY_DIGEST)?
        .query_row(params![channel_id, digest], |row| {
            Ok(WelcomeRecord {
                welcome: Bytes::from(row.get::<_, Vec<u8>>(0)?),
                commit_seq: row.get(1)?,
                epoch: row.get(2)?,
            })
        })
        .optional()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const SCHEMA: &str = include_str!("../../../static/store/migrations/0002_relay.sqlite.sql");

    fn pragma(conn: &Connection, name: &str) -> String {
        conn.query_row(&format!("PRAGMA {name}"), [], |row| {
            row.get::<_, rusqlite::types::Value>(0)
        })
        .map(|v| match v {
            rusqlite::types::Value::Integer(i) => i.to_string(),
            rusqlite::types::Value::Text(t) => t,
            other => format!("{other:?}"),
        })
        .unwrap()
    }

    #[test]
    fn connections_are_durable_and_patient() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("static.sqlite3");
        Connection::open(&path)
            .unwrap()
            .execute_batch(SCHEMA)
            .unwrap();
        let writer = open_writer(&path).unwrap();
        assert_eq!(pragma(&writer, "journal_mode"), "wal");
        // FULL = 2: the WAL is synced at every commit.
        assert_eq!(pragma(&writer, "synchronous"), "2");
        assert_eq!(pragma(&writer, "foreign_keys"), "1");
        assert_eq!(pragma(&writer, "busy_timeout"), "10000");
        let reader = open_reader(&path).unwrap();
        assert_eq!(pragma(&reader, "busy_timeout"), "10000");
        assert!(reader
            .execute(
                "INSERT INTO relay_channels (scope, name) VALUES ('', 'x')",
                []
            )
            .is_err());
        let checkpointer = open_checkpointer(&path).unwrap();
        assert_eq!(pragma(&checkpointer, "synchronous"), "2");
        checkpoint(&checkpointer).unwrap();
    }
}
