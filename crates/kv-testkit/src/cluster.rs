//! A simulated cluster of P and D engines over the fake network, driving kvflow's real
//! connectors (kv-sched-adapter) as an engine would.
//!
//! Each engine has a KV pool per TP rank in [`InMemoryMemory`], a block allocator that hands
//! out the lowest free ids first (so freed blocks are soon reused), its scheduler-side
//! connector and one [`WorkerDriver`] per rank over a [`FakeTransport`]. Engines step at every
//! multiple of the step interval; the cluster skips the steps where nothing is due, which a
//! sans-IO machine cannot tell from a step (a spurious wake-up is a no-op).
//!
//! The cluster is also the oracle. P fills every block it computes with bytes derived from
//! (engine, request, generation, position); D's loaded blocks are compared with them, byte
//! for byte. Freed blocks are scrubbed at once, so a transfer that reads a block after its
//! free delivers scrub bytes and counts as a corrupt read; an allocation checks the scrub is
//! intact, so a write into a freed block is caught too.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

use kv_core::{
    AgentName, Attention, BlockId, EngineId, KvLayout, Memory, MemoryKind, MemoryOrder, Message, PeerAddress,
    Placement, PoolShape, Region, RegionBase, RequestId, Role, Time, TransferOp,
};
use kv_sched_adapter::driver::WorkerDriver;
use kv_sched_adapter::{
    Config, Consumer, Counters, DecodeEvent, DecodeScheduler, DecodeState, DecodeWorker, LocalPool, Mode,
    PrefillCommand, PrefillEvent, PrefillScheduler, PrefillWorker, ReleaseReason, RemoteRef,
};

use crate::{offer, BlockPool, FakeHeap, FakeNetwork, InMemoryMemory, ManualClock, NetConfig, Scope};

/// The byte a freed block is scrubbed with.
const SCRUB: u8 = 0xDB;

/// The cluster's shape and the connectors' settings.
#[derive(Clone, Debug)]
pub struct ClusterConfig {
    /// Pull or push (also in `connector`; this one wins).
    pub mode: Mode,
    /// P engines, named `prefill0`, `prefill1`, ...
    pub prefillers: u32,
    /// D engines, named `decode0`, ...
    pub decoders: u32,
    /// P's TP size.
    pub prefill_tp: u32,
    /// D's TP size.
    pub decode_tp: u32,
    /// P's tokens per block.
    pub prefill_block_tokens: u32,
    /// D's tokens per block.
    pub decode_block_tokens: u32,
    /// The model's KV heads.
    pub kv_heads: u32,
    /// MLA (one latent, replicated).
    pub mla: bool,
    /// Blocks per P engine.
    pub prefill_num_blocks: u32,
    /// Blocks per D engine.
    pub decode_num_blocks: u32,
    /// Every engine steps at every multiple of this.
    pub step_interval: Duration,
    /// One-way message latency.
    pub network_latency: Duration,
    /// Post to completion of a transfer.
    pub transfer_latency: Duration,
    /// P's scheduler to P's workers.
    pub worker_handoff: Duration,
    /// The connectors' settings.
    pub connector: Config,
    /// The network's seed.
    pub seed: u64,
    /// Random faults on every notification.
    pub drop_rate: f64,
    /// Random duplication of notifications.
    pub duplicate_rate: f64,
    /// Random extra delay, which reorders.
    pub reorder_jitter: Duration,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        ClusterConfig {
            mode: Mode::Pull,
            prefillers: 1,
            decoders: 1,
            prefill_tp: 1,
            decode_tp: 1,
            prefill_block_tokens: 16,
            decode_block_tokens: 16,
            kv_heads: 8,
            mla: false,
            prefill_num_blocks: 1000,
            decode_num_blocks: 1000,
            step_interval: Duration::from_millis(10),
            network_latency: Duration::from_millis(1),
            transfer_latency: Duration::from_millis(5),
            worker_handoff: Duration::from_millis(10),
            connector: Config::default(),
            seed: 0,
            drop_rate: 0.0,
            duplicate_rate: 0.0,
            reorder_jitter: Duration::ZERO,
        }
    }
}

impl ClusterConfig {
    /// The simulated model: small, so that pools are cheap to fill and check.
    fn layout(&self, block_tokens: u32) -> KvLayout {
        KvLayout {
            layers: 2,
            block_tokens,
            kv_heads: if self.mla { 1 } else { self.kv_heads },
            head_dim: 4,
            dtype_bytes: 1,
            attention: if self.mla { Attention::Mla } else { Attention::SplitKv },
            order: MemoryOrder::Hnd,
            placement: Placement::BlockMajor,
        }
    }
}

/// A scenario or workload step the cluster cannot take.
#[derive(Clone, PartialEq, Eq, Debug, thiserror::Error)]
#[error("{0}")]
pub struct ClusterError(pub String);

fn err<T>(message: impl Into<String>) -> Result<T, ClusterError> {
    Err(ClusterError(message.into()))
}

/// One TP rank's memory: its pool region and shape.
struct RankMemory {
    memory: InMemoryMemory,
    region: Region,
    shape: PoolShape,
    rank: u32,
}

impl RankMemory {
    fn block_offset(&self, block: BlockId) -> u64 {
        u64::from(block.0) * self.shape.block_bytes()
    }

    fn scrub(&mut self, blocks: &[BlockId]) {
        let scrub = vec![SCRUB; self.shape.block_bytes() as usize];
        for &b in blocks {
            let _ = self.memory.write(self.region.id, self.block_offset(b), &scrub);
        }
    }

    fn scrubbed(&self, block: BlockId) -> bool {
        let mut bytes = vec![0; self.shape.block_bytes() as usize];
        self.memory.read(self.region.id, self.block_offset(block), &mut bytes).is_ok()
            && bytes.iter().all(|&b| b == SCRUB)
    }
}

/// The model-wide index of the first head a rank holds.
fn first_head(layout: &KvLayout, rank: u32, tp: u32) -> u32 {
    if layout.is_mla() {
        0
    } else if tp <= layout.kv_heads {
        rank * (layout.kv_heads / tp)
    } else {
        rank / (tp / layout.kv_heads)
    }
}

/// The byte P computes at a position of a prompt's KV: a mix of everything that names it.
fn kv_byte(seed: u64, layer: u32, plane: u32, head: u32, token: u64, e: u64) -> u8 {
    let mut x =
        seed ^ (u64::from(layer) << 56) ^ (u64::from(plane) << 52) ^ (u64::from(head) << 40) ^ (token << 12) ^ e;
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    let byte = x as u8;
    // Never the scrub byte, so a scrubbed block never passes for data.
    if byte == SCRUB {
        0
    } else {
        byte
    }
}

