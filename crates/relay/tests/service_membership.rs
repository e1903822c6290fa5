//! Membership (proto/relay.proto, "Membership"; docs/design.md §5.2): access follows the leaves
//! bound to an account, handshakes are checked against the channel's group, names are global
//! and orgs owned. Each test fails if its rule were not enforced. Members are real (static-mls
//! engines, or OpenMLS clients for what the engine refuses to do); tokens are [`FakeVerify`]'s
//! (`account.key`).
#![allow(clippy::unwrap_used)]

mod service_support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use openmls::prelude::{MIXED_CIPHERTEXT_WIRE_FORMAT_POLICY, MIXED_PLAINTEXT_WIRE_FORMAT_POLICY};
use sha2::{Digest, Sha256};
use static_mls::Incoming;
use static_relay::pb::relay_client::RelayClient;
use static_relay::pb::{self, fetch_welcome_request::Key, publish_result::Outcome};
use static_relay::wire::framing::{parse_message, ContentType, PRIVATE_MESSAGE};
use tonic::transport::Channel;
use tonic::{Code, Status};

use service_support::*;

/// A relay that checks tokens.
async fn relay() -> Relay {
    Relay::start_with(|_| {}, Some(Arc::new(FakeVerify))).await
}

/// `message` applied by `member`: the payload of an application message.
#[track_caller]
fn decrypted(member: &Member, message: &[u8]) -> Vec<u8> {
    match member.apply(CHANNEL, message) {
        Incoming::Application { payload, .. } => payload,
        other => panic!("not an application message: {other:?}"),
    }
}

/// (leaf, identity, account) of each member, as ListMembers has them.
fn roster(list: &pb::ListMembersResponse) -> Vec<(u32, String, String)> {
    list.members
        .iter()
        .map(|m| {
            let identity = String::from_utf8(m.identity.to_vec()).unwrap();
            (m.leaf_index, identity, m.account.clone())
        })
        .collect()
}

fn entry(leaf: u32, identity: &str, account: &str) -> (u32, String, String) {
    (leaf, identity.to_owned(), account.to_owned())
}

#[track_caller]
fn assert_denied(status: &Status) {
    assert_status(status, Code::PermissionDenied, &not_a_member(CHANNEL));
}

fn from_epoch(epoch: u64) -> pb::SubscribeRequest {
    pb::SubscribeRequest {
        channel: CHANNEL.into(),
        start: Some(pb::subscribe_request::Start::FromEpoch(epoch)),
        max_batch: 0,
    }
}

