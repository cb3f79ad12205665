//! The ports: what kvflow needs from a clock, a transport and memory.
//!
//! Adapters implement them (kv-transport-nixl over NIXL/UCX, kv-cuda over CUDA) and so does
//! kv-testkit (a manual clock, a seeded in-memory transport, in-memory memory). Every trait is
//! object-safe and no method blocks: a transfer is posted and then polled, a connection is
//! started and its outcome arrives as a [`PeerEvent`], exactly as NIXL's own API is shaped
//! (post a transfer request, poll its status, drain notifications). A driver loop calls the
//! `poll_*` methods after every input and at its next wake-up.

use std::fmt;
use std::task::Waker;
use std::time::Duration;

use crate::handshake::HandshakeError;
use crate::id::AgentName;
use crate::plan::DescriptorPair;
pub use crate::side::RefusalCause;
use crate::time::Time;
use crate::wire::Handshake;

/// A monotonic clock. Cores are handed its readings; only drivers hold a `Clock`.
pub trait Clock: Send + Sync {
    /// The current time on this engine's clock.
    fn now(&self) -> Time;
}

/// The kind of memory a region lives in; NIXL registers DRAM and VRAM differently.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, serde::Serialize, serde::Deserialize)]
pub enum MemoryKind {
    /// Pageable host memory.
    Host,
    /// Page-locked host memory (registers as DRAM, copies to a GPU without staging).
    PinnedHost,
    /// Memory of the GPU with this device ordinal.
    Device(u32),
}

impl MemoryKind {
    /// The device id NIXL registers the region with: the GPU ordinal, or 0 for host memory.
    pub fn device_id(&self) -> u32 {
        match self {
            MemoryKind::Host | MemoryKind::PinnedHost => 0,
            MemoryKind::Device(ordinal) => *ordinal,
        }
    }
}

/// A handle to an allocated region, unique within one `Memory`.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct RegionId(pub u64);

/// An allocated region: what a transport needs to register it.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct Region {
    /// The handle to free it by.
    pub id: RegionId,
    /// Where it lives.
    pub kind: MemoryKind,
    /// Address of its first byte (a device address for device memory).
    pub addr: u64,
    /// Its length in bytes.
    pub len: u64,
}

/// Why a memory operation failed.
#[derive(Clone, PartialEq, Eq, Debug, thiserror::Error)]
pub enum MemoryError {
    /// The region is not allocated here.
    #[error("unknown memory region {0:?}")]
    UnknownRegion(RegionId),
    /// A range falls outside its region.
    #[error("range {offset}+{len} is outside region {region:?} of {region_len} bytes")]
    OutOfBounds {
        /// The region.
        region: RegionId,
        /// Start of the range.
        offset: u64,
        /// Length of the range.
        len: u64,
        /// Bytes in the region.
        region_len: u64,
    },
    /// This memory cannot provide the kind asked for.
    #[error("memory kind {kind:?} is not available: {reason}")]
    Unavailable {
        /// The kind asked for.
        kind: MemoryKind,
        /// Why, and what would provide it.
        reason: String,
    },
    /// The allocation failed.
    #[error("cannot allocate {len} bytes of {kind:?}: {reason}")]
    Allocation {
        /// The kind asked for.
        kind: MemoryKind,
        /// Bytes asked for.
        len: u64,
        /// The allocator's account.
        reason: String,
    },
}

/// KV pool memory: allocate regions, free them, and move bytes in and out for filling and
/// verification (device memory goes through a host copy).
pub trait Memory: Send {
    /// Allocates `len` bytes of `kind`.
    fn allocate(&mut self, kind: MemoryKind, len: u64) -> Result<Region, MemoryError>;
    /// Frees a region; its bytes must no longer be registered with a transport.
    fn free(&mut self, region: RegionId) -> Result<(), MemoryError>;
    /// Copies `out.len()` bytes at `offset` of `region` into `out`.
    fn read(&self, region: RegionId, offset: u64, out: &mut [u8]) -> Result<(), MemoryError>;
    /// Copies `data` to `offset` of `region`.
    fn write(&mut self, region: RegionId, offset: u64, data: &[u8]) -> Result<(), MemoryError>;
}

