//! The router's calls on the cluster: P runs a prompt and exports it; D has a request arrive,
//! schedules its load, rejects it or aborts it.
//!
//! A call to a D engine that is paused (see `faults.rs`) waits for its resume.

use kv_core::{EngineId, RequestId, Role};
use kv_sched_adapter::{Consumer, LayerProgress, Mode, RemoteRef};

use super::oracle::{self, Computed};
use super::{err, fnv, Cluster, ClusterError, DecodeEngine, DecodeLoad, PrefillEngine, Prompt};

/// A call on an engine from outside it: the router's on a D engine (`Arrive`, `Schedule`,
/// `Reject`, `Abort`), a P engine's own chunked prefill going on (`Progress`,
/// `FinishPrefill`, `AbandonPrefill`: a paused engine computes nothing), or discovery's word
/// on any engine that incarnation `instance` of `engine`, and every older one, is gone
/// (`EngineLost`). One that reaches a paused engine waits for its resume.
#[derive(Clone, Debug)]
pub(super) enum Call {
    Arrive {
        request: RequestId,
        remote: RemoteRef,
    },
    Schedule {
        request: RequestId,
        prefix_hit: bool,
        cached_tokens: u64,
    },
    Reject {
        request: RequestId,
        remote: RemoteRef,
    },
    Abort {
        request: RequestId,
    },
    EngineLost {
        engine: EngineId,
        instance: u64,
    },
    /// On a P engine: a chunked prefill's progress, end, or giving up.
    Progress {
        request: RequestId,
        tokens: u64,
        /// Computed layer by layer: the tokens before the chunk computed in every layer, and
        /// the chunk's layers computed so far.
        part: Option<(u64, u32)>,
    },
    FinishPrefill {
        request: RequestId,
    },
    AbandonPrefill {
        request: RequestId,
    },
}

impl Cluster {
    fn prefill_engine(&mut self, node: &str) -> Result<&mut PrefillEngine, ClusterError> {
        match self.prefill.get_mut(&EngineId::new(node)) {
            Some(Some(engine)) => Ok(engine),
            Some(None) => err(format!("{node} is down")),
            None => err(format!("no prefill engine {node}")),
        }
    }

    pub(super) fn decode_engine(&mut self, node: &str) -> Result<&mut DecodeEngine, ClusterError> {
        match self.decode.get_mut(&EngineId::new(node)) {
            Some(Some(engine)) => Ok(engine),
            Some(None) => err(format!("{node} is down")),
            None => err(format!("no decode engine {node}")),
        }
    }

    /// Whether `node` is up and not paused.
    fn check_running(&self, node: &str) -> Result<(), ClusterError> {
        match self.paused.get(&EngineId::new(node)) {
            Some((until, _)) => err(format!("{node} is paused until {until}")),
            None => Ok(()),
        }
    }

    /// P runs a prompt and exports it; with `n > 1`, the siblings `0_r` .. `{n-1}_r` share its
    /// blocks. With a `consumer`, the router has already chosen that D engine (its incarnation
    /// now), and P binds the exports to it.
    pub fn prefill(
        &mut self,
        node: &str,
        request: &RequestId,
        prompt_tokens: u64,
        n: u32,
        consumer: Option<&str>,
    ) -> Result<(), ClusterError> {
        let prompt = self.compute(node, request, prompt_tokens, n, consumer)?;
        self.export(node, prompt)
    }

    /// Push: the router pairs P's `request` with D's leg of it by `transfer` (NixlPushConnector's
    /// `transfer_id`), before P runs it: D's handoff may name the export by that id.
    pub fn pair(&mut self, node: &str, request: &RequestId, transfer: &RequestId) -> Result<(), ClusterError> {
        let engine = self.prefill_engine(node)?;
        engine.scheduler.handle_pairing(request.clone(), transfer.clone()).map_err(|e| ClusterError(e.to_string()))?;
        self.transfers.insert((EngineId::new(node), transfer.clone()), request.clone());
        self.record(format!("{node} paired {request} with {transfer}"));
        Ok(())
    }