/// Alice (account acme) adds bob (account bobco): bob joins from the Welcome and has no access
/// until he binds his leaf; then he reads, publishes, fetches his Welcome, lists the members
/// (both accounts) and commits like alice.
/// The Welcome of a refused commit was not kept: the relay answers NOT_FOUND for it.
async fn assert_welcome_not_kept(
    client: &mut RelayClient<Channel>,
    member: &Member,
    welcome: &[u8],
) {
    let digest = Key::WelcomeSha256(Sha256::digest(welcome).to_vec().into());
    let kept = member
        .fetch_welcome(client, CHANNEL, digest)
        .await
        .unwrap_err();
    assert_eq!(kept.code(), Code::NotFound);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_of_another_account_joins_by_welcome_and_binding() {
    let relay = relay().await;
    let mut client = relay.client().await;
    let alice = Member::with_token("alice", "acme.k1");
    let bob = Member::with_token("bob", "bobco.k1");
    alice.create(&mut client, CHANNEL).await;
    let bob_kp = bob.key_package();
    let added = alice.engine.add_member(CHANNEL, &bob_kp).unwrap();
    let with_welcome = pb::PublishRequest {
        welcome: added.welcome.clone().into(),
        ..request(CHANNEL, added.commit.clone().into())
    };
    let add = client
        .publish(alice.request(with_welcome))
        .await
        .unwrap()
        .into_inner();
    assert_eq!((add.seq, add.epoch), (1, 1));
    alice.engine.merge_pending_commit(CHANNEL).unwrap();
    bob.engine.join_group(CHANNEL, &added.welcome).unwrap();

    // Joined, not bound yet: his account reaches nothing.
    assert_denied(&bob.subscribe(&mut client, CHANNEL, 0).await.unwrap_err());
    assert_denied(&bob.list_members(&mut client, CHANNEL).await.unwrap_err());
    let hello = bob.encrypt(CHANNEL, b"too early");
    assert_denied(&bob.publish(&mut client, CHANNEL, hello).await.unwrap_err());
    let bound = bob.bind(&mut client, CHANNEL).await.unwrap();
    assert_eq!(bound.epoch, 1);

    for member in [&alice, &bob] {
        let list = member.list_members(&mut client, CHANNEL).await.unwrap();
        assert_eq!(list.epoch, 1);
        assert_eq!(
            roster(&list),
            [entry(0, "alice", "acme"), entry(1, "bob", "bobco")]
        );
        assert_eq!(
            list.members[1].signature_key,
            bob.engine.signature_public_key()
        );
    }
    let mut alices = alice.subscribe(&mut client, CHANNEL, 1).await.unwrap();
    let mut bobs = Subscription::of(
        client
            .subscribe(bob.request(from_epoch(1)))
            .await
            .unwrap()
            .into_inner(),
    );
    alices.wait_keepalives(1).await;
    bobs.wait_keepalives(1).await;
    let from_bob = bob.encrypt(CHANNEL, b"hello from bobco");
    assert_eq!(
        bob.publish(&mut client, CHANNEL, from_bob.clone())
            .await
            .unwrap()
            .seq,
        2
    );
    let from_alice = alice.encrypt(CHANNEL, b"hello from acme");
    alice
        .publish(&mut client, CHANNEL, from_alice.clone())
        .await
        .unwrap();
    alices.wait_for(2).await;
    bobs.wait_for(2).await;
    // Each entry names the account that published it, as the relay authenticated it.
    let accounts = |s: &Subscription| -> Vec<(u64, String)> {
        s.entries
            .iter()
            .map(|e| (e.seq, e.account.clone()))
            .collect()
    };
    let expected = [(2, "bobco".to_owned()), (3, "acme".to_owned())];
    assert_eq!(accounts(&alices), expected);
    assert_eq!(accounts(&bobs), expected);
    assert_eq!(
        decrypted(&alice, &alices.entries[0].message),
        b"hello from bobco"
    );
    assert_eq!(
        decrypted(&bob, &bobs.entries[1].message),
        b"hello from acme"
    );

    let mut many = Many::open(&mut client, Some("bobco.k1")).await;
    many.add(subscribe_request(CHANNEL, 0));
    assert_eq!(many.live(CHANNEL).await, 3);
    assert_eq!(many.wait_for(CHANNEL, 3).await, [1, 2, 3]);
    let key = Key::KeyPackageRef(key_package_ref(&bob_kp).into());
    let welcome = bob.fetch_welcome(&mut client, CHANNEL, key).await.unwrap();
    assert_eq!(
        (welcome.welcome.to_vec(), welcome.commit_seq, welcome.epoch),
        (added.welcome, 1, 1)
    );
    // He commits as any member does.
    let (committed, commit) = bob.commit(&mut client, CHANNEL).await;
    assert_eq!((committed.seq, committed.epoch), (4, 2));
    assert!(matches!(
        alice.apply(CHANNEL, &commit),
        Incoming::Commit { epoch: 2, .. }
    ));
}

/// An account with no leaf in the group is refused every call that reaches the channel (the
/// name is found: PERMISSION_DENIED, not NOT_FOUND), and may not create under its org.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outsider_account_is_refused_everything() {
    let relay = relay().await;
    let mut client = relay.client().await;
    let alice = Member::with_token("alice", "acme.k1");
    let carol = Member::with_token("carol", "acme.k2");
    let welcome = group_of(&mut client, CHANNEL, &[&alice, &carol])
        .await
        .unwrap();
    let hello = alice.encrypt(CHANNEL, b"members only");
    alice.publish(&mut client, CHANNEL, hello).await.unwrap();
    let outsider = "evil.k1";
    let app = application(CHANNEL, 1, b"x");

    assert_denied(
        &client
            .publish(authed(request(CHANNEL, app.clone()), outsider))
            .await
            .unwrap_err(),
    );
    // A commit of a look-alike group (same group id, at the channel's epoch) is not even
    // looked at.
    let mut mallory = RawMember::new("mallory");
    mallory.create_look_alike(CHANNEL);
    mallory.self_update(true);
    let forged = mallory.self_update(false);
    assert_denied(
        &client
            .publish(authed(request(CHANNEL, forged), outsider))
            .await
            .unwrap_err(),
    );
    let mut answers = client
        .publish_stream(authed(
            tokio_stream::iter(vec![request(CHANNEL, app.clone())]),
            outsider,
        ))
        .await
        .unwrap()
        .into_inner();
    assert_denied(&next_answer(&mut answers).await.unwrap_err());
    let batch = pb::PublishBatchRequest {
        requests: vec![request(CHANNEL, app.clone())],
    };
    let mut answers = client
        .publish_batches(authed(tokio_stream::iter(vec![batch]), outsider))
        .await
        .unwrap()
        .into_inner();
    let answer = next_answer(&mut answers).await.unwrap().unwrap();
    match &answer.results[0].outcome {
        Some(Outcome::Refused(r)) => assert_eq!(
            (Code::from(r.code as i32), r.message.clone()),
            (Code::PermissionDenied, not_a_member(CHANNEL))
        ),
        other => panic!("{other:?}"),
    }
    for start in [subscribe_request(CHANNEL, 0), from_epoch(1)] {
        assert_denied(&client.subscribe(authed(start, outsider)).await.unwrap_err());
    }
    let mut many = Many::open(&mut client, Some(outsider)).await;
    many.add(subscribe_request(CHANNEL, 0));
    assert_refusal(
        many.answer(CHANNEL, 1).await,
        Code::PermissionDenied,
        &not_a_member(CHANNEL),
    );
    let evil = Member::with_token("mallory", outsider);
    let digest = Key::WelcomeSha256(Sha256::digest(&welcome).to_vec().into());
    assert_denied(
        &evil
            .fetch_welcome(&mut client, CHANNEL, digest.clone())
            .await
            .unwrap_err(),
    );
    // (A member fetches it.)
    carol
        .fetch_welcome(&mut client, CHANNEL, digest)
        .await
        .unwrap();
    assert_denied(&evil.list_members(&mut client, CHANNEL).await.unwrap_err());
    // Binding its way in fails: its own key is no leaf's, and a captured binding names the
    // account that made it.
    let bad_binding = "the leaf binding does not verify for leaf 0 and this account";
    let own = mallory.binding(CHANNEL, "evil");
    let refused = evil
        .send_binding(&mut client, CHANNEL, own)
        .await
        .unwrap_err();
    assert_status(&refused, Code::PermissionDenied, bad_binding);
    let captured = alice.binding(CHANNEL);
    let refused = evil
        .send_binding(&mut client, CHANNEL, captured)
        .await
        .unwrap_err();
    assert_status(&refused, Code::PermissionDenied, bad_binding);
    assert_denied(&evil.list_members(&mut client, CHANNEL).await.unwrap_err());
    // The org is acme's: neither the name nor another under it.
    for name in [CHANNEL, "acme/agents/other"] {
        let refused = evil.try_create(&mut client, name).await.unwrap_err();
        assert_status(
            &refused,
            Code::PermissionDenied,
            "org 'acme' belongs to another account",
        );
    }
    // Nothing of it reached the log or the group.
    let mut log = alice.subscribe(&mut client, CHANNEL, 0).await.unwrap();
    log.wait_for(2).await;
    log.wait_keepalives(2).await;
    assert_eq!(log.seqs(), [1, 2]);
    let list = alice.list_members(&mut client, CHANNEL).await.unwrap();
    assert_eq!(list.epoch, 1);
    assert_eq!(
        roster(&list),
        [entry(0, "alice", "acme"), entry(1, "carol", "acme")]
    );
}

