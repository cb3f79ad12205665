//! kv-core's [`Transport`](kv_core::Transport) port over plain TCP sockets: the baseline that
//! experiments compare NIXL/UCX against, with nothing to install.
//!
//! [`TcpTransport`] is one agent, for one TP rank, moving host memory only (pageable or
//! pinned; a device region is refused at `register`). Peers meet over the same TCP side
//! channel as kv-transport-nixl's ([`kv_side_tcp::SideChannel`], port
//! [`DEFAULT_SIDE_CHANNEL_PORT`] by default, loopback unless configured): kv-core's
//! authenticated handshake, whose loss is how a peer is seen gone. The handshake's
//! `agent_metadata` carries what NIXL's metadata carries for NIXL, and is as much a
//! capability: the address of this transport's data listener, a random 32-byte token that
//! the listener wants from whoever connects, and the table of registered regions (layout in
//! `src/metadata.rs`). Register every region before peers connect, as with NIXL.
//!
//! Unlike NIXL, whose UCX serves a peer's reads with no help from the engine, an agent serves
//! a peer's data connection only once its own engine has taken in that peer's handshake (any
//! `poll_event` or `post` after it; the side channel wakes the engine's waker for it); until
//! then the connection waits, up to the side channel's `auth_timeout`. An engine that runs
//! `WorkerDriver::step` as it should does this every step.
//!
//! Each pair of a read lands in order, so a read that fails part-way (its data connection
//! broke, or P refused a range it withdrew) reports the local ranges that had not arrived
//! whole as [`kv_core::TransportError::PartlyFailed`], and D keeps the blocks before them; a
//! read of which nothing arrived whole fails with the cause itself.
//!
//! Two agents in one process: D reads P's 4 KiB over loopback.
//!
//! ```
//! use std::sync::Arc;
//! use std::time::{Duration, Instant};
//! use kv_core::{AgentName, Clock, DescriptorPair, EngineId, Handshake, KvLayout, MemoryKind, PeerAddress};
//! use kv_core::{PeerEvent, Region, RegionId, Role, Time, TransferOp, TransferRequest, TransferStatus, Transport};
//! use kv_transport_tcp::{TcpConfig, TcpTransport};
//!
//! struct Since(Instant);
//! impl Clock for Since {
//!     fn now(&self) -> Time {
//!         Time::from_nanos(self.0.elapsed().as_nanos() as u64)
//!     }
//! }
//!
//! let clock: Arc<dyn Clock> = Arc::new(Since(Instant::now()));
//! let config = TcpConfig { bind: "127.0.0.1:0".parse()?, ..TcpConfig::default() };
//! let (p_pool, d_pool) = (vec![7u8; 4096], vec![0u8; 4096]);
//! let region = |pool: &Vec<u8>| Region { id: RegionId(1), kind: MemoryKind::Host, addr: pool.as_ptr() as u64, len: 4096 };
//! let agent = |engine: &str, role: Role, pool: &Vec<u8>| -> Result<TcpTransport, Box<dyn std::error::Error>> {
//!     let name = AgentName::new(EngineId::new(engine), 0);
//!     let offer = Handshake::new(&name, 1, 1, role, "model", KvLayout::split_kv(1, 16, 1, 8, 2));
//!     let mut transport = TcpTransport::new(offer, &config, clock.clone())?;
//!     transport.register(&region(pool))?; // before peers connect: they learn the registrations
//!     Ok(transport)
//! };
//! let (mut p, mut d) = (agent("prefill0", Role::Prefill, &p_pool)?, agent("decode0", Role::Decode, &d_pool)?);
//! d.connect(&PeerAddress(p.side_channel_addr().to_string()))?;
//! // Both engines' loops take in the handshake (P serves D's reads once it has).
//! let deadline = Instant::now() + Duration::from_secs(10);
//! let (mut peer, mut p_knows_d) = (None, false);
//! while peer.is_none() || !p_knows_d {
//!     match d.poll_event() {
//!         Some(PeerEvent::Connected(info)) => peer = Some(info.agent),
//!         _ if Instant::now() > deadline => return Err("no handshake".into()),
//!         _ => std::thread::sleep(Duration::from_millis(1)),
//!     }
//!     p_knows_d |= matches!(p.poll_event(), Some(PeerEvent::Connected(_)));
//! }
//! let peer = peer.expect("connected");
//! let pairs = vec![DescriptorPair {
//!     local_region: 0,
//!     local_addr: d_pool.as_ptr() as u64,
//!     remote_region: 0,
//!     remote_addr: p_pool.as_ptr() as u64,
//!     len: 4096,
//! }];
//! let id = d.post(TransferRequest { op: TransferOp::Read, peer, pairs, notification: Some(b"done".to_vec()) })?;
//! while d.poll_transfer(id) == TransferStatus::InProgress {
//!     std::thread::sleep(Duration::from_millis(1));
//! }
//! // The transport wrote D's pool behind the compiler's back: read it afresh.
//! assert!(std::hint::black_box(&d_pool).iter().all(|&b| b == 7));
//! drop((d, p)); // the transports let go of the pools before the pools are freed
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # The data protocol
//!
//! When a peer's handshake completes, each side opens one TCP connection to the other's data
//! listener (so two per pair of agents). A connection carries, in order, everything the agent
//! that opened it originates toward the listener's agent, and the listener's replies come back
//! on it. Every frame is
//!
//! ```text
//! kind u8 | length u32 | body (length bytes)
//! ```
//!
//! with integers little-endian. Each kind has bounds on its body length (below); a frame of a
//! kind the receiver does not accept there, or outside its bounds, closes the connection, and so
//! does a body that contradicts itself. From the connecting agent to the listener:
//!
//! | kind | frame | body | body bytes |
//! |---|---|---|---|
//! | 0x01 | HELLO | `"KVTD"`, version u8 = 1, the listener's token \[32\], the sender's incarnation u64, its rank u32, its engine name (UTF-8, the rest of the body) | 50..=113 |
//! | 0x02 | READ | transfer u64, index of the first pair u32, count u32, count x (listener's address u64, length u64): pairs first, first + 1, ... | 16 + 16 x count, count 1..=4096 |
//! | 0x03 | WRITE | transfer u64, pair index u32, listener's address u64, the data for that address | 21..=20 + 1 MiB |
//! | 0x04 | WRITE_END | transfer u64, flags u8 (bit 0: the sender aborted; others 0), the sealed notification (empty: none) | 9..=9 + 65562 |
//! | 0x05 | NOTIFY | a sealed notification | 1..=65562 |
//!
//! From the listener back:
//!
//! | kind | frame | body | body bytes |
//! |---|---|---|---|
//! | 0x81 | DATA | transfer u64, pair index u32, offset in the pair u64, the pair's bytes from that offset | 21..=20 + 1 MiB |
//! | 0x82 | RANGE_ERROR | transfer u64, pair index u32, address u64, length u64: that pair of the read is refused | 28 |
//! | 0x83 | WRITE_ACK | transfer u64, status u8 (0 written, 1 a range refused, 2 aborted by the sender), pair u32, address u64, length u64 (the first refused chunk; zeros otherwise) | 29 |
//!
//! A sealed notification is kv-core's tagged notification (`"KT"`, a sequence number, the
//! payload of at most `MAX_MESSAGE_BYTES` = 64 KiB, and a tag made with the side-channel
//! session: [`kv_core::side::SideEndpoint::seal_notification`]), hence the 65562-byte bound.
//!
//! - HELLO comes first, whole, within the side channel's `auth_timeout` of the accept. The
//!   listener compares the token in constant time and serves only an agent that is an
//!   established side-channel peer of that name and incarnation whose side channel is open
//!   (waiting until the same deadline for a handshake this engine has not taken in yet);
//!   otherwise it closes the connection and counts it ([`DataStatus`]). HELLO has no reply.
//! - READ: the listener answers each range in order. It checks that the range lies inside one
//!   of its registrations at that moment, then sends the range's bytes as DATA frames of at
//!   most 1 MiB, in order of offset, straight from memory; or one RANGE_ERROR if the range is
//!   not registered, or stops being registered part way (the bytes already sent are void).
//!   The reader puts each DATA frame straight into its local memory after checking that it
//!   continues its pair exactly; the read is settled when every pair has all its bytes or a
//!   RANGE_ERROR. A read's notification is then sealed and sent as NOTIFY on the same
//!   connection, and only then does the read report done.
//! - WRITE: a transfer's chunks come in order, unmixed with another transfer's, then its
//!   WRITE_END. Each chunk is checked against the listener's registrations of the moment before
//!   its bytes are stored; from a refused chunk on, nothing more of the transfer is stored. At
//!   WRITE_END the listener delivers the notification only if every chunk was stored and the
//!   sender did not abort (bit 0: a local range of the sender's was deregistered mid-way), then
//!   answers WRITE_ACK; the write reports done at a status-0 acknowledgement.
//! - NOTIFY and WRITE_END's notification are opened with the session of the agent the
//!   connection authenticated as; one that does not open is reported as
//!   [`PeerEvent::Refused`](kv_core::PeerEvent::Refused) (cause by `NotifyError::cause`),
//!   never delivered.
//! - When a peer's side channel closes, its data connections get up to 500 ms to deliver what
//!   they carry, so that its `Lost` comes after everything it sent.
//! - A data connection that breaks fails the transfers it carries (with `PeerLost` if the
//!   peer's side channel closes within those 500 ms, else `TransferFailed`), and the next
//!   transfer to that peer opens a new one.
//!
//! Bounds (DESIGN.md rule 12): at most [`TcpConfig::max_data_connections`] incoming data
//! connections at once (one more is closed at accept and counted); frame bodies as above; at
//! most `max_queued_events` received notifications wait for `poll_event` (more are counted and
//! dropped); the rest of a frame must arrive, and a blocked write make progress, within
//! [`STALL_TIMEOUT`] of the frame's start, which bounds how long a region is held against
//! `deregister`.
//!
//! Every completion, notification and side-channel event wakes the waker given to
//! `set_waker`, so [`poll_intervals`](kv_core::Transport::poll_intervals) asks for no polling.

