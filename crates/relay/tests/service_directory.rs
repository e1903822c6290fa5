//! The key-package directory and invitations (proto/relay.proto, OfferKeyPackages ..
//! SettleInvitation; docs/design.md §5.5): an agent lists key packages under its address, a
//! member of a channel claims one (as the address's policy allows), adds the agent and records
//! the invitation, which the agent lists, opens and settles. Each test fails if the rule it
//! names were not enforced. Members are real static-mls engines; tokens are [`FakeVerify`]'s
//! (`account.key`).
#![allow(clippy::unwrap_used)]

mod service_support;

use std::collections::HashSet;
use std::sync::Arc;

use static_proto::directory::{MAX_ONE_TIME_PACKAGES, NO_SUCH_ADDRESS};
use static_relay::error::RETRY_AFTER_TRAILER;
use static_relay::pb::relay_client::RelayClient;
use static_relay::{pb, RelayConfig};
use tonic::transport::Channel;
use tonic::{Code, Status};

use service_support::postgres;
use service_support::*;

/// A relay that checks tokens, configured by `configure`.
async fn relay_with(configure: impl FnOnce(&mut RelayConfig)) -> Relay {
    Relay::start_with(configure, Some(Arc::new(FakeVerify))).await
}

/// `count` one-time packages of `member` (and a last-resort one), bound to `account`.
fn packages_for(
    member: &Member,
    account: &str,
    count: usize,
    last_resort: bool,
) -> Vec<pb::KeyPackageOffer> {
    member
        .engine
        .directory_key_packages(account, count, last_resort)
        .unwrap()
        .into_iter()
        .map(|p| pb::KeyPackageOffer {
            key_package: p.key_package.into(),
            binding: p.binding.into(),
        })
        .collect()
}

/// `member`'s packages, bound to its own account.
fn packages(member: &Member, count: usize, last_resort: bool) -> Vec<pb::KeyPackageOffer> {
    packages_for(member, &member.account, count, last_resort)
}

async fn offer(
    client: &mut RelayClient<Channel>,
    member: &Member,
    packages: Vec<pb::KeyPackageOffer>,
    replace: bool,
) -> Result<pb::OfferKeyPackagesResponse, Status> {
    let request = pb::OfferKeyPackagesRequest {
        identity: member.name.clone().into_bytes().into(),
        packages,
        replace,
    };
    client
        .offer_key_packages(member.request(request))
        .await
        .map(tonic::Response::into_inner)
}

async fn set_policy(client: &mut RelayClient<Channel>, member: &Member, accounts: &[&str]) {
    let request = pb::SetInvitationPolicyRequest {
        identity: member.name.clone().into_bytes().into(),
        policy: Some(pb::InvitationPolicy {
            accounts: accounts.iter().map(|a| (*a).to_owned()).collect(),
        }),
    };
    client
        .set_invitation_policy(member.request(request))
        .await
        .unwrap();
}

fn claim_request(target: &Member, channel: &str) -> pb::ClaimKeyPackageRequest {
    pb::ClaimKeyPackageRequest {
        account: target.account.clone(),
        identity: target.name.clone().into_bytes().into(),
        channel: channel.to_owned(),
    }
}

/// `claimer` claims a package of `target`'s address for `channel`.
async fn claim(
    client: &mut RelayClient<Channel>,
    claimer: &Member,
    target: &Member,
    channel: &str,
) -> Result<pb::ClaimKeyPackageResponse, Status> {
    client
        .claim_key_package(claimer.request(claim_request(target, channel)))
        .await
        .map(tonic::Response::into_inner)
}

/// `inviter` adds the holder of `key_package` to `channel` (the commit and its Welcome
/// published, merged): the Welcome.
async fn add_package(
    client: &mut RelayClient<Channel>,
    inviter: &Member,
    channel: &str,
    key_package: &[u8],
) -> Vec<u8> {
    let added = inviter.engine.add_members(channel, &[key_package]).unwrap();
    let publish = pb::PublishRequest {
        welcome: added.welcome.clone().into(),
        ..request(channel, added.commit.into())
    };
    client.publish(inviter.request(publish)).await.unwrap();
    inviter.engine.merge_pending_commit(channel).unwrap();
    added.welcome
}