/// A key of a member account, without any member's signature key: its commits (a look-alike
/// group's, at the channel's epoch) are PERMISSION_DENIED and move nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_commit_is_refused_and_moves_nothing() {
    let relay = relay().await;
    let mut client = relay.client().await;
    let alice = Member::with_token("alice", "acme.k1");
    let bob = Member::with_token("bob", "bobco.k1");
    group_of(&mut client, CHANNEL, &[&alice, &bob]).await;
    let stolen = "acme.stolen";

    // Signed as leaf 0 (alice's) by another key.
    let mut mallory = RawMember::new("alice");
    mallory.create_look_alike(CHANNEL);
    mallory.self_update(true);
    assert_eq!((mallory.epoch(), mallory.leaf_index()), (1, 0));
    let forged = mallory.self_update(false);
    let refused = client
        .publish(authed(request(CHANNEL, forged), stolen))
        .await
        .unwrap_err();
    assert_status(
        &refused,
        Code::PermissionDenied,
        "the commit's signature does not verify",
    );
    // Sent as leaf 2, which the group does not have; with a Welcome, which is not kept.
    let mut creator = RawMember::new("x");
    creator.create_look_alike(CHANNEL);
    let (mut y, mut mallory) = (RawMember::new("y"), RawMember::new("mallory"));
    let (_, welcome) = creator.add(&[&y.key_package(), &mallory.key_package()]);
    y.join(&welcome, MIXED_PLAINTEXT_WIRE_FORMAT_POLICY);
    mallory.join(&welcome, MIXED_PLAINTEXT_WIRE_FORMAT_POLICY);
    assert_eq!((mallory.epoch(), mallory.leaf_index()), (1, 2));
    let (forged, forged_welcome) = mallory.add(&[&RawMember::new("z").key_package()]);
    let with_welcome = pb::PublishRequest {
        welcome: forged_welcome.clone(),
        ..request(CHANNEL, forged)
    };
    let refused = client
        .publish(authed(with_welcome, stolen))
        .await
        .unwrap_err();
    assert_status(
        &refused,
        Code::PermissionDenied,
        "the sender is not a member of the group at epoch 1",
    );
    assert_welcome_not_kept(&mut client, &alice, &forged_welcome).await;

    // The epoch did not move: a member's commit at epoch 1 is the one that starts epoch 2.
    assert_eq!(epoch_of(&mut client, &alice, CHANNEL).await, 1);
    let (won, commit) = alice.commit(&mut client, CHANNEL).await;
    assert_eq!((won.seq, won.epoch), (2, 2));
    bob.apply(CHANNEL, &commit);
    // Brought to the new epoch, still forged.
    let mut mallory = RawMember::new("alice");
    mallory.create_look_alike(CHANNEL);
    mallory.self_update(true);
    mallory.self_update(true);
    let forged = mallory.self_update(false);
    let refused = client
        .publish(authed(request(CHANNEL, forged), stolen))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied);
    let mut log = alice.subscribe(&mut client, CHANNEL, 0).await.unwrap();
    log.wait_for(2).await;
    log.wait_keepalives(2).await;
    assert_eq!(log.seqs(), [1, 2]);
}