    /// P starts a chunked prefill of one prompt: it allocates the prompt's blocks and computes
    /// into them as [`Cluster::progress`] says, and exports at [`Cluster::finish_prefill`] or
    /// gives up at [`Cluster::abandon_prefill`]. In push mode the blocks it has finished are
    /// written ahead into those D registered.
    pub fn begin_prefill(
        &mut self,
        node: &str,
        request: &RequestId,
        prompt_tokens: u64,
        consumer: Option<&str>,
    ) -> Result<(), ClusterError> {
        let prompt = self.compute(node, request, prompt_tokens, 1, consumer)?;
        self.prefill_engine(node)?.computing.insert(request.clone(), prompt);
        self.record(format!("{node} computes {request}"));
        Ok(())
    }

    /// P's chunked prefill of `request` has computed its first `tokens` tokens (whole blocks
    /// of them count).
    pub fn progress(&mut self, node: &str, request: &RequestId, tokens: u64) -> Result<(), ClusterError> {
        self.call(node, Call::Progress { request: request.clone(), tokens, part: None })
    }

    /// P computes a chunk of `request` layer by layer: its first `whole_tokens` tokens are
    /// computed in every layer, and those up to `tokens` in model layers `0..layers` (whole
    /// blocks of them count).
    pub fn progress_layers(
        &mut self,
        node: &str,
        request: &RequestId,
        whole_tokens: u64,
        tokens: u64,
        layers: u32,
    ) -> Result<(), ClusterError> {
        self.call(node, Call::Progress { request: request.clone(), tokens, part: Some((whole_tokens, layers)) })
    }

    /// P finishes the chunked prefill of `request` and exports it.
    pub fn finish_prefill(&mut self, node: &str, request: &RequestId) -> Result<(), ClusterError> {
        self.call(node, Call::FinishPrefill { request: request.clone() })
    }

    /// P gives up the chunked prefill of `request` before it finished: the blocks it reported
    /// computed come back once no write ahead from them is in flight, the others at once.
    pub fn abandon_prefill(&mut self, node: &str, request: &RequestId) -> Result<(), ClusterError> {
        self.call(node, Call::AbandonPrefill { request: request.clone() })
    }

    fn progress_now(
        &mut self,
        node: &str,
        request: &RequestId,
        tokens: u64,
        part: Option<(u64, u32)>,
    ) -> Result<(), ClusterError> {
        let p_tokens = u64::from(self.config.spec.prefill_block_size);
        let engine = self.prefill_engine(node)?;
        let Some(prompt) = engine.computing.get_mut(request) else {
            return err(format!("{node} is not computing {request}"));
        };
        let blocks_of = |tokens: u64| ((tokens / p_tokens) as usize).min(prompt.blocks.len());
        let done = blocks_of(tokens);
        let part = part.map(|(whole, layers)| LayerProgress { whole: blocks_of(whole).min(done), layers });
        let line = match part {
            Some(p) => format!("{node} computed {} blocks of {request}, and {done} in {} layers", p.whole, p.layers),
            None => format!("{node} computed {done} blocks of {request}"),
        };
        if done > 0 && (done > prompt.reported || part.is_some()) {
            prompt.reported = prompt.reported.max(done);
            let (blocks, consumer) = (prompt.blocks[..done].to_vec(), prompt.consumer.clone());
            let scheduler = &mut engine.scheduler;
            match part {
                Some(part) => scheduler.handle_layer_progress(request.clone(), blocks, part, consumer),
                None => scheduler.handle_progress(request.clone(), blocks, consumer),
            }
            .map_err(|e| ClusterError(e.to_string()))?;
        }
        self.record(line);
        self.flush_prefill(node)
    }

    fn finish_now(&mut self, node: &str, request: &RequestId) -> Result<(), ClusterError> {
        let Some(prompt) = self.prefill_engine(node)?.computing.remove(request) else {
            return err(format!("{node} is not computing {request}"));
        };
        self.export(node, prompt)
    }

