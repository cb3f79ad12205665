//! D's connector: the scheduler side that admits, schedules, rejects and aborts requests
//! carrying P's transfer parameters, and the worker side, one per TP rank, that renews P's
//! leases, loads the KV, and tells P when it is done.
//!
//! A worker tracks a request from arrival: it connects to the P ranks it maps to and renews
//! their leases by heartbeat; P's acknowledgements carry the new deadlines. At schedule it
//! fences the read: a read that could outlive P's lease (deadline on D's clock, minus the
//! safety margin and the clock offset's uncertainty) is never started, and the load-failure
//! policy applies instead. In pull mode it reads each head slice with a completion attached;
//! in push mode it registers its blocks with P and waits for P's writes, and its watchdog
//! frees them when no write comes. D's blocks are freed only when no transfer can still touch
//! them.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use kv_core::{
    check_compatible, AgentName, BlockId, DecodeRankPlan, EngineId, Granularity, Handshake, Initiator, LeaseState,
    Message, Notification, PeerAddress, PeerEvent, PlanInput, PoolSide, PreparedId, PreparedTransfer, PushRegistration,
    RequestId, Role, Time, TpMapping, TransferOp, TransferPlan, TransferRequest, TransportError,
};
use kv_lease::HeartbeatPlanner;

use crate::common::{block_indices, Action, Counters, LocalPool, Outbox, Peer, PreparedLists, RemoteRef, XferToken};
use crate::config::{Config, LoadFailurePolicy, Mode};

/// What D's scheduler tells a worker rank.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum DecodeCommand {
    /// A request with P's parameters entered the waiting queue: renew its lease.
    Track {
        /// D's request id.
        request: RequestId,
        /// P's parameters.
        remote: RemoteRef,
    },
    /// Blocks are allocated: load the KV into them (or, on a prefix hit, only tell P).
    Load {
        /// D's request id.
        request: RequestId,
        /// D's blocks, in prompt order.
        blocks: Vec<BlockId>,
        /// D already has the prompt cached.
        prefix_hit: bool,
    },
    /// D rejected the request before admission: tell P.
    Reject {
        /// P's parameters.
        remote: RemoteRef,
    },
    /// The request ends on D.
    Abort {
        /// D's request id.
        request: RequestId,
    },
}

/// How a rank's part of a load ended.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum LoadOutcome {
    /// The KV is in place.
    Loaded,
    /// The load failed or could not be made safely.
    Failed,
    /// The load was aborted.
    Aborted,
}

/// What a D worker rank tells its scheduler.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum DecodeReport {
    /// The rank is done with the request: no transfer of it can touch D's blocks any more.
    Finished {
        /// D's request id.
        request: RequestId,
        /// How.
        outcome: LoadOutcome,
    },
}

/// Where a request stands on D.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
#[cfg_attr(feature = "serde", derive(serde::Deserialize), serde(rename_all = "snake_case"))]
pub enum DecodeState {
    /// Arrived; its lease is renewed while it waits.
    Waiting,
    /// Scheduled: reading, or registered and waiting for P's write.
    Loading,
    /// Its KV is in place.
    Ready,
    /// The load failed (policy `fail`).
    Failed,
    /// The load failed and the prompt is computed locally (policy `recompute`).
    Recompute,
    /// Aborted or rejected; nothing held.
    Gone,
}

impl DecodeState {
    /// The state's name, as scenario files write it.
    pub fn as_str(&self) -> &'static str {
        match self {
            DecodeState::Waiting => "waiting",
            DecodeState::Loading => "loading",
            DecodeState::Ready => "ready",
            DecodeState::Failed => "failed",
            DecodeState::Recompute => "recompute",
            DecodeState::Gone => "gone",
        }
    }
}

/// What D's scheduler asks the engine to do.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum DecodeEvent {
    /// Hand this command to worker `rank`.
    ToWorker {
        /// The worker rank.
        rank: u32,
        /// The command.
        command: DecodeCommand,
    },
    /// The request's KV is in place; its blocks now belong to the engine.
    Ready {
        /// D's request id.
        request: RequestId,
    },
    /// The request's blocks may be freed: its load failed or was aborted.
    Free {
        /// D's request id.
        request: RequestId,
        /// The blocks.
        blocks: Vec<BlockId>,
        /// The state it ended in.
        state: DecodeState,
    },
}

