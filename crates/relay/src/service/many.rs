//! SubscribeMany: many channels followed on one stream (the contract is `proto/relay.proto`).
//!
//! One driver per stream (as for every streaming call, see [`super::Driven`]) keeps its
//! follows in a map by channel name. A follow is either *queued* (it has entries to send: its
//! name is in the ready queue) or *armed* (idle: one wake-up future on its channel's head
//! watch sits in a `FuturesUnordered`, which polls only the futures that were woken). So a
//! publish costs the stream one wake-up of the channel that moved, and an idle follow a small
//! constant, whatever the number of follows. Queued follows are served in turns, one page of
//! at most [`READ_PAGE`] entries each, then go to the back of the queue: a busy channel does
//! not starve the others. One page is read at a time (bounded in bytes, as Subscribe's) and at
//! most the response queue's bytes wait for the peer, so a stream's memory beyond its follows
//! does not grow with their number, the traffic or the messages' size; a peer that stops
//! reading stalls its own driver only.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use futures_util::future::{abortable, AbortHandle};
use futures_util::stream::{FuturesUnordered, StreamExt as _};
use futures_util::FutureExt as _;
use tokio::time::{Instant, Sleep};
use tonic::{Status, Streaming};

use super::caller::channel_name;
use super::refusal::{not_a_member, note_refusal};
use super::subscribe::{batches, consecutive, delivered_live, READ_PAGE, SUBSCRIBE_BATCH_ENTRIES};
use super::Inner;
use crate::auth::Caller;
use crate::error::{shutting_down, RelayError, Result};
use crate::log::Channel;
use crate::pb;
use crate::pb::subscribe_many_response::Item;
use crate::shutdown::Phase;

type Sender = super::Sender<std::result::Result<pb::SubscribeManyResponse, Status>>;

/// An armed follow's wake-up: its name and id, and whether the channel's log is still open;
/// None once aborted (the follow was removed or restarted).
type Wake = Pin<Box<dyn Future<Output = Option<(Arc<str>, u64, bool)>> + Send>>;

/// Wake-ups taken in one go before the stream's next select (the rest wait for the next).
const WAKES_AT_ONCE: usize = 1024;
/// Queue entries of gone follows tolerated before the queue is swept (see `unfollow`).
const STALE_SWEEP: usize = 64;

/// Why a stream stops.
enum Stop {
    /// Nothing more to send: the peer is gone, or it closed its requests and nothing is
    /// followed any more (the stream ends with OK).
    Done,
    /// Ends with this status.
    End(Status),
}

impl From<RelayError> for Stop {
    fn from(e: RelayError) -> Stop {
        Stop::End(e.to_status())
    }
}

struct Follow {
    /// Tells this follow from an earlier one of the same name (queue entries, wake-ups).
    id: u64,
    channel: Arc<Channel>,
    /// The last seq sent.
    cursor: u64,
    max_batch: usize,
    /// Some while armed (idle); None while queued.
    armed: Option<AbortHandle>,
}

/// One SubscribeMany stream's state.
struct Many {
    inner: Arc<Inner>,
    caller: Caller,
    requests: Streaming<pb::SubscribeManyRequest>,
    reading: bool,
    tx: Sender,
    follows: HashMap<Arc<str>, Follow>,
    /// Follows with entries to send, served in this order (each name at most once live).
    ready: VecDeque<(Arc<str>, u64)>,
    /// Entries of `ready` whose follow is gone or restarted (skipped when reached).
    stale: usize,
    wakes: FuturesUnordered<Wake>,
    next_id: u64,
    interval: Duration,
    /// The stream-wide keep-alive, due when nothing was sent for `interval`.
    idle: Pin<Box<Sleep>>,
}

