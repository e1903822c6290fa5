//! Request/reply's marks and records: the kind byte an application message's authenticated data
//! (AAD) carries, and the requests kept in the engine's database beside the state that sent or
//! decrypted them.
//!
//! A plain message has an empty AAD (as before request/reply existed). A request carries
//! [`KIND_REQUEST`], a reply [`KIND_REPLY`]; both encrypt `request id (16 bytes) || body`. The
//! relay sees the kind byte (the AAD is authenticated, not encrypted), nothing else of it.
//! Anything else (another AAD, a request or reply too short for its id) is [`Kind::Unknown`]:
//! a receiver drops it, never hands it out as a plain message.
//!
//! Two tables (see `store::schema`):
//! * `static_requests_out`, the requester's: each request it sent and has not handed the reply
//!   of to its caller, keyed by (channel, id), with the SHA-256 of its payload (a call with the
//!   same payload after a timeout or a crash resends the same request) and, once received, the
//!   first reply. The reply is stored in the transaction that decrypted it; later replies find
//!   the slot taken (or the row gone) and are dropped.
//! * `static_requests_in`, the responder's: each request received and not replied to yet, in
//!   arrival order; deleted once the reply is in the log.

use rusqlite::{Connection, OptionalExtension};

use crate::store::rows::{to_i64, to_u64};
use crate::store::StoreError;

/// The AAD of a request.
pub const KIND_REQUEST: u8 = 0x01;
/// The AAD of a reply.
pub const KIND_REPLY: u8 = 0x02;
/// Bytes of a request id (random), at the start of a request's or a reply's plaintext.
pub const REQUEST_ID_LEN: usize = 16;

/// A request's id.
pub type RequestId = [u8; REQUEST_ID_LEN];

/// What an application message is, by its AAD.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Plain,
    Request,
    Reply,
    Unknown,
}

impl Kind {
    pub fn of(aad: &[u8]) -> Self {
        match aad {
            [] => Kind::Plain,
            [KIND_REQUEST] => Kind::Request,
            [KIND_REPLY] => Kind::Reply,
            _ => Kind::Unknown,
        }
    }
}

/// Splits a request's or reply's plaintext into its id and body (None: too short).
pub fn split(plaintext: &[u8]) -> Option<(RequestId, &[u8])> {
    let id = plaintext.get(..REQUEST_ID_LEN)?.try_into().ok()?;
    Some((id, plaintext.get(REQUEST_ID_LEN..)?))
}

/// A request or a reply another member sent, as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Received {
    /// Its row (requests: the arrival order).
    pub row: i64,
    pub id: RequestId,
    pub seq: u64,
    pub sender: Vec<u8>,
    /// The body (without the id).
    pub payload: Vec<u8>,
    pub epoch: u64,
    pub account: Option<String>,
}

/// Records a request we are about to send.
pub(crate) fn record_out(
    conn: &Connection,
    name: &str,
    id: &RequestId,
    hash: &[u8],
    created_ms: i64,
) -> Result<(), StoreError> {
    conn.prepare_cached(
        "INSERT OR IGNORE INTO static_requests_out (name, id, payload_hash, created_ms)
         VALUES (?1, ?2, ?3, ?4)",
    )?
    .execute((name, &id[..], hash, created_ms))?;
    Ok(())
}

/// Our requests on `name` with payload hash `hash`, oldest first.
pub(crate) fn out_with_hash(
    conn: &Connection,
    name: &str,
    hash: &[u8],
) -> Result<Vec<RequestId>, StoreError> {
    let mut stmt = conn.prepare_cached(
        "SELECT id FROM static_requests_out WHERE name = ?1 AND payload_hash = ?2
         ORDER BY created_ms",
    )?;
    let ids = stmt
        .query_map((name, hash), |row| row.get::<_, Vec<u8>>(0))?
        .collect::<rusqlite::Result<Vec<_>>>()?;
    Ok(ids
        .into_iter()
        .filter_map(|id| RequestId::try_from(id.as_slice()).ok())
        .collect())
}

