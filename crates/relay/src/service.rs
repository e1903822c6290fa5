//! The Relay service: the RPCs of `proto/relay.proto` over the channel log (SubscribeMany's
//! driver in [`many`]).
//! Status codes and texts are the protocol's (`proto/relay.proto`, `tests/relay/`).
//!
//! Every call's work runs in the task that serves its HTTP/2 stream: a unary call in its
//! handler, a streaming call in a driver future polled by its own response body ([`Driven`]).
//! A publish is answered by the task its commit wakes, with no hop through a spawned task; a
//! slow reader's body is not polled, so its driver waits (and a subscriber then catches up
//! from the log); a call whose peer is gone (its body dropped) stops at once.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures_util::stream::Stream;
use futures_util::FutureExt as _;
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tonic::metadata::MetadataMap;
use tonic::{Code, Extensions, Request, Response, Status, Streaming};

use crate::access::{line_budget, CallInfo, Suppressed, ACCESS_LOG};
use crate::auth::{Authenticator, Caller, StreamGuard};
use crate::error::{shutting_down, RelayError, Result};
use crate::framing::{self, ContentType};
use crate::group::{GroupError, Handshake};
use crate::log::{Accepted, Channel, ChannelLog, Checked, Entry, GroupCheck, Outcome, WelcomeKey};
use crate::members::{GroupChange, Reach};
use crate::metrics;
use crate::pb;
use crate::retention::{Policy, MAX_AGE_SECONDS};
use crate::rules::{self, TokenBucket};
use crate::shutdown::{Phase, Shutdown};

mod create;
mod many;

pub(crate) use create::GateSettings;

/// Times BindLeaf checks a proof against a new tree when commits move the channel meanwhile.
const BIND_ATTEMPTS: usize = 3;
/// Rate-limit buckets kept before idle ones are dropped.
const MAX_BUCKETS: usize = 10_000;
/// Publishes of one PublishStream call queued ahead of their answers.
const PIPELINE_DEPTH: usize = 256;
/// Items of one PublishBatches request, and requests of one call read ahead of their answers.
use static_proto::MAX_BATCH_ITEMS as BATCH_ITEMS;
const BATCHES_AHEAD: usize = 64;
/// Entries per Subscribe response when the subscriber asks for batches (and its max_batch).
const SUBSCRIBE_BATCH_BYTES: usize = 1024 * 1024;
const SUBSCRIBE_BATCH_ENTRIES: usize = 1024;
/// Entries a subscription reads from the log at a time (at most: its page is bounded in
/// bytes too, see [`ServiceSettings::page_bytes`]).
const READ_PAGE: usize = 256;
/// Responses a call's driver may queue ahead of its body (at most: the queue is bounded in
/// bytes too, see [`ServiceSettings::queue_bytes`]). The body is polled (and so drains the
/// queue) only when HTTP/2 flow control lets it send: this bounds what a slow peer costs.
const RESPONSE_QUEUE: usize = 16;

/// What the service needs of the relay's configuration.
#[derive(Debug, Clone)]
pub(crate) struct ServiceSettings {
    pub max_message_bytes: usize,
    pub keepalive_interval: Duration,
    /// 0 = no limit.
    pub publish_rate_per_agent: f64,
    /// Channels one SubscribeMany stream may follow at once.
    pub max_subscriptions_per_stream: usize,
    /// Follows one account may hold on all its SubscribeMany streams together.
    pub max_follows_per_account: usize,
    /// The retention of channels that set none (per limit).
    pub default_policy: Policy,
    /// What one streaming call may hold ahead of its peer: half for the page read from the
    /// log, half for the queue of responses (each may exceed its half by one message).
    pub stream_buffer_bytes: usize,
    /// CreateChannel's limits and the pool of costly group checks (`create`).
    pub gate: GateSettings,
}

impl ServiceSettings {
    /// The largest gRPC message read: a message and a welcome at the limit, plus the
    /// request's own fields.
    pub fn transport_limit(&self) -> usize {
        self.max_message_bytes
            .saturating_mul(2)
            .saturating_add(64 * 1024)
    }

    /// The bytes of entries a subscription reads from the log at a time (a page holds at
    /// least one entry, so one message more at most). Measured at e879e1d: a page of 256
    /// entries of 1 MiB held 256 MiB per subscriber that stopped reading.
    pub fn page_bytes(&self) -> usize {
        (self.stream_buffer_bytes / 2).max(1)
    }

    /// The encoded bytes of responses a call may queue ahead of its body (a larger response
    /// waits alone).
    pub fn queue_bytes(&self) -> usize {
        (self.stream_buffer_bytes / 2).max(1)
    }
}

/// Where a call comes from (`ip:port`), put in each request's extensions by the server.
#[derive(Debug, Clone)]
pub(crate) struct Peer(pub Arc<str>);

/// The statuses tonic produces itself while reading a request, worded as the relay words its
/// own (clients and tests read these texts). None: leave the status as it is.
pub(crate) fn transport_error(status: &Status, limit: usize) -> Option<RelayError> {
    let message = status.message();
    match status.code() {
        Code::OutOfRange if message.starts_with("Error, decoded message length too large") => {
            Some(RelayError::resource_exhausted(format!(
                "request larger than the transport limit of {limit} bytes"
            )))
        }
        Code::Internal if message.starts_with("failed to decode Protobuf message") => Some(
            RelayError::InvalidArgument("request is not a valid protobuf message".to_owned()),
        ),
        Code::Internal if message == "Missing request message." => Some(
            RelayError::InvalidArgument("expected a request message".to_owned()),
        ),
        _ => None,
    }
}

/// A bug: logged here, the caller sees only "internal error".
fn internal(what: &str) -> RelayError {
    ::log::error!(target: "static.relay", "internal error: {what}");
    RelayError::Internal
}

/// The Relay gRPC service. Cheap to clone.
#[derive(Clone)]
pub(crate) struct Relay(Arc<Inner>);

struct Inner {
    log: ChannelLog,
    auth: Arc<Authenticator>,
    settings: ServiceSettings,
    buckets: Mutex<HashMap<String, TokenBucket>>,
    /// Follows held per account (scope) on SubscribeMany streams (see `many`).
    follows: Mutex<HashMap<String, usize>>,
    /// Rate limits of creates and org claims; the pool of costly group checks.
    gate: create::Gate,
    shutdown: Shutdown,
}

impl Relay {
    pub fn new(
        log: ChannelLog,
        auth: Arc<Authenticator>,
        settings: ServiceSettings,
        shutdown: Shutdown,
    ) -> Relay {
        let gate = create::Gate::new(settings.gate.clone());
        Relay(Arc::new(Inner {
            log,
            auth,
            gate,
            settings,
            buckets: Mutex::new(HashMap::new()),
            follows: Mutex::new(HashMap::new()),
            shutdown,
        }))
    }

