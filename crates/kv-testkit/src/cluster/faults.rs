//! What goes wrong in the cluster, on a scenario's or a workload's say: an engine paused and
//! resumed, crashed and restarted, its discovery registration lapsed; an intruder without the
//! key, a forged message, garbage; partitions, delays and failed transfers on the network.
//!
//! It also holds the timing invariant of peer loss, checked after every step.

use std::time::Duration;

use kv_core::{AgentName, EngineId, Message, RequestId, Role, Time, TransferOp};
use kv_sched_adapter::driver::WorkerDriver;

use super::observe::worker_counters;
use super::router::Call;
use super::{err, Cluster, ClusterError};
use crate::Scope;

/// A message a handshaked engine forges about another engine's export (a scenario's `forge`
/// `message`).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ForgedMessage {
    /// `"completion"`: the transfer is done, counting the event's `consumers`.
    Completion,
    /// `"abort"`: the consumer gave the request up.
    Abort,
    /// `"heartbeat"`: a lease renewal.
    Heartbeat,
    /// `"reject"`: the consumer rejected the request before admission.
    Reject,
}

impl Cluster {
    /// The engine stops for `for_`, as a process under SIGSTOP would: no step, no message,
    /// timer or completion handled, nothing sent; its side channel stays open. Transfers it
    /// posted complete no earlier than its resume; router calls wait for it.
    pub fn pause(&mut self, node: &str, for_: Duration) -> Result<(), ClusterError> {
        let id = EngineId::new(node);
        let up = matches!(self.prefill.get(&id), Some(Some(_))) || matches!(self.decode.get(&id), Some(Some(_)));
        if !up {
            return err(format!("{node} is not running"));
        }
        let until = self.now() + for_;
        let entry = self.paused.entry(id.clone()).or_insert((until, Vec::new()));
        entry.0 = entry.0.max(until);
        let until = entry.0;
        self.net.pause(Scope::Engine(id), until);
        self.record(format!("{node} paused until {until}"));
        Ok(())
    }

    /// Engines whose pause is over carry on, first with the router calls that waited for them.
    pub(super) fn resume_engines(&mut self, now: Time) {
        let due: Vec<EngineId> =
            self.paused.iter().filter(|(_, (until, _))| *until <= now).map(|(e, _)| e.clone()).collect();
        for id in due {
            let (until, calls) = self.paused.remove(&id).expect("due");
            self.resumed.insert(id.clone(), until);
            let node = id.as_str();
            self.record(format!("{node} resumed"));
            for call in calls {
                let result = self.call_now(node, call);
                if let Err(e) = result {
                    self.record(format!("{node}: a call that waited for the resume did not apply: {e}"));
                }
            }
        }
    }

    /// The timing invariant of peer loss: an export bound to a D incarnation that a P rank has
    /// heard is gone (its side channel closed, or a newer incarnation handshook) is released
    /// within one scheduler step and one network latency of the moment that P could hear it
    /// (a paused P hears when it resumes; a partition holds the close back).
    pub(super) fn check_release_timing(&mut self, now: Time) {
        let slack = self.config.spec.step_interval + self.config.spec.network_latency;
        let mut late = Vec::new();
        for engine in self.prefill.values().flatten().filter(|e| !self.paused.contains_key(&e.id)) {
            let resumed = self.resumed.get(&engine.id).copied().unwrap_or(Time::ZERO);
            for (rank, worker) in engine.workers.iter().enumerate() {
                let agent = AgentName::new(engine.id.clone(), rank as u32);
                for (request, owner) in worker.machine_ref().bound() {
                    let Some(heard) = self.net.heard_gone(&agent, &owner.engine, owner.instance) else { continue };
                    if now > heard.max(resumed) + slack {
                        late.push(format!(
                            "{agent} still holds {request}, bound to {owner}, which it heard was gone at {heard}"
                        ));
                    }
                }
            }
        }
        for line in late {
            self.violation(line);
        }
    }

    /// `from`, a handshaked D engine, sends `to` a well-formed message about `to`'s export
    /// `request` as if it were that export's consumer (rank 0 to rank 0).
    pub fn forge(
        &mut self,
        from: &str,
        to: &str,
        message: ForgedMessage,
        request: &RequestId,
        consumers: u32,
    ) -> Result<(), ClusterError> {
        let to_agent = AgentName::new(EngineId::new(to), 0);
        let message = match message {
            ForgedMessage::Completion => {
                Message::Completion { request: request.clone(), expected_consumers: consumers }
            }
            ForgedMessage::Abort => Message::Abort { request: request.clone() },
            ForgedMessage::Heartbeat => Message::Heartbeat { requests: vec![request.clone()] },
            ForgedMessage::Reject => Message::Rejection { request: request.clone() },
        };
        self.send_as(from, to, &message)?;
        self.record(format!("{from} forged {message:?} to {to_agent}"));
        Ok(())
    }

