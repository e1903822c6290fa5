//! OfferKeyPackages, SetInvitationPolicy and ClaimKeyPackage: the key-package directory
//! (docs/design.md §5.5), an address being the caller's account and an identity.
//!
//! Costs, per call (limits in `static_proto::directory`):
//! - OfferKeyPackages: by any caller, for its own account. Counted against its publish rate.
//!   CPU: per package a TLS parse, three signature checks (leaf node, package, binding) and a
//!   hash, run in the verify pool under the account's lane (so one account cannot take the
//!   relay's cores): 64 packages are ~10 ms of one core. Memory: the request (at most 64 ×
//!   16 KiB). Rows: one transaction, at most 64 package rows written (an address keeps at
//!   most 64 one-time packages and one last-resort package unclaimed).
//! - SetInvitationPolicy: by any caller, for its own account; counted against its publish
//!   rate. One transaction, at most 100 rows of at most 64 bytes.
//! - ClaimKeyPackage: by a member of the channel named, within its account's claim rate. One
//!   membership look-up (memory, else the store), one read (consent), one transaction (the
//!   hand-out and a claim row). Memory: one token bucket per claiming account and per claimed
//!   address (both maps bounded, `KeyedBuckets`).
//!
//! ClaimKeyPackage names a channel: outside the caller's channel patterns it is refused first,
//! for nothing but the comparison ([`crate::auth::Caller::may_name`]).
//!
//! A refused call is one line of the access log, as any call (its budget per account).

use std::time::Instant;

use tonic::{Request, Response};

use super::caller::channel_name;
use super::Inner;
use crate::auth::Caller;
use crate::clock::now_ms;
use crate::error::{RelayError, Result};
use crate::group::{check_key_package, peek_key_package, PackageError};
use crate::pb;
use crate::store::directory::{Address, Claim, Claimed, NewPackage, Offer, Offered, Stock};
use crate::wire::rules::KeyedBuckets;
use static_proto::directory::{
    MAX_ACCOUNT_BYTES, MAX_IDENTITY_BYTES, MAX_KEY_PACKAGE_BYTES, MAX_OFFER_PACKAGES,
    MAX_ONE_TIME_PACKAGES, MAX_POLICY_ACCOUNTS, NO_SUCH_ADDRESS,
};

/// A burst of claims of one account may be this many seconds of its rate.
const ACCOUNT_BURST_SECONDS: f64 = 4.0;
/// A burst of claims of one address may be this many seconds of its rate.
const ADDRESS_BURST_SECONDS: f64 = 20.0;

/// What the directory needs of the relay's configuration.
#[derive(Debug, Clone)]
pub(crate) struct DirectorySettings {
    /// Claims one account may make per second (0: no limit).
    pub claim_rate_per_account: f64,
    /// Claims of one address per second (0: no limit).
    pub claim_rate_per_address: f64,
    /// Pending invitations of an address past which its packages are not handed out.
    pub max_pending_invitations: usize,
    /// How long the relay keeps a Welcome (None: until used): an invitation's expiry.
    pub welcome_ttl: Option<std::time::Duration>,
}

/// The claim rates: per claiming account, per claimed address.
pub(super) struct ClaimRates {
    per_account: KeyedBuckets,
    per_address: KeyedBuckets,
    settings: DirectorySettings,
}

impl ClaimRates {
    pub fn new(settings: &DirectorySettings) -> ClaimRates {
        let (account, address) = (
            settings.claim_rate_per_account,
            settings.claim_rate_per_address,
        );
        ClaimRates {
            per_account: KeyedBuckets::new(account, account * ACCOUNT_BURST_SECONDS),
            per_address: KeyedBuckets::new(address, address * ADDRESS_BURST_SECONDS),
            settings: settings.clone(),
        }
    }

    fn take_account(&self, account: &str) -> Result<()> {
        self.per_account
            .take(account, Instant::now())
            .map_err(|ms| RelayError::ResourceExhausted {
                message: format!(
                    "key package claim rate limit of {} per second per account exceeded",
                    self.settings.claim_rate_per_account
                ),
                retry_after_ms: ms,
            })
    }

    fn take_address(&self, address: &Address) -> Result<()> {
        self.per_address
            .take(&address_key(address), Instant::now())
            .map_err(|ms| RelayError::ResourceExhausted {
                message: format!(
                    "this address's key packages are claimed too fast (at most {} per second)",
                    self.settings.claim_rate_per_address
                ),
                retry_after_ms: ms,
            })
    }
}

