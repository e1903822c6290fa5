//! Measurement helpers shared by `cargo bench` and `bench/mls_core.py` (through
//! `static._native.bench`), so Rust and Python figures come from the same code and run.
//! Not part of the product API.

use std::time::Instant;

use openmls::prelude::tls_codec::Serialize as _;
use openmls::prelude::*;
use openmls_basic_credential::SignatureKeyPair;
use openmls_rust_crypto::RustCrypto;
use openmls_sqlite_storage::SqliteStorageProvider;
use openmls_traits::crypto::OpenMlsCrypto;
use openmls_traits::signatures::Signer;
use rusqlite::Connection;

use crate::crypto::{Ed25519Signer, StaticCrypto};
use crate::engine::Engine;
use crate::error::{Error, InternalError, Result};
use crate::store::{JsonCodec, Provider};
use crate::suite::CIPHERSUITE;

fn internal(e: impl std::fmt::Debug) -> Error {
    InternalError::Bench {
        detail: format!("{e:?}"),
    }
    .into()
}

/// Makes `channel` a two-member group: `creator` creates it and adds `joiner`, who joins from
/// the Welcome. Shared by the benchmarks and the crash tests' child processes.
pub fn two_member_group(creator: &Engine, joiner: &Engine, channel: &str) -> Result<()> {
    creator.create_group(channel)?;
    let out = creator.add_member(channel, &joiner.generate_key_package()?)?;
    creator.merge_pending_commit(channel)?;
    joiner.join_group(channel, &out.welcome)?;
    Ok(())
}

/// `n` key packages of distinct throwaway identities (`member-<i>`), as `MLSMessage` bytes,
/// for building large groups. Their private keys live in an in-memory store and are dropped.
pub fn synthetic_key_packages(n: usize) -> Result<Vec<Vec<u8>>> {
    let mut conn = Connection::open_in_memory().map_err(internal)?;
    SqliteStorageProvider::<JsonCodec, &mut Connection>::new(&mut conn)
        .run_migrations()
        .map_err(internal)?;
    let crypto = RustCrypto::default();
    let provider = Provider::new(&crypto, &conn);
    (0..n)
        .map(|i| {
            let signer =
                SignatureKeyPair::new(CIPHERSUITE.signature_algorithm()).map_err(internal)?;
            let cred = CredentialWithKey {
                credential: BasicCredential::new(format!("member-{i}").into_bytes()).into(),
                signature_key: signer.public().into(),
            };
            let bundle = KeyPackage::builder()
                .build(CIPHERSUITE, &provider, &signer, cred)
                .map_err(internal)?;
            MlsMessageOut::from(bundle.key_package().clone())
                .tls_serialize_detached()
                .map_err(internal)
        })
        .collect()
}

/// Mean nanoseconds per call of `f` over `iterations` calls.
pub fn time_ns(iterations: u32, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    let start = Instant::now();
    for _ in 0..iterations {
        f()?;
    }
    Ok(start.elapsed().as_nanos() as f64 / f64::from(iterations.max(1)))
}

/// The floor: one Ed25519 signature plus one verification of a `payload_len`-byte message,
/// in nanoseconds.
pub fn ed25519_sign_verify_ns(payload_len: usize, iterations: u32) -> Result<f64> {
    let signer = SignatureKeyPair::new(SignatureScheme::ED25519).map_err(internal)?;
    let public = signer.public();
    sign_verify_ns(
        &RustCrypto::default(),
        &signer,
        public,
        payload_len,
        iterations,
    )
}

/// The floor of the engine's own Ed25519 (key parsed once, verifying key cached, strict
/// verification): one signature plus one verification of a `payload_len`-byte message, in
/// nanoseconds.
pub fn ed25519_engine_sign_verify_ns(payload_len: usize, iterations: u32) -> Result<f64> {
    let pair = SignatureKeyPair::new(SignatureScheme::ED25519).map_err(internal)?;
    let signer = Ed25519Signer::from_key_pair(&pair).map_err(internal)?;
    let public = signer.public();
    sign_verify_ns(
        &StaticCrypto::default(),
        &signer,
        public,
        payload_len,
        iterations,
    )
}

/// One signature by `signer` plus one verification by `crypto` of a `payload_len`-byte
/// message, in nanoseconds.
fn sign_verify_ns(
    crypto: &impl OpenMlsCrypto,
    signer: &impl Signer,
    public: &[u8],
    payload_len: usize,
    iterations: u32,
) -> Result<f64> {
    let payload = vec![0x5au8; payload_len];
    time_ns(iterations, || {
        let sig = signer.sign(&payload).map_err(internal)?;
        crypto
            .verify_signature(SignatureScheme::ED25519, &payload, public, &sig)
            .map_err(internal)
    })
}

/// Encrypt and decrypt times (ns per message) of `payload_len`-byte application messages
/// between two engines already in `channel`, measured in Rust.
pub fn encrypt_decrypt_ns(
    sender: &Engine,
    receiver: &Engine,
    channel: &str,
    payload_len: usize,
    iterations: u32,
) -> Result<(f64, f64)> {
    let payload = vec![0x42u8; payload_len];
    let mut messages = Vec::with_capacity(iterations as usize);
    let enc = time_ns(iterations, || {
        messages.push(sender.encrypt(channel, &payload)?);
        Ok(())
    })?;
    let mut it = messages.iter();
    let dec = time_ns(iterations, || {
        let m = it.next().ok_or_else(|| InternalError::Bench {
            detail: "ran out of messages".into(),
        })?;
        receiver.process_incoming(channel, m).map(|_| ())
    })?;
    Ok((enc, dec))
}
