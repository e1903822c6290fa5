//! The commit protocol, owned by the channel's façade: make a commit (or proposal), publish it
//! with the epoch fence, wait until the applier has merged its echo; on a lost race, drop it,
//! let the winner be applied and make it again, the members that lost most first
//! ([`CommitPace`]).

use std::sync::Arc;

use super::core::ChannelCore;
use crate::config::{COMMIT_ATTEMPTS, PROGRESS_TIMEOUT};
use crate::error::{Error, Result};
use crate::relay::refusal::Refusal;
use crate::relay::retry::{CommitPace, Retry};
use crate::relay::transport::pb;
use crate::sync::wait_value;
use static_mls::engine::Engine;
use static_mls::StoredCommit;

/// Makes a commit (and its Welcome, if it adds members), or `None` when there is nothing to
/// commit.
pub(crate) type CommitMaker =
    dyn Fn(&Engine, &str) -> static_mls::Result<Option<(Vec<u8>, Option<Vec<u8>>)>> + Send + Sync;

enum Published {
    Accepted(u64),
    Stale(u64),
}

/// One channel's commits, one at a time.
pub(crate) struct Committer {
    core: Arc<ChannelCore>,
    /// Held for a whole commit; holds the pace of our commits.
    lock: tokio::sync::Mutex<CommitPace>,
}

impl Committer {
    pub(crate) fn new(core: Arc<ChannelCore>) -> Self {
        Self {
            core,
            lock: tokio::sync::Mutex::new(CommitPace::default()),
        }
    }

    /// See the module docs. Returns the Welcome the commit made, if any.
    pub(crate) async fn commit(&self, make: Arc<CommitMaker>) -> Result<Option<Vec<u8>>> {
        let core = &self.core;
        core.check_usable()?;
        core.shared.reach().await?;
        let mut pace = self.lock.lock().await;
        // Closed (or ended) while we queued: touch the group no more. The close's wake-up may
        // reach this call after the lock's (a watch notifies its waiters one shard at a time:
        // 1.5 ms apart measured on a loaded machine), and a commit made then would stay
        // pending, never published, in the way of the next.
        core.check_usable()?;
        self.resume_cut_off().await?;
        let mut contended = false;
        if let Some(aside) = pace.step_aside() {
            let epoch = core.progress().epoch;
            contended = tokio::time::timeout(aside, core.wait_epoch(epoch + 1))
                .await
                .is_ok();
        }
        for losses in 0..COMMIT_ATTEMPTS {
            let wait = pace.wait(u32::try_from(losses).unwrap_or(u32::MAX), contended);
            if !wait.is_zero() {
                tokio::time::sleep(wait).await;
            }
            let started = std::time::Instant::now();
            let name = core.name.clone();
            let maker = Arc::clone(&make);
            let Some((commit, welcome)) =
                core.shared.blocking(move |e| Ok(maker(e, &name)?)).await?
            else {
                return Ok(None);
            };
            match self.publish_handshake(commit, welcome.clone()).await {
                Ok(Published::Accepted(seq)) => {
                    core.wait_applied(seq).await?;
                    pace.record(started.elapsed());
                    pace.won();
                    return Ok(welcome);
                }
                Ok(Published::Stale(epoch)) => {
                    self.clear_pending().await?;
                    core.wait_epoch(epoch).await?;
                    pace.record(started.elapsed());
                }
                Err(e) => {
                    // Not in the log: drop it so the group can move on.
                    self.clear_pending().await?;
                    return Err(e);
                }
            }
        }
        Err(Error::Unreachable(format!(
            "channel {:?} is too busy: other members' commits won {COMMIT_ATTEMPTS} times in a row",
            core.name
        )))
    }

    /// Commits the proposals members made (e.g. a leave); whoever wins the epoch does it for
    /// all. Failures are left to the next commit or proposal.
    pub(crate) async fn commit_proposals(&self) {
        let _ = self
            .commit(Arc::new(|e: &Engine, name: &str| {
                Ok(e.commit_pending_proposals(name)?.map(|c| (c, None)))
            }))
            .await;
    }

    /// If the machine went down while this channel was open, moves to a new epoch first (the
    /// secrets of the old one may have been used without being stored).
    pub(crate) fn ensure_fresh_epoch(&self) -> Result<()> {
        let core = &self.core;
        if core.shared.engine()?.needs_fresh_epoch(&core.name)? {
            core.block_on(self.commit(Arc::new(|e: &Engine, name: &str| {
                Ok(if e.needs_fresh_epoch(name)? {
                    Some((e.self_update(name)?, None))
                } else {
                    None
                })
            })))?;
        }
        Ok(())
    }

