//! Who owns each export, and whether it is still there: claims and binding, the engines heard from, peers and engine incarnations lost, and the release of what a lost owner held.

use super::*;

impl PrefillWorker {
    /// A D agent is gone: its engine incarnation is, and so are the exports bound to it.
    /// What it staged stays staged: settled when its export registers, then released.
    pub(super) fn peer_gone(&mut self, now: Time, agent: &AgentName) {
        let Some(peer) = self.peers.remove(agent) else { return };
        self.counters.peers_lost += 1;
        self.warnings.peer_lost(now, agent);
        self.lists.forget(agent);
        let gone = peer.consumer();
        self.gone.mark_below(&gone.engine, gone.instance.saturating_add(1));
        self.release_gone_owners(now);
        self.heard.retain(|consumer, _| !self.gone.is_gone(consumer));
    }

    /// Discovery says incarnation `instance` of `engine`, and every older one, is gone (its
    /// registration lapsed: its host may be gone without closing its sockets). Its exports
    /// are released at once, as `peer_lost`, connected or not, and so is any export named for
    /// it later; its agents still connected are dropped (their loss is reported then, and
    /// changes nothing more).
    pub fn handle_engine_lost(&mut self, now: Time, engine: &EngineId, instance: u64) {
        self.reap_expired(now);
        tracing::info!(lost = %engine, instance, "engine lost by discovery");
        self.gone.mark_below(engine, instance.saturating_add(1));
        for (agent, peer) in &self.peers {
            if peer.is_at_most(engine, instance) {
                self.out.disconnect(agent.clone());
            }
        }
        self.release_gone_owners(now);
        self.heard.retain(|consumer, _| !self.gone.is_gone(consumer));
    }

    /// Releases every export whose owner is known to be gone.
    pub(super) fn release_gone_owners(&mut self, now: Time) {
        let orphans: Vec<RequestId> = self
            .exports
            .iter()
            .filter(|(_, e)| self.families[&e.family].owner.as_ref().is_some_and(|o| self.gone.is_gone(o)))
            .map(|(r, _)| r.clone())
            .collect();
        for request in orphans {
            self.release(now, &request, ReleaseReason::PeerLost);
        }
    }

    /// Releases the family of export `id` when its owner is known to be gone (a staged claim
    /// of a gone engine may have just bound siblings registered before it).
    pub(super) fn release_if_owner_gone(&mut self, now: Time, id: &RequestId) {
        // By its family's id: a staged message may have released `id` itself already (an
        // abort), after binding its siblings to the gone engine.
        let family_id = id.parent().unwrap_or_else(|| id.clone());
        let Some(family) = self.families.get(&family_id) else { return };
        if family.owner.as_ref().is_some_and(|o| self.gone.is_gone(o)) {
            for member in family.members.clone() {
                self.release(now, &member, ReleaseReason::PeerLost);
            }
        }
    }

    /// Something came from `consumer`: if it was silent, the families it owns (and those no
    /// one owns yet, which its message may claim) were stranded until now.
    pub(super) fn hear(&mut self, now: Time, consumer: &Consumer) {
        let silent_after = self.config.heartbeat_interval * 2;
        let was_silent = self.heard.get(consumer).is_none_or(|&last| now > last + silent_after);
        if was_silent {
            let families: Vec<RequestId> = self
                .families
                .iter()
                .filter(|(_, f)| f.owner.as_ref().is_none_or(|o| o == consumer))
                .map(|(id, _)| id.clone())
                .collect();
            for family in families {
                self.accrue_stranded(now, &family);
            }
        }
        self.heard.insert(consumer.clone(), now);
    }

    /// Counts the block-time family `id` held, from its last accounting to `now`, while its
    /// owner was silent: nothing from it for two heartbeat intervals (from the family's first
    /// registration, when no one owns it or its owner was never heard from).
    pub(super) fn accrue_stranded(&mut self, now: Time, id: &RequestId) {
        let Some(family) = self.families.get(id) else { return };
        let heard = family.owner.as_ref().and_then(|o| self.heard.get(o)).copied();
        let last = heard.map_or(family.since, |h| h.max(family.since));
        let from = family.accounted.max(last + self.config.heartbeat_interval * 2);
        if now > from {
            // Siblings share their prompt's blocks: a family holds them once.
            let blocks = family.members.iter().filter_map(|m| self.exports.get(m)).map(|e| e.blocks.len()).max();
            self.stranded_block_ns += blocks.unwrap_or(0) as u128 * now.saturating_since(from).as_nanos();
            self.counters.stranded_block_ms = u64::try_from(self.stranded_block_ns / 1_000_000).unwrap_or(u64::MAX);
        }
        let family = self.families.get_mut(id).expect("present");
        family.accounted = family.accounted.max(now);
    }

    /// Binds export `id`'s family to `from`'s engine if it has no owner yet; whether `from` owns it.
    pub(super) fn bind(&mut self, id: &RequestId, from: &Claimant) -> bool {
        let Some(export) = self.exports.get_mut(id) else { return false };
        let family = self.families.get_mut(&export.family).expect("an export's family exists");
        let owner = family.owner.get_or_insert_with(|| from.consumer.clone());
        if *owner != from.consumer {
            tracing::debug!(request = %id, %owner, from = %from.consumer, "message from an engine the export is not bound to");
            return false;
        }
        export.claimed = true;
        true
    }

    pub(super) fn foreign(&mut self) {
        self.counters.ignored_messages += 1;
        self.counters.foreign_messages += 1;
    }

    /// The export a D message names: exactly, or in push mode by its transfer id, or by base id
    /// when that is unambiguous.
    pub(super) fn resolve(&self, request: &RequestId) -> Option<RequestId> {
        if self.exports.contains_key(request) {
            return Some(request.clone());
        }
        if self.config.mode != Mode::Push {
            return None;
        }
        if let Some(id) = self.transfers.get(request).filter(|id| self.exports.contains_key(*id)) {
            return Some(id.clone());
        }
        let candidates = self.by_base.get(&request.base())?;
        (candidates.len() == 1).then(|| candidates.first().expect("one").clone())
    }

    /// Stages `message` about `request` until its export registers: under the request a
    /// transfer id names, when it names one P computes (its export registers under that id).
    pub(super) fn stage(&mut self, now: Time, from: Claimant, request: RequestId, message: Message) {
        let request = self.staged_under(request);
        self.counters.early_staged += 1;
        self.counters.early_evicted += self.early.push(now, request, Early { from, message });
    }

    /// The id messages about `request` are staged under: the request a transfer id names, else
    /// `request` itself.
    pub(super) fn staged_under(&self, request: RequestId) -> RequestId {
        self.transfers.get(&request).cloned().unwrap_or(request)
    }

    /// Whether `from`'s incarnation is the one connected under its name now: a staged claim's
    /// sender may be gone, and a newer incarnation may have taken its name since.
    pub(super) fn live(&self, from: &Claimant) -> bool {
        self.peers.get(&from.agent).is_some_and(|p| p.consumer() == from.consumer)
    }
}
