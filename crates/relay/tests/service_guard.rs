//! One guard for every streaming call: Subscribe, SubscribeMany, PublishStream and
//! PublishBatches each end with UNAUTHENTICATED within a second of their key's revocation or
//! their token's expiry, while the caller keeps using them; an account's streams are bounded
//! (`--relay-max-streams-per-account`). The Python tests (`tests/relay/test_guard.py`) do the
//! same through a real `static serve` (its revocation checks), on both stores.
#![allow(clippy::unwrap_used)]

mod service_support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use static_relay::pb;
use static_relay::pb::subscribe_many_request::Op;
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::Code;

use service_support::*;

/// The owner's key creates the channel; "doomed" is another key of the same account.
const OWNER: &str = "acme.owner";
/// An expiring token of "doomed": 2 s (room for the setup on a loaded machine).
const EXPIRING: &str = "acme.doomed.2000";
const DOOMED: &str = "acme.doomed";
/// How soon a revoked or expired call must end (the "within a second").
const SOON: Duration = Duration::from_secs(1);

#[derive(Clone, Copy, Debug)]
enum Ending {
    /// `end_streams_of_key`, as the server's revocation checks call it.
    Revoked,
    /// The token's own expiry.
    Expired,
}

impl Ending {
    fn token(self) -> &'static str {
        match self {
            Ending::Revoked => DOOMED,
            Ending::Expired => EXPIRING,
        }
    }

    fn message(self) -> &'static str {
        match self {
            Ending::Revoked => "api key revoked",
            Ending::Expired => "token expired",
        }
    }

    /// Ends the key's calls now (revoked), or waits until the token expires; the moment it
    /// happened.
    async fn happen(self, relay: &Relay, issued: Instant) -> Instant {
        match self {
            Ending::Revoked => {
                assert_eq!(relay.server().live_keys(), ["doomed"]);
                let ended = relay
                    .server()
                    .end_streams_of_key("doomed", "api key revoked");
                assert_eq!(ended, 1, "the call holds no guard");
                Instant::now()
            }
            Ending::Expired => {
                let at = issued + Duration::from_millis(2000);
                tokio::time::sleep_until(at.into()).await;
                at
            }
        }
    }
}

async fn relay() -> Relay {
    Relay::start_with(|_| {}, Some(Arc::new(FakeVerify))).await
}

/// A relay with `CHANNEL` created by the account "acme".
async fn relay_with_channel() -> Relay {
    let relay = relay().await;
    let mut client = relay.client().await;
    create_as(&mut client, CHANNEL, OWNER).await;
    relay
}

fn publish_request(n: u64) -> pb::PublishRequest {
    request(
        CHANNEL,
        application(CHANNEL, 0, format!("message {n}").as_bytes()),
    )
}

/// Publishes on one PublishStream call, one message every 50 ms, until the call ends: none is
/// accepted after the key's end and the call ends in time, with its reason.
async fn publish_stream_ends(ending: Ending) {
    let relay = relay_with_channel().await;
    let mut client = relay.client().await;
    let (tx, rx) = mpsc::unbounded_channel();
    let issued = Instant::now();
    let mut answers = client
        .publish_stream(authed(UnboundedReceiverStream::new(rx), ending.token()))
        .await
        .unwrap()
        .into_inner();
    tx.send(publish_request(0)).unwrap();
    assert_eq!(next_answer(&mut answers).await.unwrap().unwrap().seq, 1);
    // An expiring token's 2 s count from its check, which came before that answer: from now,
    // not from the call's opening, which put "the end" too early on a loaded machine.
    let ended_at = ending.happen(&relay, Instant::now()).await;
    // When request n was handed to the transport: only one sent before the end may be
    // accepted, however late its answer is read (a loaded machine reads it 100s of ms later).
    let mut sent = vec![issued];
    let status = loop {
        let n = sent.len() as u64;
        sent.push(Instant::now());
        // The peer's requests may already be refused by the transport (the call is over).
        let _ = tx.send(publish_request(n));
        match tokio::time::timeout(Duration::from_millis(50), answers.message()).await {
            Err(_) => {}
            Ok(Ok(Some(accepted))) => {
                // Seq k answers request k - 1 (one channel, one writer, in order).
                let request = usize::try_from(accepted.seq - 1).unwrap();
                assert!(
                    sent[request] < ended_at,
                    "seq {} accepted, sent {:?} after the end",
                    accepted.seq,
                    sent[request] - ended_at
                );
            }
            Ok(Ok(None)) => panic!("the call ended OK"),
            Ok(Err(status)) => break status,
        }
        assert!(
            ended_at.elapsed() < 2 * SOON,
            "still publishing {:?} after the end",
            ended_at.elapsed()
        );
    };
    assert_status(&status, Code::Unauthenticated, ending.message());
    assert!(ended_at.elapsed() < SOON, "{:?}", ended_at.elapsed());
    assert!(relay.server().live_keys().is_empty());
}

