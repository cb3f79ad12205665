//! How the network carries things out when the clock reaches them: messages sent and arriving (through partitions, pauses and delays), transfers completing with their bytes copied, crashes.

use super::*;

impl Net {
    pub(super) fn settle(&mut self) {
        let now = self.clock.now();
        while let Some(entry) = self.queue.first_entry() {
            if entry.key().0 > now {
                break;
            }
            let ((at, _), event) = entry.remove_entry();
            self.run(at, event);
        }
        // Every later check is at `now` or after, where these windows are over.
        self.partitions.retain(|window| window.until > now);
        self.delays.retain(|window| window.until > now);
    }

    pub(super) fn run(&mut self, at: Time, event: Event) {
        match event {
            Event::Arrive(message) => self.arrive(at, message),
            Event::Complete { poster, id } => self.complete(at, &poster, id),
            Event::Unreachable { to, conn } => self.side_closed(at, &to, conn),
            Event::SideTimer { to } => self.side_timer(at, &to),
        }
    }

    pub(super) fn send(&mut self, message: Message) {
        let at = message.sent_at;
        let (from, to) = (&message.from.name, &message.to.name);
        let delay: Duration =
            self.delays.iter().filter(|window| window.active(at) && window.directed(from, to)).map(|w| w.by).sum();
        let due = at + self.config.latency + delay;
        if !matches!(message.body, Body::Notification(_)) {
            return self.schedule(due, Event::Arrive(message));
        }
        if self.partitioned(from, to, at) {
            self.stats.dropped += 1;
            return;
        }
        if self.rng.chance(self.config.drop_rate) {
            self.stats.dropped += 1;
            return;
        }
        let copies = if self.rng.chance(self.config.duplicate_rate) { 2 } else { 1 };
        self.stats.duplicated += copies - 1;
        let jitter = u64::try_from(self.config.reorder_jitter.as_nanos()).unwrap_or(u64::MAX);
        for _ in 0..copies {
            let extra = Duration::from_nanos(self.rng.range(0..=jitter));
            self.schedule(due + extra, Event::Arrive(message.clone()));
        }
    }

    /// When a partition between `x` and `y` active at `at` ends, if one is.
    pub(super) fn partition_end(&self, x: &AgentName, y: &AgentName, at: Time) -> Option<Time> {
        self.partitions.iter().filter(|w| w.active(at) && w.separates(x, y)).map(|w| w.until).max()
    }

    /// When a pause of `agent` active at `at` ends, if one is.
    pub(super) fn pause_end(&self, agent: &AgentName, at: Time) -> Option<Time> {
        self.pauses.iter().filter(|(who, until)| who.covers(agent) && at < *until).map(|p| p.1).max()
    }

    pub(super) fn arrive(&mut self, at: Time, message: Message) {
        let up = self.agent(&message.to).is_some();
        match &message.body {
            Body::Notification(_) => {
                if !up || self.partitioned(&message.from.name, &message.to.name, at) {
                    self.stats.dropped += 1;
                    return;
                }
            }
            Body::Open { initiator_conn, .. } => {
                if !up || self.partitioned(&message.from.name, &message.to.name, at) {
                    // No answer: the initiator's connect fails when one would have come back.
                    let event = Event::Unreachable { to: message.from.clone(), conn: *initiator_conn };
                    return self.schedule(at + self.config.latency, event);
                }
            }
            Body::Side { .. } | Body::Close { .. } => {
                if !up {
                    return;
                }
                // A stream's bytes are held, not lost, while a partition or a pause lasts.
                let held = [
                    self.partition_end(&message.from.name, &message.to.name, at).map(|t| t + self.config.latency),
                    self.pause_end(&message.to.name, at),
                ];
                if let Some(until) = held.into_iter().flatten().max() {
                    return self.schedule(until, Event::Arrive(message));
                }
            }
        }
        let Message { from, to, body, .. } = message;
        match body {
            Body::Notification(sealed) => self.notification_arrived(at, &from, &to, &sealed),
            Body::Open { initiator_conn, listener_conn } => {
                self.side_open(at, &from, &to, initiator_conn, listener_conn)
            }
            Body::Side { conn, bytes } => self.side_bytes(at, &to, conn, &bytes),
            Body::Close { conn } => self.side_peer_closed(at, &to, conn),
        }
    }

