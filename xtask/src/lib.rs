//! The pieces of `cargo xtask demo` and the end-to-end bench that the router (the `xtask`
//! binary) and the engine processes (`kvflow-node`, built with the `nixl` feature) share.
//!
//! - [`proto`]: the lines the router and the engines exchange over the engines' stdin and
//!   stdout, one JSON object per line.
//! - [`logging`]: the `tracing` subscriber the binaries install (`RUST_LOG`, to stderr).
//! - [`stats`]: the quantile every report uses; [`procfs`]: a process's `/proc/PID/stat`.
//! - [`prometheus`]: the engines' metrics endpoint (Prometheus's text format over plain
//!   HTTP), the router's scrape of it, and a parser of what it scrapes.
//! - `node` (feature `nixl`): an engine process, P or D, running kvflow's connectors over
//!   `NixlTransport` with host-memory KV pools from kv-cuda.
//! - `attacker` (feature `nixl`): the `kvflow-attack` process of `cargo xtask attack`, which
//!   attacks a running P engine and reports what held.
//! - `watch` (feature `nixl`): the `kvflow-watch` process, which reports the engines of a
//!   run's etcd registry to the router as they come and go.
//! - `e2e` (feature `nixl`): what `tests/pools.rs` and `benches/vram.rs` share, where the two
//!   adapters meet: kv-cuda's pools (VRAM included) moved by `NixlTransport` between processes.

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