    /// A client-streaming call: its caller checked and its guard taken (see
    /// [`Inner::streaming_caller`]), then driven by `run` over its requests. Returned at once:
    /// the response headers leave before any request is read.
    async fn driven<R, T, Fut>(
        &self,
        request: Request<Streaming<R>>,
        run: impl FnOnce(Arc<Inner>, Caller, Streaming<R>, Sender<Result<T, Status>>) -> Fut,
    ) -> Result<Response<Driven<Result<T, Status>>>, Status>
    where
        T: prost::Message + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let (metadata, extensions, requests) = request.into_parts();
        let (caller, guard) = self.0.streaming_caller(&metadata, &extensions).await?;
        let inner = Arc::clone(&self.0);
        let budget = inner.settings.queue_bytes();
        Ok(Response::new(Driven::new(budget, guard, move |tx| {
            run(inner, caller, requests, tx)
        })))
    }
}

impl Inner {
    /// Authenticates a call (once per call, never per message).
    async fn caller(&self, metadata: &MetadataMap, extensions: &Extensions) -> Result<Caller> {
        let peer = extensions
            .get::<Peer>()
            .map_or_else(|| Arc::from("unknown"), |p| Arc::clone(&p.0));
        let caller = self.auth.authenticate(metadata, &peer).await?;
        // For the access log: who the call is, once known.
        if let Some(who) = extensions.get::<Arc<CallInfo>>() {
            who.set(&caller.account, caller.key_id.as_ref());
        }
        Ok(caller)
    }

    /// Authenticates a streaming call and takes its guard, before anything of the call is
    /// read: the guard ends the call on revocation, expiry or shutdown (see [`Driven::new`],
    /// which every streaming response is built with), and refuses an account that holds
    /// `--relay-max-streams-per-account` streams already. Measured at 9b2be07, when only the
    /// subscriptions had one: a PublishBatches call had its items accepted 83 s after its
    /// key was revoked.
    async fn streaming_caller(
        &self,
        metadata: &MetadataMap,
        extensions: &Extensions,
    ) -> Result<(Caller, StreamGuard)> {
        let caller = self.caller(metadata, extensions).await?;
        let guard = self.auth.watch(&caller)?;
        Ok((caller, guard))
    }

    async fn channel(&self, account: &str, name: &str) -> Result<Arc<Channel>> {
        match self.log.loaded(account, name) {
            Some(channel) => Ok(channel),
            None => self.log.channel(account, name).await,
        }
    }

    /// A unary call on one channel: its caller authenticated, the channel's name checked and
    /// the channel found (what the caller may do there, its handler checks).
    async fn addressed<M: Addressed>(
        &self,
        request: Request<M>,
    ) -> Result<(Caller, String, Arc<Channel>, M)> {
        let (metadata, extensions, mut request) = request.into_parts();
        let caller = self.caller(&metadata, &extensions).await?;
        let name = channel_name(request.take_channel())?;
        let channel = self.channel(&caller.account, &name).await?;
        Ok((caller, name, channel, request))
    }

    /// The last seq `account` may read of `channel` (u64::MAX for a member; the commit that
    /// removed it for an account that was one, on this relay): PermissionDenied otherwise.
    async fn read_limit(&self, channel: &Channel, account: &str) -> Result<u64> {
        match self.log.reach(channel, account).await? {
            Reach::Member => Ok(u64::MAX),
            Reach::Until(seq) => Ok(seq),
            Reach::None => Err(not_a_member(channel.name())),
        }
    }

    /// PermissionDenied unless `account` is a member of `channel` now.
    async fn require_member(&self, channel: &Channel, account: &str) -> Result<()> {
        match self.log.reach(channel, account).await? {
            Reach::Member => Ok(()),
            Reach::Until(_) | Reach::None => Err(not_a_member(channel.name())),
        }
    }

    /// A publish to a channel with a group: application messages must be private, handshakes
    /// public and valid at their epoch (see `proto/relay.proto`, Membership).
    async fn check_group(&self, channel: &Channel, checked: &Checked) -> Result<GroupCheck> {
        let header = &checked.header;
        if header.content_type == ContentType::Application {
            if header.wire_format != framing::PRIVATE_MESSAGE {
                return Err(RelayError::InvalidArgument(
                    "application messages must be PrivateMessages".to_owned(),
                ));
            }
            return Ok(GroupCheck::Unchecked);
        }
        if header.wire_format != framing::PUBLIC_MESSAGE {
            return Err(RelayError::InvalidArgument(
                "handshake messages (commits and proposals) must be PublicMessages".to_owned(),
            ));
        }
        let Some(state) = self.log.group(channel).await? else {
            return Ok(GroupCheck::Unchecked);
        };
        if header.epoch != state.epoch() {
            // Stale, or the retry of a logged one: the writer tells which.
            return Ok(GroupCheck::OtherEpoch);
        }
        let proposals = if header.content_type == ContentType::Commit {
            self.log.proposals(channel, header.epoch).await?
        } else {
            Vec::new()
        };
        // In the pool of costly checks, within the account's budget (`create::Gate`).
        let message = checked.message.clone();
        match self
            .gate
            .check_handshake(&checked.account, state, message, proposals)
            .await?
        {
            Handshake::Proposal { .. } => Ok(GroupCheck::Valid(None)),
            Handshake::Commit(outcome) => {
                let change = GroupChange::new(outcome.next, outcome.removed, outcome.added)?;
                Ok(GroupCheck::Valid(Some(Arc::new(change))))
            }
        }
    }

    /// PermissionDenied unless `account` owns the channel's org (for a legacy channel: is its
    /// owner). One store read, before anything is written.
    async fn require_org_owner(&self, channel: &Channel, account: &str) -> Result<()> {
        let owns = if channel.is_legacy() {
            self.log.reach(channel, account).await? == Reach::Member
        } else {
            let org = channel.name().split('/').next().unwrap_or_default();
            self.log.org_owner(org).await?.as_deref() == Some(account)
        };
        if owns {
            return Ok(());
        }
        Err(RelayError::PermissionDenied(format!(
            "only the account owning the org of channel '{}' may set its retention",
            channel.name()
        )))
    }

    /// The channel's retention as GetRetention and SetRetention answer it.
    async fn retention_response(&self, channel: &Channel) -> Result<pb::RetentionResponse> {
        let row = self.log.retention_row(channel).await?;
        let effective = row.policy.over(&self.settings.default_policy);
        Ok(pb::RetentionResponse {
            channel_policy: Some(wire_policy(&row.policy)),
            effective: Some(wire_policy(&effective)),
            horizon_seq: row.horizon,
            head_seq: row.head_seq.max(channel.head_seq()),
        })
    }

