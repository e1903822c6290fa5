//! One connection: its TLS handshake, then HTTP/2 until the peer leaves, floods resets, holds
//! no call for the idle timeout, or the relay closes it.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio::sync::Notify;

use crate::service::Peer;
use crate::shutdown::{Phase, Watch};
use crate::wire::rules::TokenBucket;

use super::call::{CallGate, Connection};
use super::caps::Admitted;
use super::CLOSE_GRACE;

/// One connection: its TLS handshake first when the port has TLS, then HTTP/2.
pub(super) async fn serve(
    stream: TcpStream,
    peer: SocketAddr,
    admitted: Admitted,
    mut phase: Watch,
) {
    // Small answers must leave at once (the latency target), not wait for Nagle.
    if let Err(e) = stream.set_nodelay(true) {
        ::log::warn!(target: "static.relay", "TCP_NODELAY on {peer}: {e}");
    }
    let Some(acceptor) = admitted.shared.tls.clone() else {
        return serve_http(stream, peer, admitted, phase).await;
    };
    let timeout = admitted.shared.tls_handshake_timeout;
    let handshake = tokio::select! {
        done = tokio::time::timeout(timeout, acceptor.accept(stream)) => done,
        // A connection still shaking hands holds no call: it goes with the drain.
        () = phase.reached(Phase::Draining) => return,
    };
    let failure = match handshake {
        Ok(Ok(tls)) => return serve_http(tls, peer, admitted, phase).await,
        Ok(Err(e)) => e.to_string(),
        Err(_) => format!("no handshake within {timeout:?}"),
    };
    // Dropping the stream closes it. Rate-limited: plaintext or stalled peers must not
    // flood the log.
    admitted
        .shared
        .handshakes_failed
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .note(&format_args!("the last from {}: {failure}", peer.ip()));
}

/// One connection's HTTP/2, until the peer leaves, it floods resets, it holds no call for the
/// idle timeout, or the relay closes it.
pub(super) async fn serve_http<S>(stream: S, peer: SocketAddr, admitted: Admitted, mut phase: Watch)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let shared = Arc::clone(&admitted.shared);
    let connection = Arc::new(Connection {
        peer: Peer(Arc::from(format!("{}:{}", peer.ip(), peer.port()))),
        active: AtomicU32::new(0),
        resets: Mutex::new(TokenBucket::full(
            shared.reset_rate,
            shared.reset_burst,
            Instant::now(),
        )),
        flooded: Notify::new(),
        quiet_since: Mutex::new(Instant::now()),
    });
    let gate = CallGate {
        shared: Arc::clone(&shared),
        connection: Arc::clone(&connection),
    };
    let conn = shared.http.serve_connection(TokioIo::new(stream), gate);
    tokio::pin!(conn);
    let mut going_away = false;
    // The idle timer; once the connection is closed for idleness, the deadline of its
    // GOAWAY (a peer that sent nothing, or only the preface, never answers it).
    let timer = tokio::time::sleep(shared.idle_timeout);
    tokio::pin!(timer);
    let mut idle_closing = false;
    let flooded = loop {
        tokio::select! {
            served = conn.as_mut() => match served {
                Ok(()) => return,
                Err(e) => break is_reset_flood(&e),
            },
            () = connection.flooded.notified() => break true,
            () = phase.reached(Phase::Closing), if !going_away => {
                going_away = true;
                conn.as_mut().graceful_shutdown();
            }
            () = &mut timer => {
                let now = Instant::now();
                if idle_closing {
                    if connection.active.load(Ordering::Acquire) == 0 {
                        // Dropping the connection closes its socket.
                        return;
                    }
                    // A call that came just before the GOAWAY finishes first.
                    timer.as_mut().reset((now + CLOSE_GRACE).into());
                    continue;
                }
                match connection.idle_until(shared.idle_timeout) {
                    Some(deadline) if deadline <= now => {
                        idle_closing = true;
                        if !going_away {
                            going_away = true;
                            conn.as_mut().graceful_shutdown();
                        }
                        timer.as_mut().reset((now + CLOSE_GRACE).into());
                    }
                    Some(deadline) => timer.as_mut().reset(deadline.into()),
                    None => timer.as_mut().reset((now + shared.idle_timeout).into()),
                }
            }
        }
    };
    if flooded {
        // Dropping the connection closes its socket and ends its calls.
        ::log::warn!(
            target: "static.relay",
            "closing {}: too many stream resets",
            connection.peer.0
        );
    }
}

/// Whether h2 closed the connection for too many resets (its GOAWAY(ENHANCE_YOUR_CALM)).
pub(super) fn is_reset_flood(err: &hyper::Error) -> bool {
    let mut source = std::error::Error::source(err);
    while let Some(e) = source {
        if let Some(h2) = e.downcast_ref::<h2::Error>() {
            return h2.is_go_away()
                && !h2.is_remote()
                && h2.reason() == Some(h2::Reason::ENHANCE_YOUR_CALM);
        }
        source = e.source();
    }
    false
}
