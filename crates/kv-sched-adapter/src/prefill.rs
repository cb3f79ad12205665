//! P's connector: the scheduler side that exports finished requests, and the worker side,
//! one per TP rank, that keeps each export's lease and frees it exactly once.
//!
//! A worker learns of an export from its scheduler (one step later, as engines hand work to
//! their workers), grants it a lease, counts the completions of its consumer D ranks, renews
//! the lease on D's heartbeats and answers each with the new deadline, and releases the
//! export, with a reason, on the first of: the completion count, a rejection, an abort, a
//! sibling's completion, lease expiry, or the loss of the D engine it is bound to. Messages
//! about exports it does not know yet are staged and settled when the export arrives. In push
//! mode it also matches D's block registrations to exports and writes into D's blocks.
//!
//! The scheduler frees an export's blocks once every rank has released it.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use kv_core::{
    check_compatible, AgentName, BlockId, EngineId, Granularity, Handshake, Initiator, LeaseState, Message,
    Notification, PeerAddress, PeerEvent, PlanInput, PoolSide, PreparedId, PreparedTransfer, PushRegistration, Renewal,
    RequestId, Role, Time, TransferOp, TransferPlan, TransferRequest, TransportError,
};
use kv_lease::LeaseTable;

use crate::common::{
    block_indices, Action, Counters, EarlyStage, ExportInfo, LocalPool, Outbox, Peer, PreparedLists, RecentlyReleased,
    RemoteRef, XferToken,
};
use crate::config::{Config, Mode, ReleaseReason};

/// What P's scheduler tells a worker rank.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum PrefillCommand {
    /// A finished request's blocks are exported under a lease until `deadline`.
    Export {
        /// P's request id.
        request: RequestId,
        /// Its blocks, in prompt order.
        blocks: Vec<BlockId>,
        /// The lease's deadline.
        deadline: Time,
    },
}

/// What a P worker rank tells its scheduler.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum PrefillReport {
    /// The rank released the export; it will not touch its blocks again.
    Released {
        /// P's request id.
        request: RequestId,
        /// Why.
        reason: ReleaseReason,
    },
}

/// What P's scheduler asks the engine to do.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum PrefillEvent {
    /// Hand this command to worker `rank` (engines do it at their next step).
    ToWorker {
        /// The worker rank.
        rank: u32,
        /// The command.
        command: PrefillCommand,
    },
    /// Every rank released the export: its blocks may be freed (once per export).
    Free {
        /// P's request id.
        request: RequestId,
        /// The blocks the export held.
        blocks: Vec<BlockId>,
        /// The first rank's reason.
        reason: ReleaseReason,
    },
}

/// Why P's scheduler refused a call.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum PrefillError {
    /// The request is already exported.
    AlreadyExported(RequestId),
    /// An export needs blocks.
    NoBlocks(RequestId),
    /// A report named a rank outside the engine.
    NoSuchRank {
        /// The rank.
        rank: u32,
        /// The engine's TP size.
        tp: u32,
    },
}

impl std::fmt::Display for PrefillError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PrefillError::AlreadyExported(r) => write!(f, "request {r} is already exported"),
            PrefillError::NoBlocks(r) => write!(f, "request {r} has no blocks to export"),
            PrefillError::NoSuchRank { rank, tp } => write!(f, "rank {rank} is outside tp {tp}"),
        }
    }
}

impl std::error::Error for PrefillError {}

#[derive(Debug)]
struct SchedulerExport {
    blocks: Vec<BlockId>,
    released: BTreeSet<u32>,
    reason: Option<ReleaseReason>,
}

/// P's scheduler side: exports finished requests and frees their blocks when every rank is done.
#[derive(Debug)]
pub struct PrefillScheduler {
    engine: EngineId,
    instance: u64,
    tp: u32,
    addresses: Vec<PeerAddress>,
    config: Config,
    exports: BTreeMap<RequestId, SchedulerExport>,
    events: VecDeque<PrefillEvent>,
}

