//! [`NixlTransport`]: one NIXL agent with the UCX backend, for one TP rank.
#![allow(unsafe_code)] // NIXL's descriptor trait hands out raw pointers: see RawRegion.

use std::collections::{BTreeMap, VecDeque};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kv_core::wire::MAX_MESSAGE_BYTES;
use kv_core::{
    AgentName, Clock, Handshake, MemoryKind, Notification, PeerAddress, PeerEvent, PeerInfo, Region, RegionId,
    TransferId, TransferOp, TransferRequest, TransferStatus, Transport, TransportError,
};
use nixl_sys::{
    Agent, Backend, MemType, MemoryRegion, NixlDescriptor, NotificationMap, OptArgs, RegistrationHandle, XferDescList,
    XferOp, XferRequest, XferStatus,
};

use crate::side::{SideChannel, SideEvent, SideStats};
use crate::{runtime, NixlError};

/// The side channel's default port, as vLLM's NixlConnector uses.
pub const DEFAULT_SIDE_CHANNEL_PORT: u16 = 5600;

/// How to build a [`NixlTransport`].
#[derive(Clone, Debug)]
pub struct NixlConfig {
    /// Where the side channel listens (loopback and port 5600 unless configured).
    pub bind: SocketAddr,
    /// How long a handshake may take.
    pub handshake_timeout: Duration,
    /// Where the NIXL runtime is (else `$KVFLOW_NIXL_DIR`, else `.nixl/` of the workspace).
    pub runtime_dir: Option<PathBuf>,
    /// UCX worker threads of the backend (NIXL's `num_workers`); `None` keeps NIXL's default.
    pub ucx_workers: Option<u32>,
}

impl Default for NixlConfig {
    fn default() -> Self {
        NixlConfig {
            bind: SocketAddr::from(([127, 0, 0, 1], DEFAULT_SIDE_CHANNEL_PORT)),
            handshake_timeout: Duration::from_secs(5),
            runtime_dir: None,
            ucx_workers: None,
        }
    }
}

/// A registered region, as NIXL's descriptor traits want it.
#[derive(Debug)]
struct RawRegion {
    addr: u64,
    len: u64,
    kind: MemoryKind,
}

impl MemoryRegion for RawRegion {
    unsafe fn as_ptr(&self) -> *const u8 {
        // NIXL registers the address range; kvflow never dereferences it here.
        self.addr as usize as *const u8
    }

    fn size(&self) -> usize {
        self.len as usize
    }
}

impl NixlDescriptor for RawRegion {
    fn mem_type(&self) -> MemType {
        mem_type(self.kind)
    }

    fn device_id(&self) -> u64 {
        u64::from(self.kind.device_id())
    }
}

fn mem_type(kind: MemoryKind) -> MemType {
    match kind {
        MemoryKind::Host | MemoryKind::PinnedHost => MemType::Dram,
        MemoryKind::Device(_) => MemType::Vram,
    }
}

/// NIXL's agent name for a kvflow agent.
fn nixl_name(agent: &AgentName) -> String {
    agent.to_string()
}

enum Pending {
    InFlight(XferRequest),
    Failed(TransportError),
}

/// kv-core's [`Transport`] over NIXL with the UCX backend: one agent per TP rank, a TCP side
/// channel for the handshake and liveness, and notifications that ride on transfers.
pub struct NixlTransport {
    name: AgentName,
    agent: Agent,
    backend: Backend,
    side: SideChannel,
    regions: BTreeMap<RegionId, (RegistrationHandle, Region)>,
    peers: BTreeMap<AgentName, String>,
    transfers: BTreeMap<TransferId, Pending>,
    next_transfer: u64,
    events: VecDeque<PeerEvent>,
}

impl std::fmt::Debug for NixlTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NixlTransport").field("name", &self.name).field("side", &self.side.local_addr()).finish()
    }
}

fn backend_error(what: &str, e: nixl_sys::NixlError) -> TransportError {
    TransportError::Backend(format!("{what}: {e}"))
}

