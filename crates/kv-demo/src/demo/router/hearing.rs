//! What the router hears: each engine's events (ready, exported, freed, outcomes, transfers, stats, errors), the attacker's results and storms, and the etcd watch's sightings.

use super::*;

impl Demo {
    pub(super) fn on_event(&mut self, name: &str, instance: u64, from: FromNode) {
        let from = match from {
            FromNode::Sighting(sighting) => return self.on_sighting(sighting),
            FromNode::Attack(result) => {
                self.progress.set_message(format!("attack {}", result.attack));
                return self.attacks.push(result);
            }
            FromNode::Storm(notice) => {
                self.progress.set_message(format!(
                    "storm {} {}",
                    notice.storm,
                    if notice.active { "begins" } else { "ended" }
                ));
                self.storm = notice.active.then_some(notice.storm);
                return;
            }
            FromNode::AttackerExited => {
                if let Some(mut child) = self.attacker.take() {
                    match child.wait() {
                        Ok(status) if status.success() => {}
                        status => self.errors.push(format!("the attacker failed: {status:?}")),
                    }
                }
                return;
            }
            FromNode::Event(Event::Error { message }) if name == ATTACKER => return self.errors.push(message),
            other => other,
        };
        let current = self.nodes.get(name).is_some_and(|n| n.instance == instance);
        let event = match from {
            FromNode::Exited => {
                let killed = self.kill.as_ref().is_some_and(|k| k.engine == name && k.instance == instance)
                    || (name == "prefill0" && self.p_kill.as_ref().is_some_and(|k| k.instance == instance));
                if current && self.nodes.get(name).is_some_and(|n| n.port.is_some()) && !killed {
                    self.errors.push(format!("{name} (instance {instance}) exited unexpectedly"));
                    if let Some(node) = self.nodes.get_mut(name) {
                        node.port = None;
                    }
                }
                return;
            }
            FromNode::Event(event) => event,
            FromNode::Attack(_) | FromNode::Storm(_) | FromNode::AttackerExited | FromNode::Sighting(_) => return,
        };
        if !current {
            // A killed incarnation's last words.
            return;
        }
        match event {
            Event::Ready { ports, metrics_port } => {
                let metrics = metrics_port.map(|port| std::net::SocketAddr::from((self.host_ip(name), port)));
                if let Some(node) = self.nodes.get_mut(name) {
                    node.port = ports.first().copied();
                    node.ports = ports;
                    node.metrics = metrics;
                }
                // A D engine connects to P ahead of the first request it gets: otherwise the
                // first requests to each D engine (each incarnation) wait for the handshake,
                // P's NIXL metadata and the UCX endpoint. P's own `Ready` reaches every D
                // engine up by then.
                let role = self.nodes.get(name).map(|n| n.role);
                if role == Some(NodeRole::Decode) && self.nodes.get("prefill0").is_some_and(|p| p.port.is_some()) {
                    self.connect_ahead(name);
                } else if role == Some(NodeRole::Prefill) {
                    let decodes: Vec<String> = self
                        .nodes
                        .iter()
                        .filter(|(_, n)| n.role == NodeRole::Decode && n.port.is_some())
                        .map(|(d, _)| d.clone())
                        .collect();
                    for decode in decodes {
                        self.connect_ahead(&decode);
                    }
                }
                if let Some(addr) = metrics {
                    self.announce_metrics(name, instance, addr);
                }
            }
            Event::Exported { id, remote, finished_at_ns, first } => {
                let export = remote.request.as_str().to_owned();
                let fate = self.open.get(&id).map_or(Fate::Normal, |(r, _)| r.fate);
                let track = self.tracks.entry(export.clone()).or_default();
                track.finished_at_ns = Some(finished_at_ns);
                track.exported_by = instance;
                track.first = first;
                let undone = track.outcome.is_none();
                // Push: D heard of the request before P chose its first token; it hears it now.
                if let (true, Some(first), Some((decode, of))) =
                    (self.config.push && undone, first, track.decode.clone())
                {
                    if self.nodes.get(&decode).is_some_and(|n| n.instance == of && n.port.is_some()) {
                        self.send(&decode, &Command::FirstToken { id: export.clone(), token: first.token });
                    }
                }
                // Sibling 0 goes to D; so do the others when D rejects the whole request.
                if !self.config.push && (undone || fate == Fate::Reject) {
                    self.dispatch(&export, &id, remote, fate);
                }
            }
            Event::Busy { id } => self.retries.push_back((Instant::now() + Duration::from_millis(20), id)),
            Event::Freed { id, reason, at_ns } => {
                let track = self.tracks.entry(id).or_default();
                track.freed = Some((reason.as_str().to_owned(), at_ns));
                track.freed_by = instance;
            }
            Event::Outcome { id, outcome, ready_at_ns, scrub_check_ns, prepared_at_ns, generated, .. } => {
                let outcome = outcome.as_str();
                let track = self.tracks.get(&id);
                let from_here = track.and_then(|t| t.decode.as_ref()).is_some_and(|(d, i)| d == name && *i == instance);
                if from_here && track.is_some_and(|t| t.outcome.is_none()) {
                    let ready = (outcome == "ok" || outcome == "corrupt").then_some(ready_at_ns);
                    if outcome == "ok" {
                        self.ready_at.push(wall_ns());
                    }
                    if let Some(track) = self.tracks.get_mut(&id) {
                        track.scrub_check_ns = scrub_check_ns;
                        track.prepared_at_ns = prepared_at_ns;
                        track.generated = generated;
                    }
                    self.finish_export(&id, outcome, ready);
                }
            }
            Event::Transfer { bytes, took_ns, ok, request, completes } => {
                self.transfers.push((bytes, took_ns, ok));
                self.transfer_at.push((wall_ns(), ok));
                if let Some(track) = request.filter(|_| ok).and_then(|r| self.tracks.get_mut(&r)) {
                    track.bytes_read += bytes;
                    if completes {
                        track.completing_ns = track.completing_ns.max(took_ns);
                    }
                }
            }
            Event::Stats { connected, .. } => {
                if let Some(node) = self.nodes.get_mut(name) {
                    node.connected |= !connected.is_empty() && connected.iter().all(|&c| c > 0);
                }
            }
            Event::Error { message } => self.errors.push(format!("{name}: {message}")),
        }
    }

    /// What the router's watch on etcd saw. An engine whose registration goes while it runs
    /// is lost: the router stops routing to it (its lapse after a silent death is expected;
    /// any other is an error of the run).
    pub(super) fn on_sighting(&mut self, sighting: Sighting) {
        match sighting {
            Sighting::Watching => {}
            Sighting::Up { engine, instance, addresses, .. } => {
                self.registry.insert(engine, (instance, addresses));
            }
            Sighting::Down { engine, instance, at_ns } => {
                if self.registry.get(&engine).is_some_and(|(i, _)| *i == instance) {
                    self.registry.remove(&engine);
                }
                self.lapses.push((engine.clone(), instance, at_ns));
                let expected = self.kill.as_ref().is_some_and(|k| k.engine == engine && k.instance == instance);
                let Some(node) = self.nodes.get_mut(&engine).filter(|n| n.instance == instance) else { return };
                if node.port.take().is_some() && !expected {
                    self.errors
                        .push(format!("{engine} (instance {instance}) lost its etcd registration while running"));
                }
                self.progress.set_message(format!("{engine}'s registration is gone"));
                self.lose_requests_of(&engine, instance);
            }
            Sighting::Error { message } => self.errors.push(format!("kvflow-watch: {message}")),
        }
    }
}
