//! The faults a run makes: a D engine killed (loudly, or silently as a host dies) and restarted, engines and the router stopped with SIGSTOP, P killed mid-write and restarted; with a model, the requests lost sent again.

use super::*;

/// How long P, told to die right after its next write, has to post one before it is killed
/// outright (and the run fails: it proved nothing about a write in flight).
pub(super) const DYING_WITHIN: Duration = Duration::from_secs(10);

/// How many times, at most, a request of a run with a model is sent, and how long after its
/// loss it is sent again (see [`Demo::send_again`]).
const SENDS: usize = 3;
const RESEND_AFTER: Duration = Duration::from_millis(250);

impl Demo {
    /// The D engine killed part-way.
    pub(super) fn victim(&self) -> String {
        format!("decode{}", self.config.decoders - 1)
    }

    pub(super) fn kill_decode(&mut self) -> Result<()> {
        let engine = self.victim();
        let silent = self.config.kill_silently;
        // Its counters die with it: read them first (before a silent death's cut, too).
        self.scrape(&engine);
        let mut at_ns = wall_ns();
        if silent {
            // As a host whose cable is pulled: its sockets close without a FIN reaching
            // anyone, then it dies.
            let network = self.network.as_ref().context("--kill-silently without namespaces")?;
            network.cut(&engine)?;
            at_ns = wall_ns();
            std::thread::sleep(SILENT_KILL_AFTER);
        }
        let node = self.nodes.get_mut(&engine).expect("started");
        // Not waited for here: the kernel takes 10 to 15 ms to tear down an engine with its
        // pool, and the router serves the other engines meanwhile. `spawn` reaps it before the
        // restart, and `shutdown` at the end.
        node.child.kill().with_context(|| format!("cannot kill {engine}"))?;
        let instance = node.instance;
        if silent {
            // Nobody can tell yet: the router goes on routing to it until its registration
            // lapses, and P goes on exporting for it.
            self.kill = Some(Kill { engine: engine.clone(), instance, at_ns, restart_at: None, silent });
            self.progress.set_message(format!("{engine} died silently"));
            return Ok(());
        }
        at_ns = wall_ns();
        node.port = None;
        self.progress.set_message(format!("killed {engine}"));
        self.lose_requests_of(&engine, instance);
        let restart_at = Some(Instant::now() + Duration::from_millis(500));
        self.kill = Some(Kill { engine, instance, at_ns, restart_at, silent });
        Ok(())
    }

    /// With a model, a request that ended without D's tokens (lost with a killed engine) is
    /// sent again, as a new request with the same prompt, up to [`SENDS`] times in all.
    pub(super) fn send_again(&mut self, request: Request) {
        let Some(prompt_ids) = request.prompt_ids else { return };
        let sends = self.model_requests.get(&request.original).map_or(0, |m| m.sent_as.len());
        if sends >= SENDS {
            return;
        }
        let id = format!("{}-again{sends}", request.original);
        let again = Request { id, fate: Fate::Normal, prompt_ids: Some(prompt_ids), ..request };
        // Not at once: a D engine can hear of P's death before the router does, and a request
        // sent meanwhile would go to the dead P.
        self.resends.push_back((Instant::now() + RESEND_AFTER, again));
        self.next_request += 1;
        self.progress.inc_length(1);
    }

    /// The requests that went to an engine incarnation now gone are lost with it; the router
    /// does not retry them (with a model, it sends them again: [`Demo::send_again`]).
    pub(super) fn lose_requests_of(&mut self, engine: &str, instance: u64) {
        let lost: Vec<String> = self
            .tracks
            .iter()
            .filter(|(_, t)| {
                t.outcome.is_none() && t.decode.as_ref().is_some_and(|(e, i)| e == engine && *i == instance)
            })
            .map(|(id, _)| id.clone())
            .collect();
        for id in lost {
            self.finish_export(&id, "lost", None);
        }
    }

