//! Retention end to end on SQLite (docs/design.md §5.3): SetRetention and GetRetention and who
//! may call them, pruning to a policy (entries, bytes, age), the horizon's OUT_OF_RANGE on
//! every read path, the floors no policy passes (an unused Welcome's commit, the idempotency
//! window), the Welcomes' expiry (TTL, used), and a group that goes on after its past was
//! pruned. Passes run through `RelayServer::prune_now` (the background task runs the same
//! pass every `prune_interval`), so no test waits for a timer but the age one (one second).
#![allow(clippy::unwrap_used)]

mod service_support;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use static_relay::pb;
use static_relay::pb::relay_client::RelayClient;
use static_relay::{PassReport, RelayConfig};
use tonic::transport::Channel;
use tonic::Code;

use service_support::*;

/// Manual passes only, no idempotency floor (unless a test sets one), Welcomes kept until
/// used, then gone at the next pass.
fn manual(config: &mut RelayConfig) {
    config.prune_interval = Duration::ZERO;
    config.idempotency_window = Duration::ZERO;
    config.welcome_ttl = Duration::ZERO;
    config.used_welcome_grace = Duration::ZERO;
}

async fn relay(configure: impl FnOnce(&mut RelayConfig)) -> Relay {
    Relay::start_with(
        |c| {
            manual(c);
            configure(c);
        },
        Some(Arc::new(FakeVerify)),
    )
    .await
}

fn policy(age: Option<u64>, entries: Option<u64>, bytes: Option<u64>) -> pb::RetentionPolicy {
    pb::RetentionPolicy {
        max_age_seconds: age,
        max_entries: entries,
        max_bytes: bytes,
    }
}

async fn set_retention(
    client: &mut RelayClient<Channel>,
    member: &Member,
    policy: pb::RetentionPolicy,
) -> Result<pb::RetentionResponse, tonic::Status> {
    let request = pb::SetRetentionRequest {
        channel: CHANNEL.to_owned(),
        policy: Some(policy),
    };
    client
        .set_retention(member.request(request))
        .await
        .map(tonic::Response::into_inner)
}

async fn get_retention(
    client: &mut RelayClient<Channel>,
    member: &Member,
) -> Result<pb::RetentionResponse, tonic::Status> {
    let request = pb::GetRetentionRequest {
        channel: CHANNEL.to_owned(),
    };
    client
        .get_retention(member.request(request))
        .await
        .map(tonic::Response::into_inner)
}

/// `n` application messages of `member`'s; the last seq.
async fn chat(client: &mut RelayClient<Channel>, member: &Member, n: usize, size: usize) -> u64 {
    let mut last = 0;
    for i in 0..n {
        let mut payload = format!("message {i} ").into_bytes();
        payload.resize(size.max(payload.len()), b'.');
        let message = member.encrypt(CHANNEL, &payload);
        last = member.publish(client, CHANNEL, message).await.unwrap().seq;
    }
    last
}

async fn prune(relay: &Relay) -> PassReport {
    relay.server().prune_now().await.unwrap()
}

fn pruned_text(horizon: u64, position: &str) -> String {
    format!(
        "channel '{CHANNEL}': its log up to seq {horizon} was pruned by its retention policy, so \
         it cannot be read {position}: a member this far behind must be added to the group \
         again (a new Welcome)"
    )
}

