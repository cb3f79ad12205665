//! [`TcpTransport`]: kv-core's [`Transport`] over TCP sockets, for one TP rank.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::Arc;
use std::task::Waker;
use std::thread::JoinHandle;
use std::time::Instant;

use kv_core::side::{ConnId, SideEvent};
use kv_core::wire::MAX_MESSAGE_BYTES;
use kv_core::{
    AgentName, Clock, DescriptorPair, Handshake, MemoryKind, PeerAddress, PeerEvent, PeerInfo, PollIntervals,
    PreparedId, PreparedLists, PreparedTransfer, RefusalCause, Region, RegionId, TransferId, TransferOp,
    TransferRequest, TransferStatus, Transport, TransportError,
};
use kv_side_tcp::{Item, SideChannel, SideStatus};

use crate::client::{Job, OutConn, Target};
use crate::metadata::{self, PeerMetadata};
use crate::server::Listener;
use crate::shared::{lock, Established, Flight, Pair, Shared, CLOSE_GRACE};
use crate::{DataStatus, TcpConfig, TcpError};

/// Reads a [`TcpTransport`]'s side-channel and data-path status from any thread (see
/// [`TcpTransport::status_probe`]); it keeps the transport's shared state, not its threads.
#[derive(Clone)]
pub struct TcpProbe {
    side: kv_side_tcp::SideProbe,
    data: Arc<Shared>,
}

impl std::fmt::Debug for TcpProbe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpProbe").finish_non_exhaustive()
    }
}

impl TcpProbe {
    /// What the side channel holds and refused.
    pub fn side(&self) -> SideStatus {
        self.side.status()
    }

    /// What the data path holds and refused.
    pub fn data(&self) -> DataStatus {
        self.data.status()
    }
}

/// A connected peer: its side-channel connection, what its metadata says, and the data
/// connection that carries what this agent sends it.
struct Peer {
    conn: ConnId,
    incarnation: u64,
    meta: PeerMetadata,
    out: OutConn,
}

/// kv-core's [`Transport`] over plain TCP: one agent per TP rank, the TCP side channel for
/// the handshake and liveness, and a data listener that peers connect to with the capability
/// its metadata carries. See the crate docs for the protocol.
pub struct TcpTransport {
    name: AgentName,
    incarnation: u64,
    shared: Arc<Shared>,
    data_addr: SocketAddr,
    listener: Option<Listener>,
    peers: HashMap<AgentName, Peer>,
    /// Each prepared list's `(address, length)` ranges.
    prepared: PreparedLists<Vec<(u64, u64)>>,
    events: VecDeque<PeerEvent>,
    /// Peers whose side channel closed (connection, agent, incarnation, when), waiting for
    /// their data connections to end.
    closing: Vec<(ConnId, AgentName, u64, Instant)>,
    /// Threads of connections closed while they were still connecting.
    retired: Vec<JoinHandle<()>>,
    next_transfer: u64,
    next_conn: u64,
}

impl std::fmt::Debug for TcpTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpTransport")
            .field("name", &self.name)
            .field("side", &self.shared.side.local_addr())
            .field("data", &self.data_addr)
            .field("peers", &self.peers.len())
            .finish()
    }
}

fn check_config(config: &TcpConfig, key: &kv_core::side::ClusterKey) -> Result<(), TcpError> {
    kv_side_tcp::check_bind(config.bind, key).map_err(TcpError::Config)?;
    if config.data_bind.is_unspecified() {
        return Err(TcpError::Config(format!(
            "data_bind {} is unspecified, but peers connect to the address it names: give this host's address",
            config.data_bind
        )));
    }
    if key.is_none() && !config.data_bind.is_loopback() {
        return Err(TcpError::Config(format!(
            "the data listener would listen on {} without a cluster key: set the transport's key, or bind to loopback",
            config.data_bind
        )));
    }
    if config.max_data_connections == 0 {
        return Err(TcpError::Config("max_data_connections is 0: no peer could connect".into()));
    }
    Ok(())
}