    fn abandon_now(&mut self, node: &str, request: &RequestId) -> Result<(), ClusterError> {
        let engine = self.prefill_engine(node)?;
        let Some(prompt) = engine.computing.remove(request) else {
            return err(format!("{node} is not computing {request}"));
        };
        if prompt.reported > 0 {
            // Those blocks come back at the scheduler's `Free`.
            engine.scheduler.handle_abandoned(request.clone()).map_err(|e| ClusterError(e.to_string()))?;
        }
        let (id, rest) = (engine.id.clone(), prompt.blocks[prompt.reported..].to_vec());
        let mut engine = self.prefill.get_mut(&id).and_then(Option::take).expect("up");
        self.free_blocks(&id, &mut engine.pool, &mut engine.ranks, &rest);
        self.prefill.insert(id, Some(engine));
        self.record(format!("{node} abandoned {request}"));
        self.flush_prefill(node)
    }

    /// P allocates a prompt's blocks and computes into them (every block at once: a chunked
    /// prefill only tells when each is finished).
    fn compute(
        &mut self,
        node: &str,
        request: &RequestId,
        prompt_tokens: u64,
        n: u32,
        consumer: Option<&str>,
    ) -> Result<Prompt, ClusterError> {
        self.check_running(node)?;
        let consumer = match consumer {
            Some(d) if self.decode.contains_key(&EngineId::new(d)) => {
                Some(Consumer { engine: EngineId::new(d), instance: self.instance(&EngineId::new(d)) })
            }
            Some(d) => return err(format!("no decode engine {d} to name as the consumer")),
            None => None,
        };
        let p_tokens = self.config.spec.prefill_block_size;
        let count = kv_core::blocks_for_tokens(prompt_tokens, p_tokens) as usize;
        if count == 0 {
            return err(format!("prefill of {request}: a prompt needs at least one token"));
        }
        self.prefills += 1;
        let generation = self.history.get(&EngineId::new(node)).map_or(0, |h| h.generation);
        let seed = fnv(&[
            node.as_bytes(),
            request.as_str().as_bytes(),
            &generation.to_le_bytes(),
            &self.prefills.to_le_bytes(),
        ]);
        let ids: Vec<RequestId> = if n > 1 {
            (0..n).map(|i| RequestId::new(format!("{i}_{request}"))).collect()
        } else {
            vec![request.clone()]
        };
        let tp = self.config.spec.prefill_tp;
        let engine = self.prefill_engine(node)?;
        if let Some(id) =
            ids.iter().find(|id| engine.export_blocks.contains_key(*id) || engine.computing.contains_key(*id))
        {
            return err(format!("{node} already exports {id}"));
        }
        let Some(blocks) = engine.pool.allocate(count) else {
            return err(format!("{node} has no {count} free blocks for {request}"));
        };
        let dirty = oracle::dirty(&engine.ranks, &blocks);
        oracle::fill(&mut engine.ranks, tp, &blocks, seed, p_tokens);
        // allocate() took one reference; each further sibling export holds its own.
        for _ in 1..ids.len() {
            engine.pool.retain(&blocks);
        }
        self.count_written_after_free(node, &dirty);
        // What P computed, known from now on: a D whose own prefix cache holds the prompt's
        // first blocks holds the same bytes, and every load is checked against it.
        let (engine_id, tokens) = (EngineId::new(node), count as u64 * u64::from(p_tokens));
        for id in &ids {
            self.computed.insert((engine_id.clone(), id.clone()), Computed { seed, tokens });
        }
        self.fill_pending_caches(&engine_id);
        Ok(Prompt { ids, blocks, prompt_tokens, consumer, reported: 0 })
    }