/// The attack of the issue: a member whose client encrypts its handshakes (or who frames a
/// PrivateMessage commit by hand) sends commits the relay cannot read, at the current epoch
/// and the next. Each is INVALID_ARGUMENT and none moves the epoch (before, the fence took the
/// first at the current epoch and the channel was on an epoch no member had); the members go
/// on committing and sending.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn private_message_handshakes_are_refused_and_move_nothing() {
    let relay = relay().await;
    let mut client = relay.client().await;
    let alice = Member::with_token("alice", "acme.k1");
    let bob = Member::with_token("bob", "bobco.k1");
    let mut carol = RawMember::new("carol");
    alice.create(&mut client, CHANNEL).await;
    let (bob_kp, carol_kp) = (bob.key_package(), carol.key_package());
    let added = alice
        .engine
        .add_members(CHANNEL, &[&bob_kp, &carol_kp])
        .unwrap();
    let with_welcome = pb::PublishRequest {
        welcome: added.welcome.clone().into(),
        ..request(CHANNEL, added.commit.into())
    };
    client.publish(alice.request(with_welcome)).await.unwrap();
    alice.engine.merge_pending_commit(CHANNEL).unwrap();
    bob.join(&mut client, CHANNEL, &added.welcome).await;
    carol.join(&added.welcome, MIXED_CIPHERTEXT_WIRE_FORMAT_POLICY);
    let carols = "carolco.k1";
    let bind = pb::BindLeafRequest {
        channel: CHANNEL.into(),
        binding: Some(carol.binding(CHANNEL, "carolco")),
    };
    client.bind_leaf(authed(bind, carols)).await.unwrap();

    // Three at epoch 1, three at epoch 2 (her own view, after merging one of hers), two framed
    // by hand.
    let mut attack = Vec::new();
    for _ in 0..3 {
        attack.push(carol.self_update(false));
        carol.clear();
    }
    carol.self_update(true);
    for _ in 0..3 {
        attack.push(carol.self_update(false));
        carol.clear();
    }
    attack.push(private_message(CHANNEL, 1, COMMIT, b"sealed"));
    attack.push(private_message(CHANNEL, 2, COMMIT, b"sealed"));
    let framing: Vec<_> = attack
        .iter()
        .map(|m| {
            let header = parse_message(m).unwrap();
            (header.wire_format, header.content_type, header.epoch)
        })
        .collect();
    let commit_at = |epoch| (PRIVATE_MESSAGE, ContentType::Commit, epoch);
    assert_eq!(
        framing,
        [1, 1, 1, 2, 2, 2, 1, 2].map(commit_at),
        "PrivateMessage commits at epochs 1 and 2"
    );
    let not_public = "handshake messages (commits and proposals) must be PublicMessages";
    for message in &attack {
        let refused = client
            .publish(authed(request(CHANNEL, message.clone()), carols))
            .await
            .unwrap_err();
        assert_status(&refused, Code::InvalidArgument, not_public);
    }
    // All at once, in one batch.
    let batch = pb::PublishBatchRequest {
        requests: attack.iter().map(|m| request(CHANNEL, m.clone())).collect(),
    };
    let mut answers = client
        .publish_batches(authed(tokio_stream::iter(vec![batch]), carols))
        .await
        .unwrap()
        .into_inner();
    let answer = next_answer(&mut answers).await.unwrap().unwrap();
    assert_eq!(answer.results.len(), 8);
    for result in &answer.results {
        match &result.outcome {
            Some(Outcome::Refused(r)) => assert_eq!(
                (Code::from(r.code as i32), r.message.as_str()),
                (Code::InvalidArgument, not_public)
            ),
            other => panic!("{other:?}"),
        }
    }
    // The other half of the rule: application messages must be PrivateMessages.
    let refused = alice
        .publish(
            &mut client,
            CHANNEL,
            public_message(CHANNEL, 1, APPLICATION, b"in the clear"),
        )
        .await
        .unwrap_err();
    assert_status(
        &refused,
        Code::InvalidArgument,
        "application messages must be PrivateMessages",
    );

    // Nothing moved: epoch 1, only the add in the log; the members commit and send.
    assert_eq!(epoch_of(&mut client, &alice, CHANNEL).await, 1);
    let (won, commit) = alice.commit(&mut client, CHANNEL).await;
    assert_eq!((won.seq, won.epoch), (2, 2));
    bob.apply(CHANNEL, &commit);
    let message = bob.encrypt(CHANNEL, b"still talking");
    assert_eq!(
        bob.publish(&mut client, CHANNEL, message.clone())
            .await
            .unwrap()
            .seq,
        3
    );
    assert_eq!(decrypted(&alice, &message), b"still talking");
    let mut log = alice.subscribe(&mut client, CHANNEL, 0).await.unwrap();
    log.wait_for(3).await;
    log.wait_keepalives(2).await;
    assert_eq!(log.seqs(), [1, 2, 3]);
}

