//! What P's and D's machines share: transfer parameters, actions, counters, peers.

use std::collections::{BTreeMap, VecDeque};

use kv_core::Role;
use kv_core::{
    AgentName, BlockId, Compatible, CutOffReason, EngineId, Handshake, Message, PeerAddress, PeerInfo, PoolShape,
    PreparedId, PreparedTransfer, RefusalCause, RegionBase, RequestId, Time, TransferRequest, TransportError,
};
use kv_lease::ClockOffset;

use crate::config::ConfigError;

/// A D engine incarnation: the one consumer an export is bound to.
///
/// The router may name it when it sends the prompt to P (routers that pick P and D together
/// know it); otherwise the first handshaked D engine to claim the export is bound.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Consumer {
    /// The D engine.
    pub engine: EngineId,
    /// Its incarnation, as its handshake names it.
    pub instance: u64,
}

impl Consumer {
    /// The engine incarnation a handshake speaks for.
    pub fn of(handshake: &Handshake) -> Self {
        Consumer { engine: handshake.engine.clone(), instance: handshake.instance }
    }
}

impl std::fmt::Display for Consumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}#{}", self.engine, self.instance)
    }
}

/// A P engine as D reaches it: what [`RemoteRef`] says of the engine rather than of one
/// request. D can connect to it ahead of the first request
/// (`DecodeScheduler::handle_connect`).
#[derive(Clone, PartialEq, Eq, Debug)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct PrefillEngine {
    /// P's engine.
    pub engine: EngineId,
    /// P's side-channel address of each worker, by global rank (`stage * tp_size + tp rank`).
    pub addresses: Vec<PeerAddress>,
    /// P's TP size.
    pub tp_size: u32,
    /// P's pipeline-parallel size.
    pub pp_size: u32,
}

/// What P hands the router when it exports a request (vLLM's `kv_transfer_params`), and what
/// the router hands D with the request. With the `serde` feature it travels as one JSON object
/// (`{"prefill": {"engine", "addresses", "tp_size", "pp_size"}, "request", "instance",
/// "prompt_tokens", "export": {"blocks", "deadline", "finished"}, "consumer": {"engine",
/// "instance"}}`, times in nanoseconds on P's clock, absent options as `null`).
#[derive(Clone, PartialEq, Eq, Debug)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct RemoteRef {
    /// P's engine: its name, side-channel addresses and parallelism. D reads (or, in push
    /// mode, awaits a write from) every pipeline stage.
    pub prefill: PrefillEngine,
    /// P's request id.
    pub request: RequestId,
    /// P's incarnation, as its handshake names it; `None` when D comes first in push mode and
    /// cannot know it yet.
    pub instance: Option<u64>,
    /// Prompt tokens P computed.
    pub prompt_tokens: u64,
    /// The digest of the prompt's token ids P computed ([`kv_core::Digest::of_tokens`]), where
    /// P had them: D refuses a handoff whose prompt is not its own before it claims (P checks
    /// D's claim again, whatever the handoff says). Absent in JSON when unknown.
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "Option::is_none"))]
    pub prompt_digest: Option<kv_core::Digest>,
    /// The export, once P has finished the prompt: absent in push mode when D comes first.
    pub export: Option<ExportInfo>,
    /// The D engine the router named at prefill, to which P bound the export at once: another
    /// engine, or another incarnation of the same one, must not load it.
    pub consumer: Option<Consumer>,
}

/// P's exported blocks and their lease.
#[derive(Clone, PartialEq, Eq, Debug)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct ExportInfo {
    /// P's blocks, in prompt order (the same ids on every P rank).
    pub blocks: Vec<BlockId>,
    /// The lease's deadline on P's clock as P first granted it ([`Time::ZERO`] where the
    /// handoff does not say, as NixlConnector's): D reads only once P has answered its claim
    /// with a deadline, and never past the later of the two.
    pub deadline: Time,
    /// When P finished the prompt, on P's clock: D measures from it how long the KV took to
    /// reach it (`kvflow_kv_ready_latency_seconds`); `None` where the handoff does not say.
    #[cfg_attr(feature = "serde", serde(default))]
    pub finished: Option<Time>,
}

/// A handle the machine gives a transfer it asks to post; the driver maps it to the
/// transport's own id and reports the outcome with it.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct XferToken(pub u64);