impl PrefillScheduler {
    /// A scheduler for incarnation `instance` of `engine` (the value its workers' handshakes
    /// carry), whose rank `r` listens at `addresses[r]`.
    pub fn new(engine: EngineId, instance: u64, addresses: Vec<PeerAddress>, config: Config) -> Self {
        let tp = addresses.len() as u32;
        PrefillScheduler { engine, instance, tp, addresses, config, exports: BTreeMap::new(), events: VecDeque::new() }
    }

    /// A request finished its prompt: export `blocks` under a lease from `now`, and return
    /// the parameters the router hands D.
    pub fn handle_finished(
        &mut self,
        now: Time,
        request: RequestId,
        blocks: Vec<BlockId>,
        prompt_tokens: u64,
    ) -> Result<RemoteRef, PrefillError> {
        if self.exports.contains_key(&request) {
            return Err(PrefillError::AlreadyExported(request));
        }
        if blocks.is_empty() {
            return Err(PrefillError::NoBlocks(request));
        }
        let deadline = now + self.config.kv_lease_duration;
        for rank in 0..self.tp {
            let command = PrefillCommand::Export { request: request.clone(), blocks: blocks.clone(), deadline };
            self.events.push_back(PrefillEvent::ToWorker { rank, command });
        }
        self.exports.insert(
            request.clone(),
            SchedulerExport { blocks: blocks.clone(), released: BTreeSet::new(), reason: None },
        );
        Ok(RemoteRef {
            engine: self.engine.clone(),
            request,
            addresses: self.addresses.clone(),
            tp_size: self.tp,
            instance: self.instance,
            prompt_tokens,
            export: Some(ExportInfo { blocks, deadline }),
        })
    }

    /// A worker rank's report.
    pub fn handle_report(&mut self, rank: u32, report: PrefillReport) -> Result<(), PrefillError> {
        if rank >= self.tp {
            return Err(PrefillError::NoSuchRank { rank, tp: self.tp });
        }
        let PrefillReport::Released { request, reason } = report;
        let Some(export) = self.exports.get_mut(&request) else {
            tracing::debug!(%request, rank, "release of an export already freed");
            return Ok(());
        };
        export.released.insert(rank);
        let reason = *export.reason.get_or_insert(reason);
        if export.released.len() as u32 == self.tp {
            let export = self.exports.remove(&request).expect("present");
            tracing::debug!(%request, %reason, "export freed");
            self.events.push_back(PrefillEvent::Free { request, blocks: export.blocks, reason });
        }
        Ok(())
    }

    /// The next thing the engine must do.
    pub fn poll_event(&mut self) -> Option<PrefillEvent> {
        self.events.pop_front()
    }

    /// Exports not yet freed.
    pub fn pending(&self) -> usize {
        self.exports.len()
    }

    /// The blocks of every export not yet freed.
    pub fn held_blocks(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.exports.values().flat_map(|e| e.blocks.iter().copied())
    }

    /// The TP size.
    pub fn tp(&self) -> u32 {
        self.tp
    }
}

#[derive(Debug)]
struct Export {
    blocks: Vec<BlockId>,
    /// The D engine that renewed it, registered for it or completed it; its loss releases it.
    bound: Option<EngineId>,
    completed: BTreeSet<AgentName>,
    /// Push mode: D ranks' registrations, the writes in flight and those done.
    registrations: BTreeMap<AgentName, PushRegistration>,
    writing: BTreeSet<AgentName>,
    written: BTreeSet<AgentName>,
    /// Push mode: the writes this rank owes, one per consumer D rank (known at the first registration).
    owed_writes: usize,
    /// A release that came while a write was reading these blocks; it happens when the write ends.
    deferred: Option<ReleaseReason>,
}

