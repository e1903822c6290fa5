//! The publish rate limit within one PublishBatches request: once it refuses an item, it
//! refuses the rest of the request too (`tests/relay/test_rate_limit.py` over both stores).
#![allow(clippy::unwrap_used)]

mod service_support;

use static_relay::pb::{self, publish_result::Outcome};
use tonic::Code;

use service_support::*;

/// Tokens a second (and the burst): one comes back every 0.5 ms, far less than checking the
/// rest of a 1024-item request takes, so without the rule later items would get through.
const RATE: f64 = 2000.0;
const ITEMS: usize = 1024;
/// Enough to empty the bucket twice over (its burst is `RATE` items).
const BATCHES: usize = 6;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rate_limited_item_refuses_the_rest_of_its_request() {
    let relay = Relay::start(|c| {
        c.allow_anonymous = true;
        c.publish_rate_per_agent = RATE;
    })
    .await;
    let mut client = relay.client().await;
    create(&mut client, CHANNEL).await;
    // 1 KiB payloads: each item takes a while to check (its digest is the idempotency key).
    let padding = vec![b'x'; 1024];
    let batches: Vec<_> = (0..BATCHES)
        .map(|b| {
            let requests = (0..ITEMS)
                .map(|i| {
                    let mut payload = format!("{b}:{i}:").into_bytes();
                    payload.extend_from_slice(&padding);
                    request(CHANNEL, application(CHANNEL, 0, &payload))
                })
                .collect();
            pb::PublishBatchRequest { requests }
        })
        .collect();
    let responses = publish_batches(&mut client, batches).await;
    assert_eq!(responses.len(), BATCHES);
    let mut seqs = Vec::new();
    let mut longest_refused_run = 0;
    for (b, response) in responses.into_iter().enumerate() {
        let outcomes: Vec<_> = response
            .results
            .into_iter()
            .map(|r| r.outcome.unwrap())
            .collect();
        assert_eq!(outcomes.len(), ITEMS);
        let accepted = outcomes
            .iter()
            .take_while(|o| matches!(o, Outcome::Accepted(_)))
            .count();
        for (i, outcome) in outcomes.iter().enumerate() {
            match outcome {
                Outcome::Accepted(a) if i < accepted => seqs.push(a.seq),
                Outcome::Accepted(a) => panic!(
                    "batch {b}: item {i} accepted (seq {}) after item {accepted} was \
                     rate-limited",
                    a.seq
                ),
                Outcome::Refused(r) => {
                    assert_eq!(r.code, Code::ResourceExhausted as u32, "batch {b} item {i}");
                    assert_eq!(
                        r.message, "publish rate limit of 2000 messages/s per agent exceeded",
                        "batch {b} item {i}"
                    );
                    assert!(r.retry_after_ms > 0, "batch {b} item {i}: {r:?}");
                }
            }
        }
        longest_refused_run = longest_refused_run.max(ITEMS - accepted);
    }
    // The accepted items are the requests' prefixes, in order, without gaps.
    assert_eq!(seqs, (1..=seqs.len() as u64).collect::<Vec<_>>());
    // The case was met: a long run of items checked after a refusal (the bucket refilled
    // meanwhile).
    assert!(longest_refused_run >= ITEMS / 2, "{longest_refused_run}");
}
