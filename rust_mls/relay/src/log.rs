//! Channel logs: the in-memory view of each channel, the group-committing writer over SQLite,
//! reading after a cursor. A port of `static/relay/_log.py` + `static/store/_channels.py`
//! (SQLite only), same schema (`static/store/migrations/0002_relay.sqlite.sql`, created by
//! the Python store's migrations before the relay opens the database).
//!
//! STUB (interface fixed; bodies to be written).

use std::path::PathBuf;
use std::sync::Arc;

use bytes::Bytes;
use tokio::sync::{oneshot, watch};

use crate::error::{RelayError, Result};
use crate::framing::MessageHeader;

pub struct LogSettings {
    /// The SQLite database file (WAL); its relay tables exist already.
    pub db_path: PathBuf,
    /// Application messages are accepted at the channel's epoch or this many before it.
    pub application_window: u64,
}

/// Everything the service decided about a publish before its channel is looked up.
#[derive(Debug, Clone)]
pub struct Checked {
    pub header: MessageHeader,
    pub message: Bytes,
    /// From [`crate::rules::idempotency_key`].
    pub key: Vec<u8>,
    /// Empty, or a Welcome (only with a commit) kept for its joiners.
    pub welcome: Bytes,
    /// The KeyPackageRefs the Welcome names (empty without a Welcome).
    pub welcome_refs: Vec<Vec<u8>>,
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

/// One entry of a channel's log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub seq: u64,
    /// The message's own epoch (from its header).
    pub epoch: u64,
    pub content_type: u32,
    pub message: Bytes,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WelcomeRecord {
    pub welcome: Bytes,
    pub commit_seq: u64,
    pub epoch: u64,
}

pub enum WelcomeKey {
    Digest(Vec<u8>),
    KeyPackageRef(Vec<u8>),
}

/// Resolves once the publish is decided and (if appended) durable. A dropped sender means a
/// bug or a stopped writer: the service answers INTERNAL / UNAVAILABLE.
pub type Outcome = oneshot::Receiver<Result<Accepted>>;

/// One channel, loaded: authoritative in memory while the relay runs.
pub struct Channel {
    _private: (),
}

impl Channel {
    pub fn name(&self) -> &str {
        todo!()
    }

    /// The last committed seq (0 for an empty log).
    pub fn head_seq(&self) -> u64 {
        todo!()
    }

    /// The channel's current (committed) epoch.
    pub fn epoch(&self) -> u64 {
        todo!()
    }

    /// The head seq, changed after every commit that appended to this channel.
    pub fn watch_head(&self) -> watch::Receiver<u64> {
        todo!()
    }
}

/// The relay's channels: load, create, publish (group-committed), read. Cheap to clone.
#[derive(Clone)]
pub struct ChannelLog {
    _private: Arc<()>,
}

impl ChannelLog {
    /// Open the database and start the writer (and its background checkpoints).
    pub fn open(settings: LogSettings) -> Result<ChannelLog> {
        let _ = settings;
        todo!()
    }

    /// Create `name` at epoch 0 in `scope`: AlreadyExists("channel 'NAME' already exists").
    pub async fn create(&self, scope: &str, name: &str) -> Result<Arc<Channel>> {
        let _ = (scope, name);
        todo!()
    }

    /// The channel `name` of `scope`: NotFound("no channel 'NAME'") when it does not exist.
    pub async fn channel(&self, scope: &str, name: &str) -> Result<Arc<Channel>> {
        let _ = (scope, name);
        todo!()
    }

    /// The channel if it is in memory already (no store access).
    pub fn loaded(&self, scope: &str, name: &str) -> Option<Arc<Channel>> {
        let _ = (scope, name);
        todo!()
    }

    /// Queue publishes (already checked, their channels loaded) for the next group commit,
    /// in order; one [`Outcome`] per item, in the same order. Items submitted together (and
    /// with others arriving meanwhile) share a durable commit; entries become visible to
    /// readers and are answered only after it.
    pub fn submit(&self, items: Vec<(Arc<Channel>, Checked)>) -> Vec<Outcome> {
        let _ = items;
        todo!()
    }

    /// Up to `limit` consecutive entries after `cursor` (empty when `cursor` is the head):
    /// from memory when recent, else from the store. Unavailable on store failure or a gap.
    pub async fn read_after(
        &self,
        channel: &Channel,
        cursor: u64,
        limit: usize,
    ) -> Result<Vec<Entry>> {
        let _ = (channel, cursor, limit);
        todo!()
    }

    /// The seq after which `epoch` starts: NotFound("channel 'NAME' has no epoch E (it is at
    /// C)") when the channel never had it.
    pub async fn start_of_epoch(&self, channel: &Channel, epoch: u64) -> Result<u64> {
        let _ = (channel, epoch);
        todo!()
    }

    pub async fn fetch_welcome(
        &self,
        channel: &Channel,
        key: WelcomeKey,
    ) -> Result<Option<WelcomeRecord>> {
        let _ = (channel, key);
        todo!()
    }

    /// Commit everything submitted so far, then stop the writer (shutdown).
    pub async fn close(&self) {
        todo!()
    }
}

#[allow(dead_code)]
fn _unused(_: RelayError) {}
