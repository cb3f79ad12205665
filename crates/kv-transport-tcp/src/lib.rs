//! kv-core's [`Transport`](kv_core::Transport) port over plain TCP sockets: the baseline that
//! experiments compare NIXL/UCX against, with nothing to install.
//!
//! [`TcpTransport`] is one agent, for one TP rank, moving host memory only (pageable or
//! pinned; a device region is refused at `register`). Peers meet over the same TCP side
//! channel as kv-transport-nixl's ([`kv_side_tcp::SideChannel`], port
//! [`DEFAULT_SIDE_CHANNEL_PORT`] by default, loopback unless configured): kv-core's
//! authenticated handshake, whose loss is how a peer is seen gone. The handshake's
//! `agent_metadata` carries the address of this transport's data listener and the table of
//! registered regions, in kv-core's registration table ([`kv_core::agent::AgentTable`]). Register every region before peers
//! connect, as with NIXL. Unlike NIXL's metadata it is no capability: a data connection is
//! served only once it proved, by a challenge answered under a key derived from its own
//! side-channel session ([`kv_core::side::link`]), that it belongs to that session's peer, and
//! every frame it carries bears that session's next tag, so what an eavesdropper records on
//! the data network (names, addresses, nonces, frames) lets it read or write nothing.
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
//!     let offer = Handshake::new(&name, 1, 1, role, "model", KvLayout::split_kv(1, 16, 1, 8, kv_core::Dtype::Bfloat16));
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
//! length u32 BE | kind u8 | body                                  HELLO, CHALLENGE, PROOF
//! length u32 BE | kind u8 | control | tag [16] | data [| tag [16]]   every frame after them
//! ```
//!
//! The header is the side channel's ([`kv_core::side::FrameHeader`]): the length counts the
//! kind and the body. The body's integers are little-endian. Each kind has bounds on its body
//! length (below); a frame of a kind the receiver does not accept there, or outside its bounds,
//! closes the connection, and so does a body that contradicts itself. The link handshake comes
//! first, untagged (version 3; version 2 wrote the header as kind, then the body's length
//! little-endian, and version 1 sent a static capability token in clear; both are refused):
//!
//! | kind | frame | direction | body | body bytes |
//! |---|---|---|---|---|
//! | 0x01 | HELLO | connector to listener | `"KVTD"`, version u8 = 3, flags u8 (bit 0: tag the payloads you send me), `nonce_c` \[32\], the sender's incarnation u64, its rank u32, its engine name (UTF-8, the rest of the body) | 51..=114 |
//! | 0x84 | CHALLENGE | listener to connector | `nonce_l` \[32\], flags u8 (as HELLO's), `mac_l` \[32\] | 65 |
//! | 0x06 | PROOF | connector to listener | `mac_c` \[32\] | 32 |
//!
//! Both ends hold the secret of links bound to their side-channel session,
//! `link = HMAC-SHA256(k_export, "kvflow-export-v1" ‖ "kvflow-tcp-data-v2")`, and with the
//! transcript `HELLO ‖ CHALLENGE⁻` (both whole frames, headers included, CHALLENGE without its
//! MAC) compute `mac_l`, `mac_c` and one tag key per direction as [`kv_core::side::link`]
//! lays out (`docs/side-channel.md` has `k_export` and a test vector of `link`). Afterwards
//! every frame carries a 16-byte tag, the next of its direction (each direction counts from
//! 0), over its header and control bytes: the whole body, except for WRITE and DATA, whose 20
//! bytes of transfer, pair and address or offset are covered and whose data follows the tag.
//! When the receiver's flags asked for payload tags, the data is followed by a tag of its own
//! (the next count). A frame whose tag does not verify is counted (`frames_forged`) and ends
//! the connection before any of it is acted on. From the connector:
//!
//! | kind | frame | control, then data | body bytes |
//! |---|---|---|---|
//! | 0x02 | READ | transfer u64, index of the first pair u32, count u32, count x (listener's address u64, length u64): pairs first, first + 1, ... | 16 + 16 x count, count 1..=4096 |
//! | 0x03 | WRITE | transfer u64, pair index u32, listener's address u64; then the data for that address | 21..=20 + 1 MiB |
//! | 0x04 | WRITE_END | transfer u64, flags u8 (bit 0: the sender aborted; others 0), the sealed notification (empty: none) | 9..=9 + 65562 |
//! | 0x05 | NOTIFY | a sealed notification | 1..=65562 |
//!
//! From the listener back:
//!
//! | kind | frame | control, then data | body bytes |
//! |---|---|---|---|
//! | 0x81 | DATA | transfer u64, pair index u32, offset in the pair u64; then the pair's bytes from that offset | 21..=20 + 1 MiB |
//! | 0x82 | RANGE_ERROR | transfer u64, pair index u32, address u64, length u64: that pair of the read is refused | 28 |
//! | 0x83 | WRITE_ACK | transfer u64, status u8 (0 written, 1 a range refused, 2 aborted by the sender), pair u32, address u64, length u64 (the first refused chunk; zeros otherwise) | 29 |
//!
//! A sealed notification is kv-core's tagged notification (`"KT"`, a sequence number, the
//! payload of at most `MAX_MESSAGE_BYTES` = 64 KiB, and a tag made with the side-channel
//! session: [`kv_core::side::SideEndpoint::seal_notification`]), hence the 65562-byte bound.
//!
//! - The handshake must end within the side channel's `auth_timeout` of the accept. HELLO
//!   must name an established side-channel peer of that name and incarnation (the listener
//!   waits until the deadline for a handshake its side channel has not finished yet); the
//!   listener answers CHALLENGE, which the connector checks before it sends anything more (so
//!   an impostor listening at the peer's address learns no request), and PROOF must verify.
//!   The listener then serves the link once its engine has taken the peer in, on a thread of
//!   its own. Otherwise it closes the connection and counts it by cause ([`DataStatus`]).
//!   Nothing in the handshake is worth anything in a later connection: the other side's
//!   fresh nonce changes the transcript, the MACs and the tag keys.
//! - Pending connections are kept by stage (waiting for HELLO; greeted, waiting for PROOF)
//!   in kv-core's admission book, at most `max_unauthenticated` a stage and
//!   `max_unauthenticated_per_source` a stage from one address; one more displaces the oldest
//!   of its stage (from the crowded address), never one that got further. All of them share
//!   one thread. A peer session keeps at most [`MAX_LINKS_PER_PEER`] links; a newer one closes
//!   its oldest.
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
//! Bounds (DESIGN.md rule 12): pending connections as above; at most
//! [`TcpConfig::max_data_connections`] authenticated incoming data connections at once (one
//! more is refused and counted); frame bodies as above; at
//! most `max_queued_events` received notifications wait for `poll_event` (more are counted and
//! dropped), and at most [`MAX_QUEUED_NOTIFICATION_BYTES_PER_PEER`] of one peer's notification
//! bytes and [`MAX_QUEUED_NOTIFICATION_BYTES`] of all peers' (past them the connection is not
//! read until the engine takes some in: TCP's flow control holds the peer back, and nothing
//! is dropped); the rest of a frame must arrive, and a blocked write make progress, within
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
pub use kv_side_tcp::{KeySource, PortPlan, SideProbe, SideStatus};
pub use server::MAX_LINKS_PER_PEER;
pub use shared::{MAX_QUEUED_NOTIFICATION_BYTES, MAX_QUEUED_NOTIFICATION_BYTES_PER_PEER};
pub use transport::{TcpProbe, TcpTransport};