async fn invite(
    client: &mut RelayClient<Channel>,
    inviter: &Member,
    channel: &str,
    key_package_ref: &[u8],
    leaf: u32,
) -> Result<u64, Status> {
    let request = pb::InviteRequest {
        channel: channel.to_owned(),
        key_package_ref: key_package_ref.to_vec().into(),
        inviter_leaf: leaf,
    };
    client
        .invite(inviter.request(request))
        .await
        .map(|r| r.into_inner().invitation_id)
}

/// `inviter` invites into `channel` with its own leaf.
async fn invite_as(
    client: &mut RelayClient<Channel>,
    inviter: &Member,
    channel: &str,
    key_package_ref: &[u8],
) -> Result<u64, Status> {
    let leaf = inviter.binding(channel).leaf_index;
    invite(client, inviter, channel, key_package_ref, leaf).await
}

/// `member`'s pending invitations (of its address under `identity`).
async fn list(
    client: &mut RelayClient<Channel>,
    member: &Member,
    identity: &str,
) -> Vec<pb::Invitation> {
    let request = pb::ListInvitationsRequest {
        identity: identity.as_bytes().to_vec().into(),
        after_id: 0,
        wait_ms: 0,
    };
    client
        .list_invitations(member.request(request))
        .await
        .unwrap()
        .into_inner()
        .invitations
}

async fn open(
    client: &mut RelayClient<Channel>,
    member: &Member,
    identity: &str,
    id: u64,
) -> Result<pb::OpenInvitationResponse, Status> {
    let request = pb::OpenInvitationRequest {
        identity: identity.as_bytes().to_vec().into(),
        id,
    };
    client
        .open_invitation(member.request(request))
        .await
        .map(tonic::Response::into_inner)
}

