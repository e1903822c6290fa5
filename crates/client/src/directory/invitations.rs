//! Our side of invitations: our address, who may invite us (our policy), and the invitations
//! the relay holds for us: listed, accepted (joining from the Welcome) or declined.
//!
//! Each call is one relay call or a few; `list_invitations` is the SDK iterators' long poll
//! (the relay holds it until an invitation comes) and starts the stock keeper.

use std::sync::Arc;
use std::time::Duration;

use static_proto::directory::{
    ANY_ACCOUNT, MAX_ACCOUNT_BYTES, MAX_LIST_WAIT_MS, MAX_POLICY_ACCOUNTS,
};

use super::address::Address;
use crate::channel::Channel;
use crate::client::Client;
use crate::error::{Error, Result};
use crate::relay::retry::Retry;
use crate::relay::transport::pb;

/// An invitation into a channel, held by the relay until we accept or decline it, or its
/// Welcome expires.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invitation {
    pub id: u64,
    pub channel: String,
    /// The credential identity of the inviter's leaf.
    pub inviter_identity: Vec<u8>,
    /// The inviter's account, as the relay authenticated it.
    pub inviter_account: String,
    /// Unix milliseconds.
    pub created_at_ms: u64,
    /// Unix milliseconds: when its Welcome expires.
    pub expires_at_ms: u64,
}

impl Client {
    /// Our address: our account (from our token; "" when anonymous) and identity.
    pub fn address(&self) -> Result<Address> {
        let shared = Arc::clone(&self.shared);
        let account = self.shared.block_on(async move {
            let mut retry = Retry::within(shared.options.retry_timeout);
            shared.account(&mut retry, "address").await
        })?;
        Ok(Address {
            account,
            identity: self.identity().to_vec(),
        })
    }

    /// Keeps our key packages listed in the relay's directory from now on (the first call
    /// lists them before it returns), so that others can invite us.
    pub fn keep_key_packages(&self) -> Result<()> {
        self.shared.check_open()?;
        self.stock.start(&self.shared)
    }

    /// Lets callers of `accounts` (besides our own; `"*"`: any account) claim our key packages,
    /// and so invite us; replaces what was allowed before. Starts keeping our key packages
    /// listed.
    pub fn allow_invitations(&self, accounts: Vec<String>) -> Result<()> {
        if accounts.len() > MAX_POLICY_ACCOUNTS {
            return Err(Error::Invalid(format!(
                "at most {MAX_POLICY_ACCOUNTS} accounts may be allowed, not {}",
                accounts.len()
            )));
        }
        if let Some(bad) = accounts
            .iter()
            .find(|a| a.is_empty() || a.len() > MAX_ACCOUNT_BYTES || a.contains(':'))
        {
            return Err(Error::Invalid(format!(
                "{bad:?} is not an account id (or {ANY_ACCOUNT:?} for any account)"
            )));
        }
        self.shared.check_open()?;
        self.stock.start(&self.shared)?;
        let shared = Arc::clone(&self.shared);
        let identity = self.identity().to_vec();
        self.shared.block_on(async move {
            shared
                .unary(
                    "SetInvitationPolicy",
                    || pb::SetInvitationPolicyRequest {
                        identity: identity.clone().into(),
                        policy: Some(pb::InvitationPolicy {
                            accounts: accounts.clone(),
                        }),
                    },
                    |mut relay, request| async move { relay.set_invitation_policy(request).await },
                )
                .await
                .map(|_| ())
        })
    }

    /// Our pending invitations with an id above `after_id`, oldest first (at most 100 per
    /// call); when there is none, the relay holds the call up to `wait` for one to come (a long
    /// poll, at most 20 s). Starts keeping our key packages listed, and nudges the keeper when
    /// an invitation is new (a package of ours was claimed).
    pub fn list_invitations(&self, after_id: u64, wait: Duration) -> Result<Vec<Invitation>> {
        let wait_ms = u32::try_from(wait.as_millis())
            .unwrap_or(u32::MAX)
            .min(MAX_LIST_WAIT_MS);
        self.shared.check_open()?;
        self.stock.start(&self.shared)?;
        if let Some(failure) = self.stock.failure() {
            return Err(failure);
        }
        let shared = Arc::clone(&self.shared);
        let identity = self.identity().to_vec();
        let listed = self.shared.block_on(async move {
            shared
                .unary(
                    "ListInvitations",
                    || pb::ListInvitationsRequest {
                        identity: identity.clone().into(),
                        after_id,
                        wait_ms,
                    },
                    |mut relay, request| async move { relay.list_invitations(request).await },
                )
                .await
        })?;
        let mut newest = self
            .newest_invitation
            .load(std::sync::atomic::Ordering::SeqCst);
        let mut out = Vec::with_capacity(listed.invitations.len());
        for invitation in listed.invitations {
            if invitation.id > newest {
                newest = invitation.id;
                self.stock.nudge(invitation.last_resort);
            }
            out.push(Invitation {
                id: invitation.id,
                channel: invitation.channel,
                inviter_identity: invitation.inviter_identity.to_vec(),
                inviter_account: invitation.inviter_account,
                created_at_ms: invitation.created_at_ms,
                expires_at_ms: invitation.expires_at_ms,
            });
        }
        self.newest_invitation
            .fetch_max(newest, std::sync::atomic::Ordering::SeqCst);
        Ok(out)
    }

    /// Accepts invitation `id` into `channel`: joins from its Welcome, binds our leaf, and
    /// settles it (it is not listed again). Safe to repeat after a crash part-way: a channel
    /// already joined is bound again and reopened.
    pub fn accept_invitation(&self, id: u64, channel: &str) -> Result<Arc<Channel>> {
        static_mls::validate_channel_name(channel)?;
        self.shared.check_open()?;
        let joined = if self.shared.engine()?.has_group(channel) {
            self.shared.block_on(self.shared.bind_leaf(channel))?;
            self.open_channel(channel)?
        } else {
            let opened = self.open_invitation(id)?;
            if opened.channel != channel {
                return Err(Error::Invalid(format!(
                    "invitation {id} is into {:?}, not {channel:?}",
                    opened.channel
                )));
            }
            self.join_channel(channel, &opened.welcome)?
        };
        self.settle_invitation(id, true)?;
        Ok(joined)
    }

    /// Declines invitation `id`: it is not listed again. (The inviter's commit already added
    /// our leaf: it stays unbound, and members see it so in their roster.)
    pub fn decline_invitation(&self, id: u64) -> Result<()> {
        self.shared.check_open()?;
        self.settle_invitation(id, false)
    }

    fn open_invitation(&self, id: u64) -> Result<pb::OpenInvitationResponse> {
        let shared = Arc::clone(&self.shared);
        let identity = self.identity().to_vec();
        self.shared.block_on(async move {
            shared
                .unary(
                    "OpenInvitation",
                    || pb::OpenInvitationRequest {
                        identity: identity.clone().into(),
                        id,
                    },
                    |mut relay, request| async move { relay.open_invitation(request).await },
                )
                .await
        })
    }

    fn settle_invitation(&self, id: u64, accept: bool) -> Result<()> {
        let shared = Arc::clone(&self.shared);
        let identity = self.identity().to_vec();
        self.shared.block_on(async move {
            shared
                .unary(
                    "SettleInvitation",
                    || pb::SettleInvitationRequest {
                        identity: identity.clone().into(),
                        id,
                        accept,
                    },
                    |mut relay, request| async move { relay.settle_invitation(request).await },
                )
                .await
                .map(|_| ())
        })
    }
}