/// Stores the first reply to our request `reply.id`; false when there is no such request or
/// it has its reply already (the reply is dropped).
pub(crate) fn store_reply(
    conn: &Connection,
    name: &str,
    reply: &Received,
) -> Result<bool, StoreError> {
    let changed = conn
        .prepare_cached(
            "UPDATE static_requests_out SET reply_sender = ?3, reply_payload = ?4,
             reply_account = ?5, reply_seq = ?6, reply_epoch = ?7
             WHERE name = ?1 AND id = ?2 AND reply_seq IS NULL",
        )?
        .execute((
            name,
            &reply.id[..],
            &reply.sender,
            &reply.payload,
            reply.account.as_deref(),
            to_i64(reply.seq),
            to_i64(reply.epoch),
        ))?;
    Ok(changed > 0)
}

/// The reply stored for our request `id`, if any.
pub(crate) fn reply_of(
    conn: &Connection,
    name: &str,
    id: &RequestId,
) -> Result<Option<Received>, StoreError> {
    Ok(conn
        .prepare_cached(
            "SELECT reply_sender, reply_payload, reply_account, reply_seq, reply_epoch
             FROM static_requests_out WHERE name = ?1 AND id = ?2 AND reply_seq IS NOT NULL",
        )?
        .query_row((name, &id[..]), |row| {
            Ok(Received {
                row: 0,
                id: *id,
                sender: row.get(0)?,
                payload: row.get(1)?,
                account: row.get(2)?,
                seq: to_u64(row.get(3)?),
                epoch: to_u64(row.get(4)?),
            })
        })
        .optional()?)
}

/// Forgets our request `id` (its reply was handed to the caller).
pub(crate) fn forget_out(conn: &Connection, name: &str, id: &RequestId) -> Result<(), StoreError> {
    conn.prepare_cached("DELETE FROM static_requests_out WHERE name = ?1 AND id = ?2")?
        .execute((name, &id[..]))?;
    Ok(())
}

/// Stores a request received (a second copy of the same id is ignored).
pub(crate) fn store_request(
    conn: &Connection,
    name: &str,
    request: &Received,
) -> Result<(), StoreError> {
    conn.prepare_cached(
        "INSERT OR IGNORE INTO static_requests_in (name, id, seq, sender, payload, epoch, account)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
    )?
    .execute((
        name,
        &request.id[..],
        to_i64(request.seq),
        &request.sender,
        &request.payload,
        to_i64(request.epoch),
        request.account.as_deref(),
    ))?;
    Ok(())
}

/// The first request received on `name` after row `after` (not replied to yet).
pub(crate) fn request_after(
    conn: &Connection,
    name: &str,
    after: i64,
) -> Result<Option<Received>, StoreError> {
    let row = conn
        .prepare_cached(
            "SELECT row, id, seq, sender, payload, epoch, account FROM static_requests_in
             WHERE name = ?1 AND row > ?2 ORDER BY row LIMIT 1",
        )?
        .query_row((name, after), |row| {
            Ok((
                row.get::<_, Vec<u8>>(1)?,
                Received {
                    row: row.get(0)?,
                    id: [0; REQUEST_ID_LEN],
                    seq: to_u64(row.get(2)?),
                    sender: row.get(3)?,
                    payload: row.get(4)?,
                    epoch: to_u64(row.get(5)?),
                    account: row.get(6)?,
                },
            ))
        })
        .optional()?;
    Ok(row.and_then(|(id, mut received)| {
        received.id = RequestId::try_from(id.as_slice()).ok()?;
        Some(received)
    }))
}

/// Forgets a request received (its reply is in the log).
pub(crate) fn forget_in(conn: &Connection, name: &str, id: &RequestId) -> Result<(), StoreError> {
    conn.prepare_cached("DELETE FROM static_requests_in WHERE name = ?1 AND id = ?2")?
        .execute((name, &id[..]))?;
    Ok(())
}