mod client;
mod frame;
mod memory;
mod metadata;
mod server;
mod shared;
mod transport;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

pub use frame::{MAX_CHUNK, MAX_RANGES_PER_READ, MAX_SEALED_NOTIFICATION, STALL_TIMEOUT};
pub use kv_side_tcp::{KeySource, SideStatus};
pub use transport::TcpTransport;

/// The side channel's default port: kv-transport-nixl's plus 100, so both can run on one host.
pub const DEFAULT_SIDE_CHANNEL_PORT: u16 = 5700;

/// How to build a [`TcpTransport`].
#[derive(Clone, Debug)]
pub struct TcpConfig {
    /// Where the side channel listens (loopback and port 5700 unless configured). Without a
    /// key it must be a loopback address.
    pub bind: SocketAddr,
    /// The data listener's IP (its port is chosen by the OS); peers connect to it, so it must
    /// be an address they reach, not `0.0.0.0`. Without a key it must be a loopback address.
    pub data_bind: IpAddr,
    /// Where the cluster key is read from when the transport is made (none: loopback only).
    pub key: KeySource,
    /// The side channel's bounds and handshake deadline; `auth_timeout` is also how long a
    /// data connection has to send HELLO, and `max_queued_events` how many received
    /// notifications may wait for `poll_event`.
    pub side_limits: kv_core::side::SideLimits,
    /// Incoming data connections held at once, authenticated or not; one more is closed at
    /// accept and counted.
    pub max_data_connections: usize,
}

