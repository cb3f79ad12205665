//! D's scheduler side: admits, schedules, rejects and aborts requests carrying P's transfer
//! parameters, and tells the engine when each request has ended and when its blocks may go.

use std::collections::{BTreeMap, VecDeque};

use kv_core::{BlockId, EngineId, Prompt, RequestId};

use crate::common::{PrefillEngine, RemoteRef};
use crate::config::{Config, ConfigError, LoadFailurePolicy, Mode};
use crate::metrics::DecodeMetrics;

/// What D's scheduler tells a worker rank.
#[derive(Clone, PartialEq, Eq, Debug)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize), serde(rename_all = "snake_case"))]
pub enum DecodeCommand {
    /// A request with P's parameters entered the waiting queue: claim and renew its lease.
    Track {
        /// D's request id.
        request: RequestId,
        /// P's parameters (boxed: the other commands are small).
        remote: Box<RemoteRef>,
        /// D's own prompt, which the ranks' claims name (P checks it against what it computed).
        prompt: Prompt,
    },
    /// Blocks are allocated: load the KV into them (or, on a prefix hit, only tell P).
    Load {
        /// D's request id.
        request: RequestId,
        /// D's blocks, in prompt order.
        blocks: Vec<BlockId>,
        /// How many of them, from the first, D's own prefix cache already holds: only the
        /// rest are loaded (all of them: a prefix hit, nothing is read).
        cached_blocks: usize,
    },
    /// D rejected the request before admission: tell P.
    Reject {
        /// P's parameters.
        remote: RemoteRef,
    },
    /// The request ends on D.
    Abort {
        /// D's request id.
        request: RequestId,
    },
    /// Connect to the ranks of this P engine that requests from it would need, ahead of the
    /// first one.
    Connect {
        /// The P engine.
        prefill: PrefillEngine,
    },
}

/// How a rank's part of a load ended.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize), serde(rename_all = "snake_case"))]
pub enum LoadOutcome {
    /// The KV is in place.
    Loaded,
    /// The load failed or could not be made safely.
    Failed,
    /// The load was aborted.
    Aborted,
}

/// What a D worker rank tells its scheduler.
#[derive(Clone, PartialEq, Eq, Debug)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize), serde(rename_all = "snake_case"))]
pub enum DecodeReport {
    /// The rank is done with the request: no transfer of it can touch D's blocks any more.
    Finished {
        /// D's request id.
        request: RequestId,
        /// How.
        outcome: LoadOutcome,
        /// Loaded: how long after P finished the prompt this rank came to hold its KV, when
        /// known (P's finish is known once it has exported; see [`crate::ExportInfo::finished`]).
        kv_latency: Option<std::time::Duration>,
        /// How many of the request's blocks, from the first, hold valid KV on this rank: all
        /// when loaded; when the load failed, those D's prefix cache held and, where the
        /// transport said which bytes a failed read spoiled, the blocks read whole before the
        /// first spoiled one.
        kept_blocks: usize,
    },
    /// Push: the rank gave the load up, but P may still be writing into its blocks; they stay
    /// in quarantine until the rank reports `Finished`.
    Quarantined {
        /// D's request id.
        request: RequestId,
    },
}

/// Where a request stands on D.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
#[cfg_attr(feature = "serde", derive(serde::Deserialize), serde(rename_all = "snake_case"))]
pub enum DecodeState {
    /// Arrived; its lease is renewed while it waits.
    Waiting,
    /// Scheduled: reading, or registered and waiting for P's write.
    Loading,
    /// Its KV is in place.
    Ready,
    /// The load failed (policy `fail`).
    Failed,
    /// The load failed and the prompt is computed locally (policy `recompute`).
    Recompute,
    /// Aborted or rejected.
    Gone,
}

impl DecodeState {
    /// The state's name, as scenario files write it.
    pub fn as_str(&self) -> &'static str {
        match self {
            DecodeState::Waiting => "waiting",
            DecodeState::Loading => "loading",
            DecodeState::Ready => "ready",
            DecodeState::Failed => "failed",
            DecodeState::Recompute => "recompute",
            DecodeState::Gone => "gone",
        }
    }

    /// Whether the request has ended (ready, failed, recompute or gone).
    pub fn is_final(&self) -> bool {
        !matches!(self, DecodeState::Waiting | DecodeState::Loading)
    }
}

