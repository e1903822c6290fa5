//! The relay's RPCs end to end: a real server over SQLite, a tonic client (the behaviours of
//! `tests/relay/test_relay.py`).
#![allow(clippy::unwrap_used)]

mod service_support;

use std::time::Duration;

use bytes::Bytes;
use sha2::{Digest, Sha256};
use static_relay::pb;
use tonic::Code;

use service_support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_publish_subscribe_round_trip() {
    let relay = Relay::anonymous().await;
    let mut client = relay.client().await;
    create(&mut client, CHANNEL).await;
    let exists = Member::anonymous("bob")
        .try_create(&mut client, CHANNEL)
        .await
        .unwrap_err();
    assert_status(
        &exists,
        Code::AlreadyExists,
        "channel 'acme/agents/chat' already exists",
    );

    let first = publish(&mut client, CHANNEL, application(CHANNEL, 0, b"one"))
        .await
        .unwrap();
    assert_eq!((first.seq, first.epoch, first.duplicate), (1, 0, false));
    let mut sub = Subscription::open(&mut client, subscribe_request(CHANNEL, 0)).await;
    sub.wait_keepalives(1).await;
    publish(&mut client, CHANNEL, application(CHANNEL, 0, b"two"))
        .await
        .unwrap();
    let entries = sub.wait_for(2).await;
    assert_eq!(entries.iter().map(|e| e.seq).collect::<Vec<_>>(), [1, 2]);
    assert_eq!(entries[1].message, application(CHANNEL, 0, b"two"));
    assert_eq!(entries[1].content_type, u32::from(APPLICATION));
    assert_eq!(entries[1].epoch, 0);

    // A method the relay does not have.
    let mut grpc = tonic::client::Grpc::new(relay.connect().await);
    grpc.ready().await.unwrap();
    let unknown = grpc
        .unary::<_, pb::CreateChannelResponse, _>(
            tonic::Request::new(pb::CreateChannelRequest {
                channel: CHANNEL.into(),
                ..Default::default()
            }),
            "/static.relay.v1.Relay/Nope".parse().unwrap(),
            tonic_prost::ProstCodec::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(unknown.code(), Code::Unimplemented);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_then_live_without_gap_or_duplicate() {
    let relay = Relay::anonymous().await;
    let mut client = relay.client().await;
    create(&mut client, CHANNEL).await;
    for i in 0..10 {
        let m = application(CHANNEL, 0, format!("m{i}").as_bytes());
        publish(&mut client, CHANNEL, m).await.unwrap();
    }
    let mut live = Subscription::open(&mut client, subscribe_request(CHANNEL, 4)).await;
    live.wait_for(6).await;
    assert_eq!(live.seqs(), (5..=10).collect::<Vec<_>>());
    // Published while the subscription replays or waits: each arrives exactly once.
    let mut publisher = relay.client().await;
    for i in 10..15 {
        let m = application(CHANNEL, 0, format!("m{i}").as_bytes());
        publish(&mut publisher, CHANNEL, m).await.unwrap();
    }
    live.wait_for(11).await;
    assert_eq!(live.seqs(), (5..=15).collect::<Vec<_>>());
    live.wait_keepalives(2).await;
    assert_eq!(live.entries.len(), 11);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_publishers_see_one_order() {
    let relay = Relay::anonymous().await;
    let mut client = relay.client().await;
    create(&mut client, CHANNEL).await;
    let mut sub = Subscription::open(&mut client, subscribe_request(CHANNEL, 0)).await;
    let (publishers, per_publisher) = (4, 40);
    let mut tasks = Vec::new();
    for n in 0..publishers {
        let mut own = relay.client().await;
        tasks.push(tokio::spawn(async move {
            let message = |i: usize| application(CHANNEL, 0, format!("{n}:{i}").as_bytes());
            for i in 0..per_publisher / 2 {
                publish(&mut own, CHANNEL, message(i)).await.unwrap();
            }
            let batch: Vec<_> = (per_publisher / 2..per_publisher)
                .map(|i| request(CHANNEL, message(i)))
                .collect();
            let mut answers = own
                .publish_stream(tokio_stream::iter(batch))
                .await
                .unwrap()
                .into_inner();
            assert_eq!(all_answers(&mut answers).await.len(), per_publisher / 2);
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    let total = publishers * per_publisher;
    sub.wait_for(total).await;
    assert_eq!(sub.seqs(), (1..=total as u64).collect::<Vec<_>>());
    let payloads: Vec<_> = sub.entries.iter().map(|e| e.message.clone()).collect();
    for n in 0..publishers {
        let expected: Vec<_> = (0..per_publisher)
            .map(|i| application(CHANNEL, 0, format!("{n}:{i}").as_bytes()))
            .collect();
        let seen: Vec<_> = payloads
            .iter()
            .filter(|p| expected.contains(p))
            .cloned()
            .collect();
        assert_eq!(seen, expected, "publisher {n}'s messages in its order");
    }
    let mut replay = Subscription::open(&mut client, subscribe_request(CHANNEL, 0)).await;
    replay.wait_for(total).await;
    let replayed: Vec<_> = replay.entries.iter().map(|e| e.message.clone()).collect();
    assert_eq!(replayed, payloads);
}

/// Six members (alice added the others in one commit: epoch 1) commit at epoch 1 at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_commits_on_one_epoch_exactly_one_wins() {
    let relay = Relay::anonymous().await;
    let mut client = relay.client().await;
    let members: Vec<Member> = ["alice", "bob", "carol", "dave", "erin", "frank"]
        .into_iter()
        .map(Member::anonymous)
        .collect();
    group_of(&mut client, CHANNEL, &members.iter().collect::<Vec<_>>()).await;
    let commits: Vec<_> = members.iter().map(|m| m.update(CHANNEL)).collect();
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(6));
    let mut tasks = Vec::new();
    for commit in commits.clone() {
        let mut own = relay.client().await;
        let barrier = barrier.clone();
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            publish(&mut own, CHANNEL, commit).await
        }));
    }
    let mut won = Vec::new();
    let mut lost = Vec::new();
    for (n, task) in tasks.into_iter().enumerate() {
        match task.await.unwrap() {
            Ok(response) => won.push((n, response)),
            Err(status) => lost.push(status),
        }
    }
    assert_eq!((won.len(), lost.len()), (1, 5));
    let (winner, response) = &won[0];
    assert_eq!((response.seq, response.epoch), (2, 2));
    for status in lost {
        assert_eq!(status.code(), Code::FailedPrecondition);
        assert_eq!(
            trailer(&status, "static-current-epoch").as_deref(),
            Some("2")
        );
        assert_eq!(
            status.message(),
            "stale epoch: message epoch 1, channel epoch 2"
        );
    }
    // Everyone applies the winner (the losers' commits are void); a loser commits again.
    for member in &members {
        member.apply(CHANNEL, &commits[*winner]);
    }
    let loser = &members[(winner + 1) % members.len()];
    let (retry, _) = loser.commit(&mut client, CHANNEL).await;
    assert_eq!((retry.seq, retry.epoch), (3, 3));
}

/// Bob joined (epoch 1); alice commits up to epoch 7, bob applying each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn epoch_rules_for_applications_and_proposals() {
    let relay = Relay::anonymous().await;
    let mut client = relay.client().await;
    let (alice, bob) = (Member::anonymous("alice"), Member::anonymous("bob"));
    group_of(&mut client, CHANNEL, &[&alice, &bob]).await;
    let mut proposal_at_6 = None;
    for epoch in 1..7 {
        if epoch == 6 {
            // Made at epoch 6, published once the channel is at 7.
            proposal_at_6 = Some(Bytes::from(bob.engine.leave(CHANNEL).unwrap()));
        }
        let (_, commit) = alice.commit(&mut client, CHANNEL).await;
        bob.apply(CHANNEL, &commit);
    }
    let old = publish(&mut client, CHANNEL, application(CHANNEL, 2, b"x"))
        .await
        .unwrap();
    assert_eq!(old.epoch, 7);
    for stale in [1, 8] {
        let refused = publish(&mut client, CHANNEL, application(CHANNEL, stale, b"x"))
            .await
            .unwrap_err();
        assert_eq!(refused.code(), Code::FailedPrecondition);
        assert_eq!(
            trailer(&refused, "static-current-epoch").as_deref(),
            Some("7")
        );
    }
    let refused = publish(&mut client, CHANNEL, proposal_at_6.unwrap())
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition);
    let proposal = Bytes::from(bob.engine.leave(CHANNEL).unwrap());
    assert_eq!(
        publish(&mut client, CHANNEL, proposal).await.unwrap().epoch,
        7
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idempotent_retries_return_the_original_seq() {
    let relay = Relay::anonymous().await;
    let mut client = relay.client().await;
    let alice = create(&mut client, CHANNEL).await;
    let message = application(CHANNEL, 0, b"once");
    let first = publish(&mut client, CHANNEL, message.clone())
        .await
        .unwrap();
    publish(&mut client, CHANNEL, application(CHANNEL, 0, b"other"))
        .await
        .unwrap();
    let again = publish(&mut client, CHANNEL, message.clone())
        .await
        .unwrap();
    assert_eq!(
        (again.seq, again.duplicate, first.duplicate),
        (first.seq, true, false)
    );
    let keyed = |payload: &[u8]| pb::PublishRequest {
        idempotency_key: bytes::Bytes::from_static(b"id-1"),
        ..request(CHANNEL, application(CHANNEL, 0, payload))
    };
    let original = client.publish(keyed(b"a")).await.unwrap().into_inner();
    let retried = client.publish(keyed(b"a2")).await.unwrap().into_inner();
    assert_eq!((retried.seq, retried.duplicate), (original.seq, true));
    // A retried commit is not fenced again (nor checked: the group has moved on past it): it
    // gets its original answer.
    let (won, c) = alice.commit(&mut client, CHANNEL).await;
    let again = publish(&mut client, CHANNEL, c).await.unwrap();
    assert_eq!(
        again,
        pb::PublishResponse {
            seq: won.seq,
            epoch: 1,
            duplicate: true
        }
    );
    // Retries mixed with new messages on one PublishStream (and twice within it).
    let fresh: Vec<_> = (0..3)
        .map(|i| application(CHANNEL, 1, format!("new{i}").as_bytes()))
        .collect();
    let batch = [&fresh[0], &message, &fresh[1], &fresh[1], &fresh[2]];
    let requests: Vec<_> = batch
        .iter()
        .map(|m| request(CHANNEL, (*m).clone()))
        .collect();
    let mut answers = client
        .publish_stream(tokio_stream::iter(requests))
        .await
        .unwrap()
        .into_inner();
    let got: Vec<_> = all_answers(&mut answers)
        .await
        .into_iter()
        .map(|a| (a.seq, a.duplicate))
        .collect();
    assert_eq!(
        got,
        [
            (5, false),
            (first.seq, true),
            (6, false),
            (6, true),
            (7, false)
        ]
    );
    let mut sub = Subscription::open(&mut client, subscribe_request(CHANNEL, 0)).await;
    sub.wait_for(7).await;
    sub.wait_keepalives(2).await;
    assert_eq!(sub.entries.len(), 7, "nothing appended twice");
}

/// Alice adds bob and carol in one commit with its Welcome; a commit of hers adding dave,
/// made at epoch 0 but published once the channel is at 1, is refused with its Welcome.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscribe_from_epoch_and_fetch_welcomes() {
    let relay = Relay::anonymous().await;
    let mut client = relay.client().await;
    let alice = create(&mut client, CHANNEL).await;
    let (bob, carol, dave) = (
        Member::anonymous("bob"),
        Member::anonymous("carol"),
        Member::anonymous("dave"),
    );
    let dave_kp = dave.key_package();
    let late = alice.engine.add_member(CHANNEL, &dave_kp).unwrap();
    alice.engine.clear_pending_commit(CHANNEL).unwrap();
    publish(&mut client, CHANNEL, application(CHANNEL, 0, b"before"))
        .await
        .unwrap();
    let (bob_kp, carol_kp) = (bob.key_package(), carol.key_package());
    let added = alice
        .engine
        .add_members(CHANNEL, &[&bob_kp, &carol_kp])
        .unwrap();
    let w = Bytes::from(added.welcome);
    let with_welcome = pb::PublishRequest {
        welcome: w.clone(),
        ..request(CHANNEL, added.commit.into())
    };
    let committed = client.publish(with_welcome).await.unwrap().into_inner();
    assert_eq!((committed.seq, committed.epoch), (2, 1));
    alice.engine.merge_pending_commit(CHANNEL).unwrap();
    publish(&mut client, CHANNEL, application(CHANNEL, 1, b"after"))
        .await
        .unwrap();

    let from_epoch = |epoch| pb::SubscribeRequest {
        channel: CHANNEL.into(),
        start: Some(pb::subscribe_request::Start::FromEpoch(epoch)),
        max_batch: 0,
    };
    let mut joined = Subscription::open(&mut client, from_epoch(1)).await;
    joined.wait_for(1).await;
    assert_eq!(joined.seqs(), [3]);
    assert_eq!(joined.entries[0].message, application(CHANNEL, 1, b"after"));
    let mut all = Subscription::open(&mut client, from_epoch(0)).await;
    all.wait_for(3).await;
    assert_eq!(all.seqs(), [1, 2, 3]);
    let future = client.subscribe(from_epoch(9)).await.unwrap_err();
    assert_eq!(future.code(), Code::NotFound);

    let fetch = |key| pb::FetchWelcomeRequest {
        channel: CHANNEL.into(),
        key: Some(key),
    };
    use pb::fetch_welcome_request::Key;
    let carol_ref = key_package_ref(&carol_kp);
    let fetched = client
        .fetch_welcome(fetch(Key::KeyPackageRef(carol_ref.into())))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (fetched.welcome, fetched.commit_seq, fetched.epoch),
        (w.clone(), 2, 1)
    );
    let digest = Sha256::digest(&w).to_vec();
    let by_digest = client
        .fetch_welcome(fetch(Key::WelcomeSha256(digest.into())))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(by_digest.commit_seq, 2);
    // Joiners bind and fetch it as members would.
    bob.engine.join_group(CHANNEL, &w).unwrap();
    bob.bind(&mut client, CHANNEL).await.unwrap();
    let bob_ref = key_package_ref(&bob_kp);
    let own = bob
        .fetch_welcome(&mut client, CHANNEL, Key::KeyPackageRef(bob_ref.into()))
        .await
        .unwrap();
    assert_eq!((own.welcome, own.commit_seq, own.epoch), (w.clone(), 2, 1));
    let unknown = client
        .fetch_welcome(fetch(Key::KeyPackageRef(b"nope".to_vec().into())))
        .await
        .unwrap_err();
    assert_eq!(
        (unknown.code(), unknown.message()),
        (Code::NotFound, "no such welcome")
    );
    let keyless = client
        .fetch_welcome(pb::FetchWelcomeRequest {
            channel: CHANNEL.into(),
            key: None,
        })
        .await
        .unwrap_err();
    assert_eq!(keyless.code(), Code::InvalidArgument);
    // A refused commit keeps no welcome.
    let late = pb::PublishRequest {
        welcome: late.welcome.into(),
        ..request(CHANNEL, late.commit.into())
    };
    assert_eq!(
        client.publish(late).await.unwrap_err().code(),
        Code::FailedPrecondition
    );
    let dave_ref = key_package_ref(&dave_kp);
    let kept = client
        .fetch_welcome(fetch(Key::KeyPackageRef(dave_ref.into())))
        .await
        .unwrap_err();
    assert_eq!(kept.code(), Code::NotFound);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_oversized_and_misaddressed_messages() {
    let relay = Relay::anonymous().await;
    let mut client = relay.client().await;
    create(&mut client, CHANNEL).await;
    let refused = |r: Result<pb::PublishResponse, tonic::Status>| r.unwrap_err();

    let garbage = refused(
        publish(
            &mut client,
            CHANNEL,
            bytes::Bytes::from_static(b"\x00\x01garbage"),
        )
        .await,
    );
    assert_eq!(garbage.code(), Code::InvalidArgument);
    assert!(
        garbage.message().starts_with("malformed MLS message"),
        "{}",
        garbage.message()
    );
    let other = "acme/agents/other";
    let misaddressed = refused(publish(&mut client, CHANNEL, application(other, 0, b"x")).await);
    assert_status(
        &misaddressed,
        Code::InvalidArgument,
        "the message belongs to another group than channel 'acme/agents/chat'",
    );
    let not_commit = pb::PublishRequest {
        welcome: welcome(&[b"r"]),
        ..request(CHANNEL, application(CHANNEL, 0, b"x"))
    };
    let not_commit = client.publish(not_commit).await.unwrap_err();
    assert_status(
        &not_commit,
        Code::InvalidArgument,
        "a welcome can only be published with a commit",
    );
    let a_welcome = refused(publish(&mut client, CHANNEL, welcome(&[b"r"])).await);
    assert_eq!(a_welcome.code(), Code::InvalidArgument);
    let empty = refused(publish(&mut client, CHANNEL, bytes::Bytes::new()).await);
    assert_eq!(
        (empty.code(), empty.message()),
        (Code::InvalidArgument, "empty message")
    );
    let bad_name = client
        .create_channel(pb::CreateChannelRequest {
            channel: "not-a-channel".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(bad_name.code(), Code::InvalidArgument);
    assert!(bad_name.message().contains("org/namespace/service"));
    let long = format!("a/b/{}", "c".repeat(200));
    let too_long = client
        .create_channel(pb::CreateChannelRequest {
            channel: long,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(too_long.code(), Code::InvalidArgument);
    let none = "acme/agents/none";
    let missing = refused(publish(&mut client, none, application(none, 0, b"x")).await);
    assert_eq!(
        (missing.code(), missing.message()),
        (Code::NotFound, "no channel 'acme/agents/none'")
    );

    let mut big_client = pb::relay_client::RelayClient::new(relay.connect().await)
        .max_encoding_message_size(16 * 1024 * 1024);
    let big = application(CHANNEL, 0, &vec![b'x'; 1024 * 1024]);
    let too_big = refused(publish(&mut big_client, CHANNEL, big).await);
    assert_status(
        &too_big,
        Code::ResourceExhausted,
        "message larger than 1048576 bytes",
    );
    let huge = application(CHANNEL, 0, &vec![b'x'; 5 * 1024 * 1024]);
    let too_huge = refused(publish(&mut big_client, CHANNEL, huge).await);
    assert_status(
        &too_huge,
        Code::ResourceExhausted,
        &format!(
            "request larger than the transport limit of {} bytes",
            2 * 1024 * 1024 + 64 * 1024
        ),
    );
    // Not a protobuf message at all (a raw body through a bytes codec).
    let mut grpc = tonic::client::Grpc::new(relay.connect().await);
    grpc.ready().await.unwrap();
    let undecodable = grpc
        .unary::<_, pb::PublishResponse, _>(
            tonic::Request::new(pb::KeepAlive { head_seq: u64::MAX }),
            "/static.relay.v1.Relay/Publish".parse().unwrap(),
            RawCodec,
        )
        .await
        .unwrap_err();
    assert_eq!(
        (undecodable.code(), undecodable.message()),
        (
            Code::InvalidArgument,
            "request is not a valid protobuf message"
        )
    );
    // The connections survived all of it.
    let at_limit = application(CHANNEL, 0, &vec![b'x'; 1024 * 1024 - 100]);
    assert_eq!(
        publish(&mut big_client, CHANNEL, at_limit)
            .await
            .unwrap()
            .seq,
        1
    );
    let small = application(CHANNEL, 0, b"small");
    assert_eq!(publish(&mut client, CHANNEL, small).await.unwrap().seq, 2);
}

/// Sends `0xff` bytes as the request (never valid protobuf: field 0 / wire type 7),
/// decodes answers as protobuf.
#[derive(Clone, Copy)]
struct RawCodec;

impl tonic::codec::Codec for RawCodec {
    type Encode = pb::KeepAlive;
    type Decode = pb::PublishResponse;
    type Encoder = RawEncoder;
    type Decoder = <tonic_prost::ProstCodec<pb::KeepAlive, pb::PublishResponse> as tonic::codec::Codec>::Decoder;

    fn encoder(&mut self) -> Self::Encoder {
        RawEncoder
    }

    fn decoder(&mut self) -> Self::Decoder {
        tonic::codec::Codec::decoder(&mut tonic_prost::ProstCodec::<
            pb::KeepAlive,
            pb::PublishResponse,
        >::default())
    }
}

struct RawEncoder;

impl tonic::codec::Encoder for RawEncoder {
    type Item = pb::KeepAlive;
    type Error = tonic::Status;

    fn encode(
        &mut self,
        _: pb::KeepAlive,
        dst: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), tonic::Status> {
        use bytes::BufMut;
        dst.put_slice(&[0xff, 0xff, 0xff]);
        Ok(())
    }
}

/// Alice and bob (epoch 1) both commit at epoch 1 on one call: bob's commit loses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_stream_stops_at_the_first_refusal() {
    let relay = Relay::anonymous().await;
    let mut client = relay.client().await;
    let (alice, bob) = (Member::anonymous("alice"), Member::anonymous("bob"));
    group_of(&mut client, CHANNEL, &[&alice, &bob]).await;
    let requests = vec![
        request(CHANNEL, application(CHANNEL, 1, b"1")),
        request(CHANNEL, alice.update(CHANNEL)),
        request(CHANNEL, bob.update(CHANNEL)),
        request(CHANNEL, application(CHANNEL, 2, b"never")),
    ];
    let mut answers = client
        .publish_stream(tokio_stream::iter(requests.clone()))
        .await
        .unwrap()
        .into_inner();
    let mut got = Vec::new();
    let status = loop {
        match next_answer(&mut answers).await {
            Ok(Some(a)) => got.push((a.seq, a.epoch)),
            Ok(None) => panic!("the call ended without the refusal"),
            Err(status) => break status,
        }
    };
    assert_eq!(got, [(2, 1), (3, 2)]);
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert_eq!(
        trailer(&status, "static-current-epoch").as_deref(),
        Some("2")
    );
    let mut log = Subscription::open(&mut client, subscribe_request(CHANNEL, 1)).await;
    log.wait_for(2).await;
    log.wait_keepalives(2).await;
    let messages: Vec<_> = log.entries.iter().map(|e| e.message.clone()).collect();
    assert_eq!(
        messages[..2],
        [requests[0].message.clone(), requests[1].message.clone()]
    );
    assert!(!messages.contains(&requests[2].message));
    alice.apply(CHANNEL, &requests[1].message);
    bob.apply(CHANNEL, &requests[1].message);

    // 500 on one call: one answer each, in order, sharing commits.
    let messages: Vec<_> = (0..500)
        .map(|i| application(CHANNEL, 2, format!("{i}").as_bytes()))
        .collect();
    let mut answers = client
        .publish_stream(tokio_stream::iter(
            messages
                .iter()
                .map(|m| request(CHANNEL, m.clone()))
                .collect::<Vec<_>>(),
        ))
        .await
        .unwrap()
        .into_inner();
    let seqs: Vec<_> = all_answers(&mut answers)
        .await
        .into_iter()
        .map(|a| a.seq)
        .collect();
    // After the add, the answered two, and "never" if it made it in.
    let start = 1 + got.len() as u64 + log.entries.len() as u64 - 2 + 1;
    assert_eq!(seqs.len(), 500);
    assert!(
        seqs.windows(2).all(|w| w[1] == w[0] + 1),
        "consecutive seqs"
    );
    assert!(seqs[0] >= start);
}

/// Alice and bob (epoch 1) both commit at epoch 1 in one batch: bob's loses, the call goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_batches_answers_every_item_and_goes_on() {
    let relay = Relay::anonymous().await;
    let mut client = relay.client().await;
    let (alice, bob) = (Member::anonymous("alice"), Member::anonymous("bob"));
    group_of(&mut client, CHANNEL, &[&alice, &bob]).await;
    let other = "acme/agents/other";
    let first: Vec<_> = (0..3)
        .map(|i| request(CHANNEL, application(CHANNEL, 1, format!("{i}").as_bytes())))
        .collect();
    let second = vec![
        request(CHANNEL, alice.update(CHANNEL)),
        request(CHANNEL, bob.update(CHANNEL)), // loses the epoch: refused, call goes on
        request(CHANNEL, bytes::Bytes::from_static(b"not mls")),
        request(CHANNEL, application(CHANNEL, 1, b"0")), // a retry of the first item
        request(other, application(other, 2, b"x")),     // no such channel
        request(CHANNEL, application(CHANNEL, 2, b"after")),
    ];
    let third = vec![request(CHANNEL, application(CHANNEL, 2, b"last"))];
    let batches: Vec<_> = [first, second, third]
        .into_iter()
        .map(|requests| pb::PublishBatchRequest { requests })
        .collect();
    let responses = publish_batches(&mut client, batches).await;
    assert_eq!(
        responses
            .iter()
            .map(|a| a.results.len())
            .collect::<Vec<_>>(),
        [3, 6, 1]
    );
    use pb::publish_result::Outcome;
    let results: Vec<_> = responses
        .into_iter()
        .flat_map(|a| a.results)
        .map(|r| r.outcome.unwrap())
        .collect();
    let accepted = |o: &Outcome| match o {
        Outcome::Accepted(a) => Some((a.seq, a.epoch, a.duplicate)),
        Outcome::Refused(_) => None,
    };
    let refused = |o: &Outcome| match o {
        Outcome::Refused(r) => r.clone(),
        Outcome::Accepted(a) => panic!("accepted: {a:?}"),
    };
    assert_eq!(
        results[..4].iter().map(accepted).collect::<Vec<_>>(),
        [
            Some((2, 1, false)),
            Some((3, 1, false)),
            Some((4, 1, false)),
            Some((5, 2, false))
        ]
    );
    let stale = refused(&results[4]);
    assert_eq!(stale.code, Code::FailedPrecondition as u32);
    assert_eq!(stale.current_epoch, 2);
    assert_eq!(
        stale.message,
        "stale epoch: message epoch 1, channel epoch 2"
    );
    assert_eq!(refused(&results[5]).code, Code::InvalidArgument as u32);
    assert_eq!(accepted(&results[6]), Some((2, 1, true)));
    assert_eq!(refused(&results[7]).code, Code::NotFound as u32);
    assert_eq!(
        results[8..].iter().map(accepted).collect::<Vec<_>>(),
        [Some((6, 2, false)), Some((7, 2, false))]
    );
    let mut log = Subscription::open(&mut client, subscribe_request(CHANNEL, 0)).await;
    log.wait_for(7).await;
    log.wait_keepalives(2).await;
    assert_eq!(log.entries.len(), 7);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_batches_refuses_oversized_batches() {
    let relay = Relay::anonymous().await;
    let mut client = relay.client().await;
    create(&mut client, CHANNEL).await;
    let requests: Vec<_> = (0..1025)
        .map(|i| request(CHANNEL, application(CHANNEL, 0, format!("{i}").as_bytes())))
        .collect();
    let mut answers = client
        .publish_batches(tokio_stream::iter([pb::PublishBatchRequest { requests }]))
        .await
        .unwrap()
        .into_inner();
    let status = next_answer(&mut answers).await.unwrap_err();
    assert_status(
        &status,
        Code::InvalidArgument,
        "1025 requests in one batch; at most 1024",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_rate_limit_per_agent() {
    let relay = Relay::start(|c| {
        c.allow_anonymous = true;
        c.publish_rate_per_agent = 5.0;
    })
    .await;
    let mut client = relay.client().await;
    create(&mut client, CHANNEL).await;
    let mut outcomes = Vec::new();
    for i in 0..12 {
        outcomes.push(
            publish(
                &mut client,
                CHANNEL,
                application(CHANNEL, 0, format!("{i}").as_bytes()),
            )
            .await,
        );
    }
    assert!(outcomes[..5].iter().all(Result::is_ok));
    let refused = outcomes.into_iter().find_map(Result::err).unwrap();
    assert_status(
        &refused,
        Code::ResourceExhausted,
        "publish rate limit of 5 messages/s per agent exceeded",
    );
    let retry_after: u64 = trailer(&refused, "static-retry-after-ms")
        .unwrap()
        .parse()
        .unwrap();
    assert!(retry_after > 0 && retry_after <= 1000, "{retry_after}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    publish(&mut client, CHANNEL, application(CHANNEL, 0, b"later"))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscribe_in_batches_replays_then_follows_without_gaps() {
    let relay = Relay::anonymous().await;
    let mut client = relay.client().await;
    create(&mut client, CHANNEL).await;
    let messages: Vec<_> = (0..300)
        .map(|i| request(CHANNEL, application(CHANNEL, 0, format!("{i}").as_bytes())))
        .collect();
    let batch = |requests| tokio_stream::iter([pb::PublishBatchRequest { requests }]);
    let mut answers = client
        .publish_batches(batch(messages))
        .await
        .unwrap()
        .into_inner();
    all_answers(&mut answers).await;
    let mut sub = Subscription::open(
        &mut client,
        pb::SubscribeRequest {
            max_batch: 100,
            ..subscribe_request(CHANNEL, 10)
        },
    )
    .await;
    sub.wait_for(290).await;
    assert_eq!(sub.seqs(), (11..=300).collect::<Vec<_>>());
    let more: Vec<_> = (0..50)
        .map(|i| application(CHANNEL, 0, format!("live {i}").as_bytes()))
        .collect();
    let requests = more.iter().map(|m| request(CHANNEL, m.clone())).collect();
    let mut answers = client
        .publish_batches(batch(requests))
        .await
        .unwrap()
        .into_inner();
    all_answers(&mut answers).await;
    sub.wait_for(340).await;
    assert_eq!(sub.seqs(), (11..=350).collect::<Vec<_>>());
    let live: Vec<_> = sub.entries[290..]
        .iter()
        .map(|e| e.message.clone())
        .collect();
    assert_eq!(live, more);
    assert_eq!(sub.batch_sizes.iter().max(), Some(&100));
    assert!(sub.batch_sizes.len() < 340);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_calls_send_headers_before_any_request() {
    let relay = Relay::anonymous().await;
    let mut client = relay.client().await;
    create(&mut client, CHANNEL).await;
    // Request streams that send nothing until the response headers came.
    let (tx, rx) = tokio::sync::mpsc::channel::<pb::PublishRequest>(1);
    let call = client.publish_stream(tokio_stream::wrappers::ReceiverStream::new(rx));
    let response = tokio::time::timeout(Duration::from_secs(5), call).await;
    let mut answers = response
        .expect("no response headers before the first request")
        .unwrap()
        .into_inner();
    drop(tx);
    assert!(next_answer(&mut answers).await.unwrap().is_none());

    let (tx, rx) = tokio::sync::mpsc::channel::<pb::PublishBatchRequest>(1);
    let call = client.publish_batches(tokio_stream::wrappers::ReceiverStream::new(rx));
    let response = tokio::time::timeout(Duration::from_secs(5), call).await;
    let mut answers = response
        .expect("no response headers before the first request")
        .unwrap()
        .into_inner();
    tx.send(pb::PublishBatchRequest {
        requests: vec![request(CHANNEL, application(CHANNEL, 0, b"x"))],
    })
    .await
    .unwrap();
    let answer = next_answer(&mut answers).await.unwrap().unwrap();
    assert_eq!(answer.results.len(), 1);
    drop(tx);
    assert!(next_answer(&mut answers).await.unwrap().is_none());
}

/// Waits until `relay` has `count` channels loaded (the log unloads idle ones by itself).
async fn loaded(relay: &Relay, count: usize) {
    within("the idle channels to be unloaded", async {
        while relay.server().log().loaded_channels() != count {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
}

/// Channels unloaded when idle, through the service: a Subscribe or SubscribeMany stream keeps
/// its channel loaded however long it is quiet; once nothing holds it the channel goes, and the
/// next call reads it again from the store: the log goes on at the next seq, and subscribers
/// resume from their cursors without a gap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_channels_unload_and_reload_through_the_service() {
    let relay = Relay::start(|c| {
        c.allow_anonymous = true;
        c.idle_unload = Duration::from_millis(50);
    })
    .await;
    let mut client = relay.client().await;
    let member = create(&mut client, CHANNEL).await;
    for i in 0..3u8 {
        publish(&mut client, CHANNEL, application(CHANNEL, 0, &[i]))
            .await
            .unwrap();
    }
    loaded(&relay, 0).await;

    let mut sub = Subscription::open(&mut client, subscribe_request(CHANNEL, 0)).await;
    assert_eq!(sub.wait_for(3).await.len(), 3);
    let mut many = Many::open(&mut client, None).await;
    many.add(subscribe_request(CHANNEL, 3));
    assert_eq!(many.live(CHANNEL).await, 3);
    // Quiet far longer than the idle time, yet held by the streams.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(relay.server().log().loaded_channels(), 1);
    let fourth = publish(&mut client, CHANNEL, application(CHANNEL, 0, b"4"))
        .await
        .unwrap();
    assert_eq!(fourth.seq, 4);
    assert_eq!(sub.wait_for(4).await[3].seq, 4);
    assert_eq!(many.wait_for(CHANNEL, 1).await, [4]);

    drop(sub);
    drop(many);
    loaded(&relay, 0).await;
    let fifth = publish(&mut client, CHANNEL, application(CHANNEL, 0, b"5"))
        .await
        .unwrap();
    assert_eq!((fifth.seq, fifth.epoch, fifth.duplicate), (5, 0, false));
    let retry = publish(&mut client, CHANNEL, application(CHANNEL, 0, &[0]))
        .await
        .unwrap();
    assert_eq!((retry.seq, retry.duplicate), (1, true));
    loaded(&relay, 0).await;
    let mut resumed = Subscription::open(&mut client, subscribe_request(CHANNEL, 2)).await;
    resumed.wait_for(3).await;
    assert_eq!(resumed.seqs(), [3, 4, 5]);
    let (committed, _) = member.commit(&mut client, CHANNEL).await;
    assert_eq!((committed.seq, committed.epoch), (6, 1));
    assert_eq!(resumed.wait_for(4).await[3].seq, 6);
}
