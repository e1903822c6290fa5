//! The one retry policy of the client: what to do after a [`Refusal`], for every loop that
//! talks to the relay (calls, the reader's subscription, the publisher's call, sends), and
//! when to try again at a commit that lost its epoch to another member's ([`commit_wait`]).

use std::time::{Duration, Instant};

use crate::refusal::Refusal;

/// First wait after a transient failure; it doubles up to [`BACKOFF_MAX`].
pub(crate) const BACKOFF_MIN: Duration = Duration::from_millis(50);
/// Longest wait between two attempts: a relay that comes back is found within this.
pub(crate) const BACKOFF_MAX: Duration = Duration::from_secs(2);
/// A fresh token refused this many times in a row is final (the key is not accepted).
const TOKEN_STRIKES: u32 = 2;

/// Widest random wait before an attempt at a commit in a contended channel: a few times the
/// spread, on a busy 2-core machine, of the moments the members learn of a new epoch.
const COMMIT_WINDOW: Duration = Duration::from_millis(32);
/// A commit of ours that won this recently may be beating members that keep losing: our next
/// one waits too (see [`commit_wait`]).
pub(crate) const COMMIT_YIELD: Duration = Duration::from_millis(250);

/// How long to wait before an attempt at a commit, after `losses` attempts of this call lost
/// their epoch to other members' commits, `won_recently` if a commit of ours won within
/// [`COMMIT_YIELD`].
///
/// The relay takes the first commit it gets for an epoch (the fence), and the members that
/// contend all learn of the new epoch at about the same moment, so each race was a lottery:
/// with 5 members rotating keys freely, one lost 16 in a row in ~2.8% of its calls (0.8^16).
/// So the members that lost most go first: a random wait within a window that halves with each
/// loss, the widest for the member that just won (otherwise, being first to know its own
/// commit, it could win every race), none at all outside a contention (a member committing
/// alone, or first after a quiet spell). A member that lost k times beats one that just won
/// with odds 1 - 2^-(k+1), whoever else contends with fewer losses than it.
pub(crate) fn commit_wait(losses: u32, won_recently: bool) -> Duration {
    let window = match losses {
        0 if won_recently => COMMIT_WINDOW,
        0 => return Duration::ZERO,
        n => COMMIT_WINDOW / 2u32.saturating_pow(n.min(16)),
    };
    window.mul_f64(random_unit())
}

/// A random number in [0, 1) (not for secrets: the standard library seeds its hasher keys
/// randomly per process, and each `RandomState` gets new ones).
fn random_unit() -> f64 {
    use std::hash::{BuildHasher, Hasher};
    let bits = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    // The top 53 bits, as a fraction of 2^53.
    (bits >> 11) as f64 / (1u64 << 53) as f64
}

/// What a loop does next after a refusal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Step {
    /// Try again after this wait.
    Wait(Duration),
    /// Drop the token and try again with a fresh one, at once.
    Refresh,
    /// Stop: the refusal is final, or the deadline has passed.
    GiveUp,
}

/// One loop's retry state: its deadline (none for the background workers, which retry for as
/// long as the channel lives), its backoff and its token refusals in a row.
#[derive(Debug, Clone)]
pub(crate) struct Retry {
    deadline: Option<Instant>,
    backoff: Duration,
    strikes: u32,
}

impl Retry {
    /// Retries until `within` from now.
    pub(crate) fn within(within: Duration) -> Self {
        Self {
            deadline: Instant::now().checked_add(within),
            backoff: BACKOFF_MIN,
            strikes: 0,
        }
    }

    /// Retries for as long as the caller lives (a background worker).
    pub(crate) fn forever() -> Self {
        Self {
            deadline: None,
            backoff: BACKOFF_MIN,
            strikes: 0,
        }
    }

    /// When the loop gives up on transient failures (`None`: never).
    pub(crate) fn deadline(&self) -> Option<Instant> {
        self.deadline
    }

    pub(crate) fn expired(&self) -> bool {
        self.deadline.is_some_and(|d| Instant::now() >= d)
    }

    /// The relay answered: the next failure starts the backoff afresh.
    pub(crate) fn answered(&mut self) {
        self.backoff = BACKOFF_MIN;
        self.strikes = 0;
    }