/// P's worker side for one TP rank: the lifecycle of every export on this rank.
///
/// Drive it as the crate docs describe: feed inputs through the `handle_*` methods, then drain
/// [`PrefillWorker::poll_action`] until it returns `None`, and wake it at
/// [`PrefillWorker::poll_timeout`].
#[derive(Debug)]
pub struct PrefillWorker {
    offer: Handshake,
    config: Config,
    pool: LocalPool,
    peers: BTreeMap<AgentName, Peer>,
    exports: BTreeMap<RequestId, Export>,
    leases: LeaseTable<RequestId>,
    by_base: BTreeMap<RequestId, BTreeSet<RequestId>>,
    siblings: BTreeMap<RequestId, BTreeSet<RequestId>>,
    /// Parents whose sibling completed, until when late siblings are still released.
    pulled: BTreeMap<RequestId, Time>,
    early: EarlyStage,
    recent: RecentlyReleased,
    writes: BTreeMap<XferToken, (RequestId, AgentName)>,
    /// Push: this rank's pool, prepared once, and each D rank's, prepared at its first write.
    lists: PreparedLists,
    out: Outbox<PrefillReport>,
    counters: Counters,
}

impl PrefillWorker {
    /// The worker of the rank that `offer` describes (its agent's handshake), over `pool`.
    pub fn new(offer: Handshake, config: Config, pool: LocalPool) -> Self {
        PrefillWorker {
            early: EarlyStage::new(config.early_notification_capacity),
            offer,
            config,
            pool,
            peers: BTreeMap::new(),
            exports: BTreeMap::new(),
            leases: LeaseTable::new(),
            by_base: BTreeMap::new(),
            siblings: BTreeMap::new(),
            pulled: BTreeMap::new(),
            recent: RecentlyReleased::default(),
            writes: BTreeMap::new(),
            lists: PreparedLists::default(),
            out: Outbox::default(),
            counters: Counters::default(),
        }
    }

    /// How long an early message waits for its export. A push registration may come long
    /// before P runs the prompt; D's watchdog gives up on it after the registration timeout.
    fn stage_lifetime(&self) -> std::time::Duration {
        match self.config.mode {
            Mode::Pull => self.config.kv_lease_duration,
            Mode::Push => self.config.kv_lease_duration.max(self.config.push_registration_timeout),
        }
    }

    fn rank(&self) -> u32 {
        self.offer.rank
    }

    /// What this rank counted.
    pub fn counters(&self) -> Counters {
        self.counters
    }

    /// Exports this rank holds.
    pub fn held(&self) -> usize {
        self.exports.len()
    }

    /// A command from the scheduler.
    pub fn handle_command(&mut self, now: Time, command: PrefillCommand) {
        let PrefillCommand::Export { request, blocks, deadline } = command;
        if self.exports.contains_key(&request) || self.recent.contains(&request) {
            self.counters.duplicate_messages += 1;
            return;
        }
        let export = Export {
            blocks,
            bound: None,
            completed: BTreeSet::new(),
            registrations: BTreeMap::new(),
            writing: BTreeSet::new(),
            written: BTreeSet::new(),
            owed_writes: 0,
            deferred: None,
        };
        self.exports.insert(request.clone(), export);
        self.leases.grant(request.clone(), deadline).expect("a new export has no lease");
        self.by_base.entry(request.base()).or_default().insert(request.clone());
        let parent = request.parent();
        if let Some(parent) = &parent {
            self.siblings.entry(parent.clone()).or_default().insert(request.clone());
        }
        // Everything staged for it, in arrival order; in push mode, registrations may name it by base id.
        let push = self.config.mode == Mode::Push;
        let base = request.base();
        let staged = self.early.take(|r| *r == request || (push && r.base() == base), |_, _| true);
        if parent.as_ref().is_some_and(|p| self.pulled.get(p).is_some_and(|&until| now < until)) {
            // A late sibling of a parent already pulled.
            self.release(now, &request, ReleaseReason::Sibling);
        }
        for (from, message) in staged {
            self.on_message(now, from, message);
        }
    }

