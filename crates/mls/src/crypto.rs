//! Cheaper Ed25519 for the per-message path, same algorithms and semantics as OpenMLS's
//! defaults (`openmls_basic_credential`, `openmls_rust_crypto`):
//!
//! * [`Ed25519Signer`] keeps the parsed signing key. `SignatureKeyPair::sign` re-parses the
//!   private bytes on every signature, which recomputes the public key (a second base-point
//!   multiplication per message).
//! * [`StaticCrypto`] is `RustCrypto` with a small cache of decompressed Ed25519 public keys
//!   for signature verification (the default decompresses the sender's key per message).
//!   Verification stays `verify_strict`, with the same errors.
//!
//! Everything else delegates to `RustCrypto`.

use std::collections::HashMap;
use std::sync::Mutex;

use ed25519_dalek::Signer as _;
use openmls::prelude::tls_codec::SecretVLBytes;
use openmls_basic_credential::SignatureKeyPair;
use openmls_rust_crypto::RustCrypto;
use openmls_traits::crypto::OpenMlsCrypto;
use openmls_traits::random::OpenMlsRand;
use openmls_traits::signatures::{Signer, SignerError};
use openmls_traits::types::{
    AeadType, Ciphersuite, CryptoError, ExporterSecret, HashType, HpkeCiphertext, HpkeConfig,
    HpkeKeyPair, KemOutput, SignatureScheme,
};
use zeroize::Zeroize;

/// Our Ed25519 signature key, parsed once. Persisted as the `SignatureKeyPair` it comes from
/// (see [`Ed25519Signer::from_key_pair`]), so data directories are unchanged.
pub struct Ed25519Signer {
    key: ed25519_dalek::SigningKey,
    public: Vec<u8>,
}

#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("the signature key is not Ed25519")]
    NotEd25519,
    #[error("the stored signature key is malformed")]
    Malformed,
    #[error("the stored signature key does not match its public key")]
    Mismatch,
}

/// The serde shape of `SignatureKeyPair` (its fields are private; its serde form is its
/// storage format, so it is stable).
#[derive(serde::Deserialize)]
struct RawKeyPair {
    private: Vec<u8>,
    public: Vec<u8>,
}

impl Ed25519Signer {
    /// Parses the key of `pair`, checking that its private key yields its public key.
    pub fn from_key_pair(pair: &SignatureKeyPair) -> Result<Self, KeyError> {
        if pair.signature_scheme() != SignatureScheme::ED25519 {
            return Err(KeyError::NotEd25519);
        }
        let mut json = serde_json::to_vec(pair).map_err(|_| KeyError::Malformed)?;
        let raw = serde_json::from_slice::<RawKeyPair>(&json);
        json.zeroize();
        let mut raw = raw.map_err(|_| KeyError::Malformed)?;
        let key = ed25519_dalek::SigningKey::try_from(raw.private.as_slice());
        raw.private.zeroize();
        let key = key.map_err(|_| KeyError::Malformed)?;
        if key.verifying_key().as_bytes().as_slice() != raw.public.as_slice()
            || raw.public.as_slice() != pair.public()
        {
            return Err(KeyError::Mismatch);
        }
        Ok(Self {
            key,
            public: raw.public,
        })
    }

    /// The public key bytes (as in the credential).
    pub fn public(&self) -> &[u8] {
        &self.public
    }

    /// The Ed25519 signature of `payload` (Ed25519 signing cannot fail, unlike `Signer`'s).
    pub fn sign_bytes(&self, payload: &[u8]) -> Vec<u8> {
        self.key.sign(payload).to_bytes().to_vec()
    }
}

impl Signer for Ed25519Signer {
    fn sign(&self, payload: &[u8]) -> Result<Vec<u8>, SignerError> {
        Ok(self.sign_bytes(payload))
    }

    fn signature_scheme(&self) -> SignatureScheme {
        SignatureScheme::ED25519
    }
}

/// How many decompressed public keys [`StaticCrypto`] keeps (one per group member seen
/// recently); the cache is simply emptied when full.
const VERIFYING_KEY_CACHE: usize = 1024;

/// `RustCrypto` with cached Ed25519 verifying keys; see the module docs.
#[derive(Default)]
pub struct StaticCrypto {
    inner: RustCrypto,
    verifying_keys: Mutex<HashMap<[u8; 32], ed25519_dalek::VerifyingKey>>,
}