    /// What to do after `refusal`. A stale epoch is the caller's to handle (it must make its
    /// message again), so it gives up here like a final refusal.
    pub(crate) fn step(&mut self, refusal: &Refusal) -> Step {
        match refusal {
            Refusal::RetryAfter { wait, .. } if !self.expired() => Step::Wait(self.bounded(*wait)),
            Refusal::Transient { .. } if !self.expired() => {
                let wait = self.bounded(self.backoff);
                self.backoff = (self.backoff * 2).min(BACKOFF_MAX);
                Step::Wait(wait)
            }
            Refusal::Unauthenticated { .. } if self.strikes < TOKEN_STRIKES => {
                self.strikes += 1;
                Step::Refresh
            }
            _ => Step::GiveUp,
        }
    }

    /// A wait that ends by the deadline (the last attempt is made at it, not after).
    fn bounded(&self, wait: Duration) -> Duration {
        match self.deadline {
            Some(deadline) => wait.min(deadline.saturating_duration_since(Instant::now())),
            None => wait,
        }
    }
}

#[cfg(test)]
mod tests {
    use tonic::Code;

    use super::*;

    fn transient() -> Refusal {
        Refusal::transient(Code::Unavailable, "down")
    }

    #[test]
    fn transient_failures_back_off_exponentially_up_to_the_cap() {
        let mut retry = Retry::forever();
        let waits: Vec<_> = (0..8)
            .map(|_| match retry.step(&transient()) {
                Step::Wait(wait) => wait.as_millis(),
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(waits, [50, 100, 200, 400, 800, 1600, 2000, 2000]);
        retry.answered();
        assert_eq!(retry.step(&transient()), Step::Wait(BACKOFF_MIN));
    }

    #[test]
    fn nothing_is_retried_after_the_deadline() {
        let mut retry = Retry::within(Duration::ZERO);
        assert_eq!(retry.step(&transient()), Step::GiveUp);
        let limited = Refusal::RetryAfter {
            wait: Duration::from_millis(10),
            message: String::new(),
        };
        assert_eq!(retry.step(&limited), Step::GiveUp);
        // A wait never runs past the deadline.
        let mut retry = Retry::within(Duration::from_millis(100));
        match retry.step(&Refusal::RetryAfter {
            wait: Duration::from_secs(60),
            message: String::new(),
        }) {
            Step::Wait(wait) => assert!(wait <= Duration::from_millis(100)),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_token_refused_again_and_again_is_final() {
        let refused = Refusal::Unauthenticated {
            message: "expired".into(),
        };
        let mut retry = Retry::forever();
        assert_eq!(retry.step(&refused), Step::Refresh);
        assert_eq!(retry.step(&refused), Step::Refresh);
        assert_eq!(retry.step(&refused), Step::GiveUp);
        retry.answered();
        assert_eq!(retry.step(&refused), Step::Refresh);
    }

    #[test]
    fn the_members_that_lost_most_wait_least_before_a_commit() {
        // Alone, or first after a quiet spell: at once.
        assert_eq!(commit_wait(0, false), Duration::ZERO);
        let samples = |losses, won_recently| -> Vec<Duration> {
            (0..2000)
                .map(|_| commit_wait(losses, won_recently))
                .collect()
        };
        let winner = samples(0, true);
        assert!(winner.iter().all(|w| *w < COMMIT_WINDOW));
        // Random: spread over the window, not one value.
        assert!(winner.iter().any(|w| *w < COMMIT_WINDOW / 4));
        assert!(winner.iter().any(|w| *w > COMMIT_WINDOW * 3 / 4));
        for losses in 1..6u32 {
            let loser = samples(losses, true);
            assert!(loser.iter().all(|w| *w < COMMIT_WINDOW / 2u32.pow(losses)));
            // Against the member that just won, the loser goes first with odds
            // 1 - 2^-(losses+1): 3/4 after one loss, 63/64 after five.
            let first = loser.iter().zip(&winner).filter(|(l, w)| l < w).count();
            let expected = 2000.0 * (1.0 - 0.5f64.powi(losses as i32 + 1));
            assert!((first as f64 - expected).abs() < 120.0, "{losses}: {first}");
        }
    }

    #[test]
    fn final_refusals_and_stale_epochs_are_not_retried() {
        let mut retry = Retry::forever();
        let fin = Refusal::Final {
            code: Code::NotFound,
            message: String::new(),
        };
        assert_eq!(retry.step(&fin), Step::GiveUp);
        let stale = Refusal::StaleEpoch {
            current: 3,
            message: String::new(),
        };
        assert_eq!(retry.step(&stale), Step::GiveUp);
    }
}
