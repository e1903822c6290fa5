//! The connection caps (overall and per client address), and the rate-limited log line of
//! what they refuse (and of failing accepts and handshakes).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

use crate::observe::metrics::metrics;

use super::Shared;

/// At most one line per this interval about refused connections or failing accepts: a flood
/// of them must not flood the log (20,000 idle connections once filled it with `accept
/// failed: Too many open files`).
const LOG_EVERY: Duration = Duration::from_secs(10);

/// The connections being served: how many, and from which addresses.
#[derive(Default)]
pub(super) struct Admission {
    total: usize,
    per_address: HashMap<IpAddr, usize>,
}

/// A served connection's place in the caps, given back when it is dropped.
pub(super) struct Admitted {
    pub(super) shared: Arc<Shared>,
    address: IpAddr,
}

impl Shared {
    /// A place for a connection from `address`, or None when a cap is reached.
    pub(super) fn admit(self: &Arc<Self>, address: IpAddr) -> Option<Admitted> {
        let mut admission = self
            .admission
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if admission.total >= self.max_connections {
            return None;
        }
        let held = admission.per_address.entry(address).or_insert(0);
        if *held >= self.max_per_address {
            return None;
        }
        *held += 1;
        admission.total += 1;
        metrics().connections.inc();
        Some(Admitted {
            shared: Arc::clone(self),
            address,
        })
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let mut admission = self
            .shared
            .admission
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        admission.total = admission.total.saturating_sub(1);
        metrics().connections.dec();
        if let Some(held) = admission.per_address.get_mut(&self.address) {
            *held = held.saturating_sub(1);
            if *held == 0 {
                admission.per_address.remove(&self.address);
            }
        }
    }
}

/// A log line at most every [`LOG_EVERY`], saying how many times it happened meanwhile.
pub(super) struct RateLimitedLog {
    what: &'static str,
    last: Option<Instant>,
    unsaid: u64,
}

impl RateLimitedLog {
    pub(super) fn new(what: &'static str) -> Self {
        RateLimitedLog {
            what,
            last: None,
            unsaid: 0,
        }
    }

    pub(super) fn note(&mut self, detail: &dyn std::fmt::Display) {
        self.unsaid += 1;
        let now = Instant::now();
        if self
            .last
            .is_some_and(|last| now.saturating_duration_since(last) < LOG_EVERY)
        {
            return;
        }
        let times = if self.unsaid == 1 {
            String::new()
        } else {
            format!(" ({} times since the last report)", self.unsaid)
        };
        ::log::warn!(target: "static.relay", "{}: {detail}{times}", self.what);
        self.last = Some(now);
        self.unsaid = 0;
    }
}
