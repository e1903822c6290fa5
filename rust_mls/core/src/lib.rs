//! Static's pure Rust core. No Python here: `static-native` (the `python/` crate) is the thin
//! PyO3 layer over it.

#![forbid(unsafe_code)]

/// The crate version, reported by `static._native.__version__`.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