/// An address as a map key: the account's length first, so that no two addresses meet.
fn address_key(address: &Address) -> String {
    let mut key = format!("{}:{}:", address.account.len(), address.account);
    for byte in &address.identity {
        key.push_str(&format!("{byte:02x}"));
    }
    key
}

/// The caller, and its address of `identity` (its own account's: INVALID_ARGUMENT unless the
/// identity is 1 to 255 bytes).
pub(super) async fn own_address(
    inner: &Inner,
    metadata: &tonic::metadata::MetadataMap,
    extensions: &tonic::Extensions,
    identity: &[u8],
) -> Result<(Caller, Address)> {
    let caller = inner.caller(metadata, extensions).await?;
    check_identity(identity)?;
    let address = Address {
        account: caller.account.to_string(),
        identity: identity.to_vec(),
    };
    Ok((caller, address))
}

/// INVALID_ARGUMENT unless `identity` is 1 to 255 bytes.
fn check_identity(identity: &[u8]) -> Result<()> {
    if identity.is_empty() || identity.len() > MAX_IDENTITY_BYTES {
        return Err(RelayError::InvalidArgument(format!(
            "identity must be 1 to {MAX_IDENTITY_BYTES} bytes"
        )));
    }
    Ok(())
}

fn stock_response(stock: Stock) -> pb::OfferKeyPackagesResponse {
    pb::OfferKeyPackagesResponse {
        one_time: stock.one_time,
        last_resort: stock.last_resort,
        earliest_expiry_ms: u64::try_from(stock.earliest_expiry_ms).unwrap_or(0),
    }
}

/// OfferKeyPackages: the request's shape, the caller's publish rate, then each package in the
/// pool (first failure refuses the whole request), then one transaction (the cap).
pub(super) async fn offer_key_packages(
    inner: &Inner,
    request: Request<pb::OfferKeyPackagesRequest>,
) -> Result<Response<pb::OfferKeyPackagesResponse>> {
    let (metadata, extensions, request) = request.into_parts();
    let (caller, address) = own_address(inner, &metadata, &extensions, &request.identity).await?;
    if request.packages.len() > MAX_OFFER_PACKAGES {
        return Err(RelayError::InvalidArgument(format!(
            "at most {MAX_OFFER_PACKAGES} key packages per request"
        )));
    }
    if let Some(index) = request
        .packages
        .iter()
        .position(|p| p.key_package.len() > MAX_KEY_PACKAGE_BYTES)
    {
        return Err(RelayError::InvalidArgument(format!(
            "key package {index}: larger than {MAX_KEY_PACKAGE_BYTES} bytes"
        )));
    }
    inner.rate_limit(&caller)?;
    let directory = inner.log.directory();
    if request.packages.is_empty() && !request.replace {
        return Ok(Response::new(stock_response(
            directory.stock(address, now_ms()).await?,
        )));
    }
    // The cap, cheaply (a parse and a hash per package, one read): most offers past it are
    // refused before any signature is checked. The store decides again when it lists them.
    if !request.replace {
        let mut refs = Vec::new();
        for offer in &request.packages {
            match peek_key_package(&offer.key_package) {
                Some((key_package_ref, false)) if !refs.contains(&key_package_ref) => {
                    refs.push(key_package_ref);
                }
                _ => {}
            }
        }
        let (held, listed) = directory
            .listed(address.clone(), refs.clone(), now_ms())
            .await?;
        let adding = refs.len().saturating_sub(listed);
        if (held as usize).saturating_add(adding) > MAX_ONE_TIME_PACKAGES {
            return Err(full(held));
        }
    }
    let checked = {
        let (account, identity) = (address.account.clone(), address.identity.clone());
        let offers = request.packages;
        inner
            .gate
            .check(&caller.account, move || {
                offers
                    .into_iter()
                    .enumerate()
                    .map(|(index, offer)| {
                        let checked = check_key_package(
                            index,
                            &offer.key_package,
                            &identity,
                            &account,
                            &offer.binding,
                        )?;
                        Ok(NewPackage {
                            key_package_ref: checked.key_package_ref,
                            key_package: offer.key_package.to_vec(),
                            last_resort: checked.last_resort,
                            not_after_ms: checked.not_after_ms,
                        })
                    })
                    .collect::<std::result::Result<Vec<_>, PackageError>>()
            })
            .await?
    };
    let packages = checked.map_err(|e| match e {
        PackageError::Binding { .. } => RelayError::PermissionDenied(e.to_string()),
        PackageError::Invalid { .. } => RelayError::InvalidArgument(e.to_string()),
    })?;
    let offered = directory
        .offer(Offer {
            address,
            packages,
            replace: request.replace,
            max_one_time: MAX_ONE_TIME_PACKAGES,
            now_ms: now_ms(),
        })
        .await?;
    match offered {
        Offered::Listed(stock) => Ok(Response::new(stock_response(stock))),
        Offered::Full { held } => Err(full(held)),
    }
}

