//! The relay's log is bounded by what it decided, not by what a peer sent: refused batch items
//! are one line per batch, and repeated lines are held back ("N similar lines suppressed").
//! Its own test binary: it installs the process's logger.
#![allow(clippy::unwrap_used)]

mod service_support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use static_relay::pb::{self, publish_result::Outcome};
use tonic::Code;

use service_support::*;

/// Counts the bytes and lines the relay logs (as text, about as Python's formatter writes
/// them), and keeps the last lines.
struct Counting {
    bytes: AtomicUsize,
    lines: AtomicUsize,
    last: Mutex<Vec<String>>,
}

impl log::Log for Counting {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        metadata.target().starts_with("static.relay")
    }

    fn log(&self, record: &log::Record<'_>) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let line = format!(
            "{} {}: {}\n",
            record.level(),
            record.target(),
            record.args()
        );
        self.bytes.fetch_add(line.len(), Ordering::Relaxed);
        self.lines.fetch_add(1, Ordering::Relaxed);
        let mut last = self.last.lock().unwrap();
        last.push(line);
        if last.len() > 50 {
            last.remove(0);
        }
    }

    fn flush(&self) {}
}

static LOG: Counting = Counting {
    bytes: AtomicUsize::new(0),
    lines: AtomicUsize::new(0),
    last: Mutex::new(Vec::new()),
};

const ITEMS: usize = 1024;
const BATCHES: usize = 20;
const CALLS: usize = 5;

/// An account in no channel sends batches of 1,024 malformed one-byte items, on several calls:
/// every item is refused (INVALID_ARGUMENT) and the log stays within a few KB. At 9b2be07 it
/// was one ~200-byte line per item: ~20 MB for these 100k items.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_items_do_not_amplify_into_the_log() {
    log::set_logger(&LOG).unwrap();
    log::set_max_level(log::LevelFilter::Info);
    let relay = Relay::start_with(|_| {}, Some(Arc::new(FakeVerify))).await;
    let mut client = relay.client().await;
    let sent_before = LOG.bytes.load(Ordering::Relaxed);
    let mut refused = 0;
    for _ in 0..CALLS {
        let batches: Vec<_> = (0..BATCHES)
            .map(|_| pb::PublishBatchRequest {
                requests: (0..ITEMS)
                    .map(|_| request(CHANNEL, bytes::Bytes::from_static(b"x")))
                    .collect(),
            })
            .collect();
        let mut answers = client
            .publish_batches(authed(tokio_stream::iter(batches), "eve.k1"))
            .await
            .unwrap()
            .into_inner();
        for response in all_answers(&mut answers).await {
            for result in response.results {
                match result.outcome.unwrap() {
                    Outcome::Refused(r) => {
                        assert_eq!(Code::from(r.code as i32), Code::InvalidArgument);
                        refused += 1;
                    }
                    Outcome::Accepted(_) => panic!("a malformed item was accepted"),
                }
            }
        }
    }
    assert_eq!(refused, ITEMS * BATCHES * CALLS);
    let logged = LOG.bytes.load(Ordering::Relaxed) - sent_before;
    let last = LOG.last.lock().unwrap().clone();
    // 20 lines of burst at most for the account (and a line a second after), ~250 bytes each.
    assert!(
        logged < 8 * 1024,
        "{logged} bytes of log ({} lines) for {refused} refused items; the last lines: {last:#?}",
        LOG.lines.load(Ordering::Relaxed)
    );
    // What was written says what was refused, with counts per code.
    assert!(
        last.iter().any(|l| l.contains(
            "PublishBatches items refused 1024 of 1024 (INVALID_ARGUMENT=1024) account=eve key=k1"
        )),
        "{last:#?}"
    );
}