async fn settle(
    client: &mut RelayClient<Channel>,
    member: &Member,
    identity: &str,
    id: u64,
    accept: bool,
) -> Result<(), Status> {
    let request = pb::SettleInvitationRequest {
        identity: identity.as_bytes().to_vec().into(),
        id,
        accept,
    };
    client
        .settle_invitation(member.request(request))
        .await
        .map(|_| ())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_is_claimed_invited_and_joins_through_the_directory() {
    let relay = relay_with(|_| {}).await;
    let mut client = relay.client().await;
    let alice = Member::with_token("alice", "alice.k1");
    let bob = Member::with_token("bob", "bob.k1");
    let carol = Member::with_token("carol", "carol.k1");

    let stock = offer(&mut client, &bob, packages(&bob, 2, true), false)
        .await
        .unwrap();
    assert_eq!((stock.one_time, stock.last_resort), (2, true));
    let now_ms = u64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis(),
    )
    .unwrap();
    assert!(stock.earliest_expiry_ms > now_ms, "{stock:?}");
    set_policy(&mut client, &bob, &["alice"]).await;

    alice.create(&mut client, CHANNEL).await;
    let claimed = claim(&mut client, &alice, &bob, CHANNEL).await.unwrap();
    assert!(!claimed.last_resort);
    assert_eq!(
        claimed.key_package_ref.to_vec(),
        key_package_ref(&claimed.key_package)
    );
    // The stock went down by one.
    let stock = offer(&mut client, &bob, vec![], false).await.unwrap();
    assert_eq!((stock.one_time, stock.last_resort), (1, true));

    let welcome = add_package(&mut client, &alice, CHANNEL, &claimed.key_package).await;
    let id = invite_as(&mut client, &alice, CHANNEL, &claimed.key_package_ref)
        .await
        .unwrap();
    // Idempotent: recorded once.
    let again = invite_as(&mut client, &alice, CHANNEL, &claimed.key_package_ref)
        .await
        .unwrap();
    assert_eq!(id, again);

    let listed = list(&mut client, &bob, "bob").await;
    assert_eq!(listed.len(), 1, "{listed:?}");
    let invitation = &listed[0];
    assert_eq!(invitation.id, id);
    assert_eq!(invitation.channel, CHANNEL);
    assert_eq!(invitation.inviter_identity.as_ref(), b"alice");
    assert_eq!(invitation.inviter_account, "alice");
    assert!(!invitation.last_resort);
    assert!(invitation.expires_at_ms > invitation.created_at_ms);

    // Another account reaches none of bob's invitations (its own address of that identity
    // has none).
    assert!(list(&mut client, &carol, "bob").await.is_empty());
    let status = open(&mut client, &carol, "bob", id).await.unwrap_err();
    assert_eq!(status.code(), Code::NotFound);
    let status = settle(&mut client, &carol, "bob", id, false)
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::NotFound);
    // Nor does bob under another identity.
    assert!(list(&mut client, &bob, "bob-other").await.is_empty());

    // Bob is no member yet, and opens his invitation all the same.
    let opened = open(&mut client, &bob, "bob", id).await.unwrap();
    assert_eq!(opened.welcome.as_ref(), welcome.as_slice());
    assert_eq!((opened.channel.as_str(), opened.epoch), (CHANNEL, 1));
    bob.join(&mut client, CHANNEL, &opened.welcome).await;
    settle(&mut client, &bob, "bob", id, true).await.unwrap();
    settle(&mut client, &bob, "bob", id, true).await.unwrap();
    assert!(list(&mut client, &bob, "bob").await.is_empty());
    let status = open(&mut client, &bob, "bob", id).await.unwrap_err();
    assert_eq!(status.code(), Code::NotFound);
    // Bob is a member: his leaf is bound to his account.
    let members = bob.list_members(&mut client, CHANNEL).await.unwrap();
    assert!(members.members.iter().any(|m| m.account == "bob"));
    // Nothing of it is due for pruning yet.
    assert_eq!(relay.server().prune_now().await.unwrap().directory, 0);
    assert!(list(&mut client, &bob, "bob").await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_anonymous_agent_has_an_address_of_the_anonymous_account() {
    let relay = Relay::start_with(|c| c.allow_anonymous = true, Some(Arc::new(FakeVerify))).await;
    let mut client = relay.client().await;
    let agent = Member::anonymous("agent");
    let other = Member::anonymous("other");
    let alice = Member::with_token("alice", "alice.k1");
    let stock = offer(&mut client, &agent, packages(&agent, 1, false), false)
        .await
        .unwrap();
    assert_eq!(stock.one_time, 1);
    alice.create(&mut client, CHANNEL).await;
    // Alice's account is not the anonymous one: the default policy refuses her.
    let status = claim(&mut client, &alice, &agent, CHANNEL)
        .await
        .unwrap_err();
    assert_status(&status, Code::NotFound, NO_SUCH_ADDRESS);
    // Another anonymous caller is of the address's own account.
    other.create(&mut client, "anon/a/b").await;
    let claimed = claim(&mut client, &other, &agent, "anon/a/b")
        .await
        .unwrap();
    assert!(!claimed.last_resort);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusing_policy_reads_as_an_unknown_address() {
    let relay = relay_with(|_| {}).await;
    let mut client = relay.client().await;
    let bob = Member::with_token("bob", "bob.k1");
    let bob_phone = Member::with_token("bob-phone", "bob.k2");
    let carol = Member::with_token("carol", "carol.k1");
    let nobody = Member::with_token("nobody", "nobody.k1");
    offer(&mut client, &bob, packages(&bob, 1, true), false)
        .await
        .unwrap();
    carol.create(&mut client, "carolorg/a/b").await;
    bob_phone.create(&mut client, "bob/a/b").await;

    // The default policy: bob's own account only.
    let refused = claim(&mut client, &carol, &bob, "carolorg/a/b")
        .await
        .unwrap_err();
    assert_status(&refused, Code::NotFound, NO_SUCH_ADDRESS);
    let unknown = claim(&mut client, &carol, &nobody, "carolorg/a/b")
        .await
        .unwrap_err();
    assert_status(&unknown, Code::NotFound, NO_SUCH_ADDRESS);
    let own = claim(&mut client, &bob_phone, &bob, "bob/a/b")
        .await
        .unwrap();
    assert!(!own.last_resort);

    // A policy naming another account still refuses carol; "*" lets her.
    set_policy(&mut client, &bob, &["dave"]).await;
    let refused = claim(&mut client, &carol, &bob, "carolorg/a/b")
        .await
        .unwrap_err();
    assert_status(&refused, Code::NotFound, NO_SUCH_ADDRESS);
    set_policy(&mut client, &bob, &["*"]).await;
    let claimed = claim(&mut client, &carol, &bob, "carolorg/a/b")
        .await
        .unwrap();
    assert!(
        claimed.last_resort,
        "the one-time package went to bob-phone"
    );

    // An address with no package left reads the same.
    let empty = Member::with_token("empty", "empty.k1");
    offer(&mut client, &empty, packages(&empty, 1, false), false)
        .await
        .unwrap();
    set_policy(&mut client, &empty, &["*"]).await;
    claim(&mut client, &carol, &empty, "carolorg/a/b")
        .await
        .unwrap();
    let gone = claim(&mut client, &carol, &empty, "carolorg/a/b")
        .await
        .unwrap_err();
    assert_status(&gone, Code::NotFound, NO_SUCH_ADDRESS);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn packages_that_do_not_check_are_refused_and_nothing_is_listed() {
    let relay = relay_with(|_| {}).await;
    let mut client = relay.client().await;
    let bob = Member::with_token("bob", "bob.k1");

    // Bound to another account.
    let mut offers = packages(&bob, 2, false);
    offers.extend(packages_for(&bob, "mallory", 1, false));
    let status = offer(&mut client, &bob, offers, false).await.unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");

    // Its credential is not the request's identity.
    let request = pb::OfferKeyPackagesRequest {
        identity: b"someone-else".to_vec().into(),
        packages: packages(&bob, 1, false),
        replace: false,
    };
    let status = client
        .offer_key_packages(bob.request(request))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");

    // Tampered with (a byte of its signed content flipped).
    let mut offers = packages(&bob, 1, false);
    let mut bytes = offers[0].key_package.to_vec();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x01;
    offers[0].key_package = bytes.into();
    let status = offer(&mut client, &bob, offers, false).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");

    // Not a key package at all, and too large.
    let garbage = vec![pb::KeyPackageOffer {
        key_package: vec![0u8; 17 * 1024].into(),
        binding: vec![].into(),
    }];
    let status = offer(&mut client, &bob, garbage, false).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    // An empty identity.
    let request = pb::OfferKeyPackagesRequest {
        identity: vec![].into(),
        packages: vec![],
        replace: false,
    };
    let status = client
        .offer_key_packages(bob.request(request))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");

    let stock = offer(&mut client, &bob, vec![], false).await.unwrap();
    assert_eq!((stock.one_time, stock.last_resort), (0, false));
    assert_eq!(stock.earliest_expiry_ms, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_time_packages_go_out_once_under_concurrent_claims() {
    let relay = relay_with(|c| c.claim_rate_per_address = 0.0).await;
    let mut client = relay.client().await;
    let alice = Member::with_token("alice", "alice.k1");
    let bob = Member::with_token("bob", "bob.k1");
    let stock = offer(&mut client, &bob, packages(&bob, 10, true), false)
        .await
        .unwrap();
    assert_eq!((stock.one_time, stock.last_resort), (10, true));
    // Listing them again is a no-op.
    set_policy(&mut client, &bob, &["alice"]).await;
    alice.create(&mut client, CHANNEL).await;

    let mut claims = Vec::new();
    for _ in 0..24 {
        let mut client = client.clone();
        let request = claim_request(&bob, CHANNEL);
        claims.push(tokio::spawn(async move {
            client
                .claim_key_package(authed(request, "alice.k1"))
                .await
                .unwrap()
                .into_inner()
        }));
    }
    let mut one_time = HashSet::new();
    let mut last_resort = HashSet::new();
    for claimed in claims {
        let claimed = claimed.await.unwrap();
        if claimed.last_resort {
            last_resort.insert(claimed.key_package_ref.to_vec());
        } else {
            assert!(
                one_time.insert(claimed.key_package_ref.to_vec()),
                "a one-time package was handed out twice"
            );
        }
    }
    assert_eq!(one_time.len(), 10);
    assert_eq!(last_resort.len(), 1, "one last-resort package, reused");
    assert!(one_time.is_disjoint(&last_resort));
    let stock = offer(&mut client, &bob, vec![], false).await.unwrap();
    assert_eq!((stock.one_time, stock.last_resort), (0, true));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stock_cap_holds_under_concurrent_offers() {
    let relay = relay_with(|_| {}).await;
    let mut client = relay.client().await;
    let bob = Member::with_token("bob", "bob.k1");
    let all = packages(&bob, 80, false);
    let mut offers = Vec::new();
    for chunk in all.chunks(10) {
        let mut client = client.clone();
        let request = pb::OfferKeyPackagesRequest {
            identity: b"bob".to_vec().into(),
            packages: chunk.to_vec(),
            replace: false,
        };
        offers.push(tokio::spawn(async move {
            client.offer_key_packages(authed(request, "bob.k1")).await
        }));
    }
    // Per request of 10, in order: listed or refused.
    let mut results = Vec::new();
    for offered in offers {
        match offered.await.unwrap() {
            Ok(_) => results.push(true),
            Err(status) => {
                assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
                results.push(false);
            }
        }
    }
    let listed = results.iter().filter(|ok| **ok).count();
    let refused = results.len() - listed;
    assert_eq!((listed, refused), (6, 2));
    let stock = offer(&mut client, &bob, vec![], false).await.unwrap();
    assert_eq!(stock.one_time, 60);
    // Filled up to the cap; listing packages again is a no-op, even at the cap.
    let stock = offer(&mut client, &bob, packages(&bob, 4, false), false)
        .await
        .unwrap();
    assert_eq!(stock.one_time as usize, MAX_ONE_TIME_PACKAGES);
    let listed_again: Vec<_> = all
        .chunks(10)
        .zip(&results)
        .filter(|(_, ok)| **ok)
        .flat_map(|(chunk, _)| chunk.to_vec())
        .take(5)
        .collect();
    assert_eq!(
        offer(&mut client, &bob, listed_again, false)
            .await
            .unwrap()
            .one_time,
        64
    );
    // Past the cap, an offer is refused before its packages are checked (these would be
    // PERMISSION_DENIED: bound to another account).
    let status = offer(
        &mut client,
        &bob,
        packages_for(&bob, "mallory", 1, false),
        false,
    )
    .await
    .unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    // A last-resort package is no one-time one: listed at the cap.
    let stock = offer(&mut client, &bob, packages(&bob, 0, true), false)
        .await
        .unwrap();
    assert_eq!((stock.one_time, stock.last_resort), (64, true));
    // `replace` drops the unclaimed ones first.
    let stock = offer(&mut client, &bob, packages(&bob, 3, true), true)
        .await
        .unwrap();
    assert_eq!((stock.one_time, stock.last_resort), (3, true));
    // Too many in one request.
    let status = offer(&mut client, &bob, packages(&bob, 65, false), false)
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_account_claims_within_its_rate() {
    // 1 a second, a burst of 4.
    let relay = relay_with(|c| {
        c.claim_rate_per_account = 1.0;
        c.claim_rate_per_address = 0.0;
    })
    .await;
    let mut client = relay.client().await;
    let alice = Member::with_token("alice", "alice.k1");
    let bob = Member::with_token("bob", "bob.k1");
    offer(&mut client, &bob, packages(&bob, 0, true), false)
        .await
        .unwrap();
    set_policy(&mut client, &bob, &["*"]).await;
    alice.create(&mut client, CHANNEL).await;
    for _ in 0..4 {
        claim(&mut client, &alice, &bob, CHANNEL).await.unwrap();
    }
    let status = claim(&mut client, &alice, &bob, CHANNEL).await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(trailer(&status, RETRY_AFTER_TRAILER).is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strangers_do_not_spend_an_address_claim_budget() {
    // An address: 1 claim a second, a burst of 20.
    let relay = relay_with(|c| {
        c.claim_rate_per_account = 0.0;
        c.claim_rate_per_address = 1.0;
    })
    .await;
    let mut client = relay.client().await;
    let alice = Member::with_token("alice", "alice.k1");
    let bob = Member::with_token("bob", "bob.k1");
    let mallory = Member::with_token("mallory", "mallory.k1");
    offer(&mut client, &bob, packages(&bob, 0, true), false)
        .await
        .unwrap();
    set_policy(&mut client, &bob, &["alice"]).await;
    alice.create(&mut client, CHANNEL).await;
    mallory.create(&mut client, "mal/a/b").await;
    for _ in 0..30 {
        let status = claim(&mut client, &mallory, &bob, "mal/a/b")
            .await
            .unwrap_err();
        assert_status(&status, Code::NotFound, NO_SUCH_ADDRESS);
    }
    for _ in 0..20 {
        claim(&mut client, &alice, &bob, CHANNEL).await.unwrap();
    }
    let status = claim(&mut client, &alice, &bob, CHANNEL).await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(trailer(&status, RETRY_AFTER_TRAILER).is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_address_with_too_many_pending_invitations_is_not_claimed() {
    let relay = relay_with(|c| c.max_pending_invitations = 2).await;
    let mut client = relay.client().await;
    let alice = Member::with_token("alice", "alice.k1");
    let bob = Member::with_token("bob", "bob.k1");
    offer(&mut client, &bob, packages(&bob, 0, true), false)
        .await
        .unwrap();
    set_policy(&mut client, &bob, &["alice"]).await;
    let mut ids = Vec::new();
    for name in ["acme/a/one", "acme/a/two"] {
        alice.create(&mut client, name).await;
        let claimed = claim(&mut client, &alice, &bob, name).await.unwrap();
        assert!(claimed.last_resort);
        add_package(&mut client, &alice, name, &claimed.key_package).await;
        ids.push(
            invite_as(&mut client, &alice, name, &claimed.key_package_ref)
                .await
                .unwrap(),
        );
    }
    alice.create(&mut client, "acme/a/three").await;
    let status = claim(&mut client, &alice, &bob, "acme/a/three")
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    // Declined: no longer pending.
    settle(&mut client, &bob, "bob", ids[0], false)
        .await
        .unwrap();
    assert_eq!(list(&mut client, &bob, "bob").await.len(), 1);
    claim(&mut client, &alice, &bob, "acme/a/three")
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_members_claim_and_invite_with_their_claim_and_welcome() {
    let relay = relay_with(|_| {}).await;
    let mut client = relay.client().await;
    let alice = Member::with_token("alice", "alice.k1");
    let bob = Member::with_token("bob", "bob.k1");
    let carol = Member::with_token("carol", "carol.k1");
    offer(&mut client, &bob, packages(&bob, 2, false), false)
        .await
        .unwrap();
    set_policy(&mut client, &bob, &["*"]).await;
    alice.create(&mut client, CHANNEL).await;

    // Carol is no member of alice's channel.
    let status = claim(&mut client, &carol, &bob, CHANNEL).await.unwrap_err();
    assert_status(&status, Code::PermissionDenied, &not_a_member(CHANNEL));
    // Nor did her refusal take a package.
    let stock = offer(&mut client, &bob, vec![], false).await.unwrap();
    assert_eq!(stock.one_time, 2);

    let claimed = claim(&mut client, &alice, &bob, CHANNEL).await.unwrap();
    // No Welcome names it yet.
    let status = invite_as(&mut client, &alice, CHANNEL, &claimed.key_package_ref)
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::NotFound, "{status:?}");
    // A ref alice never claimed.
    let status = invite_as(&mut client, &alice, CHANNEL, b"not a claimed ref")
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::NotFound, "{status:?}");
    add_package(&mut client, &alice, CHANNEL, &claimed.key_package).await;
    // A leaf that is not alice's.
    let status = invite(&mut client, &alice, CHANNEL, &claimed.key_package_ref, 1)
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    // Carol, no member, cannot record it.
    let status = invite(&mut client, &carol, CHANNEL, &claimed.key_package_ref, 0)
        .await
        .unwrap_err();
    assert_status(&status, Code::PermissionDenied, &not_a_member(CHANNEL));
    invite_as(&mut client, &alice, CHANNEL, &claimed.key_package_ref)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_directory_call_needs_a_valid_token() {
    let relay = relay_with(|_| {}).await;
    let mut client = relay.client().await;
    for token in ["garbage", "bob.k1.0"] {
        let bad = Member::with_token("bob", token);
        let statuses = [
            offer(&mut client, &bad, vec![], false).await.unwrap_err(),
            client
                .set_invitation_policy(bad.request(pb::SetInvitationPolicyRequest {
                    identity: b"bob".to_vec().into(),
                    policy: None,
                }))
                .await
                .unwrap_err(),
            claim(&mut client, &bad, &bad, CHANNEL).await.unwrap_err(),
            invite(&mut client, &bad, CHANNEL, b"ref", 0)
                .await
                .unwrap_err(),
            client
                .list_invitations(bad.request(pb::ListInvitationsRequest {
                    identity: b"bob".to_vec().into(),
                    after_id: 0,
                    wait_ms: 0,
                }))
                .await
                .unwrap_err(),
            open(&mut client, &bad, "bob", 1).await.unwrap_err(),
            settle(&mut client, &bad, "bob", 1, true).await.unwrap_err(),
        ];
        for status in statuses {
            assert_eq!(status.code(), Code::Unauthenticated, "{token}: {status:?}");
        }
    }
}

fn held_list(identity: &str, wait_ms: u32) -> pb::ListInvitationsRequest {
    pb::ListInvitationsRequest {
        identity: identity.as_bytes().to_vec().into(),
        after_id: 0,
        wait_ms,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_list_is_answered_by_the_invite_and_ends_with_its_token() {
    let mut relay = relay_with(|_| {}).await;
    let mut client = relay.client().await;
    let alice = Member::with_token("alice", "alice.k1");
    let bob = Member::with_token("bob", "bob.k1");
    offer(&mut client, &bob, packages(&bob, 2, true), false)
        .await
        .unwrap();
    set_policy(&mut client, &bob, &["alice"]).await;
    alice.create(&mut client, CHANNEL).await;

    // Nothing pending: the call is held, then answered empty when its wait is over.
    let started = std::time::Instant::now();
    let empty = client
        .list_invitations(bob.request(held_list("bob", 300)))
        .await
        .unwrap()
        .into_inner();
    assert!(empty.invitations.is_empty());
    assert!(started.elapsed() >= std::time::Duration::from_millis(290));

    // A held call is answered as soon as the invitation is recorded, not at its next check.
    let mut waiting = relay.client().await;
    let held = bob.request(held_list("bob", 20_000));
    let listing = tokio::spawn(async move { waiting.list_invitations(held).await });
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let claimed = claim(&mut client, &alice, &bob, CHANNEL).await.unwrap();
    add_package(&mut client, &alice, CHANNEL, &claimed.key_package).await;
    let invited_at = std::time::Instant::now();
    let id = invite_as(&mut client, &alice, CHANNEL, &claimed.key_package_ref)
        .await
        .unwrap();
    let answered = listing.await.unwrap().unwrap().into_inner();
    assert!(
        invited_at.elapsed() < std::time::Duration::from_millis(500),
        "{:?}",
        invited_at.elapsed()
    );
    assert_eq!(
        answered
            .invitations
            .iter()
            .map(|i| i.id)
            .collect::<Vec<_>>(),
        [id]
    );
    settle(&mut client, &bob, "bob", id, false).await.unwrap();

    // A token that expires while the call is held ends it, within a second.
    let expiring = Member::with_token("bob", "bob.k2.400");
    let started = std::time::Instant::now();
    let status = client
        .list_invitations(expiring.request(held_list("bob", 20_000)))
        .await
        .unwrap_err();
    assert_eq!(
        (status.code(), status.message()),
        (Code::Unauthenticated, "token expired")
    );
    assert!(started.elapsed() < std::time::Duration::from_millis(1500));

    // So does the relay's shutdown.
    let mut waiting = relay.client().await;
    let held = bob.request(held_list("bob", 20_000));
    let listing = tokio::spawn(async move { waiting.list_invitations(held).await });
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let stopping = std::time::Instant::now();
    relay.shutdown().await;
    let status = listing.await.unwrap().unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(stopping.elapsed() < std::time::Duration::from_secs(5));
}

// --- on PostgreSQL, two relays on one database -----------------------------------------------

/// Two relays checking tokens on one new database of a cluster of the test's own (kept as long
/// as this is); None, after saying so, without PostgreSQL.
async fn two_relays(
    name: &str,
    configure: impl Fn(&mut RelayConfig),
) -> Option<(postgres::Cluster, Relay, Relay)> {
    let cluster = postgres::Cluster::start()?;
    let url = cluster.database(name).await;
    let mut relays = Vec::new();
    for _ in 0..2 {
        let dir = tempfile::tempdir().unwrap();
        relays.push(
            Relay::on_database(
                static_relay::Database::parse(&url),
                dir,
                &configure,
                Some(Arc::new(FakeVerify)),
            )
            .await,
        );
    }
    let b = relays.pop().unwrap();
    Some((cluster, relays.pop().unwrap(), b))
}

/// On PostgreSQL: bob lists through relay B, alice claims through both relays at once (each
/// one-time package once, then the last-resort one), invites through A; bob lists, opens and
/// settles through B. Concurrent offers through both relays keep the cap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_directory_is_exact_across_relays_on_postgresql() {
    let Some((_cluster, a, b)) = two_relays("directory", |c| c.claim_rate_per_address = 0.0).await
    else {
        return;
    };
    let (mut on_a, mut on_b) = (a.client().await, b.client().await);
    let alice = Member::with_token("alice", "alice.k1");
    let bob = Member::with_token("bob", "bob.k1");
    let stock = offer(&mut on_b, &bob, packages(&bob, 6, true), false)
        .await
        .unwrap();
    assert_eq!((stock.one_time, stock.last_resort), (6, true));
    set_policy(&mut on_b, &bob, &["alice"]).await;
    alice.create(&mut on_a, CHANNEL).await;

    let mut claims = Vec::new();
    for i in 0..16 {
        let mut client = if i % 2 == 0 {
            on_a.clone()
        } else {
            on_b.clone()
        };
        let request = claim_request(&bob, CHANNEL);
        claims.push(tokio::spawn(async move {
            client
                .claim_key_package(authed(request, "alice.k1"))
                .await
                .unwrap()
                .into_inner()
        }));
    }
    let mut one_time = HashSet::new();
    let mut last_resort = Vec::new();
    for claimed in claims {
        let claimed = claimed.await.unwrap();
        if claimed.last_resort {
            last_resort.push(claimed);
        } else {
            assert!(
                one_time.insert(claimed.key_package_ref.to_vec()),
                "a one-time package was handed out twice"
            );
        }
    }
    assert_eq!((one_time.len(), last_resort.len()), (6, 10));

    let package = &last_resort[0];
    let welcome = add_package(&mut on_a, &alice, CHANNEL, &package.key_package).await;
    let id = invite_as(&mut on_a, &alice, CHANNEL, &package.key_package_ref)
        .await
        .unwrap();
    assert_eq!(
        invite_as(&mut on_b, &alice, CHANNEL, &package.key_package_ref)
            .await
            .unwrap(),
        id
    );
    let listed = list(&mut on_b, &bob, "bob").await;
    assert_eq!(listed.len(), 1);
    assert!(listed[0].last_resort);
    let opened = open(&mut on_b, &bob, "bob", id).await.unwrap();
    assert_eq!(opened.welcome.as_ref(), welcome.as_slice());
    bob.join(&mut on_b, CHANNEL, &opened.welcome).await;
    settle(&mut on_b, &bob, "bob", id, true).await.unwrap();
    assert!(list(&mut on_a, &bob, "bob").await.is_empty());

    // The cap, with offers racing through both relays: 60 listed of 80.
    let all = packages(&bob, 80, false);
    let mut offers = Vec::new();
    for (i, chunk) in all.chunks(10).enumerate() {
        let mut client = if i % 2 == 0 {
            on_a.clone()
        } else {
            on_b.clone()
        };
        let request = pb::OfferKeyPackagesRequest {
            identity: b"bob".to_vec().into(),
            packages: chunk.to_vec(),
            replace: false,
        };
        offers.push(tokio::spawn(async move {
            client.offer_key_packages(authed(request, "bob.k1")).await
        }));
    }
    let mut listed = 0;
    for offered in offers {
        match offered.await.unwrap() {
            Ok(_) => listed += 1,
            Err(status) => assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}"),
        }
    }
    assert_eq!(listed, 6);
    let stock = offer(&mut on_a, &bob, vec![], false).await.unwrap();
    assert_eq!(stock.one_time, 60);
    // A prune pass runs the directory's statements; nothing is due yet (the settled
    // invitation is kept a day, the claims too, the packages live for months).
    assert_eq!(a.server().prune_now().await.unwrap().directory, 0);
}