/// The bytes of one block on one rank: `[layer][plane][head][token][elem]` (block-major, HND).
fn block_bytes(shape: &PoolShape, first_head: u32, seed: u64, first_token: u64, valid_tokens: u64) -> Vec<Option<u8>> {
    let l = shape.layout;
    let elems = shape.head_bytes_per_token();
    let mut out = Vec::with_capacity(shape.block_bytes() as usize);
    for layer in 0..l.layers {
        for plane in 0..l.planes() {
            for h in 0..shape.heads {
                for t in 0..u64::from(l.block_tokens) {
                    let token = first_token + t;
                    for e in 0..elems {
                        out.push((token < valid_tokens).then(|| kv_byte(seed, layer, plane, first_head + h, token, e)));
                    }
                }
            }
        }
    }
    out
}

/// What P computed for an export: the oracle D's bytes are checked against.
#[derive(Clone, Copy, Debug)]
struct Computed {
    seed: u64,
    /// Tokens P wrote: its blocks, whole.
    tokens: u64,
}

struct PrefillEngine {
    id: EngineId,
    scheduler: PrefillScheduler,
    workers: Vec<WorkerDriver<PrefillWorker>>,
    ranks: Vec<RankMemory>,
    pool: BlockPool,
    handoff: VecDeque<(Time, u32, PrefillCommand)>,
    export_blocks: BTreeMap<RequestId, Vec<BlockId>>,
}

struct DecodeEngine {
    id: EngineId,
    scheduler: DecodeScheduler,
    workers: Vec<WorkerDriver<DecodeWorker>>,
    ranks: Vec<RankMemory>,
    pool: BlockPool,
    loads: BTreeMap<RequestId, DecodeLoad>,
    /// Commands the scheduler gave, not yet handed to the workers.
    commands: VecDeque<(u32, kv_sched_adapter::DecodeCommand)>,
    /// The final state of every request that ended here (the scheduler forgets them).
    ended: BTreeMap<RequestId, DecodeState>,
}

/// A message a handshaked engine forges about another engine's export (a scenario's `forge`
/// `message`).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ForgedMessage {
    /// `"completion"`: the transfer is done, counting the event's `consumers`.
    Completion,
    /// `"abort"`: the consumer gave the request up.
    Abort,
    /// `"heartbeat"`: a lease renewal.
    Heartbeat,
    /// `"reject"`: the consumer rejected the request before admission.
    Reject,
}

/// A router call that reached an engine while it was paused: it runs when the engine resumes.
#[derive(Clone, Debug)]
enum Deferred {
    Arrive { request: RequestId, remote: RemoteRef },
    Schedule { request: RequestId, prefix_hit: bool },
    Reject { request: RequestId, remote: RemoteRef },
    Abort { request: RequestId },
}

#[derive(Clone, Debug)]
struct DecodeLoad {
    remote: RemoteRef,
    blocks: Vec<BlockId>,
    prefix_hit: bool,
}

/// Per engine name, what outlives its crashes: counters, releases, states.
#[derive(Default, Debug)]
struct History {
    released: BTreeMap<RequestId, ReleaseReason>,
    retired: Counters,
    generation: u64,
}

/// The simulated cluster.
pub struct Cluster {
    config: ClusterConfig,
    clock: ManualClock,
    net: FakeNetwork,
    prefill: BTreeMap<EngineId, Option<PrefillEngine>>,
    decode: BTreeMap<EngineId, Option<DecodeEngine>>,
    history: BTreeMap<EngineId, History>,
    /// The router's view: P's parameters for each of its export ids.
    exports: BTreeMap<(EngineId, RequestId), RemoteRef>,
    /// The oracle: what P computed for each export id.
    computed: BTreeMap<(EngineId, RequestId), Computed>,
    corrupt_reads: u64,
    /// Blocks found written while their engine had them free (at their next allocation).
    written_after_free: u64,
    loads_verified: u64,
    /// Engines paused until a time, and the router calls they will handle when they resume.
    paused: BTreeMap<EngineId, (Time, Vec<Deferred>)>,
    /// When each engine last resumed from a pause: it could not hear of anything before.
    resumed: BTreeMap<EngineId, Time>,
    violations: Vec<String>,
    trace: Vec<String>,
    /// A running hash of every TP rank's reports to its scheduler: not printed in the trace,
    /// but part of the digest, so that runs differing only in rank-level events (another TP
    /// size, say) differ in digest.
    rank_digest: u64,
    last_step: Option<Time>,
    dirty_since: Option<Time>,
    prefills: u64,
}

impl Cluster {
    /// A cluster at time zero with every engine up and empty.
    pub fn new(config: ClusterConfig) -> Result<Self, ClusterError> {
        let mut connector = config.connector;
        connector.mode = config.mode;
        connector.validate().map_err(|e| ClusterError(e.to_string()))?;
        if config.step_interval.is_zero() {
            return err("step interval must be positive");
        }
        let clock = ManualClock::default();
        let net_config = NetConfig {
            latency: config.network_latency,
            transfer_latency: config.transfer_latency,
            drop_rate: config.drop_rate,
            duplicate_rate: config.duplicate_rate,
            reorder_jitter: config.reorder_jitter,
        };
        let net = FakeNetwork::new(config.seed, clock.clone(), net_config);
        let mut cluster = Cluster {
            config: ClusterConfig { connector, ..config },
            clock,
            net,
            prefill: BTreeMap::new(),
            decode: BTreeMap::new(),
            history: BTreeMap::new(),
            exports: BTreeMap::new(),
            computed: BTreeMap::new(),
            corrupt_reads: 0,
            written_after_free: 0,
            loads_verified: 0,
            paused: BTreeMap::new(),
            resumed: BTreeMap::new(),
            violations: Vec::new(),
            trace: Vec::new(),
            rank_digest: FNV_OFFSET,
            last_step: None,
            dirty_since: None,
            prefills: 0,
        };
        for i in 0..cluster.config.prefillers {
            let id = EngineId::new(format!("prefill{i}"));
            let engine = cluster.start_prefill(&id)?;
            cluster.prefill.insert(id, Some(engine));
        }
        for i in 0..cluster.config.decoders {
            let id = EngineId::new(format!("decode{i}"));
            let engine = cluster.start_decode(&id)?;
            cluster.decode.insert(id, Some(engine));
        }
        Ok(cluster)
    }

    /// The simulated time.
    pub fn now(&self) -> Time {
        self.clock.now()
    }

    /// The network, for faults.
    pub fn network(&self) -> &FakeNetwork {
        &self.net
    }

    fn address(engine: &EngineId, rank: u32) -> PeerAddress {
        PeerAddress(format!("{engine}/tp{rank}"))
    }

    fn heap_base(&mut self, engine: &EngineId) -> u64 {
        // Each engine incarnation gets its own address range, so that local and remote
        // addresses never coincide and a swapped plan cannot pass.
        let index = self.history.len() as u64;
        let history = self.history.entry(engine.clone()).or_default();
        history.generation += 1;
        0x1_0000_0000 * (1 + index) + 0x1000_0000 * history.generation
    }

