//! The relay protocol, `proto/relay.proto` compiled once: the SDK's client (`static-client`) and
//! the relay (`static-relay`) use these types; [`PROTO_DESCRIPTOR`] is the compiled descriptor.
//! The constants here are the ones both sides must agree on.

#![forbid(unsafe_code)]

/// The generated protobuf messages, tonic client and server of `static.relay.v1`.
#[allow(clippy::all, clippy::pedantic, clippy::unwrap_used, missing_docs)]
pub mod pb {
    // The package name `static.relay.v1` makes prost name the file `r#static.relay.v1.rs`,
    // which `tonic::include_proto!` cannot spell.
    include!(concat!(env!("OUT_DIR"), "/r#static.relay.v1.rs"));
}

/// `proto/relay.proto` compiled: a serialized `google.protobuf.FileDescriptorSet`.
pub const PROTO_DESCRIPTOR: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/relay.bin"));

/// Trailer carrying the channel's current epoch on FAILED_PRECONDITION (decimal ASCII).
pub const CURRENT_EPOCH_TRAILER: &str = "static-current-epoch";
/// Trailer carrying the wait before a retry on RESOURCE_EXHAUSTED by the publish rate limit
/// (milliseconds, decimal ASCII).
pub const RETRY_AFTER_TRAILER: &str = "static-retry-after-ms";
/// Trailer carrying a channel's horizon (the last seq its retention pruned) on OUT_OF_RANGE
/// (decimal ASCII).
pub const HORIZON_TRAILER: &str = "static-horizon-seq";

pub mod patterns;

/// Items of one `PublishBatchRequest` at most: the relay refuses a larger batch with
/// INVALID_ARGUMENT, so the client never sends one.
pub const MAX_BATCH_ITEMS: usize = 1024;

/// The content types of a log entry (`Entry.content_type`), RFC 9420's numbers: the relay
/// writes them, the client tells its messages from handshakes by them.
pub mod content_type {
    /// An application message.
    pub const APPLICATION: u32 = 1;
    /// A proposal.
    pub const PROPOSAL: u32 = 2;
    /// A commit.
    pub const COMMIT: u32 = 3;
}

/// The key-package directory and invitations (`OfferKeyPackages` .. `SettleInvitation`): the
/// limits the relay enforces, which the SDK keeps within.
pub mod directory {
    /// Packages one `OfferKeyPackagesRequest` carries at most.
    pub const MAX_OFFER_PACKAGES: usize = 64;
    /// One-time packages an address may have listed and not claimed.
    pub const MAX_ONE_TIME_PACKAGES: usize = 64;
    /// Bytes of one offered key package at most.
    pub const MAX_KEY_PACKAGE_BYTES: usize = 16 * 1024;
    /// Bytes of an address's identity (1 at least).
    pub const MAX_IDENTITY_BYTES: usize = 255;
    /// Accounts one `InvitationPolicy` names at most, and the bytes of each.
    pub const MAX_POLICY_ACCOUNTS: usize = 100;
    /// Bytes of an account id in a policy or an address.
    pub const MAX_ACCOUNT_BYTES: usize = 64;
    /// The policy entry that lets any account claim.
    pub const ANY_ACCOUNT: &str = "*";
    /// The longest `ListInvitations` holds a call that found nothing (its `wait_ms` is cut to
    /// it), in milliseconds.
    pub const MAX_LIST_WAIT_MS: u32 = 20_000;
    /// Invitations `ListInvitations` returns at most per call.
    pub const MAX_LISTED_INVITATIONS: usize = 100;
    /// The text of NOT_FOUND from `ClaimKeyPackage`: one answer for an unknown address, an
    /// address without packages and one whose policy refuses the caller (no enumeration).
    pub const NO_SUCH_ADDRESS: &str =
        "no such address, or it does not accept invitations from this account";
    /// The printed form of an address: `static:<account>:<base64url identity, unpadded>`.
    pub const ADDRESS_SCHEME: &str = "static";
}
