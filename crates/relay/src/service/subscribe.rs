//! Subscribe: one channel's log after a cursor, replayed then live, with keep-alives; and the
//! paging of the log into responses that SubscribeMany shares.

use std::sync::Arc;
use std::time::Duration;

use tonic::{Request, Response, Status};

use super::caller::{channel_name, Addressed as _};
use super::driven::{Driven, Sender};
use super::refusal::not_a_member;
use super::Inner;
use crate::error::{shutting_down, RelayError, Result};
use crate::log::{Channel, Entry};
use crate::observe::metrics;
use crate::pb;
use crate::shutdown::Phase;

/// Entries per Subscribe response when the subscriber asks for batches (and its max_batch).
const SUBSCRIBE_BATCH_BYTES: usize = 1024 * 1024;
pub(super) const SUBSCRIBE_BATCH_ENTRIES: usize = 1024;
/// Entries a subscription reads from the log at a time (at most: its page is bounded in
/// bytes too, see [`super::ServiceSettings::page_bytes`]).
pub(super) const READ_PAGE: usize = 256;

/// Subscribe: the call checked, then driven by [`Inner::follow`].
pub(super) async fn subscribe(
    inner: &Arc<Inner>,
    request: Request<pb::SubscribeRequest>,
) -> Result<Response<Driven<Result<pb::SubscribeResponse, Status>>>> {
    use pb::subscribe_request::Start;
    let (metadata, extensions, mut request) = request.into_parts();
    // The guard first: an account at its limit of streams is refused before anything is
    // read. Registered before the drain is looked at (in `follow`): a shutdown either sees
    // this guard or is seen by the stream.
    let (caller, guard) = inner.streaming_caller(&metadata, &extensions).await?;
    let name = channel_name(request.take_channel())?;
    caller.may_name(&name)?;
    let channel = inner.channel(&caller.account, &name).await?;
    inner.read_limit(&channel, &caller.account).await?;
    let after_seq = match request.start {
        Some(Start::FromEpoch(epoch)) => inner.log.start_of_epoch(&channel, epoch).await?,
        Some(Start::AfterSeq(seq)) => seq,
        None => 0,
    };
    channel.check_cursor(after_seq)?;
    let max_batch = request.max_batch.min(SUBSCRIBE_BATCH_ENTRIES as u32) as usize;
    let inner = Arc::clone(inner);
    let account = Arc::clone(&caller.account);
    let budget = inner.settings.queue_bytes();
    Ok(Response::new(Driven::new(budget, guard, move |tx| {
        inner.follow(channel, account, after_seq, max_batch, tx)
    })))
}

impl Inner {
    /// Subscribe's stream: a keep-alive, then the log after `cursor` (replayed, then live)
    /// until the peer leaves or the stream is ended (revocation, expiry, shutdown).
    async fn follow(
        self: Arc<Self>,
        channel: Arc<Channel>,
        account: Arc<str>,
        cursor: u64,
        max_batch: usize,
        tx: Sender<Result<pb::SubscribeResponse, Status>>,
    ) {
        if let Some(reason) = self
            .stream_entries(&channel, &account, cursor, max_batch, &tx)
            .await
        {
            let _ = tx.send(Err(reason.to_status())).await;
        }
    }

    /// None when the subscriber is gone, else why the stream ends.
    async fn stream_entries(
        &self,
        channel: &Channel,
        account: &str,
        mut cursor: u64,
        max_batch: usize,
        tx: &Sender<Result<pb::SubscribeResponse, Status>>,
    ) -> Option<RelayError> {
        // A zero interval would make this loop spin on keep-alives.
        let interval = self
            .settings
            .keepalive_interval
            .max(Duration::from_millis(1));
        let mut head = channel.watch_head();
        let mut shutdown = self.shutdown.watch();
        // A first keep-alive right away tells the client the subscription is live.
        if tx.send(Ok(keep_alive(channel.head_seq()))).await.is_err() {
            return None;
        }
        // Made once and polled in every wait below (cancel-safe). Revocation and expiry are
        // the call's guard's (see `Driven::new`).
        let drained = shutdown.reached(Phase::Refusing);
        let idle = tokio::time::sleep(interval);
        tokio::pin!(drained, idle);
        let page_size = READ_PAGE.max(max_batch);
        let page_bytes = self.settings.page_bytes();
        loop {
            let last = *head.borrow_and_update();
            // Membership is looked at whenever the head moved (a commit may have removed the
            // account): a departed member reads up to the commit that removed it, then ends.
            let limit = match self.read_limit(channel, account).await {
                Ok(limit) => limit,
                Err(e) => return Some(e),
            };
            if cursor >= limit {
                return Some(not_a_member(channel.name()));
            }
            if cursor < last {
                let page = tokio::select! {
                    biased;
                    () = &mut drained => return Some(shutting_down()),
                    page = self.log.read_page(channel, cursor, page_size, page_bytes) => page,
                };
                let page = match page.and_then(|page| consecutive(page, cursor, last)) {
                    Ok(mut page) => {
                        page.retain(|e| e.seq <= limit);
                        page
                    }
                    Err(e) => return Some(e),
                };
                cursor = page.last().map_or(cursor, |e| e.seq);
                // A slow reader makes these sends wait (its body is not polled): it falls
                // behind here and reads the rest from the log later, costing nobody else.
                for response in responses(page, max_batch) {
                    if tx.send(Ok(response)).await.is_err() {
                        return None;
                    }
                }
                delivered_live(channel, cursor);
                // Entries count as traffic: no keep-alive for that interval.
                idle.as_mut().reset(tokio::time::Instant::now() + interval);
                continue;
            }
            tokio::select! {
                biased;
                () = &mut drained => return Some(shutting_down()),
                changed = head.changed() => {
                    if changed.is_err() {
                        // The channel's writer side is gone: only a closing log does that.
                        return Some(shutting_down());
                    }
                }
                () = &mut idle => {
                    if tx.send(Ok(keep_alive(channel.head_seq()))).await.is_err() {
                        return None;
                    }
                    idle.as_mut().reset(tokio::time::Instant::now() + interval);
                }
            }
        }
    }
}

