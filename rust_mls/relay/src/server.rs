//! `RelayServer`: bind (the configured host only, no SO_REUSEPORT), serve, drain.
//!
//! STUB (interface fixed; bodies to be written).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::auth::Verify;
use crate::error::Result;

/// The relay's knobs (`static/_settings.py::RelaySettings`, same defaults).
#[derive(Debug, Clone)]
pub struct RelayConfig {
    pub host: String,
    /// 0 picks a free port.
    pub port: u16,
    pub db_path: PathBuf,
    pub allow_anonymous: bool,
    pub max_message_bytes: usize,
    pub graceful_timeout: Duration,
    pub application_window: u64,
    pub keepalive_interval: Duration,
    pub max_streams_per_connection: u32,
    pub reset_burst: u32,
    pub reset_rate_per_second: f64,
    /// 0 = no limit.
    pub publish_rate_per_agent: f64,
}

/// A running relay. Dropping it without [`RelayServer::shutdown`] aborts it.
pub struct RelayServer {
    _private: (),
}

impl RelayServer {
    /// Open the log, bind and start serving on the current tokio runtime.
    pub async fn start(
        config: RelayConfig,
        verifier: Option<Arc<dyn Verify>>,
    ) -> Result<RelayServer> {
        let _ = (config, verifier);
        todo!()
    }

    pub fn local_addr(&self) -> SocketAddr {
        todo!()
    }

    /// The API keys behind live streams (for the revocation checks).
    pub fn live_keys(&self) -> Vec<String> {
        todo!()
    }

    /// End every live stream of `key_id` with UNAUTHENTICATED `reason`; how many there were.
    pub fn end_streams_of_key(&self, key_id: &str, reason: &str) -> usize {
        let _ = (key_id, reason);
        todo!()
    }

    /// Graceful stop: stop accepting, end live subscriptions with UNAVAILABLE "relay is
    /// shutting down", let in-flight calls finish within `graceful_timeout`, close every
    /// connection, commit what was submitted, close the store.
    pub async fn shutdown(self) {
        todo!()
    }
}