/// Why D's scheduler refused a call.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum DecodeError {
    /// The request is already known.
    AlreadyKnown(RequestId),
    /// The request is not waiting.
    NotWaiting(RequestId, Option<DecodeState>),
    /// Pull mode needs P's export to read from.
    NoExport(RequestId),
    /// A report named a rank outside the engine.
    NoSuchRank {
        /// The rank.
        rank: u32,
        /// The engine's TP size.
        tp: u32,
    },
}

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DecodeError::AlreadyKnown(r) => write!(f, "request {r} is already on this engine"),
            DecodeError::NotWaiting(r, state) => {
                write!(f, "request {r} is not waiting (it is {})", state.map_or("unknown", |s| s.as_str()))
            }
            DecodeError::NoExport(r) => write!(f, "request {r} carries no export from P to read in pull mode"),
            DecodeError::NoSuchRank { rank, tp } => write!(f, "rank {rank} is outside tp {tp}"),
        }
    }
}

impl std::error::Error for DecodeError {}

#[derive(Debug)]
struct SchedulerRequest {
    state: DecodeState,
    blocks: Vec<BlockId>,
    finished: BTreeMap<u32, LoadOutcome>,
    aborting: bool,
}

/// D's scheduler side.
#[derive(Debug)]
pub struct DecodeScheduler {
    tp: u32,
    config: Config,
    requests: BTreeMap<RequestId, SchedulerRequest>,
    events: VecDeque<DecodeEvent>,
}

impl DecodeScheduler {
    /// A scheduler for an engine of `tp` ranks.
    pub fn new(tp: u32, config: Config) -> Self {
        DecodeScheduler { tp, config, requests: BTreeMap::new(), events: VecDeque::new() }
    }

    fn broadcast(&mut self, command: impl Fn() -> DecodeCommand) {
        for rank in 0..self.tp {
            self.events.push_back(DecodeEvent::ToWorker { rank, command: command() });
        }
    }

    /// A request carrying P's parameters enters the waiting queue.
    pub fn handle_arrive(&mut self, request: RequestId, remote: RemoteRef) -> Result<(), DecodeError> {
        if self.requests.contains_key(&request) {
            return Err(DecodeError::AlreadyKnown(request));
        }
        if self.config.mode == Mode::Pull && remote.export.is_none() {
            return Err(DecodeError::NoExport(request));
        }
        let entry = SchedulerRequest {
            state: DecodeState::Waiting,
            blocks: Vec::new(),
            finished: BTreeMap::new(),
            aborting: false,
        };
        self.requests.insert(request.clone(), entry);
        self.broadcast(|| DecodeCommand::Track { request: request.clone(), remote: remote.clone() });
        Ok(())
    }

    /// Blocks are allocated for a waiting request: start its load.
    pub fn handle_schedule(
        &mut self,
        request: RequestId,
        blocks: Vec<BlockId>,
        prefix_hit: bool,
    ) -> Result<(), DecodeError> {
        let entry = self.requests.get_mut(&request);
        match entry {
            Some(e) if e.state == DecodeState::Waiting => {
                e.state = DecodeState::Loading;
                e.blocks = blocks.clone();
            }
            other => return Err(DecodeError::NotWaiting(request, other.map(|e| e.state))),
        }
        self.broadcast(|| DecodeCommand::Load { request: request.clone(), blocks: blocks.clone(), prefix_hit });
        Ok(())
    }

    /// D rejects `request`, carrying P's parameters, before admission; it ends `gone`.
    pub fn handle_reject(&mut self, request: RequestId, remote: RemoteRef) -> Result<(), DecodeError> {
        if self.requests.get(&request).is_some_and(|e| matches!(e.state, DecodeState::Waiting | DecodeState::Loading)) {
            return Err(DecodeError::AlreadyKnown(request));
        }
        let entry = SchedulerRequest {
            state: DecodeState::Gone,
            blocks: Vec::new(),
            finished: BTreeMap::new(),
            aborting: false,
        };
        self.requests.insert(request, entry);
        self.broadcast(|| DecodeCommand::Reject { remote: remote.clone() });
        Ok(())
    }

    /// The router aborts the request on D.
    pub fn handle_abort(&mut self, request: &RequestId) {
        let Some(entry) = self.requests.get_mut(request) else { return };
        match entry.state {
            DecodeState::Waiting => entry.state = DecodeState::Gone,
            DecodeState::Loading => entry.aborting = true,
            _ => return,
        }
        self.broadcast(|| DecodeCommand::Abort { request: request.clone() });
    }

