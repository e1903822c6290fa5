//! `static._native`: the thin PyO3 layer over `static-mls`, `static-client` and `static-relay`,
//! one submodule per Rust file, as pyca/cryptography's `bindings/_rust/` is laid out: `mls`
//! (the engine), `client` (the SDK client), `relay` (the relay server and its log bridge) and
//! `bench` (benchmark figures), each typed by `static/_native/<name>.pyi`.
//!
//! Every call releases the GIL while the core works; the core guards its groups itself, so one
//! `Engine` is usable from many Python threads at once. Errors map to the Python classes of
//! `static._errors` in exactly one place, `From<NativeError> for PyErr` (`error`).

#![forbid(unsafe_code)]

mod bench;
mod client;
mod convert;
mod error;
mod exit;
mod logging;
mod mls;
mod relay;
mod request;
mod token;
mod waiting;

use pyo3::prelude::*;

/// Adds the submodule `static._native.<name>`, filled by `fill`, and registers it in
/// `sys.modules` so that `import static._native.<name>` finds it (an extension module is not
/// a package: Python looks a submodule up there once the parent is imported).
fn submodule(
    parent: &Bound<'_, PyModule>,
    name: &str,
    fill: impl FnOnce(&Bound<'_, PyModule>) -> PyResult<()>,
) -> PyResult<()> {
    let py = parent.py();
    let module = PyModule::new(py, name)?;
    fill(&module)?;
    parent.add_submodule(&module)?;
    let qualified = format!("static._native.{name}");
    module.setattr("__name__", &qualified)?;
    py.import("sys")?
        .getattr("modules")?
        .set_item(qualified, module)?;
    Ok(())
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", static_mls::VERSION)?;
    submodule(m, "mls", mls::register)?;
    submodule(m, "client", client::register)?;
    submodule(m, "relay", |relay| {
        relay::register(relay)?;
        logging::register(relay)
    })?;
    submodule(m, "bench", bench::register)?;
    exit::register(m)?;
    Ok(())
}
