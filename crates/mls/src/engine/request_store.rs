//! The engine's side of request/reply (see [`crate::request`]): request ids, payload hashes,
//! and the requester's and the responder's records.

use openmls_traits::crypto::OpenMlsCrypto as _;
use openmls_traits::random::OpenMlsRand as _;
use openmls_traits::types::HashType;

use super::Engine;
use crate::error::{InternalError, Result};
use crate::outbox::now_ms;
use crate::request::{self, Received, RequestId};

impl Engine {
    /// A new random request id.
    pub fn new_request_id(&self) -> Result<RequestId> {
        self.crypto
            .random_array::<{ request::REQUEST_ID_LEN }>()
            .map_err(|e| {
                InternalError::Crypto {
                    detail: format!("{e:?}"),
                }
                .into()
            })
    }

    /// The SHA-256 of a request's payload (how a retried request is recognised).
    pub fn request_hash(&self, payload: &[u8]) -> Result<Vec<u8>> {
        self.crypto.hash(HashType::Sha2_256, payload).map_err(|e| {
            InternalError::Crypto {
                detail: format!("hashing a request: {e:?}"),
            }
            .into()
        })
    }

    /// Our requests on `channel` with payload hash `hash` not yet handed their reply, oldest
    /// first.
    pub fn requests_with_hash(&self, channel: &str, hash: &[u8]) -> Result<Vec<RequestId>> {
        self.with_db(|db| Ok(request::out_with_hash(&db.conn, channel, hash)?))
    }

    /// Records a request of ours before it is sent (synced: its reply must find it after a
    /// crash).
    pub fn record_request(&self, channel: &str, id: &RequestId, hash: &[u8]) -> Result<()> {
        self.with_db(|db| {
            db.transaction(|conn| Ok(request::record_out(conn, channel, id, hash, now_ms())?))
        })
    }

    /// The reply stored for our request `id`, if it came.
    pub fn request_reply(&self, channel: &str, id: &RequestId) -> Result<Option<Received>> {
        self.with_db(|db| Ok(request::reply_of(&db.conn, channel, id)?))
    }

    /// Forgets our request `id` (its reply was handed out).
    pub fn forget_request(&self, channel: &str, id: &RequestId) -> Result<()> {
        self.with_db(|db| db.light_transaction(|conn| Ok(request::forget_out(conn, channel, id)?)))
    }

    /// The first request received on `channel` after row `after` and not replied to.
    pub fn received_request_after(&self, channel: &str, after: i64) -> Result<Option<Received>> {
        self.with_db(|db| Ok(request::request_after(&db.conn, channel, after)?))
    }

    /// Forgets a request received (our reply is in the log).
    pub fn request_replied(&self, channel: &str, id: &RequestId) -> Result<()> {
        self.with_db(|db| db.light_transaction(|conn| Ok(request::forget_in(conn, channel, id)?)))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::bench_support::two_member_group;
    use crate::request::{Kind, KIND_REPLY, KIND_REQUEST};
    use crate::{Incoming, LogEntry};

    const CH: &str = "test/requests/channel";

    #[test]
    fn kinds_and_framing() {
        assert_eq!(Kind::of(&[]), Kind::Plain);
        assert_eq!(Kind::of(&[KIND_REQUEST]), Kind::Request);
        assert_eq!(Kind::of(&[KIND_REPLY]), Kind::Reply);
        assert_eq!(Kind::of(&[3]), Kind::Unknown);
        assert_eq!(Kind::of(&[KIND_REQUEST, 0]), Kind::Unknown);
        assert!(request::split(&[0; 15]).is_none());
        let (id, body) = request::split(&[7; 18]).unwrap();
        assert_eq!((id, body), ([7; 16], &[7, 7][..]));
    }

    #[test]
    fn requests_and_first_replies_are_stored_where_they_belong() {
        let dir = tempfile::tempdir().unwrap();
        let a = Engine::open(dir.path().join("a"), b"alice").unwrap();
        let b = Engine::open(dir.path().join("b"), b"bob").unwrap();
        two_member_group(&a, &b, CH).unwrap();
        // Alice asks; Bob's processing stores the request, not an inbox message.
        let id = a.new_request_id().unwrap();
        let hash = a.request_hash(b"question").unwrap();
        a.record_request(CH, &id, &hash).unwrap();
        assert_eq!(a.requests_with_hash(CH, &hash).unwrap(), vec![id]);
        let body = [&id[..], b"question"].concat();
        let plain = a.encrypt(CH, b"plain").unwrap();
        let asked = a
            .encrypt_framed_unsynced(CH, &[(&[KIND_REQUEST][..], body.as_slice())])
            .unwrap();
        let entries = [LogEntry::new(1, &plain), LogEntry::new(2, &asked[0])];
        let applied = b.process_entries(CH, &entries).unwrap();
        assert!(matches!(
            applied[0].outcome,
            Ok(Incoming::Application { .. })
        ));
        assert!(matches!(
            &applied[1].outcome,
            Ok(Incoming::Request { id: got, payload, .. }) if *got == id && payload == b"question"
        ));
        assert_eq!(b.inbox_count_after(CH, 0).unwrap(), 1);
        let received = b.received_request_after(CH, 0).unwrap().unwrap();
        assert_eq!((received.id, received.seq), (id, 2));
        assert!(b
            .received_request_after(CH, received.row)
            .unwrap()
            .is_none());
        // Two replies: the first is kept, the second dropped.
        let (first, second) = ([&id[..], b"first"].concat(), [&id[..], b"second"].concat());
        let replies = b
            .encrypt_framed_unsynced(
                CH,
                &[
                    (&[KIND_REPLY][..], first.as_slice()),
                    (&[KIND_REPLY][..], second.as_slice()),
                    (&[9][..], &b"a later kind"[..]),
                ],
            )
            .unwrap();
        b.request_replied(CH, &id).unwrap();
        assert!(b.received_request_after(CH, 0).unwrap().is_none());
        let entries: Vec<LogEntry<'_>> = (3..)
            .zip(&replies)
            .map(|(seq, m)| LogEntry::new(seq, m))
            .collect();
        let applied = a.process_entries(CH, &entries).unwrap();
        assert!(matches!(
            applied[0].outcome,
            Ok(Incoming::Reply { kept: true, .. })
        ));
        assert!(matches!(
            applied[1].outcome,
            Ok(Incoming::Reply { kept: false, .. })
        ));
        assert!(matches!(
            applied[2].outcome,
            Ok(Incoming::Unrecognized { .. })
        ));
        assert_eq!(a.inbox_count_after(CH, 0).unwrap(), 0);
        let reply = a.request_reply(CH, &id).unwrap().unwrap();
        assert_eq!((reply.payload.as_slice(), reply.seq), (&b"first"[..], 3));
        a.forget_request(CH, &id).unwrap();
        assert!(a.request_reply(CH, &id).unwrap().is_none());
        assert!(a.requests_with_hash(CH, &hash).unwrap().is_empty());
    }
}