    /// Everything decided about a publish before its channel is looked up (`_check`).
    fn check(&self, request: pb::PublishRequest, caller: &Caller) -> Result<(String, Checked)> {
        let name = channel_name(request.channel)?;
        let limit = self.settings.max_message_bytes;
        if request.message.len() > limit || request.welcome.len() > limit {
            return Err(RelayError::resource_exhausted(format!(
                "message larger than {limit} bytes"
            )));
        }
        if request.message.is_empty() {
            return Err(RelayError::InvalidArgument("empty message".to_owned()));
        }
        let key = rules::idempotency_key(&request.idempotency_key, &request.message)?;
        let header = framing::parse_message(&request.message)
            .map_err(|e| RelayError::InvalidArgument(format!("malformed MLS message: {e}")))?;
        if header.group_id != name.as_bytes() {
            return Err(RelayError::InvalidArgument(format!(
                "the message belongs to another group than channel '{name}'"
            )));
        }
        let mut welcome_refs = Vec::new();
        if !request.welcome.is_empty() {
            if header.content_type != ContentType::Commit {
                return Err(RelayError::InvalidArgument(
                    "a welcome can only be published with a commit".to_owned(),
                ));
            }
            welcome_refs = framing::parse_welcome(&request.welcome)
                .map_err(|e| RelayError::InvalidArgument(format!("malformed welcome: {e}")))?
                .key_package_refs;
        }
        self.rate_limit(caller)?;
        let checked = Checked {
            header,
            message: request.message,
            key,
            welcome: request.welcome,
            welcome_refs,
            account: Arc::clone(&caller.account),
            group: GroupCheck::Unchecked,
        };
        Ok((name, checked))
    }

    fn rate_limit(&self, caller: &Caller) -> Result<()> {
        let rate = self.settings.publish_rate_per_agent;
        if rate.is_nan() || rate <= 0.0 {
            return Ok(());
        }
        let now = Instant::now();
        let wait = {
            let mut buckets = self.buckets.lock().unwrap_or_else(PoisonError::into_inner);
            match buckets.get_mut(&caller.agent) {
                Some(bucket) => bucket.take(now, 1.0),
                None => {
                    if buckets.len() >= MAX_BUCKETS {
                        let idle = Duration::from_secs(60);
                        buckets.retain(|_, b| now.saturating_duration_since(b.updated) < idle);
                    }
                    let mut bucket = TokenBucket::full(rate, rate, now);
                    let wait = bucket.take(now, 1.0);
                    buckets.insert(caller.agent.clone(), bucket);
                    wait
                }
            }
        };
        if wait.is_zero() {
            return Ok(());
        }
        let ms = (wait.as_secs_f64() * 1000.0).round().max(1.0);
        // Saturating float-to-int conversion: a "never" (Duration::MAX) stays huge.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let retry_after_ms = ms as u64;
        Err(RelayError::ResourceExhausted {
            message: format!("publish rate limit of {rate} messages/s per agent exceeded"),
            retry_after_ms,
        })
    }

    /// A publish checked and its channel loaded, ready to submit.
    async fn prepare(
        &self,
        request: pb::PublishRequest,
        caller: &Caller,
    ) -> Result<(Arc<Channel>, Checked)> {
        let (name, mut checked) = self.check(request, caller)?;
        let channel = self.channel(&caller.account, &name).await?;
        self.require_member(&channel, &caller.account).await?;
        if !channel.is_legacy() {
            checked.group = self.check_group(&channel, &checked).await?;
        }
        Ok((channel, checked))
    }

    /// Submits one publish; `more`: the caller has more at hand right away (see
    /// [`ChannelLog::submit_more`]).
    fn submit_one(&self, item: (Arc<Channel>, Checked), more: bool) -> Result<Outcome> {
        let items = vec![item];
        let mut outcomes = if more {
            self.log.submit_more(items)
        } else {
            self.log.submit(items)
        };
        outcomes
            .pop()
            .ok_or_else(|| internal("the log gave no outcome for a publish"))
    }

    /// Waits for a submitted publish's decision. Cancel-safe; not to be polled again once it
    /// returned (the caller drops or replaces the outcome).
    async fn decided(&self, outcome: &mut Outcome) -> Result<Accepted> {
        match outcome.await {
            Ok(result) => result,
            Err(_) if self.shutdown.reached(Phase::Refusing) => Err(shutting_down()),
            Err(_) => Err(internal("a publish was dropped without an answer")),
        }
    }

    /// PublishStream: requests are read and submitted while earlier ones are being committed
    /// (so they share group commits); answers go out in request order. The first refusal
    /// ends the call after the answers before it.
    async fn publish_stream(
        self: Arc<Self>,
        caller: Caller,
        requests: Streaming<pb::PublishRequest>,
        tx: Sender<Result<pb::PublishResponse, Status>>,
    ) {
        let mut requests = Lookahead::new(requests);
        let mut shutdown = self.shutdown.watch();
        let mut queue: VecDeque<Result<Outcome, Status>> = VecDeque::new();
        let mut reading = true;
        while reading || !queue.is_empty() {
            tokio::select! {
                biased;
                decided = self.head_of_stream(&mut queue), if !queue.is_empty() => {
                    queue.pop_front();
                    let refused = decided.is_err();
                    if tx.send(decided.map(publish_response)).await.is_err() || refused {
                        return;
                    }
                }
                message = requests.message(), if reading && queue.len() < PIPELINE_DEPTH => {
                    match message {
                        Ok(Some(request)) => {
                            let item = match self.prepare(request, &caller).await {
                                Ok(item) => self.submit_one(item, requests.more_ready()),
                                Err(e) => Err(e),
                            };
                            // A refusal ends the reading: nothing after it is submitted.
                            reading = item.is_ok();
                            queue.push_back(item.map_err(|e| e.to_status()));
                        }
                        Ok(None) => reading = false,
                        Err(status) => {
                            queue.push_back(Err(self.request_failed(status)));
                            reading = false;
                        }
                    }
                }
                () = shutdown.reached(Phase::Refusing), if reading => {
                    queue.push_back(Err(shutting_down().to_status()));
                    reading = false;
                }
            }
        }
    }

    async fn head_of_stream(
        &self,
        queue: &mut VecDeque<Result<Outcome, Status>>,
    ) -> Result<Accepted, Status> {
        match queue.front_mut() {
            Some(Ok(outcome)) => self.decided(outcome).await.map_err(|e| e.to_status()),
            Some(Err(status)) => Err(status.clone()),
            None => std::future::pending().await,
        }
    }

