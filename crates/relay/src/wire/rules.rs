//! Pure rules of the relay: the epoch fence, idempotency keys, rate limits, org keys.
//! (Bearer tokens: `auth.rs`.)

use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

use crate::error::{RelayError, Result};
use crate::wire::framing::{ContentType, MessageHeader};

pub const MAX_IDEMPOTENCY_KEY: usize = 64;

/// The prefix of client-given keys: keeps them from ever equalling a digest-derived key.
const GIVEN_KEY_PREFIX: &[u8] = b"k:";

/// `Err(StaleEpoch)` unless `header` may be appended at `channel_epoch`: commits and proposals
/// need the current epoch; application messages the current one or one of the
/// `application_window` before it.
pub fn check_fence(
    header: &MessageHeader,
    channel_epoch: u64,
    application_window: u64,
) -> Result<()> {
    let ok = match header.content_type {
        ContentType::Application => {
            header.epoch <= channel_epoch && channel_epoch - header.epoch <= application_window
        }
        ContentType::Proposal | ContentType::Commit => header.epoch == channel_epoch,
    };
    if ok {
        Ok(())
    } else {
        Err(RelayError::StaleEpoch {
            message_epoch: header.epoch,
            current_epoch: channel_epoch,
        })
    }
}

/// The channel's epoch once `header` (already fenced) is appended.
pub fn epoch_after(header: &MessageHeader, channel_epoch: u64) -> u64 {
    match header.content_type {
        // Saturating: a fenced commit is at the channel's epoch, which framing keeps below
        // u64::MAX.
        ContentType::Commit => channel_epoch.saturating_add(1),
        ContentType::Application | ContentType::Proposal => channel_epoch,
    }
}

/// The key that makes a publish idempotent: `b"k:" + given`, or SHA-256 of the message when
/// none is given; InvalidArgument when `given` is longer than [`MAX_IDEMPOTENCY_KEY`].
pub fn idempotency_key(given: &[u8], message: &[u8]) -> Result<Vec<u8>> {
    if given.is_empty() {
        return Ok(Sha256::digest(message).to_vec());
    }
    if given.len() > MAX_IDEMPOTENCY_KEY {
        return Err(RelayError::InvalidArgument(format!(
            "idempotency_key longer than {MAX_IDEMPOTENCY_KEY} bytes"
        )));
    }
    let mut key = Vec::with_capacity(GIVEN_KEY_PREFIX.len() + given.len());
    key.extend_from_slice(GIVEN_KEY_PREFIX);
    key.extend_from_slice(given);
    Ok(key)
}

/// `rate` tokens a second, at most `burst` saved up.
#[derive(Debug, Clone)]
pub struct TokenBucket {
    pub rate: f64,
    pub burst: f64,
    pub tokens: f64,
    pub updated: Instant,
}

impl TokenBucket {
    pub fn full(rate: f64, burst: f64, now: Instant) -> Self {
        TokenBucket {
            rate,
            burst,
            tokens: burst,
            updated: now,
        }
    }

    /// Take `n` tokens: `Duration::ZERO` on success, else how long until they would be there
    /// (`Duration::MAX` when they never will: a rate of 0).
    pub fn take(&mut self, now: Instant, n: f64) -> Duration {
        // Instants are monotonic; a `now` older than the last update (callers racing) adds
        // nothing rather than taking tokens back.
        let elapsed = now.saturating_duration_since(self.updated).as_secs_f64();
        self.tokens = self.burst.min(self.tokens + elapsed * self.rate);
        self.updated = self.updated.max(now);
        if self.tokens >= n {
            self.tokens -= n;
            return Duration::ZERO;
        }
        if self.rate > 0.0 {
            Duration::try_from_secs_f64((n - self.tokens) / self.rate).unwrap_or(Duration::MAX)
        } else {
            Duration::MAX
        }
    }
}

/// Buckets kept before idle (full) ones are dropped.
const MAX_KEYED_BUCKETS: usize = 10_000;

/// A [`TokenBucket`] per key (an account), made full on first use: `rate` a second, `burst`
/// saved up. A rate of 0 or below (or NaN) is no limit.
#[derive(Debug)]
pub struct KeyedBuckets {
    rate: f64,
    burst: f64,
    buckets: Mutex<HashMap<String, TokenBucket>>,
}

impl KeyedBuckets {
    pub fn new(rate: f64, burst: f64) -> Self {
        KeyedBuckets {
            rate,
            burst: burst.max(1.0),
            buckets: Mutex::new(HashMap::new()),
        }
    }

    /// Takes one token of `key`'s bucket: `Ok`, or `Err(wait)` until one would be there
    /// (rounded up to a whole millisecond, at least 1).
    pub fn take(&self, key: &str, now: Instant) -> std::result::Result<(), u64> {
        if self.rate.is_nan() || self.rate <= 0.0 {
            return Ok(());
        }
        let wait = {
            let mut buckets = self.buckets.lock().unwrap_or_else(PoisonError::into_inner);
            if !buckets.contains_key(key) && buckets.len() >= MAX_KEYED_BUCKETS {
                // A bucket idle long enough to be full again is the same as none.
                let refill =
                    Duration::try_from_secs_f64(self.burst / self.rate).unwrap_or(Duration::MAX);
                buckets.retain(|_, b| now.saturating_duration_since(b.updated) < refill);
            }
            buckets
                .entry(key.to_owned())
                .or_insert_with(|| TokenBucket::full(self.rate, self.burst, now))
                .take(now, 1.0)
        };
        if wait.is_zero() {
            return Ok(());
        }
        let ms = (wait.as_secs_f64() * 1000.0).ceil().max(1.0);
        // Saturating float-to-int conversion: a "never" (Duration::MAX) stays huge.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        Err(ms as u64)
    }
}

