//! Starting a load once P's lease allows it (the read fence), its reads or its push registration, and how its transfers end.

use super::*;

impl DecodeWorker {
    /// Starts a load whose blocks are allocated, once every P rank it needs is connected.
    pub(super) fn try_start(&mut self, now: Time, request: &RequestId) {
        let Some(load) = self.loads.get(request) else { return };
        if load.phase != Phase::Starting || !load.targets.iter().all(|t| self.peers.contains_key(t)) {
            return;
        }
        // The export lives in the P incarnation that made it; a restarted P has none of it, and
        // its pool at those addresses holds other requests' blocks.
        let restarted =
            load.remote.instance.is_some_and(|i| load.targets.iter().any(|t| self.peers[t].handshake.instance != i));
        if restarted {
            tracing::info!(%request, "P restarted since it exported this request");
            self.fail(now, request);
            return;
        }
        // The parameters name P's ranks and stages; an engine whose handshakes say otherwise
        // (the parameters are stale, or name another engine's shape) holds layers or heads this
        // plan does not read, so the load could end without all of its KV.
        let (tp_size, pp_size) = (load.remote.prefill.tp_size, load.remote.prefill.pp_size);
        if let Some(peer) =
            load.targets.iter().map(|t| &self.peers[t].handshake).find(|h| (h.tp_size, h.pp_size) != (tp_size, pp_size))
        {
            tracing::warn!(
                %request,
                params = %format!("tp {tp_size} x pp {pp_size}"),
                handshake = %format!("tp {} x pp {}", peer.tp_size, peer.pp_size),
                "P's handshake does not match the transfer parameters"
            );
            self.fail(now, request);
            return;
        }
        let completion = Message::Completion {
            request: load.remote.request.clone(),
            expected_consumers: load.tp.consumers_per_prefill_rank(),
        };
        if load.prefix_hit() {
            for target in load.targets.clone() {
                self.send_to(&target, completion.clone());
            }
            self.finish(now, request, true);
            return;
        }
        match self.config.mode {
            Mode::Pull => self.start_reads(now, request, completion),
            Mode::Push => {
                let load = self.loads.get_mut(request).expect("exists");
                // A partial prefix hit registers only the blocks P must write.
                let registration = Message::PushRegistration(PushRegistration {
                    request: request.clone(),
                    export: load.remote.request.clone(),
                    decode_engine: self.offer.engine.clone(),
                    decode_rank: self.offer.rank,
                    decode_tp: self.offer.tp_size,
                    blocks: load.blocks[load.cached..].to_vec(),
                    first_block: u32::try_from(load.cached).unwrap_or(u32::MAX),
                    prefill_pp: load.remote.prefill.pp_size,
                    prompt: load.claim.prompt,
                });
                load.phase = Phase::Registered;
                load.watchdog = Some(now + self.config.push_registration_timeout);
                for target in load.targets.clone() {
                    self.send_to(&target, registration.clone());
                }
            }
        }
    }

    /// In pull mode, asks for the descriptor lists of this rank's pool and of P rank `agent`'s
    /// as soon as it connects, where reads from it can name whole blocks by index (its heads,
    /// layers and block size are this rank's), so that the first load from it goes as fast as
    /// the others: made at the first read, P's list of 384 blocks of 32 layers held the
    /// demo's rank thread 2 to 7 ms, with that read's own posted as address pairs meanwhile.
    pub(super) fn prepare_lists(&mut self, agent: &AgentName) {
        if self.config.mode != Mode::Pull || self.descriptors != Descriptors::Prepared {
            return;
        }
        let Some(peer) = self.peers.get(agent) else { return };
        let heads = peer.handshake.layout.heads_per_rank(peer.handshake.tp_size);
        let Some(shape) = peer.shape(heads) else { return };
        let own = &self.pool.shape;
        if (shape.heads, shape.layers, shape.layout.block_tokens) != (own.heads, own.layers, own.layout.block_tokens) {
            return;
        }
        let regions = peer.handshake.regions.clone();
        self.lists.want(&mut self.out, &self.pool, agent, &shape, &regions);
    }

