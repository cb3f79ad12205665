//! P's scheduler side: exports finished requests and frees their blocks once every TP rank
//! has released them. In push mode it also passes on a chunked prefill's progress, so that
//! the workers write finished blocks while the rest of the prompt computes.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use kv_core::{BlockId, EngineId, Handshake, PeerAddress, Prompt, RequestId, Role, Time};

use super::book::{Recent, RECENT_RELEASES};
use crate::common::{Consumer, ExportInfo, PrefillEngine, RemoteRef};
use crate::config::{Config, ConfigError, Mode, ReleaseReason};
use crate::metrics::PrefillMetrics;

/// The most requests a P scheduler holds paired by a transfer id at once
/// ([`PrefillScheduler::handle_pairing`]).
pub const MAX_PAIRINGS: usize = 65_536;

/// What P's scheduler tells a worker rank.
#[derive(Clone, PartialEq, Eq, Debug)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize), serde(rename_all = "snake_case"))]
pub enum PrefillCommand {
    /// A finished request's blocks are exported under a lease until `deadline`.
    Export {
        /// P's request id.
        request: RequestId,
        /// Its blocks, in prompt order.
        blocks: Vec<BlockId>,
        /// The lease's deadline.
        deadline: Time,
        /// The D engine the router named, bound to the export (and its siblings) at once.
        consumer: Option<Consumer>,
        /// The prompt P computed: a claim or a push registration that names another is refused.
        prompt: Prompt,
        /// The id that pairs the export with D's leg of the request (NixlPushConnector's
        /// `transfer_id`), by which D's messages may name it too.
        #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "Option::is_none"))]
        transfer: Option<RequestId>,
    },
    /// Push: a request still computing has these blocks finished (the prompt's first ones, in
    /// order); the worker may write them into the blocks D registered before the prompt ends.
    Progress {
        /// P's request id.
        request: RequestId,
        /// The blocks computed so far, in prompt order.
        blocks: Vec<BlockId>,
        /// The D engine the router named, if any: only its registrations are written ahead.
        consumer: Option<Consumer>,
        /// When P computes layer by layer: the blocks past the first `whole` are computed in
        /// some model layers only (none yet, a chunk about to be computed); none means every
        /// block is computed in every layer.
        #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "Option::is_none"))]
        part: Option<LayerProgress>,
        /// The id that pairs the request with D's leg (see `Export`).
        #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "Option::is_none"))]
        transfer: Option<RequestId>,
    },
    /// Push: the engine gave up a request it reported progress on, before finishing it. The
    /// worker writes no more into D's blocks, tells D none will come, and releases the request
    /// (reason `aborted`) once no write is in flight.
    Abandon {
        /// P's request id.
        request: RequestId,
    },
}

/// How far a chunk P computes layer by layer has gone: of the blocks reported computed, the
/// first `whole` are computed in every model layer, the rest (the chunk's) in model layers
/// `0..layers` so far. The blocks' model layers are the whole model's, numbered from 0; each
/// pipeline stage writes those it holds. `layers: 0` reports a chunk about to be computed:
/// its blocks are the connector's from then on, and none of its layers is written yet (an
/// engine that learns of a layer only inside its forward, as vLLM's `save_kv_layer`, reports
/// the chunk so before the forward and its layers from there).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct LayerProgress {
    /// Blocks computed in every layer, from the prompt's first.
    pub whole: usize,
    /// Model layers `0..layers` of the blocks past them are computed (0: none yet).
    pub layers: u32,
}

/// What a P worker rank tells its scheduler.
#[derive(Clone, PartialEq, Eq, Debug)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize), serde(rename_all = "snake_case"))]
pub enum PrefillReport {
    /// The rank released the export; it will not touch its blocks again.
    Released {
        /// P's request id.
        request: RequestId,
        /// Why.
        reason: ReleaseReason,
    },
}

/// What P's scheduler asks the engine to do.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum PrefillEvent {
    /// Hand this command to worker `rank` (engines do it at their next step).
    ToWorker {
        /// The worker rank.
        rank: u32,
        /// The command.
        command: PrefillCommand,
    },
    /// Every rank released the export: its blocks may be freed (once per export).
    Free {
        /// P's request id.
        request: RequestId,
        /// The blocks the export held.
        blocks: Vec<BlockId>,
        /// The first rank's reason.
        reason: ReleaseReason,
    },
}

