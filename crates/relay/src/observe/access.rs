//! The relay's access log and call metrics: one [`CallRecord`] per gRPC call, finished once
//! with the call's status code (from its trailers, or its headers for a trailers-only answer;
//! CANCELLED when the peer went away first).
//!
//! Records go to the `static.relay.access` logger: refusals (any code but OK and CANCELLED) at
//! INFO, the rest at DEBUG. A relay serves tens of thousands of calls a second (`bench/e2e.py`,
//! unary publishes), and each record that is written crosses into Python's logging (with the
//! GIL): so successful calls are logged only at `--log-level debug`, where the level check (one
//! atomic load) is all they cost otherwise. Never a token: the account and key ids only.
//!
//! Refusal lines are bounded by what the relay decided, not by what a peer sends: one line per
//! call or per batch (with counts per code), and no more than [`LineBudget`] lets through per
//! account (or peer address) and overall; the lines it holds back are counted in the next one
//! written ("N similar lines suppressed"), and every refusal is still counted in the metrics.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use http::HeaderMap;
use tonic::Code;

use crate::observe::metrics::{code_label, metrics};
use crate::wire::rules::TokenBucket;

/// The logger of the relay's access log.
pub const ACCESS_LOG: &str = "static.relay.access";

/// Who a call is, once authenticated: put in each request's extensions by the server, filled
/// in by the service (`Inner::caller`).
#[derive(Debug, Default)]
pub(crate) struct CallInfo(OnceLock<(Arc<str>, Option<String>)>);

impl CallInfo {
    /// The call's account ("" anonymous) and API key id.
    pub(crate) fn set(&self, account: &Arc<str>, key_id: Option<&String>) {
        let _ = self.0.set((Arc::clone(account), key_id.cloned()));
    }
}

/// The relay's subscriptions (counted in the `streams` gauge while they last).
fn is_stream(method: &str) -> bool {
    matches!(method, "Subscribe" | "SubscribeMany")
}

/// One call, until it is finished (by its code, or by being dropped: CANCELLED).
pub(crate) struct CallRecord {
    method: &'static str,
    started: Instant,
    peer: Arc<str>,
    who: Arc<CallInfo>,
    done: bool,
}

impl CallRecord {
    pub(crate) fn new(method: &'static str, peer: Arc<str>) -> CallRecord {
        if is_stream(method) {
            metrics().streams.inc();
        }
        CallRecord {
            method,
            started: Instant::now(),
            peer,
            who: Arc::new(CallInfo::default()),
            done: false,
        }
    }

    /// What the service fills in (see [`CallInfo`]).
    pub(crate) fn who(&self) -> Arc<CallInfo> {
        Arc::clone(&self.who)
    }

    /// The call ended with the `grpc-status` (and `grpc-message`) of `headers` (its trailers,
    /// or its headers for a trailers-only answer); false when they carry none.
    pub(crate) fn finish_with(&mut self, headers: &HeaderMap) -> bool {
        let Some(code) = headers
            .get("grpc-status")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<i32>().ok())
        else {
            return false;
        };
        let message = headers
            .get("grpc-message")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        self.finish(Code::from_i32(code), message);
        true
    }

    fn finish(&mut self, code: Code, message: &str) {
        if std::mem::replace(&mut self.done, true) {
            return;
        }
        let m = metrics();
        if is_stream(self.method) {
            m.streams.dec();
        }
        let label = code_label(code);
        let elapsed = self.started.elapsed();
        m.calls.with_label_values(&[self.method, label]).inc();
        m.call_seconds
            .with_label_values(&[self.method])
            .observe(elapsed.as_secs_f64());
        let refused = !matches!(code, Code::Ok | Code::Cancelled);
        if refused {
            m.refusals.with_label_values(&[label]).inc();
        }
        let level = if refused {
            ::log::Level::Info
        } else {
            ::log::Level::Debug
        };
        if !::log::log_enabled!(target: ACCESS_LOG, level) {
            return;
        }
        let (account, key) = match self.who.0.get() {
            Some((account, key)) => (
                if account.is_empty() {
                    "anonymous"
                } else {
                    account
                },
                key.as_deref().unwrap_or("-"),
            ),
            None => ("-", "-"),
        };
        let suppressed = if refused {
            // Who the line counts against: the account, else the peer's address as the
            // lockouts count it (its port changes with each connection; an IPv6 peer has a
            // /64 to pick addresses from).
            let key = match self.who.0.get() {
                Some((account, _)) => format!("account:{account}"),
                None => format!("peer:{}", crate::lockout::address_of(&self.peer)),
            };
            match line_budget().admit(&key) {
                Some(suppressed) => suppressed,
                None => return,
            }
        } else {
            0
        };
        ::log::log!(
            target: ACCESS_LOG,
            level,
            "{} {} {:.3}ms peer={} account={} key={}{}{}",
            self.method,
            label,
            elapsed.as_secs_f64() * 1000.0,
            self.peer,
            account,
            key,
            Message(message),
            Suppressed(suppressed),
        );
    }
}

