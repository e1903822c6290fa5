//! Invite, ListInvitations, OpenInvitation and SettleInvitation: the invitations of an address
//! into channels, recorded by the member that claimed its package and added it (docs/design.md
//! §5.5).
//!
//! Costs, per call:
//! - Invite: by a member of the channel whose account claimed the package, naming its own
//!   bound leaf. One membership look-up and the channel's members (memory, else the store),
//!   one transaction of three reads and at most one row written.
//! - ListInvitations: by any caller, for its own address. One read of at most 100 rows (each
//!   at most an identity, a channel name and two account ids: ~1 KiB); held (a long poll, at
//!   most 20 s) when none is pending: then a task, a `Notify`, and a read and a token check a
//!   second.
//! - OpenInvitation: by any caller, for its own address (the invitee is no member yet: no
//!   membership is asked). One read: the Welcome (at most the relay's message size).
//! - SettleInvitation: by any caller, for its own address. One update (and one read when it
//!   was settled already).
//!
//! A refused call is one line of the access log, as any call (its budget per account).
//!
//! A key restricted to channel patterns (issue 30, [`crate::auth::Caller::may_name`]) sees
//! and takes only the invitations into its channels: Invite names the channel (refused, as
//! any call naming one, before any read); ListInvitations leaves the others out of its answer
//! (filtered, not refused: a pending invitation elsewhere does not make the key useless, and
//! another key of the account still sees it); OpenInvitation and SettleInvitation of one
//! elsewhere are refused (PERMISSION_DENIED, naming the patterns). Settling costs such a key
//! one read more (the invitation's channel, before anything is written); a key without
//! patterns pays nothing.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, Instant, SystemTime};

use tokio::sync::Notify;
use tonic::{Request, Response};

use super::directory::own_address;
use super::Inner;
use crate::clock::now_ms;
use crate::error::{shutting_down, RelayError, Result};
use crate::pb;
use crate::shutdown::Phase;
use crate::store::directory::{Address, InvitationRow, Invited, NewInvitation};
use static_proto::directory::{MAX_LISTED_INVITATIONS, MAX_LIST_WAIT_MS};

/// Invite: the caller a member, `inviter_leaf` its bound leaf in the current tree, then the
/// store checks the claim and the Welcome and records the invitation (once per ref).
pub(super) async fn invite(
    inner: &Inner,
    request: Request<pb::InviteRequest>,
) -> Result<Response<pb::InviteResponse>> {
    let (caller, name, channel, request) = inner.addressed(request).await?;
    inner.require_member(&channel, &caller.account).await?;
    let (_, members) = inner.log.members_of(&channel).await?;
    let inviter = members.into_iter().find(|(leaf, account)| {
        leaf.leaf_index == request.inviter_leaf && account.as_deref() == Some(&*caller.account)
    });
    let Some((leaf, _)) = inviter else {
        return Err(RelayError::PermissionDenied(format!(
            "leaf {} of channel '{name}' is not bound to this account",
            request.inviter_leaf
        )));
    };
    let ttl = inner.settings.directory.welcome_ttl;
    let invited = inner
        .log
        .directory()
        .invite(NewInvitation {
            channel_id: channel.id(),
            channel: name.clone(),
            key_package_ref: request.key_package_ref.to_vec(),
            inviter_account: caller.account.to_string(),
            inviter_identity: leaf.identity,
            welcome_ttl_ms: ttl.map(|ttl| i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX)),
            now_ms: now_ms(),
        })
        .await?;
    match invited {
        Invited::Recorded(id, invitee) => {
            inner.invited.wake(&invitee);
            Ok(Response::new(pb::InviteResponse {
                invitation_id: u64::try_from(id).unwrap_or(0),
            }))
        }
        Invited::NoClaim => Err(RelayError::NotFound(format!(
            "this account claimed no such key package for channel '{name}'"
        ))),
        Invited::NoWelcome => Err(RelayError::NotFound(format!(
            "no Welcome of channel '{name}' names this key package"
        ))),
    }
}

fn db_id(id: u64) -> i64 {
    i64::try_from(id).unwrap_or(i64::MAX)
}

/// While a ListInvitations call is held, the list is read again this often (an invitation
/// recorded by another relay of the database wakes no waiter here) and the caller's token is
/// checked again (a revoked key or an expired token ends the wait).
const LIST_RECHECK: Duration = Duration::from_secs(1);

/// The waiters of held ListInvitations calls, by address: Invite wakes its invitee's at once.
/// Entries are weak (a waiter holds its `Notify`); dead ones are swept when the map has doubled
/// since the last sweep, so it holds at most about twice the calls held at once.
#[derive(Default)]
pub(super) struct Wakeups {
    waiting: Mutex<(HashMap<Address, Weak<Notify>>, usize)>,
}

impl Wakeups {
    fn lock(&self) -> std::sync::MutexGuard<'_, (HashMap<Address, Weak<Notify>>, usize)> {
        self.waiting.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The `Notify` an invitation for `address` wakes.
    fn watch(&self, address: &Address) -> Arc<Notify> {
        let mut guard = self.lock();
        let (waiting, sweep_at) = &mut *guard;
        if let Some(notify) = waiting.get(address).and_then(Weak::upgrade) {
            return notify;
        }
        let notify = Arc::new(Notify::new());
        waiting.insert(address.clone(), Arc::downgrade(&notify));
        if waiting.len() >= (*sweep_at).max(1024) {
            waiting.retain(|_, w| w.strong_count() > 0);
            *sweep_at = waiting.len() * 2;
        }
        notify
    }

