//! The outbox: each channel's application messages that a sender encrypted and has not yet
//! seen settled by the relay, kept in the engine's database (`mls.sqlite3`) beside the ratchet
//! state that produced them.
//!
//! A message is recorded in the same transaction as the ratchet advance that encrypted it, so
//! a crash can never leave a message encrypted but unrecorded (its generation spent, the
//! message gone) nor recorded but not encrypted. The outbox holds ciphertexts only: resending
//! one gives the relay the same bytes, hence the same idempotency key (the SHA-256 of the
//! message, see `proto/relay.proto`), and a file read by someone else discloses nothing the
//! relay does not see (our own message keys are deleted once used). Messages have places 1, 2,
//! 3, ... per channel, and the last place is kept across deletions: with what the SDK's client
//! journals before encryption (`static-client`'s `journal`), it counts every message ever
//! accepted, so an application resumes its own numbering after a crash. The client deletes a
//! message once the relay has settled it.

use rusqlite::{Connection, OptionalExtension};

use crate::store::rows::{to_i64, to_u64};
use crate::store::StoreError;

/// One message of the outbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outgoing {
    /// Its place among the messages the channel's outbox ever recorded: 1, 2, 3, ... in
    /// encryption order.
    pub id: i64,
    /// The epoch it was encrypted in.
    pub epoch: u64,
    /// The `MLSMessage` bytes, exactly as they go to the relay.
    pub message: Vec<u8>,
    /// When it was recorded (milliseconds since the Unix epoch).
    pub recorded_ms: u64,
}

pub(crate) fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// How many messages the channel's outbox ever recorded: its last place.
pub(crate) fn recorded(conn: &Connection, name: &str) -> Result<i64, StoreError> {
    let kept: Option<i64> = conn
        .prepare_cached("SELECT max(id) FROM static_outbox WHERE name = ?1")?
        .query_row([name], |row| row.get(0))?;
    let settled: Option<i64> = conn
        .prepare_cached("SELECT upto FROM static_outbox_settled WHERE name = ?1")?
        .query_row([name], |row| row.get(0))
        .optional()?;
    Ok(kept.unwrap_or(0).max(settled.unwrap_or(0)))
}

/// Records `messages` (encrypted at `epoch`) at `places` of the channel's outbox.
pub(crate) fn push(
    conn: &Connection,
    name: &str,
    places: &[i64],
    epoch: u64,
    messages: Vec<Vec<u8>>,
) -> Result<Vec<Outgoing>, StoreError> {
    let recorded_ms = now_ms();
    let mut insert = conn.prepare_cached(
        "INSERT INTO static_outbox (name, id, epoch, message, recorded_ms)
         VALUES (?1, ?2, ?3, ?4, ?5)",
    )?;
    let mut out = Vec::with_capacity(messages.len());
    for (&id, message) in places.iter().zip(messages) {
        insert.execute((name, id, to_i64(epoch), &message, recorded_ms))?;
        out.push(Outgoing {
            id,
            epoch,
            message,
            recorded_ms: to_u64(recorded_ms),
        });
    }
    Ok(out)
}

/// Replaces the bytes of the channel's outbox message `id` (encrypted again at `epoch`).
pub(crate) fn replace(
    conn: &Connection,
    name: &str,
    id: i64,
    epoch: u64,
    message: &[u8],
) -> Result<(), StoreError> {
    conn.prepare_cached(
        "UPDATE static_outbox SET epoch = ?3, message = ?4 WHERE name = ?1 AND id = ?2",
    )?
    .execute((name, id, to_i64(epoch), message))?;
    Ok(())
}

/// The channel's outbox, oldest first.
pub(crate) fn list(conn: &Connection, name: &str) -> Result<Vec<Outgoing>, StoreError> {
    let mut stmt = conn.prepare_cached(
        "SELECT id, epoch, message, recorded_ms FROM static_outbox WHERE name = ?1 ORDER BY id",
    )?;
    let rows = stmt.query_map([name], |row| {
        Ok(Outgoing {
            id: row.get(0)?,
            epoch: to_u64(row.get(1)?),
            message: row.get(2)?,
            recorded_ms: to_u64(row.get(3)?),
        })
    })?;
    Ok(rows.collect::<rusqlite::Result<_>>()?)
}

/// Deletes the channel's outbox messages up to `upto`, remembering that place. Without
/// `secure_delete`: the rows are ciphertexts the relay has, and zeroing their pages doubled what
/// a batch wrote.
pub(crate) fn settle(conn: &Connection, name: &str, upto: i64) -> Result<(), StoreError> {
    conn.pragma_update(None, "secure_delete", false)?;
    let deleted = conn
        .prepare_cached("DELETE FROM static_outbox WHERE name = ?1 AND id <= ?2")
        .and_then(|mut stmt| stmt.execute((name, upto)));
    conn.pragma_update(None, "secure_delete", true)?;
    deleted?;
    conn.prepare_cached(
        "INSERT INTO static_outbox_settled (name, upto) VALUES (?1, ?2)
         ON CONFLICT (name) DO UPDATE SET upto = max(upto, excluded.upto)",
    )?
    .execute((name, upto))?;
    Ok(())
}
