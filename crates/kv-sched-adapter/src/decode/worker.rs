//! D's worker side, one per TP rank: renews P's leases, loads the KV, and tells P when it is
//! done.
//!
//! A worker tracks a request from arrival: it connects to the P ranks it maps to, claims the
//! export at once, naming its own prompt and the P blocks the handoff says it will read, and
//! renews P's lease by heartbeat (claiming again, at each beat, where P has not answered the
//! claim `Held`); P's acknowledgements carry the new deadlines, and P answers `Held` only to a
//! claim that names the prompt and the blocks it computed ("refused" otherwise, and the export
//! is gone). It never loads an export the router named for another engine incarnation (P may
//! free it at any time for that one). Unless the router named this engine at prefill, it
//! reads only once every P rank it reads has answered its claim: with a deadline (P holds the
//! export for this engine), or, for a request that is not a parallel-sampling sibling, "not
//! known yet" (P's worker staged the claim, and no other engine's claim came first);
//! "released" or "refused" fails the load. A handoff that carries no deadline of P's
//! (NixlConnector's form, rebuilt by a router) waits for P's deadline whatever else holds. So
//! a request retried on a new incarnation never reads what P freed for the old one, and a
//! sibling, which another sibling's completion releases unless its owner claimed it, waits for
//! the deadline, named or not. A
//! pipeline-parallel P is read stage by stage: every stage's ranks, each holding its share of
//! the layers. At schedule it fences the read: a
//! read that could outlive P's lease (the deadline on D's clock, minus the safety margin and
//! the clock offset's uncertainty) is never started; and a read that completes after that
//! point (D stalled, was paused, or the network was slow) is a failed load, never a success,
//! since P may already have reused those blocks. The load-failure policy applies either way.
//!
//! In push mode it registers its blocks with P and waits for P's writes; its watchdog gives
//! the load up when no write comes. A push given up (by the watchdog, an abort, or a P rank
//! that will not write) asks P to cancel and keeps its blocks in quarantine until every P rank
//! has said no write is or will be in flight, or is seen gone, or `push_quarantine` passes:
//! only then can they go back to the pool. A P rank's "no write will come" that D did not ask
//! for fails the load but vouches for nothing: it may answer an earlier cancel of the same id,
//! taken in after this registration went out, so D asks that rank to cancel too and waits for
//! the answer. A write stalled longer than the quarantine is the one hazard no one-sided
//! transport can fence.
//!
//! This file keeps the loads' books, P's answers and the endings; `loads.rs` starts a load (the
//! fence, the reads or the push registration) and takes its transfers' endings.

use std::collections::{BTreeMap, BTreeSet};

use kv_core::{
    check_compatible, AgentName, BlockId, Claim, DecodeRankPlan, Descriptors, Digest, EngineId, Granularity, Handshake,
    Initiator, LeaseState, Message, Notification, PeerAddress, PeerEvent, PlanInput, PoolSide, PreparedId,
    PreparedTransfer, Prompt, PushRegistration, RequestId, Role, Time, TpMapping, TransferOp, TransferPlan,
    TransferRequest, TransportError,
};
use kv_lease::HeartbeatPlanner;

use super::scheduler::{DecodeCommand, DecodeReport, LoadOutcome};
use crate::common::{
    block_indices, by_index, request_span, Action, Consumer, Counters, Ignored, LocalPool, Outbox, Peer, PreparedLists,
    RemoteRef, XferToken,
};
use crate::config::{Config, ConfigError, Mode};

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
    /// Push: given up, waiting until no write can come; the blocks are in quarantine.
    Cancelling,
}