    /// The current incarnation of an engine: 1 at start, one more at each restart.
    fn instance(&self, engine: &EngineId) -> u64 {
        self.history.get(engine).map_or(0, |h| h.generation)
    }

    fn start_ranks(
        &mut self,
        engine: &EngineId,
        role: Role,
        tp: u32,
        block_tokens: u32,
        num_blocks: u32,
    ) -> Result<Vec<(RankMemory, kv_core::Handshake, crate::FakeTransport)>, ClusterError> {
        let layout = self.config.layout(block_tokens);
        let heads = layout.heads_per_rank(tp);
        let shape = PoolShape::new(layout, heads, num_blocks).map_err(|e| ClusterError(e.to_string()))?;
        let base = self.heap_base(engine);
        let instance = self.instance(engine);
        let mut ranks = Vec::new();
        for rank in 0..tp {
            let heap = FakeHeap::with_base(base + u64::from(rank) * 0x100_0000 * 16);
            let mut memory = InMemoryMemory::new(heap.clone());
            let region = memory
                .allocate(MemoryKind::Host, shape.pool_bytes())
                .map_err(|e| ClusterError(format!("{engine}: {e}")))?;
            let agent = AgentName::new(engine.clone(), rank);
            let mut hs = offer(&agent, role, tp, layout);
            hs.num_blocks = num_blocks;
            hs.instance = instance;
            hs.regions = vec![RegionBase { addr: region.addr, len: region.len }];
            let mut transport = self
                .net
                .transport(agent, Self::address(engine, rank), heap, hs.clone())
                .map_err(|e| ClusterError(e.to_string()))?;
            kv_core::Transport::register(&mut transport, &region).map_err(|e| ClusterError(e.to_string()))?;
            let mut mem = RankMemory { memory, region, shape, rank };
            let all: Vec<BlockId> = (0..num_blocks).map(BlockId).collect();
            mem.scrub(&all);
            ranks.push((mem, hs, transport));
        }
        Ok(ranks)
    }

    fn start_prefill(&mut self, id: &EngineId) -> Result<PrefillEngine, ClusterError> {
        let c = self.config.clone();
        let started =
            self.start_ranks(id, Role::Prefill, c.prefill_tp, c.prefill_block_tokens, c.prefill_num_blocks)?;
        let addresses = (0..c.prefill_tp).map(|r| Self::address(id, r)).collect();
        let mut ranks = Vec::new();
        let mut workers = Vec::new();
        for (mem, hs, transport) in started {
            let pool = LocalPool { shape: mem.shape, regions: hs.regions.clone() };
            workers.push(WorkerDriver::new(PrefillWorker::new(hs, c.connector, pool), Box::new(transport)));
            ranks.push(mem);
        }
        Ok(PrefillEngine {
            id: id.clone(),
            scheduler: PrefillScheduler::new(id.clone(), self.instance(id), addresses, c.connector),
            workers,
            ranks,
            pool: BlockPool::new(c.prefill_num_blocks),
            handoff: VecDeque::new(),
            export_blocks: BTreeMap::new(),
        })
    }

    fn start_decode(&mut self, id: &EngineId) -> Result<DecodeEngine, ClusterError> {
        let c = self.config.clone();
        let started = self.start_ranks(id, Role::Decode, c.decode_tp, c.decode_block_tokens, c.decode_num_blocks)?;
        let mut ranks = Vec::new();
        let mut workers = Vec::new();
        for (mem, hs, transport) in started {
            let pool = LocalPool { shape: mem.shape, regions: hs.regions.clone() };
            workers.push(WorkerDriver::new(DecodeWorker::new(hs, c.connector, pool), Box::new(transport)));
            ranks.push(mem);
        }
        Ok(DecodeEngine {
            id: id.clone(),
            scheduler: DecodeScheduler::new(c.decode_tp, c.connector),
            workers,
            ranks,
            pool: BlockPool::new(c.decode_num_blocks),
            loads: BTreeMap::new(),
            commands: VecDeque::new(),
            ended: BTreeMap::new(),
        })
    }

    /// Adds a line to the event trace.
    pub fn note(&mut self, line: String) {
        self.record(line);
    }

    fn record(&mut self, line: String) {
        tracing::trace!("{line}");
        self.trace.push(format!("{} {line}", self.now()));
    }

    fn violation(&mut self, line: String) {
        self.record(format!("VIOLATION {line}"));
        self.violations.push(format!("at {}: {line}", self.now()));
    }

    // ---- time ----

    fn next_step_at_or_after(&self, t: Time) -> Time {
        let interval = self.config.step_interval.as_nanos() as u64;
        let mut step = Time::from_nanos(t.as_nanos().div_ceil(interval) * interval);
        if let Some(last) = self.last_step {
            if step <= last {
                step = last + self.config.step_interval;
            }
        }
        step
    }

    /// The next time an engine must step: a machine's wake-up, a handoff, or network activity.
    fn next_engine_step(&mut self) -> Option<Time> {
        let mut due: Option<Time> = self.dirty_since;
        let mut take = |t: Option<Time>| {
            if let Some(t) = t {
                due = Some(due.map_or(t, |d| d.min(t)));
            }
        };
        // A paused engine wants nothing until it resumes; then it catches up on everything.
        for (until, _) in self.paused.values() {
            take(Some(*until));
        }
        let paused = &self.paused;
        for engine in self.prefill.values_mut().flatten().filter(|e| !paused.contains_key(&e.id)) {
            take(engine.handoff.iter().map(|(t, _, _)| *t).min());
            for w in &mut engine.workers {
                take(w.poll_timeout());
            }
        }
        for engine in self.decode.values_mut().flatten().filter(|e| !paused.contains_key(&e.id)) {
            for w in &mut engine.workers {
                take(w.poll_timeout());
            }
        }
        due.map(|t| self.next_step_at_or_after(t))
    }

    /// Runs everything due up to and including `target`, in time order.
    pub fn advance_to(&mut self, target: Time) {
        loop {
            let net_next = self.net.next_event_time();
            let step_next = self.next_engine_step();
            let next = [net_next, step_next].into_iter().flatten().min();
            let Some(next) = next.filter(|&t| t <= target) else { break };
            self.clock.advance_to(next);
            if net_next == Some(next) {
                self.net.settle();
                self.dirty_since.get_or_insert(next);
            }
            if step_next == Some(next) {
                self.step_engines();
            }
        }
        self.clock.advance_to(target);
        self.net.settle();
    }

