//! The pipelined-publish driver shared by PublishStream and PublishBatches: requests are read
//! ahead and submitted as they are read, and answered in their order as they are decided.
//!
//! One loop, [`drive`], selects (biased, in this order) between: answering the head of the
//! queue once it is decided (an `Err` answer is the call's last); reading the next request,
//! while reading and fewer than [`Pipelined::AHEAD`] requests wait (a request that
//! [`Pipelined::submit`] refuses is queued as the call's last answer and ends the reading, and
//! so does a failed read, as its status); and the shutdown's refusing phase, while reading
//! (queued as the call's last answer: the requests before it are still answered). The call's
//! [`crate::auth::StreamGuard`] (revocation, expiry, shutdown) is its [`super::Driven`]'s.
//!
//! What differs between the two calls, and which part of [`Pipelined`] carries it:
//!
//! - `Request`, `AHEAD`: PublishStream reads up to 256 publishes ahead (`PIPELINE_DEPTH`),
//!   PublishBatches up to 64 requests (`BATCHES_AHEAD`) of up to `MAX_BATCH_ITEMS` publishes.
//! - `Queued`: a publish's outcome; a batch's slots, one per item, waiting or decided (a
//!   refused item is decided at once).
//! - `submit`'s refusals, which end the reading: for PublishStream any refusal of the publish
//!   (its checks or its submission); for PublishBatches only a request of too many items (an
//!   item's refusal is that item's answer, and the call goes on).
//! - When `submit` asks [`Lookahead::more_ready`]: PublishStream after the publish's checks,
//!   right before submitting it; PublishBatches before the items' checks, right after the
//!   size check.
//! - `answer`: PublishStream's once the outcome is decided, a refused publish's being an
//!   `Err`, the call's last; PublishBatches' once every item is decided (decisions are kept
//!   in the slots as they come, so the wait is cancel-safe), after the items' refusals are
//!   counted and logged, and always `Ok`.
//!
//! Unit types in [`super::publish`] implement it: `PublishStream` and `PublishBatches`.

use std::collections::VecDeque;
use std::future::Future;
use std::sync::Arc;

use futures_util::FutureExt as _;
use tonic::{Status, Streaming};

use super::driven::Sender;
use super::Inner;
use crate::auth::Caller;
use crate::error::shutting_down;
use crate::shutdown::Phase;

/// One pipelined call: what it does with a request as it is read, and how it answers one once
/// decided (see the module's table).
pub(super) trait Pipelined {
    type Request: Send + 'static;
    /// A request submitted (or decided already) as it waits in the call's queue.
    type Queued: Send;
    type Response: prost::Message + 'static;
    /// Requests queued ahead of their answers.
    const AHEAD: usize;

    /// Checks and submits one request. `requests` is the call's: its
    /// [`Lookahead::more_ready`] tells whether the next request is here already. `Err`: the
    /// call's last answer, and nothing after this request is read.
    fn submit(
        inner: &Inner,
        caller: &Caller,
        request: Self::Request,
        requests: &mut Lookahead<Self::Request>,
    ) -> impl Future<Output = Result<Self::Queued, Status>> + Send;

    /// Waits until a queued request is decided and gives its answer (`Err`: the call's last).
    /// Cancel-safe: the driver drops it whenever a request is read meanwhile, and calls it
    /// again on the same queued request; once it returns, the request leaves the queue.
    fn answer(
        inner: &Inner,
        caller: &Caller,
        queued: &mut Self::Queued,
    ) -> impl Future<Output = Result<Self::Response, Status>> + Send;
}

/// A pipelined call's driver (see the module's doc), run by [`super::Driven`].
pub(super) async fn drive<P: Pipelined>(
    inner: Arc<Inner>,
    caller: Caller,
    requests: Streaming<P::Request>,
    tx: Sender<Result<P::Response, Status>>,
) {
    let mut requests = Lookahead::new(requests);
    let mut shutdown = inner.shutdown.watch();
    let mut queue: VecDeque<Result<P::Queued, Status>> = VecDeque::new();
    let mut reading = true;
    while reading || !queue.is_empty() {
        tokio::select! {
            biased;
            answer = head::<P>(&inner, &caller, &mut queue), if !queue.is_empty() => {
                queue.pop_front();
                let last = answer.is_err();
                if tx.send(answer).await.is_err() || last {
                    return;
                }
            }
            message = requests.message(), if reading && queue.len() < P::AHEAD => {
                match message {
                    Ok(Some(request)) => {
                        let queued = P::submit(&inner, &caller, request, &mut requests).await;
                        // A refusal ends the reading: nothing after it is submitted.
                        reading = queued.is_ok();
                        queue.push_back(queued);
                    }
                    Ok(None) => reading = false,
                    Err(status) => {
                        queue.push_back(Err(inner.request_failed(status)));
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

/// The answer to the first queued request once it is decided (cancel-safe, as
/// [`Pipelined::answer`]); the request stays queued until the driver takes it out.
async fn head<P: Pipelined>(
    inner: &Inner,
    caller: &Caller,
    queue: &mut VecDeque<Result<P::Queued, Status>>,
) -> Result<P::Response, Status> {
    match queue.front_mut() {
        Some(Ok(queued)) => P::answer(inner, caller, queued).await,
        Some(Err(status)) => Err(status.clone()),
        // Not polled on an empty queue (the driver's select looks first).
        None => std::future::pending().await,
    }
}

/// A request stream that can tell whether its next message is already here: a pipelined
/// call's publishes are then left to the writer thread, to be committed with what follows,
/// and only the last one at hand is committed right away (see
/// [`crate::log::ChannelLog::submit`]).
pub(super) struct Lookahead<T> {
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
    pub(super) fn more_ready(&mut self) -> bool {
        if self.next.is_none() {
            self.next = self.requests.message().now_or_never();
        }
        matches!(self.next, Some(Ok(Some(_))))
    }
}