/// Where to reach a peer's side channel: `host:port` (a port of the rank's own) or
/// `host:port/tpRANK` (one rank of an engine whose ranks share a port, [`PeerAddress::of_rank`])
/// over TCP, an agent name for the fake.
#[derive(Clone, PartialEq, Eq, Hash, Debug, serde::Serialize, serde::Deserialize)]
#[serde(transparent)]
pub struct PeerAddress(pub String);

impl PeerAddress {
    /// The address of TP rank `rank` of an engine whose ranks share one side-channel port at
    /// `host_port` (`host:port`): `host:port/tpRANK`. The HELLO names the rank, and the
    /// engine's process that accepts hands the connection to that rank's process.
    pub fn of_rank(host_port: &str, rank: u32) -> PeerAddress {
        PeerAddress(format!("{host_port}/tp{rank}"))
    }

    /// What a side channel dials, and the rank its HELLO asks for: `host:port/tpRANK` names
    /// rank RANK of an engine whose ranks share the port; `host:port` asks for whichever rank
    /// listens there (a port of its own), `None`.
    pub fn side_target(&self) -> (&str, Option<u32>) {
        match self.0.rsplit_once("/tp") {
            Some((host_port, rank)) if !host_port.is_empty() && rank.bytes().all(|b| b.is_ascii_digit()) => {
                match rank.parse::<u32>() {
                    Ok(rank) if rank != u32::MAX => (host_port, Some(rank)),
                    _ => (&self.0, None),
                }
            }
            _ => (&self.0, None),
        }
    }
}

impl fmt::Display for PeerAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A read pulls remote bytes into local memory; a write pushes local bytes to the peer.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum TransferOp {
    /// Remote to local (pull mode, D posts).
    Read,
    /// Local to remote (push mode, P posts).
    Write,
}

/// How often an engine must poll a transport for what it cannot signal (see
/// [`Transport::set_waker`]): `None` where everything of that kind wakes the waker.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct PollIntervals {
    /// While transfers are in flight: their completion.
    pub transfers: Option<Duration>,
    /// While the engine waits for a peer's notification (a completion, an acknowledgement).
    pub notifications: Option<Duration>,
}

impl PollIntervals {
    /// A transport that signals nothing: poll every millisecond for both.
    pub const UNSIGNALLED: PollIntervals =
        PollIntervals { transfers: Some(Duration::from_millis(1)), notifications: Some(Duration::from_millis(1)) };
}

/// A transport's prepared lists by id, each of local memory or of one peer's: what
/// [`Transport::prepare`] hands out and [`Transport::post_prepared`] names, with the port's
/// errors for a list that was never prepared or belongs to another side. Adapters keep what
/// their backend needs for a list (ranges, a handle) as `T`.
#[derive(Debug)]
pub struct PreparedLists<T> {
    lists: std::collections::BTreeMap<PreparedId, (Option<AgentName>, T)>,
    next: u64,
}

impl<T> Default for PreparedLists<T> {
    fn default() -> Self {
        PreparedLists { lists: std::collections::BTreeMap::new(), next: 0 }
    }
}

impl<T> PreparedLists<T> {
    /// Keeps `list`, of local memory (`owner` none) or of `owner`'s, under a new id.
    pub fn insert(&mut self, owner: Option<AgentName>, list: T) -> PreparedId {
        let id = PreparedId(self.next);
        self.next += 1;
        self.lists.insert(id, (owner, list));
        id
    }

    /// List `id`, which must be of `owner`'s memory (`None`: local).
    pub fn get(&self, id: PreparedId, owner: Option<&AgentName>) -> Result<&T, TransportError> {
        match self.lists.get(&id) {
            Some((who, list)) if who.as_ref() == owner => Ok(list),
            Some(_) => Err(TransportError::InvalidTransfer(format!("{id:?} is prepared for another side"))),
            None => Err(TransportError::InvalidTransfer(format!("{id:?} was never prepared"))),
        }
    }

