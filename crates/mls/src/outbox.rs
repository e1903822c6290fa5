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

use crate::engine::Engine;
use crate::error::Result;
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

/// Creates the outbox's tables (idempotent; part of opening the store). A message's row is
/// keyed by its channel and place, with no other index and no count updated per message, so
/// that recording a batch writes few pages beside the ratchet's.
pub(crate) fn create_tables(conn: &Connection) -> rusqlite::Result<()> {
    conn.execute_batch(
        "CREATE TABLE IF NOT EXISTS static_outbox (
             name TEXT NOT NULL REFERENCES static_groups(name) ON DELETE CASCADE,
             id INTEGER NOT NULL,
             epoch INTEGER NOT NULL,
             message BLOB NOT NULL,
             recorded_ms INTEGER NOT NULL,
             PRIMARY KEY (name, id)
         ) WITHOUT ROWID;
         -- The last place each channel's outbox settled (deleted up to): with the places
         -- still in the outbox, how many messages it ever recorded.
         CREATE TABLE IF NOT EXISTS static_outbox_settled (
             name TEXT PRIMARY KEY REFERENCES static_groups(name) ON DELETE CASCADE,
             upto INTEGER NOT NULL
         );",
    )
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

fn to_u64(v: i64) -> u64 {
    u64::try_from(v).unwrap_or(0)
}