impl Inner {
    /// SubscribeMany's driver: requests are read and follows served until the peer leaves or
    /// the stream is ended (revocation, expiry, shutdown, a bad request, a store failure).
    pub(super) async fn subscribe_many(
        self: Arc<Self>,
        caller: Caller,
        requests: Streaming<pb::SubscribeManyRequest>,
        tx: Sender,
    ) {
        // Revocation and expiry are the call's guard's (see `Driven::new`), taken before the
        // drain is looked at: a shutdown either sees that guard or is seen by the stream.
        let mut shutdown = self.shutdown.watch();
        // A zero interval would make the stream spin on keep-alives.
        let interval = self
            .settings
            .keepalive_interval
            .max(Duration::from_millis(1));
        let mut many = Many {
            inner: Arc::clone(&self),
            caller,
            requests,
            reading: true,
            tx,
            follows: HashMap::new(),
            ready: VecDeque::new(),
            stale: 0,
            wakes: FuturesUnordered::new(),
            next_id: 0,
            interval,
            idle: Box::pin(tokio::time::sleep(interval)),
        };
        // Made once and polled around every step (cancel-safe): a step cut short by it ends
        // the stream anyway.
        let drained = shutdown.reached(Phase::Refusing);
        tokio::pin!(drained);
        let stop = loop {
            tokio::select! {
                biased;
                () = &mut drained => break Stop::from(shutting_down()),
                step = many.step() => if let Err(stop) = step {
                    break stop;
                },
            }
        };
        if let Stop::End(status) = stop {
            let _ = many.tx.send(Err(status)).await;
        }
    }
}

impl Drop for Many {
    /// The stream ended: its follows leave its account's budget.
    fn drop(&mut self) {
        self.inner
            .give_back_follows(&self.caller.account, self.follows.len());
    }
}

impl Inner {
    /// Takes a place in `scope`'s budget of follows; false when it is full.
    fn take_follow(&self, scope: &str) -> bool {
        let mut follows = self.follows.lock().unwrap_or_else(PoisonError::into_inner);
        let held = follows.entry(scope.to_owned()).or_insert(0);
        if *held >= self.settings.max_follows_per_account {
            return false;
        }
        *held += 1;
        true
    }

    /// Gives `count` places back to `scope`'s budget (an account holding none is forgotten).
    fn give_back_follows(&self, scope: &str, count: usize) {
        if count == 0 {
            return;
        }
        let mut follows = self.follows.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(held) = follows.get_mut(scope) {
            *held = held.saturating_sub(count);
            if *held == 0 {
                follows.remove(scope);
            }
        }
    }
}

impl Many {
    /// One thing done: a request handled, a wake-up taken, a follow's turn, or a keep-alive.
    /// Among those ready, tokio's select picks at random: requests and turns both progress.
    async fn step(&mut self) -> Result<(), Stop> {
        // Wake-ups already in go to the queue together (a select round each would do too,
        // but thousands of channels woken at once are common: a burst of publishes).
        for _ in 0..WAKES_AT_ONCE {
            match self.wakes.next().now_or_never() {
                Some(Some(woken)) => self.woken(woken)?,
                _ => break,
            }
        }
        if !self.reading && self.follows.is_empty() {
            return Err(Stop::Done);
        }
        tokio::select! {
            message = self.requests.message(), if self.reading => self.request(message).await,
            Some(woken) = self.wakes.next(), if !self.wakes.is_empty() => self.woken(woken),
            () = std::future::ready(()), if !self.ready.is_empty() => self.turn().await,
            () = &mut self.idle => self.send(Arc::from(""), keep_alive(0)).await,
        }
    }

    async fn request(
        &mut self,
        message: Result<Option<pb::SubscribeManyRequest>, Status>,
    ) -> Result<(), Stop> {
        use pb::subscribe_many_request::Op;
        match message {
            Ok(Some(request)) => match request.op {
                Some(Op::Add(add)) => self.add(add).await,
                Some(Op::Remove(name)) => {
                    self.unfollow(&name);
                    Ok(())
                }
                None => Err(RelayError::InvalidArgument("set add or remove".to_owned()).into()),
            },
            Ok(None) => {
                // No more adds or removes: the follows go on.
                self.reading = false;
                Ok(())
            }
            Err(status) => Err(Stop::End(self.inner.request_failed(status))),
        }
    }