    /// Stops the next engine due, or resumes the stopped one when its time is up.
    pub(super) fn pause_if_due(&mut self, now: Instant) -> Result<()> {
        if let Some((pause, pid, until, began)) = &self.paused {
            if now >= *until {
                if pause.engine != ROUTER {
                    signal(*pid, "CONT")?;
                }
                self.progress.set_message(format!("resumed {}", pause.engine));
                self.paused_done.push((pause.clone(), *began, wall_ns()));
                self.paused = None;
            }
            return Ok(());
        }
        // Nothing is stopped while P is told to die at its next write: a stopped router sends
        // it no traffic to write for, and the kill would miss its write.
        let p_dying = self.p_kill.as_ref().is_some_and(|k| matches!(k.phase, PKillPhase::Dying(_)));
        if self.pauses.front().is_none_or(|p| p.at_issued > self.issued) || self.storm.is_some() || p_dying {
            return Ok(());
        }
        let pause = self.pauses.pop_front().expect("checked");
        if pause.engine == ROUTER {
            // This process cannot resume itself: a shell of its own stops it and resumes it.
            let (pid, secs) = (std::process::id(), pause.length.as_secs_f64());
            std::process::Command::new("sh")
                .arg("-c")
                .arg(format!("kill -STOP {pid}; sleep {secs}; kill -CONT {pid}"))
                .spawn()
                .context("the shell that stops the router")?;
            self.progress.set_message(format!("router stopped for {} ms", pause.length.as_millis()));
            let until = now + pause.length;
            self.paused = Some((pause, 0, until, wall_ns()));
            return Ok(());
        }
        // A killed engine that is not back yet cannot be stopped: skip that stop.
        let Some(node) = self.nodes.get(&pause.engine).filter(|n| n.port.is_some()) else {
            self.errors.push(format!("{} was down when it was due to be stopped", pause.engine));
            return Ok(());
        };
        signal(node.child.id(), "STOP")?;
        self.progress.set_message(format!("stopped {} for {} ms", pause.engine, pause.length.as_millis()));
        self.paused = Some((pause.clone(), node.child.id(), now + pause.length, wall_ns()));
        Ok(())
    }

    /// Whether the killed engine is not yet back up (a silently dead one stays dead), or its
    /// lapse not yet seen.
    pub(super) fn restarting(&self) -> bool {
        let p_down = self.p_kill.as_ref().is_some_and(|k| !matches!(k.phase, PKillPhase::Back))
            || self.nodes.get("prefill0").is_none_or(|n| n.port.is_none());
        p_down
            || self.kill.as_ref().is_some_and(|k| {
                if k.silent {
                    !self.lapses.iter().any(|(e, i, _)| *e == k.engine && *i == k.instance)
                } else {
                    self.nodes.get(&k.engine).is_none_or(|n| n.port.is_none())
                }
            })
    }

    /// `--kill-prefill`: reads P's counters, then tells P to kill itself with SIGKILL right
    /// after posting its next push write, so that it dies with that write into D's blocks in
    /// flight ([`Command::DieDuringWrite`]); see [`Demo::prefill_kill_progress`].
    pub(super) fn kill_prefill(&mut self) {
        self.scrape("prefill0");
        self.send("prefill0", &Command::DieDuringWrite);
        let instance = self.nodes["prefill0"].instance;
        self.p_kill = Some(PKill { instance, at_ns: 0, phase: PKillPhase::Dying(Instant::now()), mid_write: true });
        self.progress.set_message("prefill0 dies at its next write");
    }

    /// Moves a P kill on: once P is dead (or, if it posted no write within [`DYING_WITHIN`], killed
    /// outright), the requests it had not exported are lost with it (in push mode D, which
    /// registered for them, ends them itself when it sees P gone), and D engines must connect
    /// again; half a second later a new incarnation starts.
    pub(super) fn prefill_kill_progress(&mut self) -> Result<()> {
        let Some(kill) = &mut self.p_kill else { return Ok(()) };
        match kill.phase {
            PKillPhase::Dying(since) => {
                let node = self.nodes.get_mut("prefill0").expect("started");
                let dead = matches!(node.child.try_wait(), Ok(Some(_)));
                if !dead {
                    if since.elapsed() < DYING_WITHIN {
                        return Ok(());
                    }
                    kill.mid_write = false;
                    node.child.kill().context("cannot kill prefill0")?;
                    let _ = node.child.wait();
                }
                node.port = None;
                kill.at_ns = wall_ns();
                kill.phase = PKillPhase::Down(Instant::now() + Duration::from_millis(500));
                self.progress.set_message("prefill0 died");
                for node in self.nodes.values_mut().filter(|n| n.role == NodeRole::Decode) {
                    node.connected = false;
                }
                self.retries.clear();
                if !self.config.push {
                    let lost: Vec<String> = self
                        .tracks
                        .iter()
                        .filter(|(_, t)| t.outcome.is_none() && t.finished_at_ns.is_none())
                        .map(|(id, _)| id.clone())
                        .collect();
                    for id in lost {
                        self.finish_export(&id, "lost", None);
                    }
                }
            }
            PKillPhase::Down(at) if Instant::now() >= at => {
                kill.phase = PKillPhase::Back;
                let instance = kill.instance + 1;
                self.spawn(NodeRole::Prefill, "prefill0", instance)?;
                self.progress.set_message("restarted prefill0");
            }
            PKillPhase::Down(_) | PKillPhase::Back => {}
        }
        Ok(())
    }

    pub(super) fn restart_if_due(&mut self) -> Result<()> {
        let Some(kill) = &mut self.kill else { return Ok(()) };
        if kill.restart_at.is_none_or(|t| t > Instant::now()) {
            return Ok(());
        }
        kill.restart_at = None;
        let engine = kill.engine.clone();
        let instance = self.nodes[&engine].instance + 1;
        self.spawn(NodeRole::Decode, &engine, instance)?;
        self.progress.set_message(format!("restarted {engine}"));
        Ok(())
    }
}