impl NixlTransport {
    /// Creates the agent of the rank that `offer` describes, with the UCX backend, and starts
    /// its side channel; the agent's metadata is filled into the offer.
    pub fn new(mut offer: Handshake, config: &NixlConfig, clock: Arc<dyn Clock>) -> Result<Self, NixlError> {
        runtime::ensure_loaded(config.runtime_dir.as_deref())?;
        let name = AgentName::new(offer.engine.clone(), offer.rank);
        let agent = Agent::new(&nixl_name(&name)).map_err(|e| NixlError::Agent(format!("create {name}: {e}")))?;
        let (_, mut params) =
            agent.get_plugin_params("UCX").map_err(|e| NixlError::Agent(format!("UCX plugin parameters: {e}")))?;
        if let Some(workers) = config.ucx_workers {
            params
                .set("num_workers", &workers.to_string())
                .map_err(|e| NixlError::Agent(format!("UCX num_workers {workers}: {e}")))?;
        }
        let backend =
            agent.create_backend("UCX", &params).map_err(|e| NixlError::Agent(format!("UCX backend: {e}")))?;
        offer.agent_metadata = agent.get_local_md().map_err(|e| NixlError::Agent(format!("local metadata: {e}")))?;
        let side = SideChannel::start(config.bind, offer, clock, config.handshake_timeout)?;
        Ok(NixlTransport {
            name,
            agent,
            backend,
            side,
            regions: BTreeMap::new(),
            peers: BTreeMap::new(),
            transfers: BTreeMap::new(),
            next_transfer: 0,
            events: VecDeque::new(),
        })
    }

    /// Where the side channel listens: give it to peers as `host:port`.
    pub fn side_channel_addr(&self) -> SocketAddr {
        self.side.local_addr()
    }

    /// Bad handshake input the listener dropped.
    pub fn side_stats(&self) -> &SideStats {
        &self.side.stats
    }

    fn opt_args(&self) -> Result<OptArgs, TransportError> {
        let mut args = OptArgs::new().map_err(|e| backend_error("opt args", e))?;
        args.add_backend(&self.backend).map_err(|e| backend_error("opt args backend", e))?;
        Ok(args)
    }

    fn pump_side_channel(&mut self) {
        while let Some(event) = self.side.try_event() {
            let event = match event {
                SideEvent::Accepted { handshake, sent_at, received_at } => {
                    let agent = AgentName::new(handshake.engine.clone(), handshake.rank);
                    match self.agent.load_remote_md(&handshake.agent_metadata) {
                        Ok(remote) => {
                            self.peers.insert(agent.clone(), remote);
                            PeerEvent::Connected(Box::new(PeerInfo {
                                agent,
                                handshake: *handshake,
                                sent_at,
                                received_at,
                            }))
                        }
                        Err(e) => PeerEvent::Refused { peer: agent, error: backend_error("peer metadata", e) },
                    }
                }
                SideEvent::ConnectFailed { address, error } => PeerEvent::ConnectFailed { address, error },
                SideEvent::Refused { peer, error } => PeerEvent::Refused { peer, error },
                SideEvent::Lost(agent) => {
                    if let Some(remote) = self.peers.remove(&agent) {
                        let _ = self.agent.invalidate_remote_md(&remote);
                    }
                    PeerEvent::Lost(agent)
                }
            };
            self.events.push_back(event);
        }
    }

    fn region_containing(&self, addr: u64, len: u64) -> Option<&Region> {
        let end = addr.checked_add(len)?;
        self.regions.values().map(|(_, r)| r).find(|r| r.addr <= addr && end <= r.addr + r.len)
    }
}

impl Transport for NixlTransport {
    fn agent(&self) -> &AgentName {
        &self.name
    }

    fn register(&mut self, region: &Region) -> Result<(), TransportError> {
        let raw = RawRegion { addr: region.addr, len: region.len, kind: region.kind };
        let args = self.opt_args()?;
        let handle = self.agent.register_memory(&raw, Some(&args)).map_err(|e| backend_error("register", e))?;
        self.regions.insert(region.id, (handle, *region));
        // NIXL's metadata lists the agent's registrations: peers that handshake from now on
        // must see this region. Register before peers connect.
        let metadata = self.agent.get_local_md().map_err(|e| backend_error("local metadata", e))?;
        self.side.set_agent_metadata(metadata);
        Ok(())
    }

    fn deregister(&mut self, region: RegionId) -> Result<(), TransportError> {
        let (mut handle, _) = self
            .regions
            .remove(&region)
            .ok_or_else(|| TransportError::Backend(format!("{region:?} is not registered")))?;
        handle.deregister().map_err(|e| backend_error("deregister", e))
    }

    fn connect(&mut self, address: &PeerAddress) -> Result<(), TransportError> {
        self.side.connect(address);
        Ok(())
    }

