//! The keeper of our key packages in the relay's directory: a stock of one-time packages and
//! one last-resort package listed under our address (RFC 9420 §16.8, RFC 9750 §5), refilled
//! when packages are claimed and replaced well before they expire.
//!
//! A task on the client's runtime, started by the first `allow_invitations` or
//! `list_invitations` (an agent that never asks for invitations lists nothing). It reads the
//! stock (an empty `OfferKeyPackages`), tops it up, and sleeps until the next check or a nudge
//! (a new invitation: a package was claimed). One call lists at most
//! [`STOCK_TARGET`] + 1 packages, each made and signed here (about 1 ms each).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::Notify;

use crate::error::{Error, Result};
use crate::relay::retry::Retry;
use crate::relay::transport::pb;
use crate::shared::Shared;
use crate::sync::{lock, seen};
use static_mls::engine::DirectoryKeyPackage;

/// One-time packages we keep listed (a burst of this many invitations needs no refill).
pub(crate) const STOCK_TARGET: usize = 16;
/// Refilled when fewer than this many are left.
const STOCK_LOW: u32 = 8;
/// How often the stock is read when nothing nudges the keeper.
const CHECK_INTERVAL: Duration = Duration::from_secs(30);
/// After a failed check, the next one comes this soon (the relay restarting, say).
const RETRY_INTERVAL: Duration = Duration::from_secs(2);
/// Packages are replaced, all at once, when the earliest of them ends within this (OpenMLS
/// gives a package about 12 weeks).
const RENEW_BEFORE: Duration = Duration::from_secs(14 * 24 * 3600);

/// The keeper's state, shared with the client.
pub(crate) struct Stock {
    started: AtomicBool,
    nudge: Notify,
    /// A new last-resort package is listed at the next check (ours was claimed: its reuse
    /// weakens forward secrecy for each Welcome encrypted to it).
    renew_last_resort: AtomicBool,
    /// The last check's failure, when it failed for a reason retrying cannot mend (the key
    /// refused): `list_invitations` reports it.
    failure: Mutex<Option<String>>,
}

impl Stock {
    pub(crate) fn new() -> Self {
        Self {
            started: AtomicBool::new(false),
            nudge: Notify::new(),
            renew_last_resort: AtomicBool::new(false),
            failure: Mutex::new(None),
        }
    }

    /// Lists our packages now, the first time (so that once `allow_invitations` or the first
    /// `list_invitations` returns, others can invite us), then starts the keeper, once.
    pub(crate) fn start(self: &Arc<Self>, shared: &Arc<Shared>) -> Result<()> {
        if self.started.load(Ordering::SeqCst) {
            return Ok(());
        }
        // Concurrent first calls may both top up: the relay's stock cap bounds it.
        let stock = Arc::clone(self);
        let first = Arc::clone(shared);
        shared.block_on(async move { stock.top_up(&first).await })?;
        if self.started.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        let stock = Arc::clone(self);
        let keeper_shared = Arc::clone(shared);
        shared
            .handle
            .spawn(async move { stock.keep(keeper_shared).await });
        Ok(())
    }

    /// A package was claimed (a new invitation): check now; `last_resort` when it was the
    /// last-resort one.
    pub(crate) fn nudge(&self, last_resort: bool) {
        if last_resort {
            self.renew_last_resort.store(true, Ordering::SeqCst);
        }
        self.nudge.notify_one();
    }

    /// The keeper's lasting failure, if any (an auth error).
    pub(crate) fn failure(&self) -> Option<Error> {
        lock(&self.failure).clone().map(Error::Auth)
    }

    /// Checks the stock every [`CHECK_INTERVAL`], or at once when nudged, until the client
    /// closes (the first check was `start`'s).
    async fn keep(&self, shared: Arc<Shared>) {
        let mut closing = shared.closing();
        let mut wait = CHECK_INTERVAL;
        loop {
            tokio::select! {
                changed = closing.changed() => if changed.is_err() { return },
                () = self.nudge.notified() => {}
                () = tokio::time::sleep(wait) => {}
            }
            if seen(&mut closing, |closed| *closed) {
                return;
            }
            let checked = tokio::select! {
                _ = closing.changed() => return,
                checked = self.top_up(&shared) => checked,
            };
            wait = match checked {
                Ok(()) => {
                    lock(&self.failure).take();
                    CHECK_INTERVAL
                }
                Err(Error::Auth(why)) => {
                    *lock(&self.failure) = Some(why);
                    CHECK_INTERVAL
                }
                // Anything else (the relay unreachable) is retried soon.
                Err(_) => RETRY_INTERVAL,
            };
        }
    }

    /// Reads our stock and lists what it lacks.
    async fn top_up(&self, shared: &Arc<Shared>) -> Result<()> {
        let mut retry = Retry::within(shared.options.retry_timeout);
        let account = shared.account(&mut retry, "OfferKeyPackages").await?;
        let identity = shared.engine()?.identity().to_vec();
        let stock = offer(shared, &identity, Vec::new(), false).await?;
        let now_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis());
        let renew = stock.earliest_expiry_ms != 0
            && u128::from(stock.earliest_expiry_ms) < now_ms + RENEW_BEFORE.as_millis();
        let (count, last_resort, replace) = if renew {
            (STOCK_TARGET, true, true)
        } else {
            let count = if stock.one_time < STOCK_LOW {
                STOCK_TARGET.saturating_sub(stock.one_time as usize)
            } else {
                0
            };
            let last_resort =
                !stock.last_resort || self.renew_last_resort.swap(false, Ordering::SeqCst);
            (count, last_resort, false)
        };
        if count == 0 && !last_resort {
            return Ok(());
        }
        let packages = shared
            .blocking(move |e| Ok(e.directory_key_packages(&account, count, last_resort)?))
            .await?;
        offer(shared, &identity, packages, replace).await?;
        Ok(())
    }
}

/// One `OfferKeyPackages` call (retried as any call is); the stock after it.
async fn offer(
    shared: &Shared,
    identity: &[u8],
    packages: Vec<DirectoryKeyPackage>,
    replace: bool,
) -> Result<pb::OfferKeyPackagesResponse> {
    let offers: Vec<pb::KeyPackageOffer> = packages
        .into_iter()
        .map(|p| pb::KeyPackageOffer {
            key_package: p.key_package.into(),
            binding: p.binding.into(),
        })
        .collect();
    shared
        .unary(
            "OfferKeyPackages",
            || pb::OfferKeyPackagesRequest {
                identity: identity.to_vec().into(),
                packages: offers.clone(),
                replace,
            },
            |mut relay, request| async move { relay.offer_key_packages(request).await },
        )
        .await
}