    /// An invitation for `address` was recorded.
    fn wake(&self, address: &Address) {
        let notify = self.lock().0.get(address).and_then(Weak::upgrade);
        if let Some(notify) = notify {
            notify.notify_waiters();
        }
    }
}

/// ListInvitations: the caller's address's pending invitations; a call that finds none is held
/// up to its `wait_ms` (see `proto/relay.proto`). A held call costs a task, a `Notify` and one
/// read and one token check a second.
pub(super) async fn list_invitations(
    inner: &Inner,
    request: Request<pb::ListInvitationsRequest>,
) -> Result<Response<pb::ListInvitationsResponse>> {
    let (metadata, extensions, request) = request.into_parts();
    let (caller, address) = own_address(inner, &metadata, &extensions, &request.identity).await?;
    let wait = Duration::from_millis(request.wait_ms.min(MAX_LIST_WAIT_MS).into());
    let deadline = Instant::now() + wait;
    let mut shutdown = inner.shutdown.watch();
    let drained = shutdown.reached(Phase::Refusing);
    tokio::pin!(drained);
    loop {
        // Registered before the read: an invitation recorded after it wakes this wait.
        let notify = inner.invited.watch(&address);
        let notified = notify.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let mut rows = inner
            .log
            .directory()
            .invitations(
                address.clone(),
                db_id(request.after_id),
                MAX_LISTED_INVITATIONS,
                now_ms(),
            )
            .await?;
        rows.retain(|row| caller.may_name(&row.channel).is_ok());
        let left = deadline.saturating_duration_since(Instant::now());
        if !rows.is_empty() || left.is_zero() {
            return Ok(Response::new(listed(rows)));
        }
        // Not past the token's expiry: the call then ends as a stream's does.
        let expiry = caller.expires_at.map_or(LIST_RECHECK, |at| {
            at.duration_since(SystemTime::now()).unwrap_or_default()
        });
        tokio::select! {
            () = &mut drained => return Err(shutting_down()),
            () = &mut notified => {}
            () = tokio::time::sleep(left.min(LIST_RECHECK).min(expiry)) => {}
        }
        if caller.expires_at.is_some_and(|at| at <= SystemTime::now()) {
            return Err(RelayError::Unauthenticated("token expired".to_owned()));
        }
        // Verified again: a key revoked meanwhile ends the wait.
        inner.caller(&metadata, &extensions).await?;
    }
}

fn listed(rows: Vec<InvitationRow>) -> pb::ListInvitationsResponse {
    let ms = |v: i64| u64::try_from(v).unwrap_or(0);
    let invitations = rows
        .into_iter()
        .map(|row| pb::Invitation {
            id: ms(row.id),
            channel: row.channel,
            inviter_identity: row.inviter_identity.into(),
            inviter_account: row.inviter_account,
            created_at_ms: ms(row.created_at_ms),
            expires_at_ms: row.expires_at_ms.map_or(0, ms),
            last_resort: row.last_resort,
        })
        .collect();
    pb::ListInvitationsResponse { invitations }
}

/// OpenInvitation: the Welcome of a pending invitation of the caller's address.
pub(super) async fn open_invitation(
    inner: &Inner,
    request: Request<pb::OpenInvitationRequest>,
) -> Result<Response<pb::OpenInvitationResponse>> {
    let (metadata, extensions, request) = request.into_parts();
    let (caller, address) = own_address(inner, &metadata, &extensions, &request.identity).await?;
    let opened = inner
        .log
        .directory()
        .open_invitation(address, db_id(request.id), now_ms())
        .await?
        .ok_or_else(|| {
            RelayError::NotFound(
                "no such pending invitation of this address (or its Welcome expired)".to_owned(),
            )
        })?;
    // Read before it is checked (its channel is in the row), and nothing was written.
    caller.may_name(&opened.channel)?;
    Ok(Response::new(pb::OpenInvitationResponse {
        welcome: opened.welcome.into(),
        epoch: opened.epoch,
        channel: opened.channel,
    }))
}

/// SettleInvitation: accepted or declined, once (again: the same answer).
pub(super) async fn settle_invitation(
    inner: &Inner,
    request: Request<pb::SettleInvitationRequest>,
) -> Result<Response<pb::SettleInvitationResponse>> {
    let (metadata, extensions, request) = request.into_parts();
    let (caller, address) = own_address(inner, &metadata, &extensions, &request.identity).await?;
    if caller.channels.is_some() {
        // The invitation's channel, before it is settled (None: settled already or expired;
        // settling it then changes nothing).
        let pending = inner
            .log
            .directory()
            .open_invitation(address.clone(), db_id(request.id), now_ms())
            .await?;
        if let Some(pending) = pending {
            caller.may_name(&pending.channel)?;
        }
    }
    let settled = inner
        .log
        .directory()
        .settle(address, db_id(request.id), request.accept, now_ms())
        .await?;
    if !settled {
        return Err(RelayError::NotFound(
            "no such invitation of this address".to_owned(),
        ));
    }
    Ok(Response::new(pb::SettleInvitationResponse {}))
}