    /// Starts (or restarts) a follow and answers the add: a keep-alive tagged with the
    /// channel before any of its entries, or `ended` (and the channel is no longer followed).
    /// A new follow must fit in the stream's cap and in its account's budget of follows (taken
    /// before the channel is looked up, so a refusal costs no store read).
    async fn add(&mut self, request: pb::SubscribeRequest) -> Result<(), Stop> {
        let name: Arc<str> = Arc::from(request.channel.as_str());
        let restart = self.follows.contains_key(&name);
        let cap = self.inner.settings.max_subscriptions_per_stream;
        let budget = self.inner.settings.max_follows_per_account;
        let started = if restart {
            start(&self.inner, &self.caller, request).await
        } else if self.follows.len() >= cap {
            Err(RelayError::resource_exhausted(format!(
                "this stream follows {cap} channels already, the most it may"
            )))
        } else if !self.inner.take_follow(&self.caller.account) {
            Err(RelayError::resource_exhausted(format!(
                "this account follows {budget} channels already on its SubscribeMany streams, \
                 the most it may"
            )))
        } else {
            let started = start(&self.inner, &self.caller, request).await;
            if started.is_err() {
                self.inner.give_back_follows(&self.caller.account, 1);
            }
            started
        };
        match started {
            Ok((channel, cursor, max_batch)) => {
                let head = channel.head_seq();
                // A restart keeps its place in the budget.
                self.remove(&name);
                self.next_id += 1;
                let id = self.next_id;
                let follow = Follow {
                    id,
                    channel,
                    cursor,
                    max_batch,
                    armed: None,
                };
                self.follows.insert(Arc::clone(&name), follow);
                self.settle(Arc::clone(&name), id);
                self.send(name, keep_alive(head)).await
            }
            Err(e) => {
                self.unfollow(&name);
                self.send(name, Item::Ended(refusal(&e))).await
            }
        }
    }

    /// Stops the follow of `name`, if any, and gives its place back to the account's budget.
    fn unfollow(&mut self, name: &str) {
        if self.remove(name) {
            self.inner.give_back_follows(&self.caller.account, 1);
        }
    }

    /// Drops the follow of `name`, if any (whether there was one): its wake-up is aborted (the
    /// future then leaves `wakes` at its next poll), its queue entry left stale. Stale entries
    /// are swept once they are many and at least half the queue, so that sweeping costs O(1)
    /// a removal.
    fn remove(&mut self, name: &str) -> bool {
        let Some(gone) = self.follows.remove(name) else {
            return false;
        };
        match gone.armed {
            Some(wake) => wake.abort(),
            None => self.stale += 1,
        }
        if self.stale > STALE_SWEEP && self.stale * 2 > self.ready.len() {
            let follows = &self.follows;
            self.ready
                .retain(|(name, id)| is_queued(follows, name, *id));
            self.stale = 0;
        }
        true
    }

    /// A follow after its start or its turn: queued when its channel has entries beyond its
    /// cursor, else armed.
    fn settle(&mut self, name: Arc<str>, id: u64) {
        let Some(follow) = self.follows.get_mut(&name) else {
            return;
        };
        // Watched BEFORE the head is looked at: a commit in between wakes the watch.
        let mut head = follow.channel.watch_head();
        if follow.channel.head_seq() > follow.cursor {
            follow.armed = None;
            self.ready.push_back((name, id));
            return;
        }
        let (wake, abort) = abortable(async move { head.changed().await.is_ok() });
        follow.armed = Some(abort);
        self.wakes
            .push(Box::pin(wake.map(move |open| Some((name, id, open.ok()?)))));
    }

    fn woken(&mut self, woken: Option<(Arc<str>, u64, bool)>) -> Result<(), Stop> {
        let Some((name, id, open)) = woken else {
            return Ok(()); // aborted: that follow is gone
        };
        if !open {
            // The channel's writer side is gone: only a closing log does that.
            return Err(shutting_down().into());
        }
        if let Some(follow) = self.follows.get_mut(&name) {
            if follow.id == id && follow.armed.take().is_some() {
                self.ready.push_back((name, id));
            }
        }
        Ok(())
    }

