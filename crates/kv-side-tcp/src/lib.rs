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
//! ```no_run
//! use std::sync::Arc;
//! use kv_core::side::SideLimits;
//! use kv_side_tcp::{Item, KeySource, SideChannel};
//! # fn offer() -> kv_core::Handshake { unimplemented!() }
//! # fn clock() -> Arc<dyn kv_core::Clock> { unimplemented!() }
//! let key = KeySource::None.load()?;
//! let side = SideChannel::start("127.0.0.1:0".parse()?, key, SideLimits::default(), offer(), clock())?;
//! side.connect(&kv_core::PeerAddress("127.0.0.1:5600".into()))?;
//! while let Some(item) = side.poll_item() {
//!     match item {
//!         Item::Event(event) => drop(event), // Connected: the peer is usable; Lost: it is gone
//!         // Collect what the peer sent on the data path first, then:
//!         Item::PeerClosed(conn) => side.peer_closed(conn),
//!     }
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod channel;
mod key;

pub use channel::{nonce, Item, SideChannel, SideStatus};
pub use key::{check_bind, KeyError, KeySource};