    /// Forgets every list of `peer`'s memory (the peer is gone).
    pub fn forget_peer(&mut self, peer: &AgentName) {
        self.lists.retain(|_, (owner, _)| owner.as_ref() != Some(peer));
    }

    /// How many lists are kept.
    pub fn len(&self) -> usize {
        self.lists.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.lists.is_empty()
    }
}

/// A posted transfer's handle, unique within one transport.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct TransferId(pub u64);

/// A transfer to post: the descriptor pairs of a [`crate::TransferPlan`] with one peer.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct TransferRequest {
    /// Read or write.
    pub op: TransferOp,
    /// The peer agent (a connected one).
    pub peer: AgentName,
    /// Local and remote ranges; lengths pair up.
    pub pairs: Vec<DescriptorPair>,
    /// Delivered to the peer when the transfer completes, and only then.
    pub notification: Option<Vec<u8>>,
}

/// A descriptor list prepared once, for reuse by index: local, or of one peer's memory.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct PreparedId(pub u64);

/// A transfer that names entries of two prepared lists, pairwise, instead of addresses.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct PreparedTransfer {
    /// Read or write.
    pub op: TransferOp,
    /// The peer agent (a connected one).
    pub peer: AgentName,
    /// A local list, from [`Transport::prepare`] with no peer.
    pub local: PreparedId,
    /// Entries of `local`.
    pub local_indices: Vec<u32>,
    /// A list of `peer`'s memory, from [`Transport::prepare`] with that peer.
    pub remote: PreparedId,
    /// Entries of `remote`, one per entry of `local_indices`, of equal lengths.
    pub remote_indices: Vec<u32>,
    /// Delivered to the peer when the transfer completes, and only then.
    pub notification: Option<Vec<u8>>,
}

impl TransferRequest {
    /// The bytes it moves: its pairs' lengths.
    pub fn bytes(&self) -> u64 {
        self.pairs.iter().map(|p| p.len).sum()
    }
}

/// The bytes of transfers as they are posted, for whoever measures them above a transport (the
/// connector's driver, an engine's own timing): a transfer of address pairs moves its pairs'
/// lengths, one of prepared entries the lengths of its local list's entries, remembered here
/// when the list is prepared.
#[derive(Debug, Default)]
pub struct TransferSizes {
    local_lists: std::collections::BTreeMap<PreparedId, Vec<u64>>,
}

impl TransferSizes {
    /// A list of `ranges` was prepared as `id`, of local memory when `peer` is none (a peer's
    /// lists pair up with local entries of equal lengths, so only local ones are kept).
    pub fn prepared(&mut self, peer: Option<&AgentName>, ranges: &[(u64, u64)], id: PreparedId) {
        if peer.is_none() {
            self.local_lists.insert(id, ranges.iter().map(|r| r.1).collect());
        }
    }

    /// The bytes `request` moves: 0 for entries of a list never seen prepared.
    pub fn of_prepared(&self, request: &PreparedTransfer) -> u64 {
        let Some(lengths) = self.local_lists.get(&request.local) else { return 0 };
        request.local_indices.iter().filter_map(|&i| lengths.get(i as usize)).sum()
    }
}

impl PreparedTransfer {
    /// Refuses a transfer whose index lists are empty or of unequal lengths.
    pub fn check_counts(&self) -> Result<(), TransportError> {
        let (l, r) = (self.local_indices.len(), self.remote_indices.len());
        if l != r || l == 0 {
            return Err(TransportError::InvalidTransfer(format!("{l} local entries for {r} remote ones")));
        }
        Ok(())
    }
}

