//! The client's settings and limits, each defined once: what callers may set
//! ([`ClientOptions`]) and the fixed bounds the parts share.

use std::path::PathBuf;
use std::time::Duration;

/// Largest payload [`Channel::send`](crate::Channel::send) accepts: the relay's 1 MiB message
/// limit less room for the MLS framing, signature and AEAD tag.
pub const MAX_PAYLOAD: usize = 1024 * 1024 - 4 * 1024;

/// How long a call keeps retrying a relay that answered before and is now unreachable (it
/// restarts, the network dropped) before it fails.
const RETRY_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a call keeps trying a relay that never answered this client (nothing listens
/// there, a wrong port) before it fails.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

/// How long a call waits for the channel's background processing to reach a point.
pub(crate) const PROGRESS_TIMEOUT: Duration = Duration::from_secs(30);
/// How long one call may take to be answered (a relay that accepts connections but never
/// answers, or a TLS handshake that never completes, must not hang a caller).
pub(crate) const CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// Entries per Subscribe response we ask the relay for (it sends what is available at once).
pub(crate) const SUBSCRIBE_BATCH: u32 = 256;
/// A subscription that shows nothing (not even a keep-alive) for this long is considered
/// dead: three of the relay's default keep-alive intervals (2 s).
pub(crate) const SILENCE: Duration = Duration::from_secs(6);
/// Attempts at getting a commit accepted when other members keep winning the epoch.
pub(crate) const COMMIT_ATTEMPTS: usize = 16;
/// Times a message is encrypted again for a stale epoch before its send fails.
pub(crate) const REENCRYPTIONS: usize = 3;

/// How patient a [`Client`](crate::Client) is with its relay, and whom its TLS trusts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientOptions {
    /// How long calls try to reach a relay that never answered this client.
    pub connect_timeout: Duration,
    /// How long calls retry a relay that answered before.
    pub retry_timeout: Duration,
    /// PEM CA certificates an `https://` relay's certificate must chain to (a private CA);
    /// None trusts the system's roots. Not read from the environment here: the Python layer
    /// resolves `STATIC_CA_FILE`, as it also makes the HTTP API's calls with it.
    pub ca_file: Option<PathBuf>,
}

impl Default for ClientOptions {
    fn default() -> Self {
        Self {
            connect_timeout: CONNECT_TIMEOUT,
            retry_timeout: RETRY_TIMEOUT,
            ca_file: None,
        }
    }
}

impl ClientOptions {
    /// The defaults, overridden by the environment variables `STATIC_SDK_CONNECT_TIMEOUT` and
    /// `STATIC_SDK_RETRY_TIMEOUT` (seconds) where they hold a number >= 0.
    pub fn from_env() -> Self {
        let seconds = |name: &str| {
            std::env::var(name)
                .ok()
                .and_then(|v| v.trim().parse::<f64>().ok())
                .filter(|v| v.is_finite() && *v >= 0.0)
                .map(|v| Duration::from_secs_f64(v.min(1e9)))
        };
        let defaults = Self::default();
        Self {
            connect_timeout: seconds("STATIC_SDK_CONNECT_TIMEOUT")
                .unwrap_or(defaults.connect_timeout),
            retry_timeout: seconds("STATIC_SDK_RETRY_TIMEOUT").unwrap_or(defaults.retry_timeout),
            ca_file: defaults.ca_file,
        }
    }
}
