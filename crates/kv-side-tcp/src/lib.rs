//! The side channel's sockets, shared by every `Transport` adapter that meets its peers over
//! TCP (kv-transport-nixl, kv-transport-tcp): kv-core's [`SideEndpoint`](kv_core::side::SideEndpoint)
//! speaks the protocol; [`SideChannel`] only moves its bytes, on a thread of its own.
//!
//! This crate implements no port and knows no adapter. An adapter starts a [`SideChannel`]
//! with its offer (whose `agent_metadata` is the adapter's own: NIXL's metadata, or a TCP data
//! address and its capability), connects to peers, and takes [`Item`]s in order: a peer is
//! usable once its `Connected` event arrives, and gone at its `Lost`. A [`KeySource`] names
//! where the cluster key is read from.
//!
//! Two agents meet on loopback; each sees the other connected, with its offer:
//!
//! ```
//! use std::sync::Arc;
//! use std::time::{Duration, Instant};
//! use kv_core::side::{SideEvent, SideLimits};
//! use kv_core::{AgentName, Clock, EngineId, Handshake, KvLayout, PeerAddress, Role, Time};
//! use kv_side_tcp::{Item, KeySource, SideChannel};
//!
//! struct Since(Instant);
//! impl Clock for Since {
//!     fn now(&self) -> Time {
//!         Time::from_nanos(self.0.elapsed().as_nanos() as u64)
//!     }
//! }
//!
//! let clock: Arc<dyn Clock> = Arc::new(Since(Instant::now()));
//! let start = |engine: &str, role: Role| -> Result<SideChannel, Box<dyn std::error::Error>> {
//!     let agent = AgentName::new(EngineId::new(engine), 0);
//!     // An adapter puts what peers need to reach its data path into `agent_metadata`.
//!     let offer = Handshake::new(&agent, 1, 1, role, "model", KvLayout::split_kv(1, 16, 1, 8, kv_core::Dtype::Bfloat16));
//!     let key = KeySource::None.load()?; // loopback only; a cluster key authenticates peers
//!     Ok(SideChannel::start("127.0.0.1:0".parse()?, key, SideLimits::default(), offer, clock.clone())?)
//! };
//! let (p, d) = (start("prefill0", Role::Prefill)?, start("decode0", Role::Decode)?);
//! d.connect(&PeerAddress(p.local_addr().to_string()))?;
//! let mut met = Vec::new();
//! let deadline = Instant::now() + Duration::from_secs(10);
//! while met.len() < 2 && Instant::now() < deadline {
//!     for side in [&p, &d] {
//!         match side.poll_item() {
//!             Some(Item::Event(SideEvent::Connected { info, .. })) => met.push(info.agent.to_string()),
//!             // Collect what the peer sent on the data path first, then:
//!             Some(Item::PeerClosed(conn)) => side.peer_closed(conn),
//!             _ => std::thread::sleep(Duration::from_millis(1)),
//!         }
//!     }
//! }
//! met.sort();
//! assert_eq!(met, ["decode0/tp0", "prefill0/tp0"]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod channel;
mod key;
pub mod shared;

pub use channel::{nonce, Item, NotificationOpener, PortPlan, SideChannel, SideProbe, SideStatus};

/// How many connections the kernel queues for a listener of [`listen`] before it accepts them
/// (the kernel caps it at `net.core.somaxconn`, 4096 by default).
pub const LISTEN_BACKLOG: i32 = 4096;

/// A TCP listener bound to `addr` with an accept queue [`LISTEN_BACKLOG`] deep. std's 128 is
/// shallow enough for a flood of connections to fill between two accepts: the kernel then drops
/// the SYNs behind them, a real engine's among them, and its connect waits a second to retry.
pub fn listen(addr: std::net::SocketAddr) -> std::io::Result<std::net::TcpListener> {
    let socket = socket2::Socket::new(socket2::Domain::for_address(addr), socket2::Type::STREAM, None)?;
    // As std's listeners do, so that a restarted engine can take its port back at once.
    socket.set_reuse_address(true)?;
    socket.bind(&addr.into())?;
    socket.listen(LISTEN_BACKLOG)?;
    Ok(socket.into())
}

/// The process's monotonic clock, reading zero when it was made: what a transport's side
/// channel stamps its offers with, for engines and tests that have no clock of their own.
#[derive(Debug)]
pub struct MonotonicClock(std::time::Instant);

impl MonotonicClock {
    /// A clock that reads zero now.
    pub fn start() -> Self {
        MonotonicClock(std::time::Instant::now())
    }
}

impl kv_core::Clock for MonotonicClock {
    fn now(&self) -> kv_core::Time {
        kv_core::Time::from_nanos(self.0.elapsed().as_nanos() as u64)
    }
}
pub use key::{check_bind, KeyError, KeySource};