impl StaticCrypto {
    /// The decompressed key for `pk`, from the cache or parsed (and then cached). A key that
    /// does not decompress is never cached.
    fn verifying_key(&self, pk: &[u8]) -> Result<ed25519_dalek::VerifyingKey, CryptoError> {
        let bytes: [u8; 32] = pk.try_into().map_err(|_| CryptoError::CryptoLibraryError)?;
        let mut cache = self
            .verifying_keys
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(key) = cache.get(&bytes) {
            return Ok(*key);
        }
        let key = ed25519_dalek::VerifyingKey::from_bytes(&bytes)
            .map_err(|_| CryptoError::CryptoLibraryError)?;
        if cache.len() >= VERIFYING_KEY_CACHE {
            cache.clear();
        }
        cache.insert(bytes, key);
        Ok(key)
    }
}

impl OpenMlsCrypto for StaticCrypto {
    fn verify_signature(
        &self,
        alg: SignatureScheme,
        data: &[u8],
        pk: &[u8],
        signature: &[u8],
    ) -> Result<(), CryptoError> {
        if alg != SignatureScheme::ED25519 {
            return self.inner.verify_signature(alg, data, pk, signature);
        }
        // As RustCrypto: a bad key or signature length is CryptoLibraryError, a wrong
        // signature InvalidSignature; strict verification (no small-order R or A, canonical S).
        let key = self.verifying_key(pk)?;
        let sig: [u8; ed25519_dalek::SIGNATURE_LENGTH] = signature
            .try_into()
            .map_err(|_| CryptoError::CryptoLibraryError)?;
        key.verify_strict(data, &ed25519_dalek::Signature::from(sig))
            .map_err(|_| CryptoError::InvalidSignature)
    }

    fn supports(&self, ciphersuite: Ciphersuite) -> Result<(), CryptoError> {
        self.inner.supports(ciphersuite)
    }

    fn supported_ciphersuites(&self) -> Vec<Ciphersuite> {
        self.inner.supported_ciphersuites()
    }

    fn hkdf_extract(
        &self,
        hash_type: HashType,
        salt: &[u8],
        ikm: &[u8],
    ) -> Result<SecretVLBytes, CryptoError> {
        self.inner.hkdf_extract(hash_type, salt, ikm)
    }

    fn hmac(
        &self,
        hash_type: HashType,
        key: &[u8],
        message: &[u8],
    ) -> Result<SecretVLBytes, CryptoError> {
        self.inner.hmac(hash_type, key, message)
    }

    fn hkdf_expand(
        &self,
        hash_type: HashType,
        prk: &[u8],
        info: &[u8],
        okm_len: usize,
    ) -> Result<SecretVLBytes, CryptoError> {
        self.inner.hkdf_expand(hash_type, prk, info, okm_len)
    }

    fn hash(&self, hash_type: HashType, data: &[u8]) -> Result<Vec<u8>, CryptoError> {
        self.inner.hash(hash_type, data)
    }

    fn aead_encrypt(
        &self,
        alg: AeadType,
        key: &[u8],
        data: &[u8],
        nonce: &[u8],
        aad: &[u8],
    ) -> Result<Vec<u8>, CryptoError> {
        self.inner.aead_encrypt(alg, key, data, nonce, aad)
    }

    fn aead_decrypt(
        &self,
        alg: AeadType,
        key: &[u8],
        ct_tag: &[u8],
        nonce: &[u8],
        aad: &[u8],
    ) -> Result<Vec<u8>, CryptoError> {
        self.inner.aead_decrypt(alg, key, ct_tag, nonce, aad)
    }

    fn signature_key_gen(&self, alg: SignatureScheme) -> Result<(Vec<u8>, Vec<u8>), CryptoError> {
        self.inner.signature_key_gen(alg)
    }

    fn sign(&self, alg: SignatureScheme, data: &[u8], key: &[u8]) -> Result<Vec<u8>, CryptoError> {
        self.inner.sign(alg, data, key)
    }