    /// P exports a computed prompt.
    fn export(&mut self, node: &str, prompt: Prompt) -> Result<(), ClusterError> {
        // On P's clock: the lease deadline P hands the router is on it.
        let now = self.engine_now(node);
        let Prompt { ids, blocks, prompt_tokens, consumer, .. } = prompt;
        let engine = self.prefill_engine(node)?;
        let mut refs = Vec::new();
        for id in &ids {
            let remote = engine
                .scheduler
                .handle_finished(
                    now,
                    id.clone(),
                    blocks.clone(),
                    kv_core::Prompt::len_only(prompt_tokens),
                    consumer.clone(),
                )
                .map_err(|e| ClusterError(e.to_string()))?;
            engine.export_blocks.insert(id.clone(), blocks.clone());
            refs.push((id.clone(), remote));
        }
        let engine_id = engine.id.clone();
        self.flush_prefill(node)?;
        for (id, remote) in refs {
            self.record(format!("{node} exported {id}"));
            self.exports.insert((engine_id.clone(), id), remote);
        }
        Ok(())
    }

    /// Carries out at once what a call on P set off.
    fn flush_prefill(&mut self, node: &str) -> Result<(), ClusterError> {
        let id = EngineId::new(node);
        let now = self.now();
        let mut engine = self.prefill.get_mut(&id).and_then(Option::take).expect("checked up");
        self.drain_prefill(&mut engine, now);
        self.prefill.insert(id, Some(engine));
        Ok(())
    }

    /// P engine `engine` as D reaches it: its workers' addresses, TP and PP sizes.
    fn reach(&self, engine: EngineId) -> kv_sched_adapter::PrefillEngine {
        kv_sched_adapter::PrefillEngine {
            addresses: (0..self.config.spec.workers(Role::Prefill)).map(|r| Self::address(&engine, r)).collect(),
            engine,
            tp_size: self.config.spec.prefill_tp,
            pp_size: self.config.spec.prefill_pp,
        }
    }

    fn remote_for(
        &self,
        from: &str,
        remote_request: &RequestId,
        prompt_tokens: Option<u64>,
    ) -> Result<RemoteRef, ClusterError> {
        let engine = EngineId::new(from);
        if let Some(remote) = self.exports.get(&(engine.clone(), remote_request.clone())) {
            return Ok(remote.clone());
        }
        if self.config.spec.mode == Mode::Pull {
            return err(format!("{from} has not run {remote_request}: pull mode needs P's blocks"));
        }
        let Some(prompt_tokens) = prompt_tokens else {
            return err(format!("{remote_request} arrives before {from} ran it: prompt_tokens is required"));
        };
        if !self.prefill.contains_key(&engine) {
            return err(format!("no prefill engine {from}"));
        }
        Ok(RemoteRef {
            prefill: self.reach(engine),
            request: remote_request.clone(),
            // D comes first in push mode: it cannot know P's incarnation yet.
            instance: None,
            prompt_tokens,
            prompt_digest: None,
            export: None,
            consumer: None,
        })
    }

    /// Makes a call on engine `node` (a router call on D, or P's own chunked prefill going
    /// on): now, or when it resumes if it is paused.
    fn call(&mut self, node: &str, call: Call) -> Result<(), ClusterError> {
        let on_prefill =
            matches!(call, Call::Progress { .. } | Call::FinishPrefill { .. } | Call::AbandonPrefill { .. });
        if on_prefill {
            self.prefill_engine(node)?;
        } else {
            self.decode_engine(node)?;
        }
        if let Some((_, waiting)) = self.paused.get_mut(&EngineId::new(node)) {
            waiting.push(call);
            let line = if on_prefill { "its prefill goes on when it resumes" } else { "the router's call waits" };
            self.record(format!("{node} is paused; {line}"));
            return Ok(());
        }
        self.call_now(node, call)
    }

    /// Carries out a call on engine `node`, which is running (a router call: on a D engine).
    pub(super) fn call_now(&mut self, node: &str, call: Call) -> Result<(), ClusterError> {
        match call {
            Call::Arrive { request, remote } => self.arrive_now(node, &request, remote),
            Call::Schedule { request, prefix_hit, cached_tokens } => {
                self.schedule_now(node, &request, prefix_hit, cached_tokens)
            }
            Call::Reject { request, remote } => self.reject_now(node, &request, remote),
            Call::Abort { request } => self.abort_now(node, &request),
            Call::EngineLost { engine, instance } => self.engine_lost_now(node, &engine, instance),
            Call::Progress { request, tokens, part } => self.progress_now(node, &request, tokens, part),
            Call::FinishPrefill { request } => self.finish_now(node, &request),
            Call::AbandonPrefill { request } => self.abandon_now(node, &request),
        }
    }

