//! Static's pure Rust core. No Python here: `static-native` (the `python/` crate) is the thin
//! PyO3 layer over it.
//!
//! The product surface is [`Engine`]: one MLS client (an identity and its signature key) with
//! its groups, persisted under a data directory. Every method is safe to call from several
//! threads at once (`Engine: Send + Sync`); each group is guarded by its own mutex and every
//! state change is committed before the call returns (durably, or such that a crash of the
//! machine is detected and answered: see [`store`]).

#![forbid(unsafe_code)]

#[doc(hidden)]
pub mod bench_support;
pub mod channel_name;
pub mod client;
pub mod crypto;
pub mod engine;
pub mod error;
pub mod storage;
pub mod store;
pub mod transport;

pub use channel_name::{validate_channel_name, CHANNEL_NAME_FORM, MAX_CHANNEL_NAME_LENGTH};
pub use client::{
    Channel, Client, ClientOptions, Next, SendHandle, Token, TokenProvider, Waker, MAX_PAYLOAD,
};
pub use engine::{AddMemberOutput, Applied, Engine, Incoming, Member, CIPHERSUITE, PAST_EPOCHS};
pub use error::{Error, ErrorKind, Result};
pub use store::Cursor;

/// The crate version, reported by `static._native.__version__`.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