    pub(super) fn start_reads(&mut self, now: Time, request: &RequestId, completion: Message) {
        let _span = request_span(&self.offer.engine, Some(self.offer.rank), request).entered();
        let load = &self.loads[request];
        let Some(export) = load.remote.export.clone() else {
            self.fail(now, request);
            return;
        };
        // The fence: every P rank's lease must outlast the read, with the margin.
        if self.last_safe_start(load).is_none_or(|last| now > last) {
            tracing::info!(%request, "read fenced: P's lease could end before it");
            self.counters.reads_fenced += 1;
            self.fail(now, request);
            return;
        }
        // P may release an export before its lease for its owner's sake: the owner's completion,
        // rejection or abort, a sibling's completion, the owner's loss. Unless the router named
        // this engine at prefill (P bound the export to it then), another engine may own it (a
        // stale incarnation of this one that claimed it and is gone, say, when the router
        // retries here), and the blocks could be freed under the read. So D reads once every
        // read target has answered its claim (sent on arrival, and again at each beat): with a
        // deadline (this engine owns it, and the claim named the prompt and the blocks P
        // computed), or, unless it is a sibling, with "not known yet" (P's worker staged the
        // claim, and no other engine's came first). "Released" or "refused" fails the load; no
        // answer waits, bounded by the fence above. A sibling waits for the deadline even when
        // the router named this engine: P binds the family to it at prefill, but releases a
        // sibling its owner has not claimed yet when another sibling completes, and this
        // engine's own completion of a sibling (a prefix hit) can reach P before the claim
        // (random seed 1393, once the read margin followed short leases: its reads had all been
        // fenced before). A handoff without P's deadline (NixlConnector's form, which a router
        // rebuilt, or kvflow's without P's vouch under the cluster key, whose deadline and
        // consumer `TransferParams::resolve` clears) vouches for nothing: its load waits for
        // P's deadline, whatever else holds.
        let vouched = export.deadline > Time::ZERO;
        let named = vouched && load.remote.consumer.as_ref() == Some(&Consumer::of(&self.offer));
        let sibling = load.remote.request.parent().is_some();
        let answered = |slice: &kv_core::HeadSlice| {
            load.deadlines.contains_key(&slice.prefill_rank)
                || (vouched && !sibling && load.staged.contains(&slice.prefill_rank))
        };
        if (!named || sibling) && !load.plan.reads.iter().all(answered) {
            return;
        }
        let Ok(notification) = completion.encode() else {
            self.fail(now, request);
            return;
        };
        let mut posts = Vec::new();
        let mut to_prepare = Vec::new();
        for slice in &load.plan.reads {
            let agent = AgentName::new(load.remote.prefill.engine.clone(), slice.prefill_rank);
            let peer = &self.peers[&agent];
            let Some(p_shape) = peer.shape(load.tp.prefill_heads()) else {
                tracing::warn!(%request, peer = %agent, "cannot plan the read: the peer's pool shape is invalid");
                self.fail(now, request);
                return;
            };
            // A partial prefix hit reads only the blocks after the cached ones: from the P block
            // that holds D block `cached`'s first token, which is inside it when P's blocks are
            // the larger (the plan clips the last to the prompt).
            let d_blocks = &load.blocks[load.cached..];
            let span = peer.compat.blocks.prefill_span(load.cached..load.blocks.len());
            let p_blocks = export.blocks.get(span.blocks.start..).unwrap_or(&[]);
            let input = PlanInput {
                prefill: PoolSide { shape: p_shape, regions: &peer.handshake.regions, blocks: p_blocks },
                decode: PoolSide { shape: self.pool.shape, regions: &self.pool.regions, blocks: d_blocks },
                skip_tokens: span.skip_tokens,
                slice: *slice,
                initiator: Initiator::Decode,
            };
            // The plan also checks every block against both pools, whichever way is posted.
            let plan = match TransferPlan::build(&input, Granularity::Merged) {
                Ok(plan) => plan,
                Err(err) => {
                    tracing::warn!(%request, %err, "cannot plan the read");
                    self.fail(now, request);
                    return;
                }
            };
            if self.descriptors == Descriptors::Prepared && by_index(&p_shape, &self.pool.shape, slice) {
                if let Some((local, remote)) = self.lists.ready(&agent) {
                    let (local_indices, remote_indices) = block_indices(&self.pool.shape, d_blocks, &p_shape, p_blocks);
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
        // Lists are asked for when the peer connects (`prepare_lists`), else here, the first time
        // a peer is read; until they are ready, reads go as pairs.
        for (agent, p_shape) in to_prepare {
            let regions = self.peers[&agent].handshake.regions.clone();
            self.lists.want(&mut self.out, &self.pool, &agent, &p_shape, &regions);
        }
        let load = self.loads.get_mut(request).expect("exists");
        load.phase = Phase::Reading;
        tracing::debug!(reads = posts.len(), blocks = load.blocks.len(), "reads posted");
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

    /// The latest time a read of `load` may start: the earliest, over the P ranks it reads,
    /// of P's deadline on D's clock minus the safety margin and the clock's uncertainty.
    pub(super) fn last_safe_start(&self, load: &Load) -> Option<Time> {
        let export = load.remote.export.as_ref()?;
        if export.deadline == Time::ZERO
            && !load.plan.reads.iter().all(|s| load.deadlines.contains_key(&s.prefill_rank))
        {
            // The handoff named no deadline, and P has not given its own yet: the load waits
            // for it one lease at most (P would have let an export nobody claimed expire).
            return Some(load.since + self.config.kv_lease_duration);
        }
        load.plan
            .reads
            .iter()
            .map(|slice| {
                let agent = AgentName::new(load.remote.prefill.engine.clone(), slice.prefill_rank);
                let peer = self.peers.get(&agent)?;
                let acked = load.deadlines.get(&slice.prefill_rank).copied().unwrap_or(export.deadline);
                let deadline = acked.max(export.deadline);
                Some(peer.offset.last_safe_start(deadline, self.config.read_safety_margin, std::time::Duration::ZERO))
            })
            .try_fold(Time::from_nanos(u64::MAX), |min, t| t.map(|t| min.min(t)))
    }

    /// Of a failed pull, the blocks after the cached ones that its reads filled whole, up to the
    /// first that may hold bad bytes: none unless every read ended and the transport said where
    /// the failed ones went wrong.
    pub(super) fn intact_reads(&self, load: &Load) -> usize {
        if load.phase != Phase::Reading || load.blind || !load.reads.is_empty() {
            return 0;
        }
        let bases: Vec<u64> = self.pool.regions.iter().map(|r| r.addr).collect();
        let overlaps = |(a, alen): (u64, u64)| load.spoiled.iter().any(|&(s, slen)| a < s + slen && s < a + alen);
        load.blocks[load.cached..]
            .iter()
            .take_while(|b| !self.pool.shape.block_ranges(&bases, b.0).into_iter().any(overlaps))
            .count()
    }

    /// A transfer this worker posted ended.
    pub fn handle_transfer(&mut self, now: Time, token: XferToken, ok: bool) {
        self.transfer_ended(now, token, if ok { None } else { Some(None) });
    }

    /// A read failed part-way, and only the local ranges in `spoiled` may hold bad bytes
    /// ([`kv_core::TransportError::PartlyFailed`]): the load fails, and with the `recompute`
    /// policy D keeps the blocks before the first spoiled one.
    pub fn handle_transfer_spoiled(&mut self, now: Time, token: XferToken, spoiled: Vec<(u64, u64)>) {
        self.transfer_ended(now, token, Some(Some(spoiled)));
    }

    /// A read ended: done (`None`), failed (`Some(None)`), or failed with only `spoiled` bad.
    pub(super) fn transfer_ended(&mut self, now: Time, token: XferToken, failure: Option<Option<Vec<(u64, u64)>>>) {
        let Some(request) = self.xfers.remove(&token) else { return };
        let Some(load) = self.loads.get(&request) else { return };
        // The late-read fence: bytes that arrived after P's lease could have ended (less the
        // margin, across the clock offset) may be another request's; they are never accepted.
        let late = self.last_safe_start(load).is_none_or(|last| now > last);
        let load = self.loads.get_mut(&request).expect("exists");
        load.reads.remove(&token);
        match failure {
            Some(spoiled) => {
                self.counters.transfers_failed += 1;
                load.failed = true;
                match spoiled {
                    Some(spoiled) if !late => load.spoiled.extend(spoiled),
                    _ => load.blind = true,
                }
            }
            None if late => {
                tracing::warn!(%request, "a read completed after P's lease could have ended; its bytes are discarded");
                self.counters.late_reads += 1;
                load.distrust();
            }
            None => {}
        }
        if load.reads.is_empty() {
            if load.failed {
                // P ranks whose read failed got no completion: free them.
                let abort = Message::Abort { request: load.remote.request.clone() };
                for target in load.targets.clone() {
                    self.send_to(&target, abort.clone());
                }
            }
            self.finish(now, &request, true);
        }
    }
}
