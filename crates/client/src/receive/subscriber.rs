//! The client's subscriptions: every open channel's log is followed on a few shared
//! `SubscribeMany` streams (shards of at most [`SHARD_CHANNELS`] channels each), not on a
//! stream per channel, so a client's streams and tasks stay bounded whatever the number of its
//! channels (a stream per channel met the relay's cap of 100 streams per connection at the
//! 100th channel). Each shard (re)adds its channels after their cursors, feeds each channel's
//! [`Follower`] what comes for it, and makes the stream again, under the retry policy, when it
//! drops or falls silent.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::mpsc;
use tonic::Code;

use super::reader::Follower;
use crate::config::{SILENCE, SUBSCRIBE_BATCH};
use crate::error::Error;
use crate::relay::refusal::Refusal;
use crate::relay::retry::Retry;
use crate::relay::transport::{bounded, pb};
use crate::shared::Shared;
use crate::sync::lock;
use static_mls::store::Cursor;

/// Most channels on one stream: 10 streams for 10,000 channels, well under the relay's cap
/// of channels per stream (10,000) and of streams per connection (100).
const SHARD_CHANNELS: usize = 1000;
/// How often a shard forgets the channels that ended (closed, removed, failed).
const SWEEP: Duration = Duration::from_secs(2);

/// A shard: its task's inbox of new followers, and how many channels it holds.
struct Shard {
    follow: mpsc::UnboundedSender<Follower>,
    channels: Arc<AtomicUsize>,
}

/// See the module docs.
pub(crate) struct Subscriptions {
    shared: Arc<Shared>,
    shards: Mutex<Vec<Shard>>,
}

impl Subscriptions {
    pub(crate) fn new(shared: Arc<Shared>) -> Self {
        Self {
            shared,
            shards: Mutex::new(Vec::new()),
        }
    }

    /// Follows a channel's log from its follower's cursor until the channel ends.
    pub(crate) fn follow(&self, follower: Follower) {
        let mut shards = lock(&self.shards);
        shards.retain(|s| !s.follow.is_closed());
        let shard = match shards
            .iter()
            .position(|s| s.channels.load(Ordering::Acquire) < SHARD_CHANNELS)
        {
            Some(index) => &shards[index],
            None => {
                let (follow, incoming) = mpsc::unbounded_channel();
                let channels = Arc::new(AtomicUsize::new(0));
                self.shared.handle.spawn(shard(
                    Arc::clone(&self.shared),
                    incoming,
                    Arc::clone(&channels),
                ));
                shards.push(Shard { follow, channels });
                &shards[shards.len() - 1]
            }
        };
        shard.channels.fetch_add(1, Ordering::AcqRel);
        // A shard that is gone went with the runtime: the channel is closing too.
        let _ = shard.follow.send(follower);
    }
}

/// One channel on a shard's stream.
struct Follow {
    follower: Follower,
    /// Adds sent on the current stream and not yet answered: what comes for the channel
    /// before the answer to its latest add belongs to an earlier follow, and is dropped.
    unanswered: u32,
    /// To be added again at the next sweep (a transient refusal of its add).
    again: bool,
}

fn add(follower: &Follower) -> pb::SubscribeManyRequest {
    let start = match follower.cursor() {
        Cursor::After(seq) => pb::subscribe_request::Start::AfterSeq(seq),
        Cursor::FromEpoch(epoch) => pb::subscribe_request::Start::FromEpoch(epoch),
    };
    pb::SubscribeManyRequest {
        op: Some(pb::subscribe_many_request::Op::Add(pb::SubscribeRequest {
            channel: follower.core.name.clone(),
            start: Some(start),
            max_batch: SUBSCRIBE_BATCH,
        })),
    }
}

fn remove(name: &str) -> pb::SubscribeManyRequest {
    pb::SubscribeManyRequest {
        op: Some(pb::subscribe_many_request::Op::Remove(name.to_owned())),
    }
}

/// The shard's channels, and the count its [`Subscriptions`] reads.
struct Followed {
    by_name: HashMap<String, Follow>,
    count: Arc<AtomicUsize>,
}

impl Followed {
    /// Takes `follower` in (replacing an earlier follow of its channel, whose answers are
    /// still to come on this stream).
    fn insert(&mut self, follower: Follower) -> &mut Follow {
        use std::collections::hash_map::Entry;
        match self.by_name.entry(follower.core.name.clone()) {
            Entry::Occupied(entry) => {
                self.count.fetch_sub(1, Ordering::AcqRel);
                let follow = entry.into_mut();
                follow.follower = follower;
                follow.again = false;
                follow
            }
            Entry::Vacant(entry) => entry.insert(Follow {
                follower,
                unanswered: 0,
                again: false,
            }),
        }
    }

    /// Forgets the channels that ended; returns their names.
    fn sweep(&mut self) -> Vec<String> {
        let ended: Vec<String> = self
            .by_name
            .iter()
            .filter(|(_, f)| f.follower.core.is_closed())
            .map(|(name, _)| name.clone())
            .collect();
        for name in &ended {
            self.forget(name);
        }
        ended
    }

    fn forget(&mut self, name: &str) {
        if self.by_name.remove(name).is_some() {
            self.count.fetch_sub(1, Ordering::AcqRel);
        }
    }

