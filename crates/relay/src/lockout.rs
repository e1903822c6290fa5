//! Addresses the token verifier locked out for failed authentications, remembered here so that
//! their calls are refused before the verifier is asked again.
//!
//! The verifier (the server's authority, in Python) owns the rule: failed authentications per
//! client address, and an exemption for a token that worked from there lately
//! (`static/api/_ratelimit.py`, docs/design.md §4.1). Before this memo, every call of a locked-out
//! address still crossed into Python to be told so: a flood of junk tokens (1.4k/s) took the
//! HTTP port's p50 from 7 to 29 ms and a new relay call's from 3.6 to 38 ms (issue 27). Now a
//! lockout answer (RESOURCE_EXHAUSTED with a retry-after) is replayed here until it runs out,
//! and then one call (a probe) asks again while the others are still refused.
//!
//! The memo never lets a call through that the verifier would refuse: it only refuses calls
//! the verifier refused just now for the same reason, and asks the verifier whenever it is not
//! sure. A token that verified lately (from anywhere: a superset of the verifier's per-address
//! exemption) is always asked about, so a good client behind the same address as a guesser is
//! not locked out by the memo. Each call's token is still checked by the verifier: revocation
//! stays immediate.
//!
//! Memory is bounded: at most [`MAX_ADDRESSES`] locked-out addresses (expired ones are dropped
//! first, then the rest: the memo may forget, and forgetting only asks the verifier again) and
//! [`MAX_KNOWN`] token digests.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

use crate::error::RelayError;
use crate::wire::rules::client_key;

/// Locked-out addresses remembered at once.
pub const MAX_ADDRESSES: usize = 65_536;
/// Digests of tokens that verified lately: the verifier's own memory of them (50,000
/// address-token pairs) holds no more distinct tokens.
pub const MAX_KNOWN: usize = 50_000;

/// A token's digest: the memo keeps no token.
pub type TokenDigest = [u8; 32];

/// The digest of `token`.
pub fn digest(token: &str) -> TokenDigest {
    Sha256::digest(token.as_bytes()).into()
}

/// Whom a call's `peer` (`ip:port`) counts as: its address (an IPv6 peer's /64), as the
/// verifier counts it; the text itself when it is not an address.
pub fn address_of(peer: &str) -> String {
    match peer.parse::<SocketAddr>() {
        Ok(addr) => client_key(addr.ip()).to_string(),
        Err(_) => peer.to_owned(),
    }
}

struct LockedOut {
    until: Instant,
    /// The verifier's wait when it locked the address out: the gap between probes.
    wait: Duration,
    message: String,
}

#[derive(Default)]
struct State {
    addresses: HashMap<String, LockedOut>,
    /// Digest -> when it last verified (its order in `seq`).
    known: HashMap<TokenDigest, u64>,
    seq: u64,
}

/// What the verifier answered lately, per address and per token.
#[derive(Default)]
pub struct Lockouts {
    state: Mutex<State>,
}

impl Lockouts {
    /// The refusal to give `address` without asking the verifier, or None to ask it. Past a
    /// lockout's end, the first call asks (a probe) and the others are refused for one more
    /// wait, so that a flood does not rush the verifier the moment a lockout ends.
    pub fn check(&self, address: &str, token: &TokenDigest, now: Instant) -> Option<RelayError> {
        let mut state = self.lock();
        if state.known.contains_key(token) {
            return None;
        }
        let locked = state.addresses.get_mut(address)?;
        if now >= locked.until {
            locked.until = now + locked.wait;
            return None;
        }
        let left = locked.until.saturating_duration_since(now);
        // Whole seconds, as the verifier gives them (at least 1).
        let seconds = left.as_secs() + u64::from(left.subsec_nanos() > 0);
        Some(RelayError::ResourceExhausted {
            message: locked.message.clone(),
            retry_after_ms: seconds.max(1).saturating_mul(1000),
        })
    }

