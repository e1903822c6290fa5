//! The client against a relay that refuses or goes away: rate limits (retry-after), refused and
//! unobtainable tokens, a relay restarting while clients send and subscribe, no relay at all.
#![allow(clippy::unwrap_used)]

mod support;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use static_client::ClientOptions;
use support::{
    assert_quiet, authed_agent, closed_port, expect_error, invite, receive, receive_n, wait_until,
    watchdog, Agent, Authority, Background, Provider, Relay, Step, AUTH, TRANSPORT, WAIT,
};

const QUIET: Duration = Duration::from_millis(500);

fn texts(prefix: &str, range: std::ops::Range<usize>) -> Vec<Vec<u8>> {
    range
        .map(|i| format!("{prefix} {i}").into_bytes())
        .collect()
}

/// A relay allowing 50 messages/s per agent, sent more than that: RESOURCE_EXHAUSTED with
/// `static-retry-after-ms` is waited out, and everything arrives exactly once, in order, from
/// blocking sends and from pipelined sends alike.
#[test]
fn rate_limited_sends_arrive_once_in_order() {
    let _watchdog = watchdog("rate_limited_sends", Duration::from_secs(120));
    const RATE: usize = 50;
    const N: usize = 120;
    let relay = Relay::start_with(
        |c| {
            c.allow_anonymous = true;
            c.publish_rate_per_agent = RATE as f64;
        },
        None,
    );
    let alice = Agent::new(&relay, "alice");
    let bob = Agent::new(&relay, "bob");
    let a = alice.create_channel("acme/agents/limited").unwrap();
    let b = invite(&a, &bob);

    let blocking = texts("blocking", 0..N);
    let started = Instant::now();
    for message in &blocking {
        a.send(message.clone()).unwrap();
    }
    let took = started.elapsed();
    // Beyond the burst of RATE, the relay lets RATE through per second: the limit was hit.
    let floor = Duration::from_millis(((N - RATE) * 1000 / RATE) as u64) * 8 / 10;
    assert!(
        took >= floor,
        "{N} sends took {took:?}: the rate limit never applied"
    );

    let pipelined = texts("pipelined", 0..N);
    let handles: Vec<_> = pipelined
        .iter()
        .map(|m| a.send_pipelined(m.clone(), true).unwrap().unwrap())
        .collect();
    assert!(a.flush_until(a.pipelined(), WAIT).unwrap(), "not flushed");
    for handle in &handles {
        assert!(handle.wait(Duration::ZERO).unwrap());
    }
    eprintln!(
        "{N} blocking sends in {took:?}, {N} pipelined in {:?} overall",
        started.elapsed()
    );

    let expected: Vec<Vec<u8>> = blocking.into_iter().chain(pipelined).collect();
    let got = receive_n(&b, expected.len(), WAIT);
    assert_eq!(got.len(), expected.len());
    for (i, (got, want)) in got.iter().zip(&expected).enumerate() {
        assert_eq!(
            String::from_utf8_lossy(got),
            String::from_utf8_lossy(want),
            "message {i}"
        );
    }
    assert_quiet(&b, QUIET);
}

