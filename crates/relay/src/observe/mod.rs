//! What the relay tells its operator: it watches the serving parts and changes none of them.
//!
//! Layout: `access` is the access log and the call metrics (one record per gRPC call); `metrics`
//! is the Prometheus registry; `health` is the gRPC health service and the store's probe.

pub(crate) mod access;
pub mod health;
pub mod metrics;