/// Max entries: the oldest go, the horizon moves, and every read from before it is
/// OUT_OF_RANGE with the horizon in its trailer (Subscribe, SubscribeMany, from_epoch), while
/// reads from the horizon on get what is left, with no gap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_from_before_the_horizon_are_out_of_range() {
    let relay = relay(|_| {}).await;
    let mut client = relay.client().await;
    let alice = Member::with_token("alice", "acme.k1");
    alice.create(&mut client, CHANNEL).await;
    assert_eq!(chat(&mut client, &alice, 20, 10).await, 20);

    // Nothing to do before a policy.
    assert_eq!(prune(&relay).await, PassReport::default());
    let set = set_retention(&mut client, &alice, policy(None, Some(5), None))
        .await
        .unwrap();
    assert_eq!(set.channel_policy, Some(policy(None, Some(5), None)));
    assert_eq!((set.horizon_seq, set.head_seq), (0, 20));
    let report = prune(&relay).await;
    assert_eq!((report.entries, report.channels), (15, 1));
    let got = get_retention(&mut client, &alice).await.unwrap();
    assert_eq!((got.horizon_seq, got.head_seq), (15, 20));
    assert_eq!(got.effective, Some(policy(None, Some(5), None)));

    for after in [0, 14] {
        let Err(status) = alice.subscribe(&mut client, CHANNEL, after).await else {
            panic!("a subscription after seq {after} was accepted");
        };
        assert_status(
            &status,
            Code::OutOfRange,
            &pruned_text(15, &format!("after seq {after}")),
        );
        assert_eq!(
            trailer(&status, "static-horizon-seq").as_deref(),
            Some("15")
        );
    }
    let from_epoch = pb::SubscribeRequest {
        channel: CHANNEL.to_owned(),
        start: Some(pb::subscribe_request::Start::FromEpoch(0)),
        max_batch: 0,
    };
    let Err(status) = client.subscribe(alice.request(from_epoch.clone())).await else {
        panic!("a subscription from a pruned epoch was accepted");
    };
    assert_status(&status, Code::OutOfRange, &pruned_text(15, "from epoch 0"));

    let mut from_horizon = alice.subscribe(&mut client, CHANNEL, 15).await.unwrap();
    from_horizon.wait_for(5).await;
    assert_eq!(from_horizon.seqs(), [16, 17, 18, 19, 20]);

    let mut many = Many::open(&mut client, Some("acme.k1")).await;
    many.add(subscribe_request(CHANNEL, 3));
    let ended = many.answer(CHANNEL, 1).await.unwrap_err();
    assert_eq!(ended.horizon_seq, 15);
    assert_refusal(
        Err(ended),
        Code::OutOfRange,
        &pruned_text(15, "after seq 3"),
    );
    many.add(from_epoch);
    assert_eq!(many.answer(CHANNEL, 2).await.unwrap_err().horizon_seq, 15);
    // The stream itself goes on: a follow from the horizon is served.
    many.add(subscribe_request(CHANNEL, 15));
    assert_eq!(many.answer(CHANNEL, 3).await.unwrap(), 20);
    assert_eq!(many.wait_for(CHANNEL, 5).await, [16, 17, 18, 19, 20]);

    // A second pass has nothing left to do; new entries push the horizon on.
    assert_eq!(prune(&relay).await.entries, 0);
    chat(&mut client, &alice, 3, 10).await;
    assert_eq!(prune(&relay).await.entries, 3);
    assert_eq!(
        get_retention(&mut client, &alice)
            .await
            .unwrap()
            .horizon_seq,
        18
    );
}

