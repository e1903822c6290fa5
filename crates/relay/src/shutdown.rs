//! The relay's one stop signal, as mini-redis's `Shutdown`: the phases of a graceful stop, which
//! every part that winds down (acceptor, connections, calls, pruner, health probes) watches.

use std::sync::Arc;

use tokio::sync::watch;

/// Where the relay is in its life; each phase comes after the ones above it, and a part that
/// waits for a phase is also woken by any later one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Phase {
    Serving,
    /// No more connections (the health service already says NOT_SERVING); a connection still
    /// shaking hands goes.
    Draining,
    /// New calls are refused ([`crate::error::shutting_down`]); streaming calls stop reading
    /// and end, the rest get `graceful_timeout` to finish.
    Refusing,
    /// GOAWAY on every connection.
    Closing,
    /// The background tasks (pruner, health probes) stop; the log commits what it holds.
    Stopped,
}

/// The sending side, one per relay, cloned into whatever must read the phase at once.
#[derive(Clone)]
pub(crate) struct Shutdown(Arc<watch::Sender<Phase>>);

impl Shutdown {
    pub fn new() -> Self {
        Shutdown(Arc::new(watch::channel(Phase::Serving).0))
    }

    /// Moves on to `phase` (never back).
    pub fn advance(&self, phase: Phase) {
        self.0.send_if_modified(|now| {
            let later = *now < phase;
            if later {
                *now = phase;
            }
            later
        });
    }

    /// Whether `phase` was reached.
    pub fn reached(&self, phase: Phase) -> bool {
        // Copied out at once: no read guard outlives this line.
        let now = *self.0.borrow();
        now >= phase
    }

    /// A receiver for a task that waits for a phase.
    pub fn watch(&self) -> Watch {
        Watch(self.0.subscribe())
    }
}

/// A task's view of the phase.
#[derive(Clone)]
pub(crate) struct Watch(watch::Receiver<Phase>);

impl Watch {
    /// Resolves once `phase` was reached, or the relay is gone (cancel-safe).
    pub async fn reached(&mut self, phase: Phase) {
        // The read guard wait_for returns is dropped here: it must not live on in the caller's
        // future (it is not Send, and it would hold the watch's lock).
        let _ = self.0.wait_for(|now| *now >= phase).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_later_phase_wakes_a_wait_for_an_earlier_one_and_phases_never_go_back() {
        let shutdown = Shutdown::new();
        let mut watch = shutdown.watch();
        let waiting = tokio::spawn(async move { watch.reached(Phase::Refusing).await });
        shutdown.advance(Phase::Closing);
        tokio::time::timeout(std::time::Duration::from_secs(5), waiting)
            .await
            .expect("woken")
            .expect("joined");
        shutdown.advance(Phase::Draining);
        assert!(shutdown.reached(Phase::Closing));
        assert!(!shutdown.reached(Phase::Stopped));
    }

    #[tokio::test]
    async fn a_relay_that_is_gone_ends_every_wait() {
        let shutdown = Shutdown::new();
        let mut watch = shutdown.watch();
        drop(shutdown);
        tokio::time::timeout(
            std::time::Duration::from_secs(5),
            watch.reached(Phase::Stopped),
        )
        .await
        .expect("woken");
    }
}
