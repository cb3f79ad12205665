//! [`NixlTransport`]: one NIXL agent with the UCX backend, for one TP rank.
#![allow(unsafe_code)] // NIXL's descriptor trait hands out raw pointers: see RawRegion.

use std::collections::{BTreeMap, VecDeque};
use std::net::SocketAddr;
use std::sync::Arc;
use std::task::Waker;
use std::time::Duration;

use kv_core::side::{ConnId, SideEvent, SideLimits};
use kv_core::wire::MAX_MESSAGE_BYTES;
use kv_core::{
    AgentName, Clock, Descriptors, Handshake, MemoryKind, PeerAddress, PeerEvent, PeerInfo, PollIntervals, PreparedId,
    PreparedLists, PreparedTransfer, RefusalCause, Region, RegionId, TransferId, TransferOp, TransferRequest,
    TransferStatus, Transport, TransportError,
};
use nixl_sys::{
    Agent, AgentConfig, Backend, MemType, MemoryRegion, NixlDescriptor, OptArgs, RegistrationHandle, XferDescList,
    XferDlistHandle, XferOp, XferRequest, XferStatus,
};

use crate::drain::{Drainer, Fetcher};
use crate::metadata::{self, mem_type, Registration, TypedRanges};
use kv_side_tcp::{Item, KeySource, PortPlan, SideChannel, SideProbe, SideStatus};

use crate::{runtime, NixlError};

pub(crate) mod admit;
mod cut;
mod pieces;

use pieces::{split_entries, split_spans, Pieced, Span};
pub use pieces::{DEFAULT_POST_PIECE_BUDGET, DEFAULT_POST_PIECE_BYTES};

/// The side channel's default port, as vLLM's NixlConnector uses.
pub const DEFAULT_SIDE_CHANNEL_PORT: u16 = 5600;

/// How often an idle NIXL progress thread wakes, by default. The thread waits on UCX's event
/// descriptors, so traffic wakes it at once; the period only bounds an idle thread's sleep.
/// NIXL's own default, 0, makes it spin a core whatever the load: on a 2-core machine running
/// the demo's three engines, that tripled transfer latency (p50 7.2 ms at 0, 2.5 ms at 20 ms).
/// At 10 ms it was the largest part of an idle engine's CPU (0.31 % of a core of 0.54, at 99
/// wake-ups a second); at 100 ms an idle engine used 0.2 to 0.3 %, and one request at a time
/// moved as fast (`cargo xtask bench --only idle` measures both periods in one run).
pub const DEFAULT_PROGRESS_PERIOD: Duration = Duration::from_millis(100);

/// How often an engine polls a NIXL transport for what it cannot signal, by default: NIXL
/// reports transfer completions and notifications only when asked (UCX gives no descriptor
/// for them through NIXL's API), so an engine polls for completions every 50 µs while
/// transfers are in flight, and for notifications every 100 µs while it waits for a peer (a
/// push write's notification is what tells D it holds the KV: at 2 ms, push's P done to D
/// holds KV p50 was 7.8 to 8.3 ms for a 32 MiB prompt on 2 cores, at 250 µs 6.4 to 6.7 ms;
/// with the model's layer-wise writes, where only the last layer's write and its
/// notification are left at P done, 0.63 to 0.66 ms at 250 µs and 0.46 to 0.57 ms at 100 µs,
/// 3 runs of `--only model` each, alternated). Under load the extra wake-ups cost little: in
/// flight 8 and 32, push's throughput was 0.94 to 1.00 of pull's (3 runs). An engine waiting
/// for nothing does not poll. Side-channel events (handshakes, lost peers) wake the engine's
/// waker instead.
pub const DEFAULT_POLL_INTERVALS: PollIntervals =
    PollIntervals { transfers: Some(Duration::from_micros(50)), notifications: Some(Duration::from_micros(100)) };

