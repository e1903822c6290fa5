//! Revocation reaches the groups (docs/design.md §5.2, "Removal on revocation"): the relay is an
//! external sender of channels created with it in `external_senders`, proposes the removal of
//! leaves whose binding's key is no longer active, and a member's commit of that proposal is
//! accepted. Members are real static-mls engines; tokens are [`FakeVerify`]'s (`account.key`).
#![allow(clippy::unwrap_used)]

mod service_support;

use std::sync::Arc;

use static_mls::Incoming;
use static_relay::pb;
use static_relay::pb::relay_client::RelayClient;
use tonic::transport::Channel;
use tonic::Code;

use service_support::*;

async fn relay() -> Relay {
    Relay::start_with(|_| {}, Some(Arc::new(FakeVerify))).await
}

/// The relay's external sender key, as GetRelayInfo gives it to `member`.
async fn relay_key(client: &mut RelayClient<Channel>, member: &Member) -> Vec<u8> {
    let info = client
        .get_relay_info(member.request(pb::GetRelayInfoRequest {}))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(&info.external_sender_identity[..], b"static relay");
    assert_eq!(info.external_sender_signature_key.len(), 32);
    info.external_sender_signature_key.to_vec()
}

/// Creates `channel` with the relay (key `key`, or none) as external sender.
async fn create_with_relay(
    client: &mut RelayClient<Channel>,
    member: &Member,
    channel: &str,
    key: Option<&[u8]>,
) {
    member.engine.create_group_with_relay(channel, key).unwrap();
    let state = member.engine.public_state(channel).unwrap();
    let request = pb::CreateChannelRequest {
        channel: channel.to_owned(),
        group_info: state.group_info.into(),
        ratchet_tree: state.ratchet_tree.into(),
        binding: Some(member.binding(channel)),
    };
    client
        .create_channel(member.request(request))
        .await
        .unwrap();
}

/// The entries of `channel` after `after`, as `member` reads them.
async fn entries_after(
    client: &mut RelayClient<Channel>,
    member: &Member,
    channel: &str,
    after: u64,
    count: usize,
) -> Vec<pb::Entry> {
    let request = member.request(subscribe_request(channel, after));
    let stream = client.subscribe(request).await.unwrap().into_inner();
    let mut subscription = Subscription::of(stream);
    subscription.wait_for(count).await.to_vec()
}

fn accounts(list: &pb::ListMembersResponse) -> Vec<String> {
    list.members.iter().map(|m| m.account.clone()).collect()
}

/// Alice (key a) creates the channel naming the relay; bob (key b) joins. Key b goes inactive:
/// the relay proposes bob's removal (once per epoch), alice commits it by reference, the relay
/// accepts the commit and bob's leaf and binding are gone. Alice's leaf (key a) is untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_proposes_the_removal_of_leaves_of_an_inactive_key() {
    let relay = relay().await;
    let mut client = relay.client().await;
    let alice = Member::with_token("alice", "acme.key-a");
    let bob = Member::with_token("bob", "bobco.key-b");
    let key = relay_key(&mut client, &alice).await;
    create_with_relay(&mut client, &alice, CHANNEL, Some(&key)).await;
    let (added, ..) = alice.add(&mut client, CHANNEL, &[&bob]).await;
    assert_eq!(added.epoch, 1);

    let server = relay.server();
    assert_eq!(
        server.bound_keys("", 500).await.unwrap(),
        ["key-a", "key-b"]
    );
    assert_eq!(server.bound_keys("key-a", 500).await.unwrap(), ["key-b"]);

    let report = server
        .remove_leaves_of_keys(&["key-b".to_owned()], 100)
        .await
        .unwrap();
    assert_eq!((report.proposed, report.already, report.failed), (1, 0, 0));
    // The same leaf at the same epoch: nothing more in the log.
    let again = server
        .remove_leaves_of_keys(&["key-b".to_owned()], 100)
        .await
        .unwrap();
    assert_eq!((again.proposed, again.already), (0, 1));

    // The proposal is the log's next entry, at epoch 1, from the relay.
    let entries = entries_after(&mut client, &alice, CHANNEL, added.seq, 1).await;
    let proposal = &entries[0];
    assert_eq!(
        (proposal.seq, proposal.epoch, proposal.content_type),
        (added.seq + 1, 1, u32::from(PROPOSAL))
    );
    assert_eq!(proposal.account, "@relay");

    // A client may not publish a proposal as the external sender.
    let replayed = alice
        .publish(&mut client, CHANNEL, proposal.message.clone())
        .await
        .unwrap_err();
    assert_eq!(replayed.code(), Code::PermissionDenied, "{replayed:?}");

    match alice.apply(CHANNEL, &proposal.message) {
        Incoming::Proposal { sender } => assert_eq!(sender.as_deref(), Some(&b"static relay"[..])),
        other => panic!("not a proposal: {other:?}"),
    }
    let (committed, _) = alice.commit_proposals(&mut client, CHANNEL).await;
    assert_eq!(committed.epoch, 2);
    let members = alice.list_members(&mut client, CHANNEL).await.unwrap();
    assert_eq!(accounts(&members), ["acme"]);
    // Bob reads up to the commit that removed him, then nothing.
    let bob_reads = bob.list_members(&mut client, CHANNEL).await.unwrap_err();
    assert_eq!(bob_reads.code(), Code::PermissionDenied);
    // His key binds nothing any more.
    assert_eq!(server.bound_keys("", 500).await.unwrap(), ["key-a"]);
    let after = server
        .remove_leaves_of_keys(&["key-b".to_owned()], 100)
        .await
        .unwrap();
    assert_eq!(after, static_relay::RemovalReport::default());
}