    /// A worker rank's report.
    pub fn handle_report(&mut self, rank: u32, report: DecodeReport) -> Result<(), DecodeError> {
        if rank >= self.tp {
            return Err(DecodeError::NoSuchRank { rank, tp: self.tp });
        }
        let DecodeReport::Finished { request, outcome } = report;
        let failed_state = match self.config.load_failure_policy {
            LoadFailurePolicy::Fail => DecodeState::Failed,
            LoadFailurePolicy::Recompute => DecodeState::Recompute,
        };
        let Some(entry) = self.requests.get_mut(&request) else { return Ok(()) };
        entry.finished.insert(rank, outcome);
        match entry.state {
            DecodeState::Waiting if outcome != LoadOutcome::Loaded => {
                // P's export is gone before the load began: nothing is held, tell every rank.
                entry.state = failed_state;
                self.broadcast(|| DecodeCommand::Abort { request: request.clone() });
            }
            DecodeState::Loading if entry.finished.len() as u32 == self.tp => {
                let all_loaded = entry.finished.values().all(|o| *o == LoadOutcome::Loaded);
                entry.state = if entry.aborting {
                    DecodeState::Gone
                } else if all_loaded {
                    DecodeState::Ready
                } else {
                    failed_state
                };
                if entry.state == DecodeState::Ready {
                    self.events.push_back(DecodeEvent::Ready { request });
                } else {
                    let blocks = std::mem::take(&mut entry.blocks);
                    self.events.push_back(DecodeEvent::Free { request, blocks, state: entry.state });
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// The next thing the engine must do.
    pub fn poll_event(&mut self) -> Option<DecodeEvent> {
        self.events.pop_front()
    }

    /// Where a request stands, if this engine saw it.
    pub fn state(&self, request: &RequestId) -> Option<DecodeState> {
        self.requests.get(request).map(|e| e.state)
    }

    /// The blocks held for requests that are loading.
    pub fn held_blocks(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.requests.values().filter(|e| e.state == DecodeState::Loading).flat_map(|e| e.blocks.iter().copied())
    }

    /// Requests that still need an outcome (waiting or loading).
    pub fn pending(&self) -> usize {
        self.requests.values().filter(|e| matches!(e.state, DecodeState::Waiting | DecodeState::Loading)).count()
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Phase {
    /// Renewing the lease until blocks are allocated.
    Waiting,
    /// Blocks allocated; waiting for handshakes with the P ranks before starting.
    Starting,
    /// Pull: reads in flight.
    Reading,
    /// Push: registered, waiting for P's writes.
    Registered,
}

#[derive(Debug)]
struct Load {
    remote: RemoteRef,
    tp: TpMapping,
    plan: DecodeRankPlan,
    targets: Vec<AgentName>,
    phase: Phase,
    blocks: Vec<BlockId>,
    prefix_hit: bool,
    /// The newest acknowledged deadline of each P rank, on P's clock.
    deadlines: BTreeMap<u32, Time>,
    reads: BTreeSet<XferToken>,
    failed: bool,
    aborted: bool,
    /// Push: P ranks whose write landed, and those that said none will come.
    written: BTreeSet<u32>,
    declined: BTreeSet<u32>,
    watchdog: Option<Time>,
    /// Past this, a request still waiting stops renewing P's lease: `decoder_kv_blocks_ttl`
    /// bounds how long D can keep P's blocks alive for a request it never schedules.
    wait_until: Time,
}

impl Load {
    fn outcome(&self, ok: bool) -> LoadOutcome {
        if self.aborted {
            LoadOutcome::Aborted
        } else if ok && !self.failed {
            LoadOutcome::Loaded
        } else {
            LoadOutcome::Failed
        }
    }
}

enum ReadPost {
    Pairs(TransferRequest),
    Prepared(PreparedTransfer),
}

/// D's worker side for one TP rank.
///
/// Drive it as the crate docs describe: feed inputs through the `handle_*` methods, then drain
/// [`DecodeWorker::poll_action`] until it returns `None`, and wake it at
/// [`DecodeWorker::poll_timeout`].
#[derive(Debug)]
pub struct DecodeWorker {
    offer: Handshake,
    config: Config,
    pool: LocalPool,
    peers: BTreeMap<AgentName, Peer>,
    connecting: BTreeMap<AgentName, PeerAddress>,
    queued: BTreeMap<AgentName, Vec<Message>>,
    loads: BTreeMap<RequestId, Load>,
    /// (P engine, P's request id) to D's request ids, for acknowledgements.
    by_remote: BTreeMap<(EngineId, RequestId), BTreeSet<RequestId>>,
    heartbeats: HeartbeatPlanner<AgentName>,
    xfers: BTreeMap<XferToken, RequestId>,
    /// This rank's pool, prepared once; and each P rank's, prepared at its first read.
    lists: PreparedLists,
    out: Outbox<DecodeReport>,
    counters: Counters,
}

impl DecodeWorker {
    /// The worker of the rank that `offer` describes, over `pool`.
    pub fn new(offer: Handshake, config: Config, pool: LocalPool) -> Self {
        DecodeWorker {
            heartbeats: HeartbeatPlanner::new(config.heartbeat_interval),
            offer,
            config,
            pool,
            peers: BTreeMap::new(),
            connecting: BTreeMap::new(),
            queued: BTreeMap::new(),
            loads: BTreeMap::new(),
            by_remote: BTreeMap::new(),
            xfers: BTreeMap::new(),
            lists: PreparedLists::default(),
            out: Outbox::default(),
            counters: Counters::default(),
        }
    }

    /// What this rank counted.
    pub fn counters(&self) -> Counters {
        self.counters
    }

    /// Requests this rank is tracking or loading.
    pub fn active(&self) -> usize {
        self.loads.len()
    }

    /// A command from the scheduler.
    pub fn handle_command(&mut self, now: Time, command: DecodeCommand) {
        match command {
            DecodeCommand::Track { request, remote } => self.track(now, request, remote),
            DecodeCommand::Load { request, blocks, prefix_hit } => {
                let Some(load) = self.loads.get_mut(&request).filter(|l| l.phase == Phase::Waiting) else {
                    self.counters.late_messages += 1;
                    return;
                };
                load.blocks = blocks;
                load.prefix_hit = prefix_hit;
                load.phase = Phase::Starting;
                self.try_start(now, &request);
            }
            DecodeCommand::Reject { remote } => {
                let Some((_, _, targets)) = self.map_remote(&remote) else { return };
                for target in targets {
                    self.send_to(&target, Message::Rejection { request: remote.request.clone() });
                }
            }
            DecodeCommand::Abort { request } => self.abort(now, &request),
        }
    }

    /// The TP mapping, this rank's plan and its P targets for `remote`, connecting to them.
    fn map_remote(&mut self, remote: &RemoteRef) -> Option<(TpMapping, DecodeRankPlan, Vec<AgentName>)> {
        let layout = self.offer.layout;
        let tp = TpMapping::new(remote.tp_size, self.offer.tp_size, layout.kv_heads, layout.is_mla()).ok()?;
        let plan = tp.decode_rank(self.offer.rank).ok()?;
        let mut targets = Vec::new();
        for p in plan.completion_targets() {
            let address = remote.addresses.get(p as usize)?.clone();
            let agent = AgentName::new(remote.engine.clone(), p);
            if !self.peers.contains_key(&agent) && !self.connecting.contains_key(&agent) {
                self.connecting.insert(agent.clone(), address.clone());
                self.out.connect(address);
            }
            targets.push(agent);
        }
        Some((tp, plan, targets))
    }

    fn track(&mut self, now: Time, request: RequestId, remote: RemoteRef) {
        if self.loads.contains_key(&request) {
            self.counters.duplicate_messages += 1;
            return;
        }
        let Some((tp, plan, targets)) = self.map_remote(&remote) else {
            tracing::warn!(%request, p_tp = remote.tp_size, "P's parameters do not map onto this engine");
            self.out.report(DecodeReport::Finished { request, outcome: LoadOutcome::Failed });
            return;
        };
        for target in &targets {
            self.heartbeats.track(target.clone(), remote.request.clone(), now);
        }
        self.by_remote.entry((remote.engine.clone(), remote.request.clone())).or_default().insert(request.clone());
        let load = Load {
            remote,
            tp,
            plan,
            targets,
            phase: Phase::Waiting,
            blocks: Vec::new(),
            prefix_hit: false,
            deadlines: BTreeMap::new(),
            reads: BTreeSet::new(),
            failed: false,
            aborted: false,
            written: BTreeSet::new(),
            declined: BTreeSet::new(),
            watchdog: None,
            wait_until: now + self.config.decoder_kv_blocks_ttl,
        };
        self.loads.insert(request, load);
    }

    fn send_to(&mut self, to: &AgentName, message: Message) {
        if self.peers.contains_key(to) {
            self.out.send(to, &message);
        } else {
            self.queued.entry(to.clone()).or_default().push(message);
        }
    }

    /// Starts a load whose blocks are allocated, once every P rank it needs is connected.
    fn try_start(&mut self, now: Time, request: &RequestId) {
        let Some(load) = self.loads.get(request) else { return };
        if load.phase != Phase::Starting || !load.targets.iter().all(|t| self.peers.contains_key(t)) {
            return;
        }
        // The export lives in the P incarnation that made it; a restarted P has none of it, and
        // its pool at those addresses holds other requests' blocks.
        let instance = load.remote.instance;
        if instance != 0 && load.targets.iter().any(|t| self.peers[t].handshake.instance != instance) {
            tracing::info!(%request, "P restarted since it exported this request");
            self.fail(request);
            return;
        }
        let completion = Message::Completion {
            request: load.remote.request.clone(),
            expected_consumers: load.tp.consumers_per_prefill_rank(),
        };
        if load.prefix_hit {
            for target in load.targets.clone() {
                self.send_to(&target, completion.clone());
            }
            self.finish(request, true);
            return;
        }
        match self.config.mode {
            Mode::Pull => self.start_reads(now, request, completion),
            Mode::Push => {
                let load = self.loads.get_mut(request).expect("exists");
                let registration = Message::PushRegistration(PushRegistration {
                    request: request.clone(),
                    decode_engine: self.offer.engine.clone(),
                    decode_rank: self.offer.rank,
                    decode_tp: self.offer.tp_size,
                    blocks: load.blocks.clone(),
                });
                load.phase = Phase::Registered;
                load.watchdog = Some(now + self.config.push_registration_timeout);
                for target in load.targets.clone() {
                    self.send_to(&target, registration.clone());
                }
            }
        }
    }

    fn start_reads(&mut self, now: Time, request: &RequestId, completion: Message) {
        let load = &self.loads[request];
        let Some(export) = load.remote.export.clone() else {
            self.fail(request);
            return;
        };
        // The fence: every P rank's lease must outlast the read, with the margin.
        if self.last_safe_start(load).is_none_or(|last| now > last) {
            tracing::info!(%request, "read fenced: P's lease could end before it");
            self.counters.reads_fenced += 1;
            self.fail(request);
            return;
        }
        // The fence bounds the probing too: it fails the load once the lease could end.
        // A sibling's export can be released early by another sibling's completion, unless P
        // has bound it to this engine; P says so by acknowledging a renewal. Until every read
        // target has, probe instead of reading.
        if load.remote.request.parent().is_some() {
            let unconfirmed: Vec<AgentName> = load
                .plan
                .reads
                .iter()
                .filter(|s| !load.deadlines.contains_key(&s.prefill_rank))
                .map(|s| AgentName::new(load.remote.engine.clone(), s.prefill_rank))
                .collect();
            if !unconfirmed.is_empty() {
                let probe = Message::Heartbeat { requests: vec![load.remote.request.clone()] };
                for target in unconfirmed {
                    self.send_to(&target, probe.clone());
                }
                return;
            }
        }
        let Ok(notification) = completion.encode() else {
            self.fail(request);
            return;
        };
        let mut posts = Vec::new();
        let mut to_prepare = Vec::new();
        for slice in &load.plan.reads {
            let agent = AgentName::new(load.remote.engine.clone(), slice.prefill_rank);
            let peer = &self.peers[&agent];
            let Some(p_shape) = peer.shape(load.tp.prefill_heads()) else {
                tracing::warn!(%request, peer = %agent, "cannot plan the read: the peer's pool shape is invalid");
                self.fail(request);
                return;
            };
            let input = PlanInput {
                prefill: PoolSide { shape: p_shape, regions: &peer.handshake.regions, blocks: &export.blocks },
                decode: PoolSide { shape: self.pool.shape, regions: &self.pool.regions, blocks: &load.blocks },
                slice: *slice,
                initiator: Initiator::Decode,
            };
            // The plan also checks every block against both pools, whichever way is posted.
            let plan = match TransferPlan::build(&input, Granularity::Merged) {
                Ok(plan) => plan,
                Err(err) => {
                    tracing::warn!(%request, %err, "cannot plan the read");
                    self.fail(request);
                    return;
                }
            };
            // Whole blocks, whole heads, equal block sizes: name prepared entries by index.
            let whole = slice.heads == p_shape.heads && slice.heads == self.pool.shape.heads;
            let same_blocks = p_shape.layout.block_tokens == self.pool.shape.layout.block_tokens;
            if whole && same_blocks {
                if let Some((local, remote)) = self.lists.ready(&agent) {
                    let (local_indices, remote_indices) =
                        block_indices(&self.pool.shape, &load.blocks, &p_shape, &export.blocks);
                    posts.push(ReadPost::Prepared(PreparedTransfer {
                        op: TransferOp::Read,
                        peer: agent,
                        local,
                        local_indices,
                        remote,
                        remote_indices,
                        notification: Some(notification.clone()),
                    }));
                    continue;
                }
                to_prepare.push((agent.clone(), p_shape));
            }
            posts.push(ReadPost::Pairs(TransferRequest {
                op: TransferOp::Read,
                peer: agent,
                pairs: plan.pairs().to_vec(),
                notification: Some(notification.clone()),
            }));
        }
        // Lists are prepared once, the first time a peer is read; this read goes as pairs.
        for (agent, p_shape) in to_prepare {
            let regions = self.peers[&agent].handshake.regions.clone();
            self.lists.want(&mut self.out, &self.pool, &agent, &p_shape, &regions);
        }
        let load = self.loads.get_mut(request).expect("exists");
        load.phase = Phase::Reading;
        for post in posts {
            let token = match post {
                ReadPost::Pairs(request) => self.out.post(request),
                ReadPost::Prepared(request) => {
                    self.counters.prepared_reads += 1;
                    self.out.post_prepared(request)
                }
            };
            load.reads.insert(token);
            self.xfers.insert(token, request.clone());
        }
    }

    /// A descriptor list asked for in a read is ready (or not: then reads keep using pairs).
    pub fn handle_prepared(&mut self, _now: Time, token: XferToken, result: Result<PreparedId, TransportError>) {
        self.lists.handle_prepared(token, result);
    }

    /// The latest time a read of `load` may start: the earliest, over the P ranks it reads,
    /// of P's deadline on D's clock minus the safety margin and the clock's uncertainty.
    fn last_safe_start(&self, load: &Load) -> Option<Time> {
        let export = load.remote.export.as_ref()?;
        load.plan
            .reads
            .iter()
            .map(|slice| {
                let agent = AgentName::new(load.remote.engine.clone(), slice.prefill_rank);
                let peer = self.peers.get(&agent)?;
                let acked = load.deadlines.get(&slice.prefill_rank).copied().unwrap_or(export.deadline);
                let deadline = acked.max(export.deadline);
                Some(peer.offset.last_safe_start(deadline, self.config.read_safety_margin, std::time::Duration::ZERO))
            })
            .try_fold(Time::from_nanos(u64::MAX), |min, t| t.map(|t| min.min(t)))
    }

    /// Gives a load up: tells P, and finishes once nothing can touch D's blocks.
    fn fail(&mut self, request: &RequestId) {
        let Some(load) = self.loads.get_mut(request) else { return };
        load.failed = true;
        if load.phase == Phase::Reading && !load.reads.is_empty() {
            // An abort now would let P free blocks under these reads; `handle_transfer` tells
            // P once the last read has ended.
            return;
        }
        let abort = Message::Abort { request: load.remote.request.clone() };
        let pending: Vec<AgentName> = load
            .targets
            .iter()
            .filter(|t| !load.written.contains(&t.rank) && !load.declined.contains(&t.rank))
            .cloned()
            .collect();
        let waits = load.phase == Phase::Registered && !pending.is_empty();
        for target in &pending {
            self.send_to(target, abort.clone());
        }
        if !waits {
            self.finish(request, false);
        }
    }

    fn abort(&mut self, _now: Time, request: &RequestId) {
        let Some(load) = self.loads.get_mut(request) else { return };
        load.aborted = true;
        match load.phase {
            Phase::Reading => {}
            Phase::Waiting | Phase::Starting | Phase::Registered => self.fail(request),
        }
    }

    /// Ends the load on this rank and reports it.
    fn finish(&mut self, request: &RequestId, ok: bool) {
        let Some(load) = self.loads.remove(request) else { return };
        for target in &load.targets {
            self.heartbeats.untrack(target, &load.remote.request);
        }
        let key = (load.remote.engine.clone(), load.remote.request.clone());
        if let Some(set) = self.by_remote.get_mut(&key) {
            set.remove(request);
            if set.is_empty() {
                self.by_remote.remove(&key);
            }
        }
        let outcome = load.outcome(ok);
        if outcome == LoadOutcome::Loaded {
            // MLA: P ranks this rank did not read free when told.
            let completion = Message::Completion {
                request: load.remote.request.clone(),
                expected_consumers: load.tp.consumers_per_prefill_rank(),
            };
            if self.config.mode == Mode::Pull && !load.prefix_hit {
                for p in &load.plan.notify_only {
                    self.send_to(&AgentName::new(load.remote.engine.clone(), *p), completion.clone());
                }
            }
        }
        self.out.report(DecodeReport::Finished { request: request.clone(), outcome });
    }

    /// A peer event from the transport.
    pub fn handle_peer_event(&mut self, now: Time, event: PeerEvent) {
        match event {
            PeerEvent::Connected(info) => {
                let agent = info.agent.clone();
                match check_compatible(&self.offer, &info.handshake) {
                    Ok(compat) => {
                        self.connecting.remove(&agent);
                        // A list prepared with an earlier incarnation names its metadata, not this one's.
                        self.lists.forget(&agent);
                        self.peers.insert(agent.clone(), Peer::new(&info, compat));
                        for message in self.queued.remove(&agent).unwrap_or_default() {
                            self.out.send(&agent, &message);
                        }
                        let starting: Vec<RequestId> = self
                            .loads
                            .iter()
                            .filter(|(_, l)| l.phase == Phase::Starting && l.targets.contains(&agent))
                            .map(|(r, _)| r.clone())
                            .collect();
                        for request in starting {
                            self.try_start(now, &request);
                        }
                    }
                    Err(err) => {
                        tracing::warn!(peer = %agent, %err, "incompatible prefill rank");
                        self.peer_gone(&agent);
                    }
                }
            }
            PeerEvent::ConnectFailed { address, error } => {
                let agents: Vec<AgentName> =
                    self.connecting.iter().filter(|(_, a)| **a == address).map(|(n, _)| n.clone()).collect();
                for agent in agents {
                    tracing::warn!(peer = %agent, %error, "cannot reach prefill rank");
                    self.connecting.remove(&agent);
                    self.peer_gone(&agent);
                }
            }
            PeerEvent::Lost(agent) => self.peer_gone(&agent),
            PeerEvent::Refused { peer, error } => tracing::warn!(%peer, %error, "refused a handshake"),
        }
    }

    /// A P rank is gone or unreachable: loads that need it fail once nothing can touch D's blocks.
    fn peer_gone(&mut self, agent: &AgentName) {
        self.peers.remove(agent);
        self.lists.forget(agent);
        self.queued.remove(agent);
        self.heartbeats.forget(agent);
        let affected: Vec<RequestId> =
            self.loads.iter().filter(|(_, l)| l.targets.contains(agent)).map(|(r, _)| r.clone()).collect();
        for request in affected {
            let load = self.loads.get_mut(&request).expect("exists");
            load.declined.insert(agent.rank);
            if load.phase == Phase::Reading {
                // Its reads fail through the transport; their bytes are not trusted either way.
                load.failed = true;
            } else {
                self.fail(&request);
            }
        }
    }

    /// A notification from the transport.
    pub fn handle_notification(&mut self, now: Time, notification: Notification) {
        let from = notification.from;
        let message = match Message::decode(&notification.payload) {
            Ok(message) => message,
            Err(err) => {
                tracing::debug!(%from, %err, "malformed notification");
                self.counters.ignored_messages += 1;
                return;
            }
        };
        if self.peers.get(&from).is_none_or(|p| p.handshake.role != Role::Prefill) {
            self.counters.ignored_messages += 1;
            return;
        }
        match message {
            Message::HeartbeatAck { renewals } => {
                for renewal in renewals {
                    let key = (from.engine.clone(), renewal.request.clone());
                    for request in self.by_remote.get(&key).cloned().unwrap_or_default() {
                        self.on_renewal(now, &request, &from, renewal.lease);
                    }
                }
            }
            Message::Completion { request, .. } => self.on_push_answer(&from, &request, true),
            Message::Abort { request } => self.on_push_answer(&from, &request, false),
            Message::Heartbeat { .. } | Message::Rejection { .. } | Message::PushRegistration(_) => {
                self.counters.ignored_messages += 1
            }
        }
    }

    fn on_renewal(&mut self, now: Time, request: &RequestId, from: &AgentName, lease: LeaseState) {
        let Some(load) = self.loads.get_mut(request) else { return };
        match lease {
            LeaseState::Held(deadline) => {
                let entry = load.deadlines.entry(from.rank).or_insert(deadline);
                *entry = (*entry).max(deadline);
                if load.phase == Phase::Starting {
                    self.try_start(now, request);
                }
            }
            // P's worker has not learned of the export yet; a load waiting on it asks again.
            LeaseState::Unknown => {
                if load.phase == Phase::Starting {
                    self.try_start(now, request);
                }
            }
            LeaseState::Released => match load.phase {
                Phase::Waiting | Phase::Starting => {
                    tracing::info!(%request, peer = %from, "P no longer holds the export");
                    self.fail(request);
                }
                // A read raced the export's end: its bytes cannot be trusted.
                Phase::Reading => load.failed = true,
                // Push: P released it, so no write will come from that rank.
                Phase::Registered => self.on_push_answer(from, request, false),
            },
        }
    }

    /// Push: P's write landed (`written`), or P said none will come.
    fn on_push_answer(&mut self, from: &AgentName, request: &RequestId, written: bool) {
        let request = if self.loads.contains_key(request) {
            request.clone()
        } else {
            // P answers with D's id; an abort may name P's id instead.
            let key = (from.engine.clone(), request.clone());
            match self.by_remote.get(&key).and_then(|s| s.first()) {
                Some(r) => r.clone(),
                None => {
                    self.counters.late_messages += 1;
                    return;
                }
            }
        };
        let load = self.loads.get_mut(&request).expect("exists");
        if load.phase != Phase::Registered || !load.targets.contains(from) {
            self.counters.late_messages += 1;
            return;
        }
        let fresh = if written { load.written.insert(from.rank) } else { load.declined.insert(from.rank) };
        if !fresh {
            self.counters.duplicate_messages += 1;
            return;
        }
        if !written && !load.failed && !load.aborted {
            // One P rank will not write: the load cannot complete; stop the others too.
            self.fail(&request);
            return;
        }
        let load = &self.loads[&request];
        let answered = load.targets.iter().all(|t| load.written.contains(&t.rank) || load.declined.contains(&t.rank));
        if answered {
            let all_written = load.targets.iter().all(|t| load.written.contains(&t.rank));
            self.finish(&request, all_written);
        }
    }

    /// A transfer this worker posted ended.
    pub fn handle_transfer(&mut self, _now: Time, token: XferToken, ok: bool) {
        let Some(request) = self.xfers.remove(&token) else { return };
        let Some(load) = self.loads.get_mut(&request) else { return };
        load.reads.remove(&token);
        if !ok {
            self.counters.transfers_failed += 1;
            load.failed = true;
        }
        if load.reads.is_empty() {
            if load.failed {
                // P ranks whose read failed got no completion: free them.
                let abort = Message::Abort { request: load.remote.request.clone() };
                for target in load.targets.clone() {
                    self.send_to(&target, abort.clone());
                }
            }
            self.finish(&request, true);
        }
    }

    /// The clock reached a wake-up (spurious wake-ups are harmless).
    pub fn handle_timeout(&mut self, now: Time) {
        while let Some((peer, ids)) = self.heartbeats.poll(now) {
            // Request ids are at most 256 bytes, so 200 per frame stay under the size limit.
            for chunk in ids.chunks(200) {
                self.send_to(&peer, Message::Heartbeat { requests: chunk.to_vec() });
            }
        }
        let overdue: Vec<RequestId> = self
            .loads
            .iter()
            .filter(|(_, l)| l.phase == Phase::Registered && l.watchdog.is_some_and(|w| now >= w))
            .map(|(r, _)| r.clone())
            .collect();
        for request in overdue {
            tracing::info!(%request, "no push came before the registration timeout; freeing D's blocks");
            self.fail(&request);
            self.finish(&request, false);
        }
        let stale: Vec<RequestId> = self
            .loads
            .iter()
            .filter(|(_, l)| l.phase == Phase::Waiting && now >= l.wait_until)
            .map(|(r, _)| r.clone())
            .collect();
        for request in stale {
            tracing::info!(%request, "waited longer than decoder_kv_blocks_ttl; letting P's lease go");
            self.fail(&request);
        }
        // Loads waiting to start (for a handshake, or P's confirmation of a sibling) try again:
        // they probe once more, or fail once the fence closes.
        let starting: Vec<RequestId> =
            self.loads.iter().filter(|(_, l)| l.phase == Phase::Starting).map(|(r, _)| r.clone()).collect();
        for request in starting {
            self.try_start(now, &request);
        }
    }

    /// The next action for the driver.
    pub fn poll_action(&mut self) -> Option<Action<DecodeReport>> {
        self.out.pop()
    }

    /// When to call [`DecodeWorker::handle_timeout`] next.
    pub fn poll_timeout(&mut self) -> Option<Time> {
        let watchdog = self.loads.values().filter(|l| l.phase == Phase::Registered).filter_map(|l| l.watchdog).min();
        let stale = self.loads.values().filter(|l| l.phase == Phase::Waiting).map(|l| l.wait_until).min();
        // A load that cannot start yet is retried when its fence closes, and fails then.
        let fence = self
            .loads
            .values()
            .filter(|l| l.phase == Phase::Starting && self.config.mode == Mode::Pull)
            .filter_map(|l| self.last_safe_start(l))
            .map(|t| t + std::time::Duration::from_nanos(1))
            .min();
        [self.heartbeats.next_due(), watchdog, stale, fence].into_iter().flatten().min()
    }
}