/// What a worker machine asks its driver to do.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum Action<R> {
    /// Start a handshake with the P or D rank at this address.
    Connect(PeerAddress),
    /// Send an encoded [`Message`] to a connected peer.
    Send {
        /// The peer.
        to: AgentName,
        /// The frame.
        payload: Vec<u8>,
    },
    /// Post a transfer; report its outcome with the token.
    Post {
        /// The machine's handle for it.
        token: XferToken,
        /// What to post.
        request: TransferRequest,
    },
    /// Prepare a descriptor list (local when `peer` is `None`); report the outcome with the
    /// token through the machine's `handle_prepared`.
    Prepare {
        /// The machine's handle for it.
        token: XferToken,
        /// Whose memory: none for local.
        peer: Option<AgentName>,
        /// `(address, length)` ranges.
        ranges: Vec<(u64, u64)>,
    },
    /// Post a transfer between prepared lists; report its outcome with the token.
    PostPrepared {
        /// The machine's handle for it.
        token: XferToken,
        /// What to post.
        request: PreparedTransfer,
    },
    /// Drop a connected peer that discovery says is gone ([`kv_core::Transport::disconnect`]);
    /// the transport then reports it lost.
    Disconnect(AgentName),
    /// Tell the engine's scheduler side something.
    Report(R),
}

/// The span of one request's step on one engine: every event inside it carries the request
/// id (`request_id=`), the engine (`engine=`) and, on a worker, the TP rank, so that one
/// request's life can be followed across P's and D's logs by its id
/// (`RUST_LOG=kv_sched_adapter=debug`).
pub(crate) fn request_span(engine: &EngineId, rank: Option<u32>, request: &RequestId) -> tracing::Span {
    let span = tracing::debug_span!("request", engine = %engine, rank = tracing::field::Empty, request_id = %request);
    if let Some(rank) = rank {
        span.record("rank", rank);
    }
    span
}

/// What a machine counted and dropped, and other events worth a metric.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct Counters {
    /// Malformed, unknown, unauthenticated or foreign messages dropped (all causes together).
    pub ignored_messages: u64,
    /// Of those, messages about an export from an engine it is not bound to.
    pub foreign_messages: u64,
    /// Of those, input the transport refused: handshakes and notifications that did not
    /// authenticate, incompatible or impersonating peers, connections past a bound.
    pub refused: u64,
    /// Of those refusals, peers that did not prove they hold the cluster key (bad
    /// notification tags included).
    pub unauthenticated: u64,
    /// A consumer's completion (or registration) seen again, ignored.
    pub duplicate_messages: u64,
    /// Rejections D could not tell P about: P's transfer parameters map onto no P rank from
    /// this engine (a TP size that does not divide, or no address for a rank). P then holds
    /// the export until its lease ends.
    pub rejections_unsent: u64,
    /// Completions for exports P no longer had.
    pub notifications_after_expiry: u64,
    /// Other messages about requests this side no longer had.
    pub late_messages: u64,
    /// Early messages staged until their export registered.
    pub early_staged: u64,
    /// Staged early messages evicted because the stage was full, or never settled; also push
    /// "no write will come" answers dropped past the bound held for one D rank while P writes
    /// into it (D's quarantine then ends its wait).
    pub early_evicted: u64,
    /// Transfers that failed.
    pub transfers_failed: u64,
    /// Loads D did not start because P's lease could end before the read.
    pub reads_fenced: u64,
    /// Reads that completed after P's acknowledged deadline (less the margin): failed loads.
    pub late_reads: u64,
    /// Claims that named another prompt, or other blocks, than P's export: refused by P (on
    /// P), or heard refused (on D).
    pub claims_refused: u64,
    /// Push loads given up whose blocks went into quarantine until P confirmed no write.
    pub quarantined: u64,
    /// Reads posted by prepared-list indices rather than address pairs.
    pub prepared_reads: u64,
    /// Push writes posted by prepared-list indices rather than address pairs.
    pub prepared_writes: u64,
    /// Push writes posted ahead of their export, from blocks a chunked prefill had finished.
    pub writes_ahead: u64,
    /// Push writes of some model layers only (a chunk computed layer by layer), as pairs.
    pub layer_writes: u64,
    /// Of the ignored messages, input that did not decode (or that the transport refused as
    /// malformed).
    pub malformed: u64,
    /// Of the ignored messages, well-formed ones this side never takes from that peer: from an
    /// engine of the wrong role or an unmapped rank, of a kind this side does not receive, a
    /// push registration in pull mode or naming another agent.
    pub unknown: u64,
    /// Input the transport (or the worker, for stale and incompatible handshakes) refused, by
    /// cause, indexed by [`RefusalCause::index`].
    pub refused_by_cause: [u64; RefusalCause::ALL.len()],
    /// Lease renewals P granted (one per export a heartbeat renewed).
    pub leases_renewed: u64,
    /// Peers whose connection this rank saw lost (side channel closed, a newer incarnation
    /// handshook, or discovery said its engine is gone).
    pub peers_lost: u64,
    /// Peers the transport cut off (its `Lost` then counts in `peers_lost` too), by reason,
    /// indexed by [`CutOffReason::index`].
    pub peers_cut_off: [u64; CutOffReason::ALL.len()],
    /// P: block-milliseconds of exports held for an owner that is silent (nothing from it for
    /// two heartbeat intervals; an export no engine has claimed counts from its registration),
    /// each block of this rank's pool counted once however many siblings share it.
    pub stranded_block_ms: u64,
}