/// The key under which an org is owned: its name in lower case without '-', '.' and '_'. So
/// `Acme`, `ACME`, `acme-`, `acme.` and `ac_me` are one org, owned by whoever claimed the
/// first of them (issue 27: they were five orgs, so another account could claim a look-alike
/// of a claimed org). Channel names are ASCII (`static_mls::validate_channel_name`).
pub fn org_key(org: &str) -> String {
    org.chars()
        .filter(|c| !matches!(c, '-' | '.' | '_'))
        .map(|c| c.to_ascii_lowercase())
        .collect()
}

/// What the per-address cap counts: the address, but an IPv6 client's /64 (one subscriber
/// typically holds a whole /64: single addresses would be free to rotate), as the HTTP
/// port's caps and rate limits count it (`static/api/_ratelimit.py::client_key`); the relay's connection caps and anonymous rate limits.
pub(crate) fn client_key(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V6(v6) => IpAddr::V6(Ipv6Addr::from(u128::from(v6) & !u128::from(u64::MAX))),
        v4 => v4,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn header(content_type: ContentType, epoch: u64) -> MessageHeader {
        MessageHeader {
            wire_format: 2,
            group_id: b"g".to_vec(),
            epoch,
            content_type,
        }
    }

    fn stale(message_epoch: u64, current_epoch: u64) -> Result<()> {
        Err(RelayError::StaleEpoch {
            message_epoch,
            current_epoch,
        })
    }

    #[test]
    fn fence() {
        for ct in [ContentType::Commit, ContentType::Proposal] {
            assert_eq!(check_fence(&header(ct, 5), 5, 3), Ok(()));
            assert_eq!(check_fence(&header(ct, 4), 5, 3), stale(4, 5));
            assert_eq!(check_fence(&header(ct, 6), 5, 3), stale(6, 5));
        }
        let app = ContentType::Application;
        assert_eq!(check_fence(&header(app, 5), 5, 3), Ok(()));
        assert_eq!(check_fence(&header(app, 2), 5, 3), Ok(()));
        assert_eq!(check_fence(&header(app, 1), 5, 3), stale(1, 5));
        assert_eq!(check_fence(&header(app, 6), 5, 3), stale(6, 5));
        // A window larger than the channel's age reaches back to epoch 0.
        assert_eq!(check_fence(&header(app, 0), 1, 10), Ok(()));
        assert_eq!(check_fence(&header(app, 0), 0, 0), Ok(()));
        assert_eq!(check_fence(&header(app, 0), 1, 0), stale(0, 1));
    }

    #[test]
    fn epochs_after() {
        assert_eq!(epoch_after(&header(ContentType::Commit, 5), 5), 6);
        assert_eq!(epoch_after(&header(ContentType::Proposal, 5), 5), 5);
        assert_eq!(epoch_after(&header(ContentType::Application, 3), 5), 5);
    }

    #[test]
    fn idempotency_keys() {
        let digest = idempotency_key(b"", b"hello").unwrap();
        assert_eq!(digest, Sha256::digest(b"hello").to_vec());
        assert_eq!(
            idempotency_key(b"abc", b"hello").unwrap(),
            b"k:abc".to_vec()
        );
        assert_eq!(idempotency_key(&[1; 64], b"m").unwrap().len(), 66);
        assert_eq!(
            idempotency_key(&[1; 65], b"m"),
            Err(RelayError::InvalidArgument(
                "idempotency_key longer than 64 bytes".into()
            ))
        );
    }

    #[test]
    fn look_alike_orgs_share_a_key() {
        for org in ["acme", "Acme", "ACME", "acme-", "acme.", "a.c-m_e", "AcMe_"] {
            assert_eq!(org_key(org), "acme", "{org}");
        }
        assert_ne!(org_key("acme2"), org_key("acme"));
    }

    #[test]
    fn keyed_buckets() {
        let t0 = Instant::now();
        let buckets = KeyedBuckets::new(0.5, 2.0);
        assert_eq!(buckets.take("a", t0), Ok(()));
        assert_eq!(buckets.take("a", t0), Ok(()));
        assert_eq!(buckets.take("a", t0), Err(2000));
        // Another key has a bucket of its own.
        assert_eq!(buckets.take("b", t0), Ok(()));
        assert_eq!(buckets.take("a", t0 + Duration::from_secs(2)), Ok(()));
        let unlimited = KeyedBuckets::new(0.0, 1.0);
        for _ in 0..100 {
            assert_eq!(unlimited.take("a", t0), Ok(()));
        }
    }

    #[test]
    fn token_bucket() {
        let t0 = Instant::now();
        let mut bucket = TokenBucket::full(2.0, 3.0, t0);
        for _ in 0..3 {
            assert_eq!(bucket.take(t0, 1.0), Duration::ZERO);
        }
        let wait = bucket.take(t0, 1.0);
        assert!((wait.as_secs_f64() - 0.5).abs() < 1e-9, "{wait:?}");
        // Half a second later one token is back, and no more.
        let t1 = t0 + Duration::from_millis(500);
        assert_eq!(bucket.take(t1, 1.0), Duration::ZERO);
        assert!(bucket.take(t1, 1.0) > Duration::ZERO);
        // Refills up to the burst only.
        let t2 = t1 + Duration::from_secs(100);
        for _ in 0..3 {
            assert_eq!(bucket.take(t2, 1.0), Duration::ZERO);
        }
        assert!(bucket.take(t2, 1.0) > Duration::ZERO);
        let mut never = TokenBucket::full(0.0, 1.0, t0);
        assert_eq!(never.take(t0, 1.0), Duration::ZERO);
        assert_eq!(never.take(t2, 1.0), Duration::MAX);
    }
}
