//! kvflow's demo harness, unpublished: the engine process of `cargo xtask demo`, `attack` and
//! the end-to-end benches (`kvflow-node`, on kv-engine over NIXL or TCP), the router that drives
//! them, the attacker, the router's watch on etcd, and their JSON protocol. It wires adapters
//! together, which only a harness may; `cargo xtask` provisions, builds the binaries (the `nixl`
//! feature) and calls [`demo`].
//!
//! - [`demo`]: the router: a run of engine processes under a workload with faults, and its
//!   report; the attack suite's runs.
//! - [`proto`]: the lines the router and the engines exchange over the engines' stdin and
//!   stdout, one JSON object per line.
//! - [`logging`]: the `tracing` subscriber the binaries install (`RUST_LOG`, to stderr).
//! - [`stats`]: the quantile every report uses; [`procfs`]: a process's `/proc/PID/stat`.
//! - [`prometheus`]: the router's scrape of the engines' metrics endpoints (kv-engine's), and a
//!   parser of Prometheus's text format.
//! - `node` (feature `nixl`): an engine process, P or D, running kvflow's connectors over
//!   `NixlTransport` with host-memory KV pools from kv-cuda.
//! - `attacker` (feature `nixl`): the `kvflow-attack` process of `cargo xtask attack`, which
//!   attacks a running P engine and reports what held.
//! - `watch` (feature `nixl`): the `kvflow-watch` process, which reports the engines of a
//!   run's etcd registry to the router as they come and go.
//! - `e2e` (feature `nixl`): what `tests/pools.rs` and `benches/vram.rs` share, where the two
//!   adapters meet: kv-cuda's pools (VRAM included) moved by `NixlTransport` between processes.

pub mod demo;
pub mod logging;
pub mod procfs;
pub mod prometheus;
pub mod proto;
pub mod stats;

#[cfg(feature = "nixl")]
pub mod attacker;
#[cfg(feature = "nixl")]
pub mod e2e;
#[cfg(feature = "nixl")]
pub mod node;
#[cfg(feature = "nixl")]
pub mod watch;

/// `name` as found on `PATH`.
pub fn find_in_path(name: &str) -> Option<std::path::PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|dir| dir.join(name)).find(|candidate| candidate.is_file())
}
