//! Invite, ListInvitations, OpenInvitation and SettleInvitation: the invitations of an address
//! into channels, recorded by the member that claimed its package and added it (docs/design.md
//! §5.5).
//!
//! Costs, per call:
//! - Invite: by a member of the channel whose account claimed the package, naming its own
//!   bound leaf. One membership look-up and the channel's members (memory, else the store),
//!   one transaction of three reads and at most one row written.
//! - ListInvitations: by any caller, for its own address. One read of at most 100 rows (each
//!   at most an identity, a channel name and two account ids: ~1 KiB).
//! - OpenInvitation: by any caller, for its own address (the invitee is no member yet: no
//!   membership is asked). One read: the Welcome (at most the relay's message size).
//! - SettleInvitation: by any caller, for its own address. One update (and one read when it
//!   was settled already).
//!
//! A refused call is one line of the access log, as any call (its budget per account).

use tonic::{Request, Response};

use super::directory::check_identity;
use super::Inner;
use crate::clock::now_ms;
use crate::error::{RelayError, Result};
use crate::pb;
use crate::store::directory::{Address, Invited, NewInvitation};
use static_proto::directory::MAX_LISTED_INVITATIONS;

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
        Invited::Recorded(id) => Ok(Response::new(pb::InviteResponse {
            invitation_id: u64::try_from(id).unwrap_or(0),
        })),
        Invited::NoClaim => Err(RelayError::NotFound(format!(
            "this account claimed no such key package for channel '{name}'"
        ))),
        Invited::NoWelcome => Err(RelayError::NotFound(format!(
            "no Welcome of channel '{name}' names this key package"
        ))),
    }
}

/// The caller's address of `identity`.
async fn own_address(
    inner: &Inner,
    metadata: &tonic::metadata::MetadataMap,
    extensions: &tonic::Extensions,
    identity: &[u8],
) -> Result<Address> {
    let caller = inner.caller(metadata, extensions).await?;
    check_identity(identity)?;
    Ok(Address {
        account: caller.account.to_string(),
        identity: identity.to_vec(),
    })
}

fn db_id(id: u64) -> i64 {
    i64::try_from(id).unwrap_or(i64::MAX)
}

/// ListInvitations: the caller's address's pending invitations.
pub(super) async fn list_invitations(
    inner: &Inner,
    request: Request<pb::ListInvitationsRequest>,
) -> Result<Response<pb::ListInvitationsResponse>> {
    let (metadata, extensions, request) = request.into_parts();
    let address = own_address(inner, &metadata, &extensions, &request.identity).await?;
    let rows = inner
        .log
        .directory()
        .invitations(
            address,
            db_id(request.after_id),
            MAX_LISTED_INVITATIONS,
            now_ms(),
        )
        .await?;
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
    Ok(Response::new(pb::ListInvitationsResponse { invitations }))
}

/// OpenInvitation: the Welcome of a pending invitation of the caller's address.
pub(super) async fn open_invitation(
    inner: &Inner,
    request: Request<pb::OpenInvitationRequest>,
) -> Result<Response<pb::OpenInvitationResponse>> {
    let (metadata, extensions, request) = request.into_parts();
    let address = own_address(inner, &metadata, &extensions, &request.identity).await?;
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
    let address = own_address(inner, &metadata, &extensions, &request.identity).await?;
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
