//! Channel patterns (issue 30): a key restricted to `acme/ops/*` names no other channel on any
//! RPC (PERMISSION_DENIED, the text naming the patterns), per item in a batch and per follow
//! on SubscribeMany, and sees only its channels' invitations. Each test fails without the
//! check: the caller is a member (and org owner) of both channels, through another key of its
//! account, so every refused call would otherwise have been served. Tokens are
//! [`FakeVerify`]'s: `alice.k2+acme/ops/~` is restricted to `acme/ops/*`.
#![allow(clippy::unwrap_used)]

mod service_support;

use std::sync::Arc;

use static_relay::pb;
use static_relay::pb::relay_client::RelayClient;
use tonic::transport::Channel;
use tonic::Code;

use service_support::*;

/// A channel inside the scoped key's patterns, and one outside (`CHANNEL`).
const INSIDE: &str = "acme/ops/chat";
const OUTSIDE: &str = CHANNEL;
/// Alice's keys: every channel, and `acme/ops/*` only.
const FULL: &str = "alice.k1";
const SCOPED: &str = "alice.k2+acme/ops/~";

/// The refusal of `channel` to the scoped key.
fn outside(channel: &str) -> String {
    format!("channel {channel} is outside this key's channels (acme/ops/*)")
}

async fn relay() -> Relay {
    Relay::start_with(|_| {}, Some(Arc::new(FakeVerify))).await
}

/// Alice creates both channels with her full key, then calls with the scoped one.
async fn alice(client: &mut RelayClient<Channel>) -> Member {
    let mut alice = Member::with_token("alice", FULL);
    alice.create(client, INSIDE).await;
    alice.create(client, OUTSIDE).await;
    alice.token = Some(SCOPED.to_owned());
    alice
}