    fn step_engines(&mut self) {
        let now = self.now();
        self.last_step = Some(now);
        self.dirty_since = None;
        self.resume_engines(now);
        let names: Vec<EngineId> = self.prefill.keys().filter(|e| !self.paused.contains_key(*e)).cloned().collect();
        for id in &names {
            self.step_prefill(id, now);
        }
        let names: Vec<EngineId> = self.decode.keys().filter(|e| !self.paused.contains_key(*e)).cloned().collect();
        for id in &names {
            self.step_decode(id, now);
        }
        self.check_release_timing(now);
    }

    fn step_prefill(&mut self, id: &EngineId, now: Time) {
        let Some(mut engine) = self.prefill.get_mut(id).and_then(Option::take) else { return };
        while engine.handoff.front().is_some_and(|(t, _, _)| *t <= now) {
            let (_, rank, command) = engine.handoff.pop_front().expect("due");
            engine.workers[rank as usize].machine().handle_command(now, command);
        }
        for rank in 0..engine.workers.len() {
            let reports = engine.workers[rank].step(now);
            for report in reports {
                self.fold_rank_event(&format!("{now} {id}/tp{rank} {report:?}"));
                if let Err(e) = engine.scheduler.handle_report(rank as u32, report) {
                    self.violation(format!("{id}: {e}"));
                }
            }
        }
        self.drain_prefill(&mut engine, now);
        self.prefill.insert(id.clone(), Some(engine));
    }

    fn drain_prefill(&mut self, engine: &mut PrefillEngine, now: Time) {
        while let Some(event) = engine.scheduler.poll_event() {
            match event {
                PrefillEvent::ToWorker { rank, command } => {
                    engine.handoff.push_back((now + self.config.worker_handoff, rank, command));
                }
                PrefillEvent::Free { request, blocks, reason } => {
                    self.record(format!("{} released {request} {reason}", engine.id));
                    engine.export_blocks.remove(&request);
                    let history = self.history.entry(engine.id.clone()).or_default();
                    if history.released.insert(request.clone(), reason).is_some() {
                        self.violation(format!("{}: export {request} released twice", engine.id));
                    }
                    match engine.pool.release(&blocks) {
                        Ok(freed) => {
                            for rank in &mut engine.ranks {
                                rank.scrub(&freed);
                            }
                        }
                        Err(block) => self.violation(format!("{}: block {block} freed twice", engine.id)),
                    }
                }
            }
        }
    }

    fn step_decode(&mut self, id: &EngineId, now: Time) {
        let Some(mut engine) = self.decode.get_mut(id).and_then(Option::take) else { return };
        for rank in 0..engine.workers.len() {
            let reports = engine.workers[rank].step(now);
            for report in reports {
                self.fold_rank_event(&format!("{now} {id}/tp{rank} {report:?}"));
                if let Err(e) = engine.scheduler.handle_report(rank as u32, report) {
                    self.violation(format!("{id}: {e}"));
                }
            }
        }
        self.drain_decode(&mut engine, now);
        self.decode.insert(id.clone(), Some(engine));
    }

    /// The timing invariant of peer loss: an export bound to a D incarnation that a P rank has
    /// heard is gone (its side channel closed, or a newer incarnation handshook) is released
    /// within one scheduler step and one network latency of the moment that P could hear it
    /// (a paused P hears when it resumes; a partition holds the close back).
    fn check_release_timing(&mut self, now: Time) {
        let slack = self.config.step_interval + self.config.network_latency;
        let mut late = Vec::new();
        for engine in self.prefill.values().flatten().filter(|e| !self.paused.contains_key(&e.id)) {
            let resumed = self.resumed.get(&engine.id).copied().unwrap_or(Time::ZERO);
            for (rank, worker) in engine.workers.iter().enumerate() {
                let agent = AgentName::new(engine.id.clone(), rank as u32);
                for (request, owner) in worker.machine_ref().bound() {
                    let Some(heard) = self.net.heard_gone(&agent, &owner.engine, owner.instance) else { continue };
                    if now > heard.max(resumed) + slack {
                        late.push(format!(
                            "{agent} still holds {request}, bound to {owner}, which it heard was gone at {heard}"
                        ));
                    }
                }
            }
        }
        for line in late {
            self.violation(line);
        }
    }

    /// Carries D's scheduler events to its workers and the pool, until nothing is left.
    fn drain_decode(&mut self, engine: &mut DecodeEngine, now: Time) {
        loop {
            let mut progressed = false;
            while let Some(event) = engine.scheduler.poll_event() {
                progressed = true;
                match event {
                    DecodeEvent::ToWorker { rank, command } => engine.commands.push_back((rank, command)),
                    DecodeEvent::Ended { request, state } => {
                        self.record(format!("{} {} {request}", engine.id, state.as_str()));
                        engine.ended.insert(request.clone(), state);
                        if state == DecodeState::Ready {
                            self.verify(engine, &request);
                            if let Some(load) = engine.loads.remove(&request) {
                                // The engine decodes and is done with the blocks.
                                self.free_decode_blocks(engine, &load.blocks);
                            }
                        } else if engine.loads.get(&request).is_some_and(|l| l.blocks.is_empty()) {
                            // Ended before it had blocks: nothing comes back.
                            engine.loads.remove(&request);
                        }
                    }
                    DecodeEvent::Free { request, blocks } => {
                        let list: Vec<String> = blocks.iter().map(|b| b.to_string()).collect();
                        self.record(format!("{} freed {request} blocks {}", engine.id, list.join(",")));
                        engine.loads.remove(&request);
                        self.free_decode_blocks(engine, &blocks);
                    }
                }
            }
            while let Some((rank, command)) = engine.commands.pop_front() {
                progressed = true;
                let worker = &mut engine.workers[rank as usize];
                worker.machine().handle_command(now, command);
                for report in worker.flush(now) {
                    if let Err(e) = engine.scheduler.handle_report(rank, report) {
                        self.violation(format!("{}: {e}", engine.id));
                    }
                }
            }
            if !progressed {
                break;
            }
        }
    }

    fn free_decode_blocks(&mut self, engine: &mut DecodeEngine, blocks: &[BlockId]) {
        match engine.pool.release(blocks) {
            Ok(freed) => {
                for rank in &mut engine.ranks {
                    rank.scrub(&freed);
                }
            }
            Err(block) => self.violation(format!("{}: block {block} freed twice", engine.id)),
        }
    }