/// What D's scheduler asks the engine to do.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum DecodeEvent {
    /// Hand this command to worker `rank`.
    ToWorker {
        /// The worker rank.
        rank: u32,
        /// The command.
        command: DecodeCommand,
    },
    /// The request reached its final state, once per request: `Ready` (its KV is in place and
    /// its blocks now belong to the engine), `Failed` or `Recompute` (the load failed), or
    /// `Gone` (aborted or rejected). A failed or aborted load's blocks come back with `Free`,
    /// at once or, for a push given up while P may still write, after its quarantine.
    Ended {
        /// D's request id.
        request: RequestId,
        /// The final state.
        state: DecodeState,
        /// How many of its blocks, from the first, hold valid KV: all of them when `Ready`; when
        /// it is `Recompute`, those D's own prefix cache held and the blocks every rank read whole
        /// before a failed read's first spoiled one (where the transport can tell; compute from
        /// there on); none otherwise.
        kept_blocks: usize,
    },
    /// The request's blocks may return to the pool: no transfer can touch them any more.
    Free {
        /// D's request id.
        request: RequestId,
        /// The blocks.
        blocks: Vec<BlockId>,
    },
}

/// Why D's scheduler refused a call.
#[derive(Clone, PartialEq, Eq, Debug, thiserror::Error)]
pub enum DecodeError {
    /// The request is already known.
    #[error("request {0} is already on this engine")]
    AlreadyKnown(RequestId),
    /// The request is not waiting.
    #[error("request {0} is not waiting (it is {state})", state = .1.map_or("unknown", |s| s.as_str()))]
    NotWaiting(RequestId, Option<DecodeState>),
    /// Pull mode needs P's export to read from.
    #[error("request {0} carries no export from P to read in pull mode")]
    NoExport(RequestId),
    /// More blocks cached than allocated.
    #[error("request {request}: {cached} blocks cached, but only {blocks} allocated")]
    CachedBeyondBlocks {
        /// D's request id.
        request: RequestId,
        /// Blocks said to be cached.
        cached: usize,
        /// Blocks allocated.
        blocks: usize,
    },
    /// A report named a rank outside the engine.
    #[error("rank {rank} is outside tp {tp}")]
    NoSuchRank {
        /// The rank.
        rank: u32,
        /// The engine's TP size.
        tp: u32,
    },
}

#[derive(Debug)]
struct SchedulerRequest {
    state: DecodeState,
    blocks: Vec<BlockId>,
    /// The first `cached` of `blocks` D's prefix cache held.
    cached: usize,
    /// The fewest blocks of valid KV a rank reported keeping.
    kept: Option<usize>,
    finished: BTreeMap<u32, LoadOutcome>,
    aborting: bool,
    /// The slowest rank's time from P's finish to holding its KV, as the ranks report it;
    /// `None` once a rank could not tell.
    kv_latency: Option<std::time::Duration>,
}

impl SchedulerRequest {
    /// The blocks that hold valid KV once the request ends in `state`.
    fn kept(&self, state: DecodeState) -> usize {
        match state {
            DecodeState::Ready => self.blocks.len(),
            DecodeState::Recompute => self.kept.unwrap_or(self.cached).min(self.blocks.len()),
            _ => 0,
        }
    }
}

/// D's scheduler side. It keeps a request only while it is waiting, loading, or its blocks are
/// in quarantine; an ended request is forgotten once its blocks are back.
#[derive(Debug)]
pub struct DecodeScheduler {
    engine: EngineId,
    tp: u32,
    config: Config,
    requests: BTreeMap<RequestId, SchedulerRequest>,
    events: VecDeque<DecodeEvent>,
    metrics: DecodeMetrics,
}

impl DecodeScheduler {
    /// A scheduler for `engine`, of `tp` ranks; fails on settings that cannot work
    /// ([`Config::validate`]) or no ranks.
    pub fn new(engine: EngineId, tp: u32, config: Config) -> Result<Self, ConfigError> {
        config.validate()?;
        if tp == 0 {
            return Err(ConfigError::NoRanks { tp });
        }
        let metrics = DecodeMetrics::new(&engine);
        Ok(DecodeScheduler { engine, tp, config, requests: BTreeMap::new(), events: VecDeque::new(), metrics })
    }

    /// The engine's id.
    pub fn engine(&self) -> &EngineId {
        &self.engine
    }

    /// Whether the engine pulls or is pushed to.
    pub fn mode(&self) -> Mode {
        self.config.mode
    }

    fn broadcast(&mut self, command: impl Fn() -> DecodeCommand) {
        for rank in 0..self.tp {
            self.events.push_back(DecodeEvent::ToWorker { rank, command: command() });
        }
    }

    fn failed_state(&self) -> DecodeState {
        match self.config.kv_load_failure_policy {
            LoadFailurePolicy::Fail => DecodeState::Failed,
            LoadFailurePolicy::Recompute => DecodeState::Recompute,
        }
    }