/// How to build a [`NixlTransport`].
#[derive(Clone, Debug)]
pub struct NixlConfig {
    /// Where the side channel listens (loopback and port 5600 unless configured). Without a
    /// key it must be a loopback address.
    pub bind: SocketAddr,
    /// Whether `bind` is this rank's own port or one the engine's ranks share (peers then dial
    /// `host:port/tpRANK`); its own unless configured.
    pub port_plan: PortPlan,
    /// Where the cluster key is read from when the transport is made (none: loopback only).
    pub key: KeySource,
    /// The side channel's bounds and handshake deadline.
    pub side_limits: SideLimits,
    /// UCX worker threads of the backend (NIXL's `num_workers`); `None` keeps NIXL's default.
    pub ucx_workers: Option<u32>,
    /// NIXL's progress thread, which moves UCX traffic (a peer's reads of this agent's memory,
    /// notifications) while the engine does other work: `Some(period)` runs it, and an idle
    /// thread wakes at most about that often; `None` runs none, and the agent then moves
    /// traffic only when polled.
    pub progress_thread: Option<Duration>,
    /// Further UCX backend parameters, by NIXL's names, set as given: for example
    /// `num_threads` and `split_batch_size`, with which NIXL's thread-pool engine splits one
    /// transfer's descriptors across threads. An unknown name fails `NixlTransport::new`.
    pub ucx_params: Vec<(String, String)>,
    /// How often the engine should poll for completions and notifications
    /// ([`Transport::poll_intervals`]); [`DEFAULT_POLL_INTERVALS`] unless configured.
    pub poll_intervals: PollIntervals,
    /// The most bytes one NIXL request moves between host memory on both sides: a larger
    /// transfer goes in pieces, posted while they may go for [`NixlConfig::post_piece_budget`]
    /// a turn of the engine's loop and the rest at the next polls, its notification with the
    /// last once the others have ended, so that a large transfer does not hold the rank's
    /// thread for its whole copy (`transport/pieces.rs`). [`DEFAULT_POST_PIECE_BYTES`] unless
    /// configured; `None` posts every transfer whole.
    pub post_piece_bytes: Option<u64>,
    /// How long the polls and posts of one turn of the engine's loop (each transfer polled
    /// once) may go on posting pieces, together, before they return to the engine; the oldest
    /// transfer's pieces go first, and at least one piece goes each turn
    /// ([`DEFAULT_POST_PIECE_BUDGET`] unless configured; zero posts one piece a call).
    pub post_piece_budget: Duration,
}

impl Default for NixlConfig {
    fn default() -> Self {
        NixlConfig {
            bind: SocketAddr::from(([127, 0, 0, 1], DEFAULT_SIDE_CHANNEL_PORT)),
            port_plan: PortPlan::Own,
            key: KeySource::None,
            side_limits: SideLimits::default(),
            ucx_workers: None,
            progress_thread: Some(DEFAULT_PROGRESS_PERIOD),
            ucx_params: Vec::new(),
            poll_intervals: DEFAULT_POLL_INTERVALS,
            post_piece_bytes: Some(DEFAULT_POST_PIECE_BYTES),
            post_piece_budget: DEFAULT_POST_PIECE_BUDGET,
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

/// NIXL's agent name for one incarnation of a kvflow agent: a restarted engine is a new NIXL
/// agent, never confused with its old self.
pub fn nixl_name(agent: &AgentName, incarnation: u64) -> String {
    format!("{agent}#{incarnation}")
}

/// A connected peer: its side-channel connection, its agent as loaded into NIXL, and its
/// registered memory as its handshake listed it, so that remote ranges are named with their
/// true memory type and device.
struct Peer {
    conn: ConnId,
    nixl: String,
    memory: Vec<Registration>,
}

/// NIXL's descriptor list of typed ranges.
fn descriptor_list(typed: &TypedRanges) -> Result<XferDescList<'static>, TransportError> {
    let mut list = XferDescList::new(typed.mem_type).map_err(|e| backend_error("descriptor list", e))?;
    for &(addr, len, device) in &typed.ranges {
        list.add_desc(addr as usize, len as usize, device);
    }
    Ok(list)
}

/// A prepared NIXL descriptor list.
struct Prepared {
    handle: PreparedHandle,
    lens: Vec<u64>,
    /// Its ranges lie in host memory.
    host: bool,
}

/// NIXL's prepared-list handle holds raw pointers, so it is not `Send` by itself.
struct PreparedHandle(XferDlistHandle);

// SAFETY: the handle is used only through `&mut NixlTransport`, one thread at a time, and NIXL's
// agent, which it points into, is itself shared across threads behind a lock (nixl-sys marks
// `Agent` Send and Sync). It is dropped before the agent: see the field order of NixlTransport.
unsafe impl Send for PreparedHandle {}

fn xfer_op(op: TransferOp) -> XferOp {
    match op {
        TransferOp::Read => XferOp::Read,
        TransferOp::Write => XferOp::Write,
    }
}

enum Pending {
    InFlight(XferRequest),
    Failed(TransportError),
    Pieces(Box<Pieced>),
}

/// kv-core's [`Transport`] over NIXL with the UCX backend: one agent per TP rank, a TCP side
/// channel for the handshake and liveness, and notifications that ride on transfers.
pub struct NixlTransport {
    name: AgentName,
    /// Declared first: the drainer stops before anything it uses goes (it is only dropped).
    _drainer: Drainer,
    /// Declared before `agent`: prepared lists are released before the agent they belong to.
    prepared: PreparedLists<Prepared>,
    /// Takes NIXL's notifications in, with the drainer, and holds what the engine has not
    /// polled yet, within bounds.
    fetcher: Arc<Fetcher>,
    agent: Agent,
    backend: Backend,
    side: SideChannel,
    regions: BTreeMap<RegionId, (RegistrationHandle, Region)>,
    peers: BTreeMap<AgentName, Peer>,
    transfers: BTreeMap<TransferId, Pending>,
    next_transfer: u64,
    /// Peers cut off and logged at WARNING, most recent last (bounded: later cut-offs of
    /// older ones are logged again).
    warned: VecDeque<AgentName>,
    /// NIXL agents of peers cut off, not invalidated yet: see [`NixlTransport::invalidate_quiet`].
    cut_agents: Vec<String>,
    /// Engines cut off, refused for a while: see [`admit`].
    penalties: admit::Penalties,
    /// Peers whose metadata waits while one cut off still floods in.
    deferred: admit::DeferredQueue,
    poll_intervals: PollIntervals,
    /// NIXL's UCX backend runs a thread pool (`num_threads` above 1), which splits a
    /// transfer's descriptors across threads.
    threaded: bool,
    /// [`NixlConfig::post_piece_bytes`] and [`NixlConfig::post_piece_budget`].
    piece_bytes: Option<u64>,
    piece_budget: Duration,
    /// The posting of pieces that the polls and posts of one turn of the engine's loop share.
    piece_round: Option<pieces::Round>,
}

impl std::fmt::Debug for NixlTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NixlTransport").field("name", &self.name).field("side", &self.side.local_addr()).finish()
    }
}

