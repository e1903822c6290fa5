//! The pool where the relay's costly MLS checks run (a new channel's group, a handshake against
//! its channel's group): off the async workers, a bounded number at a time, and a bounded
//! number per account, so that one account's checks cannot take the relay from everyone else.
//!
//! At 9b2be07 these checks ran inline on a tokio worker: two loops of CreateChannel with 1 MiB
//! trees (305-372 ms of CPU each) took another account's round trip from a p50 of 2.9 ms to
//! 250 ms (issue 27). Here a check waits for one of `workers` permits (one per core: a check
//! is pure CPU) and runs on the blocking pool; an account has at most `per_account` checks
//! admitted (running or waiting), of which one runs at a time. A check past its account's
//! budget is refused at once (RESOURCE_EXHAUSTED with a retry-after) rather than queued: an
//! account's flood then costs the relay one refusal per call.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::Semaphore;

/// How long a caller refused for its budget is told to wait: about one check of a large
/// group (a commit at 512 members costs 2-3 ms; a new group, one leaf, well under 1 ms), with
/// room for the account's others ahead of it.
pub(crate) const RETRY_AFTER: Duration = Duration::from_millis(50);

/// Why a check did not run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum PoolError {
    /// The account has its whole budget admitted already.
    #[error("{admitted} costly group checks of this account are already running or waiting (at most {limit})")]
    Busy { admitted: usize, limit: usize },
    /// The check panicked, or the runtime is shutting down (a bug or a shutdown; never input).
    #[error("a group check did not complete: {0}")]
    Failed(String),
}

/// One account's admitted checks and the lane they run in one at a time.
struct Lane {
    admitted: usize,
    running: Arc<Semaphore>,
}

/// The pool. Cheap to share (`Arc`).
pub(crate) struct VerifyPool {
    workers: Arc<Semaphore>,
    per_account: usize,
    lanes: Mutex<HashMap<Arc<str>, Lane>>,
}

/// An admitted check: given back (its lane freed once the last one goes) when dropped, which
/// happens when the check is done, not when its caller stops waiting for it.
struct Admitted {
    pool: Arc<VerifyPool>,
    account: Arc<str>,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let mut lanes = self
            .pool
            .lanes
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(lane) = lanes.get_mut(&self.account) {
            lane.admitted = lane.admitted.saturating_sub(1);
            if lane.admitted == 0 {
                lanes.remove(&self.account);
            }
        }
    }
}

impl VerifyPool {
    /// `workers` checks at a time (at least 1), `per_account` admitted per account (at least 1).
    pub fn new(workers: usize, per_account: usize) -> Arc<VerifyPool> {
        Arc::new(VerifyPool {
            workers: Arc::new(Semaphore::new(workers.max(1))),
            per_account: per_account.max(1),
            lanes: Mutex::new(HashMap::new()),
        })
    }

    /// One worker per core the process may use.
    pub fn per_core(per_account: usize) -> Arc<VerifyPool> {
        let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
        VerifyPool::new(cores, per_account)
    }

    /// Runs `check` for `account` in the pool: refused at once past the account's budget,
    /// else once its turn comes. A caller that stops waiting does not stop the check; the
    /// check holds its place in the budget until it is done.
    pub async fn run<T, F>(self: &Arc<Self>, account: &str, check: F) -> Result<T, PoolError>
    where
        T: Send + 'static,
        F: FnOnce() -> T + Send + 'static,
    {
        let (admitted, lane) = self.admit(account)?;
        let task = {
            let workers = Arc::clone(&self.workers);
            // Spawned: the permits and the admission go with the check, whatever the caller.
            tokio::spawn(async move {
                let Ok(_turn) = lane.acquire_owned().await else {
                    return Err(PoolError::Failed("the account's lane closed".into()));
                };
                let Ok(_worker) = workers.acquire_owned().await else {
                    return Err(PoolError::Failed("the pool closed".into()));
                };
                let done = tokio::task::spawn_blocking(check).await;
                drop(admitted);
                done.map_err(|e| PoolError::Failed(e.to_string()))
            })
        };
        task.await.map_err(|e| PoolError::Failed(e.to_string()))?
    }