/// The side channel's default port: kv-transport-nixl's plus 100, so both can run on one host.
pub const DEFAULT_SIDE_CHANNEL_PORT: u16 = 5700;

/// How to build a [`TcpTransport`].
#[derive(Clone, Debug)]
pub struct TcpConfig {
    /// Where the side channel listens (loopback and port 5700 unless configured). Without a
    /// key it must be a loopback address.
    pub bind: SocketAddr,
    /// Whether `bind` is this rank's own port or one the engine's ranks share (peers then dial
    /// `host:port/tpRANK`); its own unless configured.
    pub port_plan: PortPlan,
    /// The data listener's IP (its port is chosen by the OS); peers connect to it, so it must
    /// be an address they reach, not `0.0.0.0`. Without a key it must be a loopback address.
    pub data_bind: IpAddr,
    /// Where the cluster key is read from when the transport is made (none: loopback only).
    pub key: KeySource,
    /// The side channel's bounds and handshake deadline; `auth_timeout` is also how long a
    /// data connection has to send HELLO, and `max_queued_events` how many received
    /// notifications may wait for `poll_event`.
    pub side_limits: kv_core::side::SideLimits,
    /// Authenticated incoming data connections held at once (each has a thread); one more is
    /// refused and counted. Pending ones are bounded by the side limits' admission budgets.
    pub max_data_connections: usize,
    /// Ask peers to tag the payload bytes they send this transport too (DATA for its reads,
    /// WRITE for writes into it), so that bytes altered on the way are refused; frame heads,
    /// addresses and acknowledgements are always tagged. Off by default: it costs a Poly1305
    /// pass over every byte on each side (`cargo xtask bench` shows how much).
    pub payload_tags: bool,
}

impl Default for TcpConfig {
    fn default() -> Self {
        let side_limits = kv_core::side::SideLimits::default();
        TcpConfig {
            bind: SocketAddr::from((Ipv4Addr::LOCALHOST, DEFAULT_SIDE_CHANNEL_PORT)),
            port_plan: PortPlan::Own,
            data_bind: IpAddr::V4(Ipv4Addr::LOCALHOST),
            key: KeySource::None,
            max_data_connections: side_limits.max_peers * server::MAX_LINKS_PER_PEER,
            side_limits,
            payload_tags: false,
        }
    }
}

/// What the data path holds now and has refused: what a test of the bounds checks.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct DataStatus {
    /// Authenticated incoming data connections open.
    pub incoming: usize,
    /// Incoming data connections still proving themselves, by stage (waiting for HELLO,
    /// greeted, proven and waiting for the engine to take the peer in), indexed as
    /// [`kv_core::side::admission::Stage::ALL`].
    pub pending_by_stage: [usize; 3],
    /// Outgoing data connections open.
    pub outgoing: usize,
    /// Incoming connections closed before they authenticated, or displaced: all causes.
    pub connections_refused: u64,
    /// The same by cause, indexed as [`kv_core::RefusalCause::ALL`]: `overloaded` (displaced
    /// by a newcomer of the same stage, or over a bound), `timeout` (no handshake within
    /// `auth_timeout`), `unauthenticated` (a PROOF that does not verify), `malformed`,
    /// `version`, `stale` (an incarnation older than the established one).
    pub refused_by_cause: [u64; kv_core::RefusalCause::ALL.len()],
    /// Frames that broke the protocol (a kind not accepted there, a length outside its bound,
    /// a malformed body); each closed its connection.
    pub frames_refused: u64,
    /// Frames whose tag was not the one the link's session makes next (forged, replayed,
    /// reordered or altered), on either side of a link; each closed its connection.
    pub frames_forged: u64,
    /// READ and WRITE ranges outside this transport's registrations, answered with an error
    /// and never touched.
    pub ranges_refused: u64,
    /// Received notifications and refusals dropped because `max_queued_events` waited already.
    pub events_dropped: u64,
    /// Bytes of received notifications waiting for the engine.
    pub queued_notification_bytes: usize,
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
