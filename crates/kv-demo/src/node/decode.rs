//! D's side of the engine process: its scheduler, the requests it knows of, its blocks given to
//! waiting requests first come first served, and the check of every byte a load brought.

use super::*;
use crate::proto::Outcome;

/// A request D knows of.
struct Load {
    remote: RemoteRef,
    /// Prompt tokens D's own prefix cache holds already (the router says so): D loads the rest.
    cached_tokens: u64,
    blocks: Vec<BlockId>,
    aborted: bool,
    /// The demo's own work on `blocks` before the load.
    prepared: Prepared,
}

/// The demo's own work on a load's blocks before it starts: checking the scrub bytes of those
/// freed before, and filling those D's prefix cache holds. The KV latency leaves it out.
#[derive(Clone, Copy, Default, Debug)]
pub(super) struct Prepared {
    /// From handing the work over to its end.
    took: Duration,
    /// When it ended (wall clock, ns; 0: none was done).
    at_ns: u64,
}

/// D's side: the requests it knows of.
pub(super) struct DecodeSide {
    loads: HashMap<RequestId, Load>,
    /// Arrived, not yet given blocks, in arrival order.
    waiting: VecDeque<RequestId>,
}

impl Side for DecodeSide {
    type Worker = DecodeWorker;
    type Scheduler = DecodeScheduler;
    const ROLE: Role = Role::Decode;

    fn new(config: &NodeConfig, _offer: &Handshake, addresses: Vec<PeerAddress>) -> Result<(Self, DecodeScheduler)> {
        let scheduler =
            DecodeScheduler::new(EngineId::new(config.name.clone()), addresses.len() as u32, config.connector())?;
        Ok((DecodeSide { loads: HashMap::new(), waiting: VecDeque::new() }, scheduler))
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
            Command::Arrive { id, remote, cached_tokens } => {
                let id = RequestId::new(id);
                match node.connector.scheduler().handle_arrive(id.clone(), remote.clone()) {
                    Ok(()) => {
                        let load = Load {
                            remote,
                            cached_tokens,
                            blocks: Vec::new(),
                            aborted: false,
                            prepared: Prepared::default(),
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
            }
            other => node.engine.emit(&Event::Error { message: format!("a decode engine cannot {other:?}") }),
        }
        Self::settle(node)
    }

    fn handle_done(node: &mut Node<Self>, tag: Tag, took: Duration, intact: bool) -> Result<()> {
        match tag {
            Tag::Prepared { id, blocks, cached } => node.prepared(id, blocks, cached, took),
            Tag::Verified { id, blocks, ready_at_ns, prepared, bytes } => {
                let outcome = if intact { Outcome::Ok } else { Outcome::Corrupt };
                node.outcome_at(&id, outcome, bytes, ready_at_ns, prepared);
                // The engine decodes and is done with the blocks.
                node.engine.release(&blocks)
            }
            _ => Err(anyhow!("a decode engine handed over work it does not do")),
        }
    }
}

impl Node<DecodeSide> {
    fn outcome(&mut self, id: &RequestId, outcome: Outcome, bytes: u64) {
        self.outcome_at(id, outcome, bytes, wall_ns(), Prepared::default());
    }

    fn outcome_at(&mut self, id: &RequestId, outcome: Outcome, bytes: u64, ready_at_ns: u64, prepared: Prepared) {
        let event = Event::Outcome {
            id: id.as_str().to_owned(),
            outcome: outcome.to_owned(),
            bytes,
            ready_at_ns,
            scrub_check_ns: prepared.took.as_nanos() as u64,
            prepared_at_ns: prepared.at_ns,
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
            // Whole blocks of D's own prefix cache, from the prompt's start.
            let cached = usize::try_from(load.cached_tokens / u64::from(tokens)).unwrap_or(usize::MAX).min(count);
            let seed = pattern::seed(load.remote.prefill.engine.as_str(), Self::parent(&load.remote).as_str());
            let Some((blocks, freed)) = self.engine.allocate(count) else { break };
            self.side.waiting.pop_front();
            // D's prefix cache holds the KV P computed for its first `cached` blocks: the same
            // bytes. The check at `Ready` then finds them intact and the read's in the blocks
            // after.
            let work = Work::Fill { seed, blocks: blocks[..cached].to_vec(), freed, first: 0 };
            self.engine.payload.submit(Tag::Prepared { id, blocks, cached }, work);
        }
        Ok(())
    }

    /// The blocks of request `id` are ready for its load (`took`: the demo's scrub checks and
    /// prefix-cache fills, which the KV latency leaves out): hands them to the scheduler, or
    /// frees them if the request ended meanwhile.
    fn prepared(&mut self, id: RequestId, blocks: Vec<BlockId>, cached: usize, took: Duration) -> Result<()> {
        let waiting = self.connector.scheduler().state(&id) == Some(DecodeState::Waiting);
        let Some(load) = self.side.loads.get_mut(&id).filter(|_| waiting) else {
            return self.engine.release(&blocks);
        };
        load.blocks = blocks.clone();
        load.prepared = Prepared { took, at_ns: wall_ns() };
        if let Err(err) = self.connector.scheduler().handle_schedule_cached(id.clone(), blocks.clone(), cached) {
            self.side.loads.remove(&id);
            self.engine.emit(&Event::Error { message: format!("{}: {err}", self.engine.name) });
            self.outcome(&id, Outcome::Refused, 0);
            return self.engine.release(&blocks);
        }
        Ok(())
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
                    let Some(load) = self.side.loads.remove(&request) else { continue };
                    let seed = pattern::seed(load.remote.prefill.engine.as_str(), Self::parent(&load.remote).as_str());
                    let bytes = self.engine.bytes(load.blocks.len());
                    let work = Work::Check { seed, blocks: load.blocks.clone(), tokens: load.remote.prompt_tokens };
                    let (blocks, prepared) = (load.blocks, load.prepared);
                    self.engine
                        .payload
                        .submit(Tag::Verified { id: request, blocks, ready_at_ns, prepared, bytes }, work);
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
                    self.side.loads.remove(&request);
                    self.engine.release(&blocks)?;
                }
            }
        }
        Ok(())
    }
}