    /// A request carrying P's parameters enters the waiting queue; `prompt` is D's own (its
    /// length, and its tokens' digest where the engine has them), which the ranks' claims name
    /// so that P lends its KV only for the prompt it computed.
    pub fn handle_arrive(&mut self, request: RequestId, remote: RemoteRef, prompt: Prompt) -> Result<(), DecodeError> {
        if self.requests.contains_key(&request) {
            return Err(DecodeError::AlreadyKnown(request));
        }
        if self.config.mode == Mode::Pull && remote.export.is_none() {
            return Err(DecodeError::NoExport(request));
        }
        let entry = SchedulerRequest {
            state: DecodeState::Waiting,
            blocks: Vec::new(),
            cached: 0,
            kept: None,
            finished: BTreeMap::new(),
            aborting: false,
            kv_latency: Some(std::time::Duration::ZERO),
        };
        self.requests.insert(request.clone(), entry);
        self.broadcast(|| DecodeCommand::Track { request: request.clone(), remote: Box::new(remote.clone()), prompt });
        Ok(())
    }

    /// Connects every rank to the ranks of P engine `prefill` it would read (or, in push mode,
    /// register with) for a request from there, ahead of the first one: the authenticated
    /// handshake, P's NIXL metadata and the transport's endpoint are then in place when it
    /// comes, instead of the first requests from a new P waiting tens of milliseconds for
    /// them. For a router or discovery that knows P engines before it routes requests; an
    /// engine's incarnation is learnt at the handshake, and a newer one connects afresh.
    /// Parameters that map onto no rank of this engine connect nothing; the first request
    /// with them fails as it would have.
    pub fn handle_connect(&mut self, prefill: PrefillEngine) {
        self.broadcast(|| DecodeCommand::Connect { prefill: prefill.clone() });
    }

    /// Blocks are allocated for a waiting request: start its load; with `prefix_hit`, D's own
    /// prefix cache already holds the whole prompt and nothing is read.
    pub fn handle_schedule(
        &mut self,
        request: RequestId,
        blocks: Vec<BlockId>,
        prefix_hit: bool,
    ) -> Result<(), DecodeError> {
        let cached = if prefix_hit { blocks.len() } else { 0 };
        self.handle_schedule_cached(request, blocks, cached)
    }

    /// Blocks are allocated for a waiting request whose first `cached_blocks` blocks D's own
    /// prefix cache already holds (vLLM's locally computed tokens, in whole D blocks): load only
    /// the rest, and tell P it is done when they are in place, as for a full load. All of them
    /// cached is a prefix hit. In push mode D registers only the blocks after the cached ones,
    /// and P writes just those.
    pub fn handle_schedule_cached(
        &mut self,
        request: RequestId,
        blocks: Vec<BlockId>,
        cached_blocks: usize,
    ) -> Result<(), DecodeError> {
        if cached_blocks > blocks.len() {
            return Err(DecodeError::CachedBeyondBlocks { request, cached: cached_blocks, blocks: blocks.len() });
        }
        match self.requests.get_mut(&request) {
            Some(e) if e.state == DecodeState::Waiting => {
                e.state = DecodeState::Loading;
                e.blocks = blocks.clone();
                e.cached = cached_blocks;
            }
            other => return Err(DecodeError::NotWaiting(request, other.map(|e| e.state))),
        }
        self.broadcast(|| DecodeCommand::Load { request: request.clone(), blocks: blocks.clone(), cached_blocks });
        Ok(())
    }

    /// D rejects `request`, carrying P's parameters, before admission; it ends `gone`.
    pub fn handle_reject(&mut self, request: RequestId, remote: RemoteRef) -> Result<(), DecodeError> {
        if self.requests.contains_key(&request) {
            return Err(DecodeError::AlreadyKnown(request));
        }
        self.broadcast(|| DecodeCommand::Reject { remote: remote.clone() });
        self.events.push_back(DecodeEvent::Ended { request, state: DecodeState::Gone, kept_blocks: 0 });
        Ok(())
    }

    /// D refused `request`'s handoff ([`crate::TransferParams::resolve`]): counted by reason
    /// (`kvflow_handoffs_refused_total`), and the export it names, if any, rejected so that P
    /// frees it at once rather than at its lease's end. The engine computes the prompt (or
    /// fails the request), as its load-failure policy says.
    #[cfg(feature = "serde")]
    pub fn handle_refused(&mut self, request: RequestId, refused: &crate::HandoffError) {
        self.metrics.handoff_refused(refused.reason.as_str());
        if let Some(remote) = refused.remote.as_deref() {
            // Known already (tracked under this id): nothing to reject that it has not claimed.
            let _ = self.handle_reject(request, remote.clone());
        }
    }

