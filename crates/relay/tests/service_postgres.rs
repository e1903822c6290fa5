//! Membership across relays on one PostgreSQL database: what one relay binds or commits, the
//! others learn from the store. Runs on a throwaway cluster of its own (initdb in a temporary
//! directory, loopback only, as `tests/support/postgres.py` makes one); skipped, saying so,
//! where PostgreSQL's binaries are missing (scripts/ensure-postgres.sh installs them).
#![allow(clippy::unwrap_used)]

mod service_support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use static_relay::{pb, Database, RelayConfig};
use tonic::Code;

use service_support::postgres::*;
use service_support::*;

/// Two relays on one database, checking tokens, keep-alives far apart (only entries wake the
/// streams).
async fn two_relays(url: &str, configure: impl Fn(&mut RelayConfig)) -> (Relay, Relay) {
    let mut relays = Vec::new();
    for _ in 0..2 {
        let dir = tempfile::tempdir().unwrap();
        let relay = Relay::on_database(
            Database::parse(url),
            dir,
            |c| {
                c.keepalive_interval = Duration::from_secs(60);
                configure(c);
            },
            Some(Arc::new(FakeVerify)),
        )
        .await;
        relays.push(relay);
    }
    let b = relays.pop().unwrap();
    (relays.pop().unwrap(), b)
}

/// Two relays on one new database of the cluster, kept (the cluster too) for as long as this is.
struct TwoRelays {
    a: Relay,
    b: Relay,
    _cluster: Cluster,
}

type Client = pb::relay_client::RelayClient<tonic::transport::Channel>;

/// [`TwoRelays`] on the database `name`, with `configure`d relays, a client of each, and alice
/// and bob (not in any channel yet); None without PostgreSQL.
async fn two_relays_on(
    name: &str,
    configure: impl Fn(&mut RelayConfig),
) -> Option<(TwoRelays, Client, Client, Member, Member)> {
    let cluster = Cluster::start()?;
    let url = cluster.database(name).await;
    let (a, b) = two_relays(&url, configure).await;
    let (on_a, on_b) = (a.client().await, b.client().await);
    let alice = Member::with_token("alice", "acme.k1");
    let bob = Member::with_token("bob", "bobco.k1");
    let relays = TwoRelays {
        a,
        b,
        _cluster: cluster,
    };
    Some((relays, on_a, on_b, alice, bob))
}

/// Bob binds through relay A and reads through relay B (B reloads the bindings before it
/// refuses). Alice removes him through A: his streams on B get the entries up to that commit
/// (so his client learns of the removal) and then end with PERMISSION_DENIED. B learns the
/// commit from the store, not from its own writer: it once dropped what it knew of bob with
/// its old group and ended his streams before the commit, which he then never saw.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removal_on_one_relay_ends_access_on_another_after_the_commit() {
    let Some((_relays, mut on_a, mut on_b, alice, bob)) = two_relays_on("removal", |_| {}).await
    else {
        return;
    };
    group_of(&mut on_a, CHANNEL, &[&alice, &bob]).await;

    let mut bobs = bob.subscribe(&mut on_b, CHANNEL, 0).await.unwrap();
    assert_eq!(bobs.wait_for(1).await.len(), 1);
    let mut bobs_many = Many::open(&mut on_b, Some("bobco.k1")).await;
    bobs_many.add(subscribe_request(CHANNEL, 0));
    assert_eq!(bobs_many.live(CHANNEL).await, 1);
    assert_eq!(bobs_many.wait_for(CHANNEL, 1).await, [1]);
    let hello = alice.encrypt(CHANNEL, b"across relays");
    alice.publish(&mut on_a, CHANNEL, hello).await.unwrap();
    bobs.wait_for(2).await;
    bobs_many.wait_for(CHANNEL, 2).await;

    let removal = alice.remove(CHANNEL, "bob");
    let removed = alice
        .publish(&mut on_a, CHANNEL, removal.clone())
        .await
        .unwrap();
    let at = Instant::now();
    assert_eq!((removed.seq, removed.epoch), (3, 2));
    let status = bobs.wait_end().await;
    assert_eq!(bobs.seqs(), [1, 2, 3], "bob's stream ended with {status:?}");
    assert_status(&status, Code::PermissionDenied, &not_a_member(CHANNEL));
    assert!(at.elapsed() < Duration::from_secs(1), "{:?}", at.elapsed());
    assert_eq!(bobs.entries[2].message, removal);
    let ended = tokio::time::timeout(Duration::from_secs(1), bobs_many.answer(CHANNEL, 2))
        .await
        .expect("the follow did not end within a second of the removal");
    assert_eq!(bobs_many.seqs(CHANNEL), [1, 2, 3]);
    assert_refusal(ended, Code::PermissionDenied, &not_a_member(CHANNEL));
    // Refused on both relays from now on.
    for client in [&mut on_a, &mut on_b] {
        let late = application(CHANNEL, 2, b"late");
        let refused = bob.publish(client, CHANNEL, late).await.unwrap_err();
        assert_status(&refused, Code::PermissionDenied, &not_a_member(CHANNEL));
    }
}