    /// D engine `from`'s rank 0 sends `message` to `to`'s rank 0 over its authenticated
    /// session, as that engine itself could: for tests of messages no scenario event makes (a
    /// push registration sent twice).
    pub fn send_as(&mut self, from: &str, to: &str, message: &Message) -> Result<(), ClusterError> {
        let to_agent = AgentName::new(EngineId::new(to), 0);
        let payload = message.encode().map_err(|e| ClusterError(e.to_string()))?;
        let engine = self.decode_engine(from)?;
        let transport = engine.workers[0].transport();
        transport
            .send_notification(&to_agent, &payload)
            .map_err(|e| ClusterError(format!("{from} cannot speak to {to_agent}: {e}")))
    }

    /// An engine stops; with `detect`, its peers see its side channel close.
    pub fn crash(&mut self, node: &str, detect: bool) -> Result<(), ClusterError> {
        let id = EngineId::new(node);
        // A paused process can be killed; what waited for it is lost with it.
        self.paused.remove(&id);
        self.net.crash(Scope::Engine(id.clone()), detect);
        let retired = match (self.prefill.get_mut(&id), self.decode.get_mut(&id)) {
            (Some(slot), _) => slot.take().map(|e| worker_counters(&e.workers)),
            (_, Some(slot)) => slot.take().map(|e| worker_counters(&e.workers)),
            _ => return err(format!("no engine {node}")),
        };
        let Some(retired) = retired else { return err(format!("{node} is already down")) };
        self.history.entry(id).or_default().retired.add(&retired);
        self.record(format!("{node} crashed detect={detect}"));
        Ok(())
    }

    /// A crashed engine comes back empty.
    pub fn restart(&mut self, node: &str) -> Result<(), ClusterError> {
        let id = EngineId::new(node);
        if self.prefill.get(&id).is_some_and(Option::is_none) {
            let engine = self.start_prefill(&id)?;
            // The router keeps P's old transfer parameters, as a real one would: D must notice
            // that the incarnation that exported them is gone.
            self.prefill.insert(id.clone(), Some(engine));
        } else if self.decode.get(&id).is_some_and(Option::is_none) {
            let engine = self.start_decode(&id)?;
            self.decode.insert(id.clone(), Some(engine));
        } else {
            return err(format!("{node} is not down"));
        }
        self.record(format!("{node} restarted"));
        Ok(())
    }

    /// Discovery's registration of engine `node` lapsed, as an etcd lease does when its host
    /// dies without closing its sockets: every other engine that is up learns, through
    /// [`WorkerDriver::engine_lost`] on each of its TP ranks, that `node`'s current incarnation
    /// (and every older one) is gone, and its scheduler side gets the reports. A paused engine
    /// learns it when it resumes. Nothing is crashed or cut off: a scenario pairs this with a
    /// silent crash or a partition.
    pub fn lapse(&mut self, node: &str) -> Result<(), ClusterError> {
        let lost = EngineId::new(node);
        if !self.prefill.contains_key(&lost) && !self.decode.contains_key(&lost) {
            return err(format!("no engine {node} whose registration could lapse"));
        }
        let instance = self.instance(&lost);
        self.record(format!("{node} registration lapsed: incarnation {instance} is gone"));
        let up: Vec<EngineId> = self
            .prefill
            .iter()
            .filter_map(|(id, e)| e.as_ref().map(|_| id))
            .chain(self.decode.iter().filter_map(|(id, e)| e.as_ref().map(|_| id)))
            .filter(|id| **id != lost)
            .cloned()
            .collect();
        for id in up {
            let call = Call::EngineLost { engine: lost.clone(), instance };
            if let Some((_, waiting)) = self.paused.get_mut(&id) {
                waiting.push(call);
                self.record(format!("{id} is paused; it hears of the lapse when it resumes"));
            } else {
                self.call_now(id.as_str(), call)?;
            }
        }
        Ok(())
    }

    /// Engine `node`, up and running, hears from discovery that incarnation `instance` of
    /// `lost`, and every older one, is gone.
    pub(super) fn engine_lost_now(&mut self, node: &str, lost: &EngineId, instance: u64) -> Result<(), ClusterError> {
        let id = EngineId::new(node);
        let (now, local) = (self.now(), self.engine_now(node));
        if let Some(slot) = self.prefill.get_mut(&id) {
            let Some(mut engine) = slot.take() else { return err(format!("{node} is down")) };
            let input = |w: &mut WorkerDriver<_>| w.engine_lost(local, lost, instance);
            self.drive_ranks(&id, now, &mut engine.workers, input, |rank, report| {
                engine.scheduler.handle_report(rank, report)
            });
            self.drain_prefill(&mut engine, now);
            self.prefill.insert(id, Some(engine));
        } else if let Some(slot) = self.decode.get_mut(&id) {
            let Some(mut engine) = slot.take() else { return err(format!("{node} is down")) };
            let input = |w: &mut WorkerDriver<_>| w.engine_lost(local, lost, instance);
            self.drive_ranks(&id, now, &mut engine.workers, input, |rank, report| {
                engine.scheduler.handle_report(rank, report)
            });
            self.drain_decode(&mut engine, now);
            self.decode.insert(id, Some(engine));
        } else {
            return err(format!("no engine {node}"));
        }
        self.record(format!("{node} heard that {lost} incarnation {instance} is gone"));
        // The transport reports the agents it dropped as lost at the engine's next step.
        self.dirty_since.get_or_insert(now);
        Ok(())
    }

