//! Publish, PublishStream and PublishBatches: a publish's checks, its submission to the
//! channel log, and its answer (one per publish, or one per item of a batch).

use std::collections::VecDeque;
use std::sync::Arc;

use futures_util::FutureExt as _;
use tonic::{Request, Response, Status, Streaming};

use super::caller::channel_name;
use super::driven::Sender;
use super::refusal::{internal, refusal_label};
use super::Inner;
use crate::access::{line_budget, Suppressed, ACCESS_LOG};
use crate::auth::Caller;
use crate::error::{shutting_down, RelayError, Result};
use crate::framing::{self, ContentType};
use crate::group::Handshake;
use crate::log::{Accepted, Channel, Checked, GroupCheck, Outcome};
use crate::members::GroupChange;
use crate::metrics;
use crate::pb;
use crate::rules;
use crate::shutdown::Phase;

/// Publishes of one PublishStream call queued ahead of their answers.
const PIPELINE_DEPTH: usize = 256;
/// Items of one PublishBatches request, and requests of one call read ahead of their answers.
use static_proto::MAX_BATCH_ITEMS as BATCH_ITEMS;
const BATCHES_AHEAD: usize = 64;

/// Publish: one publish, answered once its commit decides it.
pub(super) async fn publish(
    inner: &Inner,
    request: Request<pb::PublishRequest>,
) -> Result<Response<pb::PublishResponse>> {
    let (metadata, extensions, request) = request.into_parts();
    let caller = inner.caller(&metadata, &extensions).await?;
    let item = inner.prepare(request, &caller).await?;
    let mut outcome = inner.submit_one(item, false)?;
    // Answered as soon as the commit decides it.
    let accepted = inner.decided(&mut outcome).await?;
    Ok(Response::new(publish_response(accepted)))
}

impl Inner {
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
    /// [`crate::log::ChannelLog::submit_more`]).
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
    pub(super) async fn publish_stream(
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
    pub(super) async fn publish_batches(
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
}

/// One item of a PublishBatches request.
enum Slot {
    Waiting(Outcome),
    Decided(pb::PublishResult),
}

fn publish_response(accepted: Accepted) -> pb::PublishResponse {
    pb::PublishResponse {
        seq: accepted.seq,
        epoch: accepted.epoch,
        duplicate: accepted.duplicate,
    }
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

/// A request stream that can tell whether its next message is already here: a pipelined
/// call's publishes are then left to the writer thread, to be committed with what follows,
/// and only the last one at hand is committed right away (see
/// [`crate::log::ChannelLog::submit`]).
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