fn backend_error(what: &str, e: nixl_sys::NixlError) -> TransportError {
    TransportError::backend(what, e)
}

/// UCX settings kvflow gives NIXL's UCX backend, by UCX's names without `UCX_`: NIXL hands
/// its `engine_config` parameter (`KEY=VALUE` pairs, comma-separated) to `ucp_config_modify`
/// when it creates the backend, where a `UCX_` environment variable of the same name wins. So
/// kvflow configures UCX without touching the process's environment.
///
/// `CUDA_IPC_ENABLE_GET_ZCOPY=y` turns on UCX's zero-copy GET over CUDA IPC: under UCX's
/// default, `auto`, it is off on platforms that UCX judges slower for GET than for PUT (an H100
/// with no NVLink peer among them), and a read of VRAM from another process then falls back to
/// UCX's software emulation over TCP. Seen on an H100: a 256 MiB VRAM-to-VRAM NIXL read at
/// 0.44 GB/s under `auto`, where a write of the same bytes took the CUDA IPC path at 739 GB/s.
/// Reads are kvflow's pull path, so it wants GET. Where UCX loads no CUDA transport the key
/// applies to nothing (UCX says so at debug level only).
///
/// `USE_MT_MUTEX=y` makes the lock that UCX's worker takes for each call a mutex instead of
/// UCX's default spinlock. With NIXL's progress thread the worker has two threads, and over
/// UCX's shared memory a post copies its bytes inside the call, holding the lock: the progress
/// thread, woken meanwhile, spun on it for the whole copy (seen with `perf` in the demo on 2
/// cores: a third to two thirds of a core for 100 ms at a time, in `pthread_spin_lock` under
/// `nixlUcxSharedThread`), taking the core that the engines' own threads were waiting for. A
/// thread waiting on the mutex sleeps; an uncontended mutex costs about what the spinlock does.
pub const UCX_ENGINE_CONFIG: &[(&str, &str)] = &[("CUDA_IPC_ENABLE_GET_ZCOPY", "y"), ("USE_MT_MUTEX", "y")];

/// The backend's `engine_config`: `theirs` (what the engine's `ucx_params` set, if anything),
/// then each of [`UCX_ENGINE_CONFIG`] whose key `theirs` does not set.
pub fn engine_config(theirs: Option<&str>) -> String {
    let theirs: Vec<&str> = theirs.into_iter().flat_map(|t| t.split(',')).filter(|pair| !pair.is_empty()).collect();
    let named = |key: &str| theirs.iter().any(|pair| pair.split('=').next() == Some(key));
    let ours = UCX_ENGINE_CONFIG.iter().filter(|(key, _)| !named(key)).map(|(key, value)| format!("{key}={value}"));
    theirs.iter().map(|pair| pair.to_string()).chain(ours).collect::<Vec<_>>().join(",")
}

