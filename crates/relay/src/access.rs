//! The relay's access log and call metrics: one [`CallRecord`] per gRPC call, finished once
//! with the call's status code (from its trailers, or its headers for a trailers-only answer;
//! CANCELLED when the peer went away first).
//!
//! Records go to the `static.relay.access` logger: refusals (any code but OK and CANCELLED) at
//! INFO, the rest at DEBUG. A relay serves tens of thousands of calls a second (`bench/e2e.py`,
//! unary publishes), and each record that is written crosses into Python's logging (with the
//! GIL): so successful calls are logged only at `--log-level debug`, where the level check (one
//! atomic load) is all they cost otherwise. Never a token: the account and key ids only.

use std::sync::{Arc, OnceLock};
use std::time::Instant;

use http::HeaderMap;
use tonic::Code;

use crate::metrics::{code_label, metrics};

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
        // grpc-message is percent-encoded and may be long: cut, never decoded into the log.
        let message: String = message.chars().take(200).collect();
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
            if message.is_empty() { "" } else { " message=" },
            message,
        );
    }
}

impl Drop for CallRecord {
    fn drop(&mut self) {
        // Never finished: the peer reset the stream or went away.
        self.finish(Code::Cancelled, "");
    }
}