/// A departed member keeps its right to read up to its removal whoever takes its leaf index
/// later, on PostgreSQL too: relay B reads the channel from the store only after dave took
/// bob's leaf; relay A reads it again after an unload.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_departed_member_reads_up_to_its_removal_after_its_leaf_is_reused() {
    let Some((relays, mut on_a, mut on_b, alice, bob)) = two_relays_on("reuse", |_| {}).await
    else {
        return;
    };
    let dave = Member::with_token("dave", "daveco.k1");
    reuse_a_departed_leaf(&mut on_a, CHANNEL, &alice, &bob, &dave).await;
    assert_reads_up_to_its_removal(&mut on_b, CHANNEL, &bob).await;
    relays.a.unload_all().await;
    assert_reads_up_to_its_removal(&mut on_a, CHANNEL, &bob).await;
}

/// What one relay learns of a channel's membership, the other one uses: the org claimed on A
/// is refused on B; bob binds through B and publishes through A; commits are checked on
/// either relay against the one group (the same epoch raced on both: one wins); a leave
/// proposed on B is committed by reference on A; a forged commit is refused on both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_on_one_database_share_the_membership() {
    let Some((_relays, mut on_a, mut on_b, alice, bob)) = two_relays_on("shared", |_| {}).await
    else {
        return;
    };
    alice.create(&mut on_a, CHANNEL).await;
    let evil = Member::with_token("mallory", "evil.k1");
    let refused = evil
        .try_create(&mut on_b, "acme/agents/other")
        .await
        .unwrap_err();
    assert_status(
        &refused,
        Code::PermissionDenied,
        "org 'acme' belongs to another account",
    );
    let exists = Member::with_token("alice", "acme.k2")
        .try_create(&mut on_b, CHANNEL)
        .await
        .unwrap_err();
    assert_eq!(exists.code(), Code::AlreadyExists);

    // The add through A, the binding through B, a message through A.
    let (_, _, welcome) = alice.add_unjoined(&mut on_a, CHANNEL, &[&bob]).await;
    bob.join(&mut on_b, CHANNEL, &welcome).await;
    let hello = bob.encrypt(CHANNEL, b"bound on B, sent on A");
    assert_eq!(bob.publish(&mut on_a, CHANNEL, hello).await.unwrap().seq, 2);
    let list = alice.list_members(&mut on_a, CHANNEL).await.unwrap();
    let accounts: Vec<_> = list.members.iter().map(|m| m.account.as_str()).collect();
    assert_eq!((list.epoch, accounts), (1, vec!["acme", "bobco"]));

    // Both commit at epoch 1, alice on A, bob on B: one wins, the other is stale.
    let (alices, bobs) = (alice.update(CHANNEL), bob.update(CHANNEL));
    let (on_a_answer, on_b_answer) = tokio::join!(
        alice.publish(&mut on_a, CHANNEL, alices.clone()),
        bob.publish(&mut on_b, CHANNEL, bobs.clone()),
    );
    let (won, lost, winner) = match (on_a_answer, on_b_answer) {
        (Ok(won), Err(lost)) => (won, lost, alices),
        (Err(lost), Ok(won)) => (won, lost, bobs),
        other => panic!("not exactly one winner: {other:?}"),
    };
    assert_eq!((won.seq, won.epoch), (3, 2));
    assert_eq!(lost.code(), Code::FailedPrecondition);
    assert_eq!(trailer(&lost, "static-current-epoch").as_deref(), Some("2"));
    alice.apply(CHANNEL, &winner);
    bob.apply(CHANNEL, &winner);

    // A forged commit at the new epoch, on either relay.
    let mut mallory = RawMember::new("alice");
    mallory.create_look_alike(CHANNEL);
    mallory.self_update(true);
    mallory.self_update(true);
    let forged = mallory.self_update(false);
    for client in [&mut on_a, &mut on_b] {
        let refused = client
            .publish(authed(request(CHANNEL, forged.clone()), "acme.stolen"))
            .await
            .unwrap_err();
        assert_status(
            &refused,
            Code::PermissionDenied,
            "the commit's signature does not verify",
        );
    }

    // Bob's leave proposed on B, committed by reference on A.
    let proposal = bob.leave(CHANNEL);
    bob.publish(&mut on_b, CHANNEL, proposal.clone())
        .await
        .unwrap();
    alice.apply(CHANNEL, &proposal);
    let (committed, _) = alice.commit_proposals(&mut on_a, CHANNEL).await;
    assert_eq!((committed.seq, committed.epoch), (5, 3));
    for client in [&mut on_a, &mut on_b] {
        let late = application(CHANNEL, 3, b"gone");
        let refused = bob.publish(client, CHANNEL, late).await.unwrap_err();
        assert_status(&refused, Code::PermissionDenied, &not_a_member(CHANNEL));
    }
    let list = alice.list_members(&mut on_b, CHANNEL).await.unwrap();
    assert_eq!((list.epoch, list.members.len()), (3, 1));
}