/// Why P's scheduler refused a call.
#[derive(Clone, PartialEq, Eq, Debug, thiserror::Error)]
pub enum PrefillError {
    /// The request is already exported.
    #[error("request {0} is already exported")]
    AlreadyExported(RequestId),
    /// The id named an export, or a push prompt given up, that is freed now: the workers still
    /// take late messages for it as the old export's, so it cannot name another.
    #[error("request {0} was exported or given up before; a request id names one export")]
    Reused(RequestId),
    /// An export needs blocks.
    #[error("request {0} has no blocks to export")]
    NoBlocks(RequestId),
    /// A progress report or export does not extend the blocks reported before.
    #[error("request {request}: {blocks} blocks do not extend the {computed} reported computed before")]
    ProgressMismatch {
        /// P's request id.
        request: RequestId,
        /// The blocks in this call.
        blocks: usize,
        /// The blocks reported before.
        computed: usize,
    },
    /// A layer-by-layer report names more whole blocks than it reports, or fewer than it
    /// reported whole before.
    #[error("request {request}: {whole} whole blocks and {layers} layers of {blocks} blocks do not extend the {before} reported whole before (the whole blocks never shrink, and are at most the blocks reported)")]
    LayerMismatch {
        /// P's request id.
        request: RequestId,
        /// The blocks computed in every layer, in this call.
        whole: usize,
        /// The layers computed of the rest, in this call.
        layers: u32,
        /// The blocks in this call.
        blocks: usize,
        /// The blocks reported whole before.
        before: usize,
    },
    /// The request was not reported in progress.
    #[error("request {0} is not computing")]
    NotComputing(RequestId),
    /// A transfer id pairs one request: another has it, or this one has another.
    #[error("request {request} cannot be paired by transfer id {transfer}: {other} is paired with it")]
    Paired {
        /// P's request id.
        request: RequestId,
        /// The transfer id asked for.
        transfer: RequestId,
        /// What holds it: the other request, or this request's other transfer id.
        other: RequestId,
    },
    /// More requests are paired than [`MAX_PAIRINGS`].
    #[error("request {request} cannot be paired: {MAX_PAIRINGS} requests are paired already")]
    TooManyPairings {
        /// P's request id.
        request: RequestId,
    },
    /// A report named a rank outside the engine.
    #[error("rank {rank} is outside the engine's {tp} workers")]
    NoSuchRank {
        /// The rank.
        rank: u32,
        /// The engine's workers (TP size times pipeline stages).
        tp: u32,
    },
}

/// A request reported in progress: its blocks so far, of which the first `whole` in every layer.
#[derive(Debug)]
struct Computed {
    blocks: Vec<BlockId>,
    whole: usize,
    layers: u32,
}

#[derive(Debug)]
struct SchedulerExport {
    blocks: Vec<BlockId>,
    released: BTreeSet<u32>,
    reason: Option<ReleaseReason>,
}

/// P's scheduler side: exports finished requests and frees their blocks when every rank is done.
#[derive(Debug)]
pub struct PrefillScheduler {
    engine: EngineId,
    instance: u64,
    /// Workers: TP size times pipeline stages, one address each.
    workers: u32,
    pp: u32,
    addresses: Vec<PeerAddress>,
    config: Config,
    exports: BTreeMap<RequestId, SchedulerExport>,
    /// Requests reported in progress and not yet finished, with their blocks so far. Bounded
    /// by the pool: each holds at least one block.
    computing: BTreeMap<RequestId, Computed>,
    /// Push: requests given up while computing, until every rank released them.
    abandoned: BTreeMap<RequestId, SchedulerExport>,
    /// Ids of exports (and push prompts given up) freed on every rank since the last
    /// [`PrefillScheduler::handle_finished`]: reports carry no time, so each is stamped with
    /// the next call's `now`, which is no earlier than any rank's release of it.
    unstamped: Recent,
    /// Ids freed and stamped, forgotten two leases after their stamp: no sooner than every
    /// worker forgets them (two leases after its release). Each of the two remembers at most
    /// `RECENT_RELEASES`, as many as each worker.
    freed: Recent,
    /// The latest `now` given.
    latest: Time,
    /// Push: each request's transfer id (NixlPushConnector's `transfer_id`), and the request
    /// of each transfer id; at most [`MAX_PAIRINGS`], each until its request is freed.
    transfers: BTreeMap<RequestId, RequestId>,
    paired: BTreeMap<RequestId, RequestId>,
    events: VecDeque<PrefillEvent>,
    metrics: PrefillMetrics,
}

