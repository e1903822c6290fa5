//! The publisher task: one pipelined `PublishBatches` call for all of a client's channels.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot};
use tonic::Code;

use crate::config::CALL_TIMEOUT;
use crate::error::Error;
use crate::relay::refusal::Refusal;
use crate::relay::retry::Retry;
use crate::relay::transport::{bounded, pb};
use crate::shared::Shared;

/// Publishes encrypted messages of every channel on one long-lived `PublishBatches` call (its
/// items name their channel), pipelined: batches go out while earlier ones are in flight, and
/// each message's result goes back to its sender. One call per client rather than per channel
/// keeps the streams a client holds bounded whatever the number of its channels. Failures of
/// the call itself (connection lost, token expired, relay restarting) are handled here: the
/// call is reopened and the messages in flight are sent again with the same bytes (the relay's
/// idempotency answers those it already has). Refusals of single messages go to their senders,
/// who decide (see [`Channel::send`](crate::Channel::send)). Messages of a channel that ended
/// before they went out are not sent (they fail with the channel's end). Ends when every
/// sender is gone (the client closed).
pub(crate) async fn publisher(
    shared: Arc<Shared>,
    mut incoming: mpsc::UnboundedReceiver<Vec<Outbound>>,
) {
    let mut queue: VecDeque<Outbound> = VecDeque::new();
    let mut inflight: VecDeque<InFlight> = VecDeque::new();
    let mut inflight_bytes = 0usize;
    let mut call: Option<BatchCall> = None;
    let mut retry = Retry::forever();
    // When the oldest batch in flight must have been answered by.
    let mut answer_by = Instant::now();
    loop {
        while let Ok(more) = incoming.try_recv() {
            enqueue(&mut queue, more);
        }
        // Send what may go now.
        let mut failure: Option<(Refusal, Option<String>)> = None;
        while !queue.is_empty()
            && inflight.len() < MAX_INFLIGHT_BATCHES
            && inflight_bytes < MAX_INFLIGHT_BYTES
        {
            if call.is_none() {
                match open_batch_call(&shared).await {
                    Ok(opened) => call = Some(opened),
                    Err(OpenFailure::Refused(refusal, token)) => {
                        failure = Some((refusal, token));
                        break;
                    }
                    Err(OpenFailure::Final(e)) => {
                        for item in queue.drain(..) {
                            item.fail(e.clone());
                        }
                        break;
                    }
                    Err(OpenFailure::Token) => {
                        // The token endpoint is unreachable for now.
                        expire(&mut queue, "Publish: cannot get a relay token in time");
                        let wait = shared
                            .after(
                                &mut retry,
                                Refusal::transient(Code::Unavailable, "no token"),
                                None,
                                "Publish",
                            )
                            .unwrap_or(Duration::ZERO);
                        tokio::time::sleep(wait).await;
                        break;
                    }
                }
            }
            let Some(open) = call.as_mut() else { break };
            let batch = take_batch(&mut queue);
            if batch.items.is_empty() {
                // Only messages of channels that ended were left.
                continue;
            }
            let request = pb::PublishBatchRequest {
                requests: batch
                    .items
                    .iter()
                    .map(|o| pb::PublishRequest {
                        channel: o.channel.name().to_owned(),
                        message: o.message.clone().into(),
                        welcome: Default::default(),
                        idempotency_key: o.key.clone().into(),
                    })
                    .collect(),
            };
            if inflight.is_empty() {
                answer_by = Instant::now() + CALL_TIMEOUT;
            }
            inflight_bytes += batch.bytes;
            inflight.push_back(batch);
            if open.requests.send(request).is_err() {
                // The call is over; its status comes from the response stream.
                failure = Some(match bounded(open.responses.message()).await {
                    Err(status) => (Refusal::from_status(&status), open.token.clone()),
                    _ => (
                        Refusal::transient(Code::Unavailable, "the publish call ended"),
                        open.token.clone(),
                    ),
                });
                break;
            }
        }
        if failure.is_none() {
            let can_send = !queue.is_empty()
                && inflight.len() < MAX_INFLIGHT_BATCHES
                && inflight_bytes < MAX_INFLIGHT_BYTES;
            let waiting = !inflight.is_empty();
            tokio::select! {
                biased;
                r = async {
                    match call.as_mut() {
                        Some(open) => open.responses.message().await,
                        None => std::future::pending().await,
                    }
                }, if call.is_some() => match r {
                    Ok(Some(response)) => {
                        retry.answered();
                        answer_by = Instant::now() + CALL_TIMEOUT;
                        match inflight.pop_front() {
                            Some(batch) => {
                                inflight_bytes -= batch.bytes;
                                batch.answer(response.results);
                            }
                            None => {
                                let token = call.as_ref().and_then(|c| c.token.clone());
                                failure = Some((
                                    Refusal::transient(Code::Internal, "an answer to no batch of ours"),
                                    token,
                                ));
                            }
                        }
                    }
                    Ok(None) if !waiting => call = None,
                    Ok(None) => {
                        let token = call.as_ref().and_then(|c| c.token.clone());
                        failure = Some((
                            Refusal::transient(Code::Unavailable, "the publish call ended early"),
                            token,
                        ));
                    }
                    Err(_) if !waiting => call = None,
                    Err(status) => {
                        let token = call.as_ref().and_then(|c| c.token.clone());
                        failure = Some((Refusal::from_status(&status), token));
                    }
                },
                more = incoming.recv(), if !can_send => match more {
                    Some(more) => enqueue(&mut queue, more),
                    None => return,
                },
                _ = tokio::time::sleep_until(answer_by.into()), if waiting => {
                    let token = call.as_ref().and_then(|c| c.token.clone());
                    failure = Some((
                        Refusal::transient(
                            Code::DeadlineExceeded,
                            format!("no answer from the relay within {CALL_TIMEOUT:?}"),
                        ),
                        token,
                    ));
                }
                // Nothing to wait for: only after waiting out an unreachable token endpoint,
                // with messages to send.
                else => {}
            }
        }
        let Some((refusal, token)) = failure else {
            continue;
        };
        // The call failed: what was in flight goes back to the front of the queue, in order,
        // to be sent again on a new call.
        call = None;
        inflight_bytes = 0;
        let mut requeued = 0;
        while let Some(batch) = inflight.pop_back() {
            for item in batch.items.into_iter().rev() {
                queue.push_front(item);
                requeued += 1;
            }
        }
        let transient = matches!(refusal, Refusal::Transient { .. });
        let why = format!("Publish: {} ({:?})", refusal.message(), refusal.code());
        match shared.after(&mut retry, refusal, token.as_deref(), "Publish") {
            Ok(wait) => {
                if transient {
                    expire(&mut queue, &why);
                }
                tokio::time::sleep(wait).await;
            }
            // A refusal of the call itself that retrying will not fix: what was sent on it
            // fails, what was not yet sent goes on a new call (all of it fails when the call
            // could not even be opened, or the credentials are refused).
            Err(e) => {
                let failed = if requeued == 0 || matches!(e, Error::Auth(_)) {
                    queue.len()
                } else {
                    requeued
                };
                for item in queue.drain(..failed.min(queue.len())) {
                    item.fail(e.clone());
                }
                retry.answered();
            }
        }
    }
}