    /// A peer event from the transport.
    pub fn handle_peer_event(&mut self, now: Time, event: PeerEvent) {
        match event {
            PeerEvent::Connected(info) => {
                if self.peers.contains_key(&info.agent) {
                    // A second handshake under the same name is a new incarnation: the old one
                    // is gone, and whatever it registered or sent must not reach the new one.
                    self.peer_gone(now, &info.agent);
                }
                match check_compatible(&self.offer, &info.handshake) {
                    Ok(compat) => {
                        self.peers.insert(info.agent.clone(), Peer::new(&info, compat));
                    }
                    Err(err) => {
                        tracing::warn!(peer = %info.agent, %err, "incompatible peer ignored");
                        self.counters.ignored_messages += 1;
                    }
                }
            }
            PeerEvent::ConnectFailed { .. } => {}
            PeerEvent::Refused { peer, error } => tracing::warn!(%peer, %error, "refused a handshake"),
            PeerEvent::Lost(agent) => self.peer_gone(now, &agent),
            PeerEvent::Notification(notification) => self.handle_notification(now, notification),
        }
    }

    /// A D agent is gone: exports bound to its engine are released, its staged messages dropped.
    fn peer_gone(&mut self, now: Time, agent: &AgentName) {
        self.peers.remove(agent);
        self.lists.forget(agent);
        self.counters.late_messages += self.early.take(|_| true, |from, _| from == agent).len() as u64;
        let bound: Vec<RequestId> = self
            .exports
            .iter()
            .filter(|(_, e)| e.bound.as_ref() == Some(&agent.engine))
            .map(|(r, _)| r.clone())
            .collect();
        for request in bound {
            self.release(now, &request, ReleaseReason::PeerLost);
        }
    }

    /// A notification from the transport.
    pub fn handle_notification(&mut self, now: Time, notification: Notification) {
        match Message::decode(&notification.payload) {
            Ok(message) => self.on_message(now, notification.from, message),
            Err(err) => {
                tracing::debug!(from = %notification.from, %err, "malformed notification");
                self.counters.ignored_messages += 1;
            }
        }
    }

    /// A transfer this worker posted ended.
    pub fn handle_transfer(&mut self, now: Time, token: XferToken, ok: bool) {
        let Some((request, to)) = self.writes.remove(&token) else { return };
        let Some(export) = self.exports.get_mut(&request) else { return };
        export.writing.remove(&to);
        if ok {
            export.written.insert(to);
        } else {
            // The write is never reported done. Tell D, which gives the load up and aborts.
            self.counters.transfers_failed += 1;
            if let Some(reg) = export.registrations.remove(&to) {
                self.out.send(&to, &Message::Abort { request: reg.request });
            }
        }
        self.settle_push(now, &request);
    }

    /// A descriptor list asked for in a write is ready (or not: then writes keep using pairs).
    pub fn handle_prepared(&mut self, _now: Time, token: XferToken, result: Result<PreparedId, TransportError>) {
        self.lists.handle_prepared(token, result);
    }

    /// The clock reached a wake-up (spurious wake-ups are harmless).
    pub fn handle_timeout(&mut self, now: Time) {
        while let Some((request, _)) = self.leases.poll_expired(now) {
            self.release(now, &request, ReleaseReason::Expired);
        }
        self.counters.early_evicted += self.early.expire(now.saturating_sub(self.stage_lifetime()));
        self.recent.expire(now.saturating_sub(self.config.kv_lease_duration * 2));
        self.pulled.retain(|_, until| now < *until);
    }

    /// The next action for the driver.
    pub fn poll_action(&mut self) -> Option<Action<PrefillReport>> {
        self.out.pop()
    }

    /// When to call [`PrefillWorker::handle_timeout`] next.
    pub fn poll_timeout(&mut self) -> Option<Time> {
        let staged = self.early.oldest().map(|t| t + self.stage_lifetime());
        [self.leases.next_expiry(), staged].into_iter().flatten().min()
    }

