//! The relay's gRPC client (tonic), generated at build time from `proto/relay.proto`, and the
//! few helpers the [`crate`] needs around it: endpoint parsing, auth metadata, and the
//! mapping of gRPC statuses to the core's errors.

use std::time::Duration;

use tonic::transport::{Channel, ClientTlsConfig, Endpoint};
use tonic::{Code, Status};

use static_mls::error::Error;

pub use static_proto::pb;

pub type RelayClient = pb::relay_client::RelayClient<Channel>;

/// Largest gRPC message we send or accept: a 1 MiB MLS message plus its Welcome and framing.
pub const MAX_GRPC_MESSAGE: usize = 4 * 1024 * 1024;

pub use static_proto::{CURRENT_EPOCH_TRAILER, RETRY_AFTER_TRAILER};

/// Turns `http://h:p`, `https://h:p` (TLS), `grpc://h:p` or `h:p` into a tonic endpoint.
pub fn endpoint(url: &str) -> Result<Endpoint, Error> {
    let url = url.trim();
    let (uri, tls) = if let Some(rest) = url.strip_prefix("https://") {
        (format!("https://{rest}"), true)
    } else if let Some(rest) = url.strip_prefix("http://") {
        (format!("http://{rest}"), false)
    } else if let Some(rest) = url.strip_prefix("grpc://") {
        (format!("http://{rest}"), false)
    } else if url.contains("://") {
        return Err(Error::Transport(format!(
            "unsupported relay endpoint {url:?}: expected http://, https://, grpc:// or host:port"
        )));
    } else {
        (format!("http://{url}"), false)
    };
    let bad = |e: tonic::transport::Error| {
        Error::Transport(format!("invalid relay endpoint {url:?}: {e}"))
    };
    let mut endpoint = Endpoint::from_shared(uri.clone())
        .map_err(bad)?
        .connect_timeout(Duration::from_secs(5))
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_timeout(Duration::from_secs(10))
        .keep_alive_while_idle(true)
        .initial_stream_window_size(Some(4 * 1024 * 1024))
        .initial_connection_window_size(Some(16 * 1024 * 1024));
    if endpoint.uri().host().is_none_or(str::is_empty) {
        return Err(Error::Transport(format!(
            "invalid relay endpoint {url:?}: no host"
        )));
    }
    if tls {
        endpoint = endpoint
            .tls_config(
                ClientTlsConfig::new()
                    .with_native_roots()
                    .timeout(Duration::from_secs(5)),
            )
            .map_err(bad)?;
    }
    Ok(endpoint)
}

/// A lazily connecting client: the connection is made (and remade) on use.
pub fn connect_lazy(endpoint: &Endpoint) -> RelayClient {
    pb::relay_client::RelayClient::new(endpoint.connect_lazy())
        .max_decoding_message_size(MAX_GRPC_MESSAGE)
        .max_encoding_message_size(MAX_GRPC_MESSAGE)
}

/// Whether a failed call may succeed if simply retried (the connection or the server is
/// momentarily unavailable).
pub fn is_transient(status: &Status) -> bool {
    matches!(
        status.code(),
        Code::Unavailable
            | Code::Unknown
            | Code::Cancelled
            | Code::DeadlineExceeded
            | Code::Aborted
            | Code::Internal
    )
}

/// The channel's current epoch from a FAILED_PRECONDITION status, if present.
pub fn current_epoch(status: &Status) -> Option<u64> {
    status
        .metadata()
        .get(CURRENT_EPOCH_TRAILER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse().ok())
}

/// The wait a RESOURCE_EXHAUSTED status asks for, if present.
pub fn retry_after(status: &Status) -> Option<Duration> {
    status
        .metadata()
        .get(RETRY_AFTER_TRAILER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse().ok())
        .map(Duration::from_millis)
}

/// The core error for a final (not retried) gRPC failure.
pub fn status_error(what: &str, status: &Status) -> Error {
    let detail = format!("{what}: {} ({:?})", status.message(), status.code());
    match status.code() {
        Code::Unauthenticated | Code::PermissionDenied => Error::Auth(format!(
            "the relay refused the credentials: {}",
            status.message()
        )),
        _ => Error::Transport(detail),
    }
}