    fn fail_all(&mut self, e: &Error) {
        for (_, follow) in self.by_name.drain() {
            follow.follower.fail(e.clone());
            self.count.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// What ended a shard's stream.
enum Dropped {
    Refused(Refusal, Option<String>),
    /// No follower left, or the client closed.
    Idle,
}

/// A shard's task: follows its channels on one stream at a time, until it has none and no
/// more can come.
async fn shard(
    shared: Arc<Shared>,
    mut incoming: mpsc::UnboundedReceiver<Follower>,
    count: Arc<AtomicUsize>,
) {
    let mut followed = Followed {
        by_name: HashMap::new(),
        count,
    };
    let mut retry = Retry::forever();
    loop {
        followed.sweep();
        if followed.by_name.is_empty() {
            match incoming.recv().await {
                Some(follower) => {
                    followed.insert(follower);
                }
                None => return,
            }
        }
        let dropped = follow_on_a_stream(&shared, &mut followed, &mut incoming, &mut retry).await;
        for follow in followed.by_name.values_mut() {
            follow.follower.disconnected();
            follow.unanswered = 0;
        }
        let (refusal, token) = match dropped {
            Dropped::Idle if incoming.is_closed() => return,
            Dropped::Idle => continue,
            Dropped::Refused(refusal, token) => (refusal, token),
        };
        match shared.after(&mut retry, refusal, token.as_deref(), "SubscribeMany") {
            Ok(wait) => tokio::time::sleep(wait).await,
            // The credentials are refused, or the relay refuses the stream itself for good:
            // no channel of the shard can be followed.
            Err(e) => followed.fail_all(&e),
        }
    }
}

/// Opens a stream, adds every channel of the shard, and serves it until it drops.
async fn follow_on_a_stream(
    shared: &Shared,
    followed: &mut Followed,
    incoming: &mut mpsc::UnboundedReceiver<Follower>,
    retry: &mut Retry,
) -> Dropped {
    let (requests, stream) = mpsc::unbounded_channel();
    let (request, token) = match shared
        .request(tokio_stream::wrappers::UnboundedReceiverStream::new(stream))
        .await
    {
        Ok(r) => r,
        Err(e @ Error::Auth(_)) => {
            followed.fail_all(&e);
            return Dropped::Idle;
        }
        Err(e) => {
            return Dropped::Refused(Refusal::transient(Code::Unavailable, e.to_string()), None)
        }
    };
    for follow in followed.by_name.values_mut() {
        follow.unanswered += 1;
        let _ = requests.send(add(&follow.follower));
    }
    let mut responses = match bounded(shared.relay.clone().subscribe_many(request)).await {
        Ok(response) => response.into_inner(),
        Err(status) => return Dropped::Refused(Refusal::from_status(&status), token),
    };
    let mut sweep = tokio::time::interval(SWEEP);
    loop {
        if followed.by_name.is_empty() {
            return Dropped::Idle;
        }
        let response = tokio::select! {
            more = incoming.recv() => {
                match more {
                    Some(follower) => {
                        let follow = followed.insert(follower);
                        follow.unanswered += 1;
                        let _ = requests.send(add(&follow.follower));
                    }
                    // The client closed: its channels end with it.
                    None => return Dropped::Idle,
                }
                continue;
            }
            _ = sweep.tick() => {
                for name in followed.sweep() {
                    let _ = requests.send(remove(&name));
                }
                for follow in followed.by_name.values_mut().filter(|f| f.again) {
                    follow.again = false;
                    follow.unanswered += 1;
                    let _ = requests.send(add(&follow.follower));
                }
                continue;
            }
            r = tokio::time::timeout(SILENCE, responses.message()) => r,
        };
        let response = match response {
            Err(_silent) => {
                return Dropped::Refused(
                    Refusal::transient(Code::DeadlineExceeded, "the stream fell silent"),
                    token,
                )
            }
            Ok(Ok(None)) => {
                return Dropped::Refused(
                    Refusal::transient(Code::Unavailable, "the stream ended"),
                    token,
                )
            }
            Ok(Err(status)) => return Dropped::Refused(Refusal::from_status(&status), token),
            Ok(Ok(Some(response))) => response,
        };
        retry.answered();
        let Some(follow) = followed.by_name.get_mut(&response.channel) else {
            // Stream-wide keep-alives, and what was under way for channels we removed.
            continue;
        };
        use pb::subscribe_many_response::Item;
        match response.item {
            Some(Item::KeepAlive(k)) => {
                follow.unanswered = follow.unanswered.saturating_sub(1);
                if follow.unanswered == 0 {
                    follow.follower.live(Some(k.head_seq));
                }
            }
            Some(Item::Ended(refusal)) => {
                follow.unanswered = follow.unanswered.saturating_sub(1);
                if follow.unanswered > 0 {
                    continue;
                }
                match Refusal::from_pb(&refusal) {
                    Refusal::Transient { .. } => follow.again = true,
                    Refusal::Final {
                        code: Code::NotFound,
                        message,
                    } => {
                        let name = response.channel;
                        follow.follower.fail(Error::refused(
                            Code::NotFound,
                            format!(
                                "channel {name:?} is not on the relay for this account ({message})"
                            ),
                        ));
                        followed.forget(&name);
                    }
                    refusal => {
                        follow.follower.fail(refusal.into_error("Subscribe"));
                        followed.forget(&response.channel);
                    }
                }
            }
            Some(Item::Entries(batch)) if follow.unanswered == 0 => {
                follow.follower.live(None);
                if !follow.follower.entries(batch.entries).await {
                    let name = response.channel;
                    followed.forget(&name);
                    let _ = requests.send(remove(&name));
                }
            }
            // Entries of an earlier follow (its add is not answered yet), or nothing.
            _ => {}
        }
    }
}
