//! CreateChannel, and the gate every costly group check goes through: the checks that cost
//! nothing come first (the name, the sizes, the account's rate of creates and of org claims,
//! the org's owner), then the group's own, in the [`VerifyPool`] (off the async workers, a
//! bounded number per account), under a bound on group size (docs/design.md §5.2).
//!
//! At 9b2be07 CreateChannel built the group (every leaf's signature) before anything else was
//! looked at, inline on a tokio worker: a 1 MiB tree of 6,472 leaves cost 305-372 ms of CPU
//! and then was refused, and two loops of it took another account's round trip from 2.9 ms to
//! 250 ms (issue 27). Now such a tree is refused after a parse (a new group holds its creator
//! alone), and what is verified runs in the pool.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tonic::{Request, Response};

use super::caller::{actor, channel_name};
use super::refusal::{group_refusal, internal};
use super::Inner;
use crate::error::{RelayError, Result};
use crate::group::{GroupState, Handshake, Proof};
use crate::pb;
use crate::verify_pool::{PoolError, VerifyPool, RETRY_AFTER};
use crate::wire::rules::{org_key, KeyedBuckets};

/// A burst of creates may be this many seconds of the rate (a client making its channels at
/// start).
const CREATE_BURST_SECONDS: f64 = 10.0;

/// How long one charged claim covers further creates of the same account in the same org
/// while the first create is still on its way to the store: the claim budget's window.
const CLAIM_COVERS: Duration = Duration::from_secs(60);

/// What the gate needs of the relay's configuration.
#[derive(Debug, Clone)]
pub(crate) struct GateSettings {
    /// Members a group may have after a commit.
    pub max_group_size: usize,
    /// Channels one account may create per second (0: no limit).
    pub create_rate: f64,
    /// Orgs one account may claim per minute, and at once (0: no limit).
    pub org_claims_per_minute: f64,
    /// Costly group checks one account may have running or waiting.
    pub checks_per_account: usize,
}

/// The gate: rate limits per account and the pool.
pub(crate) struct Gate {
    settings: GateSettings,
    pool: Arc<VerifyPool>,
    creates: KeyedBuckets,
    claims: KeyedBuckets,
    /// (account, org key) claims charged within [`CLAIM_COVERS`]: concurrent creates in one
    /// new org are one claim, not one each (64 at once were refused after the 10th).
    /// Bounded: an entry is made only by a charged claim, and pruned after the window.
    charged: Mutex<HashMap<(Arc<str>, String), Instant>>,
}

impl Gate {
    pub fn new(settings: GateSettings) -> Gate {
        let pool = VerifyPool::per_core(settings.checks_per_account);
        let creates = KeyedBuckets::new(
            settings.create_rate,
            settings.create_rate * CREATE_BURST_SECONDS,
        );
        let claims = KeyedBuckets::new(
            settings.org_claims_per_minute / 60.0,
            settings.org_claims_per_minute,
        );
        Gate {
            settings,
            pool,
            creates,
            claims,
            charged: Mutex::new(HashMap::new()),
        }
    }

    fn take_create(&self, account: &str) -> Result<()> {
        self.creates
            .take(account, Instant::now())
            .map_err(|ms| RelayError::ResourceExhausted {
                message: format!(
                    "channel creation rate limit of {} per second per account exceeded",
                    self.settings.create_rate
                ),
                retry_after_ms: ms,
            })
    }

    fn take_claim(&self, account: &Arc<str>, org: &str) -> Result<()> {
        let limit = self.settings.org_claims_per_minute;
        if limit.is_nan() || limit <= 0.0 {
            return Ok(()); // no limit (0), so nothing to remember
        }
        let now = Instant::now();
        let key = (Arc::clone(account), org_key(org));
        let mut charged = self.charged.lock().unwrap_or_else(PoisonError::into_inner);
        if charged
            .get(&key)
            .is_some_and(|at| now.saturating_duration_since(*at) < CLAIM_COVERS)
        {
            return Ok(());
        }
        self.claims
            .take(account, now)
            .map_err(|ms| RelayError::ResourceExhausted {
                message: format!(
                    "org '{org}' would be a new org: an account may claim {} orgs per minute",
                    self.settings.org_claims_per_minute
                ),
                retry_after_ms: ms,
            })?;
        charged.retain(|_, at| now.saturating_duration_since(*at) < CLAIM_COVERS);
        charged.insert(key, now);
        Ok(())
    }