impl Counters {
    /// Counts input the transport refused as an ignored message, by cause; a notification seen
    /// twice counts as a duplicate.
    pub(crate) fn refused(&mut self, peer: Option<&AgentName>, cause: RefusalCause, reason: &str) {
        let peer = peer.map_or_else(|| "an unnamed peer".to_owned(), AgentName::to_string);
        // Debug here: anyone who can reach the side channel can cause these, so the workers'
        // WARNING lines are rate-limited (`crate::warnings`); the counters say how many.
        tracing::debug!(%peer, ?cause, %reason, "the transport refused input");
        self.refusal(cause);
    }

    /// Counts a peer the transport cut off for `reason`.
    pub(crate) fn cut_off(&mut self, peer: &AgentName, reason: CutOffReason) {
        // The transport logged it, once per peer, at WARNING.
        tracing::debug!(%peer, reason = reason.as_str(), "the transport cut a peer off");
        self.peers_cut_off[reason.index()] += 1;
    }

    /// Counts a refusal of `cause` as an ignored message (a replayed notification as a duplicate).
    pub(crate) fn refusal(&mut self, cause: RefusalCause) {
        if cause == RefusalCause::Replayed {
            self.duplicate_messages += 1;
            return;
        }
        self.ignored_messages += 1;
        self.refused += 1;
        self.refused_by_cause[cause.index()] += 1;
        match cause {
            RefusalCause::Unauthenticated => self.unauthenticated += 1,
            RefusalCause::Malformed => self.malformed += 1,
            _ => {}
        }
    }

    /// Counts an ignored message of `cause`.
    pub(crate) fn ignored(&mut self, cause: Ignored) {
        self.ignored_messages += 1;
        match cause {
            Ignored::Malformed => self.malformed += 1,
            Ignored::Unknown => self.unknown += 1,
            Ignored::Unauthenticated => self.unauthenticated += 1,
        }
    }