    fn on_message(&mut self, now: Time, from: AgentName, message: Message) {
        let Some(peer) = self.peers.get(&from) else {
            tracing::debug!(%from, "message from a peer without a handshake");
            self.counters.ignored_messages += 1;
            return;
        };
        if peer.handshake.role != Role::Decode
            || !peer.compat.tp.consumers_of_prefill_rank(self.rank()).is_ok_and(|c| c.contains(&from.rank))
        {
            self.counters.ignored_messages += 1;
            return;
        }
        match message {
            Message::Completion { request, .. } => self.on_completion(now, from, request),
            Message::Heartbeat { requests } => self.on_heartbeat(now, from, requests),
            Message::Rejection { request } => self.on_ended(now, from, request, ReleaseReason::Rejected),
            Message::Abort { request } => self.on_ended(now, from, request, ReleaseReason::Aborted),
            Message::PushRegistration(reg) => self.on_registration(now, from, reg),
            Message::HeartbeatAck { .. } => self.counters.ignored_messages += 1,
        }
    }

    /// The export a D message names: exactly, or in push mode by base id when that is unambiguous.
    fn resolve(&self, request: &RequestId) -> Option<RequestId> {
        if self.exports.contains_key(request) {
            return Some(request.clone());
        }
        if self.config.mode != Mode::Push {
            return None;
        }
        let candidates = self.by_base.get(&request.base())?;
        (candidates.len() == 1).then(|| candidates.first().expect("one").clone())
    }

    fn stage(&mut self, now: Time, from: AgentName, request: RequestId, message: Message) {
        self.counters.early_staged += 1;
        self.counters.early_evicted += self.early.push(now, from, request, message);
    }

    fn on_completion(&mut self, now: Time, from: AgentName, request: RequestId) {
        let Some(id) = self.resolve(&request) else {
            if self.recent.contains(&request) {
                self.counters.notifications_after_expiry += 1;
            } else {
                self.stage(now, from.clone(), request.clone(), Message::Completion { request, expected_consumers: 0 });
            }
            return;
        };
        let expected = self.peers[&from].compat.tp.consumers_per_prefill_rank() as usize;
        let export = self.exports.get_mut(&id).expect("resolved");
        export.bound = Some(from.engine.clone());
        if !export.completed.insert(from) {
            self.counters.duplicate_messages += 1;
            return;
        }
        if export.completed.len() >= expected {
            self.release(now, &id, ReleaseReason::Transferred);
        }
    }

    fn on_ended(&mut self, now: Time, from: AgentName, request: RequestId, reason: ReleaseReason) {
        if let Some(id) = self.resolve(&request) {
            self.release(now, &id, reason);
            return;
        }
        if self.recent.contains(&request) {
            self.counters.late_messages += 1;
            return;
        }
        // Push: D gave up a registration P had staged; P will never write, and says so.
        let base = request.base();
        let registrations = self.early.take(
            |r| *r == request || r.base() == base,
            |agent, message| *agent == from && matches!(message, Message::PushRegistration(_)),
        );
        for (_, message) in &registrations {
            if let Message::PushRegistration(reg) = message {
                self.out.send(&from, &Message::Abort { request: reg.request.clone() });
            }
        }
        // Staged too, so that the export, when P finishes it, is released at once.
        let message = match reason {
            ReleaseReason::Rejected => Message::Rejection { request: request.clone() },
            _ => Message::Abort { request: request.clone() },
        };
        self.stage(now, from, request, message);
    }

