//! Pipelined senders come and go: a channel holds a sender thread only while it pipelines, and
//! sends made after its thread ended start a new one (nothing is left queued without one).
#![allow(clippy::unwrap_used)]

mod support;

use std::time::Duration;

use support::{invite, receive_n, wait_until, watchdog, Agent, Relay, WAIT};

const CHANNELS: usize = 12;
const MESSAGES: usize = 20;

/// The process's threads named `static-sender` (this test binary runs this one test).
fn senders() -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
        .filter(|name| name.trim() == "static-sender")
        .count()
}

fn pipeline_round(channels: &[std::sync::Arc<static_client::Channel>], round: usize) {
    for (i, channel) in channels.iter().enumerate() {
        for m in 0..MESSAGES {
            let payload = format!("{round}/{i}/{m}").into_bytes();
            channel.send_pipelined(payload, true).unwrap().unwrap();
        }
    }
    for channel in channels {
        assert!(channel
            .flush_until(channel.pipelined(), Duration::from_secs(30))
            .unwrap());
    }
}

#[test]
fn sender_threads_end_when_idle_and_come_back_on_the_next_send() {
    let _watchdog = watchdog("senders", Duration::from_secs(120));
    let relay = Relay::start();
    let alice = Agent::new(&relay, "alice");
    let bob = Agent::new(&relay, "bob");
    let ours: Vec<_> = (0..CHANNELS)
        .map(|i| alice.create_channel(&format!("acme/senders/c{i}")).unwrap())
        .collect();
    let theirs: Vec<_> = ours.iter().map(|c| invite(c, &bob)).collect();

    for round in 0..3 {
        pipeline_round(&ours, round);
        assert!(senders() <= CHANNELS, "{} sender threads", senders());
        // Idle: every sender thread ends.
        wait_until("the idle sender threads to end", WAIT, || senders() == 0);
    }
    // Every message arrived once, in order, on every channel.
    for (i, channel) in theirs.iter().enumerate() {
        let got = receive_n(channel, 3 * MESSAGES, WAIT);
        let want: Vec<Vec<u8>> = (0..3)
            .flat_map(|round| (0..MESSAGES).map(move |m| format!("{round}/{i}/{m}").into_bytes()))
            .collect();
        assert_eq!(got, want, "channel {i}");
    }
}