    /// PublishBatches: each request's items are submitted together as it is read (so
    /// batches share group commits); each request is answered, in order, once all its items
    /// are decided. A refused item is answered as such; only a failure of the call ends it.
    async fn publish_batches(
        self: Arc<Self>,
        caller: Caller,
        requests: Streaming<pb::PublishBatchRequest>,
        tx: Sender<Result<pb::PublishBatchResponse, Status>>,
    ) {
        let mut requests = Lookahead::new(requests);
        let mut shutdown = self.shutdown.watch();
        let mut queue: VecDeque<Result<Vec<Slot>, Status>> = VecDeque::new();
        let mut reading = true;
        while reading || !queue.is_empty() {
            tokio::select! {
                biased;
                () = self.settle_head(&mut queue), if !queue.is_empty() => {
                    let Some(head) = queue.pop_front() else { continue };
                    if let Ok(slots) = &head {
                        note_item_refusals(&caller, slots);
                    }
                    let failed = head.is_err();
                    if tx.send(head.map(batch_response)).await.is_err() || failed {
                        return;
                    }
                }
                message = requests.message(), if reading && queue.len() < BATCHES_AHEAD => {
                    match message {
                        Ok(Some(batch)) if batch.requests.len() > BATCH_ITEMS => {
                            let refusal = RelayError::InvalidArgument(format!(
                                "{} requests in one batch; at most {BATCH_ITEMS}",
                                batch.requests.len()
                            ));
                            queue.push_back(Err(refusal.to_status()));
                            reading = false;
                        }
                        Ok(Some(batch)) => {
                            let more = requests.more_ready();
                            let slots = self.submit_batch(batch.requests, &caller, more).await;
                            queue.push_back(Ok(slots));
                        }
                        Ok(None) => reading = false,
                        Err(status) => {
                            queue.push_back(Err(self.request_failed(status)));
                            reading = false;
                        }
                    }
                }
                () = shutdown.reached(Phase::Refusing), if reading => {
                    queue.push_back(Err(shutting_down().to_status()));
                    reading = false;
                }
            }
        }
    }

    /// Checks every item of a batch in order and submits the accepted ones together.
    async fn submit_batch(
        &self,
        requests: Vec<pb::PublishRequest>,
        caller: &Caller,
        more: bool,
    ) -> Vec<Slot> {
        let mut items = Vec::with_capacity(requests.len());
        let mut refusals = Vec::with_capacity(requests.len());
        // Once the rate limit refuses an item, it refuses the rest of the request too: the
        // bucket refills while the items are checked, and letting a later item through after
        // an earlier one was refused would reorder a sender's pipelined messages.
        let mut rate_limited: Option<RelayError> = None;
        for request in requests {
            if let Some(refusal) = &rate_limited {
                refusals.push(Some(refusal.clone()));
                continue;
            }
            match self.prepare(request, caller).await {
                Ok(item) => {
                    items.push(item);
                    refusals.push(None);
                }
                Err(e) => {
                    if matches!(e, RelayError::ResourceExhausted { retry_after_ms, .. } if retry_after_ms > 0)
                    {
                        rate_limited = Some(e.clone());
                    }
                    refusals.push(Some(e));
                }
            }
        }
        let mut outcomes = if items.is_empty() {
            Vec::new().into_iter()
        } else if more {
            self.log.submit_more(items).into_iter()
        } else {
            self.log.submit(items).into_iter()
        };
        refusals
            .into_iter()
            .map(|refusal| match refusal {
                Some(e) => Slot::Decided(publish_result(Err(e))),
                None => match outcomes.next() {
                    Some(outcome) => Slot::Waiting(outcome),
                    None => Slot::Decided(publish_result(Err(internal(
                        "the log gave fewer outcomes than publishes",
                    )))),
                },
            })
            .collect()
    }

    /// Waits until every item of the first queued batch is decided (cancel-safe: decisions
    /// are kept in the slots as they come).
    async fn settle_head(&self, queue: &mut VecDeque<Result<Vec<Slot>, Status>>) {
        let Some(Ok(slots)) = queue.front_mut() else {
            return;
        };
        for slot in slots.iter_mut() {
            if let Slot::Waiting(outcome) = slot {
                let result = self.decided(outcome).await;
                *slot = Slot::Decided(publish_result(result));
            }
        }
    }

    /// The status a streaming call ends with when reading its requests failed.
    fn request_failed(&self, status: Status) -> Status {
        match transport_error(&status, self.settings.transport_limit()) {
            Some(e) => e.to_status(),
            None => status,
        }
    }

    /// Subscribe's stream: a keep-alive, then the log after `cursor` (replayed, then live)
    /// until the peer leaves or the stream is ended (revocation, expiry, shutdown).
    async fn follow(
        self: Arc<Self>,
        channel: Arc<Channel>,
        account: Arc<str>,
        cursor: u64,
        max_batch: usize,
        tx: Sender<Result<pb::SubscribeResponse, Status>>,
    ) {
        if let Some(reason) = self
            .stream_entries(&channel, &account, cursor, max_batch, &tx)
            .await
        {
            let _ = tx.send(Err(reason.to_status())).await;
        }
    }

    /// None when the subscriber is gone, else why the stream ends.
    async fn stream_entries(
        &self,
        channel: &Channel,
        account: &str,
        mut cursor: u64,
        max_batch: usize,
        tx: &Sender<Result<pb::SubscribeResponse, Status>>,
    ) -> Option<RelayError> {
        // A zero interval would make this loop spin on keep-alives.
        let interval = self
            .settings
            .keepalive_interval
            .max(Duration::from_millis(1));
        let mut head = channel.watch_head();
        let mut shutdown = self.shutdown.watch();
        // A first keep-alive right away tells the client the subscription is live.
        if tx.send(Ok(keep_alive(channel.head_seq()))).await.is_err() {
            return None;
        }
        // Made once and polled in every wait below (cancel-safe). Revocation and expiry are
        // the call's guard's (see `Driven::new`).
        let drained = shutdown.reached(Phase::Refusing);
        let idle = tokio::time::sleep(interval);
        tokio::pin!(drained, idle);
        let page_size = READ_PAGE.max(max_batch);
        let page_bytes = self.settings.page_bytes();
        loop {
            let last = *head.borrow_and_update();
            // Membership is looked at whenever the head moved (a commit may have removed the
            // account): a departed member reads up to the commit that removed it, then ends.
            let limit = match self.read_limit(channel, account).await {
                Ok(limit) => limit,
                Err(e) => return Some(e),
            };
            if cursor >= limit {
                return Some(not_a_member(channel.name()));
            }
            if cursor < last {
                let page = tokio::select! {
                    biased;
                    () = &mut drained => return Some(shutting_down()),
                    page = self.log.read_page(channel, cursor, page_size, page_bytes) => page,
                };
                let page = match page.and_then(|page| consecutive(page, cursor, last)) {
                    Ok(mut page) => {
                        page.retain(|e| e.seq <= limit);
                        page
                    }
                    Err(e) => return Some(e),
                };
                cursor = page.last().map_or(cursor, |e| e.seq);
                // A slow reader makes these sends wait (its body is not polled): it falls
                // behind here and reads the rest from the log later, costing nobody else.
                for response in responses(page, max_batch) {
                    if tx.send(Ok(response)).await.is_err() {
                        return None;
                    }
                }
                delivered_live(channel, cursor);
                // Entries count as traffic: no keep-alive for that interval.
                idle.as_mut().reset(tokio::time::Instant::now() + interval);
                continue;
            }
            tokio::select! {
                biased;
                () = &mut drained => return Some(shutting_down()),
                changed = head.changed() => {
                    if changed.is_err() {
                        // The channel's writer side is gone: only a closing log does that.
                        return Some(shutting_down());
                    }
                }
                () = &mut idle => {
                    if tx.send(Ok(keep_alive(channel.head_seq()))).await.is_err() {
                        return None;
                    }
                    idle.as_mut().reset(tokio::time::Instant::now() + interval);
                }
            }
        }
    }
}