/// A follow that pruning overtakes (a reader that stopped reading, far behind) gets what was
/// already on its way, in order, then `ended` OUT_OF_RANGE: never a gap, never a hang.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follow_overtaken_by_pruning_ends_out_of_range() {
    let relay = relay(|_| {}).await;
    let mut client = relay.client().await;
    let alice = Member::with_token("alice", "acme.k1");
    alice.create(&mut client, CHANNEL).await;
    // 4 MiB of entries: more than the flow-control windows and the relay's queue hold.
    let messages: Vec<pb::PublishRequest> = (0..4000)
        .map(|i| {
            let mut payload = format!("m{i} ").into_bytes();
            payload.resize(1000, b'.');
            // Hand-framed: the relay never reads the ciphertext.
            request(CHANNEL, application(CHANNEL, 0, &payload))
        })
        .collect();
    let batches: Vec<pb::PublishBatchRequest> = messages
        .chunks(1000)
        .map(|chunk| pb::PublishBatchRequest {
            requests: chunk.to_vec(),
        })
        .collect();
    let mut answers = client
        .publish_batches(alice.request(tokio_stream::iter(batches)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(all_answers(&mut answers).await.len(), 4);
    let mut many = Many::open(&mut client, Some("acme.k1")).await;
    many.add(subscribe_request(CHANNEL, 0));
    assert_eq!(many.live(CHANNEL).await, 4000);
    // Not read meanwhile: the relay's sends wait.
    tokio::time::sleep(Duration::from_millis(300)).await;
    set_retention(&mut client, &alice, policy(None, Some(10), None))
        .await
        .unwrap();
    assert_eq!(prune(&relay).await.entries, 3990);
    let ended = many.answer(CHANNEL, 2).await.unwrap_err();
    assert_eq!(ended.horizon_seq, 3990);
    let seqs = many.seqs(CHANNEL);
    assert!(seqs.len() < 3990, "{} entries came", seqs.len());
    assert_eq!(seqs, (1..=seqs.len() as u64).collect::<Vec<_>>());
}

/// Max bytes keeps the newest entries that fit; max age drops what is older (one second
/// here); the server's default applies where the channel sets nothing, and 0 lifts a limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_age_and_the_server_default() {
    let relay = relay(|c| {
        c.retention_max_entries = 100;
    })
    .await;
    let mut client = relay.client().await;
    let alice = Member::with_token("alice", "acme.k1");
    alice.create(&mut client, CHANNEL).await;
    chat(&mut client, &alice, 10, 1000).await;
    let got = get_retention(&mut client, &alice).await.unwrap();
    assert_eq!(got.channel_policy, Some(policy(None, None, None)));
    assert_eq!(got.effective, Some(policy(None, Some(100), None)));
    assert_eq!(prune(&relay).await.entries, 0);

    // Each entry is a bit over 1,000 bytes: 3,500 bytes keep the newest three.
    set_retention(&mut client, &alice, policy(None, None, Some(3500)))
        .await
        .unwrap();
    assert_eq!(prune(&relay).await.entries, 7);
    assert_eq!(
        get_retention(&mut client, &alice)
            .await
            .unwrap()
            .horizon_seq,
        7
    );

    // An age: what is older than a second goes, the rest stays.
    set_retention(&mut client, &alice, policy(Some(1), Some(0), None))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(1100)).await;
    chat(&mut client, &alice, 2, 10).await;
    assert_eq!(prune(&relay).await.entries, 3);
    let got = get_retention(&mut client, &alice).await.unwrap();
    assert_eq!((got.horizon_seq, got.head_seq), (10, 12));
    assert_eq!(got.effective, Some(policy(Some(1), None, None)));
}

/// The commit of a Welcome nobody used yet stays, and what follows it (the joiner reads from
/// there); once its joiner bound its leaf (used) or once it expired (TTL), pruning goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_welcome_holds_the_log_until_it_is_used() {
    let relay = relay(|_| {}).await;
    let mut client = relay.client().await;
    let alice = Member::with_token("alice", "acme.k1");
    let bob = Member::with_token("bob", "bobco.k1");
    alice.create(&mut client, CHANNEL).await;
    chat(&mut client, &alice, 5, 10).await;
    let (commit, _, welcome) = alice.add_unjoined(&mut client, CHANNEL, &[&bob]).await;
    assert_eq!(commit.seq, 6);
    chat(&mut client, &alice, 5, 10).await;
    set_retention(&mut client, &alice, policy(None, Some(1), None))
        .await
        .unwrap();

    // The Welcome's commit (seq 6) and everything after it stay.
    assert_eq!(prune(&relay).await.entries, 6);
    assert_eq!(
        get_retention(&mut client, &alice)
            .await
            .unwrap()
            .horizon_seq,
        6
    );
    assert_eq!(prune(&relay).await.entries, 0);

    // Bob joins from it, binds, reads from his epoch: all there.
    bob.join(&mut client, CHANNEL, &welcome).await;
    let from_epoch = pb::SubscribeRequest {
        channel: CHANNEL.to_owned(),
        start: Some(pb::subscribe_request::Start::FromEpoch(1)),
        max_batch: 0,
    };
    let stream = client.subscribe(bob.request(from_epoch)).await.unwrap();
    let mut bobs = Subscription::of(stream.into_inner());
    bobs.wait_for(5).await;
    assert_eq!(bobs.seqs(), [7, 8, 9, 10, 11]);
    // Used: gone at the next pass (no grace here), and the log with it.
    tokio::time::sleep(Duration::from_millis(5)).await;
    let report = prune(&relay).await;
    assert_eq!((report.welcomes, report.entries), (1, 4));
    assert_welcome_gone(&mut client, &alice, &welcome).await;

    // The group goes on over its pruned past: a commit, messages, a new member.
    let (answer, _) = alice.commit(&mut client, CHANNEL).await;
    assert_eq!((answer.seq, answer.epoch), (12, 2));
    bob.apply(CHANNEL, &bobs_commit(&mut client, &bob, 11).await);
    let carol = Member::with_token("carol", "carolco.k1");
    let (added, _, _) = alice.add(&mut client, CHANNEL, &[&carol]).await;
    assert_eq!(added.epoch, 3);
    let hello = carol.encrypt(CHANNEL, b"hello from carol");
    assert_eq!(
        carol
            .publish(&mut client, CHANNEL, hello)
            .await
            .unwrap()
            .seq,
        14
    );
}

