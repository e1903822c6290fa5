//! Talking to the relay: its gRPC client, its tokens, what its refusals mean, and when to try
//! again after one.
//!
//! Layout: `transport` is the gRPC client and the bound on one call; `tokens` where relay
//! tokens come from and the cached one; `refusal` the relay's "no", classified once; `retry`
//! the one retry policy after a refusal.

pub(crate) mod refusal;
pub(crate) mod retry;
pub(crate) mod tokens;
pub mod transport;