/// A request naming one channel.
trait Addressed {
    fn take_channel(&mut self) -> String;
}

macro_rules! addressed {
    ($($request:ty),*) => {
        $(impl Addressed for $request {
            fn take_channel(&mut self) -> String {
                std::mem::take(&mut self.channel)
            }
        })*
    };
}

addressed!(
    pb::SubscribeRequest,
    pb::BindLeafRequest,
    pb::ListMembersRequest,
    pb::FetchWelcomeRequest,
    pb::SetRetentionRequest,
    pb::GetRetentionRequest
);

/// One item of a PublishBatches request.
enum Slot {
    Waiting(Outcome),
    Decided(pb::PublishResult),
}

/// A page up to `sent` went to a subscriber: when that is the channel's head, published to
/// this relay, it was a live delivery, timed from that publish (one observation per page).
pub(crate) fn delivered_live(channel: &Channel, sent: u64) {
    if sent != channel.head_seq() {
        return;
    }
    if let Some(submitted) = channel.submitted_ns(sent) {
        metrics::metrics()
            .publish_to_delivery
            .observe(metrics::since_ns(submitted).as_secs_f64());
    }
}

/// The refusal of a caller whose account has no bound leaf in the channel.
fn not_a_member(channel: &str) -> RelayError {
    RelayError::PermissionDenied(format!(
        "this account is not a member of channel '{channel}' (no leaf of its group is bound to \
         it)"
    ))
}

/// A handshake or group state the channel's group refused, as a status.
fn group_refusal(e: GroupError) -> RelayError {
    if e.is_permission_denied() {
        RelayError::PermissionDenied(e.to_string())
    } else if e.is_internal() {
        ::log::error!(target: "static.relay", "internal error: {e}");
        RelayError::Internal
    } else {
        RelayError::InvalidArgument(e.to_string())
    }
}

fn channel_name(name: String) -> Result<String> {
    match static_mls::validate_channel_name(&name) {
        Ok(()) => Ok(name),
        Err(e) => Err(RelayError::InvalidArgument(e.to_string())),
    }
}

fn publish_response(accepted: Accepted) -> pb::PublishResponse {
    pb::PublishResponse {
        seq: accepted.seq,
        epoch: accepted.epoch,
        duplicate: accepted.duplicate,
    }
}

fn wire_policy(policy: &Policy) -> pb::RetentionPolicy {
    pb::RetentionPolicy {
        max_age_seconds: policy.max_age_seconds,
        max_entries: policy.max_entries,
        max_bytes: policy.max_bytes,
    }
}

/// A policy as SetRetention asks for it: INVALID_ARGUMENT beyond the store's integers.
fn requested_policy(policy: Option<pb::RetentionPolicy>) -> Result<Policy> {
    let policy = policy.unwrap_or_default();
    let fits = |v: Option<u64>, max: u64| v.is_none_or(|v| v <= max);
    let max = u64::try_from(i64::MAX).unwrap_or(u64::MAX);
    if !fits(policy.max_age_seconds, MAX_AGE_SECONDS)
        || !fits(policy.max_entries, max)
        || !fits(policy.max_bytes, max)
    {
        return Err(RelayError::InvalidArgument(format!(
            "retention limits must be at most {MAX_AGE_SECONDS} seconds and {max} entries or \
             bytes"
        )));
    }
    Ok(Policy {
        max_age_seconds: policy.max_age_seconds,
        max_entries: policy.max_entries,
        max_bytes: policy.max_bytes,
    })
}

/// Counts the refused items of a batch and logs them as one line (counts per code, the first
/// refusal's text), within the account's budget of lines ([`line_budget`]): its call ends OK,
/// so the access log would not show them. Measured at 9b2be07 (a line per item): batches of
/// 1,024 malformed one-byte items wrote 19 bytes of log per byte received.
fn note_item_refusals(caller: &Caller, slots: &[Slot]) {
    use pb::publish_result::Outcome as Decision;
    let mut counts: Vec<(&'static str, u64)> = Vec::new();
    let mut first: Option<&pb::Refusal> = None;
    for slot in slots {
        if let Slot::Decided(pb::PublishResult {
            outcome: Some(Decision::Refused(refusal)),
        }) = slot
        {
            let label = refusal_label(refusal);
            match counts.iter_mut().find(|(l, _)| *l == label) {
                Some((_, n)) => *n += 1,
                None => counts.push((label, 1)),
            }
            first.get_or_insert(refusal);
        }
    }
    let Some(first) = first else {
        return;
    };
    let m = metrics::metrics();
    for (label, n) in &counts {
        m.refusals.with_label_values(&[label]).inc_by(*n);
    }
    if !::log::log_enabled!(target: ACCESS_LOG, ::log::Level::Info) {
        return;
    }
    let Some(suppressed) = line_budget().admit(&format!("account:{}", caller.account)) else {
        return;
    };
    let refused: u64 = counts.iter().map(|(_, n)| n).sum();
    let counts: Vec<String> = counts.iter().map(|(l, n)| format!("{l}={n}")).collect();
    ::log::info!(
        target: ACCESS_LOG,
        "PublishBatches items refused {refused} of {} ({}) account={} key={} first={}{}",
        slots.len(),
        counts.join(" "),
        if caller.account.is_empty() { "anonymous" } else { &caller.account },
        caller.key_id.as_deref().unwrap_or("-"),
        first.message.chars().take(200).collect::<String>(),
        Suppressed(suppressed),
    );
}

fn refusal_label(refusal: &pb::Refusal) -> &'static str {
    metrics::code_label(Code::from_i32(i32::try_from(refusal.code).unwrap_or(2)))
}