impl PrefillScheduler {
    /// A scheduler for the engine incarnation whose workers make handshake offers like `offer`
    /// (any rank's, from [`LocalPool::offer`](crate::LocalPool::offer): the engine and its
    /// incarnation are given there, once), whose rank `r` listens at `addresses[r]`; fails on
    /// settings that cannot work ([`Config::validate`]), an offer that is not a prefill
    /// engine's, or no address.
    pub fn new(offer: &Handshake, addresses: Vec<PeerAddress>, config: Config) -> Result<Self, ConfigError> {
        config.validate()?;
        if offer.role != Role::Prefill {
            let offer = format!("{:?}", offer.role);
            return Err(ConfigError::Offer { field: "role", offer, pool: "Prefill (the scheduler's)".into() });
        }
        let workers = u32::try_from(addresses.len()).unwrap_or(u32::MAX);
        if workers == 0 {
            return Err(ConfigError::NoRanks { tp: workers });
        }
        let (engine, instance) = (offer.engine.clone(), offer.instance);
        Ok(PrefillScheduler {
            metrics: PrefillMetrics::new(&engine),
            engine,
            instance,
            workers,
            pp: 1,
            addresses,
            config,
            exports: BTreeMap::new(),
            computing: BTreeMap::new(),
            abandoned: BTreeMap::new(),
            unstamped: Recent::new(RECENT_RELEASES),
            freed: Recent::new(RECENT_RELEASES),
            latest: Time::ZERO,
            transfers: BTreeMap::new(),
            paired: BTreeMap::new(),
            events: VecDeque::new(),
        })
    }

    /// Push: `request` is paired with D's leg of it by `transfer` (NixlPushConnector's
    /// `transfer_id`, which the router gave P and D): D's ranks may name its export by that id,
    /// whatever their own request id. Call it before the request's first progress report or
    /// its export; the pairing ends when the request is freed, or at
    /// [`PrefillScheduler::handle_unpaired`] for a request never exported. One transfer id
    /// pairs one request, and a request keeps its first.
    pub fn handle_pairing(&mut self, request: RequestId, transfer: RequestId) -> Result<(), PrefillError> {
        match (self.transfers.get(&request), self.paired.get(&transfer)) {
            (Some(t), _) if *t == transfer => return Ok(()),
            (Some(t), _) => return Err(PrefillError::Paired { request, transfer, other: t.clone() }),
            (None, Some(other)) => return Err(PrefillError::Paired { request, transfer, other: other.clone() }),
            (None, None) => {}
        }
        if self.transfers.len() >= MAX_PAIRINGS {
            return Err(PrefillError::TooManyPairings { request });
        }
        self.paired.insert(transfer.clone(), request.clone());
        self.transfers.insert(request, transfer);
        Ok(())
    }

    /// The engine is done with `request`, which it did not export: its pairing, if any, ends.
    pub fn handle_unpaired(&mut self, request: &RequestId) {
        if self.computing.contains_key(request) || self.exports.contains_key(request) {
            return;
        }
        self.unpair(request);
    }

    fn unpair(&mut self, request: &RequestId) {
        if let Some(transfer) = self.transfers.remove(request) {
            self.paired.remove(&transfer);
        }
    }

    /// The engine runs `pp` pipeline stages: its addresses are those of `pp` stages of equal
    /// TP size, stage by stage (worker `r` is TP rank `r % tp` of stage `r / tp`), and each
    /// stage's worker holds its share of the layers. Fails when the addresses do not split.
    pub fn with_stages(mut self, pp: u32) -> Result<Self, ConfigError> {
        if pp == 0 || self.workers % pp != 0 {
            return Err(ConfigError::Stages { workers: self.workers, pp });
        }
        self.pp = pp;
        Ok(self)
    }

