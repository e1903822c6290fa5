//! The reader task: subscribes to a channel's log and forwards its entries to the applier.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tonic::Code;

use super::applier::{apply_batch, Applied, Applying, APPLICATION};
use super::channel::{now_ns, Channel, End};
use super::{backoff_next, bounded, lock, BACKOFF_MIN, SUBSCRIBE_BATCH};
use crate::transport::{self, pb};
use static_mls::error::{Error, ErrorKind};
use static_mls::store::Cursor;

/// A subscription that shows nothing (not even a keep-alive) for this long is considered dead.
const SILENCE: Duration = Duration::from_secs(6);

/// Subscribes to the channel's log and forwards entries, in order, to the applier.
pub(super) async fn reader(channel: Arc<Channel>, cursor: Cursor, entries: mpsc::Sender<Received>) {
    let mut shutdown = channel.shutdown.subscribe();
    let mut start = cursor;
    let mut backoff = BACKOFF_MIN;
    let mut strikes = 0;
    let shared = Arc::clone(&channel.shared);
    loop {
        if *shutdown.borrow() {
            return;
        }
        let start_field = match start {
            Cursor::After(seq) => pb::subscribe_request::Start::AfterSeq(seq),
            Cursor::FromEpoch(epoch) => pb::subscribe_request::Start::FromEpoch(epoch),
        };
        let request = shared
            .request(pb::SubscribeRequest {
                channel: channel.name.clone(),
                start: Some(start_field),
                max_batch: SUBSCRIBE_BATCH,
            })
            .await;
        let (request, token) = match request {
            Ok(r) => r,
            Err(e) if e.kind() == ErrorKind::Auth => {
                channel.end(End::Failed(e));
                return;
            }
            Err(_) => {
                // The token endpoint is unreachable: keep trying.
                if sleep_or_shutdown(&mut shutdown, backoff).await {
                    return;
                }
                backoff = backoff_next(backoff);
                continue;
            }
        };
        let mut relay = shared.relay.clone();
        let subscribed = tokio::select! {
            _ = shutdown.changed() => return,
            r = bounded(relay.subscribe(request)) => r,
        };
        let failure = match subscribed {
            Ok(response) => {
                let mut stream = response.into_inner();
                loop {
                    let item = tokio::select! {
                        _ = shutdown.changed() => return,
                        r = tokio::time::timeout(SILENCE, stream.message()) => r,
                    };
                    match item {
                        Err(_silent) => break None,
                        Ok(Ok(None)) => break None,
                        Ok(Err(status)) => break Some(status),
                        Ok(Ok(Some(response))) => {
                            backoff = BACKOFF_MIN;
                            strikes = 0;
                            // Live once the relay sends something (it opens with a keep-alive;
                            // a refusal may come after the response headers).
                            channel
                                .progress
                                .send_if_modified(|p| !std::mem::replace(&mut p.connected, true));
                            let batch = match response.item {
                                Some(pb::subscribe_response::Item::Entry(entry)) => vec![entry],
                                Some(pb::subscribe_response::Item::Entries(batch)) => batch.entries,
                                Some(pb::subscribe_response::Item::KeepAlive(k)) => {
                                    channel.progress.send_if_modified(|p| {
                                        let changed = p.head_seq != k.head_seq;
                                        p.head_seq = k.head_seq;
                                        changed
                                    });
                                    continue;
                                }
                                None => continue,
                            };
                            let seen = match start {
                                Cursor::After(seq) => seq,
                                Cursor::FromEpoch(_) => 0,
                            };
                            let batch: Vec<(u64, u32, Vec<u8>)> = batch
                                .into_iter()
                                .filter(|entry| entry.seq > seen)
                                .map(|entry| {
                                    (entry.seq, entry.content_type, Vec::from(entry.message))
                                })
                                .collect();
                            let Some(&(last, _, _)) = batch.last() else {
                                continue;
                            };
                            start = Cursor::After(last);
                            // Our own messages coming back (every send of ours does) need no
                            // engine: when the applier has applied everything before them,
                            // they are passed here, without waking it.
                            if channel.queued.load(Ordering::Acquire) == 0
                                && lock(&channel.own_messages).take_all(&batch)
                            {
                                channel
                                    .progress
                                    .send_modify(|p| p.applied_seq = p.applied_seq.max(last));
                                continue;
                            }
                            // A lone application message while the applier is idle (nothing
                            // handed to it is unapplied) is applied right here: waking the
                            // applier's thread costs tens of microseconds on a quiet machine,
                            // and the message's reader waits for that too. Only a lone message
                            // (one decryption, ~0.1-0.2 ms on this runtime's worker), never a
                            // batch or a handshake, and only in sparse traffic (see
                            // `may_apply_inline`); the order holds, as the applier has nothing.
                            if batch.len() == 1
                                && batch[0].1 == APPLICATION
                                && channel.queued.load(Ordering::Acquire) == 0
                                && shared.may_apply_inline()
                            {
                                channel.queued.fetch_add(1, Ordering::AcqRel);
                                let _applied = Applying(&channel.queued, 1);
                                let applied =
                                    shared.apply_inline(|| apply_batch(&channel, batch, now_ns()));
                                if applied == Applied::ChannelEnded {
                                    return;
                                }
                                continue;
                            }
                            let received = Received {
                                entries: batch,
                                at: now_ns(),
                            };
                            channel.queued.fetch_add(1, Ordering::AcqRel);
                            if entries.send(received).await.is_err() {
                                return;
                            }
                        }
                    }
                }
            }
            Err(status) => Some(status),
        };
        channel.progress.send_modify(|p| p.connected = false);
        if let Some(status) = failure {
            match status.code() {
                Code::Unauthenticated => {
                    if let Err(e) =
                        shared.on_unauthenticated(&status, token.as_deref(), &mut strikes)
                    {
                        channel.end(End::Failed(e));
                        return;
                    }
                    continue;
                }
                Code::NotFound => {
                    let e = Error::Transport(format!(
                        "channel {:?} is not on the relay for this account ({})",
                        channel.name,
                        status.message()
                    ));
                    channel.end(End::Failed(e));
                    return;
                }
                Code::InvalidArgument | Code::PermissionDenied | Code::Unimplemented => {
                    let e = transport::status_error("Subscribe", &status);
                    channel.end(End::Failed(e));
                    return;
                }
                _ => {}
            }
        }
        if sleep_or_shutdown(&mut shutdown, backoff).await {
            return;
        }
        backoff = backoff_next(backoff);
    }
}

/// Sleeps unless the channel shuts down first (then returns true).
pub(super) async fn sleep_or_shutdown(
    shutdown: &mut watch::Receiver<bool>,
    wait: Duration,
) -> bool {
    tokio::select! {
        _ = shutdown.changed() => true,
        _ = tokio::time::sleep(wait) => *shutdown.borrow(),
    }
}

/// Consecutive entries of the log from one Subscribe response: (seq, content type, message).
pub(super) struct Received {
    pub(super) entries: Vec<(u64, u32, Vec<u8>)>,
    /// When they arrived (see [`Timings`](super::Timings)).
    pub(super) at: u64,
}