    /// Compares a ready request's blocks on every D rank with what P computed.
    fn verify(&mut self, engine: &DecodeEngine, request: &RequestId) {
        let Some(load) = engine.loads.get(request) else { return };
        if load.prefix_hit {
            return;
        }
        let key = (load.remote.engine.clone(), load.remote.request.clone());
        // Push mode matches by base id when the engines' suffixes differ; so does the oracle.
        let by_base = || {
            let base = key.1.base();
            let mut matches = self.computed.iter().filter(|((e, r), _)| *e == key.0 && r.base() == base);
            match (matches.next(), matches.next()) {
                (Some((_, c)), None) => Some(*c),
                _ => None,
            }
        };
        let Some(computed) = self.computed.get(&key).copied().or_else(by_base) else {
            self.violation(format!("{}: {request} is ready, but its P never computed {}", engine.id, key.1));
            return;
        };
        let d_tokens = u64::from(self.config.decode_block_tokens);
        let mut corrupt = false;
        for rank in &engine.ranks {
            let first = first_head(&rank.shape.layout, rank.rank, self.config.decode_tp);
            for (i, &block) in load.blocks.iter().enumerate() {
                let expected = block_bytes(&rank.shape, first, computed.seed, i as u64 * d_tokens, computed.tokens);
                let mut got = vec![0; expected.len()];
                if rank.memory.read(rank.region.id, rank.block_offset(block), &mut got).is_err() {
                    corrupt = true;
                    continue;
                }
                if expected.iter().zip(&got).any(|(e, g)| e.is_some_and(|e| e != *g)) {
                    corrupt = true;
                }
            }
        }
        if corrupt {
            self.corrupt_reads += 1;
            self.record(format!("{} CORRUPT {request}", engine.id));
        } else {
            self.loads_verified += 1;
        }
    }

    // ---- events ----

    fn prefill_engine(&mut self, node: &str) -> Result<&mut PrefillEngine, ClusterError> {
        match self.prefill.get_mut(&EngineId::new(node)) {
            Some(Some(engine)) => Ok(engine),
            Some(None) => err(format!("{node} is down")),
            None => err(format!("no prefill engine {node}")),
        }
    }

    fn decode_engine(&mut self, node: &str) -> Result<&mut DecodeEngine, ClusterError> {
        match self.decode.get_mut(&EngineId::new(node)) {
            Some(Some(engine)) => Ok(engine),
            Some(None) => err(format!("{node} is down")),
            None => err(format!("no decode engine {node}")),
        }
    }

    /// P runs a prompt and exports it; with `n > 1`, the siblings `0_r` .. `{n-1}_r` share its
    /// blocks. With a `consumer`, the router has already chosen that D engine (its incarnation
    /// now), and P binds the exports to it.
    pub fn prefill(
        &mut self,
        node: &str,
        request: &RequestId,
        prompt_tokens: u64,
        n: u32,
        consumer: Option<&str>,
    ) -> Result<(), ClusterError> {
        let now = self.now();
        self.check_running(node)?;
        let consumer = match consumer {
            Some(d) if self.decode.contains_key(&EngineId::new(d)) => {
                Some(Consumer { engine: EngineId::new(d), instance: self.instance(&EngineId::new(d)) })
            }
            Some(d) => return err(format!("no decode engine {d} to name as the consumer")),
            None => None,
        };
        let p_tokens = self.config.prefill_block_tokens;
        let count = kv_core::blocks_for_tokens(prompt_tokens, p_tokens) as usize;
        if count == 0 {
            return err(format!("prefill of {request}: a prompt needs at least one token"));
        }
        self.prefills += 1;
        let generation = self.history.get(&EngineId::new(node)).map_or(0, |h| h.generation);
        let seed = fnv(&[
            node.as_bytes(),
            request.as_str().as_bytes(),
            &generation.to_le_bytes(),
            &self.prefills.to_le_bytes(),
        ]);
        let ids: Vec<RequestId> = if n > 1 {
            (0..n).map(|i| RequestId::new(format!("{i}_{request}"))).collect()
        } else {
            vec![request.clone()]
        };
        let tp = self.config.prefill_tp;
        let engine = self.prefill_engine(node)?;
        if let Some(id) = ids.iter().find(|id| engine.export_blocks.contains_key(*id)) {
            return err(format!("{node} already exports {id}"));
        }
        let Some(blocks) = engine.pool.allocate(count) else {
            return err(format!("{node} has no {count} free blocks for {request}"));
        };
        let mut dirty = BTreeSet::new();
        for rank in &mut engine.ranks {
            let first = first_head(&rank.shape.layout, rank.rank, tp);
            for (i, &block) in blocks.iter().enumerate() {
                if !rank.scrubbed(block) {
                    dirty.insert(block);
                }
                let bytes: Vec<u8> = block_bytes(&rank.shape, first, seed, i as u64 * u64::from(p_tokens), u64::MAX)
                    .into_iter()
                    .map(|b| b.unwrap_or(0))
                    .collect();
                let _ = rank.memory.write(rank.region.id, rank.block_offset(block), &bytes);
            }
        }
        // allocate() took one reference; each further sibling export holds its own.
        for _ in 1..ids.len() {
            engine.pool.retain(&blocks);
        }
        let mut refs = Vec::new();
        for id in &ids {
            let remote = engine
                .scheduler
                .handle_finished(now, id.clone(), blocks.clone(), prompt_tokens, consumer.clone())
                .map_err(|e| ClusterError(e.to_string()))?;
            engine.export_blocks.insert(id.clone(), blocks.clone());
            refs.push((id.clone(), remote));
        }
        let engine_id = engine.id.clone();
        let mut engine = self.prefill.get_mut(&engine_id).and_then(Option::take).expect("up");
        self.drain_prefill(&mut engine, now);
        self.prefill.insert(engine_id.clone(), Some(engine));
        self.count_written_after_free(node, &dirty);
        let tokens = count as u64 * u64::from(p_tokens);
        for (id, remote) in refs {
            self.record(format!("{node} exported {id}"));
            self.computed.insert((engine_id.clone(), id.clone()), Computed { seed, tokens });
            self.exports.insert((engine_id.clone(), id), remote);
        }
        Ok(())
    }

    /// Blocks found written while free, when they are allocated again.
    fn count_written_after_free(&mut self, node: &str, dirty: &BTreeSet<BlockId>) {
        for block in dirty {
            self.record(format!("{node}: freed block {block} was WRITTEN AFTER FREE"));
        }
        self.written_after_free += dirty.len() as u64;
    }

    /// Whether `node` is up and not paused.
    fn check_running(&self, node: &str) -> Result<(), ClusterError> {
        match self.paused.get(&EngineId::new(node)) {
            Some((until, _)) => err(format!("{node} is paused until {until}")),
            None => Ok(()),
        }
    }

    /// Defers a router call to a paused D engine until it resumes; `None` when it is running.
    fn defer(&mut self, node: &str, call: impl FnOnce() -> Deferred) -> Option<()> {
        let (_, calls) = self.paused.get_mut(&EngineId::new(node))?;
        calls.push(call());
        self.record(format!("{node} is paused; the router's call waits"));
        Some(())
    }

