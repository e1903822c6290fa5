//! Each call: counted on its connection and the server until its response is done, under the
//! per-connection cap, refused while draining, with the relay's texts for tonic's own refusals.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};
use hyper::body::Incoming;
use tokio::sync::Notify;
use tonic::body::Body;
use tonic::codegen::Service as _;
use tonic::Status;

use crate::error::{shutting_down, RelayError};
use crate::observe::access::CallRecord;
use crate::observe::metrics::{self};
use crate::service::{self, Peer};
use crate::shutdown::Phase;
use crate::wire::rules::TokenBucket;

use super::Shared;

/// The calls in flight across every connection (what a shutdown waits for).
#[derive(Default)]
pub(super) struct Calls {
    active: AtomicUsize,
    idle: Notify,
}

impl Calls {
    /// Until no call is in flight, or `deadline`.
    pub(super) async fn wait_idle(&self, deadline: tokio::time::Instant) {
        loop {
            let idle = self.idle.notified();
            tokio::pin!(idle);
            // Registered before the count is read: a last call ending now is not missed.
            idle.as_mut().enable();
            if self.active.load(Ordering::Acquire) == 0 {
                return;
            }
            if tokio::time::timeout_at(deadline, idle).await.is_err() {
                return;
            }
        }
    }
}

/// One connection's bookkeeping.
pub(super) struct Connection {
    pub(super) peer: Peer,
    /// Calls in flight on this connection.
    pub(super) active: AtomicU32,
    /// Streams the peer may reset (after they were accepted) before the connection is
    /// closed: a burst, then a rate (HTTP/2 rapid reset).
    pub(super) resets: Mutex<TokenBucket>,
    pub(super) flooded: Notify,
    /// Since when no call is in flight (the connection's start before its first call).
    pub(super) quiet_since: Mutex<Instant>,
}

impl Connection {
    /// When the connection becomes idle for `timeout` if no call comes; None while calls
    /// are in flight.
    pub(super) fn idle_until(&self, timeout: Duration) -> Option<Instant> {
        let quiet_since = || {
            *self
                .quiet_since
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
        };
        let before = quiet_since();
        if self.active.load(Ordering::Acquire) != 0 {
            return None;
        }
        // A call that ended in between set the time before its count went to 0: read again.
        Some(before.max(quiet_since()) + timeout)
    }

    fn quiet_now(&self) {
        *self
            .quiet_since
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Instant::now();
    }

    fn reset(&self) {
        let wait = self
            .resets
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take(Instant::now(), 1.0);
        if !wait.is_zero() {
            self.flooded.notify_one();
        }
    }
}

/// A call in flight: counted on its connection and the server until its response is done.
/// Dropped before that, the peer reset the stream (or went away).
pub(super) struct CallSlot {
    shared: Arc<Shared>,
    connection: Arc<Connection>,
    finished: bool,
}

impl CallSlot {
    /// A slot for a new call, or None when the connection has its cap of calls in flight.
    fn open(shared: &Arc<Shared>, connection: &Arc<Connection>) -> Option<CallSlot> {
        let before = connection.active.fetch_add(1, Ordering::AcqRel);
        if before >= shared.max_streams {
            connection.active.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        shared.calls.active.fetch_add(1, Ordering::AcqRel);
        Some(CallSlot {
            shared: Arc::clone(shared),
            connection: Arc::clone(connection),
            finished: false,
        })
    }
}

impl Drop for CallSlot {
    fn drop(&mut self) {
        // The time first, then the count: the idle timer never sees 0 calls with an old time.
        self.connection.quiet_now();
        self.connection.active.fetch_sub(1, Ordering::AcqRel);
        if self.shared.calls.active.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.shared.calls.idle.notify_waiters();
        }
        if !self.finished {
            self.connection.reset();
        }
    }
}

/// The per-connection HTTP service in front of the gRPC one: the cap of calls, the drain,
/// the peer's address, and the relay's texts for what tonic refuses by itself.
#[derive(Clone)]
pub(super) struct CallGate {
    pub(super) shared: Arc<Shared>,
    pub(super) connection: Arc<Connection>,
}

