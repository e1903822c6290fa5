//! The Relay service: its state, and the dispatch of each RPC of `proto/relay.proto` to the
//! file of its family.
//!
//! - [`create`]: CreateChannel, and the gate every costly group check goes through;
//! - [`members`]: BindLeaf, ListMembers, FetchWelcome;
//! - [`publish`]: Publish, PublishStream, PublishBatches, the last two driven by
//!   [`pipeline`];
//! - [`subscribe`]: Subscribe, and the paging of the log it shares with [`many`]
//!   (SubscribeMany);
//! - [`retention`]: SetRetention, GetRetention;
//! - [`directory`]: OfferKeyPackages, SetInvitationPolicy, ClaimKeyPackage (the key-package
//!   directory); [`invitations`]: Invite, ListInvitations, OpenInvitation, SettleInvitation;
//! - [`caller`]: who a call is and what it may do; [`refusal`]: how refusals are worded and
//!   counted; [`driven`]: the response stream of every streaming call.
//!
//! Status codes and texts are the protocol's (`proto/relay.proto`, `tests/relay/`).
//!
//! Every call naming a channel checks it against the caller's channel patterns (a key's, issue
//! 30: [`crate::auth::Caller::may_name`]) first, right after the name's shape: no store read, no
//! signature, at most 100 comparisons. Creates, commits and retention changes write their audit
//! rows (`crate::audit`) in their own transactions; application messages write none.
//!
//! Every call's work runs in the task that serves its HTTP/2 stream: a unary call in its
//! handler, a streaming call in a driver future polled by its own response body ([`Driven`]).
//! A publish is answered by the task its commit wakes, with no hop through a spawned task; a
//! slow reader's body is not polled, so its driver waits (and a subscriber then catches up
//! from the log); a call whose peer is gone (its body dropped) stops at once.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tonic::{Request, Response, Status, Streaming};

use crate::auth::{Authenticator, Caller};
use crate::error::Result;
use crate::log::ChannelLog;
use crate::pb;
use crate::retention::Policy;
use crate::shutdown::Shutdown;
use crate::wire::rules::TokenBucket;

mod caller;
mod create;
mod directory;
mod driven;
mod invitations;
mod many;
mod members;
mod pipeline;
mod publish;
mod refusal;
mod retention;
mod subscribe;

pub(crate) use create::GateSettings;
pub(crate) use directory::DirectorySettings;
use driven::{Driven, Sender};
pub(crate) use refusal::transport_error;

/// What the service needs of the relay's configuration.
#[derive(Debug, Clone)]
pub(crate) struct ServiceSettings {
    pub max_message_bytes: usize,
    pub keepalive_interval: Duration,
    /// 0 = no limit.
    pub publish_rate_per_agent: f64,
    /// Channels one SubscribeMany stream may follow at once.
    pub max_subscriptions_per_stream: usize,
    /// Follows one account may hold on all its SubscribeMany streams together.
    pub max_follows_per_account: usize,
    /// The retention of channels that set none (per limit).
    pub default_policy: Policy,
    /// What one streaming call may hold ahead of its peer: half for the page read from the
    /// log, half for the queue of responses (each may exceed its half by one message).
    pub stream_buffer_bytes: usize,
    /// CreateChannel's limits and the pool of costly group checks (`create`).
    pub gate: GateSettings,
    /// The key-package directory's limits (`directory`).
    pub directory: DirectorySettings,
}

impl ServiceSettings {
    /// The largest gRPC message read: a message and a welcome at the limit, plus the
    /// request's own fields.
    pub fn transport_limit(&self) -> usize {
        self.max_message_bytes
            .saturating_mul(2)
            .saturating_add(64 * 1024)
    }

    /// The bytes of entries a subscription reads from the log at a time (a page holds at
    /// least one entry, so one message more at most). Measured at e879e1d: a page of 256
    /// entries of 1 MiB held 256 MiB per subscriber that stopped reading.
    pub fn page_bytes(&self) -> usize {
        (self.stream_buffer_bytes / 2).max(1)
    }