impl NixlTransport {
    /// Creates the agent of the rank that `offer` describes, with the UCX backend, and starts
    /// its side channel; the agent's metadata is filled into the offer.
    ///
    /// Safe to call, use and drop inside or outside a tokio runtime: the side channel's
    /// sockets run on a thread of their own. The engine must have called
    /// [`runtime::prepare`] first.
    pub fn new(mut offer: Handshake, config: &NixlConfig, clock: Arc<dyn Clock>) -> Result<Self, NixlError> {
        let key = config.key.load()?;
        kv_side_tcp::check_bind(config.bind, &key).map_err(NixlError::Config)?;
        runtime::prepared()?;
        let name = AgentName::new(offer.engine.clone(), offer.rank);
        let nixl = nixl_name(&name, offer.instance);
        let agent_config = AgentConfig {
            enable_prog_thread: config.progress_thread.is_some(),
            pthr_delay_us: config.progress_thread.map_or(0, |d| d.as_micros() as u64),
            ..AgentConfig::default()
        };
        let agent =
            Agent::new_configured(&nixl, &agent_config).map_err(|e| NixlError::Agent(format!("create {nixl}: {e}")))?;
        let (_, mut params) =
            agent.get_plugin_params("UCX").map_err(|e| NixlError::Agent(format!("UCX plugin parameters: {e}")))?;
        if let Some(workers) = config.ucx_workers {
            params
                .set("num_workers", &workers.to_string())
                .map_err(|e| NixlError::Agent(format!("UCX num_workers {workers}: {e}")))?;
        }
        for (key, value) in &config.ucx_params {
            params.set(key, value).map_err(|e| NixlError::Agent(format!("UCX parameter {key}={value}: {e}")))?;
        }
        let theirs = config.ucx_params.iter().rev().find(|(key, _)| key == "engine_config").map(|(_, value)| value);
        let ucx = engine_config(theirs.map(String::as_str));
        params.set("engine_config", &ucx).map_err(|e| NixlError::Agent(format!("UCX engine_config {ucx}: {e}")))?;
        let backend =
            agent.create_backend("UCX", &params).map_err(|e| NixlError::Agent(format!("UCX backend: {e}")))?;
        let nixl_md = agent.get_local_md().map_err(|e| NixlError::Agent(format!("local metadata: {e}")))?;
        offer.agent_metadata =
            metadata::encode(&[], &nixl_md).map_err(|e| NixlError::Agent(format!("local metadata: {e}")))?;
        let side = SideChannel::start_on(config.bind, config.port_plan, key, config.side_limits.clone(), offer, clock)?;
        let fetcher = Arc::new(Fetcher::new(agent.clone(), side.opener()));
        let drainer = Drainer::start(fetcher.clone())
            .map_err(|e| NixlError::Agent(format!("the notification drainer's thread: {e}")))?;
        Ok(NixlTransport {
            name,
            _drainer: drainer,
            prepared: PreparedLists::default(),
            fetcher,
            agent,
            backend,
            side,
            regions: BTreeMap::new(),
            peers: BTreeMap::new(),
            transfers: BTreeMap::new(),
            next_transfer: 0,
            warned: VecDeque::new(),
            cut_agents: Vec::new(),
            penalties: admit::Penalties::default(),
            deferred: admit::DeferredQueue::new(),
            poll_intervals: config.poll_intervals,
            threaded: thread_pool(&config.ucx_params),
            piece_bytes: config.post_piece_bytes,
            piece_budget: config.post_piece_budget,
            piece_round: None,
        })
    }

    /// Where the side channel listens (on a shared port: the port).
    pub fn side_channel_addr(&self) -> SocketAddr {
        self.side.local_addr()
    }

    /// What peers dial to reach this rank's side channel: `host:port`, or `host:port/tpRANK`
    /// on a port the engine's ranks share.
    pub fn side_channel_address(&self) -> &PeerAddress {
        self.side.address()
    }

    /// What the side channel holds now: peers, pending handshakes, sockets and buffered bytes,
    /// and what its bounds turned away.
    pub fn side_status(&self) -> SideStatus {
        self.side.status()
    }

    /// A handle that reads [`NixlTransport::side_status`] from another thread.
    pub fn side_probe(&self) -> SideProbe {
        self.side.status_probe()
    }

    fn opt_args(&self) -> Result<OptArgs, TransportError> {
        let mut args = OptArgs::new().map_err(|e| backend_error("opt args", e))?;
        args.add_backend(&self.backend).map_err(|e| backend_error("opt args backend", e))?;
        Ok(args)
    }

