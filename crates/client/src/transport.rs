//! The relay's gRPC client (tonic, generated from `proto/relay.proto` by `static-proto`): the
//! endpoint a URL names, the lazily connecting client, and the bound on one call.

use std::time::Duration;

use tonic::transport::{Channel, ClientTlsConfig, Endpoint};
use tonic::Status;

use crate::config::CALL_TIMEOUT;
use crate::error::Error;

pub use static_proto::pb;

pub type RelayClient = pb::relay_client::RelayClient<Channel>;

/// Largest gRPC message we send or accept: a 1 MiB MLS message plus its Welcome and framing.
pub const MAX_GRPC_MESSAGE: usize = 4 * 1024 * 1024;

pub use static_proto::{CURRENT_EPOCH_TRAILER, HORIZON_TRAILER, RETRY_AFTER_TRAILER};

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
        return Err(Error::Invalid(format!(
            "unsupported relay endpoint {url:?}: expected http://, https://, grpc:// or host:port"
        )));
    } else {
        (format!("http://{url}"), false)
    };
    let bad =
        |e: tonic::transport::Error| Error::Invalid(format!("invalid relay endpoint {url:?}: {e}"));
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
        return Err(Error::Invalid(format!(
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

/// Bounds one gRPC call: a call not answered within [`CALL_TIMEOUT`] fails as a transient
/// DEADLINE_EXCEEDED.
pub(crate) async fn bounded<T>(
    call: impl std::future::Future<Output = Result<T, Status>>,
) -> Result<T, Status> {
    match tokio::time::timeout(CALL_TIMEOUT, call).await {
        Ok(result) => result,
        Err(_) => Err(Status::deadline_exceeded(format!(
            "no answer from the relay within {CALL_TIMEOUT:?}"
        ))),
    }
}
