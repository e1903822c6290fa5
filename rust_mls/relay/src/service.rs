//! The Relay service: the six RPCs of `proto/relay.proto` over the channel log.
//! A port of `static/relay/_service.py` (same checks, same status codes and texts).
//!
//! STUB (to be written).