    /// The backend, and the notification NIXL delivers to `peer` when the transfer completes,
    /// tagged for that peer's session.
    fn transfer_args(&self, peer: &AgentName, notification: Option<&[u8]>) -> Result<OptArgs, TransportError> {
        let mut args = self.opt_args()?;
        if let Some(notification) = notification {
            let sealed = self.side.seal(peer, notification)?;
            args.set_has_notification(true).map_err(|e| backend_error("notification flag", e))?;
            args.set_notification_message(&sealed).map_err(|e| backend_error("notification", e))?;
        }
        Ok(args)
    }

    /// Takes in what the side channel saw, in order: peers become NIXL peers once their
    /// metadata loads, and a closed peer's notifications are collected before its loss.
    fn pump_side_channel(&mut self) {
        while let Some(item) = self.side.poll_item() {
            match item {
                Item::PeerClosed(conn) => {
                    // What the peer sent before its side channel closed comes before its loss.
                    self.fetcher.fetch();
                    self.side.peer_closed(conn);
                }
                Item::Event(SideEvent::Connected { conn, info }) => self.admit(conn, info),
                Item::Event(SideEvent::ConnectFailed { address, error, .. }) => {
                    self.fetcher.inbox().push(PeerEvent::ConnectFailed { address, error });
                }
                Item::Event(SideEvent::Refused { claimed, cause, reason, .. }) => {
                    self.fetcher.inbox().push(PeerEvent::Refused { peer: claimed, cause, reason });
                }
                Item::Event(SideEvent::Lost { conn, agent, .. }) => {
                    self.drop_deferred(conn);
                    // Only the connection's own peer goes: a newer incarnation may hold the name.
                    if self.peers.get(&agent).is_some_and(|p| p.conn == conn) {
                        let peer = self.peers.remove(&agent);
                        {
                            // In one hold of the inbox (never held across a NIXL call: fetches
                            // wait on it): nothing of its is queued after its loss.
                            let mut inbox = self.fetcher.inbox();
                            if let Some(peer) = &peer {
                                inbox.forget(&peer.nixl);
                            }
                            inbox.push(PeerEvent::Lost(agent));
                        }
                        // A peer cut off is invalidated once it is quiet.
                        if let Some(peer) = peer.filter(|p| !self.cut_agents.contains(&p.nixl)) {
                            let _ = self.agent.invalidate_remote_md(&peer.nixl);
                        }
                    }
                }
            }
        }
    }

    /// A peer authenticated and its offer checked out: load its NIXL metadata (only now, from
    /// a key holder), or drop it.
    pub(super) fn connected(&mut self, conn: ConnId, info: Box<PeerInfo>) {
        let agent = info.agent.clone();
        let expected = nixl_name(&agent, info.handshake.instance);
        let loaded = metadata::decode(&info.handshake.agent_metadata)
            .map_err(|e| TransportError::Backend(format!("peer metadata: {e}")))
            .and_then(|(memory, nixl_md)| {
                let nixl = self.agent.load_remote_md(nixl_md).map_err(|e| backend_error("peer metadata", e))?;
                if nixl != expected {
                    let _ = self.agent.invalidate_remote_md(&nixl);
                    return Err(TransportError::Backend(format!(
                        "peer {agent} incarnation {} sent the NIXL metadata of agent {nixl:?}, not {expected:?}",
                        info.handshake.instance
                    )));
                }
                // UCX's endpoint to the peer now, not inside its first transfer: otherwise the
                // first request to each peer pays the wire-up (tens of milliseconds).
                if let Err(error) = self.agent.make_connection(&nixl, None) {
                    tracing::debug!(peer = %agent, %error, "no connection made ahead; the first transfer makes it");
                }
                Ok(Peer { conn, nixl, memory })
            });
        match loaded {
            Ok(peer) => {
                let nixl = peer.nixl.clone();
                // A newer incarnation replaces an older one (whose loss may still be on the way).
                let old = self.peers.insert(agent.clone(), peer);
                {
                    // In one hold of the inbox: its `Connected` comes before any notification of
                    // its that a fetch queues once its name is known.
                    let mut inbox = self.fetcher.inbox();
                    if let Some(old) = &old {
                        inbox.forget(&old.nixl);
                    }
                    inbox.push(PeerEvent::Connected(info));
                    inbox.connected(&nixl, &agent);
                }
                if let Some(old) = old {
                    let _ = self.agent.invalidate_remote_md(&old.nixl);
                }
            }
            Err(error) => {
                tracing::warn!(peer = %agent, %error, "peer dropped: its metadata does not load");
                self.drop_peer(conn, &info, RefusalCause::Malformed, error);
            }
        }
    }

