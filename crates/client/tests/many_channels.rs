//! One client with many open channels: all subscribed, a message on the oldest and on the
//! newest reaches a second client both ways, every channel can send; measures opening time,
//! threads, RSS and latency.
#![allow(clippy::unwrap_used)]

mod support;

use std::time::{Duration, Instant};

use support::{
    assert_quiet, invite, proc_status, receive, thread_count, watchdog, Agent, Relay, WAIT,
};

/// Most threads the process may have, whatever the number of channels.
const THREAD_BOUND: usize = 64;
/// Send-to-receive round trips measured on the oldest channel.
const SAMPLES: usize = 20;

fn many_channels(n: usize) {
    assert!(n >= 2);
    let relay = Relay::start();
    let alice = Agent::new(&relay, "alice");
    let bob = Agent::new(&relay, "bob");

    let started = Instant::now();
    let channels: Vec<_> = (0..n)
        .map(|i| {
            alice
                .create_channel(&format!("acme/many/c{i}"))
                .unwrap_or_else(|e| panic!("channel {i} of {n}: {e}"))
        })
        .collect();
    let opened = started.elapsed();

    // Every channel's subscription is live.
    let deadline = Instant::now() + WAIT + Duration::from_millis(2 * n as u64);
    loop {
        let connected = channels.iter().filter(|c| c.progress().connected).count();
        if connected == n {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{connected} of {n} channels subscribed after {:?} (first not: {:?}, {:?})",
            started.elapsed(),
            channels
                .iter()
                .position(|c| !c.progress().connected)
                .map(|i| channels[i].name().to_owned()),
            channels
                .iter()
                .find(|c| !c.progress().connected)
                .map(|c| c.progress()),
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let subscribed = started.elapsed();

    let oldest = &channels[0];
    let newest = &channels[n - 1];
    let bob_oldest = invite(oldest, &bob);
    let bob_newest = invite(newest, &bob);

    let mut latencies = Vec::with_capacity(SAMPLES);
    for i in 0..SAMPLES {
        let message = format!("oldest {i}").into_bytes();
        let sent = Instant::now();
        oldest.send(message.clone()).unwrap();
        assert_eq!(receive(&bob_oldest, WAIT), message);
        latencies.push(sent.elapsed());
    }
    latencies.sort();

    newest.send(b"newest".to_vec()).unwrap();
    assert_eq!(receive(&bob_newest, WAIT), b"newest");
    bob_oldest.send(b"back on the oldest".to_vec()).unwrap();
    assert_eq!(receive(oldest, WAIT), b"back on the oldest");
    bob_newest.send(b"back on the newest".to_vec()).unwrap();
    assert_eq!(receive(newest, WAIT), b"back on the newest");
    assert_quiet(&bob_oldest, Duration::from_millis(300));

    // Every channel can send (each keeps a publish call of its own open today).
    for (i, channel) in channels.iter().enumerate() {
        channel
            .send(format!("on {i}").into_bytes())
            .unwrap_or_else(|e| panic!("send on channel {i} of {n}: {e}"));
    }

    let threads = thread_count();
    eprintln!(
        "{n} channels: opened in {opened:?} ({:?} per channel), all subscribed after \
         {subscribed:?}; threads {threads}, VmRSS {}; send->receive on the oldest: median \
         {:?}, max {:?}",
        opened / u32::try_from(n).unwrap(),
        proc_status("VmRSS"),
        latencies[SAMPLES / 2],
        latencies[SAMPLES - 1],
    );
    assert!(
        threads < THREAD_BOUND,
        "{threads} threads with {n} channels (bound {THREAD_BOUND})"
    );
}

#[test]
fn twenty_channels() {
    let _watchdog = watchdog("twenty_channels", Duration::from_secs(120));
    many_channels(20);
}

/// Fewer channels than the relay's cap of 100 streams per connection, but each channel that
/// has sent keeps a publish call open besides its subscription: 60 + 40 reach the cap.
#[test]
fn sixty_channels_all_sending() {
    let _watchdog = watchdog("sixty_channels_all_sending", Duration::from_secs(300));
    many_channels(60);
}

#[test]

fn a_hundred_and_fifty_channels() {
    let _watchdog = watchdog("a_hundred_and_fifty_channels", Duration::from_secs(300));
    many_channels(150);
}

#[test]

fn ten_thousand_channels() {
    let _watchdog = watchdog("ten_thousand_channels", Duration::from_secs(3600));
    many_channels(10_000);
}