/// A commit removing an account's only leaf ends its access: its live streams get the entries
/// up to that commit (its client learns of the removal) and then end with PERMISSION_DENIED,
/// at once; its publishes are refused. An account that keeps another leaf keeps its access.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removal_ends_access() {
    // Keep-alives far apart: nothing but the commit wakes the streams.
    let relay = Relay::start_with(
        |c| c.keepalive_interval = Duration::from_secs(60),
        Some(Arc::new(FakeVerify)),
    )
    .await;
    let mut client = relay.client().await;
    let alice = Member::with_token("alice", "acme.k1");
    let bob = Member::with_token("bob", "bobco.k1");
    let carol = Member::with_token("carol", "acme.k2");
    group_of(&mut client, CHANNEL, &[&alice, &bob, &carol]).await;
    let mut bobs = bob.subscribe(&mut client, CHANNEL, 0).await.unwrap();
    bobs.wait_keepalives(1).await;
    let mut bobs_many = Many::open(&mut client, Some("bobco.k1")).await;
    bobs_many.add(subscribe_request(CHANNEL, 0));
    assert_eq!(bobs_many.live(CHANNEL).await, 1);
    let mut carols = carol.subscribe(&mut client, CHANNEL, 0).await.unwrap();
    carols.wait_keepalives(1).await;
    let hello = alice.encrypt(CHANNEL, b"before");
    alice
        .publish(&mut client, CHANNEL, hello.clone())
        .await
        .unwrap();
    bobs.wait_for(2).await;
    bobs_many.wait_for(CHANNEL, 2).await;

    // Carol's leaf goes; her account keeps alice's: her stream goes on.
    let removal = alice.remove(CHANNEL, "carol");
    let removed = alice
        .publish(&mut client, CHANNEL, removal.clone())
        .await
        .unwrap();
    assert_eq!((removed.seq, removed.epoch), (3, 2));
    alice.apply(CHANNEL, &removal);
    bob.apply(CHANNEL, &removal);
    carols.wait_for(3).await;

    // Bob's only leaf goes.
    let old_binding = bob.binding(CHANNEL);
    let removal = alice.remove(CHANNEL, "bob");
    let removed = alice
        .publish(&mut client, CHANNEL, removal.clone())
        .await
        .unwrap();
    let at = Instant::now();
    assert_eq!((removed.seq, removed.epoch), (4, 3));
    alice.apply(CHANNEL, &removal);
    assert_denied(&bobs.wait_end().await);
    assert!(at.elapsed() < Duration::from_secs(1), "{:?}", at.elapsed());
    assert_eq!(bobs.seqs(), [1, 2, 3, 4]);
    assert_eq!(bobs.entries[3].message, removal);
    let ended = tokio::time::timeout(Duration::from_secs(1), bobs_many.answer(CHANNEL, 2))
        .await
        .expect("the follow did not end within a second of the removal");
    assert_refusal(ended, Code::PermissionDenied, &not_a_member(CHANNEL));
    assert_eq!(bobs_many.seqs(CHANNEL), [1, 2, 3, 4]);
    // From those entries bob's client learns of its removal.
    assert_eq!(decrypted(&bob, &hello), b"before");
    assert!(matches!(
        bob.apply(CHANNEL, &removal),
        Incoming::Removed { epoch: 3, .. }
    ));

    // Refused from now on.
    let late = application(CHANNEL, 2, b"after");
    assert_denied(&bob.publish(&mut client, CHANNEL, late).await.unwrap_err());
    assert_denied(&bob.list_members(&mut client, CHANNEL).await.unwrap_err());
    let key = Key::WelcomeSha256(vec![0; 32].into());
    assert_denied(
        &bob.fetch_welcome(&mut client, CHANNEL, key)
            .await
            .unwrap_err(),
    );
    let mut again = bob.subscribe(&mut client, CHANNEL, 4).await.unwrap();
    assert_denied(&again.wait_end().await);
    assert!(again.entries.is_empty());
    // His old leaf is no more: binding it again gives nothing back.
    let refused = bob
        .send_binding(&mut client, CHANNEL, old_binding)
        .await
        .unwrap_err();
    assert_status(
        &refused,
        Code::PermissionDenied,
        "leaf 1 is not a member of the group at epoch 3",
    );
    // The others go on; nothing more reaches bob's ended streams.
    let after = alice.encrypt(CHANNEL, b"after");
    alice.publish(&mut client, CHANNEL, after).await.unwrap();
    carols.wait_for(5).await;
    assert_eq!(
        roster(&alice.list_members(&mut client, CHANNEL).await.unwrap()),
        [entry(0, "alice", "acme")]
    );
}

