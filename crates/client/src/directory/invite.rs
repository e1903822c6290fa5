//! Inviting an address into a channel: claim one of its key packages from the relay's
//! directory (the relay checks the address's policy), commit its Add (the Welcome travels with
//! the commit), then have the relay hold the invitation for the invitee.

use std::sync::Arc;

use tonic::Code;

use super::address::Address;
use crate::channel::Channel;
use crate::error::{Error, Result};
use crate::relay::retry::Retry;
use crate::relay::transport::pb;
use static_proto::directory::NO_SUCH_ADDRESS;

impl Channel {
    /// Invites `address` into this channel; returns once the commit that adds it is accepted
    /// and the relay holds the invitation.
    ///
    /// An address that is unknown, has no key package left, or does not allow our account is
    /// one answer (`auth error:`), so the directory cannot be enumerated; it comes at once.
    pub fn invite(&self, address: &Address) -> Result<()> {
        let shared = Arc::clone(self.shared());
        let name = self.name().to_owned();
        let claimed = {
            let shared = Arc::clone(&shared);
            let name = name.clone();
            let address = address.clone();
            self.shared().block_on(async move {
                let mut retry = Retry::within(shared.options.retry_timeout);
                shared
                    .call(
                        "ClaimKeyPackage",
                        &mut retry,
                        || pb::ClaimKeyPackageRequest {
                            account: address.account.clone(),
                            identity: address.identity.clone().into(),
                            channel: name.clone(),
                        },
                        |mut relay, request| async move { relay.claim_key_package(request).await },
                        |refusal| refusal.code() == Code::NotFound,
                    )
                    .await?
                    .map_err(|refusal| {
                        if refusal.code() == Code::NotFound {
                            Error::Auth(format!("cannot invite {address}: {NO_SUCH_ADDRESS}"))
                        } else {
                            refusal.into_error("ClaimKeyPackage")
                        }
                    })
            })?
        };
        self.add_member(claimed.key_package.to_vec())?;
        let inviter_leaf = shared.engine()?.own_leaf_index(&name)?;
        let key_package_ref = claimed.key_package_ref.to_vec();
        self.shared().block_on(async move {
            shared
                .unary(
                    "Invite",
                    || pb::InviteRequest {
                        channel: name.clone(),
                        key_package_ref: key_package_ref.clone().into(),
                        inviter_leaf,
                    },
                    |mut relay, request| async move { relay.invite(request).await },
                )
                .await
                .map(|_| ())
        })
    }
}
