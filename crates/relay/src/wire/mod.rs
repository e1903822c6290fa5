//! What the relay reads on the wire and decides from it, pure (no I/O, no `crate::` state).
//!
//! Layout: `framing` is the cleartext header of an `MLSMessage`; `rules` are the epoch fence,
//! idempotency keys, rate limits and org keys; `fence` is a group commit's decision over plain
//! channel ids, heads and keys (the stores run it inside their transactions).

pub(crate) mod fence;
pub mod framing;
pub mod rules;