    /// Proposes our removal and waits until a member commits it (the channel then ends).
    pub(crate) async fn leave(&self) -> Result<()> {
        let core = &self.core;
        core.check_usable()?;
        if core.shared.engine()?.members(&core.name)?.len() < 2 {
            return Err(Error::Group(format!(
                "cannot leave channel {:?}: we are its only member",
                core.name
            )));
        }
        core.shared.reach().await?;
        let _guard = self.lock.lock().await;
        core.check_usable()?; // as in `commit`
        self.resume_cut_off().await?;
        for _ in 0..COMMIT_ATTEMPTS {
            let name = core.name.clone();
            let proposal = core.shared.blocking(move |e| Ok(e.leave(&name)?)).await?;
            match self.publish_handshake(proposal, None).await? {
                Published::Accepted(_) => {
                    let mut rx = core.progress.subscribe();
                    let waited = tokio::time::timeout(
                        PROGRESS_TIMEOUT,
                        wait_value(&mut rx, |p| p.ended.is_some()),
                    )
                    .await;
                    return match waited {
                        Ok(_) => Ok(()),
                        Err(_) => Err(Error::Unreachable(
                            "the leave proposal is published but no member committed it yet".into(),
                        )),
                    };
                }
                Published::Stale(epoch) => core.wait_epoch(epoch).await?,
            }
        }
        Err(Error::Unreachable(
            "the channel is too busy to leave now".into(),
        ))
    }

    /// A commit of ours made by a call that was cut off before the relay answered (the client
    /// closed, or the process died): with the lock held no other call of ours is committing,
    /// so a pending commit now is one of those. It is published again as it was, its Welcome
    /// with it: the relay takes it, or says the epoch moved on (it is in the log already, or
    /// another member's commit won), and the applier merges or voids it either way. Left
    /// pending, it refused every later commit of the channel ("a commit of ours is already
    /// pending"). A refusal drops it, as a refused commit is dropped.
    async fn resume_cut_off(&self) -> Result<()> {
        let core = &self.core;
        let name = core.name.clone();
        let Some(StoredCommit { commit, welcome }) = core
            .shared
            .blocking(move |e| Ok(e.pending_commit_and_welcome(&name)?))
            .await?
        else {
            return Ok(());
        };
        match self.publish_handshake(commit, welcome).await {
            Ok(Published::Accepted(seq)) => core.wait_applied(seq).await,
            Ok(Published::Stale(epoch)) => core.wait_epoch(epoch).await,
            Err(e) => {
                self.clear_pending().await?;
                Err(e)
            }
        }
    }

    async fn clear_pending(&self) -> Result<()> {
        let name = self.core.name.clone();
        self.core
            .shared
            .blocking(move |e| {
                if e.has_group(&name) {
                    Ok(e.clear_pending_commit(&name)?)
                } else {
                    Ok(())
                }
            })
            .await
    }

    /// Publishes a commit or proposal, retrying (the same bytes: idempotent) while the relay
    /// is unreachable.
    async fn publish_handshake(
        &self,
        message: Vec<u8>,
        welcome: Option<Vec<u8>>,
    ) -> Result<Published> {
        let shared = &self.core.shared;
        let mut retry = Retry::within(shared.options.retry_timeout);
        let answer = shared
            .call(
                "Publish",
                &mut retry,
                || pb::PublishRequest {
                    channel: self.core.name.clone(),
                    message: message.clone().into(),
                    welcome: welcome.clone().unwrap_or_default().into(),
                    idempotency_key: Default::default(),
                },
                |mut relay, request| async move { relay.publish(request).await },
                |refusal| matches!(refusal, Refusal::StaleEpoch { .. }),
            )
            .await?;
        match answer {
            Ok(response) => Ok(Published::Accepted(response.seq)),
            Err(Refusal::StaleEpoch { current, .. }) => Ok(Published::Stale(current)),
            Err(refusal) => Err(refusal.into_error("Publish")),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    use super::*;
    use crate::channel::core::tests as core_tests;

    /// A commit queued behind another when the client closes fails with `runtime error:` once
    /// it has the lock, and never makes its commit (polled here without `block_on`, whose
    /// select may see the close only after the lock: CI failed on that, "a commit of ours is
    /// already pending", when the first commit's future was dropped with its commit pending).
    #[test]
    fn a_commit_queued_at_close_makes_nothing() {
        let runtime = core_tests::runtime();
        let dir = tempfile::tempdir().unwrap();
        let core = core_tests::core(&runtime, dir.path());
        let shared = Arc::clone(&core.shared);
        shared.assume_reached();
        let committer = Committer::new(core);
        let made = Arc::new(AtomicBool::new(false));
        let maker = {
            let made = Arc::clone(&made);
            Arc::new(move |_: &Engine, _: &str| {
                made.store(true, Ordering::SeqCst);
                Ok(None)
            })
        };
        let out = runtime.block_on(async {
            let held = committer.lock.lock().await;
            let commit = committer.commit(maker);
            tokio::pin!(commit);
            // Queued for the lock.
            assert!(tokio::time::timeout(Duration::from_millis(50), &mut commit)
                .await
                .is_err());
            shared.close();
            drop(held);
            commit.await
        });
        assert!(matches!(out, Err(Error::Closed(_))), "{out:?}");
        assert!(
            !made.load(Ordering::SeqCst),
            "the commit was made after the close"
        );
    }
}
