//! A channel's request/reply state in this process, which its core holds (apart from the
//! request calls in `request`, so that the core imports nothing above it).

use std::collections::HashSet;
use std::sync::atomic::AtomicI64;
use std::sync::Mutex;

use static_mls::request::RequestId;

/// See the `request` module's docs.
#[derive(Default)]
pub(crate) struct Requests {
    /// Our requests a call is waiting for.
    pub(super) busy: Mutex<HashSet<RequestId>>,
    /// The row of the last request received that this opening handed out.
    pub(super) handed: AtomicI64,
}
