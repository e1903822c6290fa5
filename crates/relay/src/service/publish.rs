//! Publish, PublishStream and PublishBatches: a publish's checks, its submission to the
//! channel log, and its answer (one per publish, or one per item of a batch).

use std::sync::Arc;

use tonic::{Request, Response, Status};

use super::caller::{actor, channel_name};
use super::pipeline::{Lookahead, Pipelined};
use super::refusal::{internal, refusal_label};
use super::Inner;
use crate::auth::Caller;
use crate::error::{shutting_down, RelayError, Result};
use crate::group::{CommitOutcome, GroupState, Handshake};
use crate::log::{Accepted, Channel, Checked, GroupCheck, Outcome};
use crate::members::GroupChange;
use crate::observe::access::{line_budget, Suppressed, ACCESS_LOG};
use crate::observe::metrics;
use crate::pb;
use crate::shutdown::Phase;
use crate::store::AuditRow;
use crate::wire::framing::{self, ContentType};
use crate::wire::rules;

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

/// PublishStream: requests are read and submitted while earlier ones are being committed
/// (so they share group commits); answers go out in request order. The first refusal
/// ends the call after the answers before it. Driven by [`super::pipeline::drive`].
pub(super) struct PublishStream;

impl Pipelined for PublishStream {
    type Request = pb::PublishRequest;
    type Queued = Outcome;
    type Response = pb::PublishResponse;
    const AHEAD: usize = PIPELINE_DEPTH;

    async fn submit(
        inner: &Inner,
        caller: &Caller,
        request: pb::PublishRequest,
        requests: &mut Lookahead<pb::PublishRequest>,
    ) -> Result<Outcome, Status> {
        let item = match inner.prepare(request, caller).await {
            Ok(item) => inner.submit_one(item, requests.more_ready()),
            Err(e) => Err(e),
        };
        item.map_err(|e| e.to_status())
    }

    async fn answer(
        inner: &Inner,
        _: &Caller,
        outcome: &mut Outcome,
    ) -> Result<pb::PublishResponse, Status> {
        let decided = inner.decided(outcome).await.map_err(|e| e.to_status());
        decided.map(publish_response)
    }
}

/// PublishBatches: each request's items are submitted together as it is read (so
/// batches share group commits); each request is answered, in order, once all its items
/// are decided. A refused item is answered as such; only a failure of the call ends it.
/// Driven by [`super::pipeline::drive`].
pub(super) struct PublishBatches;

impl Pipelined for PublishBatches {
    type Request = pb::PublishBatchRequest;
    type Queued = Vec<Slot>;
    type Response = pb::PublishBatchResponse;
    const AHEAD: usize = BATCHES_AHEAD;

    async fn submit(
        inner: &Inner,
        caller: &Caller,
        batch: pb::PublishBatchRequest,
        requests: &mut Lookahead<pb::PublishBatchRequest>,
    ) -> Result<Vec<Slot>, Status> {
        if batch.requests.len() > BATCH_ITEMS {
            let refusal = RelayError::InvalidArgument(format!(
                "{} requests in one batch; at most {BATCH_ITEMS}",
                batch.requests.len()
            ));
            return Err(refusal.to_status());
        }
        let more = requests.more_ready();
        Ok(inner.submit_batch(batch.requests, caller, more).await)
    }

    /// Waits until every item of the batch is decided (cancel-safe: decisions are kept in
    /// the slots as they come), then counts and logs its refusals and answers it.
    async fn answer(
        inner: &Inner,
        caller: &Caller,
        slots: &mut Vec<Slot>,
    ) -> Result<pb::PublishBatchResponse, Status> {
        for slot in slots.iter_mut() {
            if let Slot::Waiting(outcome) = slot {
                let result = inner.decided(outcome).await;
                *slot = Slot::Decided(publish_result(result));
            }
        }
        // Every item is decided: the batch leaves the queue with this answer.
        let slots = std::mem::take(slots);
        note_item_refusals(caller, &slots);
        Ok(batch_response(slots))
    }
}

impl Inner {
    /// Everything decided about a publish before its channel is looked up (`_check`).
    fn check(&self, request: pb::PublishRequest, caller: &Caller) -> Result<(String, Checked)> {
        let name = channel_name(request.channel)?;
        // The key's channel patterns: a batch's item outside them is refused alone.
        caller.may_name(&name)?;
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
    async fn check_group(
        &self,
        channel: &Channel,
        checked: &Checked,
        caller: &Caller,
    ) -> Result<GroupCheck> {
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
            .check_handshake(&checked.account, Arc::clone(&state), message, proposals)
            .await?
        {
            Handshake::Proposal { .. } => Ok(GroupCheck::Valid(None)),
            Handshake::Commit(outcome) => {
                let audit = self.commit_audit(channel, &state, &outcome, caller);
                let change = GroupChange::new(outcome.next, outcome.removed, outcome.added)?
                    .with_audit(audit);
                Ok(GroupCheck::Valid(Some(Arc::new(change))))
            }
        }
    }

    /// A commit's audit rows (`member.added`, `member.removed`; none for a commit that adds
    /// and removes nobody): identities from the trees before and after it, the removed
    /// leaves' accounts as memory has them bound. Commits only: messages never get here.
    fn commit_audit(
        &self,
        channel: &Channel,
        before: &GroupState,
        outcome: &CommitOutcome,
        caller: &Caller,
    ) -> Vec<AuditRow> {
        if outcome.removed.is_empty() && outcome.added.is_empty() {
            return Vec::new();
        }
        let identity = |state: &GroupState, leaf: u32| {
            state.leaf(leaf).map(|l| l.identity).unwrap_or_default()
        };
        let accounts = self.log.bound_in_memory(channel, &outcome.removed);
        let removed: Vec<(Vec<u8>, Option<String>)> = outcome
            .removed
            .iter()
            .map(|leaf| identity(before, *leaf))
            .zip(accounts)
            .collect();
        let added: Vec<Vec<u8>> = outcome
            .added
            .iter()
            .map(|leaf| identity(&outcome.next, *leaf))
            .collect();
        let by = identity(before, outcome.sender);
        actor(caller).membership(channel.name(), &by, &removed, &added)
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
            checked.group = self.check_group(&channel, &checked, caller).await?;
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
}

/// One item of a PublishBatches request.
pub(super) enum Slot {
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
            // `PublishBatches::answer` decided every slot before the batch is answered.
            Slot::Waiting(_) => publish_result(Err(internal("a batch answered before its end"))),
        })
        .collect();
    pb::PublishBatchResponse { results }
}