/// Where an [`Outbound`] goes: its channel, as far as the publisher needs to know it.
pub(crate) trait Destination: Send + Sync {
    fn name(&self) -> &str;
    /// Why the channel ended, once it has.
    fn ended(&self) -> Option<Error>;
}

/// Fails the queued messages whose retry deadline has passed.
fn expire(queue: &mut VecDeque<Outbound>, why: &str) {
    let now = Instant::now();
    if queue.iter().all(|o| o.deadline > now) {
        return;
    }
    let (late, on_time): (VecDeque<_>, VecDeque<_>) =
        queue.drain(..).partition(|o| o.deadline <= now);
    *queue = on_time;
    for item in late {
        item.fail(Error::Unreachable(why.to_owned()));
    }
}

/// Most batches of one `PublishBatches` call awaiting their answer.
const MAX_INFLIGHT_BATCHES: usize = 32;
/// Most message bytes awaiting their answer on one call.
const MAX_INFLIGHT_BYTES: usize = 8 * 1024 * 1024;
/// Items per batch: the relay's limit.
pub(crate) use static_proto::MAX_BATCH_ITEMS;
/// Message bytes per batch: the relay reads requests of at most 1 MiB; leave room for the
/// framing of each item. A larger single message goes alone.
pub(crate) const MAX_BATCH_BYTES: usize = 1024 * 1024 - 64 * 1024;
/// Framing of one item in a batch request, beyond its message (channel name, tags).
pub(crate) const ITEM_OVERHEAD: usize = 256;

/// One encrypted message on its way to the relay.
pub(crate) struct Outbound {
    /// Its channel.
    pub(crate) channel: Arc<dyn Destination>,
    pub(crate) message: Vec<u8>,
    /// Its idempotency key (`PublishRequest.idempotency_key`); empty: the relay's default,
    /// the SHA-256 of the message. Requests and replies have theirs (see `request`).
    pub(crate) key: Vec<u8>,
    /// Until when failures of the call are retried for it.
    pub(crate) deadline: Instant,
    pub(crate) reply: oneshot::Sender<Outcome>,
    /// On the first message of what one hand-over brought (see [`enqueue`]): how many
    /// messages it holds and their size in a batch. Set by the publisher.
    pub(crate) unit: Option<(usize, usize)>,
}