pub(super) type ResponseFuture = Pin<
    Box<dyn Future<Output = std::result::Result<http::Response<CountedBody>, Infallible>> + Send>,
>;

impl hyper::service::Service<http::Request<Incoming>> for CallGate {
    type Response = http::Response<CountedBody>;
    type Error = Infallible;
    type Future = ResponseFuture;

    fn call(&self, mut request: http::Request<Incoming>) -> ResponseFuture {
        let method = metrics::method_label(request.uri().path());
        let record = CallRecord::new(method, Arc::clone(&self.connection.peer.0));
        if method.starts_with("Health/") {
            // Health calls need no token, hold no call slot (a Watch must not hold the drain
            // up) and are answered while draining (NOT_SERVING).
            let mut health = self.shared.health.clone();
            return Box::pin(async move {
                let response = match health.call(request).await {
                    Ok(response) => response,
                    Err(never) => match never {},
                };
                Ok(counted(response, None, record))
            });
        }
        if self.shared.shutdown.reached(Phase::Refusing) {
            return refuse(&shutting_down(), record);
        }
        let Some(slot) = CallSlot::open(&self.shared, &self.connection) else {
            return refuse(
                &RelayError::resource_exhausted(format!(
                    "too many concurrent streams on this connection (limit {})",
                    self.shared.max_streams
                )),
                record,
            );
        };
        request
            .extensions_mut()
            .insert(self.connection.peer.clone());
        request.extensions_mut().insert(record.who());
        let mut grpc = self.shared.grpc.clone();
        let limit = self.shared.transport_limit;
        Box::pin(async move {
            let response = match grpc.call(request).await {
                Ok(response) => response,
                Err(never) => match never {},
            };
            let response = reworded(response, limit);
            Ok(counted(response, Some(slot), record))
        })
    }
}

/// The response with its call counted (`slot`) and recorded (`record`) until it is done; a
/// trailers-only answer (a refusal) is recorded at once.
pub(super) fn counted(
    response: http::Response<Body>,
    slot: Option<CallSlot>,
    mut record: CallRecord,
) -> http::Response<CountedBody> {
    let record = if record.finish_with(response.headers()) {
        None
    } else {
        Some(record)
    };
    response.map(|body| CountedBody {
        inner: body,
        slot,
        record,
    })
}

pub(super) fn refuse(error: &RelayError, record: CallRecord) -> ResponseFuture {
    let response = error.to_status().into_http::<Body>();
    Box::pin(std::future::ready(Ok(counted(response, None, record))))
}

/// A trailers-only answer tonic made by itself while reading the request (too large, not
/// protobuf), with the relay's status and text instead.
pub(super) fn reworded(response: http::Response<Body>, limit: usize) -> http::Response<Body> {
    match response
        .extensions()
        .get::<Status>()
        .and_then(|status| service::transport_error(status, limit))
    {
        Some(error) => error.to_status().into_http(),
        None => response,
    }
}

/// A response body that keeps its call counted until it is done.
pub(super) struct CountedBody {
    inner: Body,
    slot: Option<CallSlot>,
    /// Until the call's status is seen (its trailers).
    record: Option<CallRecord>,
}

impl CountedBody {
    fn finish(&mut self) {
        if let Some(slot) = &mut self.slot {
            slot.finished = true;
        }
    }
}

impl HttpBody for CountedBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<std::result::Result<Frame<Bytes>, Status>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(None) | Poll::Ready(Some(Err(_))) => self.finish(),
            Poll::Ready(Some(Ok(frame))) if frame.is_trailers() => {
                if let (Some(record), Some(trailers)) = (&mut self.record, frame.trailers_ref()) {
                    record.finish_with(trailers);
                }
                self.finish();
            }
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for CountedBody {
    fn drop(&mut self) {
        // A trailers-only answer is done without ever being polled.
        if self.inner.is_end_stream() {
            self.finish();
        }
    }
}