/// As [`publish_stream_ends`], on one PublishBatches call (as the SDK keeps one open).
async fn publish_batches_ends(ending: Ending) {
    let relay = relay_with_channel().await;
    let mut client = relay.client().await;
    let (tx, rx) = mpsc::unbounded_channel();
    let issued = Instant::now();
    let mut answers = client
        .publish_batches(authed(UnboundedReceiverStream::new(rx), ending.token()))
        .await
        .unwrap()
        .into_inner();
    let batch = |n: u64| pb::PublishBatchRequest {
        requests: vec![publish_request(2 * n), publish_request(2 * n + 1)],
    };
    tx.send(batch(0)).unwrap();
    let first = next_answer(&mut answers).await.unwrap().unwrap();
    assert_eq!(first.results.len(), 2);
    let ended_at = ending.happen(&relay, Instant::now()).await;
    // As in `publish_stream_ends`: when batch n was sent; answers come in batch order.
    let mut sent = vec![issued];
    let mut answered_batches = 1;
    let status = loop {
        let n = sent.len() as u64;
        sent.push(Instant::now());
        let _ = tx.send(batch(n));
        match tokio::time::timeout(Duration::from_millis(50), answers.message()).await {
            Err(_) => {}
            Ok(Ok(Some(_))) => {
                assert!(
                    sent[answered_batches] < ended_at,
                    "batch {answered_batches} answered, sent {:?} after the end",
                    sent[answered_batches] - ended_at
                );
                answered_batches += 1;
            }
            Ok(Ok(None)) => panic!("the call ended OK"),
            Ok(Err(status)) => break status,
        }
        assert!(
            ended_at.elapsed() < 2 * SOON,
            "still publishing {:?} after the end",
            ended_at.elapsed()
        );
    };
    assert_status(&status, Code::Unauthenticated, ending.message());
    assert!(ended_at.elapsed() < SOON, "{:?}", ended_at.elapsed());
}

