//! The relay's gRPC client (tonic, generated from `proto/relay.proto` by `static-proto`): the
//! endpoint a URL names (with the roots its TLS trusts), the lazily connecting client and the
//! health client on its connection, what a TLS failure means, and the bound on one call.

use std::path::Path;
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};
use tonic::Status;

use crate::config::CALL_TIMEOUT;
use crate::error::Error;

pub use static_proto::pb;

pub type RelayClient = pb::relay_client::RelayClient<Channel>;

/// The relay's standard gRPC health service (`grpc.health.v1.Health`, no token needed), which
/// the first contact asks (see `Shared::reach`): an answer that is never a refusal, so a client
/// start leaves no refused call in the relay's access log and refusal metrics.
pub type HealthClient = tonic_health::pb::health_client::HealthClient<Channel>;

pub use tonic_health::pb::HealthCheckRequest;

/// Largest gRPC message we send or accept: a 1 MiB MLS message plus its Welcome and framing.
pub const MAX_GRPC_MESSAGE: usize = 4 * 1024 * 1024;

pub use static_proto::{CURRENT_EPOCH_TRAILER, HORIZON_TRAILER, RETRY_AFTER_TRAILER};

/// Turns `http://h:p`, `https://h:p` (TLS), `grpc://h:p` or `h:p` into a tonic endpoint. TLS
/// trusts the PEM certificates in `ca_file` when given (a private CA), else the system's roots.
pub fn endpoint(url: &str, ca_file: Option<&Path>) -> Result<Endpoint, Error> {
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
        let config = ClientTlsConfig::new().timeout(Duration::from_secs(5));
        let config = match ca_file {
            Some(path) => config.ca_certificate(read_ca_file(path)?),
            None => config.with_native_roots(),
        };
        endpoint = endpoint.tls_config(config).map_err(bad)?;
    }
    Ok(endpoint)
}

/// The CA certificates in the PEM file at `path`, checked now: a file that is missing or holds
/// no certificate fails here, by name, not as every handshake's "not trusted".
fn read_ca_file(path: &Path) -> Result<Certificate, Error> {
    let invalid = |why: String| Error::Invalid(format!("ca_file {}: {why}", path.display()));
    let pem = std::fs::read(path).map_err(|e| invalid(format!("cannot read it: {e}")))?;
    let certificates = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| invalid(format!("not a PEM file: {e}")))?;
    if certificates.is_empty() {
        return Err(invalid(
            "holds no PEM certificate (-----BEGIN CERTIFICATE-----)".into(),
        ));
    }
    Ok(Certificate::from_pem(pem))
}

/// What went wrong in the TLS handshake behind `status`, said for a person, when that is why
/// the call failed: a certificate not trusted, or a server that does not speak TLS. Retrying
/// cannot help, so such a failure is final (`Refusal::from_status`).
pub(crate) fn tls_failure(status: &Status) -> Option<String> {
    let mut source = std::error::Error::source(status);
    while let Some(e) = source {
        // tokio-rustls reports rustls's error inside an io::Error, whose `source` skips it.
        let tls = e.downcast_ref::<rustls::Error>().or_else(|| {
            e.downcast_ref::<std::io::Error>()
                .and_then(std::io::Error::get_ref)
                .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        });
        if let Some(tls) = tls {
            return Some(match tls {
                rustls::Error::InvalidCertificate(why) if served_a_ca(why) => {
                    "the relay's TLS certificate is a CA certificate (CaUsedAsEndEntity): a \
                     self-signed certificate made by `openssl req -x509` is a CA, and a relay \
                     must serve a leaf certificate signed by a CA. Make a CA and a leaf signed \
                     by it (README, \"TLS with a private CA\"), serve the leaf with \
                     --tls-cert/--tls-key, and pass the CA's certificate as ca_file= (or \
                     STATIC_CA_FILE)"
                        .to_owned()
                }
                rustls::Error::InvalidCertificate(why) => format!(
                    "the relay's TLS certificate was not trusted ({why}); for a private CA, \
                     pass its certificate as ca_file= (or STATIC_CA_FILE)"
                ),
                other => format!(
                    "the TLS handshake with the relay failed ({other}); is the relay serving \
                     TLS there? (use http:// or grpc:// for a plaintext relay)"
                ),
            });
        }
        source = e.source();
    }
    None
}

/// Whether the relay's certificate was refused for being a CA's (basicConstraints CA:TRUE),
/// the usual self-signed certificate of a first private-CA setup: its fix is not "pass
/// ca_file", which the user has already done.
fn served_a_ca(why: &rustls::CertificateError) -> bool {
    matches!(why, rustls::CertificateError::Other(other)
        if matches!(other.0.downcast_ref::<webpki::Error>(), Some(webpki::Error::CaUsedAsEndEntity)))
}

/// A lazily connecting client, and the health client on the same connection: the connection
/// is made (and remade) on use.
pub fn connect_lazy(endpoint: &Endpoint) -> (RelayClient, HealthClient) {
    let channel = endpoint.connect_lazy();
    let relay = pb::relay_client::RelayClient::new(channel.clone())
        .max_decoding_message_size(MAX_GRPC_MESSAGE)
        .max_encoding_message_size(MAX_GRPC_MESSAGE);
    (relay, HealthClient::new(channel))
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
