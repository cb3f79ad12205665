//! An engine's side of the connector: its scheduler on the engine's thread, and a
//! [`RankThread`] per TP rank, with the traffic between them carried by [`Engine::poll`].

use std::sync::mpsc::{self, Receiver};
use std::sync::Arc;
use std::time::Duration;

use kv_core::{Clock, EngineId, Transport};
use kv_sched_adapter::driver::{WorkerDriver, WorkerMachine};
use kv_sched_adapter::{
    DecodeCommand, DecodeError, DecodeEvent, DecodeScheduler, DecodeWorker, PrefillCommand, PrefillError, PrefillEvent,
    PrefillScheduler, PrefillWorker,
};

use crate::rank::{RankOptions, RankStatus, RankThread};

/// A scheduler's next event, as [`Engine`] sorts them.
#[derive(Debug)]
pub enum Next<C, E> {
    /// A command for rank `.0`'s worker.
    ToRank(u32, C),
    /// Something for the engine itself to do.
    ForEngine(E),
}

/// What an engine's scheduler is to [`Engine`]: P's or D's.
pub trait Scheduler {
    /// Its ranks' worker.
    type Worker: WorkerMachine;
    /// What it asks of the engine besides its workers' commands (blocks to free, loads ended).
    type Event;
    /// Why it refused a report.
    type Error: std::error::Error;
    /// How many ranks it drives.
    fn ranks(&self) -> u32;
    /// A report of rank `rank`'s worker.
    fn handle_report(&mut self, rank: u32, report: <Self::Worker as WorkerMachine>::Report) -> Result<(), Self::Error>;
    /// Its next event: a command for a rank's worker, or one for the engine.
    fn poll_event(&mut self) -> Option<Next<<Self::Worker as WorkerMachine>::Command, Self::Event>>;
}

impl Scheduler for PrefillScheduler {
    type Worker = PrefillWorker;
    type Event = PrefillEvent;
    type Error = PrefillError;
    fn ranks(&self) -> u32 {
        self.workers()
    }
    fn handle_report(&mut self, rank: u32, report: kv_sched_adapter::PrefillReport) -> Result<(), PrefillError> {
        PrefillScheduler::handle_report(self, rank, report)
    }
    fn poll_event(&mut self) -> Option<Next<PrefillCommand, PrefillEvent>> {
        Some(match PrefillScheduler::poll_event(self)? {
            PrefillEvent::ToWorker { rank, command } => Next::ToRank(rank, command),
            other => Next::ForEngine(other),
        })
    }
}

impl Scheduler for DecodeScheduler {
    type Worker = DecodeWorker;
    type Event = DecodeEvent;
    type Error = DecodeError;
    fn ranks(&self) -> u32 {
        self.tp()
    }
    fn handle_report(&mut self, rank: u32, report: kv_sched_adapter::DecodeReport) -> Result<(), DecodeError> {
        DecodeScheduler::handle_report(self, rank, report)
    }
    fn poll_event(&mut self) -> Option<Next<DecodeCommand, DecodeEvent>> {
        Some(match DecodeScheduler::poll_event(self)? {
            DecodeEvent::ToWorker { rank, command } => Next::ToRank(rank, command),
            other => Next::ForEngine(other),
        })
    }
}

/// Why an engine did not start, or could not go on.
#[derive(Debug, thiserror::Error)]
pub enum EngineError<E: std::error::Error> {
    /// The scheduler drives another number of ranks than the engine was given.
    #[error("the scheduler drives {scheduler} ranks, but the engine was given {given}")]
    Ranks {
        /// The scheduler's.
        scheduler: u32,
        /// The workers given.
        given: usize,
    },
    /// A rank's thread could not start.
    #[error("the thread of rank {rank}: {error}")]
    Thread {
        /// The rank.
        rank: u32,
        /// Why.
        error: std::io::Error,
    },
    /// The scheduler refused a worker's report.
    #[error("the scheduler refused rank {rank}'s report: {error}")]
    Report {
        /// The rank.
        rank: u32,
        /// What it said.
        error: E,
    },
}