    /// A peer without the cluster key opens `to`'s side channel (its rank 0) claiming to be
    /// engine `claimed` (as a newer incarnation, rank 0), tries the handshake, and hangs up.
    pub fn intrude(&mut self, to: &str, claimed: &str) -> Result<(), ClusterError> {
        let to_id = EngineId::new(to);
        if !self.prefill.contains_key(&to_id) && !self.decode.contains_key(&to_id) {
            return err(format!("no engine {to}"));
        }
        let claimed_id = EngineId::new(claimed);
        let role = if self.prefill.contains_key(&claimed_id) { Role::Prefill } else { Role::Decode };
        let spec = &self.config.spec;
        let layout = self.config.layout(spec.block_size(role));
        let mut claim = crate::offer(&AgentName::new(claimed_id.clone(), 0), role, spec.tp_size(role), layout);
        claim.instance = self.instance(&claimed_id) + 1;
        self.net.intrude(&Self::address(&to_id, 0), claim).map_err(|e| ClusterError(e.to_string()))?;
        self.record(format!("an intruder without the key claims {claimed} at {to}"));
        Ok(())
    }

    /// Every message between `a` and `b` is dropped until `until`.
    pub fn partition(&mut self, a: &str, b: &str, until: Time) {
        self.net.partition(Scope::Engine(EngineId::new(a)), Scope::Engine(EngineId::new(b)), until);
        self.record(format!("partition {a} {b} until {until}"));
    }

    /// Every message from `a` to `b` sent before `until` arrives `by` later.
    pub fn delay(&mut self, a: &str, b: &str, by: Duration, until: Time) {
        self.net.delay(Scope::Engine(EngineId::new(a)), Scope::Engine(EngineId::new(b)), by, until);
        self.record(format!("delay {a} {b} by {by:?} until {until}"));
    }

    /// The next read or write `node` posts for `request` (D's id or P's, or either's base) fails.
    pub fn fail_transfer(&mut self, node: &str, request: &RequestId) {
        self.record(format!("fail next transfer of {node} for {request}"));
        let engine = EngineId::new(node);
        // A read's completion names P's id; D's request may name it differently.
        let mut names = vec![request.clone()];
        if let Some(Some(d)) = self.decode.get(&engine) {
            if let Some(load) = d.loads.get(request) {
                names.push(load.remote.request.clone());
            }
        }
        self.net.fail_transfer_when(move |poster, transfer| {
            if poster.engine != engine {
                return false;
            }
            let named = transfer.notification.as_deref().and_then(Message::completed_request);
            let matches = named.is_some_and(|r| names.iter().any(|n| r == *n || r.base() == n.base()));
            matches && matches!(transfer.op, TransferOp::Read | TransferOp::Write)
        });
    }

    /// The next read `node` (a D engine) posts for `request` fails part-way: the blocks before
    /// D block `from_block` of the prompt arrive intact, those from it on get garbage, and the
    /// transport says which ([`kv_core::TransportError::PartlyFailed`]). D's blocks are known
    /// once it schedules the request, so the fault is armed then if it has not been yet. On a
    /// P engine (a push write), the write fails whole: D cannot tell which of P's one-sided
    /// writes landed.
    pub fn fail_transfer_from(&mut self, node: &str, request: &RequestId, from_block: u32) {
        let engine = EngineId::new(node);
        if !self.decode.contains_key(&engine) {
            return self.fail_transfer(node, request);
        }
        self.record(format!("fail next read of {node} for {request} from block {from_block}"));
        self.spoils.insert((engine, request.clone()), from_block);
        self.arm_spoil(node, request);
    }

    /// Arms a part-way failure of `node`'s next read for `request` once its blocks are known.
    pub(super) fn arm_spoil(&mut self, node: &str, request: &RequestId) {
        let engine = EngineId::new(node);
        let Some(Some(d)) = self.decode.get(&engine) else { return };
        let Some(load) = d.loads.get(request).filter(|l| !l.blocks.is_empty()) else { return };
        let Some(from) = self.spoils.remove(&(engine.clone(), request.clone())) else { return };
        let spoiled = load.blocks.get(from as usize..).unwrap_or(&[]);
        let ranges: Vec<Vec<(u64, u64)>> = d.ranks.iter().map(|r| r.block_ranges(spoiled)).collect();
        let p_request = load.remote.request.clone();
        self.net.spoil_transfer_when(move |poster, transfer| {
            let named = transfer.notification.as_deref().and_then(Message::completed_request);
            let ours = named.as_ref() == Some(&p_request);
            (poster.engine == engine && ours).then(|| ranges.get(poster.rank as usize).cloned()).flatten()
        });
    }

    /// `from` sends `to` a notification with this payload.
    pub fn garbage(&mut self, from: &str, to: &str, bytes: &[u8]) {
        let from = AgentName::new(EngineId::new(from), 0);
        let to = AgentName::new(EngineId::new(to), 0);
        self.net.inject(&from, &to, bytes.to_vec());
        self.record(format!("garbage {from} -> {to}"));
    }
}
