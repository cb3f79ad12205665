//! D's side of the engine process: its scheduler, the requests it knows of, its blocks given to
//! waiting requests first come first served, and the check of every byte a load brought; with
//! a model, D computes its own prefix cache's KV, and decodes from the KV a load brought once
//! it holds P's first token too.

use super::*;
use crate::proto::{Generated, Outcome};

/// A request D knows of.
struct Load {
    remote: RemoteRef,
    /// Prompt tokens D's own prefix cache holds already (the router says so): D loads the rest.
    cached_tokens: u64,
    blocks: Vec<BlockId>,
    /// With a model: blocks for the tokens D decodes, after `blocks` (not the load's).
    extra: Vec<BlockId>,
    aborted: bool,
    /// The demo's own work on `blocks` before the load.
    prepared: Prepared,
    /// With a model: the request's decode.
    model: Option<Decode>,
}

/// A request D decodes with its model.
struct Decode {
    prompt: Arc<[u32]>,
    /// P's first token, once D has it.
    first: Option<u32>,
    /// Once its KV is in place: when, the demo's work before, and the bytes loaded.
    ready: Option<(u64, Prepared, u64)>,
}

/// The demo's own work on a load's blocks before it starts: checking the scrub bytes of those
/// freed before, and filling those D's prefix cache holds. The KV latency leaves it out.
#[derive(Clone, Copy, Default, Debug)]
pub(super) struct Prepared {
    /// From the engine's thread handing the work over to its taking up the work's end: the
    /// payload thread's wait for a core and its hand-back included, which a real engine, doing
    /// no such work, does not wait for either.
    took: Duration,
    /// When it ended (wall clock, ns; 0: none was done).
    at_ns: u64,
}

/// D's side: the requests it knows of.
pub(super) struct DecodeSide {
    loads: HashMap<RequestId, Load>,
    /// Arrived, not yet given blocks, in arrival order.
    waiting: VecDeque<RequestId>,
    /// With a model: tokens decoded after P's first, and P's chunk size (0: whole prompts),
    /// in which D computes its own prefix cache.
    generate: usize,
    chunk: usize,
}

impl Side for DecodeSide {
    type Worker = DecodeWorker;
    type Scheduler = DecodeScheduler;
    const ROLE: Role = Role::Decode;

    fn new(config: &NodeConfig, _offer: &Handshake, addresses: Vec<PeerAddress>) -> Result<(Self, DecodeScheduler)> {
        let scheduler =
            DecodeScheduler::new(EngineId::new(config.name.clone()), addresses.len() as u32, config.connector())?;
        let generate = config.engine_model.map_or(0, |m| m.generate as usize);
        let chunk = usize::try_from(config.prefill_chunk_tokens).unwrap_or(usize::MAX);
        Ok((DecodeSide { loads: HashMap::new(), waiting: VecDeque::new(), generate, chunk }, scheduler))
    }

    fn worker(config: &NodeConfig, offer: &Handshake, pool: LocalPool) -> Result<DecodeWorker> {
        Ok(DecodeWorker::new(offer.clone(), config.connector(), pool)?)
    }

    fn settle(node: &mut Node<Self>) -> Result<()> {
        node.schedule()?;
        node.drain()
    }

    fn handle(node: &mut Node<Self>, command: Command) -> Result<()> {
        match command {
            Command::Arrive { id, remote, cached_tokens, prompt_ids, first_token } => {
                let model = node.engine.model_prompt(&id, remote.prompt_tokens, prompt_ids, node.side.generate);
                let id = RequestId::new(id);
                let model = match model {
                    Ok(model) => model.map(|prompt| Decode { prompt, first: first_token, ready: None }),
                    Err(message) => {
                        node.engine.emit(&Event::Error { message: format!("{}: {message}", node.engine.name) });
                        node.outcome(&id, Outcome::Refused, 0);
                        return Self::settle(node);
                    }
                };
                let prompt = kv_core::Prompt::len_only(remote.prompt_tokens);
                match node.connector.scheduler().handle_arrive(id.clone(), remote.clone(), prompt) {
                    Ok(()) => {
                        let load = Load {
                            remote,
                            cached_tokens,
                            blocks: Vec::new(),
                            extra: Vec::new(),
                            aborted: false,
                            prepared: Prepared::default(),
                            model,
                        };
                        node.side.loads.insert(id.clone(), load);
                        node.side.waiting.push_back(id);
                    }
                    Err(err) => {
                        node.engine.emit(&Event::Error { message: format!("{}: {err}", node.engine.name) });
                        node.outcome(&id, Outcome::Refused, 0);
                    }
                }
            }
            Command::Reject { id, remote } => {
                let id = RequestId::new(id);
                match node.connector.scheduler().handle_reject(id.clone(), remote.clone()) {
                    Ok(()) => node.outcome(&id, Outcome::Rejected, 0),
                    Err(err) => {
                        node.engine.emit(&Event::Error { message: format!("{}: {err}", node.engine.name) });
                        node.outcome(&id, Outcome::Refused, 0);
                    }
                }
            }
            Command::Connect { prefill } => node.connector.scheduler().handle_connect(prefill),
            Command::Abort { id } => {
                let id = RequestId::new(id);
                if let Some(load) = node.side.loads.get_mut(&id) {
                    load.aborted = true;
                }
                // The outcome follows with the scheduler's `Ended`; a request already done stays done.
                node.connector.scheduler().handle_abort(&id);
                // A load in place still waiting for P's first token is D's alone to end.
                if node.side.loads.get(&id).is_some_and(|l| l.model.as_ref().is_some_and(|m| m.ready.is_some())) {
                    let load = node.side.loads.remove(&id).expect("checked");
                    node.outcome(&id, Outcome::Aborted, 0);
                    node.engine.release(&[load.blocks, load.extra].concat())?;
                }
            }
            Command::FirstToken { id, token } => {
                let id = RequestId::new(id);
                // A request D no longer holds (ended meanwhile) needs no first token.
                if let Some(model) = node.side.loads.get_mut(&id).and_then(|l| l.model.as_mut()) {
                    model.first = Some(token);
                    node.decode_if_ready(&id);
                }
            }
            other => node.engine.emit(&Event::Error { message: format!("a decode engine cannot {other:?}") }),
        }
        Self::settle(node)
    }