    fn hpke_seal(
        &self,
        config: HpkeConfig,
        pk_r: &[u8],
        info: &[u8],
        aad: &[u8],
        ptxt: &[u8],
    ) -> Result<HpkeCiphertext, CryptoError> {
        self.inner.hpke_seal(config, pk_r, info, aad, ptxt)
    }

    fn hpke_open(
        &self,
        config: HpkeConfig,
        input: &HpkeCiphertext,
        sk_r: &[u8],
        info: &[u8],
        aad: &[u8],
    ) -> Result<Vec<u8>, CryptoError> {
        self.inner.hpke_open(config, input, sk_r, info, aad)
    }

    fn hpke_setup_sender_and_export(
        &self,
        config: HpkeConfig,
        pk_r: &[u8],
        info: &[u8],
        exporter_context: &[u8],
        exporter_length: usize,
    ) -> Result<(KemOutput, ExporterSecret), CryptoError> {
        self.inner.hpke_setup_sender_and_export(
            config,
            pk_r,
            info,
            exporter_context,
            exporter_length,
        )
    }

    fn hpke_setup_receiver_and_export(
        &self,
        config: HpkeConfig,
        enc: &[u8],
        sk_r: &[u8],
        info: &[u8],
        exporter_context: &[u8],
        exporter_length: usize,
    ) -> Result<ExporterSecret, CryptoError> {
        self.inner.hpke_setup_receiver_and_export(
            config,
            enc,
            sk_r,
            info,
            exporter_context,
            exporter_length,
        )
    }

    fn derive_hpke_keypair(
        &self,
        config: HpkeConfig,
        ikm: &[u8],
    ) -> Result<HpkeKeyPair, CryptoError> {
        self.inner.derive_hpke_keypair(config, ikm)
    }
}

impl OpenMlsRand for StaticCrypto {
    type Error = <RustCrypto as OpenMlsRand>::Error;

    fn random_array<const N: usize>(&self) -> Result<[u8; N], Self::Error> {
        self.inner.random_array()
    }

    fn random_vec(&self, len: usize) -> Result<Vec<u8>, Self::Error> {
        self.inner.random_vec(len)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn signer_matches_signature_key_pair() {
        let pair = SignatureKeyPair::new(SignatureScheme::ED25519).unwrap();
        let signer = Ed25519Signer::from_key_pair(&pair).unwrap();
        assert_eq!(signer.public(), pair.public());
        let msg = b"the same key, the same deterministic signature";
        // Ed25519 signatures are deterministic: same key, same bytes.
        assert_eq!(signer.sign(msg).unwrap(), pair.sign(msg).unwrap());
    }

    #[test]
    fn verification_matches_rust_crypto() {
        let pair = SignatureKeyPair::new(SignatureScheme::ED25519).unwrap();
        let ours = StaticCrypto::default();
        let theirs = RustCrypto::default();
        let msg = b"payload";
        let sig = pair.sign(msg).unwrap();
        let alg = SignatureScheme::ED25519;
        for _ in 0..2 {
            // Second round: from the cache.
            assert_eq!(
                ours.verify_signature(alg, msg, pair.public(), &sig),
                theirs.verify_signature(alg, msg, pair.public(), &sig)
            );
            let mut bad = sig.clone();
            bad[3] ^= 1;
            assert_eq!(
                ours.verify_signature(alg, msg, pair.public(), &bad),
                theirs.verify_signature(alg, msg, pair.public(), &bad)
            );
            assert_eq!(
                ours.verify_signature(alg, b"other", pair.public(), &sig),
                theirs.verify_signature(alg, b"other", pair.public(), &sig)
            );
            assert_eq!(
                ours.verify_signature(alg, msg, pair.public(), &sig[..63]),
                theirs.verify_signature(alg, msg, pair.public(), &sig[..63])
            );
            assert_eq!(
                ours.verify_signature(alg, msg, &pair.public()[..31], &sig),
                theirs.verify_signature(alg, msg, &pair.public()[..31], &sig)
            );
        }
        // A small-order public key (the identity point): refused by strict verification.
        let mut identity = [0u8; 32];
        identity[0] = 1;
        assert_eq!(
            ours.verify_signature(alg, msg, &identity, &sig),
            theirs.verify_signature(alg, msg, &identity, &sig)
        );
        assert!(ours.verify_signature(alg, msg, &identity, &sig).is_err());
    }
}
