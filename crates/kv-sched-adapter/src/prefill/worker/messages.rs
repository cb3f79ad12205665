//! What D's ranks say of exports: claims, completions, rejections and aborts, heartbeats, and
//! the answers P owes them.

use super::*;

impl PrefillWorker {
    pub(super) fn on_message(&mut self, now: Time, from: AgentName, message: Message) {
        let Some(peer) = self.peers.get(&from) else {
            tracing::debug!(%from, "message from a peer without a handshake");
            self.counters.ignored(Ignored::Unauthenticated);
            return;
        };
        // The TP mapping pairs TP ranks; every stage of P serves the same D ranks.
        let rank = self.offer.tp_rank();
        if peer.handshake.role != Role::Decode
            || !peer.compat.tp.consumers_of_prefill_rank(rank).is_ok_and(|c| c.contains(&from.rank))
        {
            self.counters.ignored(Ignored::Unknown);
            return;
        }
        let claimant = Claimant::of(&from, peer, rank);
        self.hear(now, &claimant.consumer);
        self.on_claim(now, claimant, message);
    }

    /// A message from a D rank, now or as staged.
    pub(super) fn on_claim(&mut self, now: Time, from: Claimant, message: Message) {
        match message {
            Message::Completion { request, .. } => self.on_completion(now, from, request),
            Message::Heartbeat { requests } => self.on_heartbeat(now, from, requests),
            Message::Rejection { request } => self.on_ended(now, from, request, ReleaseReason::Rejected),
            Message::Abort { request } => self.on_ended(now, from, request, ReleaseReason::Aborted),
            Message::PushRegistration(reg) => self.on_registration(now, from, reg),
            Message::Claim(claim) => self.renew(now, from, vec![(claim.request.clone(), Some(claim))]),
            Message::HeartbeatAck { .. } => self.counters.ignored(Ignored::Unknown),
        }
    }

    /// Sends `message` to `from` if its incarnation is still the one connected.
    pub(super) fn answer(&mut self, from: &Claimant, message: &Message) {
        if self.live(from) {
            self.out.send(&from.agent, message);
        }
    }

    pub(super) fn on_completion(&mut self, now: Time, from: Claimant, request: RequestId) {
        let _span = request_span(&self.offer.engine, Some(self.offer.rank), &request).entered();
        tracing::debug!(from = %from.consumer, "completion received");
        let Some(id) = self.resolve(&request) else {
            if self.recent.contains(&request) {
                self.counters.notifications_after_expiry += 1;
            } else {
                let message = Message::Completion { request: request.clone(), expected_consumers: 0 };
                self.stage(now, from, request, message);
            }
            return;
        };
        if !self.bind(&id, &from) {
            return self.foreign();
        }
        let export = self.exports.get_mut(&id).expect("resolved");
        if !export.completed.insert(from.agent) {
            self.counters.duplicate_messages += 1;
            return;
        }
        if export.completed.len() >= from.expected {
            let reason = if export.aborted { ReleaseReason::Aborted } else { ReleaseReason::Transferred };
            self.release(now, &id, reason);
        }
    }

    pub(super) fn on_ended(&mut self, now: Time, from: Claimant, request: RequestId, reason: ReleaseReason) {
        let push = self.config.mode == Mode::Push;
        if let Some(id) = self.resolve(&request) {
            if !self.bind(&id, &from) {
                return self.foreign();
            }
            let export = self.exports.get_mut(&id).expect("resolved");
            if push {
                // D asks P to cancel; P says so once no write can come (at release).
                export.cancels.insert(from.agent.clone(), request);
            } else if reason == ReleaseReason::Aborted {
                // One rank gave its load up (a read failed, say): the owner's other ranks that
                // read from this one may still be reading, so the blocks go when every consumer
                // rank is done, as with completions.
                export.aborted = true;
                if !export.completed.insert(from.agent.clone()) {
                    self.counters.duplicate_messages += 1;
                    return;
                }
                if export.completed.len() < from.expected {
                    return;
                }
            }
            self.release(now, &id, reason);
            return;
        }
        if self.recent.contains(&request) || (push && self.recent.contains(&request.base())) {
            self.counters.late_messages += 1;
            if push {
                // Released already: no write is or will be in flight.
                self.answer(&from, &Message::Abort { request });
            }
            return;
        }
        if push {
            // D gave up a registration P had staged, or one that has not come (yet): P will
            // never write for it, and says so at once, but only if it can remember the promise
            // for a registration that comes later. When it cannot (the record is full), D's
            // blocks wait out their quarantine instead.
            let agent = from.agent.clone();
            // Written ahead to while P computes, perhaps: no more, and each answer waits for
            // the writes in flight.
            let computing = self.computing_for(&request);
            if let Some(id) = &computing {
                self.computing.get_mut(id).expect("found").stopped.insert(agent.clone());
            }
            let promise = (agent.clone(), request.base());
            if !self.cancelled.is_full() || self.cancelled.contains(&promise) {
                self.cancelled.insert(promise, now);
                let registrations = self.early.take(&request, true, |_, early| {
                    early.from.agent == agent && matches!(early.message, Message::PushRegistration(_))
                });
                let mut answered = false;
                for (_, early) in registrations {
                    if let Message::PushRegistration(reg) = early.message {
                        answered |= reg.request == request;
                        self.answer_abort(computing.as_ref(), &from, reg.request);
                    }
                }
                if !answered {
                    self.answer_abort(computing.as_ref(), &from, request.clone());
                }
            }
        }
        // Staged too, so that the export, when P finishes it, is released at once.
        let message = match reason {
            ReleaseReason::Rejected => Message::Rejection { request: request.clone() },
            _ => Message::Abort { request: request.clone() },
        };
        self.stage(now, from, request, message);
    }

