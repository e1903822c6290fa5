//! The accept loop: every listener, each connection admitted under the caps or closed at once.

use std::future::poll_fn;
use std::net::SocketAddr;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

use crate::shutdown::{Phase, Watch};
use crate::wire::rules::client_key;

use super::caps::RateLimitedLog;
use super::connection::serve;
use super::Shared;

/// Accepts until the drain; returns the connections' tasks (dropping them aborts them).
pub(super) async fn accept(
    listeners: Vec<TcpListener>,
    shared: Arc<Shared>,
    mut phase: Watch,
) -> JoinSet<()> {
    let mut connections = JoinSet::new();
    let mut refused = RateLimitedLog::new("refused connections");
    let mut failed = RateLimitedLog::new("accept failed");
    loop {
        tokio::select! {
            () = phase.reached(Phase::Draining) => return connections,
            Some(done) = connections.join_next(), if !connections.is_empty() => {
                if let Err(e) = done {
                    if e.is_panic() {
                        ::log::error!(target: "static.relay", "a connection's task panicked: {e}");
                    }
                }
            }
            accepted = accept_any(&listeners) => match accepted {
                Ok((stream, peer)) => {
                    let address = client_key(peer.ip());
                    let Some(admitted) = shared.admit(address) else {
                        // Closed at once (dropped): a refusal costs an accept and a close.
                        drop(stream);
                        refused.note(&format_args!(
                            "over the caps ({} connections, {} per address), the last from {}",
                            shared.max_connections, shared.max_per_address, address
                        ));
                        continue;
                    };
                    let phase = phase.clone();
                    connections.spawn(serve(stream, peer, admitted, phase));
                }
                Err(e) => {
                    // E.g. out of file descriptors: wait, then go on.
                    failed.note(&e);
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
        }
    }
}

pub(super) async fn accept_any(
    listeners: &[TcpListener],
) -> std::io::Result<(TcpStream, SocketAddr)> {
    poll_fn(|cx| {
        for listener in listeners {
            if let Poll::Ready(accepted) = listener.poll_accept(cx) {
                return Poll::Ready(accepted);
            }
        }
        Poll::Pending
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::IpAddr;

    #[test]
    fn an_ipv6_client_counts_by_its_64() {
        let key = |s: &str| client_key(s.parse().unwrap_or(IpAddr::V4(0.into())));
        assert_eq!(key("2001:db8:1:2:3:4:5:6"), key("2001:db8:1:2:ffff::1"));
        assert_ne!(key("2001:db8:1:2::1"), key("2001:db8:1:3::1"));
        assert_eq!(key("::ffff:10.0.0.1"), key("10.0.0.1"));
        assert_ne!(key("10.0.0.1"), key("10.0.0.2"));
    }
}
