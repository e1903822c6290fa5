//! The engine's side of the outbox (see [`crate::outbox`]): encrypting into it, encrypting
//! again, listing and settling.

use super::Engine;
use crate::error::Result;
use crate::outbox::{list, now_ms, push, recorded, replace, settle, Outgoing};
use crate::store::rows::to_u64;

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
        let too_large = vec![0; crate::suite::MAX_INPUT_LEN + 1];
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