/// Unloads every channel of `relay` that nothing holds any more (a stream that just ended
/// lets go of its channel a moment later).
async fn unload_all(relay: &Relay) {
    let log = relay.server().log();
    let started = Instant::now();
    loop {
        log.unload_idle(Duration::ZERO);
        if log.loaded_channels() == 0 {
            return;
        }
        assert!(started.elapsed() < Duration::from_secs(5), "still loaded");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A channel unloaded on relay A while relay B publishes and commits (A's NOTIFYs find it
/// gone): A reads it again from the store when next named, and carries on exactly (the next
/// seq, the new epoch, the fence, its members); a subscriber resumes on A from its cursor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_channel_unloaded_on_one_relay_while_another_publishes() {
    let Some((relays, mut on_a, mut on_b, alice, bob)) = two_relays_on("unload", |_| {}).await
    else {
        return;
    };
    group_of(&mut on_a, CHANNEL, &[&alice, &bob]).await;
    let hello = alice.encrypt(CHANNEL, b"on a");
    assert_eq!(
        alice.publish(&mut on_a, CHANNEL, hello).await.unwrap().seq,
        2
    );
    let mut bobs = bob.subscribe(&mut on_a, CHANNEL, 0).await.unwrap();
    assert_eq!(bobs.wait_for(2).await.len(), 2);
    drop(bobs);
    unload_all(&relays.a).await;

    // Alice's commit at epoch 1, left for later: bob's commit on B will have made it stale.
    let stale = alice.update(CHANNEL);
    for i in 0..3 {
        let message = bob.encrypt(CHANNEL, format!("on b {i}").as_bytes());
        bob.publish(&mut on_b, CHANNEL, message).await.unwrap();
    }
    let (moved, commit) = bob.commit(&mut on_b, CHANNEL).await;
    assert_eq!((moved.seq, moved.epoch), (6, 2));
    assert_eq!(relays.a.server().log().loaded_channels(), 0);

    let refused = alice.publish(&mut on_a, CHANNEL, stale).await.unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition, "{refused:?}");
    alice.apply(CHANNEL, &commit);
    let back = alice.encrypt(CHANNEL, b"back on a");
    let answer = alice.publish(&mut on_a, CHANNEL, back).await.unwrap();
    assert_eq!((answer.seq, answer.epoch), (7, 2));
    let mut resumed = bob.subscribe(&mut on_a, CHANNEL, 2).await.unwrap();
    resumed.wait_for(5).await;
    assert_eq!(resumed.seqs(), [3, 4, 5, 6, 7]);
    assert_eq!(epoch_of(&mut on_a, &alice, CHANNEL).await, 2);

    // Unloaded again with a stream open on B; A's commit reaches it, A's next load is exact.
    let mut on_b_stream = alice.subscribe(&mut on_b, CHANNEL, 7).await.unwrap();
    drop(resumed);
    unload_all(&relays.a).await;
    let (next, _) = alice.commit(&mut on_a, CHANNEL).await;
    assert_eq!((next.seq, next.epoch), (8, 3));
    assert_eq!(on_b_stream.wait_for(1).await[0].seq, 8);
}

/// Retention across relays: a channel's policy set through one relay is pruned by another;
/// a relay that did not prune learns the horizon when a read finds the log starting later
/// (OUT_OF_RANGE, not a gap); both relays pruning at once agree on one horizon; a Welcome
/// used through one relay (its joiner bound there) stops holding the log for the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_on_one_database_share_the_retention() {
    let Some((relays, mut on_a, mut on_b, alice, bob)) = two_relays_on("retention", |c| {
        c.prune_interval = Duration::ZERO;
        c.idempotency_window = Duration::ZERO;
        c.welcome_ttl = Duration::ZERO;
        c.used_welcome_grace = Duration::ZERO;
    })
    .await
    else {
        return;
    };
    let (a, b) = (&relays.a, &relays.b);
    alice.create(&mut on_a, CHANNEL).await;
    for i in 0..10 {
        let message = alice.encrypt(CHANNEL, format!("m{i}").as_bytes());
        alice.publish(&mut on_a, CHANNEL, message).await.unwrap();
    }
    // B has the channel loaded (horizon 0) before A prunes.
    let mut early = alice.subscribe(&mut on_b, CHANNEL, 0).await.unwrap();
    early.wait_for(10).await;
    let policy = pb::RetentionPolicy {
        max_age_seconds: None,
        max_entries: Some(3),
        max_bytes: None,
    };
    let set = pb::SetRetentionRequest {
        channel: CHANNEL.to_owned(),
        policy: Some(policy),
    };
    on_b.set_retention(alice.request(set)).await.unwrap();
    assert_eq!(a.server().prune_now().await.unwrap().entries, 7);
    // B's memory still says 0: the read finds the log starting at 8 and asks the store.
    let mut late = alice.subscribe(&mut on_b, CHANNEL, 2).await.unwrap();
    let status = late.wait_end().await;
    assert_eq!(status.code(), Code::OutOfRange, "{status:?}");
    assert_eq!(trailer(&status, "static-horizon-seq").as_deref(), Some("7"));
    assert!(late.seqs().is_empty());
    // B knows it now: refused up front.
    let refused = alice.subscribe(&mut on_b, CHANNEL, 2).await.err().unwrap();
    assert_eq!(refused.code(), Code::OutOfRange);
    more_retention(a, b, &alice, &bob, &mut on_a, &mut on_b).await;
}