    fn handle_done(node: &mut Node<Self>, done: Done<Tag>) -> Result<()> {
        let Done { tag, handed, intact, model, .. } = done;
        match tag {
            Tag::Prepared { id, blocks, extra, cached } => node.prepared(id, blocks, extra, cached, handed.elapsed()),
            Tag::Verified { id, blocks, ready_at_ns, prepared, bytes, first_at_ns } => {
                let outcome = if intact { Outcome::Ok } else { Outcome::Corrupt };
                let generated = match model {
                    Some(ModelOut::Generated(generated)) => Some(Generated { first_at_ns, ..generated }),
                    _ => None,
                };
                node.outcome_at(&id, outcome, bytes, ready_at_ns, prepared, generated);
                // The engine decodes and is done with the blocks.
                node.engine.release(&blocks)
            }
            _ => Err(anyhow!("a decode engine handed over work it does not do")),
        }
    }
}

impl Node<DecodeSide> {
    fn outcome(&mut self, id: &RequestId, outcome: Outcome, bytes: u64) {
        self.outcome_at(id, outcome, bytes, wall_ns(), Prepared::default(), None);
    }

    fn outcome_at(
        &mut self,
        id: &RequestId,
        outcome: Outcome,
        bytes: u64,
        ready_at_ns: u64,
        prepared: Prepared,
        generated: Option<Generated>,
    ) {
        let event = Event::Outcome {
            id: id.as_str().to_owned(),
            outcome: outcome.to_owned(),
            bytes,
            ready_at_ns,
            scrub_check_ns: prepared.took.as_nanos() as u64,
            prepared_at_ns: prepared.at_ns,
            generated,
        };
        self.engine.emit(&event);
    }

    /// The request P computed the prompt of: the parent of P's sibling exports.
    fn parent(remote: &RemoteRef) -> RequestId {
        remote.request.parent().unwrap_or_else(|| remote.request.clone())
    }

    /// Gives blocks to waiting requests, first come first served, while the pool has them.
    fn schedule(&mut self) -> Result<()> {
        while let Some(id) = self.side.waiting.front().cloned() {
            if self.connector.scheduler().state(&id) != Some(DecodeState::Waiting) {
                self.side.waiting.pop_front();
                continue;
            }
            let Some(load) = self.side.loads.get(&id) else {
                self.side.waiting.pop_front();
                continue;
            };
            let tokens = self.engine.shape().layout.block_tokens;
            let count = kv_core::blocks_for_tokens(load.remote.prompt_tokens, tokens).max(1) as usize;
            // With a model, D also holds the tokens it decodes.
            let decoded = load.model.as_ref().map_or(0, |_| self.side.generate as u64);
            let total = (kv_core::blocks_for_tokens(load.remote.prompt_tokens + decoded, tokens) as usize).max(count);
            // Whole blocks of D's own prefix cache, from the prompt's start.
            let cached = usize::try_from(load.cached_tokens / u64::from(tokens)).unwrap_or(usize::MAX).min(count);
            let Some((mut blocks, freed)) = self.engine.allocate(total) else { break };
            self.side.waiting.pop_front();
            let extra = blocks.split_off(count);
            let work = match &load.model {
                // D's prefix cache holds the KV of the prompt's first `cached` blocks, as an
                // earlier request with the same prefix left it: D computes it (in P's chunks).
                Some(model) => {
                    let to = (cached * tokens as usize).min(model.prompt.len());
                    let chunk = if self.side.chunk == 0 { to } else { self.side.chunk };
                    let all = [&blocks[..], &extra[..]].concat();
                    Work::Compute {
                        prompt: model.prompt.clone(),
                        blocks: all,
                        freed,
                        from: 0,
                        to,
                        chunk,
                        layers_of: None,
                    }
                }
                // D's prefix cache holds the KV P computed for its first `cached` blocks: the
                // same bytes. The check at `Ready` then finds them intact and the read's in the
                // blocks after.
                None => {
                    let seed = pattern::seed(load.remote.prefill.engine.as_str(), Self::parent(&load.remote).as_str());
                    Work::Fill { seed, blocks: blocks[..cached].to_vec(), freed, first: 0 }
                }
            };
            self.engine.payload.submit(Tag::Prepared { id, blocks, extra, cached }, work);
        }
        Ok(())
    }

