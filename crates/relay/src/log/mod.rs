//! Channel logs: the in-memory view of each channel, the group-committing writer over a store
//! (SQLite or PostgreSQL, [`crate::store`]), reading after a cursor. Same schema on both
//! (`static/store/migrations/0002_relay.*.sql`, created by the Python store's migrations
//! before the relay opens the database).
//!
//! # Design
//!
//! * **One writer per relay.** One [`Writer`] owns the store's write side. Publishes (and
//!   channel creations) queue up in a `Mutex<VecDeque>`; whoever holds the writer takes
//!   everything queued (up to [`MAX_BATCH`]), has the store fence and number it in submission
//!   order, and store it in ONE transaction: the fsync is paid once per batch. When the writer
//!   is free and the store allows it (SQLite), the submitting task commits its own publishes
//!   right away, on its thread (sparse traffic: no hand-off at all between a publish and its
//!   delivery); otherwise the writer thread (woken through a `Condvar`) takes what queued up.
//! * **Who decides.** On SQLite the relay is the only writer of its file: memory is
//!   authoritative and the fence is decided from it, idempotency optimistically (the unique
//!   index refuses a retry; only then are keys looked up). On PostgreSQL several relays share
//!   the database: each group commit locks its channels' rows, reads their heads and the
//!   batch's keys, and decides from those (exact across relays). See the store modules.
//! * **Memory only after COMMIT.** Right after the commit, still on the committing thread, each
//!   channel's recent-entries ring gets the new entries, its head and epoch advance, its
//!   `watch` wakes the subscribers, and then the publishers' oneshots are answered. A failed
//!   transaction changes nothing in memory, and everything in it is answered with the store's
//!   error. Heads only move forward: on PostgreSQL another relay's commit (NOTIFYed) moves
//!   them too, and the ring then restarts at the next local entry (it holds consecutive seqs).
//! * **Readers pull.** A subscriber holds a cursor and reads what is after it: from the ring
//!   while the ring still reaches back to it (no store access), else from the store. A slow
//!   subscriber costs nothing but its cursor.
//! * **Memory bounded by configuration.** The rings of all channels together hold at most
//!   [`LogSettings::cache_bytes`] (the oldest entries go first, whichever their channel), and
//!   a channel nobody used for [`LogSettings::idle_unload`] is unloaded entirely (see
//!   [`Registry::unload_idle`]); it is loaded again from the store when next named.
//!
//! # Layout
//!
//! One job a file: [`channel`] is one loaded channel and its ring of recent entries, [`cache`]
//! the byte budget all rings share, [`registry`] the loaded channels (loading, idle unload),
//! [`channel_log`] the [`ChannelLog`] façade (open, create, membership, publish, writer jobs)
//! and [`reads`] its reads (after a cursor, epoch starts, retention queries), [`queue`] what
//! the submitters hand the writer, [`writer`] the group commit. This file holds the types the
//! rest of the relay shares.
//!
//! [`Writer`]: writer::Writer
//! [`Registry::unload_idle`]: registry::Registry::unload_idle

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::oneshot;

use crate::error::Result;
use crate::members::GroupChange;
use crate::store::Database;
pub use crate::store::{Entry, WelcomeKey, WelcomeRecord};
use crate::wire::framing::MessageHeader;

mod cache;
mod channel;
mod channel_log;
mod queue;
mod reads;
mod registry;
mod writer;

pub use channel::Channel;
pub use channel_log::ChannelLog;

/// Most publishes one group commit takes.
const MAX_BATCH: usize = 512;

pub struct LogSettings {
    /// The database; its relay tables exist already.
    pub database: Database,
    /// Application messages are accepted at the channel's epoch or this many before it.
    pub application_window: u64,
    /// What the rings of recent entries hold, all channels together, in bytes
    /// (`RelayConfig::cache_bytes`); 0 caches nothing (every read goes to the store).
    pub cache_bytes: usize,
    /// A channel with no publish, no subscriber and no call for this long is unloaded (its
    /// ring, group state and bindings dropped) and read again from the store when next named.
    /// Zero: never unloaded.
    pub idle_unload: Duration,
}

/// Everything the service decided about a publish before its channel is looked up.
#[derive(Debug, Clone)]
pub struct Checked {
    pub header: MessageHeader,
    pub message: Bytes,
    /// From [`crate::wire::rules::idempotency_key`].
    pub key: Vec<u8>,
    /// Empty, or a Welcome (only with a commit) kept for its joiners.
    pub welcome: Bytes,
    /// The KeyPackageRefs the Welcome names (empty without a Welcome).
    pub welcome_refs: Vec<Vec<u8>>,
    /// Who publishes it (the caller's account, "" when anonymous).
    pub account: Arc<str>,
    /// What the channel's group made of it.
    pub group: GroupCheck,
}

/// A publish as the channel's group state judged it (see [`decide`]).
#[derive(Debug, Clone)]
pub enum GroupCheck {
    /// Nothing to check: an application message, or a legacy channel.
    Unchecked,
    /// A handshake valid at its epoch; a commit carries its change.
    Valid(Option<Arc<GroupChange>>),
    /// A handshake for another epoch than the state's: not checked, so it may only be the
    /// retry of a logged one (answered as a duplicate); otherwise refused as stale.
    OtherEpoch,
}

/// A publish's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Accepted {
    /// The entry's seq (the original one for a duplicate).
    pub seq: u64,
    /// The channel's epoch after this entry (a commit's epoch + 1).
    pub epoch: u64,
    /// The idempotency key was already in the log: nothing was appended.
    pub duplicate: bool,
}

/// Resolves once the publish is decided and (if appended) durable. A dropped sender means a
/// bug or a stopped writer: the service answers INTERNAL / UNAVAILABLE.
pub type Outcome = oneshot::Receiver<Result<Accepted>>;

/// An application entry of `size` zero bytes at epoch 0 (for the tests).
#[cfg(test)]
pub(crate) fn test_entry(seq: u64, size: usize) -> Entry {
    Entry {
        seq,
        epoch: 0,
        content_type: 1,
        message: Bytes::from(vec![0u8; size]),
        account: Arc::from(""),
    }
}