    /// A request finished its prompt: export `blocks` under a lease from `now` (the workers'
    /// clock), bound to `consumer` when the router has already chosen the D engine, and
    /// return the parameters the router hands D. `prompt` is the prompt computed (its length,
    /// and its tokens' digest where the engine has them): P's ranks lend the KV only to a
    /// claim that names it.
    pub fn handle_finished(
        &mut self,
        now: Time,
        request: RequestId,
        blocks: Vec<BlockId>,
        prompt: Prompt,
        consumer: Option<Consumer>,
    ) -> Result<RemoteRef, PrefillError> {
        self.stamp_freed(now);
        self.check_new(&request)?;
        if blocks.is_empty() {
            return Err(PrefillError::NoBlocks(request));
        }
        if let Some(Computed { blocks: computed, .. }) = self.computing.get(&request) {
            if !blocks.starts_with(computed) {
                let (blocks, computed) = (blocks.len(), computed.len());
                return Err(PrefillError::ProgressMismatch { request, blocks, computed });
            }
            self.computing.remove(&request);
        }
        let deadline = now + self.config.kv_lease_duration;
        for rank in 0..self.workers {
            let command = PrefillCommand::Export {
                request: request.clone(),
                blocks: blocks.clone(),
                deadline,
                consumer: consumer.clone(),
                prompt,
                transfer: self.transfers.get(&request).cloned(),
            };
            self.events.push_back(PrefillEvent::ToWorker { rank, command });
        }
        self.metrics.exported(&blocks);
        self.exports.insert(
            request.clone(),
            SchedulerExport { blocks: blocks.clone(), released: BTreeSet::new(), reason: None },
        );
        Ok(RemoteRef {
            prefill: PrefillEngine {
                engine: self.engine.clone(),
                addresses: self.addresses.clone(),
                tp_size: self.workers / self.pp,
                pp_size: self.pp,
            },
            request,
            instance: Some(self.instance),
            prompt_tokens: prompt.tokens,
            prompt_digest: prompt.digest,
            export: Some(ExportInfo { blocks, deadline, finished: Some(now) }),
            consumer,
        })
    }

    /// Stamps the ids freed since the last call with `now` and forgets those freed two leases
    /// before it.
    fn stamp_freed(&mut self, now: Time) {
        self.latest = self.latest.max(now);
        for id in self.unstamped.take_all() {
            self.freed.insert(id, self.latest);
        }
        self.freed.expire(self.latest.saturating_sub(self.config.kv_lease_duration * 2));
    }

    /// Refuses an id that names an export, or a prompt given up, now or recently.
    fn check_new(&self, request: &RequestId) -> Result<(), PrefillError> {
        if self.exports.contains_key(request) || self.abandoned.contains_key(request) {
            return Err(PrefillError::AlreadyExported(request.clone()));
        }
        if self.unstamped.contains(request) || self.freed.contains(request) {
            return Err(PrefillError::Reused(request.clone()));
        }
        Ok(())
    }

    /// A chunked prefill of `request` has computed `blocks` (all of them so far, in prompt
    /// order; each call extends the last). In push mode the workers write them ahead into the
    /// blocks D registered (the consumer's, when the router named one), so that at
    /// [`PrefillScheduler::handle_finished`] only the rest is left to move. From the first call
    /// until [`PrefillEvent::Free`] or the export, the blocks are the connector's: an engine
    /// that gives the request up calls [`PrefillScheduler::handle_abandoned`] and frees them at
    /// `Free`. Pull mode writes nothing ahead; the calls only keep that rule.
    pub fn handle_progress(
        &mut self,
        request: RequestId,
        blocks: Vec<BlockId>,
        consumer: Option<Consumer>,
    ) -> Result<(), PrefillError> {
        self.progress(request, blocks, None, consumer)
    }

    /// As [`PrefillScheduler::handle_progress`], for an engine that computes a chunk layer
    /// by layer: of `blocks` (all of them so far, in prompt order), the first `part.whole`
    /// are computed in every model layer, and the rest, the chunk in progress, in model layers
    /// `0..part.layers` (call it after each layer, or each few; `part.layers` 0 says the chunk
    /// is about to be computed: its blocks are the connector's from this call on, and the
    /// workers write the whole blocks not yet written). In push mode the workers write each
    /// layer of the chunk as it is reported, so that at the export only the last layer of the
    /// last chunk is left to move. A chunk is whole before the next one starts: the whole
    /// blocks never shrink, and `blocks` extends the last call's.
    pub fn handle_layer_progress(
        &mut self,
        request: RequestId,
        blocks: Vec<BlockId>,
        part: LayerProgress,
        consumer: Option<Consumer>,
    ) -> Result<(), PrefillError> {
        self.progress(request, blocks, Some(part), consumer)
    }