/// One engine: its scheduler, on the thread that built it (which the ranks' reports unpark),
/// and a thread per TP rank running its worker over its transport. Make the scheduler's calls
/// through [`Engine::scheduler`], then [`Engine::poll`]: it hands the ranks their commands and
/// the scheduler its ranks' reports, and returns what the engine itself must do.
pub struct Engine<S: Scheduler> {
    scheduler: S,
    ranks: Vec<RankThread<S::Worker>>,
    reports: Receiver<(u32, <S::Worker as WorkerMachine>::Report)>,
}

impl<S> Engine<S>
where
    S: Scheduler,
    S::Worker: Send + 'static,
    <S::Worker as WorkerMachine>::Command: Send + 'static,
    <S::Worker as WorkerMachine>::Report: Send + 'static,
{
    /// Starts a thread per rank, `ranks[r]` being rank `r`'s worker and transport, on the
    /// engine's `clock`; fails if the scheduler drives another number of ranks.
    pub fn start(
        scheduler: S,
        ranks: Vec<(S::Worker, Box<dyn Transport>)>,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, EngineError<S::Error>> {
        Self::start_with(scheduler, ranks, clock, |_| RankOptions::default())
    }

    /// [`Engine::start`], each rank's thread running with `options(rank)` (an observer of its
    /// commands, its idle wait).
    pub fn start_with(
        scheduler: S,
        ranks: Vec<(S::Worker, Box<dyn Transport>)>,
        clock: Arc<dyn Clock>,
        mut options: impl FnMut(u32) -> RankOptions<<S::Worker as WorkerMachine>::Command>,
    ) -> Result<Self, EngineError<S::Error>> {
        if scheduler.ranks() as usize != ranks.len() {
            return Err(EngineError::Ranks { scheduler: scheduler.ranks(), given: ranks.len() });
        }
        let (tx, reports) = mpsc::channel();
        let engine = std::thread::current();
        let threads = (0u32..)
            .zip(ranks)
            .map(|(rank, (worker, transport))| {
                let driver = WorkerDriver::new(worker, transport);
                RankThread::spawn(rank, driver, clock.clone(), tx.clone(), engine.clone(), options(rank))
                    .map_err(|error| EngineError::Thread { rank, error })
            })
            .collect::<Result<_, _>>()?;
        Ok(Engine { scheduler, ranks: threads, reports })
    }

    /// The scheduler, for the engine's calls (a prompt finished, a request arrived, blocks
    /// allocated, ...); [`Engine::poll`] after them carries out what they asked.
    pub fn scheduler(&mut self) -> &mut S {
        &mut self.scheduler
    }

    /// Hands the scheduler every report the ranks sent and the ranks every command the
    /// scheduler has for them, until neither has more; returns the scheduler's other events
    /// (blocks to free, loads ended), in order.
    pub fn poll(&mut self) -> Result<Vec<S::Event>, EngineError<S::Error>> {
        let mut events = Vec::new();
        loop {
            let mut moved = false;
            while let Some(event) = self.scheduler.poll_event() {
                moved = true;
                match event {
                    // The scheduler names only its own ranks (checked at start).
                    Next::ToRank(rank, command) => {
                        if let Some(thread) = self.ranks.get(rank as usize) {
                            thread.send(command);
                        }
                    }
                    Next::ForEngine(event) => events.push(event),
                }
            }
            while let Ok((rank, report)) = self.reports.try_recv() {
                moved = true;
                self.scheduler.handle_report(rank, report).map_err(|error| EngineError::Report { rank, error })?;
            }
            if !moved {
                return Ok(events);
            }
        }
    }

    /// Parks the calling thread (the engine's) until a rank reports, or `most` has passed.
    pub fn wait(&self, most: Duration) {
        std::thread::park_timeout(most);
    }

    /// Discovery lost incarnation `instance` of `engine`: every rank hears it.
    pub fn engine_lost(&self, engine: &EngineId, instance: u64) {
        for rank in &self.ranks {
            rank.engine_lost(engine, instance);
        }
    }

    /// What each rank's worker was at, as of its last step, by rank.
    pub fn status(&self) -> Vec<RankStatus> {
        self.ranks.iter().map(RankThread::status).collect()
    }
}
