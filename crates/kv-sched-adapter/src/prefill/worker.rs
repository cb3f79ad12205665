//! P's worker side, one per TP rank: the lifecycle of every export on the rank.
//!
//! A worker learns of an export from its scheduler (one step later, as engines hand work to
//! their workers), grants it a lease, and releases it exactly once, with a reason, on the first
//! of: its owner's completions, rejection or abort; a sibling's completion; lease expiry; or
//! the loss of its owner. In push mode it also matches D's block registrations to exports and
//! writes into D's blocks.
//!
//! Every export is bound to one D engine incarnation, its owner: the consumer the router named
//! at prefill, else the first handshaked engine to claim it (renew, complete, reject, abort or
//! register a push for it). The siblings of one prompt share one owner. Renewals, completions,
//! aborts, rejections and registrations from any other engine are counted as foreign and
//! change nothing. When the owner is seen gone (its side channel closed, or a newer incarnation
//! handshook), its exports are released at once, as `peer_lost`; an export named for an
//! incarnation already gone is released as soon as it registers. A gone incarnation never
//! comes back: its handshake is dropped (the connection closed), so that one that goes on
//! anyway (its discovery registration lapsed while it ran) fails its loads rather than read
//! what was released for it.
//!
//! Push mode with a chunked prefill: while P still computes a request, the blocks it has
//! finished ([`PrefillCommand::Progress`]) are written ahead, without a notification, into the
//! blocks its owner-to-be registered (the consumer the router named, else the engine of the
//! first claim staged for it). The last write, at the export, moves the rest and carries the
//! completion, and is posted only once the writes ahead into that D rank have completed (a
//! completed NIXL write has been flushed to its target), so the completion never overtakes
//! their bytes. Nothing tells D "no write will come" (an abort, a cancel's answer) while a
//! write into its blocks is in flight, before or after the export. A request the engine gives
//! up while computing ([`PrefillCommand::Abandon`]) is released, as `aborted`, once its writes
//! ahead have ended.
//!
//! Messages about an export the worker does not know yet (a completion, a renewal, a push
//! registration) are staged, bounded, and settled when it registers, in arrival order: a staged
//! renewal claims the export then. Staged messages of an engine since gone are settled too (what
//! it said before it went still counts) and then bind the export to the gone incarnation, which
//! releases it, unless a live engine has claimed it as well.
//!
//! This file keeps the exports' books and leases; `messages.rs` what D's ranks say (claims,
//! completions, ends, heartbeats) and the answers; `owners.rs` who owns each export and the
//! release of what a lost owner held; `push.rs` push mode's writes and their endings.

use std::collections::{BTreeMap, BTreeSet};

use kv_core::{
    check_compatible, AgentName, BlockId, Claim, Descriptors, Digest, EngineId, Granularity, Handshake, Initiator,
    LeaseState, Message, Notification, PeerEvent, PlanInput, PoolSide, PreparedId, PreparedTransfer, Prompt,
    PushRegistration, RefusalCause, Renewal, RequestId, Role, Time, TransferOp, TransferPlan, TransferRequest,
    TransportError,
};
use kv_lease::LeaseTable;

use super::book::{EarlyStage, GoneIncarnations, Recent, RECENT_RELEASES};
use super::scheduler::{LayerProgress, PrefillCommand, PrefillReport};
use crate::common::{
    block_indices, by_index, request_span, Action, Consumer, Counters, Ignored, LocalPool, Outbox, Peer, PreparedLists,
    XferToken,
};
use crate::config::{Config, ConfigError, Mode, ReleaseReason};
use ahead::Ahead;

/// At most this many parents whose sibling was transferred are remembered (seed 002's bound),
/// each for one lease; a sibling that registers later than that is held by its own lease.
const PULLED_PARENTS: usize = 8192;
/// At most this many D engines' gone incarnations are remembered.
const GONE_ENGINES: usize = 4096;
/// At most this many "no write will come" answers are held for one D rank while P's writes
/// into it for one request are in flight; past that, D's quarantine ends the wait.
const HELD_ANSWERS: usize = 8;

/// Who sent a message about an export, as its handshake fixed it.
#[derive(Clone, Debug)]
struct Claimant {
    agent: AgentName,
    consumer: Consumer,
    /// Completions this rank waits for in all, by that engine's TP mapping.
    expected: usize,
    /// Push: the writes this rank owes that engine, one per D rank it serves.
    owed: usize,
}