    /// The input this side counted and dropped, by cause, as the metric
    /// `kvflow_ignored_messages_total` labels it. The first five causes add up to
    /// `ignored_messages`; `late` and `duplicate` are messages about requests this side no
    /// longer has (notifications after expiry included) and messages seen twice.
    pub fn ignored_by_cause(&self) -> [(&'static str, u64); 7] {
        let refused_other = self.refused
            - self.refused_by_cause[RefusalCause::Malformed.index()]
            - self.refused_by_cause[RefusalCause::Unauthenticated.index()];
        [
            ("malformed", self.malformed),
            ("unknown", self.unknown),
            ("foreign", self.foreign_messages),
            ("unauthenticated", self.unauthenticated),
            ("refused", refused_other),
            ("late", self.late_messages + self.notifications_after_expiry),
            ("duplicate", self.duplicate_messages),
        ]
    }

    /// Adds another machine's counts to these.
    pub fn add(&mut self, other: &Counters) {
        self.ignored_messages += other.ignored_messages;
        self.foreign_messages += other.foreign_messages;
        self.refused += other.refused;
        self.unauthenticated += other.unauthenticated;
        self.duplicate_messages += other.duplicate_messages;
        self.rejections_unsent += other.rejections_unsent;
        self.notifications_after_expiry += other.notifications_after_expiry;
        self.late_messages += other.late_messages;
        self.early_staged += other.early_staged;
        self.early_evicted += other.early_evicted;
        self.transfers_failed += other.transfers_failed;
        self.reads_fenced += other.reads_fenced;
        self.late_reads += other.late_reads;
        self.claims_refused += other.claims_refused;
        self.quarantined += other.quarantined;
        self.prepared_reads += other.prepared_reads;
        self.prepared_writes += other.prepared_writes;
        self.writes_ahead += other.writes_ahead;
        self.layer_writes += other.layer_writes;
        self.malformed += other.malformed;
        self.unknown += other.unknown;
        for (mine, theirs) in self.refused_by_cause.iter_mut().zip(other.refused_by_cause) {
            *mine += theirs;
        }
        self.leases_renewed += other.leases_renewed;
        self.peers_lost += other.peers_lost;
        self.stranded_block_ms += other.stranded_block_ms;
    }
}

/// Why a message was counted and dropped (besides foreign ones and transport refusals).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Ignored {
    /// It did not decode.
    Malformed,
    /// This side never takes it from that peer.
    Unknown,
    /// Its sender never completed the handshake.
    Unauthenticated,
}

/// This rank's own pool: what plans are built from.
#[derive(Clone, Debug)]
pub struct LocalPool {
    /// The rank's pool shape.
    pub shape: PoolShape,
    /// Its registered regions.
    pub regions: Vec<RegionBase>,
}

impl LocalPool {
    /// The handshake offer of `agent`, a rank of a `tp_size`-wide engine, incarnation
    /// `instance`, serving `model` in `role` over this pool: its layout, block count and
    /// regions, the protocol version and the compatibility hash. The transport stamps the
    /// clock and adds its agent metadata when it sends the offer.
    /// A pool of one pipeline stage ([`PoolShape::for_stage`]) offers its engine's stage count,
    /// and `agent.rank` is then the worker's global rank.
    pub fn offer(&self, agent: &AgentName, tp_size: u32, instance: u64, role: Role, model: &str) -> Handshake {
        Handshake {
            num_blocks: self.shape.num_blocks,
            regions: self.regions.clone(),
            // Stages split the layers evenly, so a stage's share says how many there are.
            pp_size: self.shape.layout.layers / self.shape.layers.count.max(1),
            ..Handshake::new(agent, tp_size, instance, role, model, self.shape.layout)
        }
    }

    /// Checks that `offer`, a worker's handshake, describes this pool and a `role` rank, so a
    /// hand-built offer that disagrees fails at construction instead of failing every load.
    pub(crate) fn check_offer(&self, offer: &Handshake, role: Role) -> Result<(), ConfigError> {
        let mismatch = |field, offer: String, pool: String| Err(ConfigError::Offer { field, offer, pool });
        if offer.role != role {
            return mismatch("role", format!("{:?}", offer.role), format!("{role:?} (the worker's)"));
        }
        if offer.rank >= offer.workers() {
            let workers = format!("below tp_size {} x pp_size {}", offer.tp_size, offer.pp_size);
            return mismatch("rank", offer.rank.to_string(), workers);
        }
        let stage = self.shape.for_stage(offer.pp_rank(), offer.pp_size);
        if stage.map(|s| s.layers) != Ok(self.shape.layers) {
            let layers = format!("layers {}..{}", self.shape.layers.first, self.shape.layers.end());
            return mismatch("pp_size", format!("stage {} of {}", offer.pp_rank(), offer.pp_size), layers);
        }
        if offer.layout != self.shape.layout {
            return mismatch("layout", format!("{:?}", offer.layout), format!("{:?}", self.shape.layout));
        }
        if offer.num_blocks != self.shape.num_blocks {
            return mismatch("num_blocks", offer.num_blocks.to_string(), self.shape.num_blocks.to_string());
        }
        if offer.regions != self.regions {
            return mismatch("regions", format!("{:?}", offer.regions), format!("{:?}", self.regions));
        }
        let heads = self.shape.layout.heads_per_rank(offer.tp_size);
        if self.shape.heads != heads {
            let pool = format!("{} heads a rank, {heads} at tp_size {}", self.shape.heads, offer.tp_size);
            return mismatch("tp_size", offer.tp_size.to_string(), pool);
        }
        Ok(())
    }
}

