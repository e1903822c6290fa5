//! `Client::close` returns within its bound whatever calls on other threads are doing (issue
//! 28): calls stuck on a relay that stopped answering end with `runtime error:`, a waiting
//! reader sees the end, pipelined sends fail their handles.
#![allow(clippy::unwrap_used)]

mod support;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use static_client::{Channel, ClientOptions, Next, CLOSE_TIMEOUT};
use support::{expect_error, watchdog, Agent, Background, Relay};

const RUNTIME: &str = "runtime error:";

/// A TCP proxy in front of a relay that can stop passing bytes, both ways, while keeping its
/// connections open: a relay that hangs (as one stopped with SIGSTOP). Its threads are left to
/// the end of the test process.
struct Proxy {
    addr: SocketAddr,
    frozen: Arc<AtomicBool>,
}

impl Proxy {
    fn start(upstream: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let frozen = Arc::new(AtomicBool::new(false));
        let pumps = Arc::clone(&frozen);
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { return };
                let Ok(server) = TcpStream::connect(upstream) else {
                    continue;
                };
                for (from, to) in [
                    (client.try_clone().unwrap(), server.try_clone().unwrap()),
                    (server, client),
                ] {
                    let frozen = Arc::clone(&pumps);
                    std::thread::spawn(move || pump(from, to, &frozen));
                }
            }
        });
        Proxy { addr, frozen }
    }

    fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// From now on nothing passes.
    fn freeze(&self) {
        self.frozen.store(true, Ordering::SeqCst);
    }
}

/// Copies `from` to `to`, holding what it read while `frozen`.
fn pump(mut from: TcpStream, mut to: TcpStream, frozen: &AtomicBool) {
    let mut buf = [0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        while frozen.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(20));
        }
        if to.write_all(&buf[..n]).is_err() {
            return;
        }
    }
}

/// A relay, alice reaching it through a [`Proxy`] that is frozen once she has made `channel` and
/// sent on it (patient enough that nothing of hers gives up by itself during a test), and bob
/// reaching it directly.
struct Hung {
    relay: Relay,
    proxy: Proxy,
    alice: Agent,
    bob: Agent,
    channel: Arc<Channel>,
}

impl Hung {
    fn start(channel: &str) -> Hung {
        let relay = Relay::start();
        let proxy = Proxy::start(relay.addr());
        let options = ClientOptions {
            connect_timeout: Duration::from_secs(5),
            retry_timeout: Duration::from_secs(600),
            ca_file: None,
        };
        let alice = Agent::with(&proxy.endpoint(), "alice", None, options);
        let bob = Agent::new(&relay, "bob");
        let channel = alice.create_channel(channel).unwrap();
        channel.send(b"before".to_vec()).unwrap();
        proxy.freeze();
        Hung {
            relay,
            proxy,
            alice,
            bob,
            channel,
        }
    }
}

/// Every kind of blocking call is stuck on a hung relay when the client is closed from another
/// thread: `close` returns within [`CLOSE_TIMEOUT`] (and a little), and each call ends soon
/// after, with `runtime error:` or its own end. Before, a commit's wait panicked ("timer
/// error") once the runtime was shut down under it, and a close could wait for ever behind a
/// call that held a lock it needed.
#[test]
fn close_ends_calls_stuck_on_a_hung_relay() {
    let _watchdog = watchdog(
        "close_ends_calls_stuck_on_a_hung_relay",
        Duration::from_secs(120),
    );
    let Hung {
        relay: _relay,
        proxy: _proxy,
        mut alice,
        bob,
        channel,
    } = Hung::start("acme/close/hung");
    let send = {
        let channel = Arc::clone(&channel);
        Background::spawn("send", move || channel.send(b"stuck".to_vec()))
    };
    let rotate = {
        let channel = Arc::clone(&channel);
        Background::spawn("rotate_keys", move || channel.rotate_keys())
    };
    let add = {
        let channel = Arc::clone(&channel);
        let key_package = bob.generate_key_package().unwrap();
        Background::spawn("add_member", move || channel.add_member(key_package))
    };
    let read = {
        let channel = Arc::clone(&channel);
        Background::spawn("wait_next", move || {
            channel.wait_next(Duration::from_secs(600))
        })
    };
    let pipelined = channel
        .send_pipelined(b"queued".to_vec(), true)
        .unwrap()
        .unwrap();
    // Let every call reach the relay and wait for its answer.
    std::thread::sleep(Duration::from_secs(1));

    let started = Instant::now();
    alice.close();
    let took = started.elapsed();
    assert!(
        took < CLOSE_TIMEOUT + Duration::from_secs(1),
        "close took {took:?}"
    );

    let bound = Duration::from_secs(5);
    expect_error(send.join(bound), RUNTIME);
    expect_error(rotate.join(bound), RUNTIME);
    expect_error(add.join(bound), RUNTIME);
    assert!(matches!(read.join(bound), Ok(Next::End)));
    let settled = Background::spawn("the pipelined send's handle", move || {
        pipelined.wait(Duration::from_secs(600))
    });
    expect_error(settled.join(bound), RUNTIME);
}

/// A commit that a close cut off (made, its publish not answered) does not stand in the way of
/// the client's next commit after it opens again: it is published then, as it was. Here an
/// add: once the client is back, bob is a member and alice can rotate her keys. Before, every
/// later commit of the channel failed with "a commit of ours is already pending".
#[test]
fn a_commit_cut_off_by_a_close_is_published_when_the_client_is_back() {
    let _watchdog = watchdog(
        "a_commit_cut_off_by_a_close_is_published_when_the_client_is_back",
        Duration::from_secs(120),
    );
    let Hung {
        relay,
        proxy: _proxy,
        mut alice,
        bob,
        channel,
    } = Hung::start("acme/close/cut");
    let add = {
        let channel = Arc::clone(&channel);
        let key_package = bob.generate_key_package().unwrap();
        Background::spawn("add_member", move || channel.add_member(key_package))
    };
    std::thread::sleep(Duration::from_secs(1));
    alice.close();
    expect_error(add.join(Duration::from_secs(5)), RUNTIME);
    drop(channel);

    alice.reopen_at(&relay.endpoint());
    let channel = alice.open_channel("acme/close/cut").unwrap();
    channel.rotate_keys().unwrap();
    let members: Vec<Vec<u8>> = channel
        .members()
        .unwrap()
        .into_iter()
        .map(|m| m.identity)
        .collect();
    assert_eq!(members, vec![b"alice".to_vec(), b"bob".to_vec()]);
    channel.send(b"after".to_vec()).unwrap();
}
