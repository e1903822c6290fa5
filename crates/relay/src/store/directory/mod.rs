//! The key-package directory and invitations' rows (migration 0010, docs/design.md §5.5): the
//! types the service and the stores share, and the [`Directory`] trait each database
//! implements ([`sqlite`], [`postgres`]). Every call is one short transaction on a connection
//! of the directory's own (not the log's writer: no publish waits for it).

pub(crate) mod postgres;
pub(crate) mod sqlite;

use crate::store::StoreFuture;

/// An address: the account its calls act for, and an identity (a credential's content).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Address {
    pub account: String,
    pub identity: Vec<u8>,
}

/// A package to list, checked.
#[derive(Debug, Clone)]
pub(crate) struct NewPackage {
    pub key_package_ref: Vec<u8>,
    pub key_package: Vec<u8>,
    pub last_resort: bool,
    /// The end of its lifetime, unix ms.
    pub not_after_ms: i64,
}

/// An OfferKeyPackages call as the store runs it.
#[derive(Debug, Clone)]
pub(crate) struct Offer {
    pub address: Address,
    pub packages: Vec<NewPackage>,
    pub replace: bool,
    /// One-time packages the address may hold unclaimed.
    pub max_one_time: usize,
    pub now_ms: i64,
}

/// An address's packages, listed, unclaimed and unexpired.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Stock {
    pub one_time: u32,
    pub last_resort: bool,
    /// The earliest end of their lifetimes (unix ms), 0 when none is listed.
    pub earliest_expiry_ms: i64,
}

/// What an offer came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Offered {
    /// Listed (or already listed); the stock after it.
    Listed(Stock),
    /// Nothing listed: the one-time packages would pass the cap (`held` listed already).
    Full { held: u32 },
}

/// A ClaimKeyPackage call as the store runs it (its consent and rates checked).
#[derive(Debug, Clone)]
pub(crate) struct Claim {
    pub address: Address,
    pub claimer: String,
    pub channel_id: i64,
    pub max_pending: usize,
    pub now_ms: i64,
}

/// What a claim came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Claimed {
    Package {
        key_package: Vec<u8>,
        key_package_ref: Vec<u8>,
        last_resort: bool,
    },
    /// No package left (another claim took the last one meanwhile).
    NoPackage,
    /// The address has `max_pending` pending invitations.
    TooManyPending,
}

/// An Invite call as the store runs it (the caller's membership and leaf checked).
#[derive(Debug, Clone)]
pub(crate) struct NewInvitation {
    pub channel_id: i64,
    pub channel: String,
    pub key_package_ref: Vec<u8>,
    pub inviter_account: String,
    pub inviter_identity: Vec<u8>,
    /// How long the relay keeps a Welcome (None: until used).
    pub welcome_ttl_ms: Option<i64>,
    pub now_ms: i64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Invited {
    /// The invitation's id, and the invitee (whose held ListInvitations calls are woken).
    Recorded(i64, Address),
    /// The caller's account made no claim of the ref for the channel.
    NoClaim,
    /// No Welcome of the channel names the ref.
    NoWelcome,
}

/// A pending invitation as ListInvitations answers it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct InvitationRow {
    pub id: i64,
    pub channel: String,
    pub inviter_identity: Vec<u8>,
    pub inviter_account: String,
    pub created_at_ms: i64,
    /// None: its Welcome is kept until used.
    pub expires_at_ms: Option<i64>,
    pub last_resort: bool,
}

/// A pending invitation's Welcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct OpenedInvitation {
    pub channel: String,
    pub welcome: Vec<u8>,
    pub epoch: u64,
}

/// What the pruner deletes in one call, at most `limit` rows of each table.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DirectoryPrune {
    pub now_ms: i64,
    /// Claims made before this go (an Invite follows its claim within it).
    pub claims_before_ms: i64,
    /// Invitations settled before this go.
    pub settled_before_ms: i64,
    pub limit: usize,
}

/// The directory's rows, on one database.
pub(crate) trait Directory: Send + Sync {
    /// Lists `offer`'s packages (see [`Offered`]), in one transaction that no other offer of
    /// the address interleaves with (the cap is exact under concurrent offers).
    fn offer(&self, offer: Offer) -> StoreFuture<Offered>;
    /// The address's one-time packages listed unclaimed, and how many of `refs` are listed
    /// already (claimed or not): the cheap look at the cap before packages are checked.
    fn listed(
        &self,
        address: Address,
        refs: Vec<Vec<u8>>,
        now_ms: i64,
    ) -> StoreFuture<(u32, usize)>;
    /// The address's stock.
    fn stock(&self, address: Address, now_ms: i64) -> StoreFuture<Stock>;
    /// Replaces the address's policy with `allowed`.
    fn set_policy(&self, address: Address, allowed: Vec<String>) -> StoreFuture<()>;
    /// Whether `claimer` may claim a package of the address and one is listed.
    fn consents(&self, address: Address, claimer: String, now_ms: i64) -> StoreFuture<bool>;
    /// Hands out a package (the oldest one-time one, exactly once across relays; else the
    /// last-resort one) and records the claim.
    fn claim(&self, claim: Claim) -> StoreFuture<Claimed>;
    /// Records an invitation (idempotent: the same ref and channel answer the same id).
    fn invite(&self, invitation: NewInvitation) -> StoreFuture<Invited>;
    /// Up to `limit` pending, unexpired invitations of the address after `after_id`.
    fn invitations(
        &self,
        address: Address,
        after_id: i64,
        limit: usize,
        now_ms: i64,
    ) -> StoreFuture<Vec<InvitationRow>>;
    /// The Welcome of a pending invitation of the address.
    fn open_invitation(
        &self,
        address: Address,
        id: i64,
        now_ms: i64,
    ) -> StoreFuture<Option<OpenedInvitation>>;
    /// Accepts or declines a pending invitation of the address: false when it has none of
    /// that id (one settled already is true again).
    fn settle(&self, address: Address, id: i64, accept: bool, now_ms: i64) -> StoreFuture<bool>;
    /// One bounded prune: how many rows went.
    fn prune(&self, prune: DirectoryPrune) -> StoreFuture<usize>;
}

/// An invitation's states in the store.
pub(crate) const ACCEPTED: i16 = 1;
pub(crate) const DECLINED: i16 = 2;

/// A u64 id or count as the store's integers (saturating).
pub(crate) fn to_db(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

/// The stock from STOCK's rows: (last_resort, count, min(not_after)).
pub(crate) fn stock_of(rows: impl IntoIterator<Item = (bool, i64, Option<i64>)>) -> Stock {
    let mut stock = Stock::default();
    let mut earliest = i64::MAX;
    for (last_resort, count, not_after) in rows {
        if last_resort {
            stock.last_resort = count > 0;
        } else {
            stock.one_time = u32::try_from(count).unwrap_or(u32::MAX);
        }
        if let Some(not_after) = not_after {
            earliest = earliest.min(not_after);
        }
    }
    stock.earliest_expiry_ms = if earliest == i64::MAX { 0 } else { earliest };
    stock
}