    fn admit(self: &Arc<Self>, account: &str) -> Result<(Admitted, Arc<Semaphore>), PoolError> {
        let mut lanes = self.lanes.lock().unwrap_or_else(PoisonError::into_inner);
        let lane = lanes.entry(Arc::from(account)).or_insert_with(|| Lane {
            admitted: 0,
            running: Arc::new(Semaphore::new(1)),
        });
        if lane.admitted >= self.per_account {
            return Err(PoolError::Busy {
                admitted: lane.admitted,
                limit: self.per_account,
            });
        }
        lane.admitted += 1;
        let running = Arc::clone(&lane.running);
        drop(lanes);
        let admitted = Admitted {
            pool: Arc::clone(self),
            account: Arc::from(account),
        };
        Ok((admitted, running))
    }

    /// Checks admitted (running or waiting) for `account`.
    #[cfg(test)]
    pub fn admitted(&self, account: &str) -> usize {
        self.lanes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(account)
            .map_or(0, |lane| lane.admitted)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    use std::sync::mpsc;

    /// A check that runs until released: its account's budget stays taken meanwhile.
    fn blocked(release: &Arc<Mutex<mpsc::Receiver<()>>>) -> impl FnOnce() -> u32 + Send {
        let release = Arc::clone(release);
        move || {
            let _ = release
                .lock()
                .unwrap()
                .recv_timeout(Duration::from_secs(10));
            1
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_account_past_its_budget_is_refused_and_others_go_on() {
        let pool = VerifyPool::new(2, 3);
        let (tx, rx) = mpsc::channel();
        let rx = Arc::new(Mutex::new(rx));
        let mut held = Vec::new();
        for _ in 0..3 {
            let pool = Arc::clone(&pool);
            let check = blocked(&rx);
            held.push(tokio::spawn(async move { pool.run("flood", check).await }));
        }
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while pool.admitted("flood") < 3 {
            assert!(tokio::time::Instant::now() < deadline, "never admitted");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // Many callers racing past the budget: every one refused, none queued.
        let racing: Vec<_> = (0..32)
            .map(|_| {
                let pool = Arc::clone(&pool);
                tokio::spawn(async move { pool.run("flood", || 2).await })
            })
            .collect();
        for refused in racing {
            assert_eq!(
                refused.await.unwrap(),
                Err(PoolError::Busy {
                    admitted: 3,
                    limit: 3
                })
            );
        }
        // Another account's check runs meanwhile: the flood holds one worker, not both.
        let other = tokio::time::timeout(Duration::from_secs(5), pool.run("other", || 7))
            .await
            .expect("another account waited behind the flood");
        assert_eq!(other, Ok(7));
        for _ in 0..3 {
            tx.send(()).unwrap();
        }
        for check in held {
            assert_eq!(check.await.unwrap(), Ok(1));
        }
        // The budget is given back once the checks are done.
        assert_eq!(pool.admitted("flood"), 0);
        assert_eq!(pool.run("flood", || 3).await, Ok(3));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_caller_that_stops_waiting_keeps_the_budget_until_the_check_ends() {
        let pool = VerifyPool::new(1, 1);
        let (tx, rx) = mpsc::channel();
        let rx = Arc::new(Mutex::new(rx));
        let gone = tokio::time::timeout(Duration::from_millis(50), pool.run("a", blocked(&rx)));
        assert!(gone.await.is_err(), "the check should still be running");
        assert!(matches!(
            pool.run("a", || 0).await,
            Err(PoolError::Busy { .. })
        ));
        tx.send(()).unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while pool.admitted("a") > 0 {
            assert!(tokio::time::Instant::now() < deadline, "never given back");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(pool.run("a", || 4).await, Ok(4));
    }
}
