//! What a scenario's expectations, a random run's invariants and a test read back from the
//! cluster: blocks held, exports pending, release reasons, D's request states, counters
//! (crashed incarnations included) and violations.

use std::collections::BTreeSet;

use kv_core::{AgentName, BlockId, EngineId, RequestId};
use kv_sched_adapter::driver::{WorkerDriver, WorkerMachine};
use kv_sched_adapter::{Counters, DecodeState, ReleaseReason, RemoteRef};

use super::{Cluster, DecodeEngine, DecodeLoad};

/// The counters of an engine's workers, summed over its TP ranks.
pub(super) fn worker_counters<M: WorkerMachine>(workers: &[WorkerDriver<M>]) -> Counters {
    let mut total = Counters::default();
    for w in workers {
        total.add(&w.machine_ref().counters());
    }
    total
}

impl Cluster {
    /// Logical blocks an engine holds for export (P) or for loads (D); 0 when down.
    pub fn held_blocks(&self, node: &str) -> u64 {
        let id = EngineId::new(node);
        if let Some(engine) = self.prefill.get(&id) {
            return engine.as_ref().map_or(0, |e| e.pool.held() as u64);
        }
        if let Some(Some(engine)) = self.decode.get(&id) {
            let held: BTreeSet<BlockId> = engine.scheduler.held_blocks().collect();
            return held.len() as u64;
        }
        0
    }

    /// The sizes of the tables of P engine `node`'s worker `rank`; `None` when it is down.
    pub fn prefill_book(&self, node: &str, rank: usize) -> Option<kv_sched_adapter::PrefillBook> {
        let engine = self.prefill.get(&EngineId::new(node))?.as_ref()?;
        Some(engine.workers.get(rank)?.machine_ref().book())
    }

    /// The transfer parameters P engine `node` handed the router for its export `request`:
    /// its lease deadline and finish time are on P's clock.
    pub fn transfer_params(&self, node: &str, request: &RequestId) -> Option<&RemoteRef> {
        self.exports.get(&(EngineId::new(node), request.clone()))
    }

    /// Exports a P engine has not freed.
    pub fn pending_exports(&self, node: &str) -> u64 {
        match self.prefill.get(&EngineId::new(node)) {
            Some(Some(e)) => e.scheduler.pending() as u64,
            _ => 0,
        }
    }

    /// Why a P engine released an export, if it did.
    pub fn release_reason(&self, node: &str, request: &RequestId) -> Option<ReleaseReason> {
        self.history.get(&EngineId::new(node)).and_then(|h| h.released.get(request).copied())
    }

    /// Why any P engine released an export of this id, prefill engines in name order.
    pub fn release_reason_anywhere(&self, request: &RequestId) -> Option<ReleaseReason> {
        self.prefill.keys().find_map(|e| self.release_reason(e.as_str(), request))
    }

    /// Where a request stands on a D engine.
    pub fn decode_state(&self, node: &str, request: &RequestId) -> Option<DecodeState> {
        match self.decode.get(&EngineId::new(node)) {
            Some(Some(e)) => e.scheduler.state(request).or_else(|| e.ended.get(request).copied()),
            _ => None,
        }
    }

    /// Of a request whose load ended on a D engine: the D blocks it loaded from P (those its
    /// prefix cache held not counted), and the tokens of valid KV it kept.
    pub fn loaded(&self, node: &str, request: &RequestId) -> Option<(u64, u64)> {
        match self.decode.get(&EngineId::new(node)) {
            Some(Some(e)) => e.loaded.get(request).copied(),
            _ => None,
        }
    }