    /// Records the verifier's answer for `token` from `address`.
    pub fn answered(
        &self,
        address: &str,
        token: &TokenDigest,
        answer: &Result<(), &RelayError>,
        now: Instant,
    ) {
        let mut state = self.lock();
        match answer {
            Ok(()) => state.worked(*token),
            Err(RelayError::ResourceExhausted {
                message,
                retry_after_ms,
            }) => {
                let wait = Duration::from_millis((*retry_after_ms).max(1));
                state.lock_out(address, wait, message, now);
            }
            // Refused for itself, not for the address: the verifier counted a failure and
            // did not lock the address out, so it has budget left. Ask it again.
            // The token is no longer exempt either (a revoked key's), as the verifier forgets it.
            Err(RelayError::Unauthenticated(_)) => {
                state.addresses.remove(address);
                state.known.remove(token);
            }
            Err(_) => {}
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl State {
    fn worked(&mut self, token: TokenDigest) {
        self.seq += 1;
        self.known.insert(token, self.seq);
        if self.known.len() > MAX_KNOWN {
            // Keep the most recent half: one sweep per MAX_KNOWN / 2 new tokens.
            let keep_after = self.seq.saturating_sub(MAX_KNOWN as u64 / 2);
            self.known.retain(|_, at| *at > keep_after);
        }
    }

    fn lock_out(&mut self, address: &str, wait: Duration, message: &str, now: Instant) {
        if !self.addresses.contains_key(address) && self.addresses.len() >= MAX_ADDRESSES {
            self.addresses.retain(|_, l| l.until > now);
            if self.addresses.len() >= MAX_ADDRESSES {
                self.addresses.clear();
            }
        }
        self.addresses.insert(
            address.to_owned(),
            LockedOut {
                until: now + wait,
                wait,
                message: message.to_owned(),
            },
        );
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn exhausted(seconds: u64) -> RelayError {
        RelayError::ResourceExhausted {
            message: "too many failed authentications from this address".into(),
            retry_after_ms: seconds * 1000,
        }
    }

    #[test]
    fn a_lockout_is_replayed_until_it_ends_then_one_probe_asks() {
        let memo = Lockouts::default();
        let (junk, t0) = (digest("junk"), Instant::now());
        assert!(memo.check("10.0.0.1", &junk, t0).is_none());
        memo.answered("10.0.0.1", &junk, &Err(&exhausted(2)), t0);
        let refused = memo.check("10.0.0.1", &junk, t0 + Duration::from_millis(500));
        match refused {
            Some(RelayError::ResourceExhausted {
                message,
                retry_after_ms,
            }) => {
                assert_eq!(message, "too many failed authentications from this address");
                assert_eq!(retry_after_ms, 2000);
            }
            other => panic!("{other:?}"),
        }
        // Another address is not locked out.
        assert!(memo.check("10.0.0.2", &junk, t0).is_none());
        // Past the end: one probe, the others still refused.
        let later = t0 + Duration::from_secs(2);
        assert!(memo.check("10.0.0.1", &junk, later).is_none());
        assert!(memo.check("10.0.0.1", &junk, later).is_some());
        // The probe was refused for itself: the address has budget again.
        memo.answered(
            "10.0.0.1",
            &junk,
            &Err(&RelayError::Unauthenticated("invalid token".into())),
            later,
        );
        assert!(memo.check("10.0.0.1", &junk, later).is_none());
    }

    #[test]
    fn a_token_that_worked_is_always_asked_about() {
        let memo = Lockouts::default();
        let (good, junk, t0) = (digest("good"), digest("junk"), Instant::now());
        memo.answered("10.0.0.1", &good, &Ok(()), t0);
        memo.answered("10.0.0.1", &junk, &Err(&exhausted(60)), t0);
        assert!(memo.check("10.0.0.1", &junk, t0).is_some());
        assert!(memo.check("10.0.0.1", &good, t0).is_none());
    }

    #[test]
    fn memory_is_bounded() {
        let memo = Lockouts::default();
        let t0 = Instant::now();
        for i in 0..(MAX_KNOWN + 10) {
            memo.answered("a", &digest(&i.to_string()), &Ok(()), t0);
        }
        for i in 0..(MAX_ADDRESSES + 10) {
            memo.answered(&i.to_string(), &digest("junk"), &Err(&exhausted(60)), t0);
        }
        let state = memo.lock();
        assert!(state.known.len() <= MAX_KNOWN);
        assert!(state.addresses.len() <= MAX_ADDRESSES);
        // The latest are kept.
        assert!(state
            .known
            .contains_key(&digest(&(MAX_KNOWN + 9).to_string())));
    }

    #[test]
    fn addresses_count_as_the_verifier_counts_them() {
        assert_eq!(address_of("10.1.2.3:5555"), "10.1.2.3");
        assert_eq!(address_of("[2001:db8::1]:443"), "2001:db8::");
        assert_eq!(address_of("[::ffff:10.1.2.3]:1"), "10.1.2.3");
        assert_eq!(address_of("not an address"), "not an address");
    }
}