    fn progress(
        &mut self,
        request: RequestId,
        blocks: Vec<BlockId>,
        part: Option<LayerProgress>,
        consumer: Option<Consumer>,
    ) -> Result<(), PrefillError> {
        self.check_new(&request)?;
        if blocks.is_empty() {
            return Err(PrefillError::NoBlocks(request));
        }
        let (before, before_whole, before_layers) = match self.computing.get(&request) {
            Some(c) => (c.blocks.as_slice(), c.whole, c.layers),
            None => (&[][..], 0, 0),
        };
        let computed = before.len();
        if !blocks.starts_with(before) {
            return Err(PrefillError::ProgressMismatch { request, blocks: blocks.len(), computed });
        }
        // A part of no block says only that the whole blocks are done. One of no layer names
        // a chunk about to be computed: its blocks are the connector's, none of its layers
        // written yet.
        let part = part.filter(|p| p.whole != blocks.len());
        let (whole, layers) = part.map_or((blocks.len(), 0), |p| (p.whole, p.layers));
        if whole > blocks.len() || whole < before_whole {
            let before = before_whole;
            return Err(PrefillError::LayerMismatch { request, whole, layers, blocks: blocks.len(), before });
        }
        let same_chunk = blocks.len() == computed && whole == before_whole;
        let advanced = !same_chunk || (part.is_some() && layers > before_layers);
        // Layers of one chunk only grow: a report of fewer says nothing new.
        let layers = if same_chunk { layers.max(before_layers) } else { layers };
        if self.config.mode == Mode::Push && advanced {
            for rank in 0..self.workers {
                let command = PrefillCommand::Progress {
                    request: request.clone(),
                    blocks: blocks.clone(),
                    consumer: consumer.clone(),
                    part,
                    transfer: self.transfers.get(&request).cloned(),
                };
                self.events.push_back(PrefillEvent::ToWorker { rank, command });
            }
        }
        self.computing.insert(request, Computed { blocks, whole, layers });
        Ok(())
    }

    /// The engine gives up `request`, reported in progress and not finished (aborted,
    /// preempted). The blocks it reported come back as [`PrefillEvent::Free`] (reason
    /// `aborted`) once no worker writes from them: at once in pull mode, when every rank
    /// released it in push mode; the engine frees the others itself. A request never reported
    /// in progress is [`PrefillError::NotComputing`]: all its blocks are still the engine's.
    pub fn handle_abandoned(&mut self, request: RequestId) -> Result<(), PrefillError> {
        let Some(Computed { blocks, .. }) = self.computing.remove(&request) else {
            return Err(PrefillError::NotComputing(request));
        };
        let reason = ReleaseReason::Aborted;
        if self.config.mode == Mode::Pull {
            self.unpair(&request);
            self.events.push_back(PrefillEvent::Free { request, blocks, reason });
            return Ok(());
        }
        for rank in 0..self.workers {
            let command = PrefillCommand::Abandon { request: request.clone() };
            self.events.push_back(PrefillEvent::ToWorker { rank, command });
        }
        self.abandoned.insert(request, SchedulerExport { blocks, released: BTreeSet::new(), reason: Some(reason) });
        Ok(())
    }

    /// A worker rank's report.
    pub fn handle_report(&mut self, rank: u32, report: PrefillReport) -> Result<(), PrefillError> {
        if rank >= self.workers {
            return Err(PrefillError::NoSuchRank { rank, tp: self.workers });
        }
        let PrefillReport::Released { request, reason } = report;
        if let Some(abandoned) = self.abandoned.get_mut(&request) {
            abandoned.released.insert(rank);
            if abandoned.released.len() as u32 == self.workers {
                let abandoned = self.abandoned.remove(&request).expect("present");
                let reason = ReleaseReason::Aborted;
                self.unstamped.insert(request.clone(), Time::ZERO);
                self.unpair(&request);
                self.events.push_back(PrefillEvent::Free { request, blocks: abandoned.blocks, reason });
            }
            return Ok(());
        }
        let Some(export) = self.exports.get_mut(&request) else {
            tracing::debug!(%request, rank, "release of an export already freed");
            return Ok(());
        };
        export.released.insert(rank);
        let reason = *export.reason.get_or_insert(reason);
        if export.released.len() as u32 == self.workers {
            let export = self.exports.remove(&request).expect("present");
            let _span = crate::common::request_span(&self.engine, None, &request).entered();
            tracing::debug!(%reason, blocks = export.blocks.len(), "export freed on every rank");
            self.metrics.freed(&export.blocks, reason);
            self.unstamped.insert(request.clone(), Time::ZERO);
            self.unpair(&request);
            self.events.push_back(PrefillEvent::Free { request, blocks: export.blocks, reason });
        }
        Ok(())
    }