#[track_caller]
fn assert_outside<T: std::fmt::Debug>(result: Result<T, tonic::Status>, channel: &str) {
    assert_status(
        &result.unwrap_err(),
        Code::PermissionDenied,
        &outside(channel),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scoped_key_creates_only_within_its_patterns() {
    let relay = relay().await;
    let mut client = relay.client().await;
    let alice = Member::with_token("alice", SCOPED);
    assert_outside(
        alice.try_create(&mut client, "acme/agents/new").await,
        "acme/agents/new",
    );
    // Case-sensitive, one component per `*`.
    assert_outside(
        alice.try_create(&mut client, "acme/Ops/new").await,
        "acme/Ops/new",
    );
    alice.create(&mut client, "acme/ops/new").await;
    // A key restricted to no channel at all names none.
    let none = Member::with_token("alice", "alice.k3+");
    let status = none
        .try_create(&mut client, "acme/ops/other")
        .await
        .unwrap_err();
    assert_status(
        &status,
        Code::PermissionDenied,
        "channel acme/ops/other is outside this key's channels (none)",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unary_calls_naming_a_channel_outside_are_refused() {
    let relay = relay().await;
    let mut client = relay.client().await;
    let mut alice = alice(&mut client).await;

    assert_outside(alice.bind(&mut client, OUTSIDE).await, OUTSIDE);
    assert_outside(alice.list_members(&mut client, OUTSIDE).await, OUTSIDE);
    let key = pb::fetch_welcome_request::Key::WelcomeSha256(vec![0; 32].into());
    assert_outside(
        alice.fetch_welcome(&mut client, OUTSIDE, key.clone()).await,
        OUTSIDE,
    );
    let get = |channel: &str| pb::GetRetentionRequest {
        channel: channel.to_owned(),
    };
    assert_outside(
        client.get_retention(alice.request(get(OUTSIDE))).await,
        OUTSIDE,
    );
    let set = |channel: &str| pb::SetRetentionRequest {
        channel: channel.to_owned(),
        policy: Some(pb::RetentionPolicy {
            max_entries: Some(10),
            ..Default::default()
        }),
    };
    assert_outside(
        client.set_retention(alice.request(set(OUTSIDE))).await,
        OUTSIDE,
    );
    let invite = |channel: &str| pb::InviteRequest {
        channel: channel.to_owned(),
        key_package_ref: vec![1; 32].into(),
        inviter_leaf: 0,
    };
    assert_outside(client.invite(alice.request(invite(OUTSIDE))).await, OUTSIDE);
    let claim = |channel: &str| pb::ClaimKeyPackageRequest {
        account: "bob".to_owned(),
        identity: b"bob".to_vec().into(),
        channel: channel.to_owned(),
    };
    assert_outside(
        client
            .claim_key_package(alice.request(claim(OUTSIDE)))
            .await,
        OUTSIDE,
    );

    // Inside, the same calls are served (or refused for their own reasons).
    alice.bind(&mut client, INSIDE).await.unwrap();
    alice.list_members(&mut client, INSIDE).await.unwrap();
    let status = alice
        .fetch_welcome(&mut client, INSIDE, key)
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::NotFound);
    client
        .get_retention(alice.request(get(INSIDE)))
        .await
        .unwrap();
    client
        .set_retention(alice.request(set(INSIDE)))
        .await
        .unwrap();
    let status = client
        .invite(alice.request(invite(INSIDE)))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::NotFound, "{status:?}");
    let status = client
        .claim_key_package(alice.request(claim(INSIDE)))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::NotFound, "{status:?}");
    // The full key of the same account reaches both.
    alice.token = Some(FULL.to_owned());
    alice.list_members(&mut client, OUTSIDE).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishes_outside_are_refused_per_call_and_per_batch_item() {
    let relay = relay().await;
    let mut client = relay.client().await;
    let alice = alice(&mut client).await;
    let message = |channel: &str| request(channel, alice.encrypt(channel, b"hello"));

    // Publish.
    assert_outside(
        client.publish(alice.request(message(OUTSIDE))).await,
        OUTSIDE,
    );
    let first = client
        .publish(alice.request(message(INSIDE)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(first.seq, 1);

    // PublishStream: the refusal is the call's last answer.
    let requests = vec![message(INSIDE), message(OUTSIDE), message(INSIDE)];
    let mut answers = client
        .publish_stream(alice.request(tokio_stream::iter(requests)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(next_answer(&mut answers).await.unwrap().unwrap().seq, 2);
    assert_outside(next_answer(&mut answers).await, OUTSIDE);

    // PublishBatches: the item outside is refused alone.
    let batch = pb::PublishBatchRequest {
        requests: vec![message(OUTSIDE), message(INSIDE)],
    };
    let mut answers = client
        .publish_batches(alice.request(tokio_stream::iter(vec![batch])))
        .await
        .unwrap()
        .into_inner();
    let answers = all_answers(&mut answers).await;
    use pb::publish_result::Outcome;
    match &answers[0].results[..] {
        [pb::PublishResult {
            outcome: Some(Outcome::Refused(refused)),
        }, pb::PublishResult {
            outcome: Some(Outcome::Accepted(accepted)),
        }] => {
            assert_eq!(
                (Code::from(refused.code as i32), refused.message.as_str()),
                (Code::PermissionDenied, outside(OUTSIDE).as_str())
            );
            assert_eq!(accepted.seq, 3);
        }
        other => panic!("{other:?}"),
    }
    // Nothing reached the channel outside.
    let head = client
        .get_retention(authed(
            pb::GetRetentionRequest {
                channel: OUTSIDE.to_owned(),
            },
            FULL,
        ))
        .await
        .unwrap()
        .into_inner()
        .head_seq;
    assert_eq!(head, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscriptions_outside_are_refused_per_channel() {
    let relay = relay().await;
    let mut client = relay.client().await;
    let alice = alice(&mut client).await;

    assert_outside(alice.subscribe(&mut client, OUTSIDE, 0).await, OUTSIDE);
    let mut inside = alice.subscribe(&mut client, INSIDE, 0).await.unwrap();
    inside.wait_keepalives(1).await;

    // SubscribeMany: the follow outside ends, the stream and its other follows go on.
    let mut many = Many::open(&mut client, Some(SCOPED)).await;
    many.add(subscribe_request(OUTSIDE, 0));
    many.add(subscribe_request(INSIDE, 0));
    assert_refusal(
        many.answer(OUTSIDE, 1).await,
        Code::PermissionDenied,
        &outside(OUTSIDE),
    );
    many.live(INSIDE).await;
    alice
        .publish(&mut client, INSIDE, alice.encrypt(INSIDE, b"x"))
        .await
        .unwrap();
    assert_eq!(many.wait_for(INSIDE, 1).await, vec![1]);
    assert_eq!(inside.wait_for(1).await.len(), 1);
}

/// `inviter` adds the holder of `key_package` to `channel`: the commit and its Welcome
/// published and merged.
async fn add_package(
    client: &mut RelayClient<Channel>,
    inviter: &Member,
    channel: &str,
    key_package: &[u8],
) {
    let added = inviter.engine.add_members(channel, &[key_package]).unwrap();
    let publish = pb::PublishRequest {
        welcome: added.welcome.clone().into(),
        ..request(channel, added.commit.into())
    };
    client.publish(inviter.request(publish)).await.unwrap();
    inviter.engine.merge_pending_commit(channel).unwrap();
}

/// Alice (full key) claims a package of bob's address for `channel`, adds him and invites him:
/// the invitation's id.
async fn invite_bob(client: &mut RelayClient<Channel>, alice: &Member, channel: &str) -> u64 {
    let claim = pb::ClaimKeyPackageRequest {
        account: "bob".to_owned(),
        identity: b"bob".to_vec().into(),
        channel: channel.to_owned(),
    };
    let claimed = client
        .claim_key_package(alice.request(claim))
        .await
        .unwrap()
        .into_inner();
    add_package(client, alice, channel, &claimed.key_package).await;
    let invite = pb::InviteRequest {
        channel: channel.to_owned(),
        key_package_ref: claimed.key_package_ref,
        inviter_leaf: alice.binding(channel).leaf_index,
    };
    client
        .invite(alice.request(invite))
        .await
        .unwrap()
        .into_inner()
        .invitation_id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scoped_key_sees_and_takes_only_its_channels_invitations() {
    let relay = relay().await;
    let mut client = relay.client().await;
    let mut alice = alice(&mut client).await;
    alice.token = Some(FULL.to_owned());
    let mut bob = Member::with_token("bob", "bob.k1");
    let packages = bob
        .engine
        .directory_key_packages("bob", 2, true)
        .unwrap()
        .into_iter()
        .map(|p| pb::KeyPackageOffer {
            key_package: p.key_package.into(),
            binding: p.binding.into(),
        })
        .collect();
    let offer = pb::OfferKeyPackagesRequest {
        identity: b"bob".to_vec().into(),
        packages,
        replace: false,
    };
    client.offer_key_packages(bob.request(offer)).await.unwrap();
    let policy = pb::SetInvitationPolicyRequest {
        identity: b"bob".to_vec().into(),
        policy: Some(pb::InvitationPolicy {
            accounts: vec!["alice".to_owned()],
        }),
    };
    client
        .set_invitation_policy(bob.request(policy))
        .await
        .unwrap();
    let into_outside = invite_bob(&mut client, &alice, OUTSIDE).await;
    let into_inside = invite_bob(&mut client, &alice, INSIDE).await;

    let list = |wait_ms| pb::ListInvitationsRequest {
        identity: b"bob".to_vec().into(),
        after_id: 0,
        wait_ms,
    };
    let listed = |answer: pb::ListInvitationsResponse| -> Vec<(u64, String)> {
        answer
            .invitations
            .into_iter()
            .map(|i| (i.id, i.channel))
            .collect()
    };
    let all = client.list_invitations(bob.request(list(0))).await.unwrap();
    assert_eq!(listed(all.into_inner()).len(), 2);

    // Bob's scoped key: the invitation outside is left out of the list, and neither opened
    // nor settled.
    bob.token = Some("bob.k2+acme/ops/~".to_owned());
    let scoped = client.list_invitations(bob.request(list(0))).await.unwrap();
    assert_eq!(
        listed(scoped.into_inner()),
        vec![(into_inside, INSIDE.to_owned())]
    );
    let open = |id| pb::OpenInvitationRequest {
        identity: b"bob".to_vec().into(),
        id,
    };
    let settle = |id| pb::SettleInvitationRequest {
        identity: b"bob".to_vec().into(),
        id,
        accept: false,
    };
    assert_outside(
        client
            .open_invitation(bob.request(open(into_outside)))
            .await,
        OUTSIDE,
    );
    assert_outside(
        client
            .settle_invitation(bob.request(settle(into_outside)))
            .await,
        OUTSIDE,
    );
    let opened = client
        .open_invitation(bob.request(open(into_inside)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(opened.channel, INSIDE);
    client
        .settle_invitation(bob.request(settle(into_inside)))
        .await
        .unwrap();
    // A held list does not answer with the invitation it may not see: it waits it out.
    let held = client
        .list_invitations(bob.request(list(300)))
        .await
        .unwrap();
    assert!(held.into_inner().invitations.is_empty());
    // The one outside is still pending, for the full key.
    bob.token = Some("bob.k1".to_owned());
    let all = client.list_invitations(bob.request(list(0))).await.unwrap();
    assert_eq!(
        listed(all.into_inner()),
        vec![(into_outside, OUTSIDE.to_owned())]
    );
}
