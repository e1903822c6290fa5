//! Channels end to end against a real relay: create, add, join, send and receive; concurrent
//! commits; sends encrypted at an old epoch; the refusals that are final (names, Welcomes).
#![allow(clippy::unwrap_used)]

mod support;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use support::{
    assert_quiet, expect_error, invite, member_names, receive, receive_n, run_parallel, wait_until,
    watchdog, Agent, Authority, Job, Provider, Relay, AUTH, INVALID_NAME, MLS, TRANSPORT, WAIT,
};

const QUIET: Duration = Duration::from_millis(500);

/// Each commit's outcome in a race: the Welcome of an add, or the error's text.
type Outcomes = Vec<Result<Option<Vec<u8>>, String>>;

#[test]
fn two_members_exchange_messages() {
    let _watchdog = watchdog("two_members_exchange_messages", Duration::from_secs(120));
    let relay = Relay::start();
    let alice = Agent::new(&relay, "alice");
    let bob = Agent::new(&relay, "bob");
    let name = "acme/agents/flow";

    let a = alice.create_channel(name).unwrap();
    assert_eq!(member_names(&a), ["alice"]);
    assert_eq!(a.epoch().unwrap(), 0);
    let key_package = bob.generate_key_package().unwrap();
    let welcome = a.add_member(key_package).unwrap();
    assert!(!welcome.is_empty());
    assert_eq!(
        a.epoch().unwrap(),
        1,
        "the add is merged when add_member returns"
    );
    let b = bob.join_channel(name, &welcome).unwrap();

    assert_eq!(member_names(&a), ["alice", "bob"]);
    assert_eq!(member_names(&b), ["alice", "bob"]);
    assert_eq!(b.epoch().unwrap(), 1);
    assert_eq!(
        a.epoch_authenticator().unwrap(),
        b.epoch_authenticator().unwrap()
    );
    assert_eq!(alice.channels().unwrap(), [name]);
    assert_eq!(bob.channels().unwrap(), [name]);

    // Both ways, bytes intact: text, every byte value, a large payload.
    a.send(b"hello bob".to_vec()).unwrap();
    assert_eq!(receive(&b, WAIT), b"hello bob");
    b.send(b"hello alice".to_vec()).unwrap();
    assert_eq!(receive(&a, WAIT), b"hello alice");
    let binary: Vec<u8> = (0..=255u8).collect();
    a.send(binary.clone()).unwrap();
    assert_eq!(receive(&b, WAIT), binary);
    let large: Vec<u8> = (0..256 * 1024).map(|i| (i % 251) as u8).collect();
    b.send(large.clone()).unwrap();
    assert_eq!(receive(&a, WAIT), large);

    // A burst arrives complete and in order.
    let burst: Vec<Vec<u8>> = (0..50).map(|i| format!("m{i}").into_bytes()).collect();
    for message in &burst {
        a.send(message.clone()).unwrap();
    }
    assert_eq!(receive_n(&b, burst.len(), WAIT), burst);

    // Nobody gets their own messages back, nor anything twice.
    assert_quiet(&a, QUIET);
    assert_quiet(&b, QUIET);
    assert_eq!(b.pending().unwrap(), 0);
}