    /// The next thing the engine must do.
    pub fn poll_event(&mut self) -> Option<PrefillEvent> {
        self.events.pop_front()
    }

    /// Exports not yet freed.
    pub fn pending(&self) -> usize {
        self.exports.len()
    }

    /// The blocks of every export not yet freed.
    pub fn held_blocks(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.exports.values().flat_map(|e| e.blocks.iter().copied())
    }

    /// Workers: the TP size times the pipeline stages.
    pub fn workers(&self) -> u32 {
        self.workers
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn scheduler(mode: Mode) -> PrefillScheduler {
        let config = Config { mode, ..Config::default() };
        let addresses = vec![PeerAddress("p0".into()), PeerAddress("p1".into())];
        let (_, offer) = crate::common::test_offer("prefill0", Role::Prefill, 2);
        PrefillScheduler::new(&offer, addresses, config).expect("valid")
    }

    fn blocks(ids: &[u32]) -> Vec<BlockId> {
        ids.iter().map(|&b| BlockId(b)).collect()
    }

    fn events(s: &mut PrefillScheduler) -> Vec<PrefillEvent> {
        std::iter::from_fn(|| s.poll_event()).collect()
    }

    #[test]
    fn progress_must_extend_what_was_reported() {
        let mut s = scheduler(Mode::Push);
        let r = RequestId::new("r1");
        s.handle_progress(r.clone(), blocks(&[4, 5]), None).unwrap();
        assert_eq!(events(&mut s).len(), 2, "one Progress command for each rank");
        let err = s.handle_progress(r.clone(), blocks(&[4, 6, 7]), None).unwrap_err();
        assert_eq!(err.to_string(), "request r1: 3 blocks do not extend the 2 reported computed before");
        let err = s.handle_finished(Time::ZERO, r.clone(), blocks(&[5, 4, 6]), Prompt::len_only(48), None).unwrap_err();
        assert!(matches!(err, PrefillError::ProgressMismatch { blocks: 3, computed: 2, .. }), "{err}");
        s.handle_finished(Time::ZERO, r, blocks(&[4, 5, 6]), Prompt::len_only(48), None).unwrap();
    }

    #[test]
    fn a_chunk_reported_with_no_layer_computed_is_the_connector_s_and_its_layers_follow() {
        let mut s = scheduler(Mode::Push);
        let r = RequestId::new("r1");
        let part = |whole, layers| LayerProgress { whole, layers };
        let sent = |s: &mut PrefillScheduler| -> Vec<Option<LayerProgress>> {
            let commands = events(s).into_iter().filter_map(|e| match e {
                PrefillEvent::ToWorker { rank: 0, command: PrefillCommand::Progress { part, .. } } => Some(part),
                _ => None,
            });
            commands.collect()
        };
        // vLLM's connector: before the forward, the chunk with none of its layers.
        s.handle_layer_progress(r.clone(), blocks(&[4, 5]), part(0, 0), None).unwrap();
        assert_eq!(sent(&mut s), vec![Some(part(0, 0))]);
        s.handle_layer_progress(r.clone(), blocks(&[4, 5]), part(0, 2), None).unwrap();
        assert_eq!(sent(&mut s), vec![Some(part(0, 2))]);
        // Fewer layers of the same chunk say nothing new.
        s.handle_layer_progress(r.clone(), blocks(&[4, 5]), part(0, 0), None).unwrap();
        assert!(sent(&mut s).is_empty());
        // The next chunk: the last one whole, none of the new one's layers yet.
        s.handle_layer_progress(r.clone(), blocks(&[4, 5, 6]), part(2, 0), None).unwrap();
        assert_eq!(sent(&mut s), vec![Some(part(2, 0))]);
        let err = s.handle_layer_progress(r.clone(), blocks(&[4, 5, 6]), part(1, 3), None).unwrap_err();
        assert_eq!(
            err.to_string(),
            "request r1: 1 whole blocks and 3 layers of 3 blocks do not extend the 2 reported whole before (the whole blocks never shrink, and are at most the blocks reported)"
        );
        let err = s.handle_layer_progress(r.clone(), blocks(&[4, 5, 6]), part(4, 0), None).unwrap_err();
        assert!(matches!(err, PrefillError::LayerMismatch { whole: 4, blocks: 3, .. }), "{err}");
        // The blocks were the connector's from the first report: given up, they come back at Free.
        s.handle_abandoned(r.clone()).unwrap();
        let released = PrefillReport::Released { request: r.clone(), reason: ReleaseReason::Aborted };
        s.handle_report(0, released.clone()).unwrap();
        s.handle_report(1, released).unwrap();
        let free = PrefillEvent::Free { request: r, blocks: blocks(&[4, 5, 6]), reason: ReleaseReason::Aborted };
        assert_eq!(events(&mut s).pop(), Some(free));
    }

    #[test]
    fn a_push_prompt_given_up_frees_when_every_rank_released_it() {
        let mut s = scheduler(Mode::Push);
        let r = RequestId::new("r1");
        assert_eq!(s.handle_abandoned(r.clone()), Err(PrefillError::NotComputing(r.clone())));
        s.handle_progress(r.clone(), blocks(&[4, 5]), None).unwrap();
        s.handle_abandoned(r.clone()).unwrap();
        let abandon = events(&mut s)
            .into_iter()
            .filter(|e| matches!(e, PrefillEvent::ToWorker { command: PrefillCommand::Abandon { .. }, .. }));
        assert_eq!(abandon.count(), 2);
        let released =
            |request: &RequestId| PrefillReport::Released { request: request.clone(), reason: ReleaseReason::Aborted };
        s.handle_report(0, released(&r)).unwrap();
        assert!(events(&mut s).is_empty(), "rank 1 may still be writing from the blocks");
        s.handle_report(1, released(&r)).unwrap();
        let free = PrefillEvent::Free { request: r, blocks: blocks(&[4, 5]), reason: ReleaseReason::Aborted };
        assert_eq!(events(&mut s), vec![free]);
        assert_eq!(s.pending(), 0, "an abandoned prompt was never an export");
    }

    #[test]
    fn a_pull_prompt_given_up_frees_at_once() {
        let mut s = scheduler(Mode::Pull);
        let r = RequestId::new("r1");
        s.handle_progress(r.clone(), blocks(&[4, 5]), None).unwrap();
        assert!(events(&mut s).is_empty(), "pull writes nothing ahead");
        s.handle_abandoned(r.clone()).unwrap();
        let free = PrefillEvent::Free { request: r, blocks: blocks(&[4, 5]), reason: ReleaseReason::Aborted };
        assert_eq!(events(&mut s), vec![free]);
    }

    #[test]
    fn freed_ids_are_refused_for_two_leases_and_then_forgotten() {
        let mut s = scheduler(Mode::Pull);
        let lease = s.config.kv_lease_duration;
        let released = |request: &RequestId| PrefillReport::Released {
            request: request.clone(),
            reason: ReleaseReason::Transferred,
        };
        // 100 exports a second for ten minutes, each read at once.
        let mut now = Time::ZERO;
        for i in 0..60_000u32 {
            let r = RequestId::new(format!("r{i}"));
            s.handle_finished(now, r.clone(), blocks(&[i % 64]), Prompt::len_only(16), None).unwrap();
            s.handle_report(0, released(&r)).unwrap();
            s.handle_report(1, released(&r)).unwrap();
            now = now + Duration::from_millis(10);
        }
        let remembered = s.unstamped.len() + s.freed.len();
        let per_two_leases = (lease * 2).as_millis() as usize / 10;
        // Two leases of stamps, both ends included, and the last id, not yet stamped.
        assert!(remembered <= per_two_leases + 2, "{remembered} ids remembered; two leases hold {per_two_leases}");
        // Refused while a worker may still remember it, accepted two leases past the stamp.
        let last = RequestId::new("r59999");
        let err = s.handle_finished(now, last.clone(), blocks(&[1]), Prompt::len_only(16), None).unwrap_err();
        assert_eq!(err, PrefillError::Reused(last.clone()));
        let err =
            s.handle_finished(now + lease * 2, last.clone(), blocks(&[1]), Prompt::len_only(16), None).unwrap_err();
        assert_eq!(err, PrefillError::Reused(last.clone()), "stamped at the call after its release");
        s.handle_finished(now + lease * 2 + Duration::from_millis(1), last, blocks(&[1]), Prompt::len_only(16), None)
            .unwrap();
    }
}
