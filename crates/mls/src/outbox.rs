//! The outbox: each channel's application messages that a sender encrypted and has not yet
//! seen settled by the relay, kept in the engine's database (`mls.sqlite3`) beside the ratchet
//! state that produced them.
//!
//! A message is recorded in the same transaction as the ratchet advance that encrypted it, so
//! a crash can never leave a message encrypted but unrecorded (its generation spent, the
//! message gone) nor recorded but not encrypted. The outbox holds ciphertexts only: resending
//! one gives the relay the same bytes, hence the same idempotency key (the SHA-256 of the
//! message, see `proto/relay.proto`), and a file read by someone else discloses nothing the
//! relay does not see (our own message keys are deleted once used). A per-channel count of
//! every message ever recorded lets an application resume its own numbering after a crash.
//! The SDK's client deletes a message once the relay has settled it (see `static-client`).

use rusqlite::{Connection, OptionalExtension};

use crate::engine::Engine;
use crate::error::Result;
use crate::store::StoreError;

/// One message of the outbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outgoing {
    /// Its place in the outbox: increasing in encryption order, never reused.
    pub id: i64,
    /// The epoch it was encrypted in.
    pub epoch: u64,
    /// The `MLSMessage` bytes, exactly as they go to the relay.
    pub message: Vec<u8>,
    /// When it was recorded (milliseconds since the Unix epoch).
    pub recorded_ms: u64,
}

/// Creates the outbox's tables (idempotent; part of opening the store).
pub(crate) fn create_tables(conn: &Connection) -> rusqlite::Result<()> {
    conn.execute_batch(
        "CREATE TABLE IF NOT EXISTS static_outbox (
             id INTEGER PRIMARY KEY AUTOINCREMENT,
             name TEXT NOT NULL REFERENCES static_groups(name) ON DELETE CASCADE,
             epoch INTEGER NOT NULL,
             message BLOB NOT NULL,
             recorded_ms INTEGER NOT NULL
         );
         CREATE INDEX IF NOT EXISTS static_outbox_by_name ON static_outbox (name, id);
         -- How many messages each channel's outbox ever recorded.
         CREATE TABLE IF NOT EXISTS static_outbox_counts (
             name TEXT PRIMARY KEY REFERENCES static_groups(name) ON DELETE CASCADE,
             recorded INTEGER NOT NULL
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

/// Records `messages` (encrypted at `epoch`) at the end of the channel's outbox; their ids.
fn push(
    conn: &Connection,
    name: &str,
    epoch: u64,
    messages: Vec<Vec<u8>>,
) -> Result<Vec<Outgoing>, StoreError> {
    let recorded_ms = now_ms();
    let mut insert = conn.prepare_cached(
        "INSERT INTO static_outbox (name, epoch, message, recorded_ms) VALUES (?1, ?2, ?3, ?4)",
    )?;
    let mut out = Vec::with_capacity(messages.len());
    for message in messages {
        insert.execute((name, to_i64(epoch), &message, recorded_ms))?;
        out.push(Outgoing {
            id: conn.last_insert_rowid(),
            epoch,
            message,
            recorded_ms: to_u64(recorded_ms),
        });
    }
    conn.prepare_cached(
        "INSERT INTO static_outbox_counts (name, recorded) VALUES (?1, ?2)
         ON CONFLICT (name) DO UPDATE SET recorded = recorded + excluded.recorded",
    )?
    .execute((name, i64::try_from(out.len()).unwrap_or(i64::MAX)))?;
    Ok(out)
}

/// Replaces the bytes of outbox message `id` (encrypted again at `epoch`).
fn replace(conn: &Connection, id: i64, epoch: u64, message: &[u8]) -> Result<(), StoreError> {
    conn.prepare_cached("UPDATE static_outbox SET epoch = ?2, message = ?3 WHERE id = ?1")?
        .execute((id, to_i64(epoch), message))?;
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

impl Engine {
    /// Encrypts `payloads` (in order, at the group's current epoch) and records them in the
    /// channel's outbox, in one transaction that does not wait for the disk: the caller MUST
    /// call [`Engine::sync_before_send`] before a message leaves the process (see
    /// [`Engine::encrypt_many_unsynced`]). Once this returns, the messages survive the process
    /// being killed.
    pub fn encrypt_to_outbox(&self, channel: &str, payloads: &[&[u8]]) -> Result<Vec<Outgoing>> {
        let messages = self.encrypt_then(channel, payloads, false, |conn, epoch, messages| {
            Ok(push(conn, channel, epoch, messages)?)
        })?;
        Ok(messages)
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
                    replace(conn, id, epoch, &message)?;
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
        self.with_db(|db| {
            db.light_transaction(|conn| {
                conn.prepare_cached("DELETE FROM static_outbox WHERE name = ?1 AND id <= ?2")
                    .map_err(StoreError::from)?
                    .execute((channel, upto_id))
                    .map_err(StoreError::from)?;
                Ok(())
            })
        })
    }

    /// How many messages the channel's outbox ever recorded (every
    /// [`Engine::encrypt_to_outbox`] that returned, as far as the disk kept it).
    pub fn outbox_recorded(&self, channel: &str) -> Result<u64> {
        self.with_db(|db| {
            let recorded: Option<i64> = db
                .conn
                .prepare_cached("SELECT recorded FROM static_outbox_counts WHERE name = ?1")
                .map_err(StoreError::from)?
                .query_row([channel], |row| row.get(0))
                .optional()
                .map_err(StoreError::from)?;
            Ok(recorded.map_or(0, to_u64))
        })
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
            let first = a.encrypt_to_outbox(CH, &[b"one", b"two"]).unwrap();
            let second = a.encrypt_to_outbox(CH, &[b"three"]).unwrap();
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
    }

    #[test]
    fn a_failed_encryption_records_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let a = Engine::open(dir.path().join("a"), b"alice").unwrap();
        a.create_group(CH).unwrap();
        let too_large = vec![0; crate::engine::MAX_INPUT_LEN + 1];
        assert!(a.encrypt_to_outbox(CH, &[b"ok", &too_large]).is_err());
        assert!(a.outbox(CH).unwrap().is_empty());
        assert_eq!(a.outbox_recorded(CH).unwrap(), 0);
    }

    #[test]
    fn messages_encrypted_again_keep_their_place() {
        let dir = tempfile::tempdir().unwrap();
        let a = Engine::open(dir.path().join("a"), b"alice").unwrap();
        a.create_group(CH).unwrap();
        let first = a.encrypt_to_outbox(CH, &[b"one", b"two"]).unwrap();
        let again = a.reencrypt_outbox(CH, &[first[1].id], &[b"two"]).unwrap();
        assert_eq!(again[0].id, first[1].id);
        assert_ne!(again[0].message, first[1].message);
        let kept = a.outbox(CH).unwrap();
        assert_eq!(kept.len(), 2);
        assert_eq!(kept[1].message, again[0].message);
        assert_eq!(a.outbox_recorded(CH).unwrap(), 2);
    }
}
