//! Sending: a channel's messages from the caller's payload to the relay's log, blocking or
//! pipelined.
//!
//! Layout: `encrypt` encrypts on the callers' threads; `pipeline` is the state of a channel's
//! pipelined sends, `journal` their payloads on disk until encrypted, `sender` the thread that
//! sends them; `publisher` the one task that publishes every channel's messages.

pub(crate) mod encrypt;
pub(crate) mod journal;
pub(crate) mod pipeline;
pub(crate) mod publisher;
pub(crate) mod sender;