#[derive(Debug)]
struct Load {
    remote: RemoteRef,
    /// What this engine claims of the export (its own prompt, and P's blocks it will read):
    /// sent on arrival and, to each P rank that has not answered it `Held`, at every beat.
    claim: Claim,
    /// When it arrived.
    since: Time,
    tp: TpMapping,
    plan: DecodeRankPlan,
    targets: Vec<AgentName>,
    phase: Phase,
    blocks: Vec<BlockId>,
    /// The first `cached` of `blocks` D's own prefix cache holds: they are not loaded.
    cached: usize,
    /// The newest acknowledged deadline of each P rank, on P's clock.
    deadlines: BTreeMap<u32, Time>,
    /// P ranks that answered the claim "not known yet": they staged it.
    staged: BTreeSet<u32>,
    reads: BTreeSet<XferToken>,
    failed: bool,
    /// Reads that failed part-way left bad bytes only in these local ranges; every other byte
    /// of the load's reads that ended arrived whole.
    spoiled: Vec<(u64, u64)>,
    /// None of the reads' bytes can be trusted: a read failed and the transport could not say
    /// where, ended late, or raced the loss or release of P's blocks.
    blind: bool,
    aborted: bool,
    /// Push: P ranks whose write landed, and those that said none will come.
    written: BTreeSet<u32>,
    declined: BTreeSet<u32>,
    watchdog: Option<Time>,
    /// Push, given up: the blocks leave quarantine at this time at the latest.
    quarantine_until: Option<Time>,
    /// Past this, a request still waiting stops renewing P's lease: `decoder_kv_blocks_ttl`
    /// bounds how long D can keep P's blocks alive for a request it never schedules.
    wait_until: Time,
}

impl Load {
    /// The load failed, and none of its reads' bytes may be trusted.
    fn distrust(&mut self) {
        self.failed = true;
        self.blind = true;
    }

    /// D already holds the whole prompt: nothing is read, P is only told.
    fn prefix_hit(&self) -> bool {
        self.cached >= self.blocks.len()
    }

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
    /// How transfers of whole blocks name their bytes: the configuration's choice, else the
    /// transport's ([`WorkerDriver`](crate::driver::WorkerDriver) tells it).
    descriptors: Descriptors,
    out: Outbox<DecodeReport>,
    counters: Counters,
    /// The WARNING lines this rank logs, rate-limited.
    warnings: crate::warnings::Warnings,
}

impl DecodeWorker {
    /// The worker of the rank that `offer` describes, over `pool`; fails on settings that
    /// cannot work ([`Config::validate`]) or an offer that does not describe `pool`
    /// ([`LocalPool::offer`] builds one that does).
    pub fn new(offer: Handshake, config: Config, pool: LocalPool) -> Result<Self, ConfigError> {
        config.validate()?;
        pool.check_offer(&offer, Role::Decode)?;
        let warnings = crate::warnings::Warnings::new(AgentName::new(offer.engine.clone(), offer.rank));
        Ok(DecodeWorker {
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
            descriptors: config.descriptors.unwrap_or(Descriptors::Prepared),
            out: Outbox::default(),
            counters: Counters::default(),
            warnings,
        })
    }

    /// What this rank counted.
    pub fn counters(&self) -> Counters {
        self.counters
    }

    /// How its transport moves whole blocks fastest; the configuration's `descriptors`, if
    /// set, wins.
    pub fn use_descriptors(&mut self, preferred: Descriptors) {
        self.descriptors = self.config.descriptors.unwrap_or(preferred);
    }

    /// P ranks connected to this rank (handshake completed).
    pub fn connected_peers(&self) -> usize {
        self.peers.len()
    }

    /// The heartbeat interval it was configured with: its driver sends a notification the
    /// transport refused again for no longer than this.
    pub fn heartbeat_interval(&self) -> std::time::Duration {
        self.config.heartbeat_interval
    }

    /// Requests this rank is tracking or loading.
    pub fn active(&self) -> usize {
        self.loads.len()
    }

    /// Whether a peer's notification may change something now: an acknowledgement of a
    /// renewal, P's push write or its answer to a cancel, for a request this rank tracks.
    pub fn awaits_peers(&self) -> bool {
        !self.loads.is_empty()
    }