impl TcpTransport {
    /// Starts the data listener and the side channel of the rank that `offer` describes; the
    /// listener's address and the (empty) registration table become the offer's agent
    /// metadata.
    ///
    /// Safe to call, use and drop inside or outside a tokio runtime: the sockets run on
    /// threads of their own, which `Drop` stops and joins.
    pub fn new(mut offer: Handshake, config: &TcpConfig, clock: Arc<dyn Clock>) -> Result<Self, TcpError> {
        let key = config.key.load()?;
        check_config(config, &key)?;
        let name = AgentName::new(offer.engine.clone(), offer.rank);
        let bind = SocketAddr::new(config.data_bind, 0);
        let listener = kv_side_tcp::listen(bind).map_err(|e| TcpError::Listen { addr: bind, reason: e.to_string() })?;
        let data_addr = listener.local_addr().map_err(|e| TcpError::Listen { addr: bind, reason: e.to_string() })?;
        offer.agent_metadata =
            metadata::encode(data_addr, &[]).map_err(|e| TcpError::Start(format!("local metadata: {e}")))?;
        let incarnation = offer.instance;
        let side = SideChannel::start_on(config.bind, config.port_plan, key, config.side_limits.clone(), offer, clock)?;
        let limits = config.side_limits.clone();
        let shared = Arc::new(Shared::new(side, limits, config.max_data_connections, config.payload_tags));
        let listener = Listener::start(shared.clone(), listener)?;
        tracing::debug!(agent = %name, %data_addr, side = %shared.side.local_addr(), "TCP transport listening");
        Ok(TcpTransport {
            name,
            incarnation,
            shared,
            data_addr,
            listener: Some(listener),
            peers: HashMap::new(),
            prepared: PreparedLists::default(),
            events: VecDeque::new(),
            closing: Vec::new(),
            retired: Vec::new(),
            next_transfer: 0,
            next_conn: 0,
        })
    }

    /// Where the side channel listens (on a shared port: the port).
    pub fn side_channel_addr(&self) -> SocketAddr {
        self.shared.side.local_addr()
    }

    /// What peers dial to reach this rank's side channel: `host:port`, or `host:port/tpRANK`
    /// on a port the engine's ranks share.
    pub fn side_channel_address(&self) -> &PeerAddress {
        self.shared.side.address()
    }

    /// Where the data listener listens (peers learn it from the handshake).
    pub fn data_addr(&self) -> SocketAddr {
        self.data_addr
    }

    /// What the side channel holds now, and what its bounds turned away.
    pub fn side_status(&self) -> SideStatus {
        self.shared.side.status()
    }

    /// What the data path holds now, what it refused, and the bytes it moved.
    pub fn data_status(&self) -> DataStatus {
        self.shared.status()
    }

    /// A handle that reads both statuses from another thread (an engine's metrics endpoint).
    pub fn status_probe(&self) -> TcpProbe {
        TcpProbe { side: self.shared.side.status_probe(), data: self.shared.clone() }
    }

    /// Hands the side channel the metadata peers handshaking from now on learn.
    fn publish_metadata(&self) -> Result<(), TransportError> {
        let mut offer = self.shared.side.offer();
        offer.agent_metadata = metadata::encode(self.data_addr, &self.shared.registry.table())
            .map_err(|e| TransportError::Backend(format!("local metadata: {e}")))?;
        self.shared.side.set_offer(offer)
    }

    /// Opens a data connection to a peer.
    fn open_conn(
        &mut self,
        peer: &AgentName,
        incarnation: u64,
        meta: &PeerMetadata,
    ) -> Result<OutConn, TransportError> {
        self.next_conn += 1;
        let target = Target {
            peer: peer.clone(),
            peer_incarnation: incarnation,
            addr: meta.data,
            payload_tags: self.shared.payload_tags,
            me: self.name.clone(),
            incarnation: self.incarnation,
        };
        OutConn::open(&self.shared, self.next_conn, target)
    }

    /// Closes a data connection, failing what it carries with `why`.
    fn close_conn(&mut self, mut out: OutConn, why: TransportError) {
        if let Some(thread) = out.close(&self.shared, why) {
            self.retired.push(thread);
        }
    }