    /// Posts a created transfer request and tracks it under a new id.
    fn start(&mut self, xfer: XferRequest, args: &OptArgs) -> TransferId {
        let pending = match self.agent.post_xfer_req(&xfer, Some(args)) {
            Ok(_) => Pending::InFlight(xfer),
            Err(e) => Pending::Failed(backend_error("post transfer", e)),
        };
        let id = self.new_id();
        self.transfers.insert(id, pending);
        id
    }

    /// The id of the next transfer, whole or in pieces.
    fn new_id(&mut self) -> TransferId {
        let id = TransferId(self.next_transfer);
        self.next_transfer += 1;
        id
    }

    /// Where NIXL request `xfer` stands.
    fn status_of(&self, xfer: &XferRequest) -> TransferStatus {
        match self.agent.get_xfer_status(xfer) {
            Ok(XferStatus::InProgress) => TransferStatus::InProgress,
            Ok(XferStatus::Success) => TransferStatus::Done,
            Err(e) => TransferStatus::Failed(TransportError::TransferFailed(e.to_string())),
        }
    }

    /// A transfer request between entries `indices` (local, remote) of prepared `lists`.
    fn make_entries(
        &self,
        op: TransferOp,
        lists: (&Prepared, &Prepared),
        indices: (&[u32], &[u32]),
        args: &OptArgs,
    ) -> Result<XferRequest, TransportError> {
        let to_i32 = |v: &[u32]| v.iter().map(|&i| i as i32).collect::<Vec<i32>>();
        let (local, remote) = (to_i32(indices.0), to_i32(indices.1));
        self.agent
            .make_xfer_req(xfer_op(op), &lists.0.handle.0, &local, &lists.1.handle.0, &remote, Some(args))
            .map_err(|e| backend_error("make transfer", e))
    }