impl Claimant {
    fn of(agent: &AgentName, peer: &Peer, rank: u32) -> Self {
        Claimant {
            agent: agent.clone(),
            consumer: peer.consumer(),
            expected: peer.compat.tp.consumers_per_prefill_rank() as usize,
            owed: peer.compat.tp.consumers_of_prefill_rank(rank).map_or(1, |c| c.len()),
        }
    }
}

/// A message that came before its export, with who sent it.
#[derive(Debug)]
struct Early {
    from: Claimant,
    message: Message,
}

/// The exports of one prompt (one, or its parallel-sampling siblings) and their one owner.
#[derive(Debug)]
struct Family {
    owner: Option<Consumer>,
    members: BTreeSet<RequestId>,
    /// When its first export registered on this rank.
    since: Time,
    /// Its stranded block-time is counted up to here.
    accounted: Time,
}

impl Family {
    fn new(now: Time) -> Self {
        Family { owner: None, members: BTreeSet::new(), since: now, accounted: now }
    }
}

#[derive(Debug)]
struct Export {
    blocks: Vec<BlockId>,
    /// Push: the transfer id that names it too.
    transfer: Option<RequestId>,
    /// The prompt it was computed for: claims and registrations must name it.
    prompt: Prompt,
    /// The family it belongs to: its parent's id for a sibling, else its own.
    family: RequestId,
    /// Its owner claimed this very export: a sibling's completion does not release it, since
    /// the owner may be reading it.
    claimed: bool,
    /// Consumer ranks done with the blocks: completed, or (pull) aborted.
    completed: BTreeSet<AgentName>,
    /// Pull: a consumer rank aborted. The release waits until every consumer rank is done, as
    /// for completions: the owner's other ranks may still be reading the blocks.
    aborted: bool,
    /// Push mode: D ranks' registrations, the writes in flight (by D rank, with those
    /// written ahead) and the D ranks whose last write is done.
    registrations: BTreeMap<AgentName, PushRegistration>,
    writing: BTreeMap<AgentName, usize>,
    written: BTreeSet<AgentName>,
    /// Push mode: D blocks of each D rank's registration written ahead while P computed, and
    /// the D ranks whose write ahead failed (they get an abort, never the completion).
    ahead: BTreeMap<AgentName, Ahead>,
    ahead_failed: BTreeSet<AgentName>,
    /// Push mode: the writes this rank owes, one per consumer D rank (known at the first registration).
    owed_writes: usize,
    /// A release that came while a write was reading these blocks; it happens when the write ends.
    deferred: Option<ReleaseReason>,
    /// Push mode: D ranks that asked to cancel, with the id they named; each is told when no
    /// write can come any more.
    cancels: BTreeMap<AgentName, RequestId>,
}

/// An export as the scheduler's command gives it.
struct Exported {
    blocks: Vec<BlockId>,
    deadline: Time,
    consumer: Option<Consumer>,
    prompt: Prompt,
    transfer: Option<RequestId>,
}

/// Push: a request P still computes, whose finished blocks it writes ahead.
#[derive(Debug)]
struct Computing {
    /// The blocks computed so far, in prompt order: the first `whole` in every layer, the
    /// rest (a chunk computed layer by layer) in model layers `0..layers`.
    blocks: Vec<BlockId>,
    whole: usize,
    layers: u32,
    /// The D engine the router named, if any: the only one written ahead to.
    consumer: Option<Consumer>,
    /// D blocks of each D rank's registration written (or being written) so far.
    ahead: BTreeMap<AgentName, Ahead>,
    /// Writes in flight, by D rank.
    writing: BTreeMap<AgentName, usize>,
    /// D ranks written ahead to no more: a write failed, or D cancelled.
    stopped: BTreeSet<AgentName>,
    /// The engine gave the request up: released once no write is in flight.
    abandoned: bool,
    /// The transfer id that names it too.
    transfer: Option<RequestId>,
}

/// A write this rank posted.
#[derive(Debug)]
struct Write {
    /// P's request id.
    request: RequestId,
    /// The D rank written to.
    to: AgentName,
    /// The write that carries the completion (not one ahead of it).
    last: bool,
}

