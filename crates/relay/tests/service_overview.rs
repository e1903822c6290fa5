//! The console's reads (`static_relay::overview`): an account's channels with their rosters,
//! members only and filtered by a key's patterns, paged; and its application messages per
//! minute. Members are real static-mls engines; tokens are [`FakeVerify`]'s (`account.key`).
#![allow(clippy::unwrap_used)]

mod service_support;

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use static_relay::ChannelPatterns;

use service_support::*;

const OTHER: &str = "acme/agents/other";

fn now_ms() -> i64 {
    let since = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
    i64::try_from(since.as_millis()).unwrap()
}

fn patterns(list: &[&str]) -> ChannelPatterns {
    ChannelPatterns::parse(list).unwrap()
}

/// Alice (account acme) creates CHANNEL and adds Bob (account bobco), then sends two
/// application messages; she also has OTHER, alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_account_sees_its_channels_and_rate_and_no_other() {
    let relay = Relay::start_with(|_| {}, Some(Arc::new(FakeVerify))).await;
    let mut client = relay.client().await;
    let alice = Member::with_token("alice", "acme.key-a");
    let bob = Member::with_token("bob", "bobco.key-b");
    alice.create(&mut client, CHANNEL).await;
    alice.add(&mut client, CHANNEL, &[&bob]).await;
    for payload in [b"one", b"two"] {
        alice
            .publish(&mut client, CHANNEL, application(CHANNEL, 1, payload))
            .await
            .unwrap();
    }
    alice.create(&mut client, OTHER).await;
    let server = relay.server();

    // Bob: the shared channel only, with both members bound.
    let page = server.account_channels("bobco", None, 0, 50).await.unwrap();
    assert_eq!(page.next_after, None);
    assert_eq!(page.channels.len(), 1);
    let channel = &page.channels[0];
    assert_eq!(channel.name, CHANNEL);
    assert_eq!(channel.epoch, 1);
    assert_eq!(channel.member_count, 2);
    assert!(channel.head_seq >= 3, "{}", channel.head_seq);
    let last = channel.last_activity_ms.unwrap();
    assert!((now_ms() - last).abs() < 60_000, "{last}");
    assert_eq!(channel.policy, static_relay::Policy::default());
    let roster: Vec<(&[u8], Option<&str>)> = channel
        .members
        .iter()
        .map(|m| (m.identity.as_slice(), m.account.as_deref()))
        .collect();
    assert_eq!(
        roster,
        [(&b"alice"[..], Some("acme")), (&b"bob"[..], Some("bobco"))]
    );

    // Nobody else sees it; patterns filter; pages follow the cursor.
    let none = server.account_channels("carol", None, 0, 50).await.unwrap();
    assert!(none.channels.is_empty() && none.next_after.is_none());
    let elsewhere = patterns(&["other/*/*"]);
    let filtered = server
        .account_channels("acme", Some(&elsewhere), 0, 50)
        .await
        .unwrap();
    assert!(filtered.channels.is_empty());
    let first = server.account_channels("acme", None, 0, 1).await.unwrap();
    assert_eq!(first.channels.len(), 1);
    assert_eq!(first.channels[0].name, CHANNEL);
    let after = first.next_after.unwrap();
    let second = server
        .account_channels("acme", None, after, 1)
        .await
        .unwrap();
    assert_eq!(second.channels.len(), 1);
    assert_eq!(second.channels[0].name, OTHER);
    assert_eq!(second.channels[0].member_count, 1);

    // The rate: Alice's two application messages (not her commits), none of Bob's.
    let rate = server.account_rate("acme", None, now_ms()).await.unwrap();
    assert_eq!(rate.len(), 60);
    assert_eq!(rate.iter().sum::<u64>(), 2);
    assert_eq!(rate[58..].iter().sum::<u64>(), 2);
    let bobs = server.account_rate("bobco", None, now_ms()).await.unwrap();
    assert_eq!(bobs.iter().sum::<u64>(), 0);
    let outside = server
        .account_rate("acme", Some(&elsewhere), now_ms())
        .await
        .unwrap();
    assert_eq!(outside.iter().sum::<u64>(), 0);
    // An hour later, they are out of the window.
    let later = server
        .account_rate("acme", None, now_ms() + 3_600_000)
        .await
        .unwrap();
    assert_eq!(later.iter().sum::<u64>(), 0);
}

/// A member removed from a channel no longer sees it, though its row was read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_member_no_longer_sees_the_channel() {
    let relay = Relay::start_with(|_| {}, Some(Arc::new(FakeVerify))).await;
    let mut client = relay.client().await;
    let alice = Member::with_token("alice", "acme.key-a");
    let bob = Member::with_token("bob", "bobco.key-b");
    alice.create(&mut client, CHANNEL).await;
    alice.add(&mut client, CHANNEL, &[&bob]).await;
    let server = relay.server();
    assert_eq!(
        server
            .account_channels("bobco", None, 0, 50)
            .await
            .unwrap()
            .channels
            .len(),
        1
    );
    let removal = alice.remove(CHANNEL, "bob");
    alice
        .publish(&mut client, CHANNEL, removal.clone())
        .await
        .unwrap();
    alice.apply(CHANNEL, &removal);
    let page = server.account_channels("bobco", None, 0, 50).await.unwrap();
    assert!(page.channels.is_empty(), "{page:?}");
}