/// Queues the messages of one hand-over (one sender's, or one combined encryption's), marking
/// the first with the size of the whole, so that [`take_batch`] does not split them across two
/// requests when they fit in one: a pipelined batch must reach the relay's rate limit as one
/// request (see `pipeline`).
fn enqueue(queue: &mut VecDeque<Outbound>, mut more: Vec<Outbound>) {
    let bytes = more.iter().map(|o| o.message.len() + ITEM_OVERHEAD).sum();
    let count = more.len();
    if let Some(first) = more.first_mut() {
        first.unit = Some((count, bytes));
    }
    queue.extend(more);
}

impl Outbound {
    fn fail(self, e: Error) {
        let _ = self.reply.send(Outcome::Failed(e));
    }
}

/// What became of one published message.
pub(crate) enum Outcome {
    /// In the channel's log.
    Accepted,
    /// Refused by the relay: certainly not in the log.
    Refused(Refusal),
    /// Not answered for (it may be in the log): the message comes back to be resent as it is.
    Unanswered(Vec<u8>),
    /// Not published, and retrying will not help.
    Failed(Error),
}

/// A batch sent and not yet answered.
struct InFlight {
    items: Vec<Outbound>,
    bytes: usize,
}

impl InFlight {
    /// Hands each item its result.
    fn answer(self, results: Vec<pb::PublishResult>) {
        let mut results = results.into_iter();
        for item in self.items {
            let outcome = match results.next().and_then(|r| r.outcome) {
                Some(pb::publish_result::Outcome::Accepted(_)) => Outcome::Accepted,
                Some(pb::publish_result::Outcome::Refused(refusal)) => {
                    Outcome::Refused(Refusal::from_pb(&refusal))
                }
                // A short answer: retried with the same bytes.
                None => Outcome::Unanswered(item.message),
            };
            let _ = item.reply.send(outcome);
        }
    }
}

/// Takes the next batch off the queue: up to [`MAX_BATCH_ITEMS`] items and
/// [`MAX_BATCH_BYTES`], at least one unless only messages of channels that ended are left.
/// Those are not sent: nothing of a closed channel goes out after its end (they fail with it).
fn take_batch(queue: &mut VecDeque<Outbound>) -> InFlight {
    let mut items = Vec::with_capacity(queue.len().min(MAX_BATCH_ITEMS));
    let mut bytes = 0;
    while let Some(next) = queue.front() {
        if let Some(e) = next.channel.ended() {
            if let Some(item) = queue.pop_front() {
                item.fail(e);
            }
            continue;
        }
        let size = next.message.len() + ITEM_OVERHEAD;
        if !items.is_empty() {
            let full = items.len() >= MAX_BATCH_ITEMS || bytes + size > MAX_BATCH_BYTES;
            // A hand-over that fits in a batch of its own but not in what is left of this one
            // starts the next batch instead.
            let unit_overflows = next.unit.is_some_and(|(count, unit_bytes)| {
                count <= MAX_BATCH_ITEMS
                    && unit_bytes <= MAX_BATCH_BYTES
                    && (items.len() + count > MAX_BATCH_ITEMS
                        || bytes + unit_bytes > MAX_BATCH_BYTES)
            });
            if full || unit_overflows {
                break;
            }
        }
        bytes += size;
        if let Some(item) = queue.pop_front() {
            items.push(item);
        }
    }
    InFlight { items, bytes }
}

/// An open `PublishBatches` call.
struct BatchCall {
    requests: mpsc::UnboundedSender<pb::PublishBatchRequest>,
    responses: tonic::Streaming<pb::PublishBatchResponse>,
    token: Option<String>,
}

enum OpenFailure {
    /// The relay refused or failed the call.
    Refused(Refusal, Option<String>),
    /// No token for now (the token endpoint is unreachable): retried.
    Token,
    /// No token, final (the key is refused).
    Final(Error),
}