    fn remote_for(
        &self,
        from: &str,
        remote_request: &RequestId,
        prompt_tokens: Option<u64>,
    ) -> Result<RemoteRef, ClusterError> {
        let engine = EngineId::new(from);
        if let Some(remote) = self.exports.get(&(engine.clone(), remote_request.clone())) {
            return Ok(remote.clone());
        }
        if self.config.mode == Mode::Pull {
            return err(format!("{from} has not run {remote_request}: pull mode needs P's blocks"));
        }
        let Some(prompt_tokens) = prompt_tokens else {
            return err(format!("{remote_request} arrives before {from} ran it: prompt_tokens is required"));
        };
        if !self.prefill.contains_key(&engine) {
            return err(format!("no prefill engine {from}"));
        }
        Ok(RemoteRef {
            engine: engine.clone(),
            request: remote_request.clone(),
            addresses: (0..self.config.prefill_tp).map(|r| Self::address(&engine, r)).collect(),
            tp_size: self.config.prefill_tp,
            // D comes first in push mode: it cannot know P's incarnation yet.
            instance: 0,
            prompt_tokens,
            export: None,
            consumer: None,
        })
    }

    /// A request carrying P's parameters enters D's waiting queue.
    pub fn arrive(
        &mut self,
        node: &str,
        request: &RequestId,
        from: &str,
        remote_request: &RequestId,
        prompt_tokens: Option<u64>,
    ) -> Result<(), ClusterError> {
        let remote = self.remote_for(from, remote_request, prompt_tokens)?;
        self.decode_engine(node)?;
        if self.defer(node, || Deferred::Arrive { request: request.clone(), remote: remote.clone() }).is_some() {
            return Ok(());
        }
        self.arrive_now(node, request, remote)
    }

    fn arrive_now(&mut self, node: &str, request: &RequestId, remote: RemoteRef) -> Result<(), ClusterError> {
        let engine = self.decode_engine(node)?;
        engine.scheduler.handle_arrive(request.clone(), remote.clone()).map_err(|e| ClusterError(e.to_string()))?;
        engine.loads.insert(request.clone(), DecodeLoad { remote, blocks: Vec::new(), prefix_hit: false });
        self.record(format!("{node} arrived {request}"));
        self.flush_decode(node)
    }

    /// D allocates blocks for a waiting request and starts its load.
    pub fn schedule(&mut self, node: &str, request: &RequestId, prefix_hit: bool) -> Result<(), ClusterError> {
        self.decode_engine(node)?;
        if self.defer(node, || Deferred::Schedule { request: request.clone(), prefix_hit }).is_some() {
            return Ok(());
        }
        self.schedule_now(node, request, prefix_hit)
    }

    fn schedule_now(&mut self, node: &str, request: &RequestId, prefix_hit: bool) -> Result<(), ClusterError> {
        let d_tokens = self.config.decode_block_tokens;
        let engine = self.decode_engine(node)?;
        let Some(load) = engine.loads.get(request) else {
            return err(format!("{request} is not waiting on {node}"));
        };
        let count = kv_core::blocks_for_tokens(load.remote.prompt_tokens, d_tokens) as usize;
        let Some(blocks) = engine.pool.allocate(count.max(1)) else {
            return err(format!("{node} has no {count} free blocks for {request}"));
        };
        let dirty: BTreeSet<BlockId> =
            blocks.iter().copied().filter(|&b| engine.ranks.iter().any(|r| !r.scrubbed(b))).collect();
        if let Err(e) = engine.scheduler.handle_schedule(request.clone(), blocks.clone(), prefix_hit) {
            let _ = engine.pool.release(&blocks);
            return Err(ClusterError(e.to_string()));
        }
        let load = engine.loads.get_mut(request).expect("present");
        load.blocks = blocks;
        load.prefix_hit = prefix_hit;
        self.count_written_after_free(node, &dirty);
        self.record(format!("{node} scheduled {request}"));
        self.flush_decode(node)
    }

    /// D rejects a request carrying P's parameters before admission.
    pub fn reject(
        &mut self,
        node: &str,
        request: &RequestId,
        from: &str,
        remote_request: &RequestId,
    ) -> Result<(), ClusterError> {
        let remote = self.remote_for(from, remote_request, None)?;
        self.decode_engine(node)?;
        if self.defer(node, || Deferred::Reject { request: request.clone(), remote: remote.clone() }).is_some() {
            return Ok(());
        }
        self.reject_now(node, request, remote)
    }

    fn reject_now(&mut self, node: &str, request: &RequestId, remote: RemoteRef) -> Result<(), ClusterError> {
        let engine = self.decode_engine(node)?;
        engine.scheduler.handle_reject(request.clone(), remote).map_err(|e| ClusterError(e.to_string()))?;
        self.record(format!("{node} rejected {request}"));
        self.flush_decode(node)
    }

    /// The router aborts a request on an engine.
    pub fn abort(&mut self, node: &str, request: &RequestId) -> Result<(), ClusterError> {
        let id = EngineId::new(node);
        if self.prefill.contains_key(&id) {
            // After P finished, an abort on P changes nothing: the export ends by its own rules.
            self.record(format!("{node} abort {request} (no effect on an export)"));
            return Ok(());
        }
        self.decode_engine(node)?;
        if self.defer(node, || Deferred::Abort { request: request.clone() }).is_some() {
            return Ok(());
        }
        self.abort_now(node, request)
    }

    fn abort_now(&mut self, node: &str, request: &RequestId) -> Result<(), ClusterError> {
        let engine = self.decode_engine(node)?;
        engine.scheduler.handle_abort(request);
        self.record(format!("{node} aborted {request}"));
        self.flush_decode(node)
    }

    /// The engine stops for `for_`, as a process under SIGSTOP would: no step, no message,
    /// timer or completion handled, nothing sent; its side channel stays open. Transfers it
    /// posted complete no earlier than its resume; router calls wait for it.
    pub fn pause(&mut self, node: &str, for_: Duration) -> Result<(), ClusterError> {
        let id = EngineId::new(node);
        let up = matches!(self.prefill.get(&id), Some(Some(_))) || matches!(self.decode.get(&id), Some(Some(_)));
        if !up {
            return err(format!("{node} is not running"));
        }
        let until = self.now() + for_;
        let entry = self.paused.entry(id.clone()).or_insert((until, Vec::new()));
        entry.0 = entry.0.max(until);
        let until = entry.0;
        self.net.pause(Scope::Engine(id), until);
        self.record(format!("{node} paused until {until}"));
        Ok(())
    }

    /// Engines whose pause is over carry on, first with the router calls that waited for them.
    fn resume_engines(&mut self, now: Time) {
        let due: Vec<EngineId> =
            self.paused.iter().filter(|(_, (until, _))| *until <= now).map(|(e, _)| e.clone()).collect();
        for id in due {
            let (until, calls) = self.paused.remove(&id).expect("due");
            self.resumed.insert(id.clone(), until);
            let node = id.as_str();
            self.record(format!("{node} resumed"));
            for call in calls {
                let result = match call {
                    Deferred::Arrive { request, remote } => self.arrive_now(node, &request, remote),
                    Deferred::Schedule { request, prefix_hit } => self.schedule_now(node, &request, prefix_hit),
                    Deferred::Reject { request, remote } => self.reject_now(node, &request, remote),
                    Deferred::Abort { request } => self.abort_now(node, &request),
                };
                if let Err(e) = result {
                    self.record(format!("{node}: a call that waited for the resume did not apply: {e}"));
                }
            }
        }
    }

