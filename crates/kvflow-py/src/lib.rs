//! kvflow's Python module, `kvflow._kvflow`: what the `kvflow` package's connectors call into
//! the connector's settings from vLLM's `kv_transfer_config`, checked (`config`); an engine's
//! scheduler side, for vLLM's scheduler process (`scheduler`); one TP rank over NIXL, for a
//! vLLM worker process (`rank`); and the process's metrics, for vLLM's stats (`metrics`).

use pyo3::prelude::*;

mod config;
mod metrics;
mod rank;
mod scheduler;

/// The kvflow version this module was built from.
#[pyfunction]
fn version() -> &'static str {
    env!("CARGO_PKG_VERSION")
}

/// Sends kvflow's tracing events to stderr, filtered by `KVFLOW_LOG` (`tracing-subscriber`'s
/// `EnvFilter` syntax; warnings and errors when unset or unreadable), unless the process
/// already has a subscriber.
fn install_logging() {
    use tracing_subscriber::EnvFilter;
    let filter = std::env::var("KVFLOW_LOG")
        .ok()
        .and_then(|spec| EnvFilter::try_new(spec).ok())
        .unwrap_or_else(|| EnvFilter::new("warn"));
    let _already =
        tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(false).try_init();
}

/// kvflow's native module.
#[pymodule]
fn _kvflow(m: &Bound<'_, PyModule>) -> PyResult<()> {
    install_logging();
    // Before any scheduler or rank registers its metrics.
    if !metrics::install() {
        tracing::warn!("this process has another metrics recorder: kvflow's metrics go there, not to vLLM's stats");
    }
    m.add_function(wrap_pyfunction!(version, m)?)?;
    m.add_function(wrap_pyfunction!(config::connector_settings, m)?)?;
    m.add_function(wrap_pyfunction!(rank::prepare_nixl, m)?)?;
    m.add_function(wrap_pyfunction!(rank::now_ns, m)?)?;
    m.add_function(wrap_pyfunction!(metrics::metrics_delta, m)?)?;
    m.add_function(wrap_pyfunction!(metrics::metric_docs, m)?)?;
    m.add_class::<rank::Rank>()?;
    m.add_class::<scheduler::PrefillScheduler>()?;
    m.add_class::<scheduler::DecodeScheduler>()?;
    Ok(())
}