    /// A command from the scheduler.
    pub fn handle_command(&mut self, now: Time, command: DecodeCommand) {
        match command {
            DecodeCommand::Track { request, remote, prompt } => self.track(now, request, *remote, prompt),
            DecodeCommand::Load { request, blocks, cached_blocks } => {
                let Some(load) = self.loads.get_mut(&request).filter(|l| l.phase == Phase::Waiting) else {
                    self.counters.late_messages += 1;
                    return;
                };
                load.cached = cached_blocks.min(blocks.len());
                load.blocks = blocks;
                load.phase = Phase::Starting;
                self.try_start(now, &request);
            }
            DecodeCommand::Reject { remote } => {
                let targets = match self.map_remote(&remote) {
                    Ok((_, _, targets)) => targets,
                    Err(error) => {
                        tracing::warn!(
                            request = %remote.request,
                            engine = %remote.prefill.engine,
                            %error,
                            "a rejection maps onto no P rank: P holds the export until its lease ends"
                        );
                        self.counters.rejections_unsent += 1;
                        return;
                    }
                };
                for target in targets {
                    self.send_to(&target, Message::Rejection { request: remote.request.clone() });
                }
            }
            DecodeCommand::Abort { request } => self.abort(now, &request),
            DecodeCommand::Connect { prefill } => {
                if let Err(error) =
                    self.map_prefill(&prefill.engine, &prefill.addresses, prefill.tp_size, prefill.pp_size)
                {
                    tracing::warn!(prefill = %prefill.engine, %error, "not connecting ahead: P's ranks do not map onto this engine");
                }
            }
        }
    }

    /// The TP mapping, this rank's plan and its P targets for `remote`, connecting to them;
    /// the error names both sides' values.
    fn map_remote(&mut self, remote: &RemoteRef) -> Result<(TpMapping, DecodeRankPlan, Vec<AgentName>), String> {
        self.map_prefill(
            &remote.prefill.engine,
            &remote.prefill.addresses,
            remote.prefill.tp_size,
            remote.prefill.pp_size,
        )
    }

    /// How the ranks of P engine `engine` (`tp_size` x `pp_size` of them, at `addresses` by
    /// global rank) map onto this one, and the P ranks it needs, connecting to those it is
    /// neither connected nor connecting to.
    fn map_prefill(
        &mut self,
        engine: &EngineId,
        addresses: &[PeerAddress],
        tp_size: u32,
        pp_size: u32,
    ) -> Result<(TpMapping, DecodeRankPlan, Vec<AgentName>), String> {
        let layout = self.offer.layout;
        let tp =
            TpMapping::new(tp_size, self.offer.tp_size, layout.kv_heads, layout.is_mla()).map_err(|e| e.to_string())?;
        // A D engine has one stage (the handshake refuses more), so its rank is its TP rank; P's
        // stages each hold a share of the layers, and this rank reads every stage.
        let plan = tp.decode_rank(self.offer.rank).map_err(|e| e.to_string())?.across_stages(pp_size, tp_size);
        let mut targets = Vec::new();
        for p in plan.completion_targets() {
            let address = addresses.get(p as usize).cloned().ok_or_else(|| {
                format!(
                    "P rank {p} has no address: the parameters list {} for tp {} x pp {}",
                    addresses.len(),
                    tp_size,
                    pp_size
                )
            })?;
            let agent = AgentName::new(engine.clone(), p);
            if !self.peers.contains_key(&agent) && !self.connecting.contains_key(&agent) {
                self.connecting.insert(agent.clone(), address.clone());
                self.out.connect(address);
            }
            targets.push(agent);
        }
        Ok((tp, plan, targets))
    }