/// One refusal inside a call that goes on (a SubscribeMany follow ended): counted, and logged
/// within the account's budget of lines ([`line_budget`]).
pub(crate) fn note_refusal(caller: &Caller, what: &str, refusal: &pb::Refusal) {
    let label = refusal_label(refusal);
    metrics::metrics()
        .refusals
        .with_label_values(&[label])
        .inc();
    if !::log::log_enabled!(target: ACCESS_LOG, ::log::Level::Info) {
        return;
    }
    let Some(suppressed) = line_budget().admit(&format!("account:{}", caller.account)) else {
        return;
    };
    ::log::info!(
        target: ACCESS_LOG,
        "{what} {label} account={} key={} message={}{}",
        if caller.account.is_empty() { "anonymous" } else { &caller.account },
        caller.key_id.as_deref().unwrap_or("-"),
        refusal.message.chars().take(200).collect::<String>(),
        Suppressed(suppressed),
    );
}

/// What Publish would have answered, as one result of a batch.
fn publish_result(result: Result<Accepted>) -> pb::PublishResult {
    use pb::publish_result::Outcome as Decision;
    let outcome = match result {
        Ok(accepted) => Decision::Accepted(publish_response(accepted)),
        Err(e) => {
            let (current_epoch, retry_after_ms) = match &e {
                RelayError::StaleEpoch { current_epoch, .. } => (*current_epoch, 0),
                RelayError::ResourceExhausted { retry_after_ms, .. } => (0, *retry_after_ms),
                _ => (0, 0),
            };
            Decision::Refused(pb::Refusal {
                code: e.code() as u32,
                message: e.to_string(),
                current_epoch,
                retry_after_ms,
                horizon_seq: 0,
            })
        }
    };
    pb::PublishResult {
        outcome: Some(outcome),
    }
}

fn batch_response(slots: Vec<Slot>) -> pb::PublishBatchResponse {
    let results = slots
        .into_iter()
        .map(|slot| match slot {
            Slot::Decided(result) => result,
            // settle_head decided every slot before the batch is answered.
            Slot::Waiting(_) => publish_result(Err(internal("a batch answered before its end"))),
        })
        .collect();
    pb::PublishBatchResponse { results }
}

fn keep_alive(head_seq: u64) -> pb::SubscribeResponse {
    pb::SubscribeResponse {
        item: Some(pb::subscribe_response::Item::KeepAlive(pb::KeepAlive {
            head_seq,
        })),
    }
}

fn wire_entry(entry: Entry) -> pb::Entry {
    metrics::metrics().delivered.inc();
    pb::Entry {
        seq: entry.seq,
        epoch: entry.epoch,
        content_type: entry.content_type,
        message: entry.message,
        account: entry.account.to_string(),
    }
}

/// A page of the log must start right after the cursor and have no gap (never expected).
fn consecutive(page: Vec<Entry>, cursor: u64, head: u64) -> Result<Vec<Entry>> {
    if page.is_empty() {
        return Err(RelayError::Unavailable(format!(
            "log ends before seq {head}"
        )));
    }
    for (offset, entry) in (1u64..).zip(&page) {
        if entry.seq != cursor + offset {
            return Err(RelayError::Unavailable(format!(
                "log gap after seq {}",
                cursor + offset - 1
            )));
        }
    }
    Ok(page)
}

/// A page as Subscribe responses: one `entry` each, or with `max_batch > 1` runs of
/// [`batches`].
fn responses(page: Vec<Entry>, max_batch: usize) -> Vec<pb::SubscribeResponse> {
    use pb::subscribe_response::Item;
    let single = max_batch <= 1;
    batches(page, max_batch)
        .into_iter()
        .map(|mut entries| {
            // batches() gives runs of one entry each when `single`.
            let entry = if single { entries.pop() } else { None };
            let item = entry.map_or_else(|| Item::Entries(pb::Entries { entries }), Item::Entry);
            pb::SubscribeResponse { item: Some(item) }
        })
        .collect()
}

/// A page cut into runs of at most `max_batch` entries (one each for 0 or 1) and about
/// [`SUBSCRIBE_BATCH_BYTES`] (a larger entry travels alone), in order.
fn batches(page: Vec<Entry>, max_batch: usize) -> Vec<Vec<pb::Entry>> {
    let max_batch = max_batch.max(1);
    let mut out = Vec::new();
    let mut current: Vec<pb::Entry> = Vec::new();
    let mut size = 0;
    for entry in page {
        if !current.is_empty()
            && (current.len() >= max_batch || size + entry.message.len() > SUBSCRIBE_BATCH_BYTES)
        {
            out.push(std::mem::take(&mut current));
            size = 0;
        }
        size += entry.message.len();
        current.push(wire_entry(entry));
    }
    if !current.is_empty() {
        out.push(current);
    }
    out
}

#[tonic::async_trait]
impl pb::relay_server::Relay for Relay {
    async fn create_channel(
        &self,
        request: Request<pb::CreateChannelRequest>,
    ) -> Result<Response<pb::CreateChannelResponse>, Status> {
        Ok(create::create_channel(&self.0, request).await?)
    }

    async fn bind_leaf(
        &self,
        request: Request<pb::BindLeafRequest>,
    ) -> Result<Response<pb::BindLeafResponse>, Status> {
        let inner = &self.0;
        let (caller, name, channel, request) = inner.addressed(request).await?;
        let binding = request
            .binding
            .ok_or_else(|| RelayError::InvalidArgument("binding is required".to_owned()))?;
        // A commit may move the channel on between the check and the write: then check
        // against the new tree (a few times; commits are not that frequent).
        for _ in 0..BIND_ATTEMPTS {
            let state = inner.log.group(&channel).await?.ok_or_else(|| {
                RelayError::InvalidArgument(format!(
                    "channel '{name}' was created before membership (a legacy channel): \
                     there is no group to bind to"
                ))
            })?;
            state
                .verify_binding(binding.leaf_index, &caller.account, &binding.signature)
                .map_err(group_refusal)?;
            let epoch = state.epoch();
            if inner
                .log
                .bind(&channel, epoch, binding.leaf_index, &caller.account)
                .await?
            {
                return Ok(Response::new(pb::BindLeafResponse { epoch }));
            }
        }
        Err(RelayError::Unavailable(format!(
            "channel '{name}' kept moving to new epochs while binding: try again"
        ))
        .into())
    }