/// A prepared descriptor list: not asked for, asked for, ready, or refused (then pairs).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum ListState {
    Pending(XferToken),
    Ready(PreparedId),
    Failed,
}

/// A rank's pool prepared once, and each peer's pool prepared at its first transfer, so that
/// transfers of whole blocks name entries by index.
#[derive(Debug, Default)]
pub(crate) struct PreparedLists {
    local: Option<ListState>,
    remote: BTreeMap<AgentName, ListState>,
    preparing: BTreeMap<XferToken, Option<AgentName>>,
}

impl PreparedLists {
    /// The local and `peer`'s lists, if both are ready.
    pub fn ready(&self, peer: &AgentName) -> Option<(PreparedId, PreparedId)> {
        match (self.local, self.remote.get(peer)) {
            (Some(ListState::Ready(local)), Some(ListState::Ready(remote))) => Some((local, *remote)),
            _ => None,
        }
    }

    /// Asks for whichever of the local and `peer`'s lists was never asked for.
    pub fn want<R>(
        &mut self,
        out: &mut Outbox<R>,
        pool: &LocalPool,
        peer: &AgentName,
        peer_shape: &PoolShape,
        peer_regions: &[RegionBase],
    ) {
        if self.local.is_none() {
            let bases: Vec<u64> = pool.regions.iter().map(|r| r.addr).collect();
            let token = out.prepare(None, pool.shape.block_descriptors(&bases));
            self.local = Some(ListState::Pending(token));
            self.preparing.insert(token, None);
        }
        if !self.remote.contains_key(peer) {
            let bases: Vec<u64> = peer_regions.iter().map(|r| r.addr).collect();
            let token = out.prepare(Some(peer.clone()), peer_shape.block_descriptors(&bases));
            self.remote.insert(peer.clone(), ListState::Pending(token));
            self.preparing.insert(token, Some(peer.clone()));
        }
    }

    /// Records a prepared list, or that it could not be made (transfers then go as pairs).
    pub fn handle_prepared(&mut self, token: XferToken, result: Result<PreparedId, TransportError>) {
        let Some(owner) = self.preparing.remove(&token) else { return };
        let state = match result {
            Ok(id) => ListState::Ready(id),
            Err(err) => {
                tracing::debug!(%err, "descriptor list not prepared; transfers go as address pairs");
                ListState::Failed
            }
        };
        match owner {
            None => self.local = Some(state),
            // Only if it is still the list of the peer as connected now.
            Some(peer) => {
                if self.remote.get(&peer) == Some(&ListState::Pending(token)) {
                    self.remote.insert(peer, state);
                }
            }
        }
    }

    /// Forgets `peer`'s list: it is gone, or a new incarnation of it connected.
    pub fn forget(&mut self, peer: &AgentName) {
        self.remote.remove(peer);
    }
}

/// Whether a transfer between pools `a` and `b` moving `slice` can name prepared entries by
/// index: whole blocks (equal block sizes, the same layers: a pipeline stage's blocks are
/// only part of a whole model's) and whole heads on both sides. Otherwise it goes as pairs.
pub(crate) fn by_index(a: &PoolShape, b: &PoolShape, slice: &kv_core::HeadSlice) -> bool {
    slice.heads == a.heads
        && slice.heads == b.heads
        && a.layers == b.layers
        && a.layout.block_tokens == b.layout.block_tokens
}

/// The prepared-list entries of a transfer of whole blocks, `local_blocks[i]` with
/// `remote_blocks[i]`, in memory order (by descriptor group, then block: a layer-major pool's
/// groups are its layers, a layer-plane-major pool's its layers' planes), so that
/// runs contiguous on both sides are adjacent entries the transport merges.
pub(crate) fn block_indices(
    local: &PoolShape,
    local_blocks: &[BlockId],
    remote: &PoolShape,
    remote_blocks: &[BlockId],
) -> (Vec<u32>, Vec<u32>) {
    (0..local.descriptor_groups())
        .flat_map(|group| {
            local_blocks
                .iter()
                .zip(remote_blocks)
                .map(move |(l, r)| (local.descriptor_index(group, l.0), remote.descriptor_index(group, r.0)))
        })
        .unzip()
}