    fn on_heartbeat(&mut self, now: Time, from: AgentName, requests: Vec<RequestId>) {
        let extension = self.config.lease_extension;
        let renewals: Vec<Renewal> = requests
            .into_iter()
            .map(|request| {
                let lease = match self.resolve(&request) {
                    Some(id) => match self.leases.renew(&id, now, extension) {
                        Some(deadline) => {
                            // Bound: only this engine's own messages, its loss or expiry end it now.
                            self.exports.get_mut(&id).expect("leased exports exist").bound = Some(from.engine.clone());
                            LeaseState::Held(deadline)
                        }
                        // Expired and about to be reaped, or released while a write finishes.
                        None => LeaseState::Released,
                    },
                    None if self.recent.contains(&request) => LeaseState::Released,
                    None => LeaseState::Unknown,
                };
                Renewal { request, lease }
            })
            .collect();
        self.out.send_split(&from, &renewals, |renewals| Message::HeartbeatAck { renewals });
    }

    fn on_registration(&mut self, now: Time, from: AgentName, reg: PushRegistration) {
        if self.config.mode != Mode::Push || reg.decode_engine != from.engine || reg.decode_rank != from.rank {
            self.counters.ignored_messages += 1;
            return;
        }
        let Some(id) = self.resolve(&reg.request) else {
            if self.recent.contains(&reg.request) || self.recent.contains(&reg.request.base()) {
                self.counters.late_messages += 1;
                self.out.send(&from, &Message::Abort { request: reg.request });
            } else {
                let request = reg.request.clone();
                self.stage(now, from, request, Message::PushRegistration(reg));
            }
            return;
        };
        let export = self.exports.get_mut(&id).expect("resolved");
        if export.registrations.contains_key(&from) {
            self.counters.duplicate_messages += 1;
            return;
        }
        export.bound = Some(from.engine.clone());
        export.registrations.insert(from.clone(), reg);
        if export.owed_writes == 0 {
            let consumers = self.peers[&from].compat.tp.consumers_of_prefill_rank(self.offer.rank);
            export.owed_writes = consumers.map_or(1, |c| c.len());
        }
        self.write(&id, &from);
        self.settle_push(now, &id);
    }

    /// Posts the write of export `id` into the blocks D rank `to` registered.
    fn write(&mut self, id: &RequestId, to: &AgentName) {
        let peer = &self.peers[to];
        let tp = peer.compat.tp;
        let Ok(plan_d) = tp.decode_rank(to.rank) else { return };
        let export = self.exports.get_mut(id).expect("exists");
        let reg = export.registrations[to].clone();
        let completion = Message::Completion {
            request: reg.request.clone(),
            expected_consumers: plan_d.completion_targets().count() as u32,
        };
        if plan_d.notify_only.contains(&self.offer.rank) {
            // MLA: D reads the latent from another rank; this one only says it is done.
            self.out.send(to, &completion);
            export.written.insert(to.clone());
            return;
        }
        let Some(slice) = plan_d.reads.iter().find(|s| s.prefill_rank == self.offer.rank).copied() else { return };
        let d_shape = peer.shape(tp.decode_heads());
        let built = d_shape.ok_or_else(|| "peer layout".to_owned()).and_then(|d_shape| {
            let input = PlanInput {
                prefill: PoolSide { shape: self.pool.shape, regions: &self.pool.regions, blocks: &export.blocks },
                decode: PoolSide { shape: d_shape, regions: &peer.handshake.regions, blocks: &reg.blocks },
                slice,
                initiator: Initiator::Prefill,
            };
            // The plan also checks every block against both pools, whichever way is posted.
            TransferPlan::build(&input, Granularity::Merged).map_err(|e| e.to_string())
        });
        match (built, completion.encode()) {
            (Ok(plan), Ok(notification)) => {
                let d_shape = d_shape.expect("the plan was built from it");
                // Whole blocks, whole heads, equal block sizes: name prepared entries by index.
                let whole = slice.heads == self.pool.shape.heads && slice.heads == d_shape.heads;
                let indexed = whole && d_shape.layout.block_tokens == self.pool.shape.layout.block_tokens;
                let token = match self.lists.ready(to).filter(|_| indexed) {
                    Some((local, remote)) => {
                        let (local_indices, remote_indices) =
                            block_indices(&self.pool.shape, &export.blocks, &d_shape, &reg.blocks);
                        self.counters.prepared_writes += 1;
                        self.out.post_prepared(PreparedTransfer {
                            op: TransferOp::Write,
                            peer: to.clone(),
                            local,
                            local_indices,
                            remote,
                            remote_indices,
                            notification: Some(notification),
                        })
                    }
                    None => {
                        if indexed {
                            // Prepared once, at the first write to this peer; this one goes as pairs.
                            let regions = peer.handshake.regions.clone();
                            self.lists.want(&mut self.out, &self.pool, to, &d_shape, &regions);
                        }
                        let request = TransferRequest {
                            op: TransferOp::Write,
                            peer: to.clone(),
                            pairs: plan.pairs().to_vec(),
                            notification: Some(notification),
                        };
                        self.out.post(request)
                    }
                };
                export.writing.insert(to.clone());
                self.writes.insert(token, (id.clone(), to.clone()));
            }
            (Err(err), _) => {
                tracing::warn!(request = %id, peer = %to, %err, "cannot write into the registered blocks");
                export.registrations.remove(to);
                self.counters.ignored_messages += 1;
                self.out.send(to, &Message::Abort { request: reg.request });
            }
            (_, Err(err)) => tracing::warn!(request = %id, %err, "completion does not encode"),
        }
    }

