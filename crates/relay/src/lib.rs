//! Static's relay data plane: the MLS delivery service of docs/design.md §5 (gRPC, `proto/relay.proto`)
//! in Rust, over SQLite (one relay per file) or PostgreSQL (any number of relays on one database). `static serve` runs it in its process (through
//! `static._native.relay.RelayServer`) and keeps what is not per-message in Python: token checks
//! ([`Verify`], once per call), the revocation checks (which end streams through
//! [`RelayServer::end_streams_of_key`]), migrations, configuration and signals.
//!
//! Layout: `wire` (`framing`, `rules`, `fence`: a group commit's decision) and `group` (a
//! channel's public MLS group state: handshakes checked as a member would) are pure; `clock` is unix ms;
//! `members` is who may reach a channel (bound leaves); `log` is the channel logs (memory, the
//! group-committing writer); `store` is the log's I/O over plain rows, one module per database
//! (it imports nothing above it), and the key-package directory's rows (`store/directory/`); `memory` gives freed memory back to the OS;
//! `service` is the gRPC methods over the log; `overview` is the console's reads of an account's channels and rate; `server` binds, serves and drains (`tls`
//! terminates TLS; `shutdown` is the one stop signal every part watches, in phases); `observe` (`access`: the access log, `metrics`: Prometheus,
//! `health`: the gRPC health service) watches it; `settings` is its configuration, one table of knobs; `auth` is
//! who calls and the registry of live streams (`lockout` remembers the addresses its verifier
//! locked out); `error` maps every refusal to a status once.
// Denied, not forbidden: `memory` calls glibc's malloc_trim (one audited FFI call).
#![deny(unsafe_code)]

mod audit;
pub mod auth;
mod clock;
pub mod error;
pub mod group;
mod lockout;
pub mod log;
pub mod members;
mod memory;
pub mod observe;
pub mod overview;
pub mod removal;
pub mod retention;
mod server;
mod service;
pub mod settings;
mod shutdown;
mod store;
pub mod tls;
mod verify_pool;
pub mod wire;

pub use static_proto::patterns::ChannelPatterns;
pub use static_proto::{pb, PROTO_DESCRIPTOR};

pub use auth::{Caller, Principal, Verify};
pub use error::RelayError;
pub use removal::RemovalReport;
pub use retention::{PassReport, Policy, RetentionSettings};
pub use server::RelayServer;
pub use settings::{RelayConfig, Setting, SettingError};
pub use store::Database;
// The migrations' one list, for the integration tests' databases: not part of the API.
#[doc(hidden)]
pub use store::schema;
pub use tls::TlsError;