/// The provider's first token is refused (forged or expired): the client drops it, fetches a
/// fresh one and proceeds. Later, every token expires at once: commits, a first send and
/// subscriptions made again after a relay restart all get fresh tokens.
#[test]
fn refused_tokens_are_replaced() {
    let _watchdog = watchdog("refused_tokens_are_replaced", Duration::from_secs(120));
    let authority = Authority::new();
    let mut relay = Relay::start_with(|_| {}, Some(authority.verifier()));
    let alice_tokens = Provider::new(&authority, "acme", &[Step::Invalid]);
    let bob_tokens = Provider::new(&authority, "acme", &[]);
    let alice = authed_agent(&relay, "alice", &alice_tokens);
    let bob = authed_agent(&relay, "bob", &bob_tokens);

    let a = alice.create_channel("acme/agents/tokens").unwrap();
    assert_eq!(
        alice_tokens.fetches(),
        2,
        "the refused token was replaced once"
    );
    assert!(authority.refused.load(Ordering::SeqCst) >= 1);
    let b = invite(&a, &bob);
    a.send(b"one".to_vec()).unwrap();
    assert_eq!(receive(&b, WAIT), b"one");

    // Every token expires: a commit (a unary Publish) and bob's first send (opening his
    // publish call) are refused once, then go through with fresh tokens.
    authority.revoke_all();
    let (alice_before, bob_before) = (alice_tokens.fetches(), bob_tokens.fetches());
    a.rotate_keys().unwrap();
    assert!(
        alice_tokens.fetches() > alice_before,
        "alice kept her refused token"
    );
    b.send(b"two".to_vec()).unwrap();
    assert!(
        bob_tokens.fetches() > bob_before,
        "bob kept his refused token"
    );
    assert_eq!(receive(&a, WAIT), b"two");

    // Expired again while the relay restarts: the subscriptions come back with fresh tokens.
    relay.stop();
    authority.revoke_all();
    relay.restart();
    a.send(b"three".to_vec()).unwrap();
    assert_eq!(receive(&b, WAIT), b"three");
    b.send(b"four".to_vec()).unwrap();
    assert_eq!(receive(&a, WAIT), b"four");
    assert_quiet(&a, QUIET);
    assert_quiet(&b, QUIET);
}

/// A provider whose key is refused (an auth error) fails the call at once with that error;
/// tokens the relay keeps refusing, and no token at all, fail with "auth error:" too.
#[test]
fn auth_failures_are_final() {
    let _watchdog = watchdog("auth_failures_are_final", Duration::from_secs(120));
    let authority = Authority::new();
    let relay = Relay::start_with(|_| {}, Some(authority.verifier()));
    let name = "acme/agents/denied";

    let revoked = Provider::new(&authority, "acme", &[Step::Refused]);
    let agent = authed_agent(&relay, "revoked", &revoked);
    let started = Instant::now();
    let text = expect_error(agent.create_channel(name), AUTH);
    assert!(text.contains("the API key is revoked"), "{text}");
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(revoked.fetches(), 1);
    assert!(agent.channels().unwrap().is_empty());

    let forged = Provider::new(&authority, "acme", &[Step::Invalid; 10]);
    let agent = authed_agent(&relay, "forged", &forged);
    let started = Instant::now();
    let text = expect_error(agent.create_channel(name), AUTH);
    assert!(text.contains("refused the credentials"), "{text}");
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(
        (2..=4).contains(&forged.fetches()),
        "{} fetches",
        forged.fetches()
    );

    let anonymous = Agent::new(&relay, "anonymous");
    let text = expect_error(anonymous.create_channel(name), AUTH);
    assert!(text.contains("requires a token"), "{text}");
}

/// A provider that cannot reach its token endpoint once (an error other than auth) is
/// retried, as `TokenProvider` documents, and the call succeeds.
#[test]
fn unreachable_token_endpoint_is_retried() {
    let _watchdog = watchdog("unreachable_token_endpoint", Duration::from_secs(120));
    let authority = Authority::new();
    let relay = Relay::start_with(|_| {}, Some(authority.verifier()));
    let tokens = Provider::new(&authority, "acme", &[Step::Unreachable]);
    let agent = authed_agent(&relay, "alice", &tokens);
    let channel = agent.create_channel("acme/agents/flaky").unwrap();
    assert_eq!(tokens.fetches(), 2);
    channel.rotate_keys().unwrap();
}

