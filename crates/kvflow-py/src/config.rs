//! The connector's settings from vLLM's whole `kv_transfer_config`, checked as kvflow's
//! connectors check them when they are built: the connector's name gives the mode, its
//! `kv_connector_extra_config` kvflow's keys (durations in seconds, unknown extra keys refused;
//! top-level keys kvflow does not know are ignored).

use kv_core::side::ClusterKey;
use kv_sched_adapter::{Config, KvRole, KvTransferConfig, ABORT_TIMEOUT_ENV};
use kv_transport_nixl::KeySource;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::scheduler::{from_json, refuse};

/// Where the cluster key is, as the Python side names it: `("file", path)`, `("env", name)`,
/// or `None` for no key (loopback only).
pub(crate) fn key_source(key: Option<(String, String)>) -> PyResult<KeySource> {
    match key {
        None => Ok(KeySource::None),
        Some((kind, at)) if kind == "file" => Ok(KeySource::File(at.into())),
        Some((kind, at)) if kind == "env" => Ok(KeySource::Env(at)),
        Some((kind, _)) => Err(refuse("key", format!("{kind:?}, not \"file\" or \"env\""))),
    }
}

/// The cluster key `key` names (see [`key_source`]): the null key for none.
pub(crate) fn cluster_key(key: Option<(String, String)>) -> PyResult<ClusterKey> {
    key_source(key)?.load().map_err(|e| refuse("key", e))
}

/// vLLM's whole `kv_transfer_config` (JSON text), and the connector's settings from it, with
/// NixlConnector's older `VLLM_NIXL_ABORT_REQUEST_TIMEOUT` as the lease where the config
/// leaves it out, and what to say of that variable if it was set.
pub(crate) fn parse(kv_transfer_config: &str) -> PyResult<(KvTransferConfig, Config, Option<String>)> {
    let transfer: KvTransferConfig = from_json("kv_transfer_config", kv_transfer_config)?;
    let old = std::env::var(ABORT_TIMEOUT_ENV).ok();
    let (transfer, note) = transfer.with_abort_timeout(old.as_deref()).map_err(|e| refuse("kv_transfer_config", e))?;
    if !transfer.unknown.0.is_empty() {
        tracing::debug!(keys = ?transfer.unknown.0, "kv_transfer_config keys kvflow does not know are ignored");
    }
    let config = Config::from_kv_transfer_config(&transfer).map_err(|e| refuse("kv_transfer_config", e))?;
    Ok((transfer, config, note))
}

/// The settings a `kv_transfer_config` (its JSON text) gives kvflow's connector, as a dict:
/// `mode`, `kv_role`, `kv_connector_module_path`, `engine_id`, `kv_lease_duration`,
/// `heartbeat_interval`, `heartbeat_lease_extension`, `read_safety_margin` (seconds),
/// `kv_load_failure_policy` and `num_threads`; and `warnings`, the lines the engine logs at
/// WARNING once at startup (NixlConnector's keys kvflow does not act on, the old lease
/// variable), and `ignored_keys`, the top-level keys kvflow does not know. Raises `ValueError`
/// naming what is wrong.
#[pyfunction]
pub fn connector_settings<'py>(py: Python<'py>, kv_transfer_config: &str) -> PyResult<Bound<'py, PyDict>> {
    let (transfer, config, note) = parse(kv_transfer_config)?;
    let ignored = transfer.ignored();
    let mut warnings: Vec<String> = note.into_iter().collect();
    if !ignored.nixl_keys.is_empty() {
        warnings.push(format!(
            "kv_connector_extra_config keys of NixlConnector that kvflow does not act on are ignored: {}",
            ignored.nixl_keys.join(", ")
        ));
    }
    let settings = PyDict::new(py);
    settings.set_item("warnings", warnings)?;
    settings.set_item("ignored_keys", ignored.top_level)?;
    settings.set_item("mode", config.mode.as_str())?;
    let role = transfer.kv_role.map(|role| match role {
        KvRole::Producer => "kv_producer",
        KvRole::Consumer => "kv_consumer",
        KvRole::Both => "kv_both",
    });
    settings.set_item("kv_role", role)?;
    settings.set_item("kv_connector_module_path", transfer.kv_connector_module_path)?;
    settings.set_item("engine_id", transfer.engine_id)?;
    settings.set_item("kv_lease_duration", config.kv_lease_duration.as_secs_f64())?;
    settings.set_item("heartbeat_interval", config.heartbeat_interval.as_secs_f64())?;
    settings.set_item("heartbeat_lease_extension", config.lease_extension.as_secs_f64())?;
    settings.set_item("read_safety_margin", config.read_safety_margin.as_secs_f64())?;
    settings.set_item("kv_load_failure_policy", config.kv_load_failure_policy.as_str())?;
    settings.set_item("num_threads", config.num_threads)?;
    Ok(settings)
}