/// The commit after `after` as `member` reads it.
async fn bobs_commit(client: &mut RelayClient<Channel>, member: &Member, after: u64) -> Bytes {
    let mut stream = member.subscribe(client, CHANNEL, after).await.unwrap();
    stream.wait_for(1).await[0].message.clone()
}

/// `welcome` is no longer fetched by its digest: it expired.
async fn assert_welcome_gone(client: &mut RelayClient<Channel>, member: &Member, welcome: &[u8]) {
    let digest = pb::fetch_welcome_request::Key::WelcomeSha256(sha256(welcome).into());
    let gone = member
        .fetch_welcome(client, CHANNEL, digest)
        .await
        .unwrap_err();
    assert_eq!(gone.code(), Code::NotFound);
}

fn sha256(bytes: &[u8]) -> Vec<u8> {
    use sha2::Digest as _;
    sha2::Sha256::digest(bytes).to_vec()
}

/// A Welcome's TTL: once past, it goes (and no longer holds the log), used or not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn welcomes_expire_after_their_ttl() {
    let relay = relay(|c| c.welcome_ttl = Duration::from_millis(300)).await;
    let mut client = relay.client().await;
    let alice = Member::with_token("alice", "acme.k1");
    let bob = Member::with_token("bob", "bobco.k1");
    alice.create(&mut client, CHANNEL).await;
    let (_, _, welcome) = alice.add_unjoined(&mut client, CHANNEL, &[&bob]).await;
    chat(&mut client, &alice, 4, 10).await;
    set_retention(&mut client, &alice, policy(None, Some(1), None))
        .await
        .unwrap();
    // Up to the Welcome's commit (seq 1), not after it.
    assert_eq!(prune(&relay).await.entries, 1);
    tokio::time::sleep(Duration::from_millis(400)).await;
    let report = prune(&relay).await;
    assert_eq!((report.welcomes, report.entries), (1, 3));
    assert_welcome_gone(&mut client, &alice, &welcome).await;
}