/// The sizes of a P rank's tables; each but `exports` (bounded by the pool) has a fixed bound.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct PrefillBook {
    /// Exports held.
    pub exports: usize,
    /// Push: requests still computing with blocks written ahead (bounded by the pool).
    pub computing: usize,
    /// Push: "no write will come" answers held while writes into their D rank are in flight
    /// (at most 8 for each D rank and request written to).
    pub held_answers: usize,
    /// Messages staged before their export (at most `early_notification_capacity`).
    pub staged: usize,
    /// Released ids remembered to tell late messages from early ones (at most 65 536, two leases each).
    pub recent: usize,
    /// Parents whose sibling was transferred (at most 8192, one lease each).
    pub pulled: usize,
    /// D engines whose gone incarnations are remembered (at most 4096).
    pub gone_engines: usize,
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
    /// Push: the request each transfer id names (one per export or computing request).
    transfers: BTreeMap<RequestId, RequestId>,
    families: BTreeMap<RequestId, Family>,
    /// Parents whose sibling was transferred: a sibling that registers later is released at once.
    pulled: Recent,
    /// Push: cancels P answered before it knew the export, by D rank and base id: a
    /// registration that comes later for one of them gets no write, only the answer again.
    cancelled: Recent<(AgentName, RequestId)>,
    gone: GoneIncarnations,
    early: EarlyStage<Early>,
    recent: Recent,
    writes: BTreeMap<XferToken, Write>,
    /// Push: requests still computing, whose finished blocks are written ahead.
    computing: BTreeMap<RequestId, Computing>,
    /// Push: "no write will come" answers held until the writes of a request (P's id) into
    /// a D rank have ended, with who gets each: one entry per write in flight, at most
    /// [`HELD_ANSWERS`] distinct answers in each.
    held_answers: BTreeMap<(RequestId, AgentName), Vec<(Claimant, RequestId)>>,
    /// Push: this rank's pool, prepared once, and each D rank's, prepared at its first write.
    lists: PreparedLists,
    /// How transfers of whole blocks name their bytes: the configuration's choice, else the
    /// transport's ([`WorkerDriver`](crate::driver::WorkerDriver) tells it).
    descriptors: Descriptors,
    out: Outbox<PrefillReport>,
    counters: Counters,
    /// The WARNING lines this rank logs, rate-limited.
    warnings: crate::warnings::Warnings,
    /// When each D engine incarnation connected to this rank was last heard from (for the
    /// stranded block-time; an entry goes with the incarnation's agents).
    heard: BTreeMap<Consumer, Time>,
    /// Stranded block-time, in block-nanoseconds.
    stranded_block_ns: u128,
    /// When every family's stranded block-time is next brought up to date.
    next_accrual: Time,
}

impl PrefillWorker {
    /// The worker of the rank that `offer` describes (its agent's handshake), over `pool`;
    /// fails on settings that cannot work ([`Config::validate`]) or an offer that does not
    /// describe `pool` ([`LocalPool::offer`] builds one that does).
    pub fn new(offer: Handshake, config: Config, pool: LocalPool) -> Result<Self, ConfigError> {
        config.validate()?;
        pool.check_offer(&offer, Role::Prefill)?;
        let warnings = crate::warnings::Warnings::new(AgentName::new(offer.engine.clone(), offer.rank));
        Ok(PrefillWorker {
            early: EarlyStage::new(config.early_notification_capacity),
            offer,
            config,
            pool,
            peers: BTreeMap::new(),
            exports: BTreeMap::new(),
            leases: LeaseTable::new(),
            by_base: BTreeMap::new(),
            transfers: BTreeMap::new(),
            families: BTreeMap::new(),
            pulled: Recent::new(PULLED_PARENTS),
            cancelled: Recent::new(config.early_notification_capacity),
            gone: GoneIncarnations::new(GONE_ENGINES),
            recent: Recent::new(RECENT_RELEASES),
            writes: BTreeMap::new(),
            computing: BTreeMap::new(),
            held_answers: BTreeMap::new(),
            lists: PreparedLists::default(),
            descriptors: config.descriptors.unwrap_or(Descriptors::Prepared),
            out: Outbox::default(),
            counters: Counters::default(),
            warnings,
            heard: BTreeMap::new(),
            stranded_block_ns: 0,
            next_accrual: Time::ZERO,
        })
    }

