//! The log on SQLite (`static/store/migrations/0002_relay.sqlite.sql`): one relay per
//! database file, so memory is authoritative. The writer decides a batch from the channels'
//! heads in memory and stores it in one transaction (WAL, `synchronous=FULL`); idempotency is
//! optimistic: the unique index (channel_id, idempotency_key) refuses a retry, and only then
//! are the batch's keys looked up and the batch decided again. A publish refused by the fence
//! may still be the retry of a logged message: only those are looked up, after the commit.
//!
//! The unique index leads with the key's generation ([`super::keys`]): a publish touches only
//! the current generation's part of it, and a key of an older generation is looked up when
//! that generation's filter says it may be there, before the batch is decided.
//!
//! Reads run on read-only connections on the blocking pool. A PASSIVE WAL checkpoint runs on
//! its own thread and connection every [`CHECKPOINT_COMMITS`] group commits or
//! [`CHECKPOINT_BYTES`] of messages, so that SQLite's autocheckpoint (the fallback) rarely
//! runs inside a commit. The Python API writes other tables of the same file (hence
//! `busy_timeout`). Every statement goes through the connection's statement cache.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;

use super::connect::open_connection;
use bytes::Bytes;
use rusqlite::{params, Connection, ErrorCode, OpenFlags, OptionalExtension, TransactionBehavior};
use sha2::{Digest, Sha256};

use crate::clock::now_ms;
use crate::error::{RelayError, Result};
use crate::store::keys::Generations;
use crate::wire::fence::{Decision, Plan};
use crate::wire::rules::org_key;
// The shared statements, in SQLite's `?N` form (rewritten at compile time).
use crate::store::sql::sqlite::{
    ACCOUNT_CHANNELS, ACCOUNT_RATE, BIND, BOUND_KEYS, BOUND_WELCOME_LEAF, BYTES_CUT, CLAIM_ORG,
    DELETE_WELCOME, DELETE_WELCOME_LEAVES, DELETE_WELCOME_REFS, EPOCH_START, EXPIRED_WELCOMES,
    EXTERNAL_SENDER, FIRST_SINCE, INSERT_AUDIT, INSERT_EPOCH, INSERT_EXTERNAL_SENDER, INSERT_GROUP,
    INSERT_PROPOSAL, INSERT_WELCOME, INSERT_WELCOME_REF, LEAVES_OF_KEY, LOAD_CHANNEL, LOAD_GROUP,
    MARK_USED, ORG_OWNER, PROBE, PROPOSALS, PRUNE_ENTRIES, PRUNE_EPOCHS, PRUNE_HORIZON,
    PRUNE_PROPOSALS, RETENTION_ROW, RETENTION_ROWS, SET_RETENTION, SHADOWED, UPDATE_GROUP,
    WELCOMES_DUE, WELCOME_BY_DIGEST, WELCOME_FLOOR,
};
use crate::store::AuditRow;
use crate::store::{
    decide, in_memory, new_entries, new_heads, AccountChannelRow, Append, Binding, ChannelRow,
    Creation, Entry, LogReader, LogWriter, NewChannel, NewEntry, Opened, Policy, PruneStep,
    RetentionRow, SenderKey, StoreFuture, StoredBinding, StoredGroup, WelcomeKey, WelcomeRecord,
};

/// A background WAL checkpoint after this many group commits or message bytes, whichever
/// first: well under SQLite's autocheckpoint (1,000 pages), which would run inside a commit.
const CHECKPOINT_COMMITS: u32 = 64;
const CHECKPOINT_BYTES: usize = 1024 * 1024;
/// Idle read connections kept for the next read.
const IDLE_READERS: usize = 4;

// SQLite's own statements; the shared ones are in `store/sql.rs`. A row a statement: SQLite has
// no arrays, and a cached statement in-process costs no round trip, where PostgreSQL's writes
// take a batch's rows at once (UNNEST) and its reads decide more in one statement.

/// Per entry, with its key's generation (`store/keys.rs`: SQLite's alone).
const INSERT_ENTRY: &str = "INSERT INTO relay_entries (channel_id, seq, epoch, content_type, \
     channel_epoch, idempotency_key, message, account, key_gen, appended_at) \
     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)";
const UPDATE_HEAD: &str = "UPDATE relay_channels SET head_seq = ?2, epoch = ?3 WHERE id = ?1";
const INSERT_WELCOME_LEAF: &str = "INSERT INTO relay_welcome_leaves (channel_id, leaf_index, \
     digest) VALUES (?1, ?2, ?3) ON CONFLICT (channel_id, leaf_index) \
     DO UPDATE SET digest = excluded.digest";
/// One key in one generation's part of the unique index.
const FIND_KEY: &str = "SELECT seq, channel_epoch FROM relay_entries \
     WHERE key_gen = ?3 AND channel_id = ?1 AND idempotency_key = ?2";
/// The generations of the log's keys and their sizes (at open; the index alone answers).
const KEY_GENERATIONS: &str =
    "SELECT key_gen, count(*) FROM relay_entries GROUP BY key_gen ORDER BY key_gen";
const GENERATION_KEYS: &str =
    "SELECT channel_id, idempotency_key FROM relay_entries WHERE key_gen = ?1";
/// A name taken fails the INSERT (`is_constraint`) and the transaction is dropped; PostgreSQL's
/// form skips the row instead, since a failed statement aborts its whole transaction.
const CREATE_CHANNEL: &str =
    "INSERT INTO relay_channels (scope, name) VALUES ('', ?1) RETURNING id";
/// A removed leaf's binding goes; its account's departure is kept apart (migration 0008), where
/// no later binding of the same leaf index overwrites it. Per leaf, in two statements:
/// PostgreSQL's form is one (an array of leaves, a data-modifying WITH).
const UNBIND: &str = "DELETE FROM relay_members \
     WHERE channel_id = ?1 AND leaf_index = ?2 AND removed_seq IS NULL RETURNING account";
const DEPART: &str = "INSERT INTO relay_departures (channel_id, account, leaf_index, removed_seq) \
     VALUES (?1, ?2, ?3, ?4) ON CONFLICT (channel_id, account) DO UPDATE \
     SET leaf_index = excluded.leaf_index, removed_seq = excluded.removed_seq \
     WHERE excluded.removed_seq > relay_departures.removed_seq";