/// A departed member keeps its right to read up to its removal whoever takes its leaf index
/// later, across unloads and restarts: at 9b2be07 dave's binding overwrote bob's removed row,
/// and once the channel was read again from the store bob read nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_departed_member_reads_up_to_its_removal_after_its_leaf_is_reused() {
    let mut relay = relay().await;
    let mut client = relay.client().await;
    let alice = Member::with_token("alice", "acme.k1");
    let bob = Member::with_token("bob", "bobco.k1");
    let dave = Member::with_token("dave", "daveco.k1");
    reuse_a_departed_leaf(&mut client, CHANNEL, &alice, &bob, &dave).await;
    // In memory first, then read again from the store.
    assert_reads_up_to_its_removal(&mut client, CHANNEL, &bob).await;
    relay.unload_all().await;
    assert_reads_up_to_its_removal(&mut client, CHANNEL, &bob).await;

    relay.shutdown().await;
    let dir = std::mem::replace(&mut relay.dir, tempfile::tempdir().unwrap());
    let database = static_relay::Database::from(dir.path().join("static.db").as_path());
    let relay = Relay::on_database(database, dir, |_| {}, Some(Arc::new(FakeVerify))).await;
    let mut client = relay.client().await;
    assert_reads_up_to_its_removal(&mut client, CHANNEL, &bob).await;
    // Dave reads and publishes as the member he is.
    let hello = dave.encrypt(CHANNEL, b"dave here");
    assert_eq!(
        dave.publish(&mut client, CHANNEL, hello).await.unwrap().seq,
        5
    );
}

/// A member leaves: its Remove proposal, then a commit of it by reference (the relay finds the
/// proposal among those of the epoch). The commit ends the leaver's access as any removal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leave_committed_by_reference_ends_access() {
    let relay = relay().await;
    let mut client = relay.client().await;
    let alice = Member::with_token("alice", "acme.k1");
    let bob = Member::with_token("bob", "bobco.k1");
    group_of(&mut client, CHANNEL, &[&alice, &bob]).await;
    let proposal = bob.leave(CHANNEL);
    let proposed = bob
        .publish(&mut client, CHANNEL, proposal.clone())
        .await
        .unwrap();
    assert_eq!((proposed.seq, proposed.epoch), (2, 1));
    assert!(matches!(
        alice.apply(CHANNEL, &proposal),
        Incoming::Proposal { .. }
    ));
    let (committed, commit) = alice.commit_proposals(&mut client, CHANNEL).await;
    assert_eq!((committed.seq, committed.epoch), (3, 2));
    assert!(matches!(
        bob.apply(CHANNEL, &commit),
        Incoming::Removed { epoch: 2, .. }
    ));
    let late = application(CHANNEL, 2, b"gone");
    assert_denied(&bob.publish(&mut client, CHANNEL, late).await.unwrap_err());
    assert_eq!(
        roster(&alice.list_members(&mut client, CHANNEL).await.unwrap()),
        [entry(0, "alice", "acme")]
    );
}