    /// How long an early message waits for its export. A push registration may come long
    /// before P runs the prompt; D's watchdog gives up on it after the registration timeout.
    fn stage_lifetime(&self) -> std::time::Duration {
        match self.config.mode {
            Mode::Pull => self.config.kv_lease_duration,
            Mode::Push => self.config.kv_lease_duration.max(self.config.push_registration_timeout),
        }
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

    /// D ranks connected to this rank (handshake completed).
    pub fn connected_peers(&self) -> usize {
        self.peers.len()
    }

    /// The heartbeat interval it was configured with: its driver sends a notification the
    /// transport refused again for no longer than this.
    pub fn heartbeat_interval(&self) -> std::time::Duration {
        self.config.heartbeat_interval
    }

    /// Exports this rank holds.
    pub fn held(&self) -> usize {
        self.exports.len()
    }

    /// Whether a peer's notification may change something now: a completion, renewal,
    /// rejection, abort or push registration for an export this rank holds.
    pub fn awaits_peers(&self) -> bool {
        !self.exports.is_empty() || !self.computing.is_empty()
    }

    /// The handshake offer this rank makes (its engine, incarnation and pool).
    pub fn offer(&self) -> &Handshake {
        &self.offer
    }

    /// How much this rank keeps in its bounded tables, for metrics and bound checks.
    pub fn book(&self) -> PrefillBook {
        PrefillBook {
            exports: self.exports.len(),
            computing: self.computing.len(),
            held_answers: self.held_answers.values().map(Vec::len).sum(),
            staged: self.early.len(),
            recent: self.recent.len(),
            pulled: self.pulled.len(),
            gone_engines: self.gone.len(),
        }
    }

    /// Every export this rank holds that is bound to an owner, with the owner.
    pub fn bound(&self) -> impl Iterator<Item = (&RequestId, &Consumer)> + '_ {
        self.exports.keys().filter_map(|id| Some((id, self.owner(id)?)))
    }

    /// The D engine incarnation an export this rank holds is bound to, if any yet.
    pub fn owner(&self, request: &RequestId) -> Option<&Consumer> {
        let export = self.exports.get(request)?;
        self.families.get(&export.family)?.owner.as_ref()
    }

    /// Forgets what is remembered for a time only: staged messages past their lifetime, ids
    /// released more than two leases ago, parents pulled more than a lease ago, cancels past
    /// the stage's lifetime. Run on every wake-up and before a registration, so a worker that
    /// slept through the horizon (nothing else to wake it) does not act on stale memory.
    fn forget_old(&mut self, now: Time) {
        self.counters.early_evicted += self.early.expire(now.saturating_sub(self.stage_lifetime()));
        self.recent.expire(now.saturating_sub(self.config.kv_lease_duration * 2));
        self.pulled.expire(now.saturating_sub(self.config.kv_lease_duration));
        self.cancelled.expire(now.saturating_sub(self.stage_lifetime()));
    }

    /// Push: `request` is named by `transfer` too (NixlPushConnector's `transfer_id`): D's
    /// messages that named it by that id, staged before it was known, are filed under it.
    /// Returns the transfer id taken: none when another request has it.
    fn pair(&mut self, request: &RequestId, transfer: Option<RequestId>) -> Option<RequestId> {
        let transfer = transfer.filter(|_| self.config.mode == Mode::Push)?;
        match self.transfers.get(&transfer) {
            Some(id) if id == request => return Some(transfer),
            Some(id) => {
                tracing::warn!(%request, %transfer, other = %id, "transfer id already names another request; not paired");
                return None;
            }
            None => {}
        }
        self.transfers.insert(transfer.clone(), request.clone());
        self.early.rename(&transfer, request);
        Some(transfer)
    }

    /// Request `id`, named by `transfer` too if paired, is released: later messages naming
    /// either are late, and the transfer id names nothing any more.
    fn remember_released(&mut self, now: Time, id: &RequestId, transfer: Option<RequestId>) {
        self.recent.insert(id.clone(), now);
        if let Some(transfer) = transfer {
            self.transfers.remove(&transfer);
            self.recent.insert(transfer, now);
        }
    }

    /// A command from the scheduler.
    pub fn handle_command(&mut self, now: Time, command: PrefillCommand) {
        self.reap_expired(now);
        self.forget_old(now);
        match command {
            PrefillCommand::Export { request, blocks, deadline, consumer, prompt, transfer } => {
                self.on_export(now, request, Exported { blocks, deadline, consumer, prompt, transfer })
            }
            PrefillCommand::Progress { request, blocks, consumer, part, transfer } => {
                self.on_progress(request, blocks, part, consumer, transfer)
            }
            PrefillCommand::Abandon { request } => self.on_abandon(now, request),
        }
    }