    /// Takes in what the side channel and the data connections saw, in order.
    fn pump(&mut self) {
        let before = self.events.len();
        loop {
            self.settle_closing();
            let Some(item) = self.shared.side.poll_item() else { break };
            match item {
                Item::PeerClosed(conn) => match self.peers.iter().find(|(_, p)| p.conn == conn) {
                    Some((agent, peer)) => {
                        // Its loss comes once its data connections delivered what it sent.
                        let (agent, incarnation, now) = (agent.clone(), peer.incarnation, Instant::now());
                        if let Some(e) =
                            lock(&self.shared.peers).get_mut(&agent).filter(|e| e.incarnation == incarnation)
                        {
                            e.closing_since.get_or_insert(now);
                            self.shared.peers_changed_locked();
                        }
                        self.closing.push((conn, agent, incarnation, now));
                    }
                    None => self.shared.side.peer_closed(conn),
                },
                Item::Event(SideEvent::Connected { conn, info }) => self.connected(conn, info),
                Item::Event(SideEvent::ConnectFailed { address, error, .. }) => {
                    self.events.push_back(PeerEvent::ConnectFailed { address, error });
                }
                Item::Event(SideEvent::Refused { claimed, cause, reason, .. }) => {
                    self.events.push_back(PeerEvent::Refused { peer: claimed, cause, reason });
                }
                Item::Event(SideEvent::Lost { conn, agent, instance }) => {
                    self.events.extend(self.shared.take_inbox());
                    // Only the connection's own peer goes: a newer incarnation may hold the name.
                    if self.peers.get(&agent).is_some_and(|p| p.conn == conn) {
                        let mut peers = lock(&self.shared.peers);
                        if peers.get(&agent).is_some_and(|e| e.incarnation == instance) {
                            peers.remove(&agent);
                            self.shared.peers_changed_locked();
                        }
                        drop(peers);
                        if let Some(peer) = self.peers.remove(&agent) {
                            self.close_conn(peer.out, TransportError::PeerLost(agent.clone()));
                        }
                        self.prepared.forget_peer(&agent);
                        self.events.push_back(PeerEvent::Lost(agent));
                    }
                }
            }
        }
        self.shared.reap_incoming();
        self.retired.retain(|t| !t.is_finished());
        if self.events.len() > before {
            self.shared.wake();
        }
    }

    /// Tells the side channel of closed peers whose data connections are done.
    fn settle_closing(&mut self) {
        let mut i = 0;
        while i < self.closing.len() {
            let (_, agent, incarnation, since) = &self.closing[i];
            if since.elapsed() >= CLOSE_GRACE || self.shared.closing_settled(agent, *incarnation) {
                let (conn, ..) = self.closing.swap_remove(i);
                self.events.extend(self.shared.take_inbox());
                self.shared.side.peer_closed(conn);
            } else {
                i += 1;
            }
        }
    }

    /// A peer authenticated and its offer checked out: it is usable once its metadata decodes.
    fn connected(&mut self, conn: ConnId, info: Box<PeerInfo>) {
        let agent = info.agent.clone();
        let incarnation = info.handshake.instance;
        let opened =
            metadata::decode(&info.handshake.agent_metadata).map_err(|e| format!("peer metadata: {e}")).and_then(
                |meta| self.open_conn(&agent, incarnation, &meta).map(|out| (meta, out)).map_err(|e| e.to_string()),
            );
        match opened {
            Ok((meta, out)) => {
                if let Some(old) = self.peers.insert(agent.clone(), Peer { conn, incarnation, meta, out }) {
                    // A newer incarnation replaced it (its loss may still be on the way).
                    self.close_conn(old.out, TransportError::PeerLost(agent.clone()));
                    self.prepared.forget_peer(&agent);
                }
                let mut peers = lock(&self.shared.peers);
                peers.insert(agent, Established { incarnation, closing_since: None, incoming: 0 });
                self.shared.peers_changed_locked();
                drop(peers);
                self.events.push_back(PeerEvent::Connected(info));
            }
            Err(reason) => {
                tracing::warn!(peer = %agent, %reason, "peer dropped: its metadata is not usable");
                self.shared.side.peer_closed(conn);
                self.events.push_back(PeerEvent::Refused { peer: Some(agent), cause: RefusalCause::Malformed, reason });
            }
        }
    }

    /// The peer's data connection, reopened if it broke.
    fn conn_to(&mut self, peer: &AgentName) -> Result<&OutConn, TransportError> {
        let p = self.peers.get(peer).ok_or_else(|| TransportError::UnknownPeer(peer.clone()))?;
        if !p.out.is_open() {
            let (incarnation, meta) = (p.incarnation, p.meta.clone());
            let fresh = self.open_conn(peer, incarnation, &meta)?;
            let p = self.peers.get_mut(peer).ok_or_else(|| TransportError::UnknownPeer(peer.clone()))?;
            let old = std::mem::replace(&mut p.out, fresh);
            self.close_conn(old, TransportError::TransferFailed(format!("data connection to {peer} closed")));
        }
        self.peers.get(peer).map(|p| &p.out).ok_or_else(|| TransportError::UnknownPeer(peer.clone()))
    }

