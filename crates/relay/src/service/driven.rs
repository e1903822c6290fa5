//! The streaming driver: a call's response stream whose producer runs inside the stream's own
//! polls, under the call's guard, with a response queue bounded in count and in bytes.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures_util::stream::Stream;
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tonic::Status;

use crate::auth::StreamGuard;

/// Responses a call's driver may queue ahead of its body (at most: the queue is bounded in
/// bytes too, see [`super::ServiceSettings::queue_bytes`]). The body is polled (and so drains
/// the queue) only when HTTP/2 flow control lets it send: this bounds what a slow peer costs.
const RESPONSE_QUEUE: usize = 16;

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
    /// the call's (see [`super::Inner::streaming_caller`]), held as long as the call.
    pub(super) fn new<F>(
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
