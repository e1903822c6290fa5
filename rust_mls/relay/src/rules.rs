//! Pure rules of the relay: the epoch fence, idempotency keys, rate limits.
//! A port of `static/relay/_rules.py` (bearer tokens: `auth.rs`).
//!
//! STUB (interface fixed; bodies to be written).

use crate::error::Result;
use crate::framing::MessageHeader;

pub const MAX_IDEMPOTENCY_KEY: usize = 64;

/// `Err(StaleEpoch)` unless `header` may be appended at `channel_epoch`: commits and proposals
/// need the current epoch; application messages the current one or one of the
/// `application_window` before it.
pub fn check_fence(
    header: &MessageHeader,
    channel_epoch: u64,
    application_window: u64,
) -> Result<()> {
    let _ = (header, channel_epoch, application_window);
    todo!()
}

/// The channel's epoch once `header` (already fenced) is appended.
pub fn epoch_after(header: &MessageHeader, channel_epoch: u64) -> u64 {
    let _ = (header, channel_epoch);
    todo!()
}

/// The key that makes a publish idempotent: `b"k:" + given`, or SHA-256 of the message when
/// none is given; InvalidArgument when `given` is longer than [`MAX_IDEMPOTENCY_KEY`].
pub fn idempotency_key(given: &[u8], message: &[u8]) -> Result<Vec<u8>> {
    let _ = (given, message);
    todo!()
}

/// `rate` tokens a second, at most `burst` saved up.
#[derive(Debug, Clone)]
pub struct TokenBucket {
    pub rate: f64,
    pub burst: f64,
    pub tokens: f64,
    pub updated: std::time::Instant,
}

impl TokenBucket {
    pub fn full(rate: f64, burst: f64, now: std::time::Instant) -> Self {
        TokenBucket {
            rate,
            burst,
            tokens: burst,
            updated: now,
        }
    }

    /// Take `n` tokens: `Duration::ZERO` on success, else how long until they would be there.
    pub fn take(&mut self, now: std::time::Instant, n: f64) -> std::time::Duration {
        let _ = (now, n);
        todo!()
    }
}