    pub(super) fn on_heartbeat(&mut self, now: Time, from: Claimant, requests: Vec<RequestId>) {
        self.renew(now, from, requests.into_iter().map(|r| (r, None)).collect());
    }

    /// How a claim of export `id` from `from` differs from what P computed, if it does: its
    /// prompt, or (pull) the blocks it would read. `None` also when the export is bound to
    /// another engine: that claim is answered as foreign, and changes nothing.
    pub(super) fn claim_mismatch(&self, id: &RequestId, from: &Claimant, claim: &Claim) -> Option<String> {
        let export = self.exports.get(id)?;
        let owner = self.families.get(&export.family).and_then(|f| f.owner.as_ref());
        if owner.is_some_and(|o| *o != from.consumer) {
            return None;
        }
        if let Some(mismatch) = claim.prompt.mismatch(&export.prompt) {
            return Some(mismatch.to_string());
        }
        let theirs = claim.blocks?;
        (theirs != Digest::of_blocks(&export.blocks)).then(|| {
            format!("the claim names other P blocks than the export's {} (digest {theirs})", export.blocks.len())
        })
    }

    /// Refuses `from`'s claim (or push registration) of export `id`, which names another prompt
    /// or other blocks (`why`): logged, counted, and the export released (`rejected`); the
    /// caller answers.
    pub(super) fn refuse_claim(&mut self, now: Time, id: &RequestId, from: &Claimant, why: &str) {
        self.warnings.claim_refused(now, id, &from.consumer, why);
        self.counters.claims_refused += 1;
        self.release(now, id, ReleaseReason::Rejected);
    }

    /// Renews (and, the first time, binds to `from`) the exports `requests` name; each with a
    /// claim is checked first, and one that names another prompt or other blocks than P's
    /// export releases it (`rejected`) and is answered `Refused`.
    pub(super) fn renew(&mut self, now: Time, from: Claimant, requests: Vec<(RequestId, Option<Claim>)>) {
        let extension = self.config.lease_extension;
        let mut foreign = false;
        let mut renewals = Vec::with_capacity(requests.len());
        for (request, claim) in requests {
            let resolved = self.resolve(&request);
            let refused = match (&resolved, &claim) {
                (Some(id), Some(claim)) => self.claim_mismatch(id, &from, claim),
                _ => None,
            };
            if let (Some(why), Some(id)) = (refused, &resolved) {
                self.refuse_claim(now, id, &from, &why);
                renewals.push(Renewal { request, lease: LeaseState::Refused });
                continue;
            }
            let lease = match resolved {
                Some(id) if self.bind(&id, &from) => match self.leases.renew(&id, now, extension) {
                    Some(deadline) => {
                        self.counters.leases_renewed += 1;
                        LeaseState::Held(deadline)
                    }
                    // Push: a write into that rank's blocks is in flight; "released" would tell
                    // D that none is, and D would free the blocks under it. The write's own
                    // completion answers.
                    None if self.exports[&id].writing.contains_key(&from.agent) => LeaseState::Unknown,
                    // Expired and about to be reaped, or released while a write finishes.
                    None => LeaseState::Released,
                },
                // Bound to another engine: never safe for this one to read.
                Some(_) => {
                    foreign = true;
                    LeaseState::Released
                }
                None if self.recent.contains(&request) => LeaseState::Released,
                None => {
                    // Staged: it claims the export when the export registers, and is answered then.
                    // Another engine's claim staged first would bind it instead, and this engine
                    // must not read on the strength of "not known yet": no answer until then.
                    let key = self.staged_under(request.clone());
                    let contested = self.early.any(&key, |e| e.from.consumer != from.consumer);
                    let message = match claim {
                        Some(claim) => Message::Claim(claim),
                        None => Message::Heartbeat { requests: vec![request.clone()] },
                    };
                    self.stage(now, from.clone(), request.clone(), message);
                    if contested {
                        continue;
                    }
                    LeaseState::Unknown
                }
            };
            renewals.push(Renewal { request, lease });
        }
        if foreign {
            self.foreign();
        }
        if self.live(&from) {
            self.out.send_split(&from.agent, &renewals, |renewals| Message::HeartbeatAck { renewals });
        }
    }

    /// Tells `from` that no write will come for its `request`: now, or, while writes of P's
    /// request `id` into its blocks are in flight, when they have ended.
    pub(super) fn answer_abort(&mut self, id: Option<&RequestId>, from: &Claimant, request: RequestId) {
        let busy = id.filter(|id| {
            let in_export = self.exports.get(*id).is_some_and(|e| e.writing.contains_key(&from.agent));
            in_export || self.computing.get(*id).is_some_and(|c| c.writing.contains_key(&from.agent))
        });
        match busy {
            Some(id) => {
                let held = self.held_answers.entry((id.clone(), from.agent.clone())).or_default();
                if held.iter().any(|(_, r)| *r == request) {
                    self.counters.duplicate_messages += 1;
                } else if held.len() >= HELD_ANSWERS {
                    self.counters.early_evicted += 1;
                } else {
                    held.push((from.clone(), request));
                }
            }
            None => self.answer(from, &Message::Abort { request }),
        }
    }
}