impl Default for TcpConfig {
    fn default() -> Self {
        let side_limits = kv_core::side::SideLimits::default();
        TcpConfig {
            bind: SocketAddr::from((Ipv4Addr::LOCALHOST, DEFAULT_SIDE_CHANNEL_PORT)),
            data_bind: IpAddr::V4(Ipv4Addr::LOCALHOST),
            key: KeySource::None,
            max_data_connections: side_limits.max_peers + side_limits.max_unauthenticated,
            side_limits,
        }
    }
}

/// What the data path holds now and has refused: what a test of the bounds checks.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct DataStatus {
    /// Incoming data connections open, authenticated or not.
    pub incoming: usize,
    /// Outgoing data connections open.
    pub outgoing: usize,
    /// Incoming connections closed before they authenticated: over the bound, no HELLO in
    /// time, a malformed HELLO, a wrong token, or an agent that is no established peer.
    pub connections_refused: u64,
    /// Frames that broke the protocol (a kind not accepted there, a length outside its bound,
    /// a malformed body); each closed its connection.
    pub frames_refused: u64,
    /// READ and WRITE ranges outside this transport's registrations, answered with an error
    /// and never touched.
    pub ranges_refused: u64,
    /// Received notifications and refusals dropped because `max_queued_events` waited already.
    pub events_dropped: u64,
    /// Data bytes this transport sent: its writes, and what it served to peers' reads.
    pub bytes_sent: u64,
    /// Data bytes this transport received: its reads, and peers' writes.
    pub bytes_received: u64,
}

/// Why a [`TcpTransport`] could not be made.
#[derive(Clone, Debug, thiserror::Error)]
pub enum TcpError {
    /// The cluster key could not be read.
    #[error(transparent)]
    Key(#[from] kv_side_tcp::KeyError),
    /// The configuration contradicts itself.
    #[error("TCP transport configuration: {0}")]
    Config(String),
    /// The data listener could not listen.
    #[error("data listener cannot listen on {addr}: {reason}")]
    Listen {
        /// The address it tried.
        addr: SocketAddr,
        /// The operating system's account.
        reason: String,
    },
    /// A thread or the token's randomness was not to be had.
    #[error("TCP transport cannot start: {0}")]
    Start(String),
    /// The side channel could not start.
    #[error(transparent)]
    Transport(#[from] kv_core::TransportError),
}
