//! A simulated cluster of P and D engines over the fake network, driving kvflow's real
//! connectors (kv-sched-adapter) as an engine would.
//!
//! Each engine has a KV pool per TP rank in [`InMemoryMemory`], a block allocator that hands
//! out the lowest free ids first (so freed blocks are soon reused), its scheduler-side
//! connector and one [`WorkerDriver`] per rank over a [`FakeTransport`](crate::FakeTransport).
//! Engines step at every multiple of the step interval; the cluster skips the steps where
//! nothing is due, which a sans-IO machine cannot tell from a step (a spurious wake-up is a
//! no-op).
//!
//! The cluster is also the oracle. P fills every block it computes with bytes derived from
//! (engine, request, generation, position); D's loaded blocks are compared with them, byte
//! for byte. Freed blocks are scrubbed at once, so a transfer that reads a block after its
//! free delivers scrub bytes and counts as a corrupt read; an allocation checks the scrub is
//! intact, so a write into a freed block is caught too.
//!
//! Each engine runs on its own clock, true time plus its skew (`clocks.rs`): every time the
//! cluster hands an engine's connectors, and every wake-up they ask for, is on that clock.
//!
//! This file wires the engines and steps them through time; `router.rs` holds the router's
//! calls (prefill, arrive, schedule, reject, abort), `oracle.rs` the bytes and their checks,
//! `faults.rs` what goes wrong (pauses, crashes, discovery lapses, partitions, forgeries),
//! `clocks.rs` the engines' clocks, and `observe.rs` what a scenario or a test reads back.

mod clocks;
mod faults;
mod observe;
mod oracle;
mod router;

use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::time::Duration;

use kv_core::{
    AgentName, Attention, BlockId, EngineId, Fnv1a, Handshake, KvLayout, Memory, MemoryKind, MemoryOrder, PeerAddress,
    Placement, PoolShape, RegionBase, RequestId, Role, Time,
};
use kv_sched_adapter::driver::{WorkerDriver, WorkerMachine};
use kv_sched_adapter::{
    Config, ConfigError, Counters, DecodeEvent, DecodeScheduler, DecodeState, DecodeWorker, LocalPool, PrefillCommand,
    PrefillEvent, PrefillScheduler, PrefillWorker, ReleaseReason, RemoteRef,
};

use crate::scenario::ClusterSpec;
use crate::{BlockPool, FakeHeap, FakeNetwork, InMemoryMemory, ManualClock, NetConfig, FAKE_MODEL};

use clocks::Clocks;
pub use faults::ForgedMessage;
use oracle::{Computed, RankMemory};
use router::Call;