    /// The turn of the follow at the front of the queue: one page sent, then it goes to the
    /// back of the queue, or is armed when it caught up.
    async fn turn(&mut self) -> Result<(), Stop> {
        let Some((name, id)) = self.ready.pop_front() else {
            return Ok(());
        };
        let follow = match self.follows.get(&name) {
            Some(follow) if follow.id == id && follow.armed.is_none() => follow,
            _ => {
                self.stale = self.stale.saturating_sub(1);
                return Ok(());
            }
        };
        let (channel, cursor, max_batch) =
            (Arc::clone(&follow.channel), follow.cursor, follow.max_batch);
        let last = channel.head_seq();
        // Membership is looked at on every turn (a commit may have removed the account): a
        // departed member reads up to the commit that removed it, then its follow ends.
        let limit = match self.inner.read_limit(&channel, &self.caller.account).await {
            Ok(limit) if cursor < limit => Ok(limit),
            Ok(_) => Err(not_a_member(channel.name())),
            Err(e) => Err(e),
        };
        let limit = match limit {
            Ok(limit) => limit,
            Err(e) => {
                self.unfollow(&name);
                return self.send(name, Item::Ended(refusal(&e))).await;
            }
        };
        if cursor < last {
            let read = self
                .inner
                .log
                .read_page(
                    &channel,
                    cursor,
                    READ_PAGE.max(max_batch),
                    self.inner.settings.page_bytes(),
                )
                .await;
            let mut page = match read {
                // Pruning overtook this follow: it ends, not the stream.
                Err(e @ RelayError::Pruned { .. }) => {
                    self.unfollow(&name);
                    return self.send(name, Item::Ended(refusal(&e))).await;
                }
                read => read.and_then(|page| consecutive(page, cursor, last))?,
            };
            page.retain(|e| e.seq <= limit);
            let sent = page.last().map_or(cursor, |e| e.seq);
            // A slow reader makes these sends wait: its stream falls behind here (and reads
            // the rest from the log later), costing nobody else.
            for entries in batches(page, max_batch) {
                let item = Item::Entries(pb::Entries { entries });
                self.send(Arc::clone(&name), item).await?;
            }
            delivered_live(&channel, sent);
            // No request was read meanwhile: the follow is the one this turn started with.
            if let Some(follow) = self.follows.get_mut(&name) {
                follow.cursor = sent;
            }
            if sent >= limit {
                // A departed member has read up to the commit that removed it: ended now, not
                // at the channel's next entry (which may never come).
                self.unfollow(&name);
                let ended = refusal(&not_a_member(channel.name()));
                return self.send(name, Item::Ended(ended)).await;
            }
        }
        self.settle(name, id);
        Ok(())
    }

    async fn send(&mut self, channel: Arc<str>, item: Item) -> Result<(), Stop> {
        if let Item::Ended(refusal) = &item {
            note_refusal(&self.caller, "SubscribeMany follow", refusal);
        }
        let response = pb::SubscribeManyResponse {
            channel: channel.to_string(),
            item: Some(item),
        };
        self.tx.send(Ok(response)).await.map_err(|_| Stop::Done)?;
        // Anything sent counts as traffic: no keep-alive for that interval.
        self.idle.as_mut().reset(Instant::now() + self.interval);
        Ok(())
    }
}

/// What Subscribe decides before its stream starts: the channel (one the caller reaches),
/// the cursor, the batch size. (Not a method of `Many`, whose wake-ups are not `Sync`.)
async fn start(
    inner: &Inner,
    caller: &Caller,
    request: pb::SubscribeRequest,
) -> Result<(Arc<Channel>, u64, usize)> {
    use pb::subscribe_request::Start;
    let name = channel_name(request.channel)?;
    // Outside the key's channel patterns: this follow ends (`ended`), the stream goes on.
    caller.may_name(&name)?;
    let account = &*caller.account;
    let channel = inner.channel(account, &name).await?;
    inner.read_limit(&channel, account).await?;
    let cursor = match request.start {
        Some(Start::FromEpoch(epoch)) => inner.log.start_of_epoch(&channel, epoch).await?,
        Some(Start::AfterSeq(seq)) => seq,
        None => 0,
    };
    channel.check_cursor(cursor)?;
    let max_batch = request.max_batch.min(SUBSCRIBE_BATCH_ENTRIES as u32) as usize;
    Ok((channel, cursor, max_batch))
}

fn is_queued(follows: &HashMap<Arc<str>, Follow>, name: &str, id: u64) -> bool {
    follows
        .get(name)
        .is_some_and(|f| f.id == id && f.armed.is_none())
}

fn keep_alive(head_seq: u64) -> Item {
    Item::KeepAlive(pb::KeepAlive { head_seq })
}

/// What Subscribe's status would have been, as an `ended` item.
fn refusal(e: &RelayError) -> pb::Refusal {
    pb::Refusal {
        code: e.code() as u32,
        message: e.to_string(),
        current_epoch: 0,
        retry_after_ms: 0,
        horizon_seq: match e {
            RelayError::Pruned { horizon, .. } => *horizon,
            _ => 0,
        },
    }
}
