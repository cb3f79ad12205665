//! kvflow's Python module, `kvflow._kvflow`: what the `kvflow` package's connectors call into
//! the connector's settings from vLLM's `kv_transfer_config`, checked (`config`); an engine's
//! scheduler side, for vLLM's scheduler process (`scheduler`); and one TP rank over NIXL, for a
//! vLLM worker process (`rank`).

use pyo3::prelude::*;

mod config;
mod rank;
mod scheduler;

/// The kvflow version this module was built from.
#[pyfunction]
fn version() -> &'static str {
    env!("CARGO_PKG_VERSION")
}

/// kvflow's native module.
#[pymodule]
fn _kvflow(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(version, m)?)?;
    m.add_function(wrap_pyfunction!(config::connector_settings, m)?)?;
    m.add_function(wrap_pyfunction!(rank::prepare_nixl, m)?)?;
    m.add_function(wrap_pyfunction!(rank::now_ns, m)?)?;
    m.add_class::<rank::Rank>()?;
    m.add_class::<scheduler::PrefillScheduler>()?;
    m.add_class::<scheduler::DecodeScheduler>()?;
    Ok(())
}