/// Where a posted transfer stands.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum TransferStatus {
    /// Still moving.
    InProgress,
    /// Every byte arrived; the notification, if any, was handed to the transport.
    Done,
    /// It failed; none of its bytes may be trusted and no notification was sent.
    Failed(TransportError),
}

/// A notification from a peer agent.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct Notification {
    /// The sender, as the transport authenticated it.
    pub from: AgentName,
    /// The bytes (a [`crate::wire::Message`] frame, or garbage to count and drop).
    pub payload: Vec<u8>,
}

/// A handshake that completed, with the local clock readings around it.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct PeerInfo {
    /// The peer's agent.
    pub agent: AgentName,
    /// What the peer sent.
    pub handshake: Handshake,
    /// Local clock when the local offer was sent.
    pub sent_at: Time,
    /// Local clock when the peer's offer arrived.
    pub received_at: Time,
    /// Where we connected to reach the peer; `None` when it connected to us. A transport
    /// that cannot take up a peer it dialed (its metadata does not load) reports
    /// [`PeerEvent::ConnectFailed`] for this address, so that the engine tries again later.
    pub dialed: Option<PeerAddress>,
}

impl PeerInfo {
    /// The peer's clock minus ours, from this sample: `peer_clock - (sent + received) / 2`.
    pub fn clock_offset_nanos(&self) -> i64 {
        let mid = (i128::from(self.sent_at.as_nanos()) + i128::from(self.received_at.as_nanos())) / 2;
        let offset = i128::from(self.handshake.clock.as_nanos()) - mid;
        offset.clamp(i128::from(i64::MIN), i128::from(i64::MAX)) as i64
    }

    /// The sample's round trip, a bound on its error.
    pub fn round_trip(&self) -> std::time::Duration {
        self.received_at.saturating_since(self.sent_at)
    }
}

/// What happened to a peer, in the order it happened: a transport hands out a peer's
/// notifications only after its `Connected`, and its `Lost` only after every notification it
/// sent before it was lost, so that nothing a lost peer said is dropped uncounted.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum PeerEvent {
    /// A handshake completed, in either direction: the peer may now exchange KV with us.
    Connected(Box<PeerInfo>),
    /// A connection we started failed or was refused.
    ConnectFailed {
        /// Where we tried.
        address: PeerAddress,
        /// Why.
        error: TransportError,
    },
    /// A connected peer's side channel closed: it is gone.
    Lost(AgentName),
    /// Input the transport refused before any machine saw it, and goes on serving others: a
    /// handshake from a peer that did not prove it holds the cluster key, is incompatible, or
    /// claims a live or stale name; or a notification whose tag does not verify. Machines count
    /// it as an ignored message.
    Refused {
        /// The peer as it named itself, if it said.
        peer: Option<AgentName>,
        /// Why, by kind.
        cause: RefusalCause,
        /// Why, in words, naming both sides' values where they disagree.
        reason: String,
    },
    /// A notification from a connected peer.
    Notification(Notification),
    /// The transport stopped listening to a connected peer it could not keep within its
    /// bounds, and closes its side channel: the peer's [`PeerEvent::Lost`] follows, after
    /// nothing more from it. Machines count it (`kvflow_peers_cut_off_total{reason}`).
    CutOff {
        /// The peer.
        peer: AgentName,
        /// Why, by kind.
        reason: CutOffReason,
    },
}

/// Why a transport cut a connected peer off ([`PeerEvent::CutOff`]).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum CutOffReason {
    /// Its notifications outran what the engine takes in: the transport dropped more of them
    /// unread, beyond its bound on what one peer may have waiting, than that bound holds.
    NotificationFlood,
}

impl CutOffReason {
    /// Every reason, in declaration order.
    pub const ALL: [CutOffReason; 1] = [CutOffReason::NotificationFlood];

    /// The reason's name, in lower case (a metric's label value).
    pub fn as_str(self) -> &'static str {
        match self {
            CutOffReason::NotificationFlood => "notification_flood",
        }
    }

    /// Its place in [`CutOffReason::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }
}

