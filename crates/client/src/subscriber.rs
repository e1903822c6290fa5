//! A channel's subscription to its log: subscribes after the follower's cursor, feeds it what
//! comes, and subscribes again (with the retry policy) when the stream drops or falls silent.

use std::time::Duration;

use tonic::Code;

use crate::config::{SILENCE, SUBSCRIBE_BATCH};
use crate::error::Error;
use crate::reader::Follower;
use crate::refusal::Refusal;
use crate::retry::Retry;
use crate::transport::{bounded, pb};
use static_mls::store::Cursor;

/// Follows one channel until it ends.
pub(crate) async fn subscribe(mut follower: Follower) {
    let core = std::sync::Arc::clone(&follower.core);
    let shared = &core.shared;
    let mut shutdown = core.shutdown.subscribe();
    let mut retry = Retry::forever();
    loop {
        if *shutdown.borrow() {
            return;
        }
        let start = match follower.cursor() {
            Cursor::After(seq) => pb::subscribe_request::Start::AfterSeq(seq),
            Cursor::FromEpoch(epoch) => pb::subscribe_request::Start::FromEpoch(epoch),
        };
        let request = shared
            .request(pb::SubscribeRequest {
                channel: core.name.clone(),
                start: Some(start),
                max_batch: SUBSCRIBE_BATCH,
            })
            .await;
        let (request, token) = match request {
            Ok(r) => r,
            Err(e @ Error::Auth(_)) => {
                follower.fail(e);
                return;
            }
            Err(_) => {
                // The token endpoint is unreachable: keep trying.
                let wait = retry_wait(&mut retry);
                if core.sleep_or_shutdown(wait).await {
                    return;
                }
                continue;
            }
        };
        let mut relay = shared.relay.clone();
        let subscribed = tokio::select! {
            _ = shutdown.changed() => return,
            r = bounded(relay.subscribe(request)) => r,
        };
        let refusal = match subscribed {
            Ok(response) => {
                let mut stream = response.into_inner();
                loop {
                    let item = tokio::select! {
                        _ = shutdown.changed() => return,
                        r = tokio::time::timeout(SILENCE, stream.message()) => r,
                    };
                    let response = match item {
                        Err(_silent) => break Refusal::transient(Code::DeadlineExceeded, "silent"),
                        Ok(Ok(None)) => break Refusal::transient(Code::Unavailable, "ended"),
                        Ok(Err(status)) => break Refusal::from_status(&status),
                        Ok(Ok(Some(response))) => response,
                    };
                    retry.answered();
                    // Live once the relay sends something (it opens with a keep-alive; a
                    // refusal may come after the response headers).
                    let entries = match response.item {
                        Some(pb::subscribe_response::Item::Entry(entry)) => vec![entry],
                        Some(pb::subscribe_response::Item::Entries(batch)) => batch.entries,
                        Some(pb::subscribe_response::Item::KeepAlive(k)) => {
                            follower.live(Some(k.head_seq));
                            continue;
                        }
                        None => continue,
                    };
                    follower.live(None);
                    if !follower.entries(entries).await {
                        return;
                    }
                }
            }
            Err(status) => Refusal::from_status(&status),
        };
        follower.disconnected();
        let wait = match refusal {
            Refusal::Final {
                code: Code::NotFound,
                message,
            } => Err(Error::refused(
                Code::NotFound,
                format!(
                    "channel {:?} is not on the relay for this account ({message})",
                    core.name
                ),
            )),
            refusal => shared.after(&mut retry, refusal, token.as_deref(), "Subscribe"),
        };
        match wait {
            Ok(wait) => {
                if core.sleep_or_shutdown(wait).await {
                    return;
                }
            }
            Err(e) => {
                follower.fail(e);
                return;
            }
        }
    }
}

/// The policy's next wait for a failure that is not the relay's (no token yet).
fn retry_wait(retry: &mut Retry) -> Duration {
    match retry.step(&Refusal::transient(Code::Unavailable, "no token")) {
        crate::retry::Step::Wait(wait) => wait,
        _ => crate::retry::BACKOFF_MAX,
    }
}