    /// D engine `node`, which must be running, connects to P engine `from` ahead of any
    /// request (`DecodeScheduler::handle_connect`).
    pub fn connect_ahead(&mut self, node: &str, from: &str) -> Result<(), ClusterError> {
        let engine = EngineId::new(from);
        if !self.prefill.contains_key(&engine) {
            return err(format!("no prefill engine {from}"));
        }
        let prefill = self.reach(engine);
        self.decode_engine(node)?.scheduler.handle_connect(prefill);
        self.record(format!("{node} connects ahead to {from}"));
        self.flush_decode(node)
    }

    /// A request carrying P's parameters enters D's waiting queue; `prefill_pp`, when given, is the
    /// pipeline stages the parameters claim for P instead of its own.
    pub fn arrive(
        &mut self,
        node: &str,
        request: &RequestId,
        from: &str,
        remote_request: &RequestId,
        prompt_tokens: Option<u64>,
        prefill_pp: Option<u32>,
    ) -> Result<(), ClusterError> {
        let mut remote = self.remote_for(from, remote_request, prompt_tokens)?;
        remote.prefill.pp_size = prefill_pp.unwrap_or(remote.prefill.pp_size);
        self.call(node, Call::Arrive { request: request.clone(), remote })
    }

    fn arrive_now(&mut self, node: &str, request: &RequestId, remote: RemoteRef) -> Result<(), ClusterError> {
        let engine = self.decode_engine(node)?;
        // The simulated engines know their prompts' lengths, not their tokens.
        let prompt = kv_core::Prompt::len_only(remote.prompt_tokens);
        engine
            .scheduler
            .handle_arrive(request.clone(), remote.clone(), prompt)
            .map_err(|e| ClusterError(e.to_string()))?;
        engine
            .loads
            .insert(request.clone(), DecodeLoad { remote, blocks: Vec::new(), cached: 0, cache_pending: false });
        self.record(format!("{node} arrived {request}"));
        self.flush_decode(node)
    }

    /// D allocates blocks for a waiting request and starts its load.
    pub fn schedule(&mut self, node: &str, request: &RequestId, prefix_hit: bool) -> Result<(), ClusterError> {
        self.call(node, Call::Schedule { request: request.clone(), prefix_hit, cached_tokens: 0 })
    }

    /// Fills the cached blocks of D's loads from P engine `from` that were scheduled before
    /// its prefill began, now that what it computes is known.
    fn fill_pending_caches(&mut self, from: &EngineId) {
        let tp = self.config.spec.decode_tp;
        let d_tokens = self.config.spec.decode_block_size;
        let mut pending = Vec::new();
        for (id, engine) in &self.decode {
            let Some(engine) = engine else { continue };
            for (request, load) in &engine.loads {
                if load.cache_pending && load.remote.prefill.engine == *from {
                    if let Some(computed) = self.computed_for(&load.remote) {
                        pending.push((id.clone(), request.clone(), computed));
                    }
                }
            }
        }
        for (id, request, computed) in pending {
            let Some(Some(engine)) = self.decode.get_mut(&id) else { continue };
            let load = engine.loads.get_mut(&request).expect("listed above");
            load.cache_pending = false;
            oracle::fill(&mut engine.ranks, tp, &load.blocks[..load.cached], computed.seed, d_tokens);
        }
    }

    /// D allocates blocks for a waiting request whose first `cached_tokens` tokens (whole D
    /// blocks) its own prefix cache holds, and loads the rest.
    pub fn schedule_cached(&mut self, node: &str, request: &RequestId, cached_tokens: u64) -> Result<(), ClusterError> {
        self.call(node, Call::Schedule { request: request.clone(), prefix_hit: false, cached_tokens })
    }