impl Drop for CallRecord {
    fn drop(&mut self) {
        // Never finished: the peer reset the stream or went away.
        self.finish(Code::Cancelled, "");
    }
}

/// A call's `grpc-message` as the line shows it: ` message="..."`, decoded from the wire's
/// percent-encoding (gRPC's HTTP/2 protocol: `%XX` of UTF-8) so that an operator reads
/// `invalid channel name: ''` rather than `invalid%20channel%20name...`, cut to
/// [`MESSAGE_CHARS`] and quoted with Rust's escapes (a peer's text cannot forge a line break or
/// a field); nothing when the message is empty.
struct Message<'a>(&'a str);

/// The longest message a line shows, in characters (the relay's own are under 200).
const MESSAGE_CHARS: usize = 200;

impl std::fmt::Display for Message<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.0.is_empty() {
            return Ok(());
        }
        let decoded = percent_decode(self.0);
        let shown: String = decoded.chars().take(MESSAGE_CHARS).collect();
        write!(f, " message={shown:?}")
    }
}

/// `text` with each `%XX` (two hex digits) replaced by its byte, read as UTF-8 (lossily); any
/// other `%` is kept.
fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| char::from(b).to_digit(16);
        match (
            bytes[i],
            bytes.get(i + 1).copied().and_then(hex),
            bytes.get(i + 2).copied().and_then(hex),
        ) {
            (b'%', Some(high), Some(low)) => {
                // Two hex digits: at most 0xff.
                out.push(u8::try_from(high * 16 + low).unwrap_or(b'?'));
                i += 3;
            }
            (b, _, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Shows " (N similar lines suppressed)" after a line, nothing for 0.
pub(crate) struct Suppressed(pub u64);

impl std::fmt::Display for Suppressed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.0 == 0 {
            return Ok(());
        }
        write!(f, " ({} similar lines suppressed)", self.0)
    }
}

/// Refusal lines one key (an account, or a peer address) may write in a burst, then per
/// second; and all keys together. A refusal line is ~200 bytes: at these rates the refusals of
/// one key write at most ~200 B/s after a 4 KiB burst, and all of them at most ~10 KB/s,
/// whatever the peers send. Measured at 9b2be07 (a line per refused batch item): batches of
/// 1,024 malformed one-byte items wrote 6.2 MB/s of log for 0.33 MB/s received (19x).
const KEY_BURST: f64 = 20.0;
const KEY_RATE: f64 = 1.0;
const ALL_BURST: f64 = 200.0;
const ALL_RATE: f64 = 50.0;
/// Keys remembered; past it, keys idle for a minute are forgotten (and, if none is, new keys
/// share the overall budget only).
const MAX_KEYS: usize = 10_000;
const IDLE: Duration = Duration::from_secs(60);