/// Why a transport operation failed.
#[derive(Clone, PartialEq, Eq, Debug, thiserror::Error)]
pub enum TransportError {
    /// No handshake completed with this peer.
    #[error("unknown peer {0}")]
    UnknownPeer(AgentName),
    /// Nobody answers at this address.
    #[error("no peer at {0}")]
    Unreachable(PeerAddress),
    /// The peer was lost.
    #[error("peer {0} is lost")]
    PeerLost(AgentName),
    /// The handshake was refused.
    #[error("handshake refused: {0}")]
    Handshake(#[from] HandshakeError),
    /// A descriptor is not inside a registered region.
    #[error("{side} range {addr:#x}+{len} is not in a registered region")]
    NotRegistered {
        /// `"local"` or `"remote"`.
        side: &'static str,
        /// Start of the range.
        addr: u64,
        /// Its length.
        len: u64,
    },
    /// A descriptor pair's lengths or a request's shape are wrong.
    #[error("invalid transfer: {0}")]
    InvalidTransfer(String),
    /// The transfer handle is not known (never posted, or already reported done or failed).
    #[error("unknown transfer {0:?}")]
    UnknownTransfer(TransferId),
    /// The transfer failed in flight.
    #[error("transfer failed: {0}")]
    TransferFailed(String),
    /// A read failed part-way, and the transport knows where: only the local byte ranges in
    /// `spoiled` (address, length) may hold bad bytes, and every other byte the read was to
    /// move arrived whole. A transport that cannot tell (NIXL) reports
    /// [`TransportError::TransferFailed`], and then none of the read's bytes may be trusted.
    #[error("read failed part-way ({} local ranges spoiled): {reason}", spoiled.len())]
    PartlyFailed {
        /// Why.
        reason: String,
        /// The local `(address, length)` ranges that may hold bad bytes.
        spoiled: Vec<(u64, u64)>,
    },
    /// A notification is larger than the transport carries.
    #[error("notification of {len} bytes exceeds the {max}-byte limit")]
    NotificationTooLarge {
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The backend failed.
    #[error("transport backend: {0}")]
    Backend(String),
    /// The backend failed with an error of its own, kept as the source (see
    /// [`TransportError::backend`]).
    #[error("transport backend: {what}: {source}")]
    BackendError {
        /// What was being done.
        what: String,
        /// The backend's error.
        source: SourceError,
    },
}

impl TransportError {
    /// The backend failed at `what` with `source`, which stays reachable through
    /// [`std::error::Error::source`].
    pub fn backend(what: impl Into<String>, source: impl std::error::Error + Send + Sync + 'static) -> Self {
        TransportError::BackendError { what: what.into(), source: SourceError(std::sync::Arc::new(source)) }
    }
}

/// An adapter's own error under a port's, shared so that the port's errors stay `Clone`; two
/// are equal when their messages are.
#[derive(Clone, Debug)]
pub struct SourceError(pub std::sync::Arc<dyn std::error::Error + Send + Sync>);

impl fmt::Display for SourceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for SourceError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

impl PartialEq for SourceError {
    fn eq(&self, other: &Self) -> bool {
        self.0.to_string() == other.0.to_string()
    }
}

impl Eq for SourceError {}

/// Moving KV bytes and small notifications between TP-rank agents.
///
/// One transport is one agent (one TP rank). Regions are registered once; a transfer names
/// descriptor pairs within registered regions on both sides; completion is polled;
/// notifications ride on completed transfers or are sent alone; peers come and go through
/// [`PeerEvent`]s. Liveness comes from the side channel, not from transfer errors.
pub trait Transport: Send {
    /// This transport's agent.
    fn agent(&self) -> &AgentName;
    /// Makes a region available to local and remote transfers.
    fn register(&mut self, region: &Region) -> Result<(), TransportError>;
    /// Withdraws a region; transfers that name it fail from now on.
    fn deregister(&mut self, region: RegionId) -> Result<(), TransportError>;
    /// Starts a handshake with the peer at `address`; the outcome is a [`PeerEvent`].
    fn connect(&mut self, address: &PeerAddress) -> Result<(), TransportError>;
    /// Posts a transfer.
    fn post(&mut self, request: TransferRequest) -> Result<TransferId, TransportError>;
    /// Prepares a descriptor list of `(address, length)` ranges once: local memory when `peer`
    /// is `None`, else that connected peer's. Transfers then name its entries by index
    /// ([`Transport::post_prepared`]), so that descriptors are checked once, not per transfer.
    fn prepare(&mut self, peer: Option<&AgentName>, ranges: &[(u64, u64)]) -> Result<PreparedId, TransportError>;
    /// Posts a transfer between entries of two prepared lists.
    fn post_prepared(&mut self, request: PreparedTransfer) -> Result<TransferId, TransportError>;
    /// Where a transfer stands; `Done` and `Failed` are reported once, then the id is unknown.
    /// A write is `Done` only once its bytes are in the peer's memory (NIXL flushes the
    /// endpoint first; the TCP transport waits for the peer's acknowledgement): a notification
    /// sent after it, on a later transfer or alone, never overtakes them. Push writes ahead
    /// of their export rely on it.
    fn poll_transfer(&mut self, id: TransferId) -> TransferStatus;
    /// Sends a notification to a connected peer.
    fn send_notification(&mut self, peer: &AgentName, payload: &[u8]) -> Result<(), TransportError>;
    /// The next peer event or notification, if any, in the order they happened (see [`PeerEvent`]).
    fn poll_event(&mut self) -> Option<PeerEvent>;
    /// Drops a connected peer that something other than its side channel says is gone (its
    /// discovery registration lapsed): its side channel closes, transfers to it are refused
    /// from now on, and [`Transport::poll_event`] reports it [`PeerEvent::Lost`] once, after
    /// the notifications it sent before. A peer not connected: nothing happens.
    fn disconnect(&mut self, peer: &AgentName);
    /// Wakes `waker` whenever the transport's own threads queue something for
    /// [`Transport::poll_event`] (a handshake, a lost peer), so that an engine can wait instead
    /// of polling; the waker is woken at once if something is queued already. What the
    /// transport cannot signal it polls for at [`Transport::poll_intervals`]. A transport
    /// with no threads of its own (the default) keeps no waker.
    fn set_waker(&mut self, waker: Waker) {
        drop(waker);
    }
    /// How often to poll for what the waker does not announce.
    fn poll_intervals(&self) -> PollIntervals {
        PollIntervals::UNSIGNALLED
    }
    /// How transfers of whole blocks go fastest over this transport, given the memory it has
    /// registered and its backend's configuration. The default, prepared lists, checks
    /// descriptors once per peer instead of per transfer.
    fn descriptors(&self) -> Descriptors {
        Descriptors::Prepared
    }
}

/// How a transfer of whole blocks names its bytes (the connectors' choice, a transport's
/// preference, or the engine's override).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum Descriptors {
    /// Address pairs, merged where contiguous on both sides ([`Transport::post`]): a few
    /// large descriptors, which a backend's thread pool can split across threads.
    Pairs,
    /// Entries of lists prepared once per peer, named by index
    /// ([`Transport::post_prepared`]): descriptors are checked once, not per transfer.
    Prepared,
}

impl Descriptors {
    /// The choice's name, as configuration writes it: `pairs` or `prepared`.
    pub fn as_str(self) -> &'static str {
        match self {
            Descriptors::Pairs => "pairs",
            Descriptors::Prepared => "prepared",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::id::EngineId;
    use crate::layout::KvLayout;
    use crate::wire::{Role, PROTOCOL_VERSION};

    #[test]
    fn the_ports_are_object_safe() {
        fn takes(_: Option<&dyn Transport>, _: Option<&dyn Memory>, _: Option<&dyn Clock>) {}
        takes(None, None, None);
    }

    #[test]
    fn prepared_lists_are_found_only_for_their_own_side_and_go_with_their_peer() {
        let (p, q) = (AgentName::new(EngineId::new("p"), 0), AgentName::new(EngineId::new("q"), 0));
        let mut lists = PreparedLists::default();
        let local = lists.insert(None, "local");
        let of_p = lists.insert(Some(p.clone()), "p's");
        let of_q = lists.insert(Some(q.clone()), "q's");
        assert_eq!(lists.get(local, None), Ok(&"local"));
        assert_eq!(lists.get(of_p, Some(&p)), Ok(&"p's"));
        let other = |id| Err(TransportError::InvalidTransfer(format!("{id:?} is prepared for another side")));
        assert_eq!(lists.get(of_p, None), other(of_p), "a peer's list named as local");
        assert_eq!(lists.get(of_p, Some(&q)), other(of_p), "p's list named as q's");
        lists.forget_peer(&p);
        let never = Err(TransportError::InvalidTransfer(format!("{of_p:?} was never prepared")));
        assert_eq!(lists.get(of_p, Some(&p)), never, "a lost peer's lists are gone");
        assert_eq!((lists.len(), lists.get(of_q, Some(&q))), (2, Ok(&"q's")));
    }

    #[test]
    fn an_address_names_a_rank_of_a_shared_port_or_none() {
        let shared = PeerAddress::of_rank("10.0.0.1:5600", 3);
        assert_eq!(shared.0, "10.0.0.1:5600/tp3");
        assert_eq!(shared.side_target(), ("10.0.0.1:5600", Some(3)));
        assert_eq!(PeerAddress::of_rank("[::1]:5600", 0).side_target(), ("[::1]:5600", Some(0)));
        assert_eq!(PeerAddress("10.0.0.1:5600".into()).side_target(), ("10.0.0.1:5600", None));
        // What is not a rank stays part of the address, which then does not resolve.
        for odd in ["h:1/tp", "h:1/tpx", "h:1/tp-1", "h:1/tp4294967295", "/tp1"] {
            assert_eq!(PeerAddress(odd.into()).side_target(), (odd, None), "{odd}");
        }
    }

    #[test]
    fn clock_offset_is_taken_from_the_middle_of_the_round_trip() {
        let layout = KvLayout::split_kv(1, 16, 1, 1, crate::Dtype::Fp8E4m3);
        let info = PeerInfo {
            agent: AgentName::new(EngineId::new("p"), 0),
            handshake: Handshake {
                protocol_version: PROTOCOL_VERSION,
                engine: EngineId::new("p"),
                rank: 0,
                tp_size: 1,
                pp_size: 1,
                instance: 0,
                role: Role::Prefill,
                model: String::new(),
                layout,
                num_blocks: 1,
                regions: Vec::new(),
                compat_hash: 0,
                clock: Time::from_millis(1_000_005),
                agent_metadata: Vec::new(),
            },
            sent_at: Time::from_millis(100),
            received_at: Time::from_millis(110),
            dialed: None,
        };
        assert_eq!(info.clock_offset_nanos(), 999_900 * 1_000_000);
        assert_eq!(info.round_trip(), std::time::Duration::from_millis(10));
    }
}

#[cfg(test)]
mod source_tests {
    use std::error::Error;

    use super::TransportError;

    #[test]
    fn a_backend_error_keeps_its_source_and_stays_clone_and_comparable() {
        let io = std::io::Error::new(std::io::ErrorKind::AddrInUse, "address in use");
        let e = TransportError::backend("side channel cannot listen on 127.0.0.1:5600", io);
        assert_eq!(e.to_string(), "transport backend: side channel cannot listen on 127.0.0.1:5600: address in use");
        assert_eq!(e.source().map(ToString::to_string).as_deref(), Some("address in use"));
        assert_eq!(e.clone(), e);
        let other = TransportError::backend("side channel", std::io::Error::other("another"));
        assert_ne!(e, other);
    }
}
