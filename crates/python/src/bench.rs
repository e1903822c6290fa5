//! `static._native.bench`: figures measured inside Rust for the benchmarks (`bench/`), from
//! `static_mls::bench_support`; not part of the SDK surface.

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::convert::bytes;
use crate::error::NativeResult;
use crate::exit;
use crate::mls::Engine;

/// `n` key packages of distinct throwaway identities.
#[pyfunction]
fn synthetic_key_packages(py: Python<'_>, n: usize) -> NativeResult<Vec<Py<PyBytes>>> {
    let kps = exit::without_gil(py, || static_mls::bench_support::synthetic_key_packages(n))?;
    Ok(kps.iter().map(|kp| bytes(py, kp)).collect())
}

/// (encrypt ns, decrypt ns) per message, measured inside Rust.
#[pyfunction]
fn rust_encrypt_decrypt(
    py: Python<'_>,
    sender: &Engine,
    receiver: &Engine,
    channel: &str,
    payload_len: usize,
    iterations: u32,
) -> NativeResult<(f64, f64)> {
    let (s, r) = (sender.engine()?, receiver.engine()?);
    Ok(exit::without_gil(py, || {
        static_mls::bench_support::encrypt_decrypt_ns(&s, &r, channel, payload_len, iterations)
    })?)
}

/// One Ed25519 sign + verify of `payload_len` bytes, in ns, measured in Rust.
#[pyfunction]
fn ed25519_sign_verify_ns(
    py: Python<'_>,
    payload_len: usize,
    iterations: u32,
) -> NativeResult<f64> {
    Ok(exit::without_gil(py, || {
        static_mls::bench_support::ed25519_sign_verify_ns(payload_len, iterations)
    })?)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(synthetic_key_packages, m)?)?;
    m.add_function(wrap_pyfunction!(rust_encrypt_decrypt, m)?)?;
    m.add_function(wrap_pyfunction!(ed25519_sign_verify_ns, m)?)?;
    Ok(())
}