/// Both relays pruning at once, and a Welcome used through the other relay.
async fn more_retention(
    a: &Relay,
    b: &Relay,
    alice: &Member,
    bob: &Member,
    on_a: &mut pb::relay_client::RelayClient<tonic::transport::Channel>,
    on_b: &mut pb::relay_client::RelayClient<tonic::transport::Channel>,
) {
    // Both prune at once: one horizon.
    for i in 0..20 {
        let message = alice.encrypt(CHANNEL, format!("n{i}").as_bytes());
        alice.publish(on_a, CHANNEL, message).await.unwrap();
    }
    let (on_a_pass, on_b_pass) = tokio::join!(a.server().prune_now(), b.server().prune_now());
    assert!(on_a_pass.unwrap().entries + on_b_pass.unwrap().entries >= 20);
    let get = pb::GetRetentionRequest {
        channel: CHANNEL.to_owned(),
    };
    let got = on_a
        .get_retention(alice.request(get.clone()))
        .await
        .unwrap();
    assert_eq!(got.into_inner().horizon_seq, 27);

    // A Welcome added through A holds the log until bob binds through B.
    let (commit, _, welcome) = alice.add_unjoined(on_a, CHANNEL, &[bob]).await;
    assert_eq!(commit.seq, 31);
    for i in 0..5 {
        let message = alice.encrypt(CHANNEL, format!("w{i}").as_bytes());
        alice.publish(on_a, CHANNEL, message).await.unwrap();
    }
    a.server().prune_now().await.unwrap();
    let got = on_b
        .get_retention(alice.request(get.clone()))
        .await
        .unwrap();
    assert_eq!(got.into_inner().horizon_seq, 31);
    bob.join(on_b, CHANNEL, &welcome).await;
    tokio::time::sleep(Duration::from_millis(5)).await;
    let report = a.server().prune_now().await.unwrap();
    assert_eq!((report.welcomes, report.entries), (1, 2));
    let got = on_b.get_retention(bob.request(get)).await.unwrap();
    assert_eq!(got.into_inner().horizon_seq, 33);
}