    /// `from`, a handshaked D engine, sends `to` a well-formed message about `to`'s export
    /// `request` as if it were that export's consumer (rank 0 to rank 0).
    pub fn forge(
        &mut self,
        from: &str,
        to: &str,
        message: ForgedMessage,
        request: &RequestId,
        consumers: u32,
    ) -> Result<(), ClusterError> {
        let to_agent = AgentName::new(EngineId::new(to), 0);
        let message = match message {
            ForgedMessage::Completion => {
                Message::Completion { request: request.clone(), expected_consumers: consumers }
            }
            ForgedMessage::Abort => Message::Abort { request: request.clone() },
            ForgedMessage::Heartbeat => Message::Heartbeat { requests: vec![request.clone()] },
            ForgedMessage::Reject => Message::Rejection { request: request.clone() },
        };
        let payload = message.encode().map_err(|e| ClusterError(e.to_string()))?;
        let engine = self.decode_engine(from)?;
        let transport = engine.workers[0].transport();
        transport
            .send_notification(&to_agent, &payload)
            .map_err(|e| ClusterError(format!("{from} cannot speak to {to_agent}: {e}")))?;
        self.record(format!("{from} forged {message:?} to {to_agent}"));
        Ok(())
    }

    fn flush_decode(&mut self, node: &str) -> Result<(), ClusterError> {
        let id = EngineId::new(node);
        let now = self.now();
        let mut engine = self.decode.get_mut(&id).and_then(Option::take).expect("checked up");
        self.drain_decode(&mut engine, now);
        self.decode.insert(id, Some(engine));
        Ok(())
    }

    /// An engine stops; with `detect`, its peers see its side channel close.
    pub fn crash(&mut self, node: &str, detect: bool) -> Result<(), ClusterError> {
        let id = EngineId::new(node);
        // A paused process can be killed; what waited for it is lost with it.
        self.paused.remove(&id);
        self.net.crash(Scope::Engine(id.clone()), detect);
        let retired = match (self.prefill.get_mut(&id), self.decode.get_mut(&id)) {
            (Some(slot), _) => slot.take().map(|e| {
                let mut c = Counters::default();
                for w in &e.workers {
                    c.add(&w.machine_ref().counters());
                }
                c
            }),
            (_, Some(slot)) => slot.take().map(|e| {
                let mut c = Counters::default();
                for w in &e.workers {
                    c.add(&w.machine_ref().counters());
                }
                c
            }),
            _ => return err(format!("no engine {node}")),
        };
        let Some(retired) = retired else { return err(format!("{node} is already down")) };
        self.history.entry(id).or_default().retired.add(&retired);
        self.record(format!("{node} crashed detect={detect}"));
        Ok(())
    }

    /// A crashed engine comes back empty.
    pub fn restart(&mut self, node: &str) -> Result<(), ClusterError> {
        let id = EngineId::new(node);
        if self.prefill.get(&id).is_some_and(Option::is_none) {
            let engine = self.start_prefill(&id)?;
            // The router keeps P's old transfer parameters, as a real one would: D must notice
            // that the incarnation that exported them is gone.
            self.prefill.insert(id.clone(), Some(engine));
        } else if self.decode.get(&id).is_some_and(Option::is_none) {
            let engine = self.start_decode(&id)?;
            self.decode.insert(id.clone(), Some(engine));
        } else {
            return err(format!("{node} is not down"));
        }
        self.record(format!("{node} restarted"));
        Ok(())
    }

    /// A peer without the cluster key opens `to`'s side channel (its rank 0) claiming to be
    /// engine `claimed` (as a newer incarnation, rank 0), tries the handshake, and hangs up.
    pub fn intrude(&mut self, to: &str, claimed: &str) -> Result<(), ClusterError> {
        let to_id = EngineId::new(to);
        if !self.prefill.contains_key(&to_id) && !self.decode.contains_key(&to_id) {
            return err(format!("no engine {to}"));
        }
        let claimed_id = EngineId::new(claimed);
        let (role, tp, block_tokens) = if self.prefill.contains_key(&claimed_id) {
            (Role::Prefill, self.config.prefill_tp, self.config.prefill_block_tokens)
        } else {
            (Role::Decode, self.config.decode_tp, self.config.decode_block_tokens)
        };
        let mut claim =
            crate::offer(&AgentName::new(claimed_id.clone(), 0), role, tp, self.config.layout(block_tokens));
        claim.instance = self.instance(&claimed_id) + 1;
        self.net.intrude(&Self::address(&to_id, 0), claim).map_err(|e| ClusterError(e.to_string()))?;
        self.record(format!("an intruder without the key claims {claimed} at {to}"));
        Ok(())
    }

    /// Every message between `a` and `b` is dropped until `until`.
    pub fn partition(&mut self, a: &str, b: &str, until: Time) {
        self.net.partition(Scope::Engine(EngineId::new(a)), Scope::Engine(EngineId::new(b)), until);
        self.record(format!("partition {a} {b} until {until}"));
    }

    /// Every message from `a` to `b` sent before `until` arrives `by` later.
    pub fn delay(&mut self, a: &str, b: &str, by: Duration, until: Time) {
        self.net.delay(Scope::Engine(EngineId::new(a)), Scope::Engine(EngineId::new(b)), by, until);
        self.record(format!("delay {a} {b} by {by:?} until {until}"));
    }

    /// The next read or write `node` posts for `request` (D's id or P's, or either's base) fails.
    pub fn fail_transfer(&mut self, node: &str, request: &RequestId) {
        self.record(format!("fail next transfer of {node} for {request}"));
        let engine = EngineId::new(node);
        // A read's completion names P's id; D's request may name it differently.
        let mut names = vec![request.clone()];
        if let Some(Some(d)) = self.decode.get(&engine) {
            if let Some(load) = d.loads.get(request) {
                names.push(load.remote.request.clone());
            }
        }
        self.net.fail_transfer_when(move |poster, transfer| {
            if poster.engine != engine {
                return false;
            }
            let named = transfer.notification.as_deref().and_then(|n| Message::decode(n).ok());
            let matches = match named {
                Some(Message::Completion { request: r, .. }) => names.iter().any(|n| r == *n || r.base() == n.base()),
                _ => false,
            };
            matches && matches!(transfer.op, TransferOp::Read | TransferOp::Write)
        });
    }

