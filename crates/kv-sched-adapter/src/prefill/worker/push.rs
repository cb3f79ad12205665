//! P's push mode: D's block registrations matched to exports, writes into D's blocks (ahead of the export while P computes, then the last one with the completion), and prompts given up part-way.

use super::ahead::Segment;
use super::*;

impl PrefillWorker {
    pub(super) fn on_registration(&mut self, now: Time, from: Claimant, reg: PushRegistration) {
        let agent = from.agent.clone();
        if self.config.mode != Mode::Push || reg.decode_engine != agent.engine || reg.decode_rank != agent.rank {
            self.counters.ignored(Ignored::Unknown);
            return;
        }
        if reg.prefill_pp != self.offer.pp_size {
            // D would wait for writes from stages this engine does not have, or finish before
            // every stage wrote: tell it none will come, and keep the export for a good one.
            tracing::warn!(request = %reg.request, peer = %agent, registered = reg.prefill_pp, local = self.offer.pp_size, "push registration counts other pipeline stages");
            self.counters.ignored(Ignored::Malformed);
            self.answer(&from, &Message::Abort { request: reg.request });
            return;
        }
        if self.cancelled.contains(&(agent.clone(), reg.export.base())) {
            // It came after D's cancel, which P answered: no write, ever.
            self.counters.late_messages += 1;
            self.answer(&from, &Message::Abort { request: reg.request });
            return;
        }
        // P's request as D's handoff names it: its id, its transfer id, or its base id.
        let Some(id) = self.resolve(&reg.export) else {
            if self.recent.contains(&reg.export) || self.recent.contains(&reg.export.base()) {
                self.counters.late_messages += 1;
                self.answer(&from, &Message::Abort { request: reg.request });
            } else {
                let named = reg.export.clone();
                self.stage(now, from, named.clone(), Message::PushRegistration(reg));
                if let Some(id) = self.computing_for(&named) {
                    // P is computing it: the blocks finished so far can go now.
                    self.write_ahead(&id);
                }
            }
            return;
        };
        let claim = Claim { request: reg.request.clone(), prompt: reg.prompt, blocks: None };
        if let Some(why) = self.claim_mismatch(&id, &from, &claim) {
            // D's prompt is not the one P computed: no write (the answer waits for any write
            // ahead into D's blocks, which D then never decodes from), and the export goes.
            self.refuse_claim(now, &id, &from, &why);
            self.answer_abort(Some(&id), &from, reg.request);
            return;
        }
        if !self.bind(&id, &from) {
            // Written ahead to before the router's choice bound it elsewhere, perhaps: the
            // answer waits for those writes.
            self.foreign();
            self.answer_abort(Some(&id), &from, reg.request);
            return;
        }
        let export = self.exports.get_mut(&id).expect("resolved");
        if export.registrations.contains_key(&agent) {
            self.counters.duplicate_messages += 1;
            return;
        }
        export.registrations.insert(agent.clone(), reg);
        if export.owed_writes == 0 {
            export.owed_writes = from.owed;
        }
        // A registration staged by an incarnation since gone binds the export but gets no
        // write: not even into a newer incarnation that took its name.
        if self.live(&from) {
            self.write(&id, &agent);
        }
        self.settle_push(now, &id);
    }

