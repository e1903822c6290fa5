//! The relay's health: the standard gRPC health service (`grpc.health.v1.Health`, from
//! `tonic-health`) on the relay port, reachable without a token, and the same status for the
//! HTTP port's `/readyz` ([`Health::status`]).
//!
//! SERVING while the log's store can write (a probe every `--relay-health-interval`: one small
//! write transaction of the writer, `relay_health`), NOT_SERVING once a probe failed or the
//! relay drains. A health call only reads the last status: a flood of them costs no store work.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tonic_health::pb::health_server::HealthServer;
use tonic_health::server::{HealthReporter, HealthService};
use tonic_health::ServingStatus;

use crate::log::ChannelLog;
use crate::shutdown::{Phase, Watch};
// A Check may name the relay's service, or "" (the server as a whole).
use crate::pb::relay_server::SERVICE_NAME as RELAY_SERVICE;

/// The relay's health status and the gRPC service that reports it.
pub(crate) struct Health {
    reporter: HealthReporter,
    service: HealthServer<HealthService>,
    /// None when serving, else why not.
    not_ready: Mutex<Option<String>>,
    /// Set once the relay drains: probes no longer change the status.
    draining: AtomicBool,
}

impl Health {
    /// NOT_SERVING ("starting") until the first probe.
    pub(crate) async fn new() -> Arc<Health> {
        let reporter = HealthReporter::new();
        let service = HealthServer::new(HealthService::from_health_reporter(reporter.clone()));
        let health = Arc::new(Health {
            reporter,
            service,
            not_ready: Mutex::new(None),
            draining: AtomicBool::new(false),
        });
        health.set(Some("starting".to_owned())).await;
        health
    }

    /// The gRPC service (cheap to clone).
    pub(crate) fn service(&self) -> HealthServer<HealthService> {
        self.service.clone()
    }

    /// Ok when serving, else why not.
    pub fn status(&self) -> Result<(), String> {
        match &*self.lock() {
            None => Ok(()),
            Some(reason) => Err(reason.clone()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<String>> {
        self.not_ready
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    async fn set(&self, not_ready: Option<String>) {
        let status = if not_ready.is_none() {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        };
        *self.lock() = not_ready;
        for name in ["", RELAY_SERVICE] {
            self.reporter.set_service_status(name, status).await;
        }
    }

    /// One probe of the store; the status follows it. A change is logged once.
    pub(crate) async fn probe(&self, log: &ChannelLog) {
        let outcome = log.probe().await;
        if self.draining.load(Ordering::Acquire) {
            return;
        }
        let was = self.status();
        match (&was, outcome) {
            (Err(_), Ok(())) => {
                ::log::info!(target: "static.relay", "relay store writable: SERVING");
                self.set(None).await;
            }
            (_, Err(e)) => {
                let reason = format!("relay store cannot write: {e}");
                if was.as_ref().err() != Some(&reason) {
                    ::log::error!(target: "static.relay", "store failure: {reason}: NOT_SERVING");
                }
                self.set(Some(reason)).await;
            }
            (Ok(()), Ok(())) => {}
        }
    }

    /// NOT_SERVING for good: the relay drains.
    pub(crate) async fn drain(&self) {
        self.draining.store(true, Ordering::Release);
        self.set(Some(crate::error::SHUTTING_DOWN.to_owned())).await;
    }
}

/// Probes every `interval` until the relay stops.
pub(crate) async fn run(health: Arc<Health>, log: ChannelLog, interval: Duration, mut stop: Watch) {
    loop {
        tokio::select! {
            () = stop.reached(Phase::Stopped) => return,
            () = tokio::time::sleep(interval) => {}
        };
        health.probe(&log).await;
    }
}