/// Four members commit at once (three rotating their keys, one adding a fifth member): every
/// commit lands (or gives up as "too busy"), and everyone ends in the same epoch with the same
/// epoch authenticator, where messages still flow.
#[test]
fn concurrent_commits_converge() {
    let _watchdog = watchdog("concurrent_commits_converge", Duration::from_secs(180));
    let relay = Relay::start();
    let name = "acme/agents/race";
    let agents: Vec<Agent> = ["a", "b", "c", "d"]
        .iter()
        .map(|n| Agent::new(&relay, n))
        .collect();
    let newcomer = Agent::new(&relay, "e");
    let mut channels = vec![agents[0].create_channel(name).unwrap()];
    for agent in &agents[1..] {
        channels.push(invite(&channels[0], agent));
    }
    let start_epoch = channels[0].epoch().unwrap();
    assert_eq!(start_epoch, 3);

    const ROTATIONS: usize = 3;
    let key_package = newcomer.generate_key_package().unwrap();
    let mut jobs: Vec<Job<Outcomes>> = Vec::new();
    for channel in &channels[..3] {
        let channel = Arc::clone(channel);
        jobs.push(Box::new(move || {
            (0..ROTATIONS)
                .map(|_| {
                    channel
                        .rotate_keys()
                        .map(|()| None)
                        .map_err(|e| e.to_string())
                })
                .collect()
        }));
    }
    {
        let channel = Arc::clone(&channels[3]);
        jobs.push(Box::new(move || {
            vec![channel
                .add_member(key_package)
                .map(Some)
                .map_err(|e| e.to_string())]
        }));
    }
    let results: Vec<_> = run_parallel(Duration::from_secs(120), jobs)
        .into_iter()
        .flatten()
        .collect();
    let mut committed = 0u64;
    let mut welcome = None;
    for result in results {
        match result {
            Ok(w) => {
                committed += 1;
                if w.is_some() {
                    welcome = w;
                }
            }
            Err(text) => assert!(
                text.starts_with(TRANSPORT) && text.contains("too busy"),
                "a concurrent commit failed with {text:?}"
            ),
        }
    }
    eprintln!("{committed} of {} commits landed", 3 * ROTATIONS + 1);
    assert!(committed >= 1);

    if let Some(welcome) = welcome {
        channels.push(newcomer.join_channel(name, &welcome).unwrap());
    }
    let expected = start_epoch + committed;
    wait_until("every member reaches the last epoch", WAIT, || {
        channels.iter().all(|c| c.epoch().unwrap() == expected)
    });
    let authenticator = channels[0].epoch_authenticator().unwrap();
    for channel in &channels {
        assert_eq!(channel.epoch_authenticator().unwrap(), authenticator);
        assert_eq!(member_names(channel), member_names(&channels[0]));
    }

    // Messages flow between every pair.
    for (i, channel) in channels.iter().enumerate() {
        channel.send(format!("from {i}").into_bytes()).unwrap();
    }
    for (i, channel) in channels.iter().enumerate() {
        let got: BTreeSet<Vec<u8>> = receive_n(channel, channels.len() - 1, WAIT)
            .into_iter()
            .collect();
        let want: BTreeSet<Vec<u8>> = (0..channels.len())
            .filter(|j| *j != i)
            .map(|j| format!("from {j}").into_bytes())
            .collect();
        assert_eq!(got, want, "member {i}");
    }
    for channel in &channels {
        assert_quiet(channel, QUIET);
    }
}

/// A member that was away while others committed `commits` times sends at once on return:
/// its message (encrypted at its old epoch if it is still behind: within the relay's window of
/// 5 epochs it is accepted as is, beyond it refused as stale and encrypted again) arrives.
fn send_after_missed_commits(commits: usize) {
    let relay = Relay::start();
    let name = "acme/agents/stale";
    let mut alice = Agent::new(&relay, "alice");
    let bob = Agent::new(&relay, "bob");
    let a = alice.create_channel(name).unwrap();
    let b = invite(&a, &bob);
    a.send(b"before".to_vec()).unwrap();
    assert_eq!(receive(&b, WAIT), b"before");
    let old_epoch = a.epoch().unwrap();
    drop(a);

    alice.close();
    for _ in 0..commits {
        b.rotate_keys().unwrap();
    }
    let current = b.epoch().unwrap();
    assert_eq!(current, old_epoch + commits as u64);

    alice.reopen();
    let a = alice.open_channel(name).unwrap();
    let sent_at = a.epoch().unwrap();
    a.send(b"after".to_vec()).unwrap();
    eprintln!(
        "{commits} missed commits: alice sent at local epoch {sent_at} (channel at {current})"
    );
    assert_eq!(receive(&b, WAIT), b"after");
    wait_until("alice catches up", WAIT, || a.epoch().unwrap() == current);
    assert_eq!(
        a.epoch_authenticator().unwrap(),
        b.epoch_authenticator().unwrap()
    );
    b.send(b"welcome back".to_vec()).unwrap();
    assert_eq!(receive(&a, WAIT), b"welcome back");
    assert_quiet(&a, QUIET);
    assert_quiet(&b, QUIET);
}

#[test]
fn send_at_an_epoch_inside_the_window_arrives() {
    let _watchdog = watchdog("send_inside_window", Duration::from_secs(120));
    send_after_missed_commits(5);
}