    fn schedule_now(
        &mut self,
        node: &str,
        request: &RequestId,
        prefix_hit: bool,
        cached_tokens: u64,
    ) -> Result<(), ClusterError> {
        let d_tokens = self.config.spec.decode_block_size;
        let tp = self.config.spec.decode_tp;
        let remote = self.decode_engine(node)?.loads.get(request).map(|l| l.remote.clone());
        let computed = remote.and_then(|remote| self.computed_for(&remote));
        let engine = self.decode_engine(node)?;
        let Some(load) = engine.loads.get(request) else {
            return err(format!("{request} is not waiting on {node}"));
        };
        let count = kv_core::blocks_for_tokens(load.remote.prompt_tokens, d_tokens) as usize;
        let cached = if prefix_hit { count.max(1) } else { (cached_tokens / u64::from(d_tokens)) as usize };
        let cached = cached.min(count.max(1));
        let Some(blocks) = engine.pool.allocate(count.max(1)) else {
            return err(format!("{node} has no {count} free blocks for {request}"));
        };
        let dirty = oracle::dirty(&engine.ranks, &blocks);
        if let Err(e) = engine.scheduler.handle_schedule_cached(request.clone(), blocks.clone(), cached) {
            let _ = engine.pool.release(&blocks);
            return Err(ClusterError(e.to_string()));
        }
        // D's own prefix cache computed the same KV for the cached blocks: they hold what P
        // computed for them (or, pushed to before P's prefill began, will compute), and the
        // load must leave them so.
        let partial = cached > 0 && cached < blocks.len();
        if let Some(computed) = computed.filter(|_| partial) {
            oracle::fill(&mut engine.ranks, tp, &blocks[..cached], computed.seed, d_tokens);
        }
        let load = engine.loads.get_mut(request).expect("present");
        load.blocks = blocks;
        load.cached = cached;
        load.cache_pending = partial && computed.is_none();
        self.arm_spoil(node, request);
        self.count_written_after_free(node, &dirty);
        self.record(format!("{node} scheduled {request}"));
        self.flush_decode(node)
    }

    /// D rejects a request carrying P's parameters before admission; `prefill_tp`, when given,
    /// is the TP size the parameters claim for P instead of its own.
    pub fn reject(
        &mut self,
        node: &str,
        request: &RequestId,
        from: &str,
        remote_request: &RequestId,
        prefill_tp: Option<u32>,
    ) -> Result<(), ClusterError> {
        let mut remote = self.remote_for(from, remote_request, None)?;
        remote.prefill.tp_size = prefill_tp.unwrap_or(remote.prefill.tp_size);
        self.call(node, Call::Reject { request: request.clone(), remote })
    }

    fn reject_now(&mut self, node: &str, request: &RequestId, remote: RemoteRef) -> Result<(), ClusterError> {
        let engine = self.decode_engine(node)?;
        engine.scheduler.handle_reject(request.clone(), remote).map_err(|e| ClusterError(e.to_string()))?;
        self.record(format!("{node} rejected {request}"));
        self.flush_decode(node)
    }

    /// The router aborts a request on an engine.
    pub fn abort(&mut self, node: &str, request: &RequestId) -> Result<(), ClusterError> {
        let id = EngineId::new(node);
        if self.prefill.contains_key(&id) {
            // After P finished, an abort on P changes nothing: the export ends by its own rules.
            self.record(format!("{node} abort {request} (no effect on an export)"));
            return Ok(());
        }
        self.call(node, Call::Abort { request: request.clone() })
    }

    fn abort_now(&mut self, node: &str, request: &RequestId) -> Result<(), ClusterError> {
        let engine = self.decode_engine(node)?;
        engine.scheduler.handle_abort(request);
        self.record(format!("{node} aborted {request}"));
        self.flush_decode(node)
    }

    /// Carries out at once what a router call on D set off.
    fn flush_decode(&mut self, node: &str) -> Result<(), ClusterError> {
        let id = EngineId::new(node);
        let now = self.now();
        let mut engine = self.decode.get_mut(&id).and_then(Option::take).expect("checked up");
        self.drain_decode(&mut engine, now);
        self.decode.insert(id, Some(engine));
        Ok(())
    }
}