    /// Posts the last write of export `id` into the blocks D rank `to` registered: those not
    /// written ahead, with the completion. It waits while writes ahead into that rank are in
    /// flight ([`PrefillWorker::handle_transfer`] calls again when they end).
    pub(super) fn write(&mut self, id: &RequestId, to: &AgentName) {
        let export = self.exports.get_mut(id).expect("exists");
        if export.writing.contains_key(to) || export.written.contains(to) {
            return;
        }
        let Some(reg) = export.registrations.get(to).cloned() else { return };
        if export.ahead_failed.contains(to) {
            // A write ahead failed (or D cancelled while P computed): D cannot tell what
            // landed, so it gets no completion; it gives the load up.
            export.registrations.remove(to);
            self.out.send(to, &Message::Abort { request: reg.request });
            return;
        }
        let ahead = export.ahead.get(to).copied().unwrap_or_default();
        // A rank no longer connected gets nothing: its loss releases the export.
        let Some(Ok(plan_d)) = self.peers.get(to).map(|p| p.compat.tp.decode_rank(to.rank)) else { return };
        // D counts one write from each of the P ranks it maps to in every stage.
        let completion = Message::Completion {
            request: reg.request.clone(),
            expected_consumers: plan_d.completion_targets().count() as u32 * self.offer.pp_size,
        };
        if plan_d.notify_only.contains(&self.offer.tp_rank()) || (ahead.whole > 0 && ahead.covers(reg.blocks.len())) {
            // MLA: D reads the latent from another rank; this one only says it is done. Or every
            // block went ahead, and those writes have completed (flushed to D).
            self.out.send(to, &completion);
            export.written.insert(to.clone());
            return;
        }
        let notification = match completion.encode() {
            Ok(notification) => notification,
            Err(err) => return tracing::warn!(request = %id, %err, "completion does not encode"),
        };
        let blocks = export.blocks.clone();
        let posted = match ahead.part {
            None => self.post_write(to, &reg, &blocks, ahead.whole..reg.blocks.len(), Some(notification)).map(Some),
            // The rest of a chunk's layers and the blocks never written go as one write.
            Some(_) => {
                let segments = ahead.segments_to(&Ahead::new(reg.blocks.len(), 0, 0));
                self.post_segments(to, &reg, &blocks, &segments, Some(notification))
            }
        };
        match posted {
            Ok(None) => {
                // This pipeline stage holds none of the layers left: every byte went ahead.
                self.out.send(to, &completion);
                self.exports.get_mut(id).expect("exists").written.insert(to.clone());
            }
            Ok(Some(token)) => {
                let export = self.exports.get_mut(id).expect("exists");
                *export.writing.entry(to.clone()).or_default() += 1;
                self.writes.insert(token, Write { request: id.clone(), to: to.clone(), last: true });
            }
            Err(err) => {
                tracing::warn!(request = %id, peer = %to, %err, "cannot write into the registered blocks");
                self.exports.get_mut(id).expect("exists").registrations.remove(to);
                self.counters.ignored(Ignored::Malformed);
                self.out.send(to, &Message::Abort { request: reg.request });
            }
        }
    }

    /// In push mode, asks for the descriptor lists of this rank's pool and of D rank `agent`'s
    /// as soon as it connects, where writes to it can name whole blocks by index, so that the
    /// first write to it goes as fast as the others: made at the first write, the lists held
    /// the rank's thread for milliseconds, with that write posted as address pairs meanwhile.
    pub(super) fn prepare_lists(&mut self, agent: &AgentName) {
        if self.config.mode != Mode::Push || self.descriptors != Descriptors::Prepared {
            return;
        }
        let Some(peer) = self.peers.get(agent) else { return };
        let tp = peer.compat.tp;
        let rank = self.offer.tp_rank();
        let Ok(plan_d) = tp.decode_rank(agent.rank) else { return };
        let Some(slice) = plan_d.reads.iter().find(|s| s.prefill_rank == rank).copied() else { return };
        let Some(d_shape) = peer.shape(tp.decode_heads()) else { return };
        if !by_index(&self.pool.shape, &d_shape, &slice) {
            return;
        }
        let regions = peer.handshake.regions.clone();
        self.lists.want(&mut self.out, &self.pool, agent, &d_shape, &regions);
    }