    /// `from` sends `to` a notification with this payload.
    pub fn garbage(&mut self, from: &str, to: &str, bytes: &[u8]) {
        let from = AgentName::new(EngineId::new(from), 0);
        let to = AgentName::new(EngineId::new(to), 0);
        self.net.inject(&from, &to, bytes.to_vec());
        self.record(format!("garbage {from} -> {to}"));
    }

    // ---- observations ----

    /// Logical blocks an engine holds for export (P) or for loads (D); 0 when down.
    pub fn held_blocks(&self, node: &str) -> u64 {
        let id = EngineId::new(node);
        if let Some(engine) = self.prefill.get(&id) {
            return engine.as_ref().map_or(0, |e| e.pool.held() as u64);
        }
        if let Some(Some(engine)) = self.decode.get(&id) {
            let held: BTreeSet<BlockId> = engine.scheduler.held_blocks().collect();
            return held.len() as u64;
        }
        0
    }

    /// Exports a P engine has not freed.
    pub fn pending_exports(&self, node: &str) -> u64 {
        match self.prefill.get(&EngineId::new(node)) {
            Some(Some(e)) => e.scheduler.pending() as u64,
            _ => 0,
        }
    }

    /// Why a P engine released an export, if it did.
    pub fn release_reason(&self, node: &str, request: &RequestId) -> Option<ReleaseReason> {
        self.history.get(&EngineId::new(node)).and_then(|h| h.released.get(request).copied())
    }

    /// Why any P engine released an export of this id, prefill engines in name order.
    pub fn release_reason_anywhere(&self, request: &RequestId) -> Option<ReleaseReason> {
        self.prefill.keys().find_map(|e| self.release_reason(e.as_str(), request))
    }

    /// Where a request stands on a D engine.
    pub fn decode_state(&self, node: &str, request: &RequestId) -> Option<DecodeState> {
        match self.decode.get(&EngineId::new(node)) {
            Some(Some(e)) => e.scheduler.state(request).or_else(|| e.ended.get(request).copied()),
            _ => None,
        }
    }

    /// Every engine's counters, crashed incarnations included.
    pub fn counters(&self) -> Counters {
        let mut total = Counters::default();
        for h in self.history.values() {
            total.add(&h.retired);
        }
        for e in self.prefill.values().flatten() {
            for w in &e.workers {
                total.add(&w.machine_ref().counters());
            }
        }
        for e in self.decode.values().flatten() {
            for w in &e.workers {
                total.add(&w.machine_ref().counters());
            }
        }
        total
    }

    /// One P engine's counters, crashed incarnations included.
    pub fn engine_counters(&self, node: &str) -> Counters {
        let id = EngineId::new(node);
        let mut total = self.history.get(&id).map(|h| h.retired).unwrap_or_default();
        if let Some(Some(e)) = self.prefill.get(&id) {
            for w in &e.workers {
                total.add(&w.machine_ref().counters());
            }
        }
        if let Some(Some(e)) = self.decode.get(&id) {
            for w in &e.workers {
                total.add(&w.machine_ref().counters());
            }
        }
        total
    }

    /// Loads whose bytes did not match what P computed.
    pub fn corrupt_reads(&self) -> u64 {
        self.corrupt_reads
    }

    /// Writes that landed in blocks their engine had already given back to its pool: those
    /// found when the block was allocated again, and those in blocks free now.
    pub fn written_after_free(&self) -> u64 {
        let free_dirty = |pool: &BlockPool, ranks: &[RankMemory]| {
            pool.free_blocks().filter(|&b| ranks.iter().any(|r| !r.scrubbed(b))).count() as u64
        };
        let p: u64 = self.prefill.values().flatten().map(|e| free_dirty(&e.pool, &e.ranks)).sum();
        let d: u64 = self.decode.values().flatten().map(|e| free_dirty(&e.pool, &e.ranks)).sum();
        self.written_after_free + p + d
    }

    /// Writes found in blocks at their next allocation after a free (cheap: no scan).
    pub fn written_after_free_found(&self) -> u64 {
        self.written_after_free
    }

    /// Loads whose bytes matched what P computed.
    pub fn loads_verified(&self) -> u64 {
        self.loads_verified
    }

    /// Invariant violations seen so far (blocks freed twice, writes into freed blocks, ...).
    pub fn violations(&self) -> &[String] {
        &self.violations
    }

    /// Whether anything is still pending on an engine that is up.
    pub fn busy(&self) -> bool {
        self.prefill.values().flatten().any(|e| e.scheduler.pending() > 0 || e.pool.held() > 0)
            || self.decode.values().flatten().any(|e| e.scheduler.pending() > 0 || e.pool.held() > 0)
    }

    /// Blocks held on engines that are up, by engine, for the drain check.
    pub fn held_everywhere(&self) -> Vec<(String, u64)> {
        let names: Vec<String> = self.prefill.keys().chain(self.decode.keys()).map(|e| e.as_str().to_owned()).collect();
        names.into_iter().map(|n| (n.clone(), self.held_blocks(&n))).filter(|(_, h)| *h > 0).collect()
    }

    /// The state of every D worker, for debugging a failed run.
    pub fn describe_decode_workers(&self) -> String {
        let mut out = String::new();
        for e in self.decode.values().flatten() {
            for w in &e.workers {
                out.push_str(&format!("{:#?}\n", w.machine_ref()));
            }
        }
        out
    }

    /// Runs time forward until nothing is pending or `limit` more has passed; returns when it stopped.
    pub fn drain(&mut self, limit: Duration) -> Time {
        let end = self.now() + limit;
        while self.busy() && self.now() < end {
            let next = (self.now() + Duration::from_secs(1)).min(end);
            self.advance_to(next);
        }
        self.now()
    }

    /// Folds one rank-level event into [`Cluster::digest`].
    fn fold_rank_event(&mut self, line: &str) {
        self.rank_digest = fnv_fold(self.rank_digest, line.bytes().chain([b'\n']));
    }

    /// A digest of everything that happened, for replay checks: the trace, and every TP
    /// rank's reports to its scheduler.
    pub fn digest(&self) -> u64 {
        let trace = self.trace.iter().fold(FNV_OFFSET, |h, line| fnv_fold(h, line.bytes().chain([b'\n'])));
        fnv_fold(trace, self.rank_digest.to_le_bytes())
    }

    /// The event trace, one line per event.
    pub fn trace(&self) -> &[String] {
        &self.trace
    }
}

/// FNV-1a's offset basis and prime (64-bit).
const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0100_0000_01b3;

/// Folds `bytes` into the FNV-1a hash `h`.
fn fnv_fold(h: u64, bytes: impl IntoIterator<Item = u8>) -> u64 {
    bytes.into_iter().fold(h, |h, b| (h ^ u64::from(b)).wrapping_mul(FNV_PRIME))
}

fn fnv(parts: &[&[u8]]) -> u64 {
    parts.iter().fold(FNV_OFFSET, |h, part| fnv_fold(fnv_fold(h, part.iter().copied()), [0xff]))
}
