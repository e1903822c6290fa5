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
