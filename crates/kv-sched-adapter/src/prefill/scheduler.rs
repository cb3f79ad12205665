//! P's scheduler side: exports finished requests and frees their blocks once every TP rank
//! has released them.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use kv_core::{BlockId, EngineId, PeerAddress, RequestId, Time};

use crate::common::{Consumer, ExportInfo, RemoteRef};
use crate::config::{Config, ConfigError, ReleaseReason};
use crate::metrics::PrefillMetrics;

/// What P's scheduler tells a worker rank.
#[derive(Clone, PartialEq, Eq, Debug)]
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
    },
}

/// What a P worker rank tells its scheduler.
#[derive(Clone, PartialEq, Eq, Debug)]
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
    /// An export needs blocks.
    #[error("request {0} has no blocks to export")]
    NoBlocks(RequestId),
    /// A report named a rank outside the engine.
    #[error("rank {rank} is outside the engine's {tp} workers")]
    NoSuchRank {
        /// The rank.
        rank: u32,
        /// The engine's workers (TP size times pipeline stages).
        tp: u32,
    },
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
    events: VecDeque<PrefillEvent>,
    metrics: PrefillMetrics,
}

impl PrefillScheduler {
    /// A scheduler for incarnation `instance` of `engine` (the value its workers' handshakes
    /// carry), whose rank `r` listens at `addresses[r]`; fails on settings that cannot work
    /// ([`Config::validate`]) or no address.
    pub fn new(
        engine: EngineId,
        instance: u64,
        addresses: Vec<PeerAddress>,
        config: Config,
    ) -> Result<Self, ConfigError> {
        config.validate()?;
        let workers = u32::try_from(addresses.len()).unwrap_or(u32::MAX);
        if workers == 0 {
            return Err(ConfigError::NoRanks { tp: workers });
        }
        Ok(PrefillScheduler {
            metrics: PrefillMetrics::new(&engine),
            engine,
            instance,
            workers,
            pp: 1,
            addresses,
            config,
            exports: BTreeMap::new(),
            events: VecDeque::new(),
        })
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

    /// A request finished its prompt: export `blocks` under a lease from `now`, bound to
    /// `consumer` when the router has already chosen the D engine, and return the parameters
    /// the router hands D.
    pub fn handle_finished(
        &mut self,
        now: Time,
        request: RequestId,
        blocks: Vec<BlockId>,
        prompt_tokens: u64,
        consumer: Option<Consumer>,
    ) -> Result<RemoteRef, PrefillError> {
        if self.exports.contains_key(&request) {
            return Err(PrefillError::AlreadyExported(request));
        }
        if blocks.is_empty() {
            return Err(PrefillError::NoBlocks(request));
        }
        let deadline = now + self.config.kv_lease_duration;
        for rank in 0..self.workers {
            let command = PrefillCommand::Export {
                request: request.clone(),
                blocks: blocks.clone(),
                deadline,
                consumer: consumer.clone(),
            };
            self.events.push_back(PrefillEvent::ToWorker { rank, command });
        }
        self.metrics.exported(&blocks);
        self.exports.insert(
            request.clone(),
            SchedulerExport { blocks: blocks.clone(), released: BTreeSet::new(), reason: None },
        );
        Ok(RemoteRef {
            engine: self.engine.clone(),
            request,
            addresses: self.addresses.clone(),
            tp_size: self.workers / self.pp,
            pp_size: self.pp,
            instance: Some(self.instance),
            prompt_tokens,
            export: Some(ExportInfo { blocks, deadline, finished: now }),
            consumer,
        })
    }

    /// A worker rank's report.
    pub fn handle_report(&mut self, rank: u32, report: PrefillReport) -> Result<(), PrefillError> {
        if rank >= self.workers {
            return Err(PrefillError::NoSuchRank { rank, tp: self.workers });
        }
        let PrefillReport::Released { request, reason } = report;
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