/// A binding binds only when it is the leaf's, for the caller's account, over the leaf's
/// current key; anything else is PERMISSION_DENIED and gives no access. The same at
/// CreateChannel, which then creates nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leaf_bindings_must_verify() {
    let relay = relay().await;
    let mut client = relay.client().await;
    let alice = Member::with_token("alice", "acme.k1");
    let bob = Member::with_token("bob", "bobco.k1");
    alice.create(&mut client, CHANNEL).await;
    let added = alice
        .engine
        .add_member(CHANNEL, &bob.key_package())
        .unwrap();
    alice
        .publish(&mut client, CHANNEL, added.commit.into())
        .await
        .unwrap();
    alice.engine.merge_pending_commit(CHANNEL).unwrap();
    bob.engine.join_group(CHANNEL, &added.welcome).unwrap();

    let bad =
        |leaf: u32| format!("the leaf binding does not verify for leaf {leaf} and this account");
    // Made for another account (alice's).
    let for_acme = bob.binding_for(CHANNEL, "acme");
    let refused = bob
        .send_binding(&mut client, CHANNEL, for_acme.clone())
        .await
        .unwrap_err();
    assert_status(&refused, Code::PermissionDenied, &bad(1));
    // Bob's proof, claimed for alice's leaf.
    let good = bob.binding(CHANNEL);
    let wrong_leaf = pb::LeafBinding {
        leaf_index: 0,
        ..good.clone()
    };
    let refused = bob
        .send_binding(&mut client, CHANNEL, wrong_leaf)
        .await
        .unwrap_err();
    assert_status(&refused, Code::PermissionDenied, &bad(0));
    // A signature with a byte flipped, and a truncated one.
    let mut flipped = good.signature.to_vec();
    flipped[7] ^= 1;
    let truncated = good.signature[..32].to_vec();
    for signature in [flipped, truncated, Vec::new()] {
        let binding = pb::LeafBinding {
            signature: signature.into(),
            ..good.clone()
        };
        let refused = bob
            .send_binding(&mut client, CHANNEL, binding)
            .await
            .unwrap_err();
        assert_status(&refused, Code::PermissionDenied, &bad(1));
    }
    // Bob's valid proof replayed by another account.
    let evil = Member::with_token("mallory", "evil.k1");
    let refused = evil
        .send_binding(&mut client, CHANNEL, good.clone())
        .await
        .unwrap_err();
    assert_status(&refused, Code::PermissionDenied, &bad(1));
    // None of these gave bob's account access.
    assert_denied(&bob.subscribe(&mut client, CHANNEL, 0).await.unwrap_err());
    let missing = client
        .bind_leaf(bob.request(pb::BindLeafRequest {
            channel: CHANNEL.into(),
            binding: None,
        }))
        .await
        .unwrap_err();
    assert_status(&missing, Code::InvalidArgument, "binding is required");
    let unknown = bob
        .send_binding(&mut client, "acme/agents/none", good.clone())
        .await
        .unwrap_err();
    assert_eq!(unknown.code(), Code::NotFound);

    assert_eq!(
        bob.send_binding(&mut client, CHANNEL, good.clone())
            .await
            .unwrap()
            .epoch,
        1
    );
    bob.subscribe(&mut client, CHANNEL, 0).await.unwrap();
    // A proof names the leaf's encryption key: after bob's update the old one binds nothing.
    let (_, commit) = bob.commit(&mut client, CHANNEL).await;
    alice.apply(CHANNEL, &commit);
    let refused = bob
        .send_binding(&mut client, CHANNEL, good)
        .await
        .unwrap_err();
    assert_status(&refused, Code::PermissionDenied, &bad(1));
    assert_eq!(bob.bind(&mut client, CHANNEL).await.unwrap().epoch, 2);

    // CreateChannel: the creator's binding must verify too; a refused one creates nothing.
    let name = "acme/agents/other";
    let dave = Member::with_token("dave", "acme.k2");
    let mut request = dave.create_request(name);
    request.binding = Some(dave.binding_for(name, "bobco"));
    let refused = client
        .create_channel(dave.request(request.clone()))
        .await
        .unwrap_err();
    assert_status(&refused, Code::PermissionDenied, &bad(0));
    request.binding = Some(dave.binding(name));
    client.create_channel(dave.request(request)).await.unwrap();
}