/// A leaf bound again with another key is no longer the old key's: the old key going inactive
/// removes nothing (an agent restarted with a rolled key stays a member).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leaf_bound_again_with_a_new_key_is_not_removed() {
    let relay = relay().await;
    let mut client = relay.client().await;
    let alice = Member::with_token("alice", "acme.key-a");
    let mut bob = Member::with_token("bob", "bobco.key-b");
    let key = relay_key(&mut client, &alice).await;
    create_with_relay(&mut client, &alice, CHANNEL, Some(&key)).await;
    alice.add(&mut client, CHANNEL, &[&bob]).await;
    // Bob restarts with a rolled key and binds his leaf again.
    bob.token = Some("bobco.key-b2".to_owned());
    bob.bind(&mut client, CHANNEL).await.unwrap();
    let server = relay.server();
    assert_eq!(
        server.bound_keys("", 500).await.unwrap(),
        ["key-a", "key-b2"]
    );
    let report = server
        .remove_leaves_of_keys(&["key-b".to_owned()], 100)
        .await
        .unwrap();
    assert_eq!(report, static_relay::RemovalReport::default());
    let members = alice.list_members(&mut client, CHANNEL).await.unwrap();
    assert_eq!(accounts(&members), ["acme", "bobco"]);
}

/// A channel that does not name the relay (created before, or without it) keeps today's
/// behaviour: nothing is proposed, the leaf stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn channels_without_the_relay_as_external_sender_are_skipped() {
    let relay = relay().await;
    let mut client = relay.client().await;
    let alice = Member::with_token("alice", "acme.key-a");
    let bob = Member::with_token("bob", "bobco.key-b");
    create_with_relay(&mut client, &alice, CHANNEL, None).await;
    let (added, ..) = alice.add(&mut client, CHANNEL, &[&bob]).await;
    let report = relay
        .server()
        .remove_leaves_of_keys(&["key-b".to_owned()], 100)
        .await
        .unwrap();
    assert_eq!((report.proposed, report.skipped), (0, 1));
    // Nothing was appended after the add: the next publish takes the next seq.
    let message = alice.encrypt(CHANNEL, b"hello");
    let sent = alice.publish(&mut client, CHANNEL, message).await.unwrap();
    assert_eq!(sent.seq, added.seq + 1);
}

/// A commit that raced the proposal (moving the epoch) leaves it stale: the next pass proposes
/// again at the new epoch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_an_epoch_change_the_relay_proposes_again() {
    let relay = relay().await;
    let mut client = relay.client().await;
    let alice = Member::with_token("alice", "acme.key-a");
    let bob = Member::with_token("bob", "bobco.key-b");
    let key = relay_key(&mut client, &alice).await;
    create_with_relay(&mut client, &alice, CHANNEL, Some(&key)).await;
    alice.add(&mut client, CHANNEL, &[&bob]).await;
    let server = relay.server();
    let keys = ["key-b".to_owned()];
    assert_eq!(
        server
            .remove_leaves_of_keys(&keys, 100)
            .await
            .unwrap()
            .proposed,
        1
    );
    // Alice commits an update without the proposal (she has not read it).
    let (update, _) = alice.commit(&mut client, CHANNEL).await;
    assert_eq!(update.epoch, 2);
    let report = server.remove_leaves_of_keys(&keys, 100).await.unwrap();
    assert_eq!(report.proposed, 1);
    let entries = entries_after(&mut client, &alice, CHANNEL, update.seq, 1).await;
    assert_eq!(
        (entries[0].epoch, entries[0].content_type),
        (2, u32::from(PROPOSAL))
    );
    alice.apply(CHANNEL, &entries[0].message);
    let (committed, _) = alice.commit_proposals(&mut client, CHANNEL).await;
    assert_eq!(committed.epoch, 3);
    let members = alice.list_members(&mut client, CHANNEL).await.unwrap();
    assert_eq!(accounts(&members), ["acme"]);
}
