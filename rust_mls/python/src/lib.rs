//! `static._native`: the thin PyO3 layer over `static-core`.

use pyo3::prelude::*;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", static_core::VERSION)?;
    Ok(())
}