/// MLS lets one identity hold two leaves (two devices); the relay does not (one identity, one
/// leaf: the binding rule needs it). The engine refuses such an add itself; a client that does
/// not (OpenMLS) gets its commit refused, and the epoch does not move.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_leaf_with_an_identity_in_the_group_is_refused() {
    let relay = relay().await;
    let mut client = relay.client().await;
    let alice = Member::with_token("alice", "acme.k1");
    let mut carol = RawMember::new("carol");
    alice.create(&mut client, CHANNEL).await;
    let added = alice
        .engine
        .add_member(CHANNEL, &carol.key_package())
        .unwrap();
    alice
        .publish(&mut client, CHANNEL, added.commit.into())
        .await
        .unwrap();
    alice.engine.merge_pending_commit(CHANNEL).unwrap();
    carol.join(&added.welcome, MIXED_PLAINTEXT_WIRE_FORMAT_POLICY);
    let bind = pb::BindLeafRequest {
        channel: CHANNEL.into(),
        binding: Some(carol.binding(CHANNEL, "acme")),
    };
    client.bind_leaf(authed(bind, "acme.k2")).await.unwrap();

    // Another device of alice's: the same identity, another key.
    let second = Member::with_token("alice", "acme.k3");
    let second_kp = second.key_package();
    assert!(alice.engine.add_member(CHANNEL, &second_kp).is_err());
    let (commit, welcome) = carol.add(&[&second_kp]);
    let with_welcome = pb::PublishRequest {
        welcome: welcome.clone(),
        ..request(CHANNEL, commit)
    };
    let refused = client
        .publish(authed(with_welcome, "acme.k2"))
        .await
        .unwrap_err();
    assert_status(
        &refused,
        Code::InvalidArgument,
        "identity \"alice\" would be held by leaves 0 and 2",
    );
    assert_welcome_not_kept(&mut client, &alice, &welcome).await;
    assert_eq!(epoch_of(&mut client, &alice, CHANNEL).await, 1);
    // Another identity is fine.
    carol.clear();
    let dave = Member::with_token("dave", "acme.k4");
    let (commit, _) = carol.add(&[&dave.key_package()]);
    let accepted = client
        .publish(authed(request(CHANNEL, commit), "acme.k2"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!((accepted.seq, accepted.epoch), (2, 2));
}

/// With --allow-anonymous, callers without a token are one account, "", under the same rules:
/// it owns the orgs it created first, reaches only channels where a leaf is bound to it, its
/// bindings must name "", its handshakes are checked like anyone's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_anonymous_relay_applies_the_same_rules_to_the_account_empty() {
    let relay = Relay::start_with(|c| c.allow_anonymous = true, Some(Arc::new(FakeVerify))).await;
    let mut client = relay.client().await;
    let alice = Member::anonymous("alice");
    let bob = Member::with_token("bob", "bobco.k1");
    let carol = Member::anonymous("carol");
    let name = "anon/agents/chat";
    alice.create(&mut client, name).await;
    // bobco is an outsider of the anonymous account's channel and org.
    let outsider = |status: &Status| {
        assert_status(status, Code::PermissionDenied, &not_a_member(name));
    };
    outsider(&bob.subscribe(&mut client, name, 0).await.unwrap_err());
    outsider(&bob.list_members(&mut client, name).await.unwrap_err());
    let refused = bob
        .try_create(&mut client, "anon/agents/mine")
        .await
        .unwrap_err();
    assert_status(
        &refused,
        Code::PermissionDenied,
        "org 'anon' belongs to another account",
    );
    // And the other way round: a token's org and channel are not the anonymous account's.
    let bobs = "bobco/agents/chat";
    bob.create(&mut client, bobs).await;
    let dave = Member::anonymous("dave");
    let refused = dave
        .try_create(&mut client, "bobco/agents/x")
        .await
        .unwrap_err();
    assert_status(
        &refused,
        Code::PermissionDenied,
        "org 'bobco' belongs to another account",
    );
    let refused = dave
        .publish(&mut client, bobs, application(bobs, 0, b"x"))
        .await
        .unwrap_err();
    assert_status(&refused, Code::PermissionDenied, &not_a_member(bobs));

    // Alice adds bob and carol; carol's binding must name "", bob's "bobco".
    let (bob_kp, carol_kp) = (bob.key_package(), carol.key_package());
    let added = alice
        .engine
        .add_members(name, &[&bob_kp, &carol_kp])
        .unwrap();
    alice
        .publish(&mut client, name, added.commit.into())
        .await
        .unwrap();
    alice.engine.merge_pending_commit(name).unwrap();
    bob.engine.join_group(name, &added.welcome).unwrap();
    carol.engine.join_group(name, &added.welcome).unwrap();
    let refused = carol
        .send_binding(&mut client, name, carol.binding_for(name, "bobco"))
        .await
        .unwrap_err();
    assert_status(
        &refused,
        Code::PermissionDenied,
        "the leaf binding does not verify for leaf 2 and this account",
    );
    carol.bind(&mut client, name).await.unwrap();
    bob.bind(&mut client, name).await.unwrap();
    let list = carol.list_members(&mut client, name).await.unwrap();
    assert_eq!(
        roster(&list),
        [
            entry(0, "alice", ""),
            entry(1, "bob", "bobco"),
            entry(2, "carol", "")
        ]
    );

    // Handshakes are checked as for anyone: a forged commit, a PrivateMessage commit.
    let mut mallory = RawMember::new("alice");
    mallory.create_look_alike(name);
    mallory.self_update(true);
    let refused = dave
        .publish(&mut client, name, mallory.self_update(false))
        .await
        .unwrap_err();
    assert_status(
        &refused,
        Code::PermissionDenied,
        "the commit's signature does not verify",
    );
    let refused = dave
        .publish(
            &mut client,
            name,
            private_message(name, 1, COMMIT, b"sealed"),
        )
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument);
    assert_eq!(epoch_of(&mut client, &alice, name).await, 1);

    // Removing carol leaves the account alice's leaf: it keeps its access. Removing bob ends
    // bobco's.
    let mut bobs_sub = bob.subscribe(&mut client, name, 0).await.unwrap();
    bobs_sub.wait_keepalives(1).await;
    let removal = alice.remove(name, "carol");
    alice
        .publish(&mut client, name, removal.clone())
        .await
        .unwrap();
    alice.apply(name, &removal);
    bob.apply(name, &removal);
    carol.subscribe(&mut client, name, 0).await.unwrap();
    let removal = alice.remove(name, "bob");
    alice
        .publish(&mut client, name, removal.clone())
        .await
        .unwrap();
    outsider(&bobs_sub.wait_end().await);
    assert_eq!(bobs_sub.seqs(), [1, 2, 3]);
    outsider(&bob.list_members(&mut client, name).await.unwrap_err());
    dave.list_members(&mut client, name).await.unwrap();
}
