//! kv-core's [`Transport`](kv_core::Transport) port over NIXL/UCX, through nixl-sys.
//!
//! [`NixlTransport`] is one NIXL agent with the UCX backend, for one TP rank. Its regions are
//! registered with NIXL (host memory as DRAM, device memory as VRAM), transfers are NIXL
//! transfer requests whose notification NIXL delivers to the peer on completion, and peers
//! meet over a TCP side channel (port 5600 by default, loopback unless configured) that runs
//! kv-core's handshake and then stays open: its loss is how a peer is seen gone, since NIXL
//! reports a remote disconnect only as a generic backend error.
//!
//! The NIXL runtime is the `nixl-cu12` wheel that `cargo xtask setup` unpacks into the
//! workspace's `.nixl/` folder; [`runtime::prepare`], which an engine calls before its first
//! transport, loads it from where it is told or `KVFLOW_NIXL_DIR` says (nothing is baked in at
//! build time), with no library path exported and no environment variable set.
//!
//! ```
//! use std::sync::Arc;
//! use std::time::Instant;
//! use kv_core::{AgentName, Clock, EngineId, Handshake, KvLayout, MemoryKind, Region, RegionId, Role, Time, Transport};
//! use kv_transport_nixl::{runtime, NixlConfig, NixlTransport};
//!
//! struct Since(Instant);
//! impl Clock for Since {
//!     fn now(&self) -> Time {
//!         Time::from_nanos(self.0.elapsed().as_nanos() as u64)
//!     }
//! }
//!
//! // Before the first transport (this example stops where no runtime is set up: the error
//! // says how to set one up).
//! if runtime::prepare(None).is_err() {
//!     return Ok(());
//! }
//! let offer = Handshake::new(&AgentName::new(EngineId::new("prefill0"), 0), 1, 1, Role::Prefill, "model", KvLayout::split_kv(1, 16, 1, 8, kv_core::Dtype::Bfloat16));
//! let config = NixlConfig { bind: "127.0.0.1:0".parse()?, ..NixlConfig::default() };
//! let mut transport = NixlTransport::new(offer, &config, Arc::new(Since(Instant::now())))?;
//! let pool = vec![0u8; 1 << 20];
//! transport.register(&Region { id: RegionId(1), kind: MemoryKind::Host, addr: pool.as_ptr() as u64, len: 1 << 20 })?;
//! // Peers connect to this address (or this one connects to theirs) and read the pool.
//! assert!(transport.side_channel_addr().port() > 0);
//! drop(transport); // before the pool it registered
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! Register every region before peers connect: NIXL's metadata, which peers load at
//! handshake, lists the registrations that exist then. The handshake's agent metadata carries,
//! ahead of NIXL's, kvflow's table of those registrations ([`kv_core::agent::AgentTable`]) with
//! their memory kind and GPU, so that each
//! side builds the peer's descriptor lists with the peer's true memory type (DRAM or VRAM) and
//! device id, and refuses a remote range outside them before NIXL sees it.

mod drain;
mod inbox;
mod metadata;
pub mod runtime;
mod transport;

use std::path::PathBuf;

pub use kv_side_tcp::{KeySource, PortPlan, SideProbe, SideStatus};

pub use drain::{DRAIN_BUSY_PERIOD, DRAIN_IDLE_PERIOD};
pub use inbox::{
    CUT_OFF_AFTER_DROPPED_BYTES, MAX_QUEUED_EVENTS, MAX_QUEUED_NOTIFICATION_BYTES,
    MAX_QUEUED_NOTIFICATION_BYTES_PER_PEER, MAX_STRANGER_NAMES,
};

/// The NIXL part of a handshake's agent metadata (after kvflow's registration table), for
/// tools that drive NIXL themselves, such as `cargo xtask attack`. Never panics.
pub fn nixl_agent_metadata(agent_metadata: &[u8]) -> Result<&[u8], String> {
    metadata::decode(agent_metadata).map(|(_, nixl)| nixl).map_err(|e| e.to_string())
}
pub use transport::admit::{MAX_DEFERRAL, PENALTY_FIRST, PENALTY_MAX};
pub use transport::{
    engine_config, nixl_name, NixlConfig, NixlTransport, DEFAULT_POLL_INTERVALS, DEFAULT_POST_PIECE_BUDGET,
    DEFAULT_POST_PIECE_BYTES, DEFAULT_SIDE_CHANNEL_PORT, UCX_ENGINE_CONFIG,
};

/// Why a [`NixlTransport`] could not be made.
#[derive(Clone, Debug, thiserror::Error)]
pub enum NixlError {
    /// The NIXL runtime is not where it was looked for.
    #[error(
        "NIXL runtime not found at {}: run `cargo xtask setup` to fetch the nixl-cu12 wheel into .nixl/, or set KVFLOW_NIXL_DIR to the folder holding libnixl_capi.so",
        path.display()
    )]
    RuntimeMissing {
        /// The library looked for.
        path: PathBuf,
    },
    /// Neither the configuration nor the environment says where the runtime is.
    #[error(
        "no NIXL runtime configured: pass its folder to runtime::prepare, or set KVFLOW_NIXL_DIR to the folder holding libnixl_capi.so (`cargo xtask setup` fetches the nixl-cu12 wheel and prints that folder)"
    )]
    RuntimeNotConfigured,
    /// A transport was made before the engine called [`runtime::prepare`].
    #[error("the NIXL runtime is not prepared: call kv_transport_nixl::runtime::prepare before the first transport")]
    RuntimeNotPrepared,
    /// The runtime is there but does not load.
    #[error("cannot load the NIXL runtime {}: {reason}", path.display())]
    RuntimeLoad {
        /// The library.
        path: PathBuf,
        /// dlopen's account.
        reason: String,
    },
    /// NIXL refused to make the agent or its backend.
    #[error("NIXL agent: {0}")]
    Agent(String),
    /// The cluster key could not be read.
    #[error(transparent)]
    Key(#[from] kv_side_tcp::KeyError),
    /// The configuration contradicts itself.
    #[error("NIXL transport configuration: {0}")]
    Config(String),
    /// The side channel could not start.
    #[error(transparent)]
    Transport(#[from] kv_core::TransportError),
}