    /// Push: releases the export when every consumer's write is done, or, once no write is
    /// in flight, for a reason that came while one was.
    fn settle_push(&mut self, now: Time, id: &RequestId) {
        let Some(export) = self.exports.get(id) else { return };
        if !export.writing.is_empty() {
            return;
        }
        if export.owed_writes > 0 && export.written.len() >= export.owed_writes {
            self.release(now, id, ReleaseReason::Transferred);
        } else if let Some(reason) = export.deferred {
            self.release(now, id, reason);
        }
    }

    /// Releases export `id` for `reason`: exactly once, with sibling release on a transfer.
    fn release(&mut self, now: Time, id: &RequestId, reason: ReleaseReason) {
        let Some(export) = self.exports.get(id) else { return };
        if !export.writing.is_empty() {
            // A write is reading the blocks; it ends (done or failed) before they can go.
            self.exports.get_mut(id).expect("exists").deferred.get_or_insert(reason);
            return;
        }
        let export = self.exports.remove(id).expect("exists");
        self.leases.release(id);
        if let Some(set) = self.by_base.get_mut(&id.base()) {
            set.remove(id);
            if set.is_empty() {
                self.by_base.remove(&id.base());
            }
        }
        self.recent.insert(id.clone(), now);
        // Push: D ranks that registered and got no write learn that none will come.
        for (agent, reg) in &export.registrations {
            if !export.written.contains(agent) && self.peers.contains_key(agent) {
                self.out.send(agent, &Message::Abort { request: reg.request.clone() });
            }
        }
        tracing::debug!(request = %id, %reason, rank = self.offer.rank, "export released");
        self.out.report(PrefillReport::Released { request: id.clone(), reason });
        let Some(parent) = id.parent() else { return };
        if let Some(set) = self.siblings.get_mut(&parent) {
            set.remove(id);
            if set.is_empty() {
                self.siblings.remove(&parent);
            }
        }
        if reason == ReleaseReason::Transferred {
            self.pulled.insert(parent.clone(), now + self.config.kv_lease_duration);
            // Siblings nobody claimed are stranded: release them. A sibling a D engine has
            // renewed or registered for may be under a read right now; that engine ends it.
            let others: Vec<RequestId> = self
                .siblings
                .get(&parent)
                .into_iter()
                .flatten()
                .filter(|s| self.exports.get(*s).is_some_and(|e| e.bound.is_none()))
                .cloned()
                .collect();
            for sibling in others {
                self.release(now, &sibling, ReleaseReason::Sibling);
            }
        }
    }
}
