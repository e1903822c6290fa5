//! A key package offered to the directory, checked as a joiner's package would be (RFC 9420
//! §10.1) plus its binding to the offering account: pure CPU (three signature checks, one hash),
//! run in the verify pool by `service/directory.rs`.

use openmls::prelude::tls_codec::Deserialize as _;
use openmls::prelude::{MlsMessageBodyIn, MlsMessageIn, ProtocolVersion};
use static_mls::binding::verify_key_package_binding;
use static_mls::engine::key_package_encryption_key;
use static_mls::CIPHERSUITE;

use super::crypto;

/// What the directory keeps of a package that passed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckedPackage {
    /// Its KeyPackageRef (RFC 9420 §5.2).
    pub key_package_ref: Vec<u8>,
    pub last_resort: bool,
    /// The end of its lifetime, unix ms.
    pub not_after_ms: i64,
}

/// Why a package was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PackageError {
    /// Not a valid key package for this relay: INVALID_ARGUMENT.
    #[error("key package {index}: {reason}")]
    Invalid { index: usize, reason: String },
    /// Its binding does not verify for the caller's account: PERMISSION_DENIED.
    #[error(
        "key package {index}: its binding does not verify for this account and identity (a \
         KeyPackageBinding signed by the package's leaf signature key)"
    )]
    Binding { index: usize },
}

/// The KeyPackageRef and last-resort mark of a package, read without checking it (a parse and
/// one hash: the cheap look before the stock is counted). None: not an MLSMessage(key_package)
/// (the check says why).
pub fn peek_key_package(bytes: &[u8]) -> Option<(Vec<u8>, bool)> {
    let message = MlsMessageIn::tls_deserialize_exact(bytes).ok()?;
    let MlsMessageBodyIn::KeyPackage(package) = message.extract() else {
        return None;
    };
    let package = package.into_unchecked();
    let key_package_ref = package.hash_ref(crypto()).ok()?;
    Some((key_package_ref.as_slice().to_vec(), package.last_resort()))
}

/// Checks the package at `index` of a request: an MLSMessage(key_package) that validates
/// (signatures, lifetime, capabilities), of the relay's cipher suite, whose credential is
/// `identity`, bound to `account` by `binding`.
pub fn check_key_package(
    index: usize,
    bytes: &[u8],
    identity: &[u8],
    account: &str,
    binding: &[u8],
) -> Result<CheckedPackage, PackageError> {
    let invalid = |reason: String| PackageError::Invalid { index, reason };
    let message = MlsMessageIn::tls_deserialize_exact(bytes)
        .map_err(|e| invalid(format!("not a TLS-serialized MLSMessage: {e}")))?;
    let MlsMessageBodyIn::KeyPackage(package) = message.extract() else {
        return Err(invalid("not an MLSMessage(key_package)".to_owned()));
    };
    let package = package
        .validate(crypto(), ProtocolVersion::Mls10)
        .map_err(|e| invalid(format!("does not validate: {e}")))?;
    if package.ciphersuite() != CIPHERSUITE {
        return Err(invalid(format!(
            "cipher suite {:?}, the relay's is {CIPHERSUITE:?}",
            package.ciphersuite()
        )));
    }
    let leaf = package.leaf_node();
    if leaf.credential().serialized_content() != identity {
        return Err(invalid(
            "its credential's identity is not the request's identity".to_owned(),
        ));
    }
    let key = key_package_encryption_key(&package)
        .map_err(|e| invalid(format!("no encryption key: {e}")))?;
    if !verify_key_package_binding(
        leaf.signature_key().as_slice(),
        identity,
        account,
        &key,
        binding,
    ) {
        return Err(PackageError::Binding { index });
    }
    let key_package_ref = package
        .hash_ref(crypto())
        .map_err(|e| invalid(format!("no KeyPackageRef: {e}")))?;
    let not_after_ms = package
        .life_time()
        .not_after()
        .saturating_mul(1000)
        .min(i64::MAX as u64);
    Ok(CheckedPackage {
        key_package_ref: key_package_ref.as_slice().to_vec(),
        last_resort: package.last_resort(),
        not_after_ms: i64::try_from(not_after_ms).unwrap_or(i64::MAX),
    })
}