    async fn list_members(
        &self,
        request: Request<pb::ListMembersRequest>,
    ) -> Result<Response<pb::ListMembersResponse>, Status> {
        let inner = &self.0;
        let (caller, name, channel, _) = inner.addressed(request).await?;
        inner.require_member(&channel, &caller.account).await?;
        if channel.is_legacy() {
            return Err(RelayError::InvalidArgument(format!(
                "channel '{name}' was created before membership (a legacy channel): the relay \
                 does not know its members"
            ))
            .into());
        }
        let (epoch, members) = inner.log.members_of(&channel).await?;
        let members = members
            .into_iter()
            .map(|(leaf, account)| pb::Member {
                leaf_index: leaf.leaf_index,
                identity: leaf.identity.into(),
                signature_key: leaf.signature_key.into(),
                bound: account.is_some(),
                account: account.map(|a| a.to_string()).unwrap_or_default(),
            })
            .collect();
        Ok(Response::new(pb::ListMembersResponse { epoch, members }))
    }

    async fn publish(
        &self,
        request: Request<pb::PublishRequest>,
    ) -> Result<Response<pb::PublishResponse>, Status> {
        let (metadata, extensions, request) = request.into_parts();
        let caller = self.0.caller(&metadata, &extensions).await?;
        let item = self.0.prepare(request, &caller).await?;
        let mut outcome = self.0.submit_one(item, false)?;
        // Answered as soon as the commit decides it.
        let accepted = self.0.decided(&mut outcome).await?;
        Ok(Response::new(publish_response(accepted)))
    }

    type PublishStreamStream = Driven<Result<pb::PublishResponse, Status>>;

    async fn publish_stream(
        &self,
        request: Request<Streaming<pb::PublishRequest>>,
    ) -> Result<Response<Self::PublishStreamStream>, Status> {
        self.driven(request, Inner::publish_stream).await
    }

    type PublishBatchesStream = Driven<Result<pb::PublishBatchResponse, Status>>;

    async fn publish_batches(
        &self,
        request: Request<Streaming<pb::PublishBatchRequest>>,
    ) -> Result<Response<Self::PublishBatchesStream>, Status> {
        self.driven(request, Inner::publish_batches).await
    }

    type SubscribeStream = Driven<Result<pb::SubscribeResponse, Status>>;

    async fn subscribe(
        &self,
        request: Request<pb::SubscribeRequest>,
    ) -> Result<Response<Self::SubscribeStream>, Status> {
        use pb::subscribe_request::Start;
        let inner = &self.0;
        let (metadata, extensions, mut request) = request.into_parts();
        // The guard first: an account at its limit of streams is refused before anything is
        // read. Registered before the drain is looked at (in `follow`): a shutdown either sees
        // this guard or is seen by the stream.
        let (caller, guard) = inner.streaming_caller(&metadata, &extensions).await?;
        let name = channel_name(request.take_channel())?;
        let channel = inner.channel(&caller.account, &name).await?;
        inner.read_limit(&channel, &caller.account).await?;
        let after_seq = match request.start {
            Some(Start::FromEpoch(epoch)) => inner.log.start_of_epoch(&channel, epoch).await?,
            Some(Start::AfterSeq(seq)) => seq,
            None => 0,
        };
        channel.check_cursor(after_seq)?;
        let max_batch = request.max_batch.min(SUBSCRIBE_BATCH_ENTRIES as u32) as usize;
        let inner = Arc::clone(inner);
        let account = Arc::clone(&caller.account);
        let budget = inner.settings.queue_bytes();
        Ok(Response::new(Driven::new(budget, guard, move |tx| {
            inner.follow(channel, account, after_seq, max_batch, tx)
        })))
    }

    type SubscribeManyStream = Driven<Result<pb::SubscribeManyResponse, Status>>;

    async fn subscribe_many(
        &self,
        request: Request<Streaming<pb::SubscribeManyRequest>>,
    ) -> Result<Response<Self::SubscribeManyStream>, Status> {
        self.driven(request, Inner::subscribe_many).await
    }

    async fn fetch_welcome(
        &self,
        request: Request<pb::FetchWelcomeRequest>,
    ) -> Result<Response<pb::FetchWelcomeResponse>, Status> {
        use pb::fetch_welcome_request::Key;
        let inner = &self.0;
        let (caller, _, channel, request) = inner.addressed(request).await?;
        inner.require_member(&channel, &caller.account).await?;
        let key = match request.key {
            Some(Key::WelcomeSha256(digest)) => WelcomeKey::Digest(digest.to_vec()),
            Some(Key::KeyPackageRef(key_package_ref)) => {
                WelcomeKey::KeyPackageRef(key_package_ref.to_vec())
            }
            None => {
                return Err(RelayError::InvalidArgument(
                    "set welcome_sha256 or key_package_ref".to_owned(),
                )
                .into())
            }
        };
        let found = inner
            .log
            .fetch_welcome(&channel, key)
            .await?
            .ok_or_else(|| RelayError::NotFound("no such welcome".to_owned()))?;
        Ok(Response::new(pb::FetchWelcomeResponse {
            welcome: found.welcome,
            commit_seq: found.commit_seq,
            epoch: found.epoch,
        }))
    }

    async fn set_retention(
        &self,
        request: Request<pb::SetRetentionRequest>,
    ) -> Result<Response<pb::RetentionResponse>, Status> {
        let inner = &self.0;
        let (caller, _, channel, request) = inner.addressed(request).await?;
        let policy = requested_policy(request.policy)?;
        inner.require_org_owner(&channel, &caller.account).await?;
        inner.rate_limit(&caller)?;
        inner.log.set_retention(&channel, policy).await?;
        Ok(Response::new(inner.retention_response(&channel).await?))
    }

    async fn get_retention(
        &self,
        request: Request<pb::GetRetentionRequest>,
    ) -> Result<Response<pb::RetentionResponse>, Status> {
        let inner = &self.0;
        let (caller, _, channel, _) = inner.addressed(request).await?;
        if inner.read_limit(&channel, &caller.account).await.is_err() {
            inner.require_org_owner(&channel, &caller.account).await?;
        }
        Ok(Response::new(inner.retention_response(&channel).await?))
    }
}

type Driver = Pin<Box<dyn Future<Output = ()> + Send>>;

/// A response stream whose producer (the driver) runs inside the stream's own polls: no task
/// is spawned, the driver runs only while the body is polled (that is, while HTTP/2 flow
/// control lets the call send), and it is dropped with the body when the peer goes away.
///
/// Every streaming call's response is one of these, and one is only made with the call's
/// [`StreamGuard`]: the guard is polled before the driver at every poll, and once it ends
/// (revocation, expiry, shutdown) the driver is dropped (nothing more of the call is read or
/// decided) and the call ends with the guard's reason, after the responses already queued.
///
/// So a driver may stay suspended at any await for as long as its peer does not read: what it
/// awaits must not hold anything others wait for. Store reads run as tasks of their own (the
/// PostgreSQL read pool's shared connections; SQLite's blocking threads) for that reason.
pub(crate) struct Driven<T> {
    driver: Option<Driver>,
    rx: mpsc::Receiver<(T, OwnedSemaphorePermit)>,
}