    /// Runs a costly group check for `account` in the pool.
    pub(super) async fn check<T, F>(&self, account: &str, check: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce() -> T + Send + 'static,
    {
        self.pool.run(account, check).await.map_err(|e| match e {
            PoolError::Busy { .. } => RelayError::ResourceExhausted {
                message: e.to_string(),
                retry_after_ms: u64::try_from(RETRY_AFTER.as_millis()).unwrap_or(u64::MAX),
            },
            PoolError::Failed(_) => internal(&e.to_string()),
        })
    }

    /// A handshake checked against its channel's group (see
    /// [`GroupState::check_handshake_within`]), in the pool.
    pub async fn check_handshake(
        &self,
        account: &str,
        state: Arc<GroupState>,
        message: Bytes,
        proposals: Vec<Bytes>,
    ) -> Result<Handshake> {
        let limit = self.settings.max_group_size;
        self.check(account, move || {
            let proposals: Vec<&[u8]> = proposals.iter().map(AsRef::as_ref).collect();
            state.check_handshake_within(&message, &proposals, limit)
        })
        .await?
        .map_err(group_refusal)
    }
}

/// CreateChannel: cheapest checks first, the group last and in the pool.
pub(super) async fn create_channel(
    inner: &Inner,
    request: Request<pb::CreateChannelRequest>,
) -> Result<Response<pb::CreateChannelResponse>> {
    let (metadata, extensions, request) = request.into_parts();
    let caller = inner.caller(&metadata, &extensions).await?;
    let name = channel_name(request.channel)?;
    caller.may_name(&name)?;
    if request.group_info.is_empty() {
        return Err(RelayError::InvalidArgument(
            "group_info is required: the creator's GroupInfo at epoch 0 (this relay checks \
             handshakes against the channel's group; see proto/relay.proto)"
                .to_owned(),
        ));
    }
    let binding = request.binding.ok_or_else(|| {
        RelayError::InvalidArgument(
            "binding is required: the creator's leaf binding (LeafBinding)".to_owned(),
        )
    })?;
    let limit = inner.settings.max_message_bytes;
    if request.group_info.len() > limit || request.ratchet_tree.len() > limit {
        return Err(RelayError::resource_exhausted(format!(
            "group state larger than {limit} bytes"
        )));
    }
    let gate = &inner.gate;
    gate.take_create(&caller.account)?;
    // The org before the group: another account's org is refused for one store read, and a
    // new org costs a claim of the account's budget. (The store decides again when it
    // creates: this read may be stale.)
    let org = name.split('/').next().unwrap_or_default();
    match inner.log.org_owner(org).await? {
        Some(owner) if *owner == *caller.account => {}
        Some(_) => {
            return Err(RelayError::PermissionDenied(format!(
                "org '{org}' belongs to another account"
            )))
        }
        None => gate.take_claim(&caller.account, org)?,
    }
    let state = {
        let name = name.clone();
        let account = Arc::clone(&caller.account);
        let (group_info, tree) = (request.group_info, request.ratchet_tree);
        let (leaf, signature) = (binding.leaf_index, binding.signature);
        gate.check(&caller.account, move || {
            let proof = Proof {
                leaf,
                account: &account,
                signature: &signature,
            };
            GroupState::create_bound(&name, &group_info, &tree, &proof)
        })
        .await?
        .map_err(group_refusal)?
    };
    // Its audit rows are written in the create's transaction.
    let by = actor(&caller);
    inner
        .log
        .create_audited(
            &name,
            &caller.account,
            state,
            binding.leaf_index,
            caller.key_id.as_deref(),
            Some(&by),
        )
        .await?;
    Ok(Response::new(pb::CreateChannelResponse {
        channel: name,
        epoch: 0,
    }))
}
