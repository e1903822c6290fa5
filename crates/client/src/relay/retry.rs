//! The one retry policy of the client: what to do after a [`Refusal`], for every loop that
//! talks to the relay (calls, the reader's subscription, the publisher's call, sends), and
//! when to try again at a commit that lost its epoch to another member's ([`CommitPace`]).

use std::time::{Duration, Instant};

use super::refusal::Refusal;

/// First wait after a transient failure; it doubles up to [`BACKOFF_MAX`].
pub(crate) const BACKOFF_MIN: Duration = Duration::from_millis(50);
/// Longest wait between two attempts: a relay that comes back is found within this.
pub(crate) const BACKOFF_MAX: Duration = Duration::from_secs(2);
/// A fresh token refused this many times in a row is final (the key is not accepted).
const TOKEN_STRIKES: u32 = 2;

/// How long after a commit of ours won its epoch the next one steps aside first (see
/// [`CommitPace`]): a caller committing again at once (a loop of `rotate_keys`) may be racing
/// members whose commits just lost to ours.
const COMMIT_YIELD_AFTER: Duration = Duration::from_millis(500);
/// Bounds of the estimate of a commit round (making a commit, publishing it, learning its
/// fate and applying the winner), from which the waits are scaled: 5-20 ms measured on a
/// release build on 2 busy cores, several times that on a debug build.
const ROUND_FLOOR: Duration = Duration::from_millis(5);
const ROUND_CEILING: Duration = Duration::from_millis(250);

/// The pace of one channel's commits: when a commit of ours last won, and how long a round
/// takes. Decides the waits before an attempt at a commit.
///
/// The relay takes the first commit it gets for an epoch (the fence), and contending members
/// learn of a new epoch at about the same moment, so each race was a lottery: with 5 members
/// rotating keys freely one lost 16 in a row in ~2.8% of its calls (0.8^16), and the member
/// that had just won, first to know its own commit (merging it costs less than processing
/// another's), won more than its share. So:
/// - a commit of ours that won within [`COMMIT_YIELD_AFTER`] makes the next one step aside
///   until another member's commit moves the epoch, for at most two rounds
///   ([`CommitPace::step_aside`]): the members that lost to it go first;
/// - then, and after each loss, a random wait within a window of 4 rounds (after stepping aside
///   for a commit that came) halving with each loss ([`CommitPace::wait`]): the members that
///   lost most go first (after k losses, before one with none with odds 1 - 2^-(k+1));
/// - no wait at all outside a contention (a member committing alone, or after a quiet spell),
///   beyond the two rounds of stepping aside for a commit right after one of its own.
///
/// The windows follow the measured round, so the order holds on a slow machine too.
#[derive(Debug, Clone, Default)]
pub(crate) struct CommitPace {
    last_win: Option<Instant>,
    round: Option<Duration>,
}

impl CommitPace {
    fn round(&self) -> Duration {
        self.round
            .unwrap_or(ROUND_FLOOR)
            .clamp(ROUND_FLOOR, ROUND_CEILING)
    }

    /// An attempt took `took`, from making the commit to applying the epoch's winner.
    pub(crate) fn record(&mut self, took: Duration) {
        self.round = Some(match self.round {
            Some(round) => (round * 3 + took) / 4,
            None => took,
        });
    }

    /// A commit of ours won its epoch.
    pub(crate) fn won(&mut self) {
        self.last_win = Some(Instant::now());
    }

    /// How long to wait, at most, for another member's commit before our first attempt: two
    /// rounds right after a win of ours, else none.
    pub(crate) fn step_aside(&self) -> Option<Duration> {
        self.last_win
            .filter(|at| at.elapsed() < COMMIT_YIELD_AFTER)
            .map(|_| self.round() * 2)
    }

    /// How long to wait before an attempt after `losses` lost ones, `contended` if another
    /// member's commit came while we stepped aside.
    pub(crate) fn wait(&self, losses: u32, contended: bool) -> Duration {
        if losses == 0 && !contended {
            return Duration::ZERO;
        }
        let window = self.round() * 4 / 2u32.saturating_pow(losses.min(16));
        window.mul_f64(random_unit())
    }
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
        let mut pace = CommitPace::default();
        // Alone, or first after a quiet spell: at once, no stepping aside.
        assert_eq!(pace.wait(0, false), Duration::ZERO);
        assert_eq!(pace.step_aside(), None);
        pace.record(Duration::from_millis(20));
        pace.won();
        // Right after a win: two rounds aside at most.
        assert_eq!(pace.step_aside(), Some(Duration::from_millis(40)));
        let samples = |losses, contended| -> Vec<Duration> {
            (0..2000).map(|_| pace.wait(losses, contended)).collect()
        };
        let window = Duration::from_millis(80);
        let fresh = samples(0, true);
        assert!(fresh.iter().all(|w| *w < window));
        // Random: spread over the window, not one value.
        assert!(fresh.iter().any(|w| *w < window / 4));
        assert!(fresh.iter().any(|w| *w > window * 3 / 4));
        for losses in 1..6u32 {
            let loser = samples(losses, false);
            assert!(loser.iter().all(|w| *w < window / 2u32.pow(losses)));
            // Against a member without a loss, the loser goes first with odds
            // 1 - 2^-(losses+1): 3/4 after one loss, 63/64 after five.
            let first = loser.iter().zip(&fresh).filter(|(l, f)| l < f).count();
            let expected = 2000.0 * (1.0 - 0.5f64.powi(losses as i32 + 1));
            assert!((first as f64 - expected).abs() < 120.0, "{losses}: {first}");
        }
        // The windows follow the measured round, within bounds.
        for _ in 0..50 {
            pace.record(Duration::from_secs(5));
        }
        assert_eq!(pace.step_aside(), Some(ROUND_CEILING * 2));
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