    /// The encoded bytes of responses a call may queue ahead of its body (a larger response
    /// waits alone).
    pub fn queue_bytes(&self) -> usize {
        (self.stream_buffer_bytes / 2).max(1)
    }
}

/// Where a call comes from (`ip:port`), put in each request's extensions by the server.
#[derive(Debug, Clone)]
pub(crate) struct Peer(pub Arc<str>);

/// The Relay gRPC service. Cheap to clone.
#[derive(Clone)]
pub(crate) struct Relay(Arc<Inner>);

struct Inner {
    log: ChannelLog,
    auth: Arc<Authenticator>,
    settings: ServiceSettings,
    buckets: Mutex<HashMap<String, TokenBucket>>,
    /// Follows held per account (scope) on SubscribeMany streams (see `many`).
    follows: Mutex<HashMap<String, usize>>,
    /// Rate limits of creates and org claims; the pool of costly group checks.
    gate: create::Gate,
    /// The directory's claim rates.
    claims: directory::ClaimRates,
    /// Held ListInvitations calls, woken by Invite.
    invited: invitations::Wakeups,
    shutdown: Shutdown,
}

impl Relay {
    pub fn new(
        log: ChannelLog,
        auth: Arc<Authenticator>,
        settings: ServiceSettings,
        shutdown: Shutdown,
    ) -> Relay {
        let gate = create::Gate::new(settings.gate.clone());
        let claims = directory::ClaimRates::new(&settings.directory);
        Relay(Arc::new(Inner {
            log,
            auth,
            gate,
            claims,
            invited: invitations::Wakeups::default(),
            settings,
            buckets: Mutex::new(HashMap::new()),
            follows: Mutex::new(HashMap::new()),
            shutdown,
        }))
    }

    /// A client-streaming call: its caller checked and its guard taken (see
    /// [`Inner::streaming_caller`]), then driven by `run` over its requests. Returned at once:
    /// the response headers leave before any request is read.
    async fn driven<R, T, Fut>(
        &self,
        request: Request<Streaming<R>>,
        run: impl FnOnce(Arc<Inner>, Caller, Streaming<R>, Sender<Result<T, Status>>) -> Fut,
    ) -> Result<Response<Driven<Result<T, Status>>>, Status>
    where
        T: prost::Message + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let (metadata, extensions, requests) = request.into_parts();
        let (caller, guard) = self.0.streaming_caller(&metadata, &extensions).await?;
        let inner = Arc::clone(&self.0);
        let budget = inner.settings.queue_bytes();
        Ok(Response::new(Driven::new(budget, guard, move |tx| {
            run(inner, caller, requests, tx)
        })))
    }
}

#[tonic::async_trait]
impl pb::relay_server::Relay for Relay {
    async fn create_channel(
        &self,
        request: Request<pb::CreateChannelRequest>,
    ) -> Result<Response<pb::CreateChannelResponse>, Status> {
        Ok(create::create_channel(&self.0, request).await?)
    }

    async fn bind_leaf(
        &self,
        request: Request<pb::BindLeafRequest>,
    ) -> Result<Response<pb::BindLeafResponse>, Status> {
        Ok(members::bind_leaf(&self.0, request).await?)
    }

    async fn list_members(
        &self,
        request: Request<pb::ListMembersRequest>,
    ) -> Result<Response<pb::ListMembersResponse>, Status> {
        Ok(members::list_members(&self.0, request).await?)
    }

    async fn publish(
        &self,
        request: Request<pb::PublishRequest>,
    ) -> Result<Response<pb::PublishResponse>, Status> {
        Ok(publish::publish(&self.0, request).await?)
    }

    type PublishStreamStream = Driven<Result<pb::PublishResponse, Status>>;

    async fn publish_stream(
        &self,
        request: Request<Streaming<pb::PublishRequest>>,
    ) -> Result<Response<Self::PublishStreamStream>, Status> {
        self.driven(request, pipeline::drive::<publish::PublishStream>)
            .await
    }

    type PublishBatchesStream = Driven<Result<pb::PublishBatchResponse, Status>>;

