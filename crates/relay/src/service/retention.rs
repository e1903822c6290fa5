//! SetRetention and GetRetention: who may set a channel's retention, and policies as the
//! protocol carries them.

use tonic::{Request, Response};

use super::caller::actor;
use super::Inner;
use crate::error::{RelayError, Result};
use crate::log::Channel;
use crate::members::Reach;
use crate::pb;
use crate::retention::{Policy, MAX_AGE_SECONDS};

/// SetRetention: by the org's owner, within the publish rate limit.
pub(super) async fn set_retention(
    inner: &Inner,
    request: Request<pb::SetRetentionRequest>,
) -> Result<Response<pb::RetentionResponse>> {
    let (caller, _, channel, request) = inner.addressed(request).await?;
    let policy = requested_policy(request.policy)?;
    inner.require_org_owner(&channel, &caller.account).await?;
    inner.rate_limit(&caller)?;
    // Its `retention.changed` row is written in the same transaction.
    inner
        .log
        .set_retention(&channel, policy, &actor(&caller))
        .await?;
    Ok(Response::new(inner.retention_response(&channel).await?))
}

/// GetRetention: for a reader of the channel or the org's owner.
pub(super) async fn get_retention(
    inner: &Inner,
    request: Request<pb::GetRetentionRequest>,
) -> Result<Response<pb::RetentionResponse>> {
    let (caller, _, channel, _) = inner.addressed(request).await?;
    if inner.read_limit(&channel, &caller.account).await.is_err() {
        inner.require_org_owner(&channel, &caller.account).await?;
    }
    Ok(Response::new(inner.retention_response(&channel).await?))
}

impl Inner {
    /// PermissionDenied unless `account` owns the channel's org (for a legacy channel: is its
    /// owner). One store read, before anything is written.
    async fn require_org_owner(&self, channel: &Channel, account: &str) -> Result<()> {
        let owns = if channel.is_legacy() {
            self.log.reach(channel, account).await? == Reach::Member
        } else {
            let org = channel.name().split('/').next().unwrap_or_default();
            self.log.org_owner(org).await?.as_deref() == Some(account)
        };
        if owns {
            return Ok(());
        }
        Err(RelayError::PermissionDenied(format!(
            "only the account owning the org of channel '{}' may set its retention",
            channel.name()
        )))
    }

    /// The channel's retention as GetRetention and SetRetention answer it.
    async fn retention_response(&self, channel: &Channel) -> Result<pb::RetentionResponse> {
        let row = self.log.retention_row(channel).await?;
        let effective = row.policy.over(&self.settings.default_policy);
        Ok(pb::RetentionResponse {
            channel_policy: Some(wire_policy(&row.policy)),
            effective: Some(wire_policy(&effective)),
            horizon_seq: row.horizon,
            head_seq: row.head_seq.max(channel.head_seq()),
        })
    }
}

fn wire_policy(policy: &Policy) -> pb::RetentionPolicy {
    pb::RetentionPolicy {
        max_age_seconds: policy.max_age_seconds,
        max_entries: policy.max_entries,
        max_bytes: policy.max_bytes,
    }
}

/// A policy as SetRetention asks for it: INVALID_ARGUMENT beyond the store's integers.
fn requested_policy(policy: Option<pb::RetentionPolicy>) -> Result<Policy> {
    let policy = policy.unwrap_or_default();
    let fits = |v: Option<u64>, max: u64| v.is_none_or(|v| v <= max);
    let max = u64::try_from(i64::MAX).unwrap_or(u64::MAX);
    if !fits(policy.max_age_seconds, MAX_AGE_SECONDS)
        || !fits(policy.max_entries, max)
        || !fits(policy.max_bytes, max)
    {
        return Err(RelayError::InvalidArgument(format!(
            "retention limits must be at most {MAX_AGE_SECONDS} seconds and {max} entries or \
             bytes"
        )));
    }
    Ok(Policy {
        max_age_seconds: policy.max_age_seconds,
        max_entries: policy.max_entries,
        max_bytes: policy.max_bytes,
    })
}