/// No `FOR UPDATE` (SQLite has no row locks): the IMMEDIATE transaction holds the write lock.
const CHANNEL_EPOCH: &str = "SELECT epoch FROM relay_channels WHERE id = ?1";
/// A bare NULL: PostgreSQL's form casts it (`NULL::bytea`), which SQLite cannot parse.
const LOAD_GROUP_EPOCH: &str = "SELECT epoch, NULL FROM relay_groups WHERE channel_id = ?1";
/// The bound leaves, then each departed account's last removal (a bare NULL, as above).
const LOAD_BINDINGS: &str = "SELECT leaf_index, account, NULL FROM relay_members \
     WHERE channel_id = ?1 UNION ALL SELECT leaf_index, account, removed_seq \
     FROM relay_departures WHERE channel_id = ?1";
/// The page's bytes are counted while stepping (`read`), not by the database as PostgreSQL's
/// form does to spare the network the rows past the page.
const READ: &str = "SELECT seq, epoch, content_type, message, account FROM relay_entries \
     WHERE channel_id = ?1 AND seq > ?2 ORDER BY seq LIMIT ?3";
/// The digest, then the Welcome by `WELCOME_BY_DIGEST`: two cached look-ups in-process, where
/// PostgreSQL joins them to save a round trip.
const WELCOME_BY_REF: &str = "SELECT digest FROM relay_welcome_refs \
     WHERE channel_id = ?1 AND key_package_ref = ?2";

/// The writer's connection: WAL, and `synchronous=FULL` so that a commit is on disk (the WAL
/// synced) before anything is answered. The database must exist (with its relay tables).
fn open_writer(path: &Path) -> rusqlite::Result<Connection> {
    let conn = open_connection(path, OpenFlags::SQLITE_OPEN_READ_WRITE)?;
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
        UPDATE_GROUP,
        BIND,
        DEPART,
        INSERT_PROPOSAL,
    ] {
        conn.prepare_cached(sql)?;
    }
    Ok(conn)
}

/// A connection for reads (a read-only handle: it never takes the write lock).
fn open_reader(path: &Path) -> rusqlite::Result<Connection> {
    open_connection(path, OpenFlags::SQLITE_OPEN_READ_ONLY)
}

/// The background checkpoints' connection. The checkpoint syncs the database file before the
/// WAL may be reused (`synchronous=FULL`).
fn open_checkpointer(path: &Path) -> rusqlite::Result<Connection> {
    let conn = open_connection(path, OpenFlags::SQLITE_OPEN_READ_WRITE)?;
    conn.execute_batch("PRAGMA synchronous=FULL;")?;
    Ok(conn)
}

/// A PASSIVE checkpoint: neither waits for nor blocks the writer.
fn checkpoint(conn: &Connection) -> rusqlite::Result<()> {
    conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(()))
}

/// A constraint refused the statement (for the log: a unique index; for a channel: its name).
fn is_constraint(err: &rusqlite::Error) -> bool {
    matches!(err, rusqlite::Error::SqliteFailure(e, _) if e.code == ErrorCode::ConstraintViolation)
}

/// Create a channel: its org claimed (or owned already), its row, its epoch-0 row, its group
/// and the creator's binding, in one transaction.
fn create_channel(conn: &mut Connection, new: &NewChannel<'_>) -> rusqlite::Result<Creation> {
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    // Orgs are owned by their key: look-alikes are one org (migration 0009).
    let org = org_key(new.org);
    let claimed = tx
        .prepare_cached(CLAIM_ORG)?
        .execute(params![org, new.account])?
        > 0;
    let owner: String = tx
        .prepare_cached(ORG_OWNER)?
        .query_row(params![org], |row| row.get(0))?;
    if owner != new.account {
        return Ok(Creation::OrgTaken);
    }
    let inserted = tx
        .prepare_cached(CREATE_CHANNEL)?
        .query_row(params![new.name], |row| row.get::<_, i64>(0));
    let id = match inserted {
        Ok(id) => id,
        // Dropping `tx` rolls back.
        Err(err) if is_constraint(&err) => return Ok(Creation::NameTaken),
        Err(err) => return Err(err),
    };
    tx.prepare_cached(INSERT_EPOCH)?
        .execute(params![id, 0i64, 0i64])?;
    tx.prepare_cached(INSERT_GROUP)?
        .execute(params![id, 0i64, new.state])?;
    tx.prepare_cached(BIND)?
        .execute(params![id, new.leaf, new.account, new.key_id])?;
    let claim = new.claimed.filter(|_| claimed);
    insert_audit(&tx, new.audit.iter().chain(claim))?;
    tx.commit()?;
    Ok(Creation::Done(id))
}

/// Audit rows, in the caller's transaction.
fn insert_audit<'a>(
    conn: &Connection,
    rows: impl IntoIterator<Item = &'a AuditRow>,
) -> rusqlite::Result<()> {
    let mut insert = conn.prepare_cached(INSERT_AUDIT)?;
    for row in rows {
        insert.execute(params![
            row.account,
            row.at_ms,
            row.kind,
            row.key_id,
            row.channel,
            row.detail
        ])?;
    }
    Ok(())
}

/// Binds a leaf if the channel is still at the proof's epoch.
fn bind(conn: &mut Connection, binding: &Binding<'_>) -> rusqlite::Result<bool> {
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let epoch: u64 = tx
        .prepare_cached(CHANNEL_EPOCH)?
        .query_row(params![binding.channel_id], |row| row.get(0))?;
    if epoch != binding.epoch {
        return Ok(false);
    }
    tx.prepare_cached(BIND)?.execute(params![
        binding.channel_id,
        binding.leaf,
        binding.account,
        binding.key_id
    ])?;
    let awaited: Option<Vec<u8>> = tx
        .prepare_cached(BOUND_WELCOME_LEAF)?
        .query_row(params![binding.channel_id, binding.leaf], |row| row.get(0))
        .optional()?;
    if let Some(digest) = awaited {
        tx.prepare_cached(MARK_USED)?.execute(params![
            binding.channel_id,
            digest,
            binding.now_ms
        ])?;
    }
    tx.commit()?;
    Ok(true)
}

fn load_channel(
    conn: &Connection,
    account: &str,
    name: &str,
) -> rusqlite::Result<Option<ChannelRow>> {
    conn.prepare_cached(LOAD_CHANNEL)?
        .query_row(params![account, name], |row| {
            let legacy: bool = row.get(5)?;
            Ok(ChannelRow {
                id: row.get(0)?,
                epoch: row.get(1)?,
                head_seq: row.get(2)?,
                scope: row.get(3)?,
                legacy_owner: if legacy {
                    Some(row.get::<_, Option<String>>(4)?.unwrap_or_default())
                } else {
                    None
                },
                horizon: row.get(6)?,
            })
        })
        .optional()
}