/// The relay stops and comes back on the same port while a member sends, blocking on one
/// channel and pipelined on another: the sends made during the outage complete once it is
/// back, and the receiver gets every message once, in order.
#[test]
fn sends_during_a_relay_outage_complete() {
    let _watchdog = watchdog("sends_during_outage", Duration::from_secs(150));
    const N: usize = 30;
    let mut relay = Relay::start();
    let alice = Agent::new(&relay, "alice");
    let bob = Agent::new(&relay, "bob");
    let a1 = alice.create_channel("acme/outage/blocking").unwrap();
    let a2 = alice.create_channel("acme/outage/pipelined").unwrap();
    let b1 = invite(&a1, &bob);
    let b2 = invite(&a2, &bob);
    a1.send(b"warm".to_vec()).unwrap();
    a2.send(b"warm".to_vec()).unwrap();
    assert_eq!(receive(&b1, WAIT), b"warm");
    assert_eq!(receive(&b2, WAIT), b"warm");

    let pace = Duration::from_millis(60);
    let blocking = {
        let a1 = a1.clone();
        Background::spawn("blocking sends", move || {
            for message in texts("blocking", 0..N) {
                a1.send(message).unwrap();
                std::thread::sleep(pace);
            }
        })
    };
    let pipelined = {
        let a2 = a2.clone();
        Background::spawn("pipelined sends", move || {
            for message in texts("pipelined", 0..N) {
                a2.send_pipelined(message, true).unwrap().unwrap();
                std::thread::sleep(pace);
            }
            a2.flush_until(a2.pipelined(), Duration::from_secs(40))
                .unwrap()
        })
    };
    std::thread::sleep(Duration::from_millis(400));
    relay.stop();
    let down = Instant::now();
    std::thread::sleep(Duration::from_millis(1500));
    relay.restart();
    eprintln!("relay down for {:?}", down.elapsed());
    blocking.join(Duration::from_secs(60));
    assert!(pipelined.join(Duration::from_secs(60)), "not flushed");

    assert_eq!(receive_n(&b1, N, WAIT), texts("blocking", 0..N));
    assert_eq!(receive_n(&b2, N, WAIT), texts("pipelined", 0..N));
    assert_quiet(&b1, QUIET);
    assert_quiet(&b2, QUIET);
}

/// A subscriber keeps receiving across a relay restart: its subscription drops, comes back,
/// and resumes after the last entry it had (no duplicates, order kept).
#[test]
fn subscriber_resumes_after_a_relay_restart() {
    let _watchdog = watchdog("subscriber_resumes", Duration::from_secs(120));
    let mut relay = Relay::start();
    let alice = Agent::new(&relay, "alice");
    let bob = Agent::new(&relay, "bob");
    let a = alice.create_channel("acme/agents/resume").unwrap();
    let b = invite(&a, &bob);
    for message in texts("before", 0..5) {
        a.send(message).unwrap();
    }
    assert_eq!(receive_n(&b, 5, WAIT), texts("before", 0..5));

    relay.stop();
    wait_until("bob's subscription drops", WAIT, || !b.progress().connected);
    relay.restart();
    wait_until("bob subscribes again", WAIT, || b.progress().connected);

    for message in texts("after", 0..5) {
        a.send(message).unwrap();
    }
    assert_eq!(receive_n(&b, 5, WAIT), texts("after", 0..5));
    b.send(b"reply".to_vec()).unwrap();
    assert_eq!(receive(&a, WAIT), b"reply");
    assert_quiet(&a, QUIET);
    assert_quiet(&b, QUIET);
}

/// Nothing listens at the endpoint: calls fail within about the connect timeout.
#[test]
fn unreachable_relay_fails_within_the_connect_timeout() {
    let _watchdog = watchdog("unreachable_relay", Duration::from_secs(60));
    let port = closed_port();
    let connect_timeout = Duration::from_secs(1);
    let options = ClientOptions {
        connect_timeout,
        retry_timeout: Duration::from_secs(30),
        ca_file: None,
    };
    let agent = Agent::with(&format!("http://127.0.0.1:{port}"), "alice", None, options);
    let started = Instant::now();
    let text = expect_error(agent.create_channel("acme/agents/nowhere"), TRANSPORT);
    let took = started.elapsed();
    eprintln!("create_channel failed after {took:?}: {text}");
    assert!(
        took >= connect_timeout * 9 / 10 && took < connect_timeout + Duration::from_secs(3),
        "failed after {took:?}"
    );
    assert!(text.contains(&port.to_string()), "{text}");
    assert!(agent.channels().unwrap().is_empty());
    let started = Instant::now();
    expect_error(
        agent.join_channel("acme/agents/nowhere", b"welcome"),
        TRANSPORT,
    );
    assert!(started.elapsed() < connect_timeout + Duration::from_secs(3));
}