    /// The logical D blocks a load really read: the bytes its reads landed whole (counted by the
    /// network, whatever the connector believes), over the bytes of one block; a logical block
    /// counts once every D rank has its part. For a load that ended `whole`, a block clipped
    /// to the prompt counts; otherwise only blocks landed whole do.
    pub(super) fn blocks_read(
        &self,
        engine: &DecodeEngine,
        request: &RequestId,
        load: &DecodeLoad,
        whole: bool,
    ) -> u64 {
        let round = |bytes: u64, block: u64| if whole { bytes.div_ceil(block.max(1)) } else { bytes / block.max(1) };
        // Pull: each D rank's reads, whose completions name P's request.
        let pulled = (0..engine.ranks.len() as u32).map(|r| {
            let bytes = self.net.moved(&AgentName::new(engine.id.clone(), r), &load.remote.request);
            round(bytes, engine.ranks[r as usize].block_bytes())
        });
        let pulled = pulled.min().unwrap_or(0);
        // Push: P's writes, every P worker's (each stage's ranks) into every D rank's blocks,
        // which name D's request.
        let pushed: u64 = (0..load.remote.prefill.tp_size * load.remote.prefill.pp_size)
            .map(|r| self.net.moved(&AgentName::new(load.remote.prefill.engine.clone(), r), request))
            .sum();
        let block: u64 = engine.ranks.iter().map(|r| r.block_bytes()).sum();
        pulled.max(round(pushed, block))
    }

    /// The blocks a D engine allocated for a request it is loading.
    pub fn decode_blocks(&self, node: &str, request: &RequestId) -> Option<Vec<BlockId>> {
        match self.decode.get(&EngineId::new(node)) {
            Some(Some(e)) => e.loads.get(request).map(|l| l.blocks.clone()),
            _ => None,
        }
    }

    /// Every engine's counters, crashed incarnations included.
    pub fn counters(&self) -> Counters {
        let mut total = Counters::default();
        for h in self.history.values() {
            total.add(&h.retired);
        }
        for e in self.prefill.values().flatten() {
            total.add(&worker_counters(&e.workers));
        }
        for e in self.decode.values().flatten() {
            total.add(&worker_counters(&e.workers));
        }
        total
    }

    /// One P engine's counters, crashed incarnations included.
    pub fn engine_counters(&self, node: &str) -> Counters {
        let id = EngineId::new(node);
        let mut total = self.history.get(&id).map(|h| h.retired).unwrap_or_default();
        if let Some(Some(e)) = self.prefill.get(&id) {
            total.add(&worker_counters(&e.workers));
        }
        if let Some(Some(e)) = self.decode.get(&id) {
            total.add(&worker_counters(&e.workers));
        }
        total
    }

    /// Invariant violations seen so far (blocks freed twice, writes into freed blocks, ...).
    pub fn violations(&self) -> &[String] {
        &self.violations
    }

    /// Whether anything is still pending on an engine that is up.
    pub fn busy(&self) -> bool {
        self.prefill.values().flatten().any(|e| e.scheduler.pending() > 0 || e.pool.held() > 0)
            || self.decode.values().flatten().any(|e| e.scheduler.pending() > 0 || e.pool.held() > 0)
    }

    /// Blocks held on engines that are up, by engine, for the drain check.
    pub fn held_everywhere(&self) -> Vec<(String, u64)> {
        let names: Vec<String> = self.prefill.keys().chain(self.decode.keys()).map(|e| e.as_str().to_owned()).collect();
        names.into_iter().map(|n| (n.clone(), self.held_blocks(&n))).filter(|(_, h)| *h > 0).collect()
    }

    /// P ranks each rank of D engine `node` has completed a handshake with, by rank (empty
    /// when it is down).
    pub fn connected_prefill_ranks(&self, node: &str) -> Vec<usize> {
        let engine = self.decode.get(&kv_core::EngineId::new(node)).and_then(Option::as_ref);
        engine.map_or_else(Vec::new, |e| e.workers.iter().map(|w| w.machine_ref().connected_peers()).collect())
    }

    /// The state of every D worker, for debugging a failed run.
    pub fn describe_decode_workers(&self) -> String {
        let mut out = String::new();
        for e in self.decode.values().flatten() {
            for w in &e.workers {
                out.push_str(&format!("{:#?}\n", w.machine_ref()));
            }
        }
        out
    }
}