    fn post(&mut self, request: TransferRequest) -> Result<TransferId, TransportError> {
        self.pump_side_channel();
        let remote = self.peers.get(&request.peer).ok_or_else(|| TransportError::UnknownPeer(request.peer.clone()))?;
        if request.pairs.is_empty() {
            return Err(TransportError::InvalidTransfer("no descriptor pairs".into()));
        }
        let local_region = self.region_containing(request.pairs[0].local_addr, request.pairs[0].len);
        let kind = local_region.map(|r| r.kind).unwrap_or(MemoryKind::Host);
        let mut local = XferDescList::new(mem_type(kind)).map_err(|e| backend_error("descriptor list", e))?;
        // The peer's memory kind is in its registrations; NIXL checks it against the metadata.
        let mut remote_list = XferDescList::new(mem_type(kind)).map_err(|e| backend_error("descriptor list", e))?;
        for pair in &request.pairs {
            if pair.len == 0 {
                return Err(TransportError::InvalidTransfer("a descriptor of 0 bytes".into()));
            }
            let region = self.region_containing(pair.local_addr, pair.len).ok_or(TransportError::NotRegistered {
                side: "local",
                addr: pair.local_addr,
                len: pair.len,
            })?;
            let dev = u64::from(region.kind.device_id());
            local.add_desc(pair.local_addr as usize, pair.len as usize, dev);
            remote_list.add_desc(pair.remote_addr as usize, pair.len as usize, dev);
        }
        let mut args = self.opt_args()?;
        if let Some(notification) = &request.notification {
            if notification.len() > MAX_MESSAGE_BYTES {
                return Err(TransportError::NotificationTooLarge { len: notification.len(), max: MAX_MESSAGE_BYTES });
            }
            args.set_has_notification(true).map_err(|e| backend_error("notification flag", e))?;
            args.set_notification_message(notification).map_err(|e| backend_error("notification", e))?;
        }
        let op = match request.op {
            TransferOp::Read => XferOp::Read,
            TransferOp::Write => XferOp::Write,
        };
        let xfer = self
            .agent
            .create_xfer_req(op, &local, &remote_list, remote, Some(&args))
            .map_err(|e| backend_error("create transfer", e))?;
        let id = TransferId(self.next_transfer);
        self.next_transfer += 1;
        match self.agent.post_xfer_req(&xfer, Some(&args)) {
            Ok(_) => {
                self.transfers.insert(id, Pending::InFlight(xfer));
            }
            Err(e) => {
                self.transfers.insert(id, Pending::Failed(backend_error("post transfer", e)));
            }
        }
        Ok(id)
    }

    fn poll_transfer(&mut self, id: TransferId) -> TransferStatus {
        let status = match self.transfers.get(&id) {
            None => return TransferStatus::Failed(TransportError::UnknownTransfer(id)),
            Some(Pending::Failed(e)) => TransferStatus::Failed(e.clone()),
            Some(Pending::InFlight(xfer)) => match self.agent.get_xfer_status(xfer) {
                Ok(XferStatus::InProgress) => return TransferStatus::InProgress,
                Ok(XferStatus::Success) => TransferStatus::Done,
                Err(e) => TransferStatus::Failed(TransportError::TransferFailed(e.to_string())),
            },
        };
        self.transfers.remove(&id);
        status
    }

    fn send_notification(&mut self, peer: &AgentName, payload: &[u8]) -> Result<(), TransportError> {
        self.pump_side_channel();
        if payload.len() > MAX_MESSAGE_BYTES {
            return Err(TransportError::NotificationTooLarge { len: payload.len(), max: MAX_MESSAGE_BYTES });
        }
        let remote = self.peers.get(peer).ok_or_else(|| TransportError::UnknownPeer(peer.clone()))?;
        self.agent.send_notification(remote, payload, Some(&self.backend)).map_err(|e| backend_error("notify", e))
    }

    fn drain_notifications(&mut self, out: &mut Vec<Notification>) {
        let Ok(mut map) = NotificationMap::new() else { return };
        if let Err(e) = self.agent.get_notifications(&mut map, None) {
            tracing::debug!(error = %e, "cannot fetch notifications");
            return;
        }
        let agents: Vec<String> = map.agents().filter_map(|a| a.ok().map(str::to_owned)).collect();
        for remote in agents {
            let Some(from) = self.peers.iter().find(|(_, name)| **name == remote).map(|(a, _)| a.clone()) else {
                tracing::debug!(%remote, "notification from an agent without a handshake");
                continue;
            };
            let count = map.get_notifications_size(&remote).unwrap_or(0);
            for i in 0..count {
                if let Ok(payload) = map.get_notification_bytes(&remote, i) {
                    out.push(Notification { from: from.clone(), payload });
                }
            }
        }
    }

    fn poll_event(&mut self) -> Option<PeerEvent> {
        self.pump_side_channel();
        self.events.pop_front()
    }
}