/// The refusal of an offer past the cap.
fn full(held: u32) -> RelayError {
    RelayError::resource_exhausted(format!(
        "this address holds {held} one-time key packages not yet claimed: at most \
         {MAX_ONE_TIME_PACKAGES} (nothing of the request was listed)"
    ))
}

/// SetInvitationPolicy: the policy's shape, the caller's publish rate, one transaction.
pub(super) async fn set_invitation_policy(
    inner: &Inner,
    request: Request<pb::SetInvitationPolicyRequest>,
) -> Result<Response<pb::SetInvitationPolicyResponse>> {
    let (metadata, extensions, request) = request.into_parts();
    let (caller, address) = own_address(inner, &metadata, &extensions, &request.identity).await?;
    let accounts = request.policy.unwrap_or_default().accounts;
    if accounts.len() > MAX_POLICY_ACCOUNTS || accounts.iter().any(|a| a.len() > MAX_ACCOUNT_BYTES)
    {
        return Err(RelayError::InvalidArgument(format!(
            "a policy names at most {MAX_POLICY_ACCOUNTS} accounts of at most \
             {MAX_ACCOUNT_BYTES} bytes each"
        )));
    }
    inner.rate_limit(&caller)?;
    inner.log.directory().set_policy(address, accounts).await?;
    Ok(Response::new(pb::SetInvitationPolicyResponse {}))
}

/// ClaimKeyPackage: shape, the caller's claim rate, its membership of the channel, the
/// address's consent (NOT_FOUND, one text), the address's claim rate, then the hand-out.
pub(super) async fn claim_key_package(
    inner: &Inner,
    request: Request<pb::ClaimKeyPackageRequest>,
) -> Result<Response<pb::ClaimKeyPackageResponse>> {
    let (metadata, extensions, request) = request.into_parts();
    let caller = inner.caller(&metadata, &extensions).await?;
    check_identity(&request.identity)?;
    if request.account.len() > MAX_ACCOUNT_BYTES {
        return Err(RelayError::InvalidArgument(format!(
            "account must be at most {MAX_ACCOUNT_BYTES} bytes"
        )));
    }
    let name = channel_name(request.channel)?;
    caller.may_name(&name)?;
    inner.claims.take_account(&caller.account)?;
    let channel = inner.channel(&caller.account, &name).await?;
    inner.require_member(&channel, &caller.account).await?;
    let address = Address {
        account: request.account,
        identity: request.identity.to_vec(),
    };
    let directory = inner.log.directory();
    let no_such_address = || RelayError::NotFound(NO_SUCH_ADDRESS.to_owned());
    if !directory
        .consents(address.clone(), caller.account.to_string(), now_ms())
        .await?
    {
        return Err(no_such_address());
    }
    inner.claims.take_address(&address)?;
    let claimed = directory
        .claim(Claim {
            address,
            claimer: caller.account.to_string(),
            channel_id: channel.id(),
            max_pending: inner.settings.directory.max_pending_invitations,
            now_ms: now_ms(),
        })
        .await?;
    match claimed {
        Claimed::Package {
            key_package,
            key_package_ref,
            last_resort,
        } => Ok(Response::new(pb::ClaimKeyPackageResponse {
            key_package: key_package.into(),
            key_package_ref: key_package_ref.into(),
            last_resort,
        })),
        Claimed::NoPackage => Err(no_such_address()),
        Claimed::TooManyPending => Err(RelayError::resource_exhausted(format!(
            "this address has {} pending invitations: it must accept or decline some first",
            inner.settings.directory.max_pending_invitations
        ))),
    }
}