fn to_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// How many messages the channel's outbox ever recorded: its last place.
fn recorded(conn: &Connection, name: &str) -> Result<i64, StoreError> {
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
fn push(
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
fn replace(
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
fn list(conn: &Connection, name: &str) -> Result<Vec<Outgoing>, StoreError> {
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
fn settle(conn: &Connection, name: &str, upto: i64) -> Result<(), StoreError> {
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

impl Engine {
    /// Encrypts `payloads` (in order, at the group's current epoch) and records them at
    /// `places` of the channel's outbox (places the caller numbers on from
    /// [`Engine::outbox_recorded`]), in one transaction that does not wait for the disk: the
    /// caller MUST call [`Engine::sync_before_send`] before a message leaves the process (see
    /// [`Engine::encrypt_many_unsynced`]). Once this returns, the messages survive the process
    /// being killed.
    /// `settled`: a place up to which the relay settled the outbox since, deleted in the
    /// same transaction (see [`Engine::outbox_settled`]), which saves one per batch.
    pub fn encrypt_to_outbox(
        &self,
        channel: &str,
        settled: Option<i64>,
        places: &[i64],
        payloads: &[&[u8]],
    ) -> Result<Vec<Outgoing>> {
        self.encrypt_then(channel, payloads, false, |conn, epoch, messages| {
            if let Some(upto) = settled {
                settle(conn, channel, upto)?;
            }
            Ok(push(conn, channel, places, epoch, messages)?)
        })
    }

    /// Encrypts again, at the group's current epoch, the outbox messages `ids` (whose
    /// plaintexts are `payloads`), replacing their bytes in one transaction (unsynced, as
    /// [`Engine::encrypt_to_outbox`]); their new values, ids unchanged.
    pub fn reencrypt_outbox(
        &self,
        channel: &str,
        ids: &[i64],
        payloads: &[&[u8]],
    ) -> Result<Vec<Outgoing>> {
        self.encrypt_then(channel, payloads, false, |conn, epoch, messages| {
            let recorded_ms = to_u64(now_ms());
            ids.iter()
                .zip(messages)
                .map(|(&id, message)| {
                    replace(conn, channel, id, epoch, &message)?;
                    Ok(Outgoing {
                        id,
                        epoch,
                        message,
                        recorded_ms,
                    })
                })
                .collect()
        })
    }

    /// The channel's outbox, oldest first.
    pub fn outbox(&self, channel: &str) -> Result<Vec<Outgoing>> {
        self.with_db(|db| Ok(list(&db.conn, channel)?))
    }

    /// Deletes the channel's outbox messages up to `upto_id` (the relay settled them), in a
    /// light transaction: a power loss may bring them back, and they are then sent again
    /// (the relay's idempotency answers for them).
    pub fn outbox_settled(&self, channel: &str, upto_id: i64) -> Result<()> {
        self.with_db(|db| db.light_transaction(|conn| Ok(settle(conn, channel, upto_id)?)))
    }

    /// The last place the channel's outbox recorded or settled (every
    /// [`Engine::encrypt_to_outbox`] that returned, as far as the disk kept it).
    pub fn outbox_recorded(&self, channel: &str) -> Result<u64> {
        self.with_db(|db| Ok(to_u64(recorded(&db.conn, channel)?)))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::bench_support::two_member_group;

    const CH: &str = "test/outbox/channel";

    #[test]
    fn recorded_messages_survive_a_reopening_in_order_until_settled() {
        let dir = tempfile::tempdir().unwrap();
        let (a_dir, b_dir) = (dir.path().join("a"), dir.path().join("b"));
        let ids = {
            let a = Engine::open(&a_dir, b"alice").unwrap();
            let b = Engine::open(&b_dir, b"bob").unwrap();
            two_member_group(&a, &b, CH).unwrap();
            let first = a
                .encrypt_to_outbox(CH, None, &[1, 2], &[b"one", b"two"])
                .unwrap();
            let second = a.encrypt_to_outbox(CH, None, &[3], &[b"three"]).unwrap();
            assert!(first[0].id < first[1].id && first[1].id < second[0].id);
            // The receiver reads what the outbox holds.
            for (m, want) in first
                .iter()
                .chain(&second)
                .zip([&b"one"[..], b"two", b"three"])
            {
                match b.process_incoming(CH, &m.message).unwrap() {
                    crate::Incoming::Application { payload, .. } => assert_eq!(payload, want),
                    other => panic!("unexpected {other:?}"),
                }
            }
            [first[0].id, first[1].id, second[0].id]
        };
        let a = Engine::open(&a_dir, b"alice").unwrap();
        let kept: Vec<i64> = a.outbox(CH).unwrap().iter().map(|m| m.id).collect();
        assert_eq!(kept, ids);
        assert_eq!(a.outbox_recorded(CH).unwrap(), 3);
        a.outbox_settled(CH, ids[1]).unwrap();
        let kept: Vec<i64> = a.outbox(CH).unwrap().iter().map(|m| m.id).collect();
        assert_eq!(kept, [ids[2]]);
        // The count covers every message recorded, settled or not.
        assert_eq!(a.outbox_recorded(CH).unwrap(), 3);
        a.outbox_settled(CH, ids[2]).unwrap();
        assert!(a.outbox(CH).unwrap().is_empty());
        assert_eq!(a.outbox_recorded(CH).unwrap(), 3);
        // What was settled meanwhile goes with the next batch's transaction.
        let next = a.encrypt_to_outbox(CH, Some(3), &[4], &[b"four"]).unwrap();
        let kept: Vec<i64> = a.outbox(CH).unwrap().iter().map(|m| m.id).collect();
        assert_eq!(kept, [next[0].id]);
    }

    #[test]
    fn a_failed_encryption_records_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let a = Engine::open(dir.path().join("a"), b"alice").unwrap();
        a.create_group(CH).unwrap();
        let too_large = vec![0; crate::engine::MAX_INPUT_LEN + 1];
        assert!(a
            .encrypt_to_outbox(CH, None, &[1, 2], &[b"ok", &too_large])
            .is_err());
        assert!(a.outbox(CH).unwrap().is_empty());
        assert_eq!(a.outbox_recorded(CH).unwrap(), 0);
    }

    #[test]
    fn messages_encrypted_again_keep_their_place() {
        let dir = tempfile::tempdir().unwrap();
        let a = Engine::open(dir.path().join("a"), b"alice").unwrap();
        a.create_group(CH).unwrap();
        let first = a
            .encrypt_to_outbox(CH, None, &[1, 2], &[b"one", b"two"])
            .unwrap();
        let again = a.reencrypt_outbox(CH, &[first[1].id], &[b"two"]).unwrap();
        assert_eq!(again[0].id, first[1].id);
        assert_ne!(again[0].message, first[1].message);
        let kept = a.outbox(CH).unwrap();
        assert_eq!(kept.len(), 2);
        assert_eq!(kept[1].message, again[0].message);
        assert_eq!(a.outbox_recorded(CH).unwrap(), 2);
    }
}