/// Within the idempotency window nothing is pruned, so a retry gets its original seq; with no
/// window, a retry of a pruned entry is a new publish (documented).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idempotency_is_exact_within_the_window() {
    let relay = relay(|c| c.idempotency_window = Duration::from_secs(600)).await;
    let mut client = relay.client().await;
    let alice = Member::with_token("alice", "acme.k1");
    alice.create(&mut client, CHANNEL).await;
    let first = alice.encrypt(CHANNEL, b"first");
    assert_eq!(
        alice
            .publish(&mut client, CHANNEL, first.clone())
            .await
            .unwrap()
            .seq,
        1
    );
    chat(&mut client, &alice, 4, 10).await;
    set_retention(&mut client, &alice, policy(None, Some(1), None))
        .await
        .unwrap();
    assert_eq!(prune(&relay).await.entries, 0);
    let retry = alice.publish(&mut client, CHANNEL, first).await.unwrap();
    assert_eq!((retry.seq, retry.duplicate), (1, true));

    let relay = self::relay(|_| {}).await;
    let mut client = relay.client().await;
    let alice = Member::with_token("alice", "acme.k1");
    alice.create(&mut client, CHANNEL).await;
    let first = alice.encrypt(CHANNEL, b"first");
    alice
        .publish(&mut client, CHANNEL, first.clone())
        .await
        .unwrap();
    chat(&mut client, &alice, 4, 10).await;
    set_retention(&mut client, &alice, policy(None, Some(1), None))
        .await
        .unwrap();
    assert_eq!(prune(&relay).await.entries, 4);
    let retry = alice.publish(&mut client, CHANNEL, first).await.unwrap();
    assert_eq!((retry.seq, retry.duplicate), (6, false));
}

/// Only the org's owner sets a channel's retention; members (and the owner) read it; anyone
/// else is refused before anything is written; out-of-range limits are INVALID_ARGUMENT.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_org_owner_sets_retention() {
    let relay = relay(|_| {}).await;
    let mut client = relay.client().await;
    let alice = Member::with_token("alice", "acme.k1");
    let bob = Member::with_token("bob", "bobco.k1");
    let mallory = Member::with_token("mallory", "evil.k1");
    group_of(&mut client, CHANNEL, &[&alice, &bob]).await;

    let owner_only =
        format!("only the account owning the org of channel '{CHANNEL}' may set its retention");
    for caller in [&bob, &mallory] {
        let refused = set_retention(&mut client, caller, policy(None, Some(1), None))
            .await
            .unwrap_err();
        assert_status(&refused, Code::PermissionDenied, &owner_only);
    }
    // A member reads it; an outsider does not.
    assert_eq!(
        get_retention(&mut client, &bob)
            .await
            .unwrap()
            .channel_policy,
        Some(policy(None, None, None))
    );
    let refused = get_retention(&mut client, &mallory).await.unwrap_err();
    assert_status(&refused, Code::PermissionDenied, &owner_only);
    // Another key of the owner's account may.
    let alice2 = Member::with_token("alice", "acme.k2");
    set_retention(&mut client, &alice2, policy(Some(3600), None, None))
        .await
        .unwrap();
    let too_old = set_retention(&mut client, &alice, policy(Some(u64::MAX), None, None))
        .await
        .unwrap_err();
    assert_eq!(too_old.code(), Code::InvalidArgument);
    let too_many = set_retention(&mut client, &alice, policy(None, Some(u64::MAX), None))
        .await
        .unwrap_err();
    assert_eq!(too_many.code(), Code::InvalidArgument);
    assert_eq!(
        get_retention(&mut client, &alice)
            .await
            .unwrap()
            .channel_policy,
        Some(policy(Some(3600), None, None))
    );
    // A channel that does not exist.
    let request = pb::GetRetentionRequest {
        channel: "acme/agents/none".to_owned(),
    };
    let missing = client
        .get_retention(alice.request(request))
        .await
        .unwrap_err();
    assert_eq!(missing.code(), Code::NotFound);
}

/// The background pruner runs every `prune_interval` and stops with the relay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pruner_runs_in_the_background_and_stops_with_the_relay() {
    let mut relay = relay(|c| c.prune_interval = Duration::from_millis(50)).await;
    let mut client = relay.client().await;
    let alice = Member::with_token("alice", "acme.k1");
    alice.create(&mut client, CHANNEL).await;
    chat(&mut client, &alice, 10, 10).await;
    set_retention(&mut client, &alice, policy(None, Some(2), None))
        .await
        .unwrap();
    within("the background pruner", async {
        while get_retention(&mut client, &alice)
            .await
            .unwrap()
            .horizon_seq
            != 8
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    within("the shutdown", relay.shutdown()).await;
}
