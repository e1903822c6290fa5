//! Request/reply on a channel: a request gets exactly one reply, across a requester's retries,
//! reconnections and crashes, and a responder's.
//!
//! The wire (see `static_mls::request`): a request is an application message whose AAD is
//! [`KIND_REQUEST`] and whose plaintext is `id (16 random bytes) || body`, published with the
//! idempotency key `b"rq" || id`; a reply has the AAD [`KIND_REPLY`], the plaintext
//! `id || body` and the key `b"rp" || id`. So a request sent again (a retry after a timeout,
//! after a crash) is one entry of the log (the relay answers `duplicate`), and so is a second
//! reply to the same request, whoever sends it. Plain messages keep an empty AAD and no key.
//!
//! * Requester ([`Channel::request`]): the request is recorded in the engine's database
//!   (with the SHA-256 of its payload) before it is sent; the applier stores the first reply
//!   in that record, in the transaction that decrypts it, and drops later ones. A call with the
//!   same payload as a request still waiting for its reply (an earlier call timed out, or the
//!   process died) takes that request over: it is sent again with the same id, and a reply
//!   already stored is returned at once. The record is deleted when its reply is handed to the
//!   caller ([`Outstanding::poll`]). Requests being waited for in this process are not taken
//!   over by another call (each concurrent call gets its own request and its own reply).
//! * Responder ([`Channel::poll_request`]): the applier stores requests received; each is
//!   handed out once per opening of the channel (a cursor over the stored rows) and offered
//!   again by the next opening until it is replied to ([`Channel::reply`], which deletes it
//!   once the reply is in the log).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::channel::core::ChannelCore;
use crate::channel::Channel;
use crate::config::MAX_PAYLOAD;
use crate::error::{Error, Result};
use crate::receive::inbox::Message;
use crate::send::encrypt::Framing;
use crate::sync::lock;
use static_mls::request::{KIND_REPLY, KIND_REQUEST, REQUEST_ID_LEN};

pub(crate) mod state;

pub use static_mls::request::RequestId;

/// Largest body of a request or a reply: a payload's maximum less the id.
pub const MAX_REQUEST_PAYLOAD: usize = MAX_PAYLOAD - REQUEST_ID_LEN;

/// A request another member sent us, to reply to with [`Channel::reply`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub id: RequestId,
    /// Its body.
    pub payload: Vec<u8>,
    /// The requester's identity, as MLS authenticated it.
    pub sender: Vec<u8>,
    /// The account that published it, as the relay attests it.
    pub account: Option<String>,
    pub seq: u64,
    pub epoch: u64,
}

/// What a wait for the next request found.
#[derive(Debug)]
pub enum NextRequest {
    Request(Request),
    /// Nothing yet.
    Empty,
    /// The channel has ended (requests not replied to stay for its next opening).
    End,
}

/// A request of ours waiting for its reply. Dropping it leaves the request recorded: a later
/// call with the same payload takes it over.
pub struct Outstanding {
    core: Arc<ChannelCore>,
    id: RequestId,
}

impl Outstanding {
    pub fn id(&self) -> RequestId {
        self.id
    }

    /// The reply, if it came (handed out once: the request is then forgotten); the channel's
    /// end as an error.
    pub fn poll(&self) -> Result<Option<Message>> {
        let core = &self.core;
        let engine = core.shared.engine()?;
        if let Some(reply) = engine.request_reply(&core.name, &self.id)? {
            engine.forget_request(&core.name, &self.id)?;
            return Ok(Some(Message {
                payload: reply.payload,
                sender: reply.sender,
                account: reply.account,
                seq: reply.seq,
                epoch: reply.epoch,
            }));
        }
        core.check_usable()?;
        Ok(None)
    }

    /// Waits up to `timeout` for the reply (blocking the calling thread).
    pub fn wait(&self, timeout: Duration) -> Result<Option<Message>> {
        let deadline = Instant::now() + timeout;
        loop {
            let seen = self.core.generation();
            if let Some(reply) = self.poll()? {
                return Ok(Some(reply));
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(None);
            }
            self.core.wait_signal(seen, deadline - now);
        }
    }
}

impl Drop for Outstanding {
    fn drop(&mut self) {
        lock(&self.core.requests.busy).remove(&self.id);
    }
}