/// The cluster's shape and the connectors' settings.
#[derive(Clone, Debug)]
pub struct ClusterConfig {
    /// The engines and the simulated timing, as a scenario's `[cluster]` table gives them;
    /// its `mode` wins over the one in `connector`.
    pub spec: ClusterSpec,
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
            spec: ClusterSpec::default(),
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
        let mla = self.spec.mla;
        KvLayout {
            layers: 2,
            block_tokens,
            kv_heads: if mla { 1 } else { self.spec.num_kv_heads },
            head_dim: 4,
            dtype: kv_core::Dtype::Fp8E4m3,
            attention: if mla { Attention::Mla } else { Attention::SplitKv },
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

struct PrefillEngine {
    id: EngineId,
    scheduler: PrefillScheduler,
    workers: Vec<WorkerDriver<PrefillWorker>>,
    ranks: Vec<RankMemory>,
    pool: BlockPool,
    handoff: VecDeque<(Time, u32, PrefillCommand)>,
    export_blocks: BTreeMap<RequestId, Vec<BlockId>>,
    /// Prompts of a chunked prefill, computing.
    computing: BTreeMap<RequestId, Prompt>,
}

/// A prompt P computed into its blocks, not yet exported.
struct Prompt {
    /// The exports it becomes: the request, or its parallel-sampling siblings.
    ids: Vec<RequestId>,
    blocks: Vec<BlockId>,
    prompt_tokens: u64,
    consumer: Option<kv_sched_adapter::Consumer>,
    /// Of its blocks, the first ones reported computed: the connector's until it frees them.
    reported: usize,
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
    /// Of every request that ended here: the D blocks it loaded from P, and the tokens of
    /// valid KV it kept.
    loaded: BTreeMap<RequestId, (u64, u64)>,
}

#[derive(Clone, Debug)]
struct DecodeLoad {
    remote: RemoteRef,
    blocks: Vec<BlockId>,
    /// The first `cached` of `blocks` the engine's own prefix cache held.
    cached: usize,
    /// Its cached blocks wait for the bytes P computes: D scheduled it (push) before P's
    /// prefill began, and its prefix cache holds what P will compute.
    cache_pending: bool,
}

impl DecodeLoad {
    /// The whole prompt was in D's prefix cache: nothing was read.
    fn prefix_hit(&self) -> bool {
        self.cached >= self.blocks.len()
    }
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
    /// True time.
    clock: ManualClock,
    /// Each engine's own clock, from true time.
    clocks: Clocks,
    net: FakeNetwork,
    prefill: BTreeMap<EngineId, Option<PrefillEngine>>,
    decode: BTreeMap<EngineId, Option<DecodeEngine>>,
    history: BTreeMap<EngineId, History>,
    /// The router's view: P's parameters for each of its export ids.
    exports: BTreeMap<(EngineId, RequestId), RemoteRef>,
    /// The oracle: what P computed for each export id.
    computed: BTreeMap<(EngineId, RequestId), Computed>,
    /// The router's pairings: the P request each transfer id names, on its engine.
    transfers: BTreeMap<(EngineId, RequestId), RequestId>,
    corrupt_reads: u64,
    /// Blocks found written while their engine had them free (at their next allocation).
    written_after_free: u64,
    loads_verified: u64,
    /// Engines paused until a time, and the router calls they will handle when they resume.
    paused: BTreeMap<EngineId, (Time, Vec<Call>)>,
    /// When each engine last resumed from a pause: it could not hear of anything before.
    resumed: BTreeMap<EngineId, Time>,
    violations: Vec<String>,
    trace: Vec<String>,
    /// A running hash of every TP rank's reports to its scheduler: not printed in the trace,
    /// but part of the digest, so that runs differing only in rank-level events (another TP
    /// size, say) differ in digest.
    rank_digest: u64,
    /// Part-way read failures asked for, by D engine and request, waiting for D's blocks.
    spoils: BTreeMap<(EngineId, RequestId), u32>,
    last_step: Option<Time>,
    dirty_since: Option<Time>,
    prefills: u64,
}

impl Cluster {
    /// A cluster at time zero with every engine up and empty.
    pub fn new(config: ClusterConfig) -> Result<Self, ClusterError> {
        let clocks = Clocks::new(&config.spec)?;
        let mut connector = config.connector;
        connector.mode = config.spec.mode;
        connector.validate().map_err(|e| ClusterError(e.to_string()))?;
        if config.spec.step_interval.is_zero() {
            return err("step interval must be positive");
        }
        let clock = ManualClock::default();
        let net_config = NetConfig {
            latency: config.spec.network_latency,
            transfer_latency: config.spec.transfer_latency,
            drop_rate: config.drop_rate,
            duplicate_rate: config.duplicate_rate,
            reorder_jitter: config.reorder_jitter,
        };
        let net = FakeNetwork::new(config.seed, clock.clone(), net_config);
        for (engine, offset) in clocks.offsets() {
            net.set_clock_offset(engine.clone(), offset);
        }
        let mut cluster = Cluster {
            config: ClusterConfig { connector, ..config },
            clock,
            clocks,
            net,
            prefill: BTreeMap::new(),
            decode: BTreeMap::new(),
            history: BTreeMap::new(),
            exports: BTreeMap::new(),
            computed: BTreeMap::new(),
            transfers: BTreeMap::new(),
            corrupt_reads: 0,
            written_after_free: 0,
            loads_verified: 0,
            paused: BTreeMap::new(),
            resumed: BTreeMap::new(),
            violations: Vec::new(),
            trace: Vec::new(),
            rank_digest: Fnv1a::OFFSET,
            spoils: BTreeMap::new(),
            last_step: None,
            dirty_since: None,
            prefills: 0,
        };
        let skews: Vec<String> = (cluster.config.spec.clock_skew.iter())
            .filter(|(_, skew)| **skew != 0)
            .map(|(node, skew)| format!("{node} clock is {} true time", clocks::describe_skew(*skew)))
            .collect();
        for line in skews {
            cluster.record(line);
        }
        for i in 0..cluster.config.spec.prefillers {
            let id = EngineId::new(format!("prefill{i}"));
            let engine = cluster.start_prefill(&id)?;
            cluster.prefill.insert(id, Some(engine));
        }
        for i in 0..cluster.config.spec.decoders {
            let id = EngineId::new(format!("decode{i}"));
            let engine = cluster.start_decode(&id)?;
            cluster.decode.insert(id, Some(engine));
        }
        Ok(cluster)
    }

    /// The simulated time: true time, which scenario steps are timed by.
    pub fn now(&self) -> Time {
        self.clock.now()
    }

    /// What engine `node`'s clock reads now: true time plus its skew (and the lead that keeps
    /// every clock at or above its origin; see `clocks.rs`).
    pub fn engine_now(&self, node: &str) -> Time {
        self.clocks.local(&EngineId::new(node), self.now())
    }

    /// What engine `id`'s clock reads at true time `t`.
    fn local(&self, id: &EngineId, t: Time) -> Time {
        self.clocks.local(id, t)
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

    /// Brings up a new incarnation of an engine's TP ranks: each rank's pool, scrubbed, its
    /// transport with the pool registered, and the worker `worker` makes from its offer.
    fn start_ranks<M: WorkerMachine>(
        &mut self,
        engine: &EngineId,
        role: Role,
        worker: impl Fn(Handshake, LocalPool) -> Result<M, ConfigError>,
    ) -> Result<(Vec<RankMemory>, Vec<WorkerDriver<M>>), ClusterError> {
        let spec = &self.config.spec;
        let (tp, num_blocks) = (spec.tp_size(role), spec.num_blocks(role));
        let stages = spec.workers(role) / tp;
        let layout = self.config.layout(spec.block_size(role));
        let heads = layout.heads_per_rank(tp);
        let model = PoolShape::new(layout, heads, num_blocks).map_err(|e| ClusterError(e.to_string()))?;
        let base = self.heap_base(engine);
        let instance = self.instance(engine);
        let (mut ranks, mut workers) = (Vec::new(), Vec::new());
        // Worker `rank` is TP rank `rank % tp` of pipeline stage `rank / tp`.
        for rank in 0..tp * stages {
            let shape = model.for_stage(rank / tp, stages).map_err(|e| ClusterError(format!("{engine}: {e}")))?;
            let heap = FakeHeap::with_base(base + u64::from(rank) * 0x100_0000 * 16);
            let mut memory = InMemoryMemory::new(heap.clone());
            let region = memory
                .allocate(MemoryKind::Host, shape.pool_bytes())
                .map_err(|e| ClusterError(format!("{engine}: {e}")))?;
            let agent = AgentName::new(engine.clone(), rank);
            let pool = LocalPool { shape, regions: vec![RegionBase { addr: region.addr, len: region.len }] };
            let hs = pool.offer(&agent, tp, instance, role, FAKE_MODEL);
            let mut transport = self
                .net
                .transport(agent, Self::address(engine, rank), heap, hs.clone())
                .map_err(|e| ClusterError(e.to_string()))?;
            kv_core::Transport::register(&mut transport, &region).map_err(|e| ClusterError(e.to_string()))?;
            let machine = worker(hs, pool).map_err(|e| ClusterError(format!("{engine} rank {rank}: {e}")))?;
            workers.push(WorkerDriver::new(machine, Box::new(transport)));
            ranks.push(RankMemory::new(memory, region, shape, rank % tp));
        }
        Ok((ranks, workers))
    }

    fn start_prefill(&mut self, id: &EngineId) -> Result<PrefillEngine, ClusterError> {
        let connector = self.config.connector;
        let (ranks, workers) =
            self.start_ranks(id, Role::Prefill, |hs, pool| PrefillWorker::new(hs, connector, pool))?;
        let spec = &self.config.spec;
        let addresses = (0..spec.workers(Role::Prefill)).map(|r| Self::address(id, r)).collect();
        let offer = workers
            .first()
            .map(|w| w.machine_ref().offer().clone())
            .ok_or_else(|| ClusterError(format!("{id}: no ranks")))?;
        Ok(PrefillEngine {
            id: id.clone(),
            scheduler: PrefillScheduler::new(&offer, addresses, connector)
                .and_then(|s| s.with_stages(spec.prefill_pp))
                .map_err(|e| ClusterError(format!("{id}: {e}")))?,
            workers,
            ranks,
            pool: BlockPool::new(spec.prefill_num_blocks),
            handoff: VecDeque::new(),
            export_blocks: BTreeMap::new(),
            computing: BTreeMap::new(),
        })
    }

    fn start_decode(&mut self, id: &EngineId) -> Result<DecodeEngine, ClusterError> {
        let connector = self.config.connector;
        let (ranks, workers) = self.start_ranks(id, Role::Decode, |hs, pool| DecodeWorker::new(hs, connector, pool))?;
        let spec = &self.config.spec;
        Ok(DecodeEngine {
            id: id.clone(),
            scheduler: DecodeScheduler::new(id.clone(), spec.decode_tp, connector)
                .map_err(|e| ClusterError(format!("{id}: {e}")))?,
            workers,
            ranks,
            pool: BlockPool::new(spec.decode_num_blocks),
            loads: BTreeMap::new(),
            commands: VecDeque::new(),
            ended: BTreeMap::new(),
            loaded: BTreeMap::new(),
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
        let interval = self.config.spec.step_interval.as_nanos() as u64;
        let mut step = Time::from_nanos(t.as_nanos().div_ceil(interval) * interval);
        if let Some(last) = self.last_step {
            if step <= last {
                step = last + self.config.spec.step_interval;
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
        let (paused, clocks) = (&self.paused, &self.clocks);
        // A worker asks on its engine's clock; the handoff queue is in true time.
        for engine in self.prefill.values_mut().flatten().filter(|e| !paused.contains_key(&e.id)) {
            take(engine.handoff.iter().map(|(t, _, _)| *t).min());
            for w in &mut engine.workers {
                take(w.poll_timeout().map(|t| clocks.true_time(&engine.id, t)));
            }
        }
        for engine in self.decode.values_mut().flatten().filter(|e| !paused.contains_key(&e.id)) {
            for w in &mut engine.workers {
                take(w.poll_timeout().map(|t| clocks.true_time(&engine.id, t)));
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

    /// Runs time forward until nothing is pending or `limit` more has passed; returns when it stopped.
    pub fn drain(&mut self, limit: Duration) -> Time {
        let end = self.now() + limit;
        while self.busy() && self.now() < end {
            let next = (self.now() + Duration::from_secs(1)).min(end);
            self.advance_to(next);
        }
        self.now()
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
        let local = self.local(id, now);
        while engine.handoff.front().is_some_and(|(t, _, _)| *t <= now) {
            // Carried out at once, as an engine's driver does (`WorkerDriver::command`).
            let (_, rank, command) = engine.handoff.pop_front().expect("due");
            for report in engine.workers[rank as usize].command(local, command) {
                self.fold_rank_event(&format!("{now} {id}/tp{rank} {report:?}"));
                if let Err(e) = engine.scheduler.handle_report(rank, report) {
                    self.violation(format!("{id}: {e}"));
                }
            }
        }
        let step = |w: &mut WorkerDriver<_>| step_through(w, local);
        self.drive_ranks(id, now, &mut engine.workers, step, |rank, report| {
            engine.scheduler.handle_report(rank, report)
        });
        self.drain_prefill(&mut engine, now);
        self.prefill.insert(id.clone(), Some(engine));
    }

    fn step_decode(&mut self, id: &EngineId, now: Time) {
        let Some(mut engine) = self.decode.get_mut(id).and_then(Option::take) else { return };
        let local = self.local(id, now);
        let step = |w: &mut WorkerDriver<_>| step_through(w, local);
        self.drive_ranks(id, now, &mut engine.workers, step, |rank, report| {
            engine.scheduler.handle_report(rank, report)
        });
        self.drain_decode(&mut engine, now);
        self.decode.insert(id.clone(), Some(engine));
    }

    /// Gives every TP rank's worker of engine `id` an input through `input` (a step, or news
    /// from discovery) and hands the reports it returns to the engine's scheduler through
    /// `to_scheduler`; a report the scheduler refuses is a violation. `now`, true time, only
    /// dates the reports in the digest.
    fn drive_ranks<M: WorkerMachine, E: fmt::Display>(
        &mut self,
        id: &EngineId,
        now: Time,
        workers: &mut [WorkerDriver<M>],
        mut input: impl FnMut(&mut WorkerDriver<M>) -> Vec<M::Report>,
        mut to_scheduler: impl FnMut(u32, M::Report) -> Result<(), E>,
    ) where
        M::Report: fmt::Debug,
    {
        for (rank, worker) in workers.iter_mut().enumerate() {
            for report in input(worker) {
                self.fold_rank_event(&format!("{now} {id}/tp{rank} {report:?}"));
                if let Err(e) = to_scheduler(rank as u32, report) {
                    self.violation(format!("{id}: {e}"));
                }
            }
        }
    }

    fn drain_prefill(&mut self, engine: &mut PrefillEngine, now: Time) {
        while let Some(event) = engine.scheduler.poll_event() {
            match event {
                PrefillEvent::ToWorker { rank, command } => {
                    engine.handoff.push_back((now + self.config.spec.worker_handoff, rank, command));
                }
                PrefillEvent::Free { request, blocks, reason } => {
                    self.record(format!("{} released {request} {reason}", engine.id));
                    engine.export_blocks.remove(&request);
                    let history = self.history.entry(engine.id.clone()).or_default();
                    if history.released.insert(request.clone(), reason).is_some() {
                        self.violation(format!("{}: export {request} released twice", engine.id));
                    }
                    self.free_blocks(&engine.id, &mut engine.pool, &mut engine.ranks, &blocks);
                }
            }
        }
    }

    /// Carries D's scheduler events to its workers and the pool, until nothing is left.
    fn drain_decode(&mut self, engine: &mut DecodeEngine, now: Time) {
        let local = self.local(&engine.id, now);
        loop {
            let mut progressed = false;
            while let Some(event) = engine.scheduler.poll_event() {
                progressed = true;
                match event {
                    DecodeEvent::ToWorker { rank, command } => engine.commands.push_back((rank, command)),
                    DecodeEvent::Ended { request, state, kept_blocks } => {
                        self.record(format!("{} {} {request} keeping {kept_blocks} blocks", engine.id, state.as_str()));
                        engine.ended.insert(request.clone(), state);
                        if let Some(load) = engine.loads.get(&request) {
                            let d_tokens = u64::from(self.config.spec.decode_block_size);
                            let read = self.blocks_read(engine, &request, load, state == DecodeState::Ready);
                            let kept = (kept_blocks as u64 * d_tokens).min(load.remote.prompt_tokens);
                            engine.loaded.insert(request.clone(), (read, kept));
                        }
                        if state == DecodeState::Recompute {
                            // The KV D keeps must be what P computed, as a ready load's must.
                            self.verify(engine, &request, kept_blocks);
                        }
                        if state == DecodeState::Ready {
                            self.verify(engine, &request, kept_blocks);
                            if let Some(load) = engine.loads.remove(&request) {
                                // The engine decodes and is done with the blocks.
                                self.free_blocks(&engine.id, &mut engine.pool, &mut engine.ranks, &load.blocks);
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
                        self.free_blocks(&engine.id, &mut engine.pool, &mut engine.ranks, &blocks);
                    }
                }
            }
            while let Some((rank, command)) = engine.commands.pop_front() {
                progressed = true;
                for report in engine.workers[rank as usize].command(local, command) {
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

    // ---- the digest ----

    /// Folds one rank-level event into [`Cluster::digest`].
    fn fold_rank_event(&mut self, line: &str) {
        self.rank_digest = fnv_fold(self.rank_digest, line.bytes().chain([b'\n']));
    }

    /// A digest of everything that happened, for replay checks: the trace, and every TP
    /// rank's reports to its scheduler.
    pub fn digest(&self) -> u64 {
        let trace = self.trace.iter().fold(Fnv1a::OFFSET, |h, line| fnv_fold(h, line.bytes().chain([b'\n'])));
        fnv_fold(trace, self.rank_digest.to_le_bytes())
    }

    /// The event trace, one line per event.
    pub fn trace(&self) -> &[String] {
        &self.trace
    }
}

/// Steps a rank as an engine's thread does: again at once while a step leaves events in the
/// transport (the driver takes at most `MAX_EVENTS_PER_STEP` a step), so that a burst is taken in
/// at one simulated instant.
fn step_through<M: WorkerMachine>(worker: &mut WorkerDriver<M>, now: Time) -> Vec<M::Report> {
    let mut reports = worker.step(now);
    while worker.backlogged() {
        reports.extend(worker.step(now));
    }
    reports
}

/// Folds `bytes` into the FNV-1a hash `h`.
fn fnv_fold(h: u64, bytes: impl IntoIterator<Item = u8>) -> u64 {
    Fnv1a::from_state(h).write(bytes).finish()
}

/// The FNV-1a hash of `parts`, each followed by 0xff.
fn fnv(parts: &[&[u8]]) -> u64 {
    let mut h = Fnv1a::new();
    for part in parts {
        h.write(part.iter().copied()).write([0xff]);
    }
    h.finish()
}