    /// The plan of a write of P's `blocks` into `d_range` of the blocks D rank `to` registered
    /// in `reg`, model layers `layers` of those both pools hold: D block `b` of the prompt
    /// (from `reg.first_block` on) takes the P blocks that hold its tokens (a part of one when
    /// P's blocks are the larger), and the plan clips the last and checks every block against
    /// both pools. A write ahead (`d_range` short of the end) takes only the P blocks of its D
    /// blocks. `None` when this rank's stage holds none of `layers`.
    fn plan_write<'a>(
        &self,
        to: &AgentName,
        reg: &'a PushRegistration,
        blocks: &'a [BlockId],
        d_range: std::ops::Range<usize>,
        layers: std::ops::Range<u32>,
    ) -> Result<Option<WritePlan<'a>>, String> {
        let peer = self.peers.get(to).ok_or_else(|| format!("{to} is not connected"))?;
        let tp = peer.compat.tp;
        let plan_d = tp.decode_rank(to.rank).map_err(|e| e.to_string())?;
        let rank = self.offer.tp_rank();
        let slice = plan_d.reads.iter().find(|s| s.prefill_rank == rank).copied();
        let slice = slice.ok_or_else(|| format!("no head slice of P rank {rank} for D rank {}", to.rank))?;
        let d_shape = peer.shape(tp.decode_heads()).ok_or_else(|| "peer layout".to_owned())?;
        let first = reg.first_block as usize;
        let d_blocks =
            reg.blocks.get(d_range.clone()).ok_or_else(|| format!("D blocks {d_range:?} of {}", reg.blocks.len()))?;
        let span = peer.compat.blocks.prefill_span(first + d_range.start..first + d_range.end);
        let p_from = span.blocks.start.min(blocks.len());
        let p_blocks = &blocks[p_from..span.blocks.end.clamp(p_from, blocks.len())];
        let input = PlanInput {
            prefill: PoolSide { shape: self.pool.shape, regions: &self.pool.regions, blocks: p_blocks },
            decode: PoolSide { shape: d_shape, regions: &peer.handshake.regions, blocks: d_blocks },
            skip_tokens: span.skip_tokens,
            slice,
            initiator: Initiator::Prefill,
        };
        let plan = match TransferPlan::build_layers(&input, Granularity::Merged, layers) {
            Ok(plan) => plan,
            Err(kv_core::PlanError::LayersNotHeld { .. }) => return Ok(None),
            Err(e) => return Err(e.to_string()),
        };
        let indexed = self.descriptors == Descriptors::Prepared && by_index(&self.pool.shape, &d_shape, &slice);
        Ok(Some(WritePlan { plan, p_blocks, d_blocks, d_shape, indexed }))
    }

    /// Posts a write of P's `blocks` into `d_range` of the blocks D rank `to` registered in
    /// `reg`, every layer ([`PrefillWorker::plan_write`]): by prepared block indices when both
    /// pools allow it, else as pairs.
    pub(super) fn post_write(
        &mut self,
        to: &AgentName,
        reg: &PushRegistration,
        blocks: &[BlockId],
        d_range: std::ops::Range<usize>,
        notification: Option<Vec<u8>>,
    ) -> Result<XferToken, String> {
        let Some(write) = self.plan_write(to, reg, blocks, d_range, 0..ahead::ALL_LAYERS)? else {
            return Err("the stage holds no layer".into());
        };
        let WritePlan { plan, p_blocks, d_blocks, d_shape, indexed } = write;
        let token = match self.lists.ready(to).filter(|_| indexed) {
            Some((local, remote)) => {
                let (local_indices, remote_indices) = block_indices(&self.pool.shape, p_blocks, &d_shape, d_blocks);
                self.counters.prepared_writes += 1;
                self.out.post_prepared(PreparedTransfer {
                    op: TransferOp::Write,
                    peer: to.clone(),
                    local,
                    local_indices,
                    remote,
                    remote_indices,
                    notification,
                })
            }
            None => {
                if indexed {
                    // Asked for when the peer connected; until they are ready (or if that was
                    // not asked), writes go as pairs.
                    let regions = self.peers[to].handshake.regions.clone();
                    self.lists.want(&mut self.out, &self.pool, to, &d_shape, &regions);
                }
                let request = TransferRequest {
                    op: TransferOp::Write,
                    peer: to.clone(),
                    pairs: plan.pairs().to_vec(),
                    notification,
                };
                self.out.post(request)
            }
        };
        Ok(token)
    }

    /// Posts one write of `segments` (D blocks of `reg`, each in some model layers) of P's
    /// `blocks` into D rank `to`, as pairs: a layer's bytes are not whole blocks, which
    /// prepared indices name. `None` when this rank's stage holds none of their layers.
    pub(super) fn post_segments(
        &mut self,
        to: &AgentName,
        reg: &PushRegistration,
        blocks: &[BlockId],
        segments: &[Segment],
        notification: Option<Vec<u8>>,
    ) -> Result<Option<XferToken>, String> {
        if let [one] = segments {
            if one.all_layers() {
                return self.post_write(to, reg, blocks, one.blocks.clone(), notification).map(Some);
            }
        }
        let mut pairs = Vec::new();
        for segment in segments {
            if let Some(write) = self.plan_write(to, reg, blocks, segment.blocks.clone(), segment.layers.clone())? {
                pairs.extend_from_slice(write.plan.pairs());
            }
        }
        if pairs.is_empty() {
            return Ok(None);
        }
        self.counters.layer_writes += 1;
        Ok(Some(self.out.post(TransferRequest { op: TransferOp::Write, peer: to.clone(), pairs, notification })))
    }

    /// Push: a request P computes has `blocks` finished (with `part`, the chunk in progress in
    /// some layers only).
    pub(super) fn on_progress(
        &mut self,
        request: RequestId,
        blocks: Vec<BlockId>,
        part: Option<LayerProgress>,
        consumer: Option<Consumer>,
        transfer: Option<RequestId>,
    ) {
        if self.config.mode != Mode::Push || self.exports.contains_key(&request) || self.recent.contains(&request) {
            return;
        }
        let transfer = match self.computing.get(&request) {
            Some(computing) => computing.transfer.clone(),
            None => self.pair(&request, transfer),
        };
        let computing = self.computing.entry(request.clone()).or_insert_with(|| Computing {
            blocks: Vec::new(),
            whole: 0,
            layers: 0,
            consumer: None,
            ahead: BTreeMap::new(),
            writing: BTreeMap::new(),
            stopped: BTreeSet::new(),
            abandoned: false,
            transfer,
        });
        if computing.abandoned {
            return;
        }
        let (whole, layers) = part.map_or((blocks.len(), 0), |p| (p.whole.min(blocks.len()), p.layers));
        if whole > computing.whole || blocks.len() > computing.blocks.len() {
            computing.layers = layers;
        } else if whole == computing.whole {
            computing.layers = computing.layers.max(layers);
        }
        computing.whole = computing.whole.max(whole);
        if blocks.len() > computing.blocks.len() {
            computing.blocks = blocks;
        }
        if consumer.is_some() {
            computing.consumer = consumer;
        }
        self.write_ahead(&request);
    }

    /// The request P computes that a D message about `request` names: exactly, else by base
    /// id when that is unambiguous (no export and no other computing request shares it).
    pub(super) fn computing_for(&self, request: &RequestId) -> Option<RequestId> {
        if self.computing.contains_key(request) {
            return Some(request.clone());
        }
        if let Some(id) = self.transfers.get(request).filter(|id| self.computing.contains_key(*id)) {
            return Some(id.clone());
        }
        if self.config.mode != Mode::Push || self.by_base.contains_key(&request.base()) {
            return None;
        }
        let mut same = self.computing.keys().filter(|id| id.base() == request.base());
        match (same.next(), same.next()) {
            (Some(id), None) => Some(id.clone()),
            _ => None,
        }
    }

    /// Whether computing request `id` is the only request its base id names, so that push
    /// registrations may name it by base id.
    pub(super) fn unique_base(&self, id: &RequestId) -> bool {
        self.config.mode == Mode::Push
            && !self.by_base.contains_key(&id.base())
            && self.computing.keys().filter(|other| other.base() == id.base()).count() == 1
    }

    /// Push: writes the blocks computing request `id` has finished, past those written
    /// already, into the blocks its owner-to-be registered: the consumer the router named, else
    /// the engine of the first claim staged from a live engine (the one the export will be
    /// bound to when it registers). Siblings are not written ahead: they share their blocks.
    pub(super) fn write_ahead(&mut self, id: &RequestId) {
        let Some(computing) = self.computing.get(id) else { return };
        if computing.abandoned || id.parent().is_some() {
            return;
        }
        let by_base = self.unique_base(id);
        let owner = computing.consumer.clone().or_else(|| {
            self.early
                .about(id, by_base)
                .map(|(_, early)| early)
                .find(|early| !self.gone.is_gone(&early.from.consumer) && self.claims(early))
                .map(|early| early.from.consumer.clone())
        });
        let Some(owner) = owner else { return };
        let mut targets: BTreeMap<AgentName, PushRegistration> = BTreeMap::new();
        for (_, early) in self.early.about(id, by_base) {
            if let Message::PushRegistration(reg) = &early.message {
                if early.from.consumer == owner && self.live(&early.from) && self.claims(early) {
                    targets.entry(early.from.agent.clone()).or_insert_with(|| reg.clone());
                }
            }
        }
        let rank = self.offer.tp_rank();
        for (to, reg) in targets {
            let Some(peer) = self.peers.get(&to) else { continue };
            let tp = peer.compat.tp;
            if peer.shape(tp.decode_heads()).is_none()
                || tp.decode_rank(to.rank).map_or(true, |plan| plan.notify_only.contains(&rank))
            {
                continue;
            }
            let computing = &self.computing[id];
            if computing.stopped.contains(&to) {
                continue;
            }
            // D block `b` is whole once all its P blocks are, and has a layer once all its P
            // blocks have it.
            let d_blocks = |p: usize| {
                let d = peer.compat.blocks.decode_blocks_in(p);
                d.saturating_sub(reg.first_block as usize).min(reg.blocks.len())
            };
            let ready = Ahead::new(d_blocks(computing.whole), d_blocks(computing.blocks.len()), computing.layers);
            let done = computing.ahead.get(&to).copied().unwrap_or_default();
            let segments = done.segments_to(&ready);
            if segments.is_empty() {
                continue;
            }
            let blocks = computing.blocks.clone();
            let posted = self.post_segments(&to, &reg, &blocks, &segments, None);
            let computing = self.computing.get_mut(id).expect("present");
            match posted {
                Ok(None) => {
                    // This stage holds none of those layers.
                    computing.ahead.insert(to.clone(), done.then(&ready));
                }
                Ok(Some(token)) => {
                    computing.ahead.insert(to.clone(), done.then(&ready));
                    *computing.writing.entry(to.clone()).or_default() += 1;
                    self.counters.writes_ahead += 1;
                    self.writes.insert(token, Write { request: id.clone(), to, last: false });
                }
                Err(err) => {
                    // The last write, at the export, tries again and says why.
                    tracing::debug!(request = %id, peer = %to, %err, "no write ahead");
                    computing.stopped.insert(to);
                }
            }
        }
    }

    /// Whether staged message `early` would claim its export when it registers: anything but a
    /// push registration this rank would refuse.
    pub(super) fn claims(&self, early: &Early) -> bool {
        match &early.message {
            Message::PushRegistration(reg) => {
                let agent = &early.from.agent;
                self.config.mode == Mode::Push
                    && reg.decode_engine == agent.engine
                    && reg.decode_rank == agent.rank
                    && reg.prefill_pp == self.offer.pp_size
                    && !self.cancelled.contains(&(agent.clone(), reg.export.base()))
            }
            _ => true,
        }
    }

    /// Push: the engine gave up computing request `id`.
    pub(super) fn on_abandon(&mut self, now: Time, id: RequestId) {
        let Some(computing) = self.computing.get_mut(&id) else {
            // Nothing was written ahead from this rank.
            self.out.report(PrefillReport::Released { request: id, reason: ReleaseReason::Aborted });
            return;
        };
        computing.abandoned = true;
        if computing.writing.is_empty() {
            self.finish_abandon(now, &id);
        }
    }

    /// Releases abandoned request `id`, no write from it in flight: D ranks whose registrations
    /// are staged for it learn at once that no write will come, and messages about it from
    /// now on are late.
    pub(super) fn finish_abandon(&mut self, now: Time, id: &RequestId) {
        let by_base = self.unique_base(id);
        let transfer = self.computing.remove(id).and_then(|c| c.transfer);
        self.remember_released(now, id, transfer);
        let staged = self.early.take(id, by_base, |_, early| matches!(early.message, Message::PushRegistration(_)));
        for (_, early) in staged {
            if let Message::PushRegistration(reg) = early.message {
                self.answer(&early.from, &Message::Abort { request: reg.request });
            }
        }
        let _span = request_span(&self.offer.engine, Some(self.offer.rank), id).entered();
        tracing::debug!("abandoned while computing; released");
        self.out.report(PrefillReport::Released { request: id.clone(), reason: ReleaseReason::Aborted });
    }

    /// The writes of P's request `id` into D rank `to` have ended: the answers held for them go.
    pub(super) fn release_answers(&mut self, id: &RequestId, to: &AgentName) {
        for (from, request) in self.held_answers.remove(&(id.clone(), to.clone())).unwrap_or_default() {
            self.answer(&from, &Message::Abort { request });
        }
    }

    /// Push: releases the export when every consumer's write is done, or, once no write is
    /// in flight, for a reason that came while one was.
    pub(super) fn settle_push(&mut self, now: Time, id: &RequestId) {
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

    /// A transfer this worker posted ended.
    pub fn handle_transfer(&mut self, now: Time, token: XferToken, ok: bool) {
        let Some(Write { request, to, last }) = self.writes.remove(&token) else { return };
        if !ok {
            self.counters.transfers_failed += 1;
        }
        if let Some(computing) = self.computing.get_mut(&request) {
            // A write ahead; the request still computes.
            let idle = write_ended(&mut computing.writing, &to);
            if !ok {
                computing.stopped.insert(to.clone());
            }
            let abandoned = computing.abandoned && computing.writing.is_empty();
            if idle {
                self.release_answers(&request, &to);
            }
            if abandoned {
                self.finish_abandon(now, &request);
            }
            return;
        }
        let Some(export) = self.exports.get_mut(&request) else { return };
        let idle = write_ended(&mut export.writing, &to);
        if last {
            if ok {
                export.written.insert(to.clone());
            } else if let Some(reg) = export.registrations.remove(&to) {
                // The write is never reported done. Tell D, which gives the load up and aborts.
                self.out.send(&to, &Message::Abort { request: reg.request });
            }
        } else if !ok {
            export.ahead_failed.insert(to.clone());
        }
        if idle {
            self.release_answers(&request, &to);
            let export = &self.exports[&request];
            if !last && export.deferred.is_none() && export.registrations.contains_key(&to) {
                // The writes ahead into that rank have completed: the last one may go.
                self.write(&request, &to);
            }
        }
        self.settle_push(now, &request);
    }

    /// A transfer failed part-way ([`TransportError::PartlyFailed`]): P's are push writes, whose
    /// landed part D cannot tell from the rest, so it is a failed write like any other.
    pub fn handle_transfer_spoiled(&mut self, now: Time, token: XferToken, spoiled: Vec<(u64, u64)>) {
        let _ = spoiled;
        self.handle_transfer(now, token, false);
    }
}

/// One write into `to` ended; whether none is in flight into it any more.
pub(super) fn write_ended(writing: &mut BTreeMap<AgentName, usize>, to: &AgentName) -> bool {
    match writing.get_mut(to) {
        Some(count) if *count > 1 => {
            *count -= 1;
            false
        }
        _ => {
            writing.remove(to);
            true
        }
    }
}

/// A write planned: its plan, the blocks on each side, D's shape, and whether both pools
/// allow prepared block indices.
struct WritePlan<'a> {
    plan: TransferPlan,
    p_blocks: &'a [BlockId],
    d_blocks: &'a [BlockId],
    d_shape: kv_core::PoolShape,
    indexed: bool,
}