/// A page up to `sent` went to a subscriber: when that is the channel's head, published to
/// this relay, it was a live delivery, timed from that publish (one observation per page).
pub(super) fn delivered_live(channel: &Channel, sent: u64) {
    if sent != channel.head_seq() {
        return;
    }
    if let Some(submitted) = channel.submitted_ns(sent) {
        metrics::metrics()
            .publish_to_delivery
            .observe(metrics::since_ns(submitted).as_secs_f64());
    }
}

fn keep_alive(head_seq: u64) -> pb::SubscribeResponse {
    pb::SubscribeResponse {
        item: Some(pb::subscribe_response::Item::KeepAlive(pb::KeepAlive {
            head_seq,
        })),
    }
}

fn wire_entry(entry: Entry) -> pb::Entry {
    metrics::metrics().delivered.inc();
    pb::Entry {
        seq: entry.seq,
        epoch: entry.epoch,
        content_type: entry.content_type,
        message: entry.message,
        account: entry.account.to_string(),
    }
}

/// A page of the log must start right after the cursor and have no gap (never expected).
pub(super) fn consecutive(page: Vec<Entry>, cursor: u64, head: u64) -> Result<Vec<Entry>> {
    if page.is_empty() {
        return Err(RelayError::Unavailable(format!(
            "log ends before seq {head}"
        )));
    }
    for (offset, entry) in (1u64..).zip(&page) {
        if entry.seq != cursor + offset {
            return Err(RelayError::Unavailable(format!(
                "log gap after seq {}",
                cursor + offset - 1
            )));
        }
    }
    Ok(page)
}

/// A page as Subscribe responses: one `entry` each, or with `max_batch > 1` runs of
/// [`batches`].
fn responses(page: Vec<Entry>, max_batch: usize) -> Vec<pb::SubscribeResponse> {
    use pb::subscribe_response::Item;
    let single = max_batch <= 1;
    batches(page, max_batch)
        .into_iter()
        .map(|mut entries| {
            // batches() gives runs of one entry each when `single`.
            let entry = if single { entries.pop() } else { None };
            let item = entry.map_or_else(|| Item::Entries(pb::Entries { entries }), Item::Entry);
            pb::SubscribeResponse { item: Some(item) }
        })
        .collect()
}

/// A page cut into runs of at most `max_batch` entries (one each for 0 or 1) and about
/// [`SUBSCRIBE_BATCH_BYTES`] (a larger entry travels alone), in order.
pub(super) fn batches(page: Vec<Entry>, max_batch: usize) -> Vec<Vec<pb::Entry>> {
    let max_batch = max_batch.max(1);
    let mut out = Vec::new();
    let mut current: Vec<pb::Entry> = Vec::new();
    let mut size = 0;
    for entry in page {
        if !current.is_empty()
            && (current.len() >= max_batch || size + entry.message.len() > SUBSCRIBE_BATCH_BYTES)
        {
            out.push(std::mem::take(&mut current));
            size = 0;
        }
        size += entry.message.len();
        current.push(wire_entry(entry));
    }
    if !current.is_empty() {
        out.push(current);
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::log::test_entry as entry;

    fn batch_sizes(responses: &[pb::SubscribeResponse]) -> Vec<usize> {
        responses
            .iter()
            .map(|r| match &r.item {
                Some(pb::subscribe_response::Item::Entries(e)) => e.entries.len(),
                _ => 0,
            })
            .collect()
    }

    #[test]
    fn pages_are_cut_by_count_and_bytes() {
        let page: Vec<Entry> = (1..=250).map(|s| entry(s, 10)).collect();
        assert_eq!(batch_sizes(&responses(page, 100)), vec![100, 100, 50]);
        let big: Vec<Entry> = (1..=5).map(|s| entry(s, 400 * 1024)).collect();
        assert_eq!(batch_sizes(&responses(big, 100)), vec![2, 2, 1]);
        let huge = vec![entry(1, 2 * 1024 * 1024), entry(2, 1)];
        assert_eq!(batch_sizes(&responses(huge, 100)), vec![1, 1]);
        let single = responses(vec![entry(1, 1), entry(2, 1)], 1);
        assert!(single
            .iter()
            .all(|r| matches!(r.item, Some(pb::subscribe_response::Item::Entry(_)))));
    }

    #[test]
    fn pages_must_follow_the_cursor() {
        assert!(consecutive(vec![entry(5, 1), entry(6, 1)], 4, 6).is_ok());
        assert_eq!(
            consecutive(vec![entry(5, 1), entry(7, 1)], 4, 7)
                .unwrap_err()
                .to_string(),
            "log gap after seq 5"
        );
        assert_eq!(
            consecutive(Vec::new(), 4, 7).unwrap_err().to_string(),
            "log ends before seq 7"
        );
    }
}