    /// The local registrations, as a peer learns them.
    fn local_memory(&self) -> impl Iterator<Item = Registration> + '_ {
        self.regions.values().map(|(_, r)| Registration { addr: r.addr, len: r.len, kind: r.kind })
    }

    /// Local ranges typed by the local registrations that hold them.
    fn typed_local(&self, ranges: impl IntoIterator<Item = (u64, u64)>) -> Result<TypedRanges, TransportError> {
        metadata::typed_ranges("local", ranges, |addr, len| Registration::kind_of(self.local_memory(), addr, len))
    }

    /// A peer's ranges typed by the peer's registrations that hold them.
    fn typed_remote(peer: &Peer, ranges: impl IntoIterator<Item = (u64, u64)>) -> Result<TypedRanges, TransportError> {
        metadata::typed_ranges("remote", ranges, |addr, len| {
            Registration::kind_of(peer.memory.iter().copied(), addr, len)
        })
    }

    /// Hands the side channel the metadata that peers handshaking from now on load: NIXL's,
    /// which lists the registrations of this moment, and kvflow's table of the same.
    fn publish_metadata(&mut self) -> Result<(), TransportError> {
        let nixl_md = self.agent.get_local_md().map_err(|e| backend_error("local metadata", e))?;
        let table: Vec<Registration> = self.local_memory().collect();
        let mut offer = self.side.offer();
        offer.agent_metadata =
            metadata::encode(&table, &nixl_md).map_err(|e| TransportError::Backend(format!("local metadata: {e}")))?;
        self.side.set_offer(offer)
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
        // Peers that handshake from now on must see this region. Register before peers connect.
        self.publish_metadata()
    }

    fn deregister(&mut self, region: RegionId) -> Result<(), TransportError> {
        let (mut handle, _) = self
            .regions
            .remove(&region)
            .ok_or_else(|| TransportError::Backend(format!("{region:?} is not registered")))?;
        handle.deregister().map_err(|e| backend_error("deregister", e))?;
        self.publish_metadata()
    }

    fn connect(&mut self, address: &PeerAddress) -> Result<(), TransportError> {
        self.side.connect(address)
    }

    fn post(&mut self, request: TransferRequest) -> Result<TransferId, TransportError> {
        self.pump_side_channel();
        let peer = self.peers.get(&request.peer).ok_or_else(|| TransportError::UnknownPeer(request.peer.clone()))?;
        if request.pairs.is_empty() {
            return Err(TransportError::InvalidTransfer("no descriptor pairs".into()));
        }
        // Each side's list takes the memory type and devices of that side's registrations.
        let local = self.typed_local(request.pairs.iter().map(|p| (p.local_addr, p.len)))?;
        let remote = Self::typed_remote(peer, request.pairs.iter().map(|p| (p.remote_addr, p.len)))?;
        if let Some(max) = self
            .piece_bytes
            .filter(|&max| (local.mem_type, remote.mem_type) == (MemType::Dram, MemType::Dram) && request.bytes() > max)
        {
            let spans = local.ranges.iter().zip(&remote.ranges).map(|(&(l, len, ld), &(r, _, rd))| Span {
                local: l,
                remote: r,
                len,
                local_device: ld,
                remote_device: rd,
            });
            let pieces = split_spans(spans, max);
            return Ok(self.start_pieces(request.op, request.peer, pieces, request.notification));
        }
        let (local, remote) = (descriptor_list(&local)?, descriptor_list(&remote)?);
        let args = self.transfer_args(&request.peer, request.notification.as_deref())?;
        let xfer = self
            .agent
            .create_xfer_req(xfer_op(request.op), &local, &remote, &peer.nixl, Some(&args))
            .map_err(|e| backend_error("create transfer", e))?;
        Ok(self.start(xfer, &args))
    }

    fn prepare(&mut self, peer: Option<&AgentName>, ranges: &[(u64, u64)]) -> Result<PreparedId, TransportError> {
        self.pump_side_channel();
        // NIXL names the local side "" and a remote side by its agent name.
        let (agent_name, typed) = match peer {
            Some(peer) => {
                let remote = self.peers.get(peer).ok_or_else(|| TransportError::UnknownPeer(peer.clone()))?;
                (remote.nixl.clone(), Self::typed_remote(remote, ranges.iter().copied())?)
            }
            None => (String::new(), self.typed_local(ranges.iter().copied())?),
        };
        let list = descriptor_list(&typed)?;
        let args = self.opt_args()?;
        let handle =
            self.agent.prepare_xfer_dlist(&agent_name, &list, Some(&args)).map_err(|e| backend_error("prepare", e))?;
        let lens = ranges.iter().map(|&(_, len)| len).collect();
        let host = typed.mem_type == MemType::Dram;
        Ok(self.prepared.insert(peer.cloned(), Prepared { handle: PreparedHandle(handle), lens, host }))
    }

    fn post_prepared(&mut self, request: PreparedTransfer) -> Result<TransferId, TransportError> {
        self.pump_side_channel();
        if !self.peers.contains_key(&request.peer) {
            return Err(TransportError::UnknownPeer(request.peer));
        }
        let local = self.prepared.get(request.local, None)?;
        let remote = self.prepared.get(request.remote, Some(&request.peer))?;
        request.check_counts()?;
        for (&l, &r) in request.local_indices.iter().zip(&request.remote_indices) {
            match (local.lens.get(l as usize), remote.lens.get(r as usize)) {
                (Some(a), Some(b)) if a == b => {}
                _ => return Err(TransportError::InvalidTransfer(format!("entries {l} and {r} do not pair"))),
            }
        }
        let bytes: u64 = request.local_indices.iter().map(|&l| local.lens[l as usize]).sum();
        if let Some(max) = self.piece_bytes.filter(|&max| local.host && remote.host && bytes > max) {
            let lists = (request.local, request.remote);
            let pieces =
                split_entries(lists, &request.local_indices, &request.remote_indices, |l| local.lens[l as usize], max);
            return Ok(self.start_pieces(request.op, request.peer, pieces, request.notification));
        }
        let args = self.transfer_args(&request.peer, request.notification.as_deref())?;
        let xfer =
            self.make_entries(request.op, (local, remote), (&request.local_indices, &request.remote_indices), &args)?;
        Ok(self.start(xfer, &args))
    }

    fn poll_transfer(&mut self, id: TransferId) -> TransferStatus {
        let status = match self.transfers.get(&id) {
            None => return TransferStatus::Failed(TransportError::UnknownTransfer(id)),
            Some(Pending::Pieces(_)) => return self.poll_pieces(id),
            Some(Pending::Failed(e)) => TransferStatus::Failed(e.clone()),
            Some(Pending::InFlight(xfer)) => match self.status_of(xfer) {
                TransferStatus::InProgress => return TransferStatus::InProgress,
                ended => ended,
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
        let sealed = self.side.seal(peer, payload)?;
        self.agent.send_notification(&remote.nixl, &sealed, Some(&self.backend)).map_err(|e| backend_error("notify", e))
    }

    fn disconnect(&mut self, peer: &AgentName) {
        // A loss already on its way is taken in first: then the peer is no longer here.
        self.pump_side_channel();
        let Some(conn) = self.peers.get(peer).map(|p| p.conn) else { return };
        // As when its side channel closes: what it sent before comes before its loss, which the
        // endpoint reports as any other (its metadata invalidated, the peer forgotten).
        self.fetcher.fetch();
        self.side.peer_closed(conn);
        self.pump_side_channel();
    }

    fn set_waker(&mut self, waker: Waker) {
        self.fetcher.set_waker(waker.clone());
        self.side.set_waker(waker);
    }

    /// As configured, except that while a transfer has pieces left to post the engine is to
    /// poll again at once: each poll posts the next ones.
    fn poll_intervals(&self) -> PollIntervals {
        let pieces_left = self.transfers.values().any(|t| matches!(t, Pending::Pieces(p) if p.may_post()));
        if pieces_left {
            return PollIntervals { transfers: Some(Duration::ZERO), ..self.poll_intervals };
        }
        self.poll_intervals
    }

    /// Merged address pairs where prepared lists lose, else prepared lists. With NIXL's thread
    /// pool, contiguous prepared entries are merged into one descriptor its threads cannot split
    /// (16 cores: merged pairs 27.6 GB/s, prepared entries about 5); device memory moved at 0.61
    /// to 0.68 of `cuMemcpy` as 128 prepared block descriptors and 0.83 to 0.97 as one
    /// descriptor on an H100 (on an H200, 0.92 and 0.98; scattered blocks cost UCX's
    /// `cuda_ipc` about 5 µs a descriptor either way, 0.12 to 0.19 of the copy). On host memory
    /// without a thread pool the two ran alike (merged 7.9 GB/s, prepared 7.7 on 2 cores), and
    /// prepared lists check descriptors once per peer.
    fn descriptors(&self) -> Descriptors {
        let device = self.regions.values().any(|(_, region)| matches!(region.kind, MemoryKind::Device(_)));
        if self.threaded || device {
            Descriptors::Pairs
        } else {
            Descriptors::Prepared
        }
    }

    /// Fetches at every call, so that NIXL's own list holds only what came since the last one
    /// (the drainer fetches too, when calls are far apart: [`crate::drain`]) and the bounds of
    /// [`crate::inbox`] apply to the rest; closes the side channel of a peer those bounds cut
    /// off.
    fn poll_event(&mut self) -> Option<PeerEvent> {
        self.pump_side_channel();
        self.fetcher.fetch();
        if self.cut_off_flooders() {
            // Its loss, queued behind its cut-off.
            self.pump_side_channel();
        }
        self.invalidate_quiet();
        self.admit_deferred();
        self.fetcher.inbox().pop()
    }
}

/// Whether UCX backend parameters `params` start NIXL's thread pool: `num_threads` above 1.
fn thread_pool(params: &[(String, String)]) -> bool {
    params.iter().any(|(key, value)| key == "num_threads" && value.trim().parse::<u32>().is_ok_and(|n| n > 1))
}

#[cfg(test)]
mod tests {
    #[test]
    fn ucx_settings_join_the_engines_own_which_win() {
        use super::engine_config;
        let ours = "CUDA_IPC_ENABLE_GET_ZCOPY=y,USE_MT_MUTEX=y";
        assert_eq!(engine_config(None), ours);
        assert_eq!(engine_config(Some("")), ours);
        assert_eq!(engine_config(Some("TLS=tcp")), format!("TLS=tcp,{ours}"));
        assert_eq!(
            engine_config(Some("CUDA_IPC_ENABLE_GET_ZCOPY=n,TLS=^ib")),
            "CUDA_IPC_ENABLE_GET_ZCOPY=n,TLS=^ib,USE_MT_MUTEX=y"
        );
        assert_eq!(engine_config(Some("USE_MT_MUTEX=n")), "USE_MT_MUTEX=n,CUDA_IPC_ENABLE_GET_ZCOPY=y");
    }

    use super::thread_pool;

    #[test]
    fn a_thread_pool_is_num_threads_above_one() {
        let params = |pairs: &[(&str, &str)]| -> Vec<(String, String)> {
            pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
        };
        assert!(!thread_pool(&params(&[])));
        assert!(!thread_pool(&params(&[("num_threads", "1")])));
        assert!(!thread_pool(&params(&[("num_threads", "0"), ("split_batch_size", "8")])));
        assert!(!thread_pool(&params(&[("num_threads", "many")])));
        assert!(thread_pool(&params(&[("num_threads", "4")])));
        assert!(thread_pool(&params(&[("split_batch_size", "4"), ("num_threads", " 8 ")])));
    }
}