    async fn publish_batches(
        &self,
        request: Request<Streaming<pb::PublishBatchRequest>>,
    ) -> Result<Response<Self::PublishBatchesStream>, Status> {
        self.driven(request, pipeline::drive::<publish::PublishBatches>)
            .await
    }

    type SubscribeStream = Driven<Result<pb::SubscribeResponse, Status>>;

    async fn subscribe(
        &self,
        request: Request<pb::SubscribeRequest>,
    ) -> Result<Response<Self::SubscribeStream>, Status> {
        Ok(subscribe::subscribe(&self.0, request).await?)
    }

    type SubscribeManyStream = Driven<Result<pb::SubscribeManyResponse, Status>>;

    async fn subscribe_many(
        &self,
        request: Request<Streaming<pb::SubscribeManyRequest>>,
    ) -> Result<Response<Self::SubscribeManyStream>, Status> {
        self.driven(request, Inner::subscribe_many).await
    }

    async fn fetch_welcome(
        &self,
        request: Request<pb::FetchWelcomeRequest>,
    ) -> Result<Response<pb::FetchWelcomeResponse>, Status> {
        Ok(members::fetch_welcome(&self.0, request).await?)
    }

    async fn set_retention(
        &self,
        request: Request<pb::SetRetentionRequest>,
    ) -> Result<Response<pb::RetentionResponse>, Status> {
        Ok(retention::set_retention(&self.0, request).await?)
    }

    /// GetRelayInfo: the relay's key as external sender (any caller the relay accepts).
    async fn get_relay_info(
        &self,
        request: Request<pb::GetRelayInfoRequest>,
    ) -> Result<Response<pb::GetRelayInfoResponse>, Status> {
        let (metadata, extensions, _) = request.into_parts();
        self.0.caller(&metadata, &extensions).await?;
        Ok(Response::new(pb::GetRelayInfoResponse {
            external_sender_signature_key: self.0.log.external_sender_key().to_vec().into(),
            external_sender_identity: static_mls::RELAY_SENDER_IDENTITY.to_vec().into(),
        }))
    }

    async fn get_retention(
        &self,
        request: Request<pb::GetRetentionRequest>,
    ) -> Result<Response<pb::RetentionResponse>, Status> {
        Ok(retention::get_retention(&self.0, request).await?)
    }

    async fn offer_key_packages(
        &self,
        request: Request<pb::OfferKeyPackagesRequest>,
    ) -> Result<Response<pb::OfferKeyPackagesResponse>, Status> {
        Ok(directory::offer_key_packages(&self.0, request).await?)
    }

    async fn set_invitation_policy(
        &self,
        request: Request<pb::SetInvitationPolicyRequest>,
    ) -> Result<Response<pb::SetInvitationPolicyResponse>, Status> {
        Ok(directory::set_invitation_policy(&self.0, request).await?)
    }

    async fn claim_key_package(
        &self,
        request: Request<pb::ClaimKeyPackageRequest>,
    ) -> Result<Response<pb::ClaimKeyPackageResponse>, Status> {
        Ok(directory::claim_key_package(&self.0, request).await?)
    }

    async fn invite(
        &self,
        request: Request<pb::InviteRequest>,
    ) -> Result<Response<pb::InviteResponse>, Status> {
        Ok(invitations::invite(&self.0, request).await?)
    }

    async fn list_invitations(
        &self,
        request: Request<pb::ListInvitationsRequest>,
    ) -> Result<Response<pb::ListInvitationsResponse>, Status> {
        Ok(invitations::list_invitations(&self.0, request).await?)
    }

    async fn open_invitation(
        &self,
        request: Request<pb::OpenInvitationRequest>,
    ) -> Result<Response<pb::OpenInvitationResponse>, Status> {
        Ok(invitations::open_invitation(&self.0, request).await?)
    }

    async fn settle_invitation(
        &self,
        request: Request<pb::SettleInvitationRequest>,
    ) -> Result<Response<pb::SettleInvitationResponse>, Status> {
        Ok(invitations::settle_invitation(&self.0, request).await?)
    }
}