    /// Checks a transfer against both sides' registrations and posts it.
    fn start(
        &mut self,
        op: TransferOp,
        peer: &AgentName,
        pairs: Vec<Pair>,
        notification: Option<Vec<u8>>,
    ) -> Result<TransferId, TransportError> {
        let remote = &self.peers.get(peer).ok_or_else(|| TransportError::UnknownPeer(peer.clone()))?.meta.memory;
        if pairs.is_empty() {
            return Err(TransportError::InvalidTransfer("no descriptor pairs".into()));
        }
        for p in &pairs {
            if p.len == 0 {
                return Err(TransportError::InvalidTransfer("a range of 0 bytes".into()));
            }
            if !self.shared.registry.holds(p.local, p.len) {
                return Err(TransportError::NotRegistered { side: "local", addr: p.local, len: p.len });
            }
            if !remote.iter().any(|r| r.holds(p.remote, p.len)) {
                return Err(TransportError::NotRegistered { side: "remote", addr: p.remote, len: p.len });
            }
        }
        if let Some(n) = &notification {
            if n.len() > MAX_MESSAGE_BYTES {
                return Err(TransportError::NotificationTooLarge { len: n.len(), max: MAX_MESSAGE_BYTES });
            }
        }
        // A write's notification rides behind its last chunk; a read's goes once its bytes are here.
        let (sealed, after_read) = match op {
            TransferOp::Write => (notification.map(|n| self.shared.side.seal(peer, &n)).transpose()?, None),
            TransferOp::Read => (None, notification),
        };
        let conn = self.conn_to(peer)?.id;
        let id = TransferId(self.next_transfer);
        self.next_transfer += 1;
        let pairs: Arc<[Pair]> = pairs.into();
        lock(&self.shared.transfers).insert(id, Flight::new(op, peer.clone(), conn, pairs.clone(), after_read));
        let job = match op {
            TransferOp::Read => Job::Read { id, pairs },
            TransferOp::Write => Job::Write { id, pairs, sealed },
        };
        if !self.conn_to(peer)?.send(job) {
            let why = TransportError::TransferFailed(format!("data connection to {peer} closed"));
            self.shared.finish(id, TransferStatus::Failed(why));
        }
        Ok(id)
    }
}

impl Transport for TcpTransport {
    fn agent(&self) -> &AgentName {
        &self.name
    }

    fn register(&mut self, region: &Region) -> Result<(), TransportError> {
        if let MemoryKind::Device(ordinal) = region.kind {
            return Err(TransportError::Backend(format!(
                "kv-transport-tcp moves host memory only: region {:?} is memory of GPU {ordinal}",
                region.id
            )));
        }
        self.shared.registry.register(region).map_err(TransportError::Backend)?;
        // Peers that handshake from now on see it. Register before peers connect.
        self.publish_metadata()
    }

    fn deregister(&mut self, region: RegionId) -> Result<(), TransportError> {
        self.shared
            .registry
            .deregister(region)
            .ok_or_else(|| TransportError::Backend(format!("{region:?} is not registered")))?;
        self.publish_metadata()
    }

    fn connect(&mut self, address: &PeerAddress) -> Result<(), TransportError> {
        self.shared.side.connect(address)
    }

    fn post(&mut self, request: TransferRequest) -> Result<TransferId, TransportError> {
        self.pump();
        let pairs = request
            .pairs
            .iter()
            .map(|p: &DescriptorPair| Pair { local: p.local_addr, remote: p.remote_addr, len: p.len })
            .collect();
        self.start(request.op, &request.peer, pairs, request.notification)
    }