/// A Subscribe call being fed by another key's publishes ends in time.
async fn subscribe_ends(ending: Ending) {
    let relay = relay_with_channel().await;
    let mut client = relay.client().await;
    let issued = Instant::now();
    let mut sub = Subscription::of(
        client
            .subscribe(authed(subscribe_request(CHANNEL, 0), ending.token()))
            .await
            .unwrap()
            .into_inner(),
    );
    sub.wait_keepalives(1).await;
    let ended_at = ending.happen(&relay, issued).await;
    let feeder = {
        let mut client = relay.client().await;
        tokio::spawn(async move {
            for n in 0..40 {
                let _ = client.publish(authed(publish_request(n), OWNER)).await;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };
    let status = sub.wait_end().await;
    feeder.abort();
    assert_status(&status, Code::Unauthenticated, ending.message());
    assert!(ended_at.elapsed() < SOON, "{:?}", ended_at.elapsed());
}

/// A SubscribeMany call that keeps adding channels ends in time.
async fn subscribe_many_ends(ending: Ending) {
    let relay = relay_with_channel().await;
    let mut client = relay.client().await;
    let issued = Instant::now();
    let mut many = Many::open(&mut client, Some(ending.token())).await;
    many.add(subscribe_request(CHANNEL, 0));
    many.live(CHANNEL).await;
    let ended_at = ending.happen(&relay, issued).await;
    let status = loop {
        // Once the call has ended, its requests are no longer read: what ended it is next.
        let _ = many.offer(Op::Remove(CHANNEL.to_owned()))
            && many.offer(Op::Add(subscribe_request(CHANNEL, 0)));
        match tokio::time::timeout(Duration::from_millis(50), many.next()).await {
            Err(_) | Ok(Ok(())) => {}
            Ok(Err(status)) => break status,
        }
        assert!(ended_at.elapsed() < 2 * SOON, "{:?}", ended_at.elapsed());
    };
    assert_status(&status, Code::Unauthenticated, ending.message());
    assert!(ended_at.elapsed() < SOON, "{:?}", ended_at.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revocation_ends_a_publish_stream_call() {
    publish_stream_ends(Ending::Revoked).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expiry_ends_a_publish_stream_call() {
    publish_stream_ends(Ending::Expired).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revocation_ends_a_publish_batches_call() {
    publish_batches_ends(Ending::Revoked).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expiry_ends_a_publish_batches_call() {
    publish_batches_ends(Ending::Expired).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revocation_ends_a_subscribe_call() {
    subscribe_ends(Ending::Revoked).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expiry_ends_a_subscribe_call() {
    subscribe_ends(Ending::Expired).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revocation_ends_a_subscribe_many_call() {
    subscribe_many_ends(Ending::Revoked).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expiry_ends_a_subscribe_many_call() {
    subscribe_many_ends(Ending::Expired).await;
}

/// An account's streams are bounded over all its keys and connections, whatever the RPC; a
/// refused call is refused before anything is read, other accounts are untouched, and a
/// stream that ends gives its place back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_account_holds_at_most_its_streams() {
    let relay = Relay::start_with(
        |c| c.max_streams_per_account = 3,
        Some(Arc::new(FakeVerify)),
    )
    .await;
    let mut client = relay.client().await;
    create_as(&mut client, CHANNEL, OWNER).await;
    let mut held = Vec::new();
    for token in ["acme.k1", "acme.k2", "acme.k3"] {
        let mut other = relay.client().await;
        let mut sub = Subscription::of(
            other
                .subscribe(authed(subscribe_request(CHANNEL, 0), token))
                .await
                .unwrap()
                .into_inner(),
        );
        sub.wait_keepalives(1).await;
        held.push(sub);
    }
    let limit = "this account holds 3 relay streams already (the relay's limit per account): \
                 end one first";
    // Every streaming RPC is refused, even one naming a channel that does not exist.
    let refused = client
        .subscribe(authed(subscribe_request("acme/no/such", 0), "acme.k4"))
        .await
        .unwrap_err();
    assert_status(&refused, Code::ResourceExhausted, limit);
    let (_tx, rx) = mpsc::unbounded_channel::<pb::PublishBatchRequest>();
    let refused = client
        .publish_batches(authed(UnboundedReceiverStream::new(rx), "acme.k1"))
        .await
        .unwrap_err();
    assert_status(&refused, Code::ResourceExhausted, limit);
    let (_tx, rx) = mpsc::unbounded_channel::<pb::PublishRequest>();
    let refused = client
        .publish_stream(authed(UnboundedReceiverStream::new(rx), "acme.k1"))
        .await
        .unwrap_err();
    assert_status(&refused, Code::ResourceExhausted, limit);
    let (_tx, rx) = mpsc::unbounded_channel::<pb::SubscribeManyRequest>();
    let refused = client
        .subscribe_many(authed(UnboundedReceiverStream::new(rx), "acme.k1"))
        .await
        .unwrap_err();
    assert_status(&refused, Code::ResourceExhausted, limit);
    // Unary calls are not streams.
    publish_stream_free(&mut client).await;
    // Another account has its own.
    let (_tx, rx) = mpsc::unbounded_channel::<pb::SubscribeManyRequest>();
    client
        .subscribe_many(authed(UnboundedReceiverStream::new(rx), "bob.k1"))
        .await
        .unwrap();
    // A stream that ends gives its place back.
    drop(held.pop());
    within("a place given back", async {
        loop {
            let (_tx, rx) = mpsc::unbounded_channel::<pb::SubscribeManyRequest>();
            if client
                .subscribe_many(authed(UnboundedReceiverStream::new(rx), "acme.k1"))
                .await
                .is_ok()
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
}

async fn publish_stream_free(
    client: &mut static_relay::pb::relay_client::RelayClient<tonic::transport::Channel>,
) {
    let published = client
        .publish(authed(publish_request(99), "acme.k1"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(published.seq, 1);
}

/// Many callers of one account racing for the last places: exactly the limit gets through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_callers_cannot_overshoot_the_stream_limit() {
    let relay = Relay::start_with(
        |c| c.max_streams_per_account = 5,
        Some(Arc::new(FakeVerify)),
    )
    .await;
    let mut callers = Vec::new();
    for i in 0..40 {
        let channel = relay.connect().await;
        callers.push(tokio::spawn(async move {
            let mut client = static_relay::pb::relay_client::RelayClient::new(channel);
            let (tx, rx) = mpsc::unbounded_channel::<pb::SubscribeManyRequest>();
            let token = format!("acme.k{i}");
            let opened = client
                .subscribe_many(authed(UnboundedReceiverStream::new(rx), &token))
                .await;
            match opened {
                // Held until the test has counted.
                Ok(call) => Ok((tx, call.into_inner(), client)),
                Err(status) => Err(status.code()),
            }
        }));
    }
    let mut held = Vec::new();
    let mut refused = 0;
    for caller in callers {
        match within("a caller", caller).await.unwrap() {
            Ok(call) => held.push(call),
            Err(code) => {
                assert_eq!(code, Code::ResourceExhausted);
                refused += 1;
            }
        }
    }
    assert_eq!((held.len(), refused), (5, 35));
}