/// A peer that completed the handshake.
#[derive(Clone, Debug)]
pub(crate) struct Peer {
    pub handshake: Handshake,
    pub compat: Compatible,
    pub offset: ClockOffset,
}

impl Peer {
    pub fn new(info: &PeerInfo, compat: Compatible) -> Self {
        Peer {
            handshake: info.handshake.clone(),
            compat,
            offset: ClockOffset::from_sample(info.clock_offset_nanos(), info.round_trip()),
        }
    }

    /// The engine incarnation this peer belongs to.
    pub fn consumer(&self) -> Consumer {
        Consumer::of(&self.handshake)
    }

    /// Whether the peer is an agent of `engine` at incarnation `instance` or an older one:
    /// one that discovery's loss of that incarnation takes with it.
    pub fn is_at_most(&self, engine: &EngineId, instance: u64) -> bool {
        self.handshake.engine == *engine && self.handshake.instance <= instance
    }

    /// The peer's pool shape, from its handshake: a prefill peer's pool holds its pipeline
    /// stage's layers.
    pub fn shape(&self, heads: u32) -> Option<PoolShape> {
        let hs = &self.handshake;
        PoolShape::new(hs.layout, heads, hs.num_blocks).and_then(|s| s.for_stage(hs.pp_rank(), hs.pp_size)).ok()
    }
}

/// The action queue and the helpers every machine uses to fill it.
#[derive(Debug)]
pub(crate) struct Outbox<R> {
    actions: VecDeque<Action<R>>,
    next_token: u64,
}

impl<R> Default for Outbox<R> {
    fn default() -> Self {
        Outbox { actions: VecDeque::new(), next_token: 0 }
    }
}

impl<R> Outbox<R> {
    pub fn send(&mut self, to: &AgentName, message: &Message) {
        match message.encode() {
            Ok(payload) => self.actions.push_back(Action::Send { to: to.clone(), payload }),
            Err(err) => tracing::warn!(peer = %to, %err, "message not sent"),
        }
    }

    /// Sends a heartbeat (or its acknowledgement) in as many frames as the size limit needs.
    pub fn send_split<T: Clone>(&mut self, to: &AgentName, items: &[T], make: impl Fn(Vec<T>) -> Message) {
        // Request ids are at most 256 bytes, so 200 per frame stays well under 64 KiB.
        for chunk in items.chunks(200) {
            self.send(to, &make(chunk.to_vec()));
        }
    }

    pub fn post(&mut self, request: TransferRequest) -> XferToken {
        let token = self.token();
        self.actions.push_back(Action::Post { token, request });
        token
    }

    fn token(&mut self) -> XferToken {
        let token = XferToken(self.next_token);
        self.next_token += 1;
        token
    }

    pub fn prepare(&mut self, peer: Option<AgentName>, ranges: Vec<(u64, u64)>) -> XferToken {
        let token = self.token();
        self.actions.push_back(Action::Prepare { token, peer, ranges });
        token
    }

    pub fn post_prepared(&mut self, request: PreparedTransfer) -> XferToken {
        let token = self.token();
        self.actions.push_back(Action::PostPrepared { token, request });
        token
    }

    pub fn connect(&mut self, address: PeerAddress) {
        self.actions.push_back(Action::Connect(address));
    }

    pub fn disconnect(&mut self, peer: AgentName) {
        self.actions.push_back(Action::Disconnect(peer));
    }

    pub fn report(&mut self, report: R) {
        self.actions.push_back(Action::Report(report));
    }

    pub fn pop(&mut self) -> Option<Action<R>> {
        self.actions.pop_front()
    }
}

/// A small pool and its rank-0 handshake offer, for the crate's unit tests.
#[cfg(test)]
pub(crate) fn test_offer(engine: &str, role: Role, tp_size: u32) -> (LocalPool, Handshake) {
    let layout = kv_core::KvLayout::split_kv(2, 16, 4, 8, kv_core::Dtype::Bfloat16);
    let shape = kv_core::PoolShape::new(layout, layout.heads_per_rank(tp_size), 8).expect("a valid shape");
    let pool = LocalPool { shape, regions: vec![kv_core::RegionBase { addr: 0x10_0000, len: shape.pool_bytes() }] };
    let offer = pool.offer(&AgentName::new(EngineId::new(engine), 0), tp_size, 1, role, "m");
    (pool, offer)
}