#[test]
fn send_at_an_epoch_beyond_the_window_arrives() {
    let _watchdog = watchdog("send_beyond_window", Duration::from_secs(120));
    send_after_missed_commits(7);
}

#[test]
fn final_refusals_of_names_and_welcomes() {
    let _watchdog = watchdog("final_refusals", Duration::from_secs(120));
    let relay = Relay::start();
    let alice = Agent::new(&relay, "alice");
    let carol = Agent::new(&relay, "carol");
    let name = "acme/agents/taken";
    let a = alice.create_channel(name).unwrap();

    // A channel that exists on the relay (someone else's group) cannot be created again.
    let text = expect_error(carol.create_channel(name), MLS);
    assert!(text.contains("already exists on the relay"), "{text}");
    assert!(carol.channels().unwrap().is_empty());
    // Nor by its member.
    let text = expect_error(alice.create_channel(name), MLS);
    assert!(text.contains("already a member"), "{text}");

    expect_error(alice.create_channel("not a channel"), INVALID_NAME);
    expect_error(alice.create_channel("acme/agents"), INVALID_NAME);
    expect_error(carol.join_channel("acme//x", b"welcome"), INVALID_NAME);

    let text = expect_error(carol.open_channel(name), MLS);
    assert!(text.contains("not a member"), "{text}");
    expect_error(carol.join_channel(name, b"not a welcome"), MLS);
    // A Welcome for someone else.
    let bob = Agent::new(&relay, "bob");
    let welcome = a.add_member(bob.generate_key_package().unwrap()).unwrap();
    expect_error(carol.join_channel(name, &welcome), MLS);
    assert!(carol.channels().unwrap().is_empty());
    // The channel still works for its members.
    let b = bob.join_channel(name, &welcome).unwrap();
    a.send(b"still fine".to_vec()).unwrap();
    assert_eq!(receive(&b, WAIT), b"still fine");
}

/// A Welcome into a channel of another account. Before membership the relay kept channels per
/// account, so such a join was refused; now access follows MLS membership (docs/design.md
/// §5.2): the joiner binds its leaf to its own account and is a member like any other, while
/// names stay global and the org its creator's, so the other account cannot create under it.
#[test]
fn a_member_of_another_account_joins_but_cannot_create_under_the_org() {
    let _watchdog = watchdog("join_other_account", Duration::from_secs(120));
    let authority = Authority::new();
    let relay = Relay::start_with(|_| {}, Some(authority.verifier()));
    let alice = support::authed_agent(&relay, "alice", &Provider::new(&authority, "acme", &[]));
    let mallory =
        support::authed_agent(&relay, "mallory", &Provider::new(&authority, "other", &[]));
    let name = "acme/agents/private";
    // A channel of mallory's own, followed on the same subscriptions as the joined one.
    let own = mallory.create_channel("other/agents/own").unwrap();
    let own_peer = support::authed_agent(&relay, "trent", &Provider::new(&authority, "other", &[]));
    let theirs = invite(&own, &own_peer);
    let a = alice.create_channel(name).unwrap();
    let welcome = a
        .add_member(mallory.generate_key_package().unwrap())
        .unwrap();
    let m = mallory.join_channel(name, &welcome).unwrap();
    a.send(b"to another account".to_vec()).unwrap();
    assert_eq!(receive(&m, WAIT), b"to another account");
    m.send(b"from another account".to_vec()).unwrap();
    assert_eq!(receive(&a, WAIT), b"from another account");
    // Its own channel goes on beside it.
    theirs.send(b"still here".to_vec()).unwrap();
    assert_eq!(receive(&own, WAIT), b"still here");
    assert_eq!(
        mallory.channels().unwrap(),
        ["acme/agents/private", "other/agents/own"]
    );
    assert_eq!(member_names(&m), ["alice", "mallory"]);
    assert_eq!(member_names(&a), ["alice", "mallory"]);
    // The org is alice's account's: mallory's account may not create under it.
    let text = expect_error(mallory.create_channel("acme/agents/mine"), AUTH);
    assert!(
        text.contains("org 'acme' belongs to another account"),
        "{text}"
    );
    assert_eq!(mallory.channels().unwrap().len(), 2);
}
