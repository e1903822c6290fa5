//! Who a call is and what it may do: authentication (once per call), the streaming guard, the
//! channel a call addresses, membership, and the publish rate limit per agent.

use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

use tonic::metadata::MetadataMap;
use tonic::{Extensions, Request};

use super::refusal::not_a_member;
use super::{Inner, Peer};
use crate::audit::Actor;
use crate::auth::{Caller, StreamGuard};
use crate::clock::now_ms;
use crate::error::{RelayError, Result};
use crate::log::Channel;
use crate::members::Reach;
use crate::observe::access::CallInfo;
use crate::pb;
use crate::wire::rules::TokenBucket;

/// Rate-limit buckets kept before idle ones are dropped.
const MAX_BUCKETS: usize = 10_000;

impl Inner {
    /// Authenticates a call (once per call, never per message).
    pub(super) async fn caller(
        &self,
        metadata: &MetadataMap,
        extensions: &Extensions,
    ) -> Result<Caller> {
        let peer = extensions
            .get::<Peer>()
            .map_or_else(|| Arc::from("unknown"), |p| Arc::clone(&p.0));
        let caller = self.auth.authenticate(metadata, &peer).await?;
        // For the access log: who the call is, once known.
        if let Some(who) = extensions.get::<Arc<CallInfo>>() {
            who.set(&caller.account, caller.key_id.as_ref());
        }
        Ok(caller)
    }

    /// Authenticates a streaming call and takes its guard, before anything of the call is
    /// read: the guard ends the call on revocation, expiry or shutdown (see
    /// [`super::Driven::new`], which every streaming response is built with), and refuses an account that holds
    /// `--relay-max-streams-per-account` streams already. Measured at 9b2be07, when only the
    /// subscriptions had one: a PublishBatches call had its items accepted 83 s after its
    /// key was revoked.
    pub(super) async fn streaming_caller(
        &self,
        metadata: &MetadataMap,
        extensions: &Extensions,
    ) -> Result<(Caller, StreamGuard)> {
        let caller = self.caller(metadata, extensions).await?;
        let guard = self.auth.watch(&caller)?;
        Ok((caller, guard))
    }

    pub(super) async fn channel(&self, account: &str, name: &str) -> Result<Arc<Channel>> {
        match self.log.loaded(account, name) {
            Some(channel) => Ok(channel),
            None => self.log.channel(account, name).await,
        }
    }

    /// A unary call on one channel: its caller authenticated, the channel's name checked (its
    /// shape, then the caller's channel patterns: [`Caller::may_name`]) and the channel found (what the caller may do there, its handler checks).
    pub(super) async fn addressed<M: Addressed>(
        &self,
        request: Request<M>,
    ) -> Result<(Caller, String, Arc<Channel>, M)> {
        let (metadata, extensions, mut request) = request.into_parts();
        let caller = self.caller(&metadata, &extensions).await?;
        let name = channel_name(request.take_channel())?;
        caller.may_name(&name)?;
        let channel = self.channel(&caller.account, &name).await?;
        Ok((caller, name, channel, request))
    }

    /// The last seq `account` may read of `channel` (u64::MAX for a member; the commit that
    /// removed it for an account that was one, on this relay): PermissionDenied otherwise.
    pub(super) async fn read_limit(&self, channel: &Channel, account: &str) -> Result<u64> {
        match self.log.reach(channel, account).await? {
            Reach::Member => Ok(u64::MAX),
            Reach::Until(seq) => Ok(seq),
            Reach::None => Err(not_a_member(channel.name())),
        }
    }

    /// PermissionDenied unless `account` is a member of `channel` now.
    pub(super) async fn require_member(&self, channel: &Channel, account: &str) -> Result<()> {
        match self.log.reach(channel, account).await? {
            Reach::Member => Ok(()),
            Reach::Until(_) | Reach::None => Err(not_a_member(channel.name())),
        }
    }

    pub(super) fn rate_limit(&self, caller: &Caller) -> Result<()> {
        let rate = self.settings.publish_rate_per_agent;
        if rate.is_nan() || rate <= 0.0 {
            return Ok(());
        }
        let now = Instant::now();
        let wait = {
            let mut buckets = self.buckets.lock().unwrap_or_else(PoisonError::into_inner);
            match buckets.get_mut(&caller.agent) {
                Some(bucket) => bucket.take(now, 1.0),
                None => {
                    if buckets.len() >= MAX_BUCKETS {
                        let idle = Duration::from_secs(60);
                        buckets.retain(|_, b| now.saturating_duration_since(b.updated) < idle);
                    }
                    let mut bucket = TokenBucket::full(rate, rate, now);
                    let wait = bucket.take(now, 1.0);
                    buckets.insert(caller.agent.clone(), bucket);
                    wait
                }
            }
        };
        if wait.is_zero() {
            return Ok(());
        }
        let ms = (wait.as_secs_f64() * 1000.0).round().max(1.0);
        // Saturating float-to-int conversion: a "never" (Duration::MAX) stays huge.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let retry_after_ms = ms as u64;
        Err(RelayError::ResourceExhausted {
            message: format!("publish rate limit of {rate} messages/s per agent exceeded"),
            retry_after_ms,
        })
    }
}

/// The caller as its audit rows name it, now.
pub(super) fn actor(caller: &Caller) -> Actor {
    Actor {
        account: caller.account.to_string(),
        key_id: caller.key_id.clone(),
        at_ms: now_ms(),
    }
}

/// A request naming one channel.
pub(super) trait Addressed {
    fn take_channel(&mut self) -> String;
}

macro_rules! addressed {
    ($($request:ty),*) => {
        $(impl Addressed for $request {
            fn take_channel(&mut self) -> String {
                std::mem::take(&mut self.channel)
            }
        })*
    };
}

addressed!(
    pb::SubscribeRequest,
    pb::BindLeafRequest,
    pb::ListMembersRequest,
    pb::FetchWelcomeRequest,
    pb::SetRetentionRequest,
    pb::GetRetentionRequest,
    pb::InviteRequest
);

pub(super) fn channel_name(name: String) -> Result<String> {
    match static_mls::validate_channel_name(&name) {
        Ok(()) => Ok(name),
        Err(e) => Err(RelayError::InvalidArgument(e.to_string())),
    }
}