    fn on_export(&mut self, now: Time, request: RequestId, exported: Exported) {
        let Exported { blocks, deadline, consumer, prompt, transfer } = exported;
        let _span = request_span(&self.offer.engine, Some(self.offer.rank), &request).entered();
        tracing::debug!(blocks = blocks.len(), deadline_ns = deadline.as_nanos(), consumer = ?consumer, "export registered");
        if self.exports.contains_key(&request) {
            self.counters.duplicate_messages += 1;
            return;
        }
        if self.recent.contains(&request) {
            // The id named an export this rank released: late messages for that one would be
            // taken as this one's, so it is refused, and released at once rather than left to
            // strand in the scheduler (which refuses such ids itself while it remembers them).
            self.counters.duplicate_messages += 1;
            tracing::warn!("export under an id released before; released at once");
            self.out.report(PrefillReport::Released { request, reason: ReleaseReason::Aborted });
            return;
        }
        let transfer = self.pair(&request, transfer);
        let family_id = request.parent().unwrap_or_else(|| request.clone());
        // What was written ahead while it computed, and the writes still in flight, go with it.
        let (writing, ahead, ahead_failed) =
            self.computing.remove(&request).map(|c| (c.writing, c.ahead, c.stopped)).unwrap_or_default();
        let export = Export {
            blocks,
            transfer,
            prompt,
            family: family_id.clone(),
            claimed: false,
            completed: BTreeSet::new(),
            aborted: false,
            registrations: BTreeMap::new(),
            writing,
            written: BTreeSet::new(),
            ahead,
            ahead_failed,
            owed_writes: 0,
            deferred: None,
            cancels: BTreeMap::new(),
        };
        self.exports.insert(request.clone(), export);
        self.leases.grant(request.clone(), deadline).expect("a new export has no lease");
        self.by_base.entry(request.base()).or_default().insert(request.clone());
        let family = self.families.entry(family_id).or_insert_with(|| Family::new(now));
        family.members.insert(request.clone());
        if let Some(consumer) = consumer {
            // The router's choice binds the family; siblings were exported with the same one.
            family.owner.get_or_insert(consumer);
        }
        // A worker can learn of an export after its lease has already run out (a long handoff,
        // a stalled engine): then it is released before anything staged can renew or write it.
        self.reap_expired(now);
        // Everything staged for it, in arrival order; in push mode, registrations may name it
        // by base id. A claim staged by an engine since gone still binds it (and so releases
        // it), unless a live engine has claimed it too.
        let mut staged = self.early.take(&request, self.config.mode == Mode::Push, |_, _| true);
        if staged.iter().any(|(_, e)| !self.gone.is_gone(&e.from.consumer)) {
            let before = staged.len();
            staged.retain(|(_, e)| !self.gone.is_gone(&e.from.consumer));
            self.counters.late_messages += (before - staged.len()) as u64;
        }
        if request.parent().is_some_and(|p| self.pulled.contains(&p)) {
            // A late sibling of a parent already pulled.
            self.release(now, &request, ReleaseReason::Sibling);
        }
        for (_, early) in staged {
            self.on_claim(now, early.from, early.message);
        }
        self.release_if_owner_gone(now, &request);
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
                let incarnation = Consumer::of(&info.handshake);
                if self.gone.is_gone(&incarnation) {
                    tracing::warn!(peer = %info.agent, %incarnation, "a stale incarnation handshook; dropped");
                    self.counters.refusal(RefusalCause::Stale);
                    // Its side channel closes, so that it learns it is gone (if it still runs)
                    // and ends what it would load from this rank.
                    self.out.disconnect(info.agent.clone());
                    return;
                }
                match check_compatible(&self.offer, &info.handshake) {
                    Ok(compat) => {
                        self.peers.insert(info.agent.clone(), Peer::new(&info, compat));
                        self.prepare_lists(&info.agent);
                        self.hear(now, &incarnation);
                    }
                    Err(err) => {
                        tracing::warn!(peer = %info.agent, %err, "incompatible peer ignored");
                        self.counters.refusal(RefusalCause::Incompatible);
                    }
                }
                // A newer incarnation handshaking says every older one of its engine is gone.
                self.gone.mark_below(&incarnation.engine, incarnation.instance);
                self.release_gone_owners(now);
            }
            PeerEvent::ConnectFailed { .. } => {}
            PeerEvent::Refused { peer, cause, reason } => {
                self.warnings.refused(now, peer.as_ref(), cause, &reason);
                self.counters.refused(peer.as_ref(), cause, &reason);
            }
            // Its loss follows, and ends what was bound to it.
            PeerEvent::CutOff { peer, reason } => self.counters.cut_off(&peer, reason),
            PeerEvent::Lost(agent) => self.peer_gone(now, &agent),
            PeerEvent::Notification(notification) => self.handle_notification(now, notification),
        }
    }

    /// A notification from the transport.
    pub fn handle_notification(&mut self, now: Time, notification: Notification) {
        self.reap_expired(now);
        match Message::decode(&notification.payload) {
            Ok(message) => self.on_message(now, notification.from, message),
            Err(err) => {
                tracing::debug!(from = %notification.from, %err, "malformed notification");
                self.counters.ignored(Ignored::Malformed);
            }
        }
    }

    /// A descriptor list asked for in a write is ready (or not: then writes keep using pairs).
    pub fn handle_prepared(&mut self, _now: Time, token: XferToken, result: Result<PreparedId, TransportError>) {
        self.lists.handle_prepared(token, result);
    }

    /// Releases every export whose lease has run out by `now`. Every input runs it first, so
    /// that nothing is renewed, written or answered about a lease that has already ended (an
    /// answer of "released" is a promise that no write will come).
    fn reap_expired(&mut self, now: Time) {
        while let Some((request, _)) = self.leases.poll_expired(now) {
            self.release(now, &request, ReleaseReason::Expired);
        }
    }

    /// The clock reached a wake-up (spurious wake-ups are harmless).
    pub fn handle_timeout(&mut self, now: Time) {
        self.reap_expired(now);
        if now >= self.next_accrual {
            // Brought up to date at most once a heartbeat interval (and at every release), so
            // that the count moves while an export stays stranded.
            self.next_accrual = now + self.config.heartbeat_interval;
            let families: Vec<RequestId> = self.families.keys().cloned().collect();
            for family in families {
                self.accrue_stranded(now, &family);
            }
        }
        self.forget_old(now);
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

    /// Releases export `id` for `reason`: exactly once, with sibling release on a transfer.
    fn release(&mut self, now: Time, id: &RequestId, reason: ReleaseReason) {
        let Some(export) = self.exports.get(id) else { return };
        if !export.writing.is_empty() {
            // A write is reading the blocks; it ends (done or failed) before they can go.
            self.exports.get_mut(id).expect("exists").deferred.get_or_insert(reason);
            return;
        }
        let family = self.exports[id].family.clone();
        self.accrue_stranded(now, &family);
        let export = self.exports.remove(id).expect("exists");
        self.leases.release(id);
        if let Some(set) = self.by_base.get_mut(&id.base()) {
            set.remove(id);
            if set.is_empty() {
                self.by_base.remove(&id.base());
            }
        }
        self.remember_released(now, id, export.transfer.clone());
        // Push: D ranks that registered and got no write, or asked to cancel, learn that none will come.
        for (agent, reg) in &export.registrations {
            if !export.written.contains(agent) && self.peers.contains_key(agent) {
                self.out.send(agent, &Message::Abort { request: reg.request.clone() });
            }
        }
        for (agent, request) in &export.cancels {
            if !export.registrations.contains_key(agent) && self.peers.contains_key(agent) {
                self.out.send(agent, &Message::Abort { request: request.clone() });
            }
        }
        let _span = request_span(&self.offer.engine, Some(self.offer.rank), id).entered();
        tracing::debug!(%reason, "export released");
        let owner = self.families.get(&export.family).and_then(|f| f.owner.as_ref());
        self.warnings.released(now, id, reason, export.blocks.len(), owner);
        self.out.report(PrefillReport::Released { request: id.clone(), reason });
        let family = self.families.get_mut(&export.family).expect("an export's family exists");
        family.members.remove(id);
        let siblings: Vec<RequestId> = if reason == ReleaseReason::Transferred && id.parent().is_some() {
            self.pulled.insert(export.family.clone(), now);
            // Siblings their owner never claimed are stranded: release them. One it claimed may
            // be under a read right now; the owner ends it.
            family.members.iter().filter(|s| self.exports.get(*s).is_some_and(|e| !e.claimed)).cloned().collect()
        } else {
            Vec::new()
        };
        if family.members.is_empty() {
            self.families.remove(&export.family);
        }
        for sibling in siblings {
            self.release(now, &sibling, ReleaseReason::Sibling);
        }
    }
}

mod ahead;
mod messages;
mod owners;
mod push;
#[cfg(test)]
mod tests;