    pub(super) fn complete(&mut self, at: Time, poster: &Endpoint, id: TransferId) {
        // A paused poster's transfer completes when it resumes: a one-sided read copies in the
        // reader's own process, and a write's completion is seen by the writer.
        let resume =
            self.pauses.iter().filter(|(who, until)| who.covers(&poster.name) && at < *until).map(|p| p.1).max();
        if let Some(resume) = resume {
            return self.schedule(resume, Event::Complete { poster: poster.clone(), id });
        }
        let Some(agent) = self.agent_mut(poster) else { return };
        let Some(Transfer::InFlight { request, peer, doom, spoil, completes }) = agent.transfers.remove(&id) else {
            return;
        };
        let doom = doom.or_else(|| self.severed(poster, &peer));
        let status = match doom.map_or_else(|| self.copy(poster, &peer, &request), Err) {
            Ok(()) => {
                let spoiled: u64 = spoil.iter().map(|s| s.1).sum();
                if let Some(completes) = completes {
                    let landed = request.bytes().saturating_sub(spoiled);
                    *self.moved.entry((poster.name.clone(), completes)).or_insert(0) += landed;
                }
                if spoil.is_empty() {
                    self.stats.transfers_done += 1;
                    if let Some(payload) = request.notification {
                        let body = Body::Notification(payload);
                        self.send(Message { from: poster.clone(), to: peer, sent_at: at, body });
                    }
                    TransferStatus::Done
                } else {
                    // The bytes landed but those of the spoiled ranges, which hold garbage.
                    self.stats.transfers_failed += 1;
                    if let Some(local) = self.agent(poster) {
                        for &(addr, len) in &spoil {
                            local.heap.write_at(addr, &vec![0xEE; len as usize]);
                        }
                    }
                    let reason = "injected failure part-way".to_owned();
                    TransferStatus::Failed(TransportError::PartlyFailed { reason, spoiled: spoil })
                }
            }
            Err(reason) => {
                self.stats.transfers_failed += 1;
                TransferStatus::Failed(TransportError::TransferFailed(reason))
            }
        };
        if let Some(agent) = self.agent_mut(poster) {
            agent.transfers.insert(id, Transfer::Finished(status));
        }
    }

    /// Copies a transfer's bytes now, all or nothing.
    pub(super) fn copy(&self, poster: &Endpoint, peer: &Endpoint, request: &TransferRequest) -> Result<(), String> {
        let (Some(local), Some(remote)) = (self.agent(poster), self.agent(peer)) else {
            return Err(format!("peer {} is down", peer.name));
        };
        // A region deregistered in flight fails the transfer, as the port promises.
        validate(&request.pairs, &local.regions, Some(&remote.regions)).map_err(|e| e.to_string())?;
        let (source, target) = match request.op {
            TransferOp::Read => (&remote.heap, &local.heap),
            TransferOp::Write => (&local.heap, &remote.heap),
        };
        let ends = |pair: &DescriptorPair| match request.op {
            TransferOp::Read => (pair.remote_addr, pair.local_addr),
            TransferOp::Write => (pair.local_addr, pair.remote_addr),
        };
        // Read every source range before writing any, so overlapping ranges copy what was there.
        let mut chunks = Vec::with_capacity(request.pairs.len());
        for pair in &request.pairs {
            let (from, to) = ends(pair);
            let bytes = source.read_at(from, pair.len).ok_or("registered memory was freed in flight")?;
            if !target.contains(to, pair.len) {
                return Err("registered memory was freed in flight".to_owned());
            }
            chunks.push((to, bytes));
        }
        for (to, bytes) in chunks {
            target.write_at(to, &bytes);
        }
        Ok(())
    }

    /// Stops one agent; transfers it posted fail now, transfers posted to it fail at completion.
    pub(super) fn crash_one(&mut self, victim: &Endpoint, detect: bool, now: Time) {
        let Some(agent) = self.agent_mut(victim) else { return };
        agent.up = false;
        agent.regions.clear();
        agent.peers.clear();
        agent.events.clear();
        let conns = std::mem::take(&mut agent.conns);
        let mut failed = 0;
        for transfer in agent.transfers.values_mut() {
            if matches!(transfer, Transfer::InFlight { .. }) {
                let error = TransportError::TransferFailed(format!("{} crashed", victim.name));
                *transfer = Transfer::Finished(TransferStatus::Failed(error));
                failed += 1;
            }
        }
        self.stats.transfers_failed += failed;
        if !detect {
            return;
        }
        for conn in conns.into_values() {
            self.close_behind(victim, conn, now);
        }
    }
}