/// The rate limit on refusal lines (see [`KEY_BURST`]).
pub(crate) struct LineBudget {
    state: Mutex<Budget>,
}

struct Budget {
    keys: HashMap<String, KeyLines>,
    all: TokenBucket,
    /// Lines held back that no key's entry could count (the map was full).
    unkeyed: u64,
}

struct KeyLines {
    bucket: TokenBucket,
    suppressed: u64,
}

impl LineBudget {
    pub(crate) fn new() -> LineBudget {
        LineBudget {
            state: Mutex::new(Budget {
                keys: HashMap::new(),
                all: TokenBucket::full(ALL_RATE, ALL_BURST, Instant::now()),
                unkeyed: 0,
            }),
        }
    }

    /// Whether a line of `key` may be written now: Some(the lines held back since the last
    /// one written, to be said with it), or None (held back, and counted).
    pub(crate) fn admit(&self, key: &str) -> Option<u64> {
        let now = Instant::now();
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let Budget { keys, all, unkeyed } = &mut *state;
        if !keys.contains_key(key) && keys.len() >= MAX_KEYS {
            keys.retain(|_, k| now.saturating_duration_since(k.bucket.updated) < IDLE);
        }
        let entry = if keys.len() < MAX_KEYS || keys.contains_key(key) {
            Some(keys.entry(key.to_owned()).or_insert_with(|| KeyLines {
                bucket: TokenBucket::full(KEY_RATE, KEY_BURST, now),
                suppressed: 0,
            }))
        } else {
            None
        };
        let Some(lines) = entry else {
            if all.take(now, 1.0).is_zero() {
                return Some(std::mem::take(unkeyed));
            }
            *unkeyed += 1;
            return None;
        };
        // The key's own budget first: a key past it does not use up the overall one.
        if lines.bucket.take(now, 1.0).is_zero() && all.take(now, 1.0).is_zero() {
            return Some(std::mem::take(&mut lines.suppressed) + std::mem::take(unkeyed));
        }
        lines.suppressed += 1;
        None
    }
}

/// The process's budget of refusal lines.
pub(crate) fn line_budget() -> &'static LineBudget {
    static BUDGET: OnceLock<LineBudget> = OnceLock::new();
    BUDGET.get_or_init(LineBudget::new)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_are_shown_readable_and_quoted() {
        let shown = |m: &str| Message(m).to_string();
        assert_eq!(
            shown("invalid%20channel%20name:%20''"),
            " message=\"invalid channel name: ''\""
        );
        assert_eq!(shown(""), "");
        // UTF-8 decoded; a stray or short % kept; a peer's line break and quote escaped.
        assert_eq!(shown("caf%C3%A9 100% %4"), " message=\"café 100% %4\"");
        assert_eq!(
            shown("a%0Aaccount=admin%22"),
            " message=\"a\\naccount=admin\\\"\""
        );
        assert_eq!(
            shown(&"x".repeat(5000)).len(),
            " message=\"\"".len() + MESSAGE_CHARS
        );
    }

    #[test]
    fn lines_are_held_back_per_key_and_counted() {
        let budget = LineBudget::new();
        let admitted = (0..100)
            .filter(|_| budget.admit("account:a").is_some())
            .count();
        // The burst, and at most a token more refilled meanwhile.
        assert!((20..=21).contains(&admitted), "{admitted}");
        // Another key has its own.
        assert_eq!(budget.admit("account:b"), Some(0));
        assert_eq!(Suppressed(0).to_string(), "");
        assert_eq!(Suppressed(79).to_string(), " (79 similar lines suppressed)");
    }

    #[test]
    fn all_keys_together_are_bounded() {
        let budget = LineBudget::new();
        let admitted = (0..1000)
            .filter(|i| budget.admit(&format!("account:{i}")).is_some())
            .count();
        assert!((200..=202).contains(&admitted), "{admitted}");
    }
}