    fn prepare(&mut self, peer: Option<&AgentName>, ranges: &[(u64, u64)]) -> Result<PreparedId, TransportError> {
        self.pump();
        let side = if peer.is_some() { "remote" } else { "local" };
        if ranges.is_empty() {
            return Err(TransportError::InvalidTransfer(format!("no {side} ranges")));
        }
        let remote = match peer {
            Some(peer) => Some(&self.peers.get(peer).ok_or_else(|| TransportError::UnknownPeer(peer.clone()))?.meta),
            None => None,
        };
        for &(addr, len) in ranges {
            if len == 0 {
                return Err(TransportError::InvalidTransfer(format!("a {side} range of 0 bytes")));
            }
            let registered = match remote {
                Some(meta) => meta.memory.iter().any(|r| r.holds(addr, len)),
                None => self.shared.registry.holds(addr, len),
            };
            if !registered {
                return Err(TransportError::NotRegistered { side, addr, len });
            }
        }
        Ok(self.prepared.insert(peer.cloned(), ranges.to_vec()))
    }

    fn post_prepared(&mut self, request: PreparedTransfer) -> Result<TransferId, TransportError> {
        self.pump();
        if !self.peers.contains_key(&request.peer) {
            return Err(TransportError::UnknownPeer(request.peer));
        }
        let local = self.prepared.get(request.local, None)?;
        let remote = self.prepared.get(request.remote, Some(&request.peer))?;
        request.check_counts()?;
        let mut pairs = Vec::with_capacity(request.local_indices.len());
        for (&l, &r) in request.local_indices.iter().zip(&request.remote_indices) {
            match (local.get(l as usize), remote.get(r as usize)) {
                (Some(&(local, a)), Some(&(remote, b))) if a == b => pairs.push(Pair { local, remote, len: a }),
                _ => return Err(TransportError::InvalidTransfer(format!("entries {l} and {r} do not pair"))),
            }
        }
        self.start(request.op, &request.peer, pairs, request.notification)
    }

    fn poll_transfer(&mut self, id: TransferId) -> TransferStatus {
        self.shared.take_outcome(id).unwrap_or(TransferStatus::InProgress)
    }

    fn send_notification(&mut self, peer: &AgentName, payload: &[u8]) -> Result<(), TransportError> {
        self.pump();
        if payload.len() > MAX_MESSAGE_BYTES {
            return Err(TransportError::NotificationTooLarge { len: payload.len(), max: MAX_MESSAGE_BYTES });
        }
        if !self.peers.contains_key(peer) {
            return Err(TransportError::UnknownPeer(peer.clone()));
        }
        let sealed = self.shared.side.seal(peer, payload)?;
        if self.conn_to(peer)?.send(Job::Notify(sealed)) {
            Ok(())
        } else {
            Err(TransportError::TransferFailed(format!("data connection to {peer} closed")))
        }
    }

    fn poll_event(&mut self) -> Option<PeerEvent> {
        if self.events.is_empty() {
            self.events.extend(self.shared.take_inbox());
            self.pump();
        }
        self.events.pop_front()
    }

    fn disconnect(&mut self, peer: &AgentName) {
        // A loss already on its way is taken in first: then the peer is no longer here.
        self.pump();
        let Some(conn) = self.peers.get(peer).map(|p| p.conn) else { return };
        // No grace for its data connections, as a closed side channel gets: it is gone now. The
        // endpoint reports the loss as any other, which takes in what the peer sent before,
        // stops serving its data connections and closes ours to it.
        self.closing.retain(|(closing, ..)| *closing != conn);
        self.shared.side.peer_closed(conn);
        self.pump();
    }

    fn set_waker(&mut self, waker: Waker) {
        self.shared.set_waker(waker.clone());
        if !self.events.is_empty() || !self.closing.is_empty() || self.shared.has_ready() {
            waker.wake_by_ref();
        }
        self.shared.side.set_waker(waker);
    }

    fn poll_intervals(&self) -> PollIntervals {
        // Completions, notifications and side-channel items all wake the waker.
        PollIntervals { transfers: None, notifications: None }
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        self.shared.begin_stop();
        let peers: Vec<Peer> = self.peers.drain().map(|(_, p)| p).collect();
        for peer in peers {
            self.close_conn(peer.out, TransportError::Backend("the transport was dropped".into()));
        }
        for thread in self.retired.drain(..) {
            let _ = thread.join();
        }
        // Stops accepting and ends every pending handshake; no new serving thread starts after.
        drop(self.listener.take());
        let incoming: Vec<_> = lock(&self.shared.incoming).drain().map(|(_, c)| c).collect();
        for conn in &incoming {
            let _ = conn.stream.shutdown(std::net::Shutdown::Both);
        }
        for conn in incoming {
            let _ = conn.thread.join();
        }
    }
}