impl<M: prost::Message + 'static> Driven<Result<M, Status>> {
    /// `budget`: the bytes of responses that may wait in the queue (see [`Sender`]); `guard`:
    /// the call's (see [`Inner::streaming_caller`]), held as long as the call.
    fn new<F>(
        budget: usize,
        mut guard: StreamGuard,
        make: impl FnOnce(Sender<Result<M, Status>>) -> F,
    ) -> Self
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let (tx, rx) = mpsc::channel(RESPONSE_QUEUE);
        let budget = u32::try_from(budget).unwrap_or(u32::MAX).max(1);
        let tx = Sender {
            tx,
            bytes: Arc::new(Semaphore::new(budget as usize)),
            budget,
        };
        let work = make(tx.clone());
        let driver = async move {
            let reason = tokio::select! {
                biased;
                reason = guard.ended() => reason,
                () = work => return,
            };
            // The driver is dropped by now (select! drops its futures before this): the
            // reason is the call's last word.
            let _ = tx.send(Err(reason.to_status())).await;
            drop(guard);
        };
        Driven {
            driver: Some(Box::pin(driver)),
            rx,
        }
    }
}

/// What a queued response weighs: its encoded size.
pub(crate) trait Weigh {
    fn weight(&self) -> usize;
}

impl<M: prost::Message> Weigh for Result<M, Status> {
    fn weight(&self) -> usize {
        match self {
            Ok(message) => message.encoded_len(),
            Err(status) => status.message().len(),
        }
    }
}

/// The peer is gone: the response queue's other end was dropped.
#[derive(Debug)]
pub(crate) struct Gone;

/// The driver's end of a call's response queue: at most [`RESPONSE_QUEUE`] responses and
/// `budget` bytes (their encoded sizes) wait for the body; a response larger than the budget
/// waits alone. A byte is given back as its response leaves the queue for the encoder.
pub(crate) struct Sender<T> {
    tx: mpsc::Sender<(T, OwnedSemaphorePermit)>,
    bytes: Arc<Semaphore>,
    budget: u32,
}

impl<T> Clone for Sender<T> {
    fn clone(&self) -> Self {
        Sender {
            tx: self.tx.clone(),
            bytes: Arc::clone(&self.bytes),
            budget: self.budget,
        }
    }
}

impl<T: Weigh> Sender<T> {
    /// Waits for room (cancel-safe: nothing is queued until it returns).
    pub async fn send(&self, item: T) -> std::result::Result<(), Gone> {
        let weight = u32::try_from(item.weight())
            .unwrap_or(u32::MAX)
            .clamp(1, self.budget);
        let permit = Arc::clone(&self.bytes)
            .acquire_many_owned(weight)
            .await
            .map_err(|_| Gone)?;
        // Room for the bytes; the queue's count is the other bound.
        self.tx.send((item, permit)).await.map_err(|_| Gone)
    }
}

impl<T> Stream for Driven<T> {
    type Item = T;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<T>> {
        let this = &mut *self;
        if let Some(driver) = this.driver.as_mut() {
            if driver.as_mut().poll(cx).is_ready() {
                // Its sender is dropped with it: the stream ends once the queue is empty.
                this.driver = None;
            }
        }
        // The response's bytes are given back as it leaves for the encoder.
        this.rx
            .poll_recv(cx)
            .map(|queued| queued.map(|(item, _bytes)| item))
    }
}

/// A request stream that can tell whether its next message is already here: a pipelined
/// call's publishes are then left to the writer thread, to be committed with what follows,
/// and only the last one at hand is committed right away (see [`ChannelLog::submit`]).
struct Lookahead<T> {
    requests: Streaming<T>,
    next: Option<std::result::Result<Option<T>, Status>>,
}

impl<T> Lookahead<T> {
    fn new(requests: Streaming<T>) -> Self {
        Lookahead {
            requests,
            next: None,
        }
    }

    /// The next message (cancel-safe, as `Streaming::message`).
    async fn message(&mut self) -> std::result::Result<Option<T>, Status> {
        match self.next.take() {
            Some(next) => next,
            None => self.requests.message().await,
        }
    }

    /// Whether another request has arrived already (it is kept for [`Lookahead::message`]).
    fn more_ready(&mut self) -> bool {
        if self.next.is_none() {
            self.next = self.requests.message().now_or_never();
        }
        matches!(self.next, Some(Ok(Some(_))))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::log::test_entry as entry;

    fn batch_sizes(responses: &[pb::SubscribeResponse]) -> Vec<usize> {
        responses
            .iter()
            .map(|r| match &r.item {
                Some(pb::subscribe_response::Item::Entries(e)) => e.entries.len(),
                _ => 0,
            })
            .collect()
    }

    #[test]
    fn pages_are_cut_by_count_and_bytes() {
        let page: Vec<Entry> = (1..=250).map(|s| entry(s, 10)).collect();
        assert_eq!(batch_sizes(&responses(page, 100)), vec![100, 100, 50]);
        let big: Vec<Entry> = (1..=5).map(|s| entry(s, 400 * 1024)).collect();
        assert_eq!(batch_sizes(&responses(big, 100)), vec![2, 2, 1]);
        let huge = vec![entry(1, 2 * 1024 * 1024), entry(2, 1)];
        assert_eq!(batch_sizes(&responses(huge, 100)), vec![1, 1]);
        let single = responses(vec![entry(1, 1), entry(2, 1)], 1);
        assert!(single
            .iter()
            .all(|r| matches!(r.item, Some(pb::subscribe_response::Item::Entry(_)))));
    }

    #[test]
    fn pages_must_follow_the_cursor() {
        assert!(consecutive(vec![entry(5, 1), entry(6, 1)], 4, 6).is_ok());
        assert_eq!(
            consecutive(vec![entry(5, 1), entry(7, 1)], 4, 7)
                .unwrap_err()
                .to_string(),
            "log gap after seq 5"
        );
        assert_eq!(
            consecutive(Vec::new(), 4, 7).unwrap_err().to_string(),
            "log ends before seq 7"
        );
    }

    #[test]
    fn transport_statuses_get_the_relay_texts() {
        let too_large = Status::out_of_range(
            "Error, decoded message length too large: found 9 bytes, the limit is: 8 bytes",
        );
        assert_eq!(
            transport_error(&too_large, 8).unwrap().to_string(),
            "request larger than the transport limit of 8 bytes"
        );
        let garbage = Status::internal("failed to decode Protobuf message: invalid varint");
        assert_eq!(
            transport_error(&garbage, 8).unwrap().code(),
            Code::InvalidArgument
        );
        assert!(transport_error(&Status::internal("other"), 8).is_none());
    }
}
