//! Receiving: a channel's log from the relay's subscription to the messages its readers take.
//!
//! Layout: `subscriber` follows every channel's log on a few shared streams; `reader` is a
//! channel's follower of what they bring, `own` our own messages it passes over, `entry` one
//! entry of a log; `applier` the threads that apply entries in order; `inbox` what readers
//! take.

pub(crate) mod applier;
pub(crate) mod entry;
pub(crate) mod inbox;
pub(crate) mod own;
pub(crate) mod reader;
pub(crate) mod subscriber;