async fn open_batch_call(shared: &Shared) -> std::result::Result<BatchCall, OpenFailure> {
    let (requests, stream) = mpsc::unbounded_channel();
    let (request, token) = match shared
        .request(tokio_stream::wrappers::UnboundedReceiverStream::new(stream))
        .await
    {
        Ok(r) => r,
        Err(e @ Error::Auth(_)) => return Err(OpenFailure::Final(e)),
        Err(_) => return Err(OpenFailure::Token),
    };
    match bounded(shared.relay.clone().publish_batches(request)).await {
        Ok(response) => Ok(BatchCall {
            requests,
            responses: response.into_inner(),
            token,
        }),
        Err(status) => Err(OpenFailure::Refused(Refusal::from_status(&status), token)),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::MAX_PAYLOAD;

    struct Nowhere;

    impl Destination for Nowhere {
        fn name(&self) -> &str {
            "a/b/c"
        }

        fn ended(&self) -> Option<Error> {
            None
        }
    }

    struct Gone;

    impl Destination for Gone {
        fn name(&self) -> &str {
            "a/b/gone"
        }

        fn ended(&self) -> Option<Error> {
            Some(Error::Closed("channel \"a/b/gone\" is closed".into()))
        }
    }

    #[test]
    fn messages_of_channels_that_ended_are_not_sent() {
        let (mut gone, mut answer) = outbound(10);
        gone.channel = Arc::new(Gone);
        let mut queue: VecDeque<Outbound> = [gone, outbound(10).0].into();
        let batch = take_batch(&mut queue);
        assert_eq!(batch.items.len(), 1);
        assert_eq!(batch.items[0].channel.name(), "a/b/c");
        assert!(matches!(
            answer.try_recv(),
            Ok(Outcome::Failed(Error::Closed(_)))
        ));
        assert!(queue.is_empty());
    }

    fn outbound(len: usize) -> (Outbound, oneshot::Receiver<Outcome>) {
        let (reply, answer) = oneshot::channel();
        let item = Outbound {
            channel: Arc::new(Nowhere),
            message: vec![0; len],
            key: Vec::new(),
            deadline: Instant::now() + Duration::from_secs(30),
            reply,
            unit: None,
        };
        (item, answer)
    }

    #[test]
    fn a_hand_over_that_fits_in_one_batch_is_not_split() {
        let mut queue = VecDeque::new();
        enqueue(&mut queue, (0..1000).map(|_| outbound(10).0).collect());
        enqueue(&mut queue, (0..100).map(|_| outbound(10).0).collect());
        enqueue(&mut queue, (0..1500).map(|_| outbound(10).0).collect());
        let sizes: Vec<usize> =
            std::iter::from_fn(|| (!queue.is_empty()).then(|| take_batch(&mut queue).items.len()))
                .collect();
        // The second hand-over would straddle the first request: it starts the next one. The
        // third is larger than a request: it is cut, filling each request.
        assert_eq!(sizes, vec![1000, 1024, 576]);
    }

    #[test]
    fn batches_respect_the_relay_limits() {
        let mut queue: VecDeque<Outbound> = (0..3000).map(|_| outbound(10).0).collect();
        assert_eq!(take_batch(&mut queue).items.len(), MAX_BATCH_ITEMS);
        assert_eq!(queue.len(), 3000 - MAX_BATCH_ITEMS);

        let mut queue: VecDeque<Outbound> = (0..40).map(|_| outbound(100_000).0).collect();
        let batch = take_batch(&mut queue);
        assert!(batch.bytes <= MAX_BATCH_BYTES);
        assert_eq!(
            batch.items.len(),
            MAX_BATCH_BYTES / (100_000 + ITEM_OVERHEAD)
        );

        // A message larger than a batch goes alone.
        let mut queue: VecDeque<Outbound> = [outbound(MAX_PAYLOAD).0, outbound(10).0].into();
        assert_eq!(take_batch(&mut queue).items.len(), 1);
        assert_eq!(take_batch(&mut queue).items.len(), 1);
        assert!(queue.is_empty());
    }

    #[test]
    fn answers_go_to_their_senders_in_order() {
        let (items, mut answers): (Vec<_>, Vec<_>) = (0..3).map(|_| outbound(1)).unzip();
        let accepted = pb::PublishResult {
            outcome: Some(pb::publish_result::Outcome::Accepted(
                pb::PublishResponse::default(),
            )),
        };
        let refused = pb::PublishResult {
            outcome: Some(pb::publish_result::Outcome::Refused(pb::Refusal {
                code: Code::FailedPrecondition as u32,
                current_epoch: 7,
                ..pb::Refusal::default()
            })),
        };
        // The third gets no result: it may be in the log, so it is resent with its bytes.
        InFlight { items, bytes: 0 }.answer(vec![accepted, refused]);
        assert!(matches!(answers[0].try_recv(), Ok(Outcome::Accepted)));
        assert!(matches!(
            answers[1].try_recv(),
            Ok(Outcome::Refused(Refusal::StaleEpoch { current: 7, .. }))
        ));
        assert!(matches!(
            answers[2].try_recv(),
            Ok(Outcome::Unanswered(m)) if m.len() == 1
        ));
    }
}