    fn track(&mut self, now: Time, request: RequestId, remote: RemoteRef, prompt: Prompt) {
        let _span = request_span(&self.offer.engine, Some(self.offer.rank), &request).entered();
        tracing::debug!(prefill = %remote.prefill.engine, prefill_request = %remote.request, "load tracked: P's lease is renewed until it starts");
        if self.loads.contains_key(&request) {
            self.counters.duplicate_messages += 1;
            return;
        }
        if let Some(consumer) = remote.consumer.as_ref().filter(|c| **c != Consumer::of(&self.offer)) {
            // P bound this export to another engine incarnation at prefill (a restarted engine
            // gets the requests the router named for its old self): it may free the blocks
            // at any time for that one, so they are never safe to read here.
            tracing::warn!(%request, %consumer, "the export is bound to another engine incarnation");
            self.out.report(DecodeReport::Finished {
                request,
                outcome: LoadOutcome::Failed,
                kv_latency: None,
                kept_blocks: 0,
            });
            return;
        }
        let (tp, plan, targets) = match self.map_remote(&remote) {
            Ok(mapped) => mapped,
            Err(error) => {
                tracing::warn!(%request, %error, "P's parameters do not map onto this engine");
                self.out.report(DecodeReport::Finished {
                    request,
                    outcome: LoadOutcome::Failed,
                    kv_latency: None,
                    kept_blocks: 0,
                });
                return;
            }
        };
        // Claim it at once, so that P binds the export to this engine before anything else can,
        // and learns of this engine in time to release it if this engine goes. The claim names
        // this engine's own prompt and, in pull mode, the P blocks it will read: P holds the
        // export for it only if they are what P computed, whatever the handoff said.
        let blocks = match self.config.mode {
            Mode::Pull => remote.export.as_ref().map(|e| Digest::of_blocks(&e.blocks)),
            Mode::Push => None,
        };
        let claim = Claim { request: remote.request.clone(), prompt, blocks };
        for target in &targets {
            self.heartbeats.track(target.clone(), remote.request.clone(), now);
            self.send_to(target, Message::Claim(claim.clone()));
        }
        self.by_remote
            .entry((remote.prefill.engine.clone(), remote.request.clone()))
            .or_default()
            .insert(request.clone());
        let load = Load {
            remote,
            claim,
            since: now,
            tp,
            plan,
            targets,
            phase: Phase::Waiting,
            blocks: Vec::new(),
            cached: 0,
            deadlines: BTreeMap::new(),
            staged: BTreeSet::new(),
            reads: BTreeSet::new(),
            failed: false,
            spoiled: Vec::new(),
            blind: false,
            aborted: false,
            written: BTreeSet::new(),
            declined: BTreeSet::new(),
            watchdog: None,
            quarantine_until: None,
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

    /// A descriptor list asked for in a read is ready (or not: then reads keep using pairs).
    pub fn handle_prepared(&mut self, _now: Time, token: XferToken, result: Result<PreparedId, TransportError>) {
        self.lists.handle_prepared(token, result);
    }

    /// Gives a load up: tells P, and finishes once nothing can touch D's blocks.
    fn fail(&mut self, now: Time, request: &RequestId) {
        let Some(load) = self.loads.get_mut(request) else { return };
        load.failed = true;
        if load.phase == Phase::Reading && !load.reads.is_empty() {
            // An abort now would let P free blocks under these reads; `handle_transfer` tells
            // P once the last read has ended.
            return;
        }
        if load.phase == Phase::Cancelling {
            return;
        }
        let abort = Message::Abort { request: load.remote.request.clone() };
        let pending: Vec<AgentName> = load
            .targets
            .iter()
            .filter(|t| !load.written.contains(&t.rank) && !load.declined.contains(&t.rank))
            .cloned()
            .collect();
        let quarantine = load.phase == Phase::Registered && !pending.is_empty();
        if quarantine {
            // P may be writing into these blocks right now: they stay out of the pool until
            // every P rank says no write can come, is seen gone, or the quarantine ends.
            load.phase = Phase::Cancelling;
            load.quarantine_until = Some(now + self.config.push_quarantine);
            self.counters.quarantined += 1;
            self.out.report(DecodeReport::Quarantined { request: request.clone() });
        }
        for target in &pending {
            self.send_to(target, abort.clone());
        }
        if !quarantine {
            self.finish(now, request, false);
        }
    }

    fn abort(&mut self, now: Time, request: &RequestId) {
        let Some(load) = self.loads.get_mut(request) else { return };
        load.aborted = true;
        match load.phase {
            Phase::Reading | Phase::Cancelling => {}
            Phase::Waiting | Phase::Starting | Phase::Registered => self.fail(now, request),
        }
    }

    /// Ends the load on this rank and reports it.
    fn finish(&mut self, now: Time, request: &RequestId, ok: bool) {
        let Some(load) = self.loads.remove(request) else { return };
        for target in &load.targets {
            self.heartbeats.untrack(target, &load.remote.request);
        }
        let key = (load.remote.prefill.engine.clone(), load.remote.request.clone());
        if let Some(set) = self.by_remote.get_mut(&key) {
            set.remove(request);
            if set.is_empty() {
                self.by_remote.remove(&key);
            }
        }
        let outcome = load.outcome(ok);
        let _span = request_span(&self.offer.engine, Some(self.offer.rank), request).entered();
        tracing::debug!(?outcome, "load finished");
        if outcome == LoadOutcome::Loaded {
            // MLA: P ranks this rank did not read free when told.
            let completion = Message::Completion {
                request: load.remote.request.clone(),
                expected_consumers: load.tp.consumers_per_prefill_rank(),
            };
            if self.config.mode == Mode::Pull && !load.prefix_hit() {
                for p in &load.plan.notify_only {
                    self.send_to(&AgentName::new(load.remote.prefill.engine.clone(), *p), completion.clone());
                }
            }
        }
        let kv_latency = match outcome {
            LoadOutcome::Loaded => self.kv_latency(now, &load),
            _ => None,
        };
        let kept_blocks = match outcome {
            LoadOutcome::Loaded => load.blocks.len(),
            LoadOutcome::Failed => load.cached + self.intact_reads(&load),
            LoadOutcome::Aborted => 0,
        };
        self.out.report(DecodeReport::Finished { request: request.clone(), outcome, kv_latency, kept_blocks });
    }

    /// How long after P finished the prompt this rank came to hold its KV (`now`), across the
    /// clock offset measured at the handshake; unknown when P had not finished when the load
    /// began (push, D first) or no P rank of it is connected.
    fn kv_latency(&self, now: Time, load: &Load) -> Option<std::time::Duration> {
        let finished = load.remote.export.as_ref()?.finished?;
        let peer = load.targets.iter().find_map(|t| self.peers.get(t))?;
        Some(now.saturating_since(peer.offset.to_local(finished)))
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
                        self.prepare_lists(&agent);
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
                        self.peer_gone(now, &agent);
                    }
                }
            }
            PeerEvent::ConnectFailed { address, error } => {
                let agents: Vec<AgentName> =
                    self.connecting.iter().filter(|(_, a)| **a == address).map(|(n, _)| n.clone()).collect();
                for agent in agents {
                    self.warnings.unreachable(now, &agent, &error);
                    self.connecting.remove(&agent);
                    self.peer_gone(now, &agent);
                }
            }
            // Its loss follows, and ends what was bound to it.
            PeerEvent::CutOff { peer, reason } => self.counters.cut_off(&peer, reason),
            PeerEvent::Lost(agent) => self.peer_gone(now, &agent),
            PeerEvent::Refused { peer, cause, reason } => {
                self.warnings.refused(now, peer.as_ref(), cause, &reason);
                self.counters.refused(peer.as_ref(), cause, &reason);
            }
            PeerEvent::Notification(notification) => self.handle_notification(now, notification),
        }
    }

    /// Discovery says incarnation `instance` of P engine `engine`, and every older one, is
    /// gone (its registration lapsed). Its agents still connected are dropped, and their loss,
    /// reported by the transport, fails the loads that need them; loads from it whose P ranks
    /// are not connected fail now.
    pub fn handle_engine_lost(&mut self, now: Time, engine: &EngineId, instance: u64) {
        tracing::info!(lost = %engine, instance, "engine lost by discovery");
        for (agent, peer) in &self.peers {
            if peer.is_at_most(engine, instance) {
                self.out.disconnect(agent.clone());
            }
        }
        let unconnected: BTreeSet<AgentName> = self
            .loads
            .values()
            .filter(|l| l.remote.prefill.engine == *engine && l.remote.instance.is_none_or(|i| i <= instance))
            .flat_map(|l| l.targets.iter())
            .filter(|agent| !self.peers.contains_key(*agent))
            .cloned()
            .collect();
        for agent in unconnected {
            self.peer_gone(now, &agent);
        }
    }

    /// A P rank is gone or unreachable: loads that need it fail once nothing can touch D's blocks.
    fn peer_gone(&mut self, now: Time, agent: &AgentName) {
        if self.peers.remove(agent).is_some() {
            self.counters.peers_lost += 1;
            self.warnings.peer_lost(now, agent);
        }
        self.lists.forget(agent);
        self.queued.remove(agent);
        self.heartbeats.forget(agent);
        let affected: Vec<RequestId> =
            self.loads.iter().filter(|(_, l)| l.targets.contains(agent)).map(|(r, _)| r.clone()).collect();
        for request in affected {
            let load = self.loads.get_mut(&request).expect("exists");
            load.declined.insert(agent.rank);
            match load.phase {
                // Its reads fail through the transport; their bytes are not trusted either way.
                Phase::Reading => load.distrust(),
                // A P rank seen gone writes nothing more.
                Phase::Cancelling => self.settle_cancel(now, &request),
                Phase::Waiting | Phase::Starting | Phase::Registered => self.fail(now, &request),
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
                self.counters.ignored(Ignored::Malformed);
                return;
            }
        };
        match self.peers.get(&from) {
            None => return self.counters.ignored(Ignored::Unauthenticated),
            Some(peer) if peer.handshake.role != Role::Prefill => return self.counters.ignored(Ignored::Unknown),
            Some(_) => {}
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
            Message::Completion { request, .. } => self.on_push_answer(now, &from, &request, true),
            Message::Abort { request } => self.on_push_answer(now, &from, &request, false),
            Message::Heartbeat { .. }
            | Message::Rejection { .. }
            | Message::PushRegistration(_)
            | Message::Claim(_) => self.counters.ignored(Ignored::Unknown),
        }
    }

    /// The clock reached a wake-up (spurious wake-ups are harmless).
    pub fn handle_timeout(&mut self, now: Time) {
        while let Some((peer, ids)) = self.heartbeats.poll(now) {
            // A request this P rank has not answered `Held` yet is claimed again (the claim, or
            // its answer, may have been lost); the others are renewed.
            let mut renewals = Vec::with_capacity(ids.len());
            for id in ids {
                match self.unclaimed(&peer, &id) {
                    Some(claim) => self.send_to(&peer, Message::Claim(claim)),
                    None => renewals.push(id),
                }
            }
            // Request ids are at most 256 bytes, so 200 per frame stay under the size limit.
            for chunk in renewals.chunks(200) {
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
            tracing::info!(%request, "no push came before the registration timeout; giving the load up");
            self.fail(now, &request);
        }
        let released: Vec<RequestId> = self
            .loads
            .iter()
            .filter(|(_, l)| l.phase == Phase::Cancelling && l.quarantine_until.is_some_and(|t| now >= t))
            .map(|(r, _)| r.clone())
            .collect();
        for request in released {
            tracing::warn!(%request, "P never said that no write can come; the quarantine ends and the blocks go back");
            self.finish(now, &request, false);
        }
        let stale: Vec<RequestId> = self
            .loads
            .iter()
            .filter(|(_, l)| l.phase == Phase::Waiting && now >= l.wait_until)
            .map(|(r, _)| r.clone())
            .collect();
        for request in stale {
            tracing::info!(%request, "waited longer than decoder_kv_blocks_ttl; letting P's lease go");
            self.fail(now, &request);
        }
        // Loads waiting to start (for a handshake, or P's word that it holds the export) try
        // again: they start, or fail once the fence closes.
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
        let quarantine =
            self.loads.values().filter(|l| l.phase == Phase::Cancelling).filter_map(|l| l.quarantine_until).min();
        let stale = self.loads.values().filter(|l| l.phase == Phase::Waiting).map(|l| l.wait_until).min();
        // A load that cannot start yet is retried when its fence closes, and fails then.
        let fence = self
            .loads
            .values()
            .filter(|l| l.phase == Phase::Starting && self.config.mode == Mode::Pull)
            .filter_map(|l| self.last_safe_start(l))
            .map(|t| t + std::time::Duration::from_nanos(1))
            .min();
        [self.heartbeats.next_due(), watchdog, quarantine, stale, fence].into_iter().flatten().min()
    }
}

mod answers;
mod loads;
#[cfg(test)]
mod tests;
