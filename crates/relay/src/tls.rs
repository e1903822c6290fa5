//! TLS on the relay's port: the rustls server configuration (ring provider, ALPN `h2`) built
//! from a PEM certificate chain and its private key, with errors that name the file at fault.
//!
//! ring rather than aws-lc-rs: the SDK's tonic client already builds rustls on ring
//! (`tls-ring`), so the relay adds no C/assembly toolchain (aws-lc-sys wants cmake and NASM or
//! a prebuilt download) and nothing that is not already in `Cargo.lock` and the offline cache.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
pub use rustls::ServerConfig;
use thiserror::Error;

/// Why a certificate and key cannot serve TLS.
#[derive(Debug, Error)]
pub enum TlsError {
    #[error("cannot read {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{} holds no PEM certificate (-----BEGIN CERTIFICATE-----)", path.display())]
    NoCertificate { path: PathBuf },
    #[error("{} is not a valid PEM file: {detail}", path.display())]
    BadPem { path: PathBuf, detail: String },
    #[error(
        "{} holds no PEM private key (-----BEGIN PRIVATE KEY-----, RSA or EC)",
        path.display()
    )]
    NoKey { path: PathBuf },
    #[error("{} and {} cannot serve TLS together: {detail}", cert.display(), key.display())]
    Unusable {
        cert: PathBuf,
        key: PathBuf,
        detail: String,
    },
}

/// The server configuration of the PEM certificate chain at `cert` (leaf first) and the
/// private key at `key`: checked now (readable, parsable, the key is the leaf's), so that a
/// bad file is a configuration error at startup, not a failure of each handshake.
pub fn server_config(cert: &Path, key: &Path) -> Result<Arc<ServerConfig>, TlsError> {
    let read = |path: &Path| {
        std::fs::read(path).map_err(|source| TlsError::Read {
            path: path.to_owned(),
            source,
        })
    };
    let bad_pem = |path: &Path, e: rustls::pki_types::pem::Error| TlsError::BadPem {
        path: path.to_owned(),
        detail: e.to_string(),
    };
    let chain = CertificateDer::pem_slice_iter(&read(cert)?)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad_pem(cert, e))?;
    if chain.is_empty() {
        return Err(TlsError::NoCertificate {
            path: cert.to_owned(),
        });
    }
    let private_key = match PrivateKeyDer::from_pem_slice(&read(key)?) {
        Ok(private_key) => private_key,
        Err(rustls::pki_types::pem::Error::NoItemsFound) => {
            return Err(TlsError::NoKey {
                path: key.to_owned(),
            })
        }
        Err(e) => return Err(bad_pem(key, e)),
    };
    let unusable = |detail: String| TlsError::Unusable {
        cert: cert.to_owned(),
        key: key.to_owned(),
        detail,
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| unusable(e.to_string()))?
        .with_no_client_auth()
        // Also checks that the key is the leaf certificate's.
        .with_single_cert(chain, private_key)
        .map_err(|e| unusable(e.to_string()))?;
    // gRPC is HTTP/2 only: a client that offers no `h2` is refused in the handshake.
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(config))
}
