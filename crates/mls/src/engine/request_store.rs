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