/// `prefix || id`: a request's or reply's idempotency key.
fn key(prefix: &[u8], id: &RequestId) -> Vec<u8> {
    [prefix, &id[..]].concat()
}

/// `id || body`: a request's or reply's plaintext.
fn framed(id: &RequestId, body: &[u8]) -> Vec<u8> {
    [&id[..], body].concat()
}

fn check_body(body: &[u8]) -> Result<()> {
    if body.len() > MAX_REQUEST_PAYLOAD {
        return Err(Error::Invalid(format!(
            "payload of {} bytes exceeds the maximum of {MAX_REQUEST_PAYLOAD} bytes per request \
             or reply",
            body.len()
        )));
    }
    Ok(())
}

impl Channel {
    /// Sends a request (or takes over the one an earlier call with the same payload left
    /// waiting, see the module docs); returns once it is in the log (or its reply is already
    /// here). Wait for the reply with [`Outstanding::wait`].
    pub fn request(&self, payload: Vec<u8>) -> Result<Outstanding> {
        check_body(&payload)?;
        let core = &self.core;
        core.check_usable()?;
        let engine = core.shared.engine()?;
        let hash = engine.request_hash(&payload)?;
        let waiting = engine.requests_with_hash(&core.name, &hash)?;
        let taken = {
            let mut busy = lock(&core.requests.busy);
            waiting.into_iter().find(|id| busy.insert(*id))
        };
        let outstanding = match taken {
            Some(id) => {
                let outstanding = Outstanding {
                    core: Arc::clone(core),
                    id,
                };
                if engine.request_reply(&core.name, &id)?.is_some() {
                    return Ok(outstanding);
                }
                outstanding
            }
            None => {
                // Busy before it is recorded: a concurrent call with the same payload that
                // finds the record must not take it over.
                let id = engine.new_request_id()?;
                lock(&core.requests.busy).insert(id);
                let outstanding = Outstanding {
                    core: Arc::clone(core),
                    id,
                };
                engine.record_request(&core.name, &id, &hash)?;
                outstanding
            }
        };
        drop(engine);
        let id = outstanding.id;
        self.send_framed(
            framed(&id, &payload),
            Framing {
                aad: &[KIND_REQUEST],
                key: key(b"rq", &id),
            },
        )?;
        Ok(outstanding)
    }

    /// Replies to request `id` (blocking until the reply is in the log, as [`Channel::send`]).
    /// A second reply to the same request appends nothing: the relay answers it as a
    /// duplicate of the first.
    pub fn reply(&self, id: RequestId, body: Vec<u8>) -> Result<()> {
        check_body(&body)?;
        let core = &self.core;
        self.send_framed(
            framed(&id, &body),
            Framing {
                aad: &[KIND_REPLY],
                key: key(b"rp", &id),
            },
        )?;
        core.shared.engine()?.request_replied(&core.name, &id)?;
        Ok(())
    }

    /// Takes the next request received that this opening has not handed out, without waiting.
    pub fn poll_request(&self) -> Result<NextRequest> {
        let core = &self.core;
        match core.ended() {
            None => {}
            Some(crate::End::Failed(_)) => return Err(core.ended_error()),
            Some(_) => return Ok(NextRequest::End),
        }
        let Ok(engine) = core.shared.engine() else {
            return Ok(NextRequest::End);
        };
        let handed = &core.requests.handed;
        loop {
            let after = handed.load(Ordering::Acquire);
            let Some(r) = engine.received_request_after(&core.name, after)? else {
                return Ok(NextRequest::Empty);
            };
            // Another reader took it meanwhile: look again after it.
            if handed
                .compare_exchange(after, r.row, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                return Ok(NextRequest::Request(Request {
                    id: r.id,
                    payload: r.payload,
                    sender: r.sender,
                    account: r.account,
                    seq: r.seq,
                    epoch: r.epoch,
                }));
            }
        }
    }

    /// Waits up to `timeout` for the next request (blocking the calling thread).
    pub fn wait_request(&self, timeout: Duration) -> Result<NextRequest> {
        let deadline = Instant::now() + timeout;
        loop {
            let seen = self.core.generation();
            match self.poll_request()? {
                NextRequest::Empty => {}
                other => return Ok(other),
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(NextRequest::Empty);
            }
            self.core.wait_signal(seen, deadline - now);
        }
    }
}
