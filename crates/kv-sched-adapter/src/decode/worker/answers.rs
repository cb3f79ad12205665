//! P's answers to this rank's claims, heartbeats and push registrations: deadlines, "not known
//! yet", releases and refusals, writes that landed and writes that will not come; and the claim
//! to send again where P has not answered it `Held`.

use super::*;

impl DecodeWorker {
    /// P rank `from`'s answer for the export D's load `request` reads.
    pub(super) fn on_renewal(&mut self, now: Time, request: &RequestId, from: &AgentName, lease: LeaseState) {
        let Some(load) = self.loads.get_mut(request) else { return };
        match lease {
            LeaseState::Held(deadline) => {
                let entry = load.deadlines.entry(from.rank).or_insert(deadline);
                *entry = (*entry).max(deadline);
                if load.phase == Phase::Starting {
                    self.try_start(now, request);
                }
            }
            // P's worker has not learned of the export yet; it staged the claim and answers it
            // when the export registers (and the next beat claims again).
            LeaseState::Unknown => {
                if load.staged.insert(from.rank) && load.phase == Phase::Starting {
                    self.try_start(now, request);
                }
            }
            LeaseState::Refused => {
                // P computed another prompt, or holds other blocks, than the handoff said: a
                // router rebuilt it wrong, or a client edited or replayed it. P released it.
                let prefill = load.remote.prefill.engine.clone();
                let prefill_request = load.remote.request.clone();
                self.warnings.handoff_refused(now, request, &prefill, &prefill_request);
                self.counters.claims_refused += 1;
                match load.phase {
                    Phase::Reading => load.distrust(),
                    Phase::Registered | Phase::Cancelling => self.on_push_answer(now, from, request, false),
                    Phase::Waiting | Phase::Starting => self.fail(now, request),
                }
            }
            LeaseState::Released => match load.phase {
                Phase::Waiting | Phase::Starting => {
                    self.warnings.export_gone(now, request, from);
                    self.fail(now, request);
                }
                // A read raced the export's end: its bytes cannot be trusted.
                Phase::Reading => load.distrust(),
                // Push: P released it, so no write will come from that rank.
                Phase::Registered | Phase::Cancelling => self.on_push_answer(now, from, request, false),
            },
        }
    }

    /// Push: P's write landed (`written`), or P said none will come.
    pub(super) fn on_push_answer(&mut self, now: Time, from: &AgentName, request: &RequestId, written: bool) {
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
        if !matches!(load.phase, Phase::Registered | Phase::Cancelling) || !load.targets.contains(from) {
            self.counters.late_messages += 1;
            return;
        }
        let fresh = if written { load.written.insert(from.rank) } else { load.declined.insert(from.rank) };
        if !fresh {
            self.counters.duplicate_messages += 1;
            return;
        }
        if load.phase == Phase::Cancelling {
            // Given up already: a write that landed, or P's word that none will, both say
            // that no write can come from that rank any more.
            return self.settle_cancel(now, &request);
        }
        if !written && !load.failed && !load.aborted {
            // One P rank will not write: the load cannot complete; stop the others too. D did
            // not ask, so the answer may be a stale one (to a cancel of the same id, taken in
            // after this registration went out) and cannot vouch that no write is in flight:
            // D cancels that rank too, and its blocks wait in quarantine for the answer.
            load.declined.remove(&from.rank);
            self.fail(now, &request);
            return;
        }
        let load = &self.loads[&request];
        let answered = load.targets.iter().all(|t| load.written.contains(&t.rank) || load.declined.contains(&t.rank));
        if answered {
            let all_written = load.targets.iter().all(|t| load.written.contains(&t.rank));
            self.finish(now, &request, all_written);
        }
    }

    /// Push, given up: the blocks leave quarantine once every P rank has answered.
    pub(super) fn settle_cancel(&mut self, now: Time, request: &RequestId) {
        let Some(load) = self.loads.get(request) else { return };
        if load.targets.iter().all(|t| load.written.contains(&t.rank) || load.declined.contains(&t.rank)) {
            self.finish(now, request, false);
        }
    }

    /// The claim of P's request `id` to send P rank `peer` again: that of a load of it which
    /// that rank has not answered `Held`, if none has been.
    pub(super) fn unclaimed(&self, peer: &AgentName, id: &RequestId) -> Option<Claim> {
        let loads = self.by_remote.get(&(peer.engine.clone(), id.clone()))?;
        let loads: Vec<&Load> = loads.iter().filter_map(|r| self.loads.get(r)).collect();
        if loads.iter().any(|l| l.deadlines.contains_key(&peer.rank)) {
            return None;
        }
        loads.first().map(|l| l.claim.clone())
    }
}
