//! BindLeaf, ListMembers and FetchWelcome: an account's leaf in a channel's group, the group's
//! members, and the welcomes its commits carried.

use tonic::{Request, Response};

use super::refusal::group_refusal;
use super::Inner;
use crate::error::{RelayError, Result};
use crate::log::WelcomeKey;
use crate::pb;

/// Times BindLeaf checks a proof against a new tree when commits move the channel meanwhile.
const BIND_ATTEMPTS: usize = 3;

/// BindLeaf: the caller's account bound to a leaf of the group, by the leaf's signature.
pub(super) async fn bind_leaf(
    inner: &Inner,
    request: Request<pb::BindLeafRequest>,
) -> Result<Response<pb::BindLeafResponse>> {
    let (caller, name, channel, request) = inner.addressed(request).await?;
    let binding = request
        .binding
        .ok_or_else(|| RelayError::InvalidArgument("binding is required".to_owned()))?;
    // A commit may move the channel on between the check and the write: then check
    // against the new tree (a few times; commits are not that frequent).
    for _ in 0..BIND_ATTEMPTS {
        let state = inner.log.group(&channel).await?.ok_or_else(|| {
            RelayError::InvalidArgument(format!(
                "channel '{name}' was created before membership (a legacy channel): \
                 there is no group to bind to"
            ))
        })?;
        state
            .verify_binding(binding.leaf_index, &caller.account, &binding.signature)
            .map_err(group_refusal)?;
        let epoch = state.epoch();
        if inner
            .log
            .bind(
                &channel,
                epoch,
                binding.leaf_index,
                &caller.account,
                caller.key_id.as_deref(),
            )
            .await?
        {
            return Ok(Response::new(pb::BindLeafResponse { epoch }));
        }
    }
    Err(RelayError::Unavailable(format!(
        "channel '{name}' kept moving to new epochs while binding: try again"
    )))
}

/// ListMembers: the group's leaves and the accounts bound to them (members only).
pub(super) async fn list_members(
    inner: &Inner,
    request: Request<pb::ListMembersRequest>,
) -> Result<Response<pb::ListMembersResponse>> {
    let (caller, name, channel, _) = inner.addressed(request).await?;
    inner.require_member(&channel, &caller.account).await?;
    if channel.is_legacy() {
        return Err(RelayError::InvalidArgument(format!(
            "channel '{name}' was created before membership (a legacy channel): the relay \
             does not know its members"
        )));
    }
    let (epoch, members) = inner.log.members_of(&channel).await?;
    let members = members
        .into_iter()
        .map(|(leaf, account)| pb::Member {
            leaf_index: leaf.leaf_index,
            identity: leaf.identity.into(),
            signature_key: leaf.signature_key.into(),
            bound: account.is_some(),
            account: account.map(|a| a.to_string()).unwrap_or_default(),
        })
        .collect();
    Ok(Response::new(pb::ListMembersResponse { epoch, members }))
}

/// FetchWelcome: a welcome a commit carried, by its digest or a key package's ref.
pub(super) async fn fetch_welcome(
    inner: &Inner,
    request: Request<pb::FetchWelcomeRequest>,
) -> Result<Response<pb::FetchWelcomeResponse>> {
    use pb::fetch_welcome_request::Key;
    let (caller, _, channel, request) = inner.addressed(request).await?;
    inner.require_member(&channel, &caller.account).await?;
    let key = match request.key {
        Some(Key::WelcomeSha256(digest)) => WelcomeKey::Digest(digest.to_vec()),
        Some(Key::KeyPackageRef(key_package_ref)) => {
            WelcomeKey::KeyPackageRef(key_package_ref.to_vec())
        }
        None => {
            return Err(RelayError::InvalidArgument(
                "set welcome_sha256 or key_package_ref".to_owned(),
            ))
        }
    };
    let found = inner
        .log
        .fetch_welcome(&channel, key)
        .await?
        .ok_or_else(|| RelayError::NotFound("no such welcome".to_owned()))?;
    Ok(Response::new(pb::FetchWelcomeResponse {
        welcome: found.welcome,
        commit_seq: found.commit_seq,
        epoch: found.epoch,
    }))
}