    /// The router aborts the request on D.
    pub fn handle_abort(&mut self, request: &RequestId) {
        let Some(entry) = self.requests.get_mut(request) else { return };
        match entry.state {
            DecodeState::Waiting => {
                self.requests.remove(request);
                let ended = DecodeEvent::Ended { request: request.clone(), state: DecodeState::Gone, kept_blocks: 0 };
                self.events.push_back(ended);
            }
            DecodeState::Loading => entry.aborting = true,
            _ => return,
        }
        self.broadcast(|| DecodeCommand::Abort { request: request.clone() });
    }

    /// A worker rank's report.
    pub fn handle_report(&mut self, rank: u32, report: DecodeReport) -> Result<(), DecodeError> {
        if rank >= self.tp {
            return Err(DecodeError::NoSuchRank { rank, tp: self.tp });
        }
        let failed_state = self.failed_state();
        match report {
            DecodeReport::Quarantined { request } => {
                let Some(entry) = self.requests.get_mut(&request) else { return Ok(()) };
                // That rank's writes may still land: none of its blocks past the cached ones hold
                // valid KV, whatever the other ranks loaded.
                entry.kept = Some(entry.kept.map_or(entry.cached, |k| k.min(entry.cached)));
                if entry.state == DecodeState::Loading {
                    // The request moves on (recompute, fail, gone); its blocks wait for P.
                    entry.state = if entry.aborting { DecodeState::Gone } else { failed_state };
                    let state = entry.state;
                    let kept_blocks = entry.kept(state);
                    self.events.push_back(DecodeEvent::Ended { request, state, kept_blocks });
                }
            }
            DecodeReport::Finished { request, outcome, kv_latency, kept_blocks } => {
                let Some(entry) = self.requests.get_mut(&request) else { return Ok(()) };
                entry.finished.insert(rank, outcome);
                entry.kept = Some(entry.kept.map_or(kept_blocks, |k| k.min(kept_blocks)));
                entry.kv_latency = entry.kv_latency.zip(kv_latency).map(|(a, b)| a.max(b));
                match entry.state {
                    DecodeState::Waiting if outcome != LoadOutcome::Loaded => {
                        // P's export is gone before the load began: nothing is held, tell every rank.
                        self.requests.remove(&request);
                        let ended =
                            DecodeEvent::Ended { request: request.clone(), state: failed_state, kept_blocks: 0 };
                        self.events.push_back(ended);
                        self.broadcast(|| DecodeCommand::Abort { request: request.clone() });
                    }
                    DecodeState::Waiting => {}
                    _ if entry.finished.len() as u32 == self.tp => {
                        let entry = self.requests.remove(&request).expect("present");
                        if entry.state == DecodeState::Loading {
                            let all_loaded = entry.finished.values().all(|o| *o == LoadOutcome::Loaded);
                            let state = if entry.aborting {
                                DecodeState::Gone
                            } else if all_loaded {
                                DecodeState::Ready
                            } else {
                                failed_state
                            };
                            let kept_blocks = entry.kept(state);
                            self.events.push_back(DecodeEvent::Ended { request: request.clone(), state, kept_blocks });
                            if state == DecodeState::Ready {
                                if let Some(latency) = entry.kv_latency {
                                    self.metrics.kv_ready(latency);
                                }
                                return Ok(());
                            }
                        }
                        self.events.push_back(DecodeEvent::Free { request, blocks: entry.blocks });
                    }
                    _ => {}
                }
            }
        }
        Ok(())
    }

    /// The next thing the engine must do.
    pub fn poll_event(&mut self) -> Option<DecodeEvent> {
        let event = self.events.pop_front();
        match &event {
            Some(DecodeEvent::Ended { state, .. }) => self.metrics.ended(*state),
            Some(_) => {}
            // Drained: the held blocks as they stand now.
            None => self.metrics.held(self.requests.values().map(|e| e.blocks.len()).sum()),
        }
        event
    }

    /// Its TP ranks: the workers it drives.
    pub fn tp(&self) -> u32 {
        self.tp
    }

    /// Where a request stands, while this engine keeps it (ended requests are forgotten once
    /// their blocks are back; [`DecodeEvent::Ended`] gave their final state).
    pub fn state(&self, request: &RequestId) -> Option<DecodeState> {
        self.requests.get(request).map(|e| e.state)
    }

    /// The blocks held for requests that are loading, or in quarantine after a push given up.
    pub fn held_blocks(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.requests.values().filter(|e| e.state != DecodeState::Waiting).flat_map(|e| e.blocks.iter().copied())
    }

    /// Requests still kept: waiting, loading, or with blocks in quarantine.
    pub fn pending(&self) -> usize {
        self.requests.len()
    }
}