    /// The blocks of request `id` are ready for its load (`took`: the demo's scrub checks and
    /// prefix-cache fills, which the KV latency leaves out): hands them to the scheduler, or
    /// frees them if the request ended meanwhile.
    fn prepared(
        &mut self,
        id: RequestId,
        blocks: Vec<BlockId>,
        extra: Vec<BlockId>,
        cached: usize,
        took: Duration,
    ) -> Result<()> {
        let waiting = self.connector.scheduler().state(&id) == Some(DecodeState::Waiting);
        let Some(load) = self.side.loads.get_mut(&id).filter(|_| waiting) else {
            return self.engine.release(&[blocks, extra].concat());
        };
        load.blocks = blocks.clone();
        load.extra = extra;
        load.prepared = Prepared { took, at_ns: wall_ns() };
        if let Err(err) = self.connector.scheduler().handle_schedule_cached(id.clone(), blocks.clone(), cached) {
            let extra = self.side.loads.remove(&id).map(|l| l.extra).unwrap_or_default();
            self.engine.emit(&Event::Error { message: format!("{}: {err}", self.engine.name) });
            self.outcome(&id, Outcome::Refused, 0);
            return self.engine.release(&[blocks, extra].concat());
        }
        Ok(())
    }

    /// With a model: once request `id`'s KV is in place and D holds P's first token, hands
    /// its decode to the payload threads.
    fn decode_if_ready(&mut self, id: &RequestId) {
        let ready = self
            .side
            .loads
            .get(id)
            .and_then(|l| l.model.as_ref())
            .is_some_and(|m| m.ready.is_some() && m.first.is_some());
        if !ready {
            return;
        }
        let load = self.side.loads.remove(id).expect("checked");
        let model = load.model.expect("checked");
        let ((ready_at_ns, prepared, bytes), first) = (model.ready.expect("checked"), model.first.expect("checked"));
        let blocks = [load.blocks, load.extra].concat();
        let work = Work::Decode {
            blocks: blocks.clone(),
            prompt_tokens: model.prompt.len(),
            first,
            count: self.side.generate,
        };
        let first_at_ns = wall_ns();
        let tag = Tag::Verified { id: id.clone(), blocks, ready_at_ns, prepared, bytes, first_at_ns };
        self.engine.payload.submit(tag, work);
    }

    /// Carries the scheduler's events to the ranks and the pool until none is left.
    fn drain(&mut self) -> Result<()> {
        for event in self.poll()? {
            match event {
                // kv-engine hands the ranks their commands itself.
                DecodeEvent::ToWorker { rank, .. } => return Err(anyhow!("a command for rank {rank} was not sent")),
                DecodeEvent::Ended { request, state: DecodeState::Ready, .. } => {
                    // The KV is in place now; checking it is the demo's work, not the load's.
                    let ready_at_ns = wall_ns();
                    if let Some(load) = self.side.loads.get_mut(&request).filter(|l| l.model.is_some()) {
                        let (bytes, prepared) = (self.engine.bytes(load.blocks.len()), load.prepared);
                        if let Some(model) = load.model.as_mut() {
                            model.ready = Some((ready_at_ns, prepared, bytes));
                        }
                        self.decode_if_ready(&request);
                        continue;
                    }
                    let Some(load) = self.side.loads.remove(&request) else { continue };
                    let seed = pattern::seed(load.remote.prefill.engine.as_str(), Self::parent(&load.remote).as_str());
                    let bytes = self.engine.bytes(load.blocks.len());
                    let work = Work::Check { seed, blocks: load.blocks.clone(), tokens: load.remote.prompt_tokens };
                    let (blocks, prepared) = (load.blocks, load.prepared);
                    let tag = Tag::Verified { id: request, blocks, ready_at_ns, prepared, bytes, first_at_ns: 0 };
                    self.engine.payload.submit(tag, work);
                }
                DecodeEvent::Ended { request, state, .. } => {
                    // A rejection was reported when it was made; it has no load.
                    let Some(load) = self.side.loads.get(&request) else { continue };
                    let aborted = load.aborted || state == DecodeState::Gone;
                    if load.blocks.is_empty() {
                        self.side.loads.remove(&request);
                    }
                    self.outcome(&request, if aborted { Outcome::Aborted } else { Outcome::ended(state) }, 0);
                }
                DecodeEvent::Free { request, blocks } => {
                    let extra = self.side.loads.remove(&request).map(|l| l.extra).unwrap_or_default();
                    self.engine.release(&[blocks, extra].concat())?;
                }
            }
        }
        Ok(())
    }
}
