//! Revocation reaches the groups (docs/design.md §5.2, "Removal on revocation"): the relay is an
//! MLS external sender of each channel created with it in the `external_senders` extension
//! (RFC 9420 §12.1.8.1), and proposes the removal of the leaves whose binding was last proven
//! by a key that is no longer active (revoked, expired, or past its roll's grace). The members'
//! SDKs commit pending proposals at once, as they do for a member's leave.
//!
//! Which keys are inactive is the HTTP side's to say: `static serve` (Python) asks for the keys
//! behind bindings ([`bound_keys`]), checks them, and hands the inactive ones to
//! [`remove_leaves_of_keys`].
//!
//! A proposal is an ordinary handshake entry of the channel's log: decided by the same writer,
//! at the channel's current epoch (the fence refuses it if the epoch moved meanwhile: the next
//! pass proposes again at the new one), kept in `relay_proposals` for that epoch, delivered to
//! subscribers. Proposing the same leaf twice in one epoch appends nothing: the proposal's bytes
//! are the same (Ed25519 signs deterministically), so is its idempotency key, and the log
//! answers the second as a duplicate. Channels without the relay in `external_senders` (created
//! before this, or by an SDK that did not name it) are skipped: their members keep today's
//! behaviour (the key's streams end; its leaf stays until a member removes it).

use std::sync::Arc;

use bytes::Bytes;

use crate::error::{RelayError, Result};
use crate::log::{ChannelLog, Checked, GroupCheck};
use crate::wire::{framing, rules};

/// The account an entry of the relay's own is logged under (no account id has this form).
pub const RELAY_ACCOUNT: &str = "@relay";

/// Leaves read per key and pass: a key bound to more leaves has the rest on the next pass.
const LEAVES_PER_KEY: usize = 1_000;

/// What one call of [`remove_leaves_of_keys`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RemovalReport {
    /// Remove proposals appended to channel logs.
    pub proposed: usize,
    /// Already proposed at the channel's current epoch (nothing appended).
    pub already: usize,
    /// Leaves in channels that do not name the relay as external sender (older channels).
    pub skipped: usize,
    /// Proposals refused or failed (e.g. the epoch moved meanwhile): tried again next pass.
    pub failed: usize,
}

/// Up to `limit` distinct API keys behind bindings, in order, after `after` (a batch of the
/// keys to check).
pub async fn bound_keys(log: &ChannelLog, after: &str, limit: usize) -> Result<Vec<String>> {
    log.bound_keys(after, limit).await
}

/// Proposes the removal of every leaf last bound by one of `keys` (keys found inactive), at
/// most `max_proposals` appended in this call.
pub async fn remove_leaves_of_keys(
    log: &ChannelLog,
    keys: &[String],
    max_proposals: usize,
) -> Result<RemovalReport> {
    let mut report = RemovalReport::default();
    for key in keys {
        for (name, leaf) in log.leaves_of_key(key, LEAVES_PER_KEY).await? {
            if report.proposed >= max_proposals {
                return Ok(report);
            }
            match propose_removal(log, &name, leaf).await {
                Ok(Proposed::Appended) => report.proposed += 1,
                Ok(Proposed::Duplicate) => report.already += 1,
                Ok(Proposed::NotExternalSender) => report.skipped += 1,
                Err(e) => {
                    ::log::warn!(
                        target: "static.relay",
                        "could not propose the removal of leaf {leaf} of channel '{name}' \
                         (its key is no longer active): {e}"
                    );
                    report.failed += 1;
                }
            }
        }
    }
    Ok(report)
}

enum Proposed {
    Appended,
    Duplicate,
    NotExternalSender,
}

/// Proposes the removal of leaf `leaf` of channel `name` at its current epoch.
async fn propose_removal(log: &ChannelLog, name: &str, leaf: u32) -> Result<Proposed> {
    // The channel holding the name (a legacy channel has no group: skipped below).
    let channel = log.channel("", name).await?;
    let Some(state) = log.group(&channel).await? else {
        return Ok(Proposed::NotExternalSender);
    };
    let sender = log.external_sender();
    let Some(index) = state.relay_sender_index(&sender.public) else {
        return Ok(Proposed::NotExternalSender);
    };
    if state.leaf(leaf).is_none() {
        // Removed meanwhile (its binding goes with the commit): nothing to propose.
        return Ok(Proposed::Duplicate);
    }
    let message = state
        .propose_remove(leaf, index, &sender.public, &sender.private)
        .and_then(|message| state.check_relay_proposal(&message).map(|()| message))
        .map_err(|e| RelayError::Unavailable(format!("the relay's proposal: {e}")))?;
    let header = framing::parse_message(&message)
        .map_err(|e| RelayError::Unavailable(format!("the relay's proposal: {e}")))?;
    let message = Bytes::from(message);
    let checked = Checked {
        header,
        key: rules::idempotency_key(&[], &message)?,
        message,
        welcome: Bytes::new(),
        welcome_refs: Vec::new(),
        account: Arc::from(RELAY_ACCOUNT),
        group: GroupCheck::Valid(None),
    };
    let outcome = log
        .submit(vec![(channel, checked)])
        .pop()
        .ok_or(RelayError::Internal)?;
    let accepted = outcome.await.map_err(|_| crate::error::shutting_down())??;
    Ok(if accepted.duplicate {
        Proposed::Duplicate
    } else {
        ::log::info!(
            target: "static.relay",
            "proposed the removal of leaf {leaf} of channel '{name}' at epoch {} \
             (its binding's key is no longer active)",
            accepted.epoch
        );
        Proposed::Appended
    })
}
