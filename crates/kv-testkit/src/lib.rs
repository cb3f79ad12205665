//! kvflow's deterministic fakes: a manual clock, a seeded in-memory network with fault
//! injection, and in-memory KV pools.
//!
//! They stand in for the real adapters (NIXL/UCX, CUDA) so that the lifecycle code can be
//! tested, and simulated, exactly and fast. Nothing here does I/O, starts a thread or reads the
//! system clock, and every random choice follows from one seed, so a run replays exactly.
//!
//! - [`ManualClock`]: a shared [`kv_core::Clock`] that moves only when told to, never back.
//! - [`Rng`]: the seeded generator behind every random choice.
//! - [`FakeHeap`] and [`InMemoryMemory`]: [`kv_core::Memory`] over byte buffers at synthetic
//!   addresses, shared with the transport that copies between them.
//! - [`FakeNetwork`] and [`FakeTransport`]: [`kv_core::Transport`] between in-process agents,
//!   with latency, kv-core's authenticated side-channel protocol over an in-order byte stream,
//!   transfers whose bytes really move (at completion time), sealed notifications, and faults:
//!   drop, duplicate, reorder, delay, partition, pause, crash, failed transfers, garbage and
//!   intruders without the cluster key; each engine's agents may read a clock of their own
//!   ([`FakeNetwork::set_clock_offset`]). Nothing happens until the clock moves and the network
//!   settles; see the [`network`] module for the timing rules.
//! - [`offer`]: a handshake offer for a fake engine rank.
//! - [`cluster::Cluster`]: P and D engines with pools, TP ranks and kvflow's real connectors
//!   over the fake network and a manual clock, each engine on its own clock (true time plus
//!   its skew), and the byte oracle that checks every load.
//! - [`pattern`]: the bytes a demo engine computes into a prompt's KV, per row, its check, and
//!   [`pattern::SCRUB`], the byte freed blocks are scrubbed with.
//! - [`random`]: seeded random workloads with faults, run with the invariants checked.
//! - [`scenario`]: scenario files (`docs/scenario-format.md`) read into a typed, validated
//!   [`scenario::Scenario`].
//!
//! A decode agent reads a block from a prefill agent:
//!
//! ```
//! use std::time::Duration;
//! use kv_core::*;
//! use kv_testkit::{offer, FakeHeap, FakeNetwork, InMemoryMemory, ManualClock, NetConfig};
//!
//! let clock = ManualClock::default();
//! let net = FakeNetwork::new(7, clock.clone(), NetConfig::default());
//! let layout = KvLayout {
//!     layers: 1, block_tokens: 16, kv_heads: 1, head_dim: 8, dtype: kv_core::Dtype::Bfloat16,
//!     attention: Attention::SplitKv, order: MemoryOrder::Hnd, placement: Placement::BlockMajor,
//! };
//! let (p_name, d_name) = (AgentName::new(EngineId::new("prefill0"), 0), AgentName::new(EngineId::new("decode0"), 0));
//! let (p_heap, d_heap) = (FakeHeap::with_base(0x1000_0000), FakeHeap::with_base(0x9000_0000));
//! let (mut p_pool, mut d_pool) = (InMemoryMemory::new(p_heap.clone()), InMemoryMemory::new(d_heap.clone()));
//! let p_address = PeerAddress("prefill0".into());
//! let mut p = net.transport(p_name.clone(), p_address.clone(), p_heap, offer(&p_name, Role::Prefill, 1, layout))?;
//! let d_address = PeerAddress("decode0".into());
//! let mut d = net.transport(d_name.clone(), d_address, d_heap, offer(&d_name, Role::Decode, 1, layout))?;
//!
//! let p_region = p_pool.allocate(MemoryKind::Host, 4096)?;
//! let d_region = d_pool.allocate(MemoryKind::Device(0), 4096)?;
//! p.register(&p_region)?;
//! d.register(&d_region)?;
//! p_pool.write(p_region.id, 512, b"kv bytes")?;
//!
//! d.connect(&p_address)?;
//! clock.advance(Duration::from_millis(4)); // the authenticated handshake: two round trips
//! assert!(matches!(d.poll_event(), Some(PeerEvent::Connected(_))));
//!
//! let pairs = vec![DescriptorPair {
//!     local_region: 0, local_addr: d_region.addr, remote_region: 0, remote_addr: p_region.addr + 512, len: 8,
//! }];
//! let done = Some(b"done".to_vec());
//! let read = d.post(TransferRequest { op: TransferOp::Read, peer: p_name, pairs, notification: done })?;
//! assert_eq!(d.poll_transfer(read), TransferStatus::InProgress);
//! clock.advance(Duration::from_millis(6)); // the transfer, then its notification
//! assert_eq!(d.poll_transfer(read), TransferStatus::Done);
//!
//! let mut bytes = [0; 8];
//! d_pool.read(d_region.id, 0, &mut bytes)?;
//! assert_eq!(&bytes, b"kv bytes");
//! assert!(matches!(p.poll_event(), Some(PeerEvent::Connected(_))));
//! let Some(PeerEvent::Notification(note)) = p.poll_event() else { panic!("the read's notification") };
//! assert_eq!((note.from, note.payload), (d_name, b"done".to_vec()));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod clock;
pub mod cluster;
mod memory;
pub mod network;
pub mod pattern;
mod pool;
pub mod random;
mod rng;
pub mod scenario;

pub use clock::ManualClock;
pub use memory::{FakeHeap, InMemoryMemory};
pub use network::{FakeNetwork, FakeTransport, NetConfig, NetStats, Scope};
pub use pool::BlockPool;
pub use rng::Rng;

use kv_core::{AgentName, Handshake, KvLayout, Role};

/// The model every [`offer`] names.
pub const FAKE_MODEL: &str = "kvflow-fake-model";

/// A handshake offer for `agent`, a rank of an engine with `tp_size` ranks, serving
/// [`FAKE_MODEL`] in `layout`: no pool regions, no blocks, no agent metadata, clock zero (the
/// fake network stamps the clock when the offer leaves).
pub fn offer(agent: &AgentName, role: Role, tp_size: u32, layout: KvLayout) -> Handshake {
    Handshake::new(agent, tp_size, 0, role, FAKE_MODEL, layout)
}