fn load_group(
    conn: &Connection,
    channel_id: i64,
    with_state: bool,
) -> rusqlite::Result<Option<StoredGroup>> {
    let sql = if with_state {
        LOAD_GROUP
    } else {
        LOAD_GROUP_EPOCH
    };
    let Some((epoch, state)) = conn
        .prepare_cached(sql)?
        .query_row(params![channel_id], |row| Ok((row.get(0)?, row.get(1)?)))
        .optional()?
    else {
        return Ok(None);
    };
    let bindings = bindings(conn, channel_id)?;
    Ok(Some(StoredGroup {
        epoch,
        state,
        bindings,
    }))
}

fn bindings(conn: &Connection, channel_id: i64) -> rusqlite::Result<Vec<StoredBinding>> {
    let mut stmt = conn.prepare_cached(LOAD_BINDINGS)?;
    let rows = stmt.query_map(params![channel_id], |row| {
        Ok(StoredBinding {
            leaf: row.get(0)?,
            account: row.get(1)?,
            removed_seq: row.get(2)?,
        })
    })?;
    rows.collect()
}

fn proposals(conn: &Connection, channel_id: i64, epoch: u64) -> rusqlite::Result<Vec<Bytes>> {
    let mut stmt = conn.prepare_cached(PROPOSALS)?;
    let rows = stmt.query_map(params![channel_id, epoch], |row| {
        Ok(Bytes::from(row.get::<_, Vec<u8>>(0)?))
    })?;
    rows.collect()
}

fn shadowed_names(conn: &Connection) -> rusqlite::Result<Vec<String>> {
    let mut stmt = conn.prepare(SHADOWED)?;
    let rows = stmt.query_map([], |row| row.get(0))?;
    rows.collect()
}

/// One group commit in one transaction: the entries (with their epoch starts and Welcomes),
/// then each channel's new `(id, head_seq, epoch)`.
fn append(
    conn: &mut Connection,
    entries: &[NewEntry<'_>],
    heads: impl Iterator<Item = (i64, u64, u64)>,
    key_gen: u64,
) -> rusqlite::Result<()> {
    let now = now_ms();
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
                e.message,
                e.account,
                key_gen,
                now
            ])?;
            if e.keep_proposal {
                tx.prepare_cached(INSERT_PROPOSAL)?.execute(params![
                    e.channel_id,
                    e.epoch,
                    e.seq,
                    e.message
                ])?;
            }
            if let Some(change) = e.change {
                tx.prepare_cached(UPDATE_GROUP)?.execute(params![
                    e.channel_id,
                    change.epoch,
                    change.state
                ])?;
                let mut unbind = tx.prepare_cached(UNBIND)?;
                let mut depart = tx.prepare_cached(DEPART)?;
                for leaf in change.removed {
                    let account: Option<String> = unbind
                        .query_row(params![e.channel_id, leaf], |row| row.get(0))
                        .optional()?;
                    if let Some(account) = account {
                        depart.execute(params![e.channel_id, account, leaf, e.seq])?;
                    }
                }
                insert_audit(&tx, change.audit)?;
            }
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
                    e.welcome,
                    now
                ])?;
                let mut insert_ref = tx.prepare_cached(INSERT_WELCOME_REF)?;
                for r in e.welcome_refs {
                    insert_ref.execute(params![e.channel_id, r, digest])?;
                }
                let mut insert_leaf = tx.prepare_cached(INSERT_WELCOME_LEAF)?;
                for leaf in e.welcome_leaves {
                    insert_leaf.execute(params![e.channel_id, leaf, digest])?;
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

/// One prune step, in one transaction.
fn prune(conn: &mut Connection, step: &PruneStep) -> rusqlite::Result<()> {
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    tx.prepare_cached(PRUNE_ENTRIES)?
        .execute(params![step.channel_id, step.horizon, step.to])?;
    tx.prepare_cached(PRUNE_HORIZON)?
        .execute(params![step.channel_id, step.to])?;
    tx.prepare_cached(PRUNE_EPOCHS)?
        .execute(params![step.channel_id, step.to])?;
    tx.prepare_cached(PRUNE_PROPOSALS)?
        .execute(params![step.channel_id])?;
    tx.commit()
}

/// Up to `limit` expired or used Welcomes deleted, in one transaction.
fn expire_welcomes(
    conn: &mut Connection,
    created_before: i64,
    used_before: i64,
    limit: usize,
) -> rusqlite::Result<usize> {
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let expired: Vec<(i64, Vec<u8>)> = {
        let mut stmt = tx.prepare_cached(EXPIRED_WELCOMES)?;
        let rows = stmt.query_map(params![created_before, used_before, limit], |row| {
            Ok((row.get(0)?, row.get(1)?))
        })?;
        rows.collect::<rusqlite::Result<_>>()?
    };
    for (channel_id, digest) in &expired {
        for sql in [DELETE_WELCOME_REFS, DELETE_WELCOME_LEAVES, DELETE_WELCOME] {
            tx.prepare_cached(sql)?
                .execute(params![channel_id, digest])?;
        }
    }
    tx.commit()?;
    Ok(expired.len())
}

/// A policy's limits as stored (NULL: the default; SQLite integers are i64).
fn policy_params(policy: &Policy) -> [Option<i64>; 3] {
    let db = |v: Option<u64>| v.map(|v| i64::try_from(v).unwrap_or(i64::MAX));
    [
        db(policy.max_age_seconds),
        db(policy.max_entries),
        db(policy.max_bytes),
    ]
}

fn retention_row(row: &rusqlite::Row<'_>) -> rusqlite::Result<RetentionRow> {
    let limit = |i: usize| -> rusqlite::Result<Option<u64>> {
        Ok(row
            .get::<_, Option<i64>>(i)?
            .map(|v| u64::try_from(v).unwrap_or(0)))
    };
    Ok(RetentionRow {
        id: row.get(0)?,
        head_seq: row.get(1)?,
        horizon: row.get(2)?,
        policy: Policy {
            max_age_seconds: limit(3)?,
            max_entries: limit(4)?,
            max_bytes: limit(5)?,
        },
    })
}

fn retention_rows(
    conn: &Connection,
    after_id: i64,
    limit: usize,
) -> rusqlite::Result<Vec<RetentionRow>> {
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let mut stmt = conn.prepare_cached(RETENTION_ROWS)?;
    let rows = stmt.query_map(params![after_id, limit], retention_row)?;
    rows.collect()
}

fn retention_row_of(conn: &Connection, channel_id: i64) -> rusqlite::Result<Option<RetentionRow>> {
    conn.prepare_cached(RETENTION_ROW)?
        .query_row(params![channel_id], retention_row)
        .optional()
}

fn first_since(
    conn: &Connection,
    channel_id: i64,
    after_seq: u64,
    up_to: u64,
    since_ms: i64,
) -> rusqlite::Result<Option<u64>> {
    conn.prepare_cached(FIRST_SINCE)?
        .query_row(params![channel_id, after_seq, up_to, since_ms], |row| {
            row.get(0)
        })
        .optional()
}

fn bytes_cut(
    conn: &Connection,
    channel_id: i64,
    after_seq: u64,
    max_bytes: u64,
) -> rusqlite::Result<Option<u64>> {
    let max_bytes = i64::try_from(max_bytes).unwrap_or(i64::MAX);
    conn.prepare_cached(BYTES_CUT)?
        .query_row(params![channel_id, after_seq, max_bytes], |row| row.get(0))
        .optional()
}

fn welcome_floor(conn: &Connection, channel_id: i64) -> rusqlite::Result<Option<u64>> {
    conn.prepare_cached(WELCOME_FLOOR)?
        .query_row(params![channel_id], |row| row.get(0))
}

fn bound_keys(conn: &Connection, after: &str, limit: usize) -> rusqlite::Result<Vec<String>> {
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let mut stmt = conn.prepare_cached(BOUND_KEYS)?;
    let rows = stmt.query_map(params![after, limit], |row| row.get(0))?;
    rows.collect()
}

fn leaves_of_key(
    conn: &Connection,
    key_id: &str,
    limit: usize,
) -> rusqlite::Result<Vec<(String, u32)>> {
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let mut stmt = conn.prepare_cached(LEAVES_OF_KEY)?;
    let rows = stmt.query_map(params![key_id, limit], |row| Ok((row.get(0)?, row.get(1)?)))?;
    rows.collect()
}

fn account_channels(
    conn: &Connection,
    account: &str,
    after_id: i64,
    limit: usize,
) -> rusqlite::Result<Vec<AccountChannelRow>> {
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let mut stmt = conn.prepare_cached(ACCOUNT_CHANNELS)?;
    let rows = stmt.query_map(params![account, after_id, limit], |row| {
        let limit = |i: usize| -> rusqlite::Result<Option<u64>> {
            Ok(row
                .get::<_, Option<i64>>(i)?
                .map(|v| u64::try_from(v).unwrap_or(0)))
        };
        Ok(AccountChannelRow {
            id: row.get(0)?,
            name: row.get(1)?,
            epoch: row.get(2)?,
            head_seq: row.get(3)?,
            policy: Policy {
                max_age_seconds: limit(4)?,
                max_entries: limit(5)?,
                max_bytes: limit(6)?,
            },
            // 0: appended before the time was recorded (migration 0004).
            last_activity_ms: row.get::<_, Option<i64>>(7)?.filter(|at| *at > 0),
        })
    })?;
    rows.collect()
}

fn account_rate(
    conn: &Connection,
    account: &str,
    since_ms: i64,
    content_type: u32,
    limit: usize,
) -> rusqlite::Result<Vec<(String, i64, u64)>> {
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let mut stmt = conn.prepare_cached(ACCOUNT_RATE)?;
    let rows = stmt.query_map(params![account, since_ms, content_type, limit], |row| {
        Ok((row.get(0)?, row.get(1)?, row.get(2)?))
    })?;
    rows.collect()
}

/// The relay's external sender key pair: the one stored, or `offered` stored now.
fn external_sender(conn: &Connection, offered: &SenderKey) -> rusqlite::Result<SenderKey> {
    conn.prepare_cached(INSERT_EXTERNAL_SENDER)?
        .execute(params![offered.public, offered.private, now_ms()])?;
    conn.prepare_cached(EXTERNAL_SENDER)?.query_row([], |row| {
        Ok(SenderKey {
            public: row.get(0)?,
            private: row.get(1)?,
        })
    })
}

fn org_owner(conn: &Connection, org: &str) -> rusqlite::Result<Option<String>> {
    conn.prepare_cached(ORG_OWNER)?
        .query_row(params![org_key(org)], |row| row.get(0))
        .optional()
}

/// The entry holding `key` in the channel's log: its (seq, channel_epoch). Looks in the
/// current generation, then in the older ones whose filters may hold it (`older_only`: only
/// those).
fn find_key(
    conn: &Connection,
    generations: &Generations,
    channel_id: i64,
    key: &[u8],
    older_only: bool,
) -> rusqlite::Result<Option<(u64, u64)>> {
    let current = (!older_only).then(|| generations.current());
    for generation in current
        .into_iter()
        .chain(generations.older_candidates(channel_id, key))
    {
        let found = conn
            .prepare_cached(FIND_KEY)?
            .query_row(params![channel_id, key, generation], |row| {
                Ok((row.get(0)?, row.get(1)?))
            })
            .optional()?;
        if found.is_some() {
            return Ok(found);
        }
    }
    Ok(None)
}

/// The generations of the log's keys, with a filter of each (one scan of the index).
fn load_generations(conn: &Connection) -> rusqlite::Result<Generations> {
    let mut generations = Generations::new();
    let sizes = conn
        .prepare(KEY_GENERATIONS)?
        .query_map([], |row| Ok((row.get::<_, u64>(0)?, row.get::<_, u64>(1)?)))?
        .collect::<rusqlite::Result<Vec<_>>>()?;
    let mut keys = conn.prepare(GENERATION_KEYS)?;
    for (generation, count) in sizes {
        generations.load(generation, count);
        let mut rows = keys.query(params![generation])?;
        while let Some(row) = rows.next()? {
            let channel_id: i64 = row.get(0)?;
            let key = row.get_ref(1)?.as_blob()?;
            generations.appended(channel_id, key);
        }
        generations.roll_if_full();
    }
    Ok(generations)
}

/// Up to `limit` entries after `after_seq`, in order.
fn read(
    conn: &Connection,
    channel_id: i64,
    after_seq: u64,
    limit: usize,
    max_bytes: usize,
) -> rusqlite::Result<Vec<Entry>> {
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let mut stmt = conn.prepare_cached(READ)?;
    let mut rows = stmt.query(params![channel_id, after_seq, limit])?;
    let mut page = Vec::new();
    let mut bytes = 0usize;
    // Stepped row by row: the rows past the page's bytes are never copied out.
    while bytes < max_bytes {
        let Some(row) = rows.next()? else { break };
        let message = row.get::<_, Vec<u8>>(3)?;
        bytes = bytes.saturating_add(message.len());
        page.push(Entry {
            seq: row.get(0)?,
            epoch: row.get(1)?,
            content_type: row.get(2)?,
            message: Bytes::from(message),
            account: Arc::from(row.get::<_, String>(4)?),
        });
    }
    Ok(page)
}

/// The seq after which `epoch` starts, None when the channel never reached it.
fn epoch_start(conn: &Connection, channel_id: i64, epoch: u64) -> rusqlite::Result<Option<u64>> {
    conn.prepare_cached(EPOCH_START)?
        .query_row(params![channel_id, epoch], |row| row.get(0))
        .optional()
}

fn fetch_welcome(
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

/// Opens the writer, a first reader and the checkpointer on the database file `path`.
pub(crate) fn open(path: &Path) -> Result<Opened> {
    let conn = open_writer(path).map_err(RelayError::store)?;
    let external_sender =
        external_sender(&conn, &SenderKey::generate()?).map_err(RelayError::store)?;
    let generations = load_generations(&conn).map_err(RelayError::store)?;
    let reader = SqliteReader(Arc::new(ReadPool {
        idle: Mutex::new(vec![open_reader(path).map_err(RelayError::store)?]),
        path: path.to_owned(),
    }));
    let checkpointer = Checkpointer::start(open_checkpointer(path).map_err(RelayError::store)?)?;
    Ok(Opened {
        writer: Box::new(SqliteWriter {
            conn,
            generations,
            checkpointer,
            commits_since_checkpoint: 0,
            bytes_since_checkpoint: 0,
        }),
        reader: Arc::new(reader),
        directory: Arc::new(super::directory::sqlite::SqliteDirectory::open(path)?),
        external_sender,
    })
}

struct SqliteWriter {
    conn: Connection,
    generations: Generations,
    checkpointer: Checkpointer,
    commits_since_checkpoint: u32,
    bytes_since_checkpoint: usize,
}

/// Per publish of a batch, the (seq, channel_epoch) of the entry holding its key.
type Found = Vec<Option<(u64, u64)>>;

impl LogWriter for SqliteWriter {
    fn commits_inline(&self) -> bool {
        true
    }

    fn create_channel(&mut self, channel: &NewChannel<'_>) -> Result<Creation> {
        let created = create_channel(&mut self.conn, channel).map_err(RelayError::store)?;
        if matches!(created, Creation::Done(_)) {
            self.count_commit(channel.state.len());
        }
        Ok(created)
    }

    fn bind(&mut self, binding: &Binding<'_>) -> Result<bool> {
        let bound = bind(&mut self.conn, binding).map_err(RelayError::store)?;
        if bound {
            self.count_commit(0);
        }
        Ok(bound)
    }

    fn prune(&mut self, step: &PruneStep) -> Result<()> {
        prune(&mut self.conn, step).map_err(RelayError::store)?;
        self.count_commit(0);
        Ok(())
    }

    fn expire_welcomes(
        &mut self,
        created_before: i64,
        used_before: i64,
        limit: usize,
    ) -> Result<usize> {
        let expired = expire_welcomes(&mut self.conn, created_before, used_before, limit)
            .map_err(RelayError::store)?;
        if expired > 0 {
            self.count_commit(0);
        }
        Ok(expired)
    }

    fn set_retention(
        &mut self,
        channel_id: i64,
        policy: &Policy,
        audit: Option<&AuditRow>,
    ) -> Result<()> {
        let [age, entries, bytes] = policy_params(policy);
        let set = |conn: &mut Connection| -> rusqlite::Result<()> {
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            tx.prepare_cached(SET_RETENTION)?
                .execute(params![channel_id, age, entries, bytes])?;
            insert_audit(&tx, audit)?;
            tx.commit()
        };
        set(&mut self.conn).map_err(RelayError::store)?;
        self.count_commit(0);
        Ok(())
    }

    fn probe(&mut self, now_ms: i64) -> Result<()> {
        self.conn
            .prepare_cached(PROBE)
            .and_then(|mut stmt| stmt.execute(params![now_ms]))
            .map_err(RelayError::store)?;
        self.count_commit(0);
        Ok(())
    }

    fn append(&mut self, batch: &[Append<'_>], window: u64) -> Result<Plan> {
        let mut looked_up = false;
        // Retries of older generations (the unique index only refuses the current one's).
        let older = self.find_older_keys(batch).map_err(RelayError::store)?;
        let mut plan = decide(batch, in_memory, older.as_deref(), window);
        let mut stored = self.store(batch, &plan);
        if matches!(&stored, Err(err) if is_constraint(err)) {
            // A retried publish hit the unique index: find the batch's keys in the log and
            // decide again (the failed transaction was rolled back).
            looked_up = true;
            stored = self.find_keys(batch).and_then(|found| {
                plan = decide(batch, in_memory, Some(&found), window);
                self.store(batch, &plan)
            });
        }
        // On error a duplicate found within the batch would point at an entry that does not
        // exist, and a refusal may be a retry we could not look up: the whole batch fails.
        stored.map_err(RelayError::store)?;
        if plan.appends() {
            let entries = new_entries(batch, &plan);
            for e in &entries {
                self.generations.appended(e.channel_id, e.key);
            }
            self.generations.roll_if_full();
            let bytes = entries.iter().map(|e| e.message.len()).sum();
            self.count_commit(bytes);
        }
        if !looked_up {
            // A refusal may be a retry of a message logged before (possibly now stale).
            for (p, decision) in batch.iter().zip(plan.decisions.iter_mut()) {
                if matches!(decision, Decision::Refused(_)) {
                    match self.find_key(p.channel_id, p.key, false) {
                        Ok(Some((seq, channel_epoch))) => {
                            *decision = Decision::Duplicate { seq, channel_epoch };
                        }
                        Ok(None) => {}
                        Err(err) => *decision = Decision::Refused(RelayError::store(err)),
                    }
                }
            }
        }
        Ok(plan)
    }
}

impl SqliteWriter {
    fn find_key(
        &self,
        channel_id: i64,
        key: &[u8],
        older_only: bool,
    ) -> rusqlite::Result<Option<(u64, u64)>> {
        find_key(&self.conn, &self.generations, channel_id, key, older_only)
    }

    /// The batch's keys already in the log: per publish, the (seq, channel_epoch) holding it.
    fn find_keys(&self, batch: &[Append<'_>]) -> rusqlite::Result<Found> {
        batch
            .iter()
            .map(|p| self.find_key(p.channel_id, p.key, false))
            .collect()
    }

    /// The batch's keys found in older generations, None when there are none (the usual case:
    /// a filter check per older generation and publish, and a look-up for ~1% of them).
    fn find_older_keys(&self, batch: &[Append<'_>]) -> rusqlite::Result<Option<Found>> {
        let found = batch
            .iter()
            .map(|p| self.find_key(p.channel_id, p.key, true))
            .collect::<rusqlite::Result<Vec<_>>>()?;
        Ok(found.iter().any(Option::is_some).then_some(found))
    }

    /// Stores the plan's entries and heads in one transaction (none when nothing is appended).
    fn store(&mut self, batch: &[Append<'_>], plan: &Plan) -> rusqlite::Result<()> {
        let entries = new_entries(batch, plan);
        if entries.is_empty() {
            return Ok(());
        }
        append(
            &mut self.conn,
            &entries,
            new_heads(plan),
            self.generations.current(),
        )
    }

    fn count_commit(&mut self, bytes: usize) {
        self.commits_since_checkpoint += 1;
        self.bytes_since_checkpoint += bytes;
        if self.commits_since_checkpoint >= CHECKPOINT_COMMITS
            || self.bytes_since_checkpoint >= CHECKPOINT_BYTES
        {
            self.commits_since_checkpoint = 0;
            self.bytes_since_checkpoint = 0;
            self.checkpointer.request();
        }
    }
}

/// The reads, on the blocking pool.
struct SqliteReader(Arc<ReadPool>);

/// Read connections, opened when needed and kept (a few) for the next read.
struct ReadPool {
    path: PathBuf,
    idle: Mutex<Vec<Connection>>,
}

impl ReadPool {
    fn run<T>(&self, read: impl FnOnce(&Connection) -> rusqlite::Result<T>) -> rusqlite::Result<T> {
        let idle = self
            .idle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop();
        let conn = match idle {
            Some(conn) => conn,
            None => open_reader(&self.path)?,
        };
        let result = read(&conn);
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        if idle.len() < IDLE_READERS {
            idle.push(conn);
        }
        result
    }
}

/// Runs `read` on a read connection of `reader`, on the blocking pool.
fn on_pool<T, F>(reader: &SqliteReader, read: F) -> StoreFuture<T>
where
    T: Send + 'static,
    F: FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
{
    let reader = Arc::clone(&reader.0);
    Box::pin(async move {
        match tokio::task::spawn_blocking(move || reader.run(read)).await {
            Ok(result) => result.map_err(RelayError::store),
            Err(err) if err.is_cancelled() => Err(crate::error::shutting_down()),
            // A panic in a read: a bug.
            Err(_) => Err(RelayError::Internal),
        }
    })
}

impl LogReader for SqliteReader {
    fn load_channel(&self, account: &str, name: &str) -> StoreFuture<Option<ChannelRow>> {
        let (account, name) = (account.to_owned(), name.to_owned());
        on_pool(self, move |conn| load_channel(conn, &account, &name))
    }

    fn load_group(&self, channel_id: i64, with_state: bool) -> StoreFuture<Option<StoredGroup>> {
        on_pool(self, move |conn| load_group(conn, channel_id, with_state))
    }

    fn bindings(&self, channel_id: i64) -> StoreFuture<Vec<StoredBinding>> {
        on_pool(self, move |conn| bindings(conn, channel_id))
    }

    fn proposals(&self, channel_id: i64, epoch: u64) -> StoreFuture<Vec<Bytes>> {
        on_pool(self, move |conn| proposals(conn, channel_id, epoch))
    }

    fn shadowed_names(&self) -> StoreFuture<Vec<String>> {
        on_pool(self, shadowed_names)
    }

    fn read(
        &self,
        channel_id: i64,
        after_seq: u64,
        limit: usize,
        max_bytes: usize,
    ) -> StoreFuture<Vec<Entry>> {
        on_pool(self, move |conn| {
            read(conn, channel_id, after_seq, limit, max_bytes)
        })
    }

    fn epoch_start(&self, channel_id: i64, epoch: u64) -> StoreFuture<Option<u64>> {
        on_pool(self, move |conn| epoch_start(conn, channel_id, epoch))
    }

    fn fetch_welcome(
        &self,
        channel_id: i64,
        key: WelcomeKey,
    ) -> StoreFuture<Option<WelcomeRecord>> {
        on_pool(self, move |conn| fetch_welcome(conn, channel_id, &key))
    }

    fn retention_rows(&self, after_id: i64, limit: usize) -> StoreFuture<Vec<RetentionRow>> {
        on_pool(self, move |conn| retention_rows(conn, after_id, limit))
    }

    fn retention_row(&self, channel_id: i64) -> StoreFuture<Option<RetentionRow>> {
        on_pool(self, move |conn| retention_row_of(conn, channel_id))
    }

    fn first_since(
        &self,
        channel_id: i64,
        after_seq: u64,
        up_to: u64,
        since_ms: i64,
    ) -> StoreFuture<Option<u64>> {
        on_pool(self, move |conn| {
            first_since(conn, channel_id, after_seq, up_to, since_ms)
        })
    }

    fn bytes_cut(
        &self,
        channel_id: i64,
        after_seq: u64,
        max_bytes: u64,
    ) -> StoreFuture<Option<u64>> {
        on_pool(self, move |conn| {
            bytes_cut(conn, channel_id, after_seq, max_bytes)
        })
    }

    fn welcome_floor(&self, channel_id: i64) -> StoreFuture<Option<u64>> {
        on_pool(self, move |conn| welcome_floor(conn, channel_id))
    }

    fn welcomes_due(&self, created_before: i64, used_before: i64) -> StoreFuture<bool> {
        on_pool(self, move |conn| {
            conn.prepare_cached(WELCOMES_DUE)?
                .query_row(params![created_before, used_before], |row| row.get(0))
        })
    }

    fn org_owner(&self, org: &str) -> StoreFuture<Option<String>> {
        let org = org.to_owned();
        on_pool(self, move |conn| org_owner(conn, &org))
    }

    fn bound_keys(&self, after: String, limit: usize) -> StoreFuture<Vec<String>> {
        on_pool(self, move |conn| bound_keys(conn, &after, limit))
    }

    fn leaves_of_key(&self, key_id: String, limit: usize) -> StoreFuture<Vec<(String, u32)>> {
        on_pool(self, move |conn| leaves_of_key(conn, &key_id, limit))
    }

    fn account_channels(
        &self,
        account: String,
        after_id: i64,
        limit: usize,
    ) -> StoreFuture<Vec<AccountChannelRow>> {
        on_pool(self, move |conn| {
            account_channels(conn, &account, after_id, limit)
        })
    }

    fn account_rate(
        &self,
        account: String,
        since_ms: i64,
        content_type: u32,
        limit: usize,
    ) -> StoreFuture<Vec<(String, i64, u64)>> {
        on_pool(self, move |conn| {
            account_rate(conn, &account, since_ms, content_type, limit)
        })
    }

    fn close(&self) {
        self.0
            .idle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
    }
}

// -- background checkpoints -------------------------------------------------------------------

/// Runs PASSIVE WAL checkpoints on its own thread and connection when the writer asks.
struct Checkpointer {
    shared: Arc<CheckpointShared>,
    thread: Option<JoinHandle<()>>,
}

type CheckpointShared = (Mutex<CheckpointState>, Condvar);

#[derive(Default)]
struct CheckpointState {
    due: bool,
    stop: bool,
    runs: u64,
}

impl Checkpointer {
    fn start(conn: Connection) -> Result<Checkpointer> {
        let shared = Arc::new((Mutex::new(CheckpointState::default()), Condvar::new()));
        let theirs = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("static-relay-checkpoint".into())
            .spawn(move || Self::run(&conn, &theirs))
            .map_err(RelayError::store)?;
        Ok(Checkpointer {
            shared,
            thread: Some(thread),
        })
    }

    fn run(conn: &Connection, shared: &CheckpointShared) {
        let (state, wake) = shared;
        let mut guard = state.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            if guard.stop {
                return;
            }
            if !guard.due {
                guard = wake.wait(guard).unwrap_or_else(PoisonError::into_inner);
                continue;
            }
            guard.due = false;
            drop(guard);
            // Best effort: a failure leaves the WAL to the next run or SQLite's autocheckpoint.
            let _ = checkpoint(conn);
            guard = state.lock().unwrap_or_else(PoisonError::into_inner);
            guard.runs += 1;
        }
    }

    /// Asks for a checkpoint (one already due or running covers it).
    fn request(&self) {
        let (state, wake) = &*self.shared;
        state.lock().unwrap_or_else(PoisonError::into_inner).due = true;
        wake.notify_one();
    }
}

impl Drop for Checkpointer {
    fn drop(&mut self) {
        let (state, wake) = &*self.shared;
        state.lock().unwrap_or_else(PoisonError::into_inner).stop = true;
        wake.notify_one();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::store::schema;

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

    /// A database file with the relay's tables, in a directory removed when dropped.
    fn database() -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("static.sqlite3");
        Connection::open(&path)
            .unwrap()
            .execute_batch(&schema::SQLITE.concat())
            .unwrap();
        (dir, path)
    }

    /// Migrations 0008 and 0009 on rows of the release before them: removed bindings become
    /// departures (per account, its latest removal); orgs are folded to their key, one row per
    /// key (the one already folded, else the first in byte order), the others left as they
    /// were.
    #[test]
    fn departures_and_org_keys_migrate() {
        let conn = Connection::open_in_memory().unwrap();
        let schema = schema::SQLITE.concat();
        let (before, after) = schema.split_at(schema.find("-- database: relay (SQLite keeps the relay's tables in a file of their own: static/store/_migrations.py)\n-- Departures").unwrap());
        conn.execute_batch(before).unwrap();
        conn.execute_batch(
            "INSERT INTO relay_channels (scope, name) VALUES ('', 'acme/a/b');
             INSERT INTO relay_members (channel_id, leaf_index, account, removed_seq) VALUES
                 (1, 0, 'alice', NULL), (1, 1, 'bob', 3), (1, 2, 'bob', 7), (1, 3, 'carol', 5);
             INSERT INTO relay_orgs (org, account) VALUES ('Acme', 'a'), ('ACME', 'b'),
                 ('acme-', 'c'), ('beta', 'd'), ('Zeta.', 'e'), ('zeta_', 'f'), ('zeta', 'g'),
                 ('Gamma', 'h');",
        )
        .unwrap();
        conn.execute_batch(after).unwrap();
        let rows = |sql: &str| -> Vec<String> {
            let mut stmt = conn.prepare(sql).unwrap();
            let rows = stmt.query_map([], |row| row.get::<_, String>(0)).unwrap();
            rows.map(Result::unwrap).collect()
        };
        assert_eq!(
            rows("SELECT account || ':' || leaf_index FROM relay_members ORDER BY leaf_index"),
            ["alice:0"]
        );
        assert_eq!(
            rows(
                "SELECT account || ':' || leaf_index || '@' || removed_seq \
                 FROM relay_departures ORDER BY account"
            ),
            ["bob:2@7", "carol:3@5"]
        );
        assert_eq!(
            rows("SELECT org || '=' || account FROM relay_orgs ORDER BY org"),
            // ACME took the key (first in byte order); Acme and acme- are left; zeta was
            // folded already, so Zeta. and zeta_ are left.
            ["Acme=a", "Zeta.=e", "acme=b", "acme-=c", "beta=d", "gamma=h", "zeta=g", "zeta_=f"]
        );
    }

    #[test]
    fn connections_are_durable_and_patient() {
        let (_dir, path) = database();
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

    fn writer(path: &Path) -> SqliteWriter {
        let conn = open_writer(path).unwrap();
        SqliteWriter {
            generations: load_generations(&conn).unwrap(),
            conn,
            checkpointer: Checkpointer::start(open_checkpointer(path).unwrap()).unwrap(),
            commits_since_checkpoint: 0,
            bytes_since_checkpoint: 0,
        }
    }

    /// A message to publish: its header, key and bytes.
    struct Message {
        header: crate::wire::framing::MessageHeader,
        key: Vec<u8>,
        message: Bytes,
    }

    /// Message `i` of epoch `epoch`, its key given (as the relay stores client-given keys).
    fn message(i: u64, epoch: u64, content_type: crate::wire::framing::ContentType) -> Message {
        Message {
            header: crate::wire::framing::MessageHeader {
                wire_format: 2,
                group_id: b"g".to_vec(),
                epoch,
                content_type,
            },
            key: format!("k:{i}").into_bytes(),
            message: Bytes::from(format!("message {i}")),
        }
    }

    /// A channel's head in memory, moved as the log moves it once a batch is durable.
    #[derive(Default)]
    struct Head(Mutex<(u64, u64)>);

    impl crate::store::Memory for Head {
        fn heads(&self) -> (u64, u64) {
            *self.0.lock().unwrap()
        }
    }

    impl Head {
        fn committed(&self, plan: &Plan) {
            for (_, t) in plan.changed() {
                *self.0.lock().unwrap() = (t.head, t.epoch);
            }
        }

        fn head_seq(&self) -> u64 {
            self.0.lock().unwrap().0
        }
    }

    /// `messages` as a batch on channel `id`.
    fn batch<'a>(id: i64, head: &'a Head, messages: &'a [Message]) -> Vec<Append<'a>> {
        messages
            .iter()
            .map(|m| Append {
                channel_id: id,
                memory: head,
                legacy: false,
                header: &m.header,
                key: &m.key,
                message: &m.message,
                welcome: &[],
                welcome_refs: &[],
                account: "",
                other_epoch: false,
                change: None,
            })
            .collect()
    }

    /// A channel `org/ns/service` made through `writer`: its id.
    fn created_channel(writer: &mut SqliteWriter) -> i64 {
        let new = NewChannel {
            name: "org/ns/service",
            org: "org",
            account: "",
            state: b"state",
            leaf: 0,
            audit: &[],
            claimed: None,
            key_id: None,
        };
        let Creation::Done(id) = writer.create_channel(&new).unwrap() else {
            panic!("not created");
        };
        id
    }

    #[test]
    fn a_retry_gets_its_original_seq_from_any_key_generation() {
        use crate::store::keys::GENERATION;
        use crate::wire::framing::ContentType::{Application, Commit};

        let (_dir, path) = database();
        let mut writer = writer(&path);
        let id = created_channel(&mut writer);
        let head = Head::default();
        // Generation 0 fills up, generation 1 gets 100 entries: message i has seq i + 1.
        let logged = GENERATION + 100;
        for first in (0..logged).step_by(512) {
            let messages: Vec<_> = (first..logged.min(first + 512))
                .map(|i| message(i, 0, Application))
                .collect();
            let plan = writer.append(&batch(id, &head, &messages), 0).unwrap();
            head.committed(&plan);
        }
        assert_eq!(writer.generations.current(), 1);
        assert_eq!(head.head_seq(), logged);

        let seqs = |plan: &Plan| -> Vec<String> {
            plan.decisions
                .iter()
                .map(|d| match d {
                    Decision::Append { seq, .. } => format!("append {seq}"),
                    Decision::Duplicate { seq, .. } => format!("duplicate {seq}"),
                    Decision::Refused(err) => format!("refused {err}"),
                })
                .collect()
        };
        // Retries of both generations (twice one of them) beside a new message.
        let messages = [3, GENERATION + 50, logged, 3].map(|i| message(i, 0, Application));
        let plan = writer.append(&batch(id, &head, &messages), 0).unwrap();
        head.committed(&plan);
        let expected = [
            "duplicate 4".to_owned(),
            format!("duplicate {}", GENERATION + 51),
            format!("append {}", logged + 1),
            "duplicate 4".to_owned(),
        ];
        assert_eq!(seqs(&plan), expected);

        // A commit moves the epoch: retries of epoch 0 are stale now, and still get their seqs,
        // also once the filters are rebuilt from the index by a new writer.
        let messages = [message(logged + 1, 0, Commit)];
        let plan = writer.append(&batch(id, &head, &messages), 0).unwrap();
        head.committed(&plan);
        drop(writer);
        let mut writer = super::tests::writer(&path);
        assert_eq!(writer.generations.current(), 1);
        let messages = [5, GENERATION + 7, logged].map(|i| message(i, 0, Application));
        let plan = writer.append(&batch(id, &head, &messages), 0).unwrap();
        let expected = [
            "duplicate 6".to_owned(),
            format!("duplicate {}", GENERATION + 8),
            format!("duplicate {}", logged + 1),
        ];
        assert_eq!(seqs(&plan), expected);
        // A new message of the current epoch goes to the current generation.
        let messages = [message(logged + 2, 1, Application)];
        let plan = writer.append(&batch(id, &head, &messages), 0).unwrap();
        assert_eq!(seqs(&plan), [format!("append {}", logged + 3)]);
        let key_gen: u64 = writer
            .conn
            .query_row(
                "SELECT key_gen FROM relay_entries WHERE channel_id = ?1 AND seq = ?2",
                params![id, logged + 3],
                |row| row.get(0),
            )
            .unwrap();
        assert_eq!(key_gen, 1);
    }

    #[test]
    fn checkpoints_run_beside_the_writer() {
        use crate::wire::framing::{ContentType, MessageHeader};

        let (_dir, path) = database();
        let mut writer = writer(&path);
        let id = created_channel(&mut writer);
        let head = Head::default();
        let shared = Arc::clone(&writer.checkpointer.shared);
        let runs = || shared.0.lock().unwrap().runs;
        assert_eq!(runs(), 0);
        for epoch in 0..u64::from(CHECKPOINT_COMMITS) - 1 {
            let message = Bytes::from(format!("commit {epoch}"));
            let messages = [Message {
                header: MessageHeader {
                    wire_format: 2,
                    group_id: b"g".to_vec(),
                    epoch,
                    content_type: ContentType::Commit,
                },
                key: message.to_vec(),
                message,
            }];
            let plan = writer.append(&batch(id, &head, &messages), 0).unwrap();
            head.committed(&plan);
        }
        // The create and 63 group commits: one checkpoint requested, on its own thread.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while runs() == 0 && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert_eq!(runs(), 1);
        assert_eq!(head.head_seq(), u64::from(CHECKPOINT_COMMITS) - 1);
    }
}
