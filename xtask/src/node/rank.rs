//! One thread per TP rank of an engine process, as an engine runs one worker per GPU: the
//! rank's `WorkerDriver` (its worker and its transport, one NIXL agent) lives on it, steps at
//! its own wake-ups (its deadlines, its transport's waker), and trades commands and reports
//! with the engine's thread, which keeps the scheduler side and the pool's memory.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::sync::Arc;
use std::thread::{JoinHandle, Thread};

use anyhow::{Context, Result};
use kv_core::{BlockId, Clock, EngineId};
use kv_sched_adapter::driver::{thread_waker, WorkerDriver, WorkerMachine};

use super::transport::AheadOf;
use super::IDLE_WAIT;

/// What the engine's thread asks of a rank's.
enum ToRank<C> {
    /// A command of the scheduler for the rank's worker.
    Command(C),
    /// Discovery says this incarnation of this engine, and every older one, is gone.
    EngineLost(EngineId, u64),
}

/// What the demo's engine watches of the commands a rank's worker gets.
pub(super) struct Hooks<C> {
    /// What a command says of the request the worker writes ahead for.
    pub writes_ahead: fn(&C) -> WritesAhead,
    /// Where the rank's transport reads that request.
    pub ahead_of: AheadOf,
}

/// What a command says of the request a P worker writes ahead for (its chunked prefill).
pub(super) enum WritesAhead {
    /// Nothing.
    Same,
    /// This request has computed these blocks: writes without a notification from them are its
    /// own.
    Computed(String, Vec<BlockId>),
    /// This request is exported or given up: none of its writes go ahead any more.
    Ended(String),
}

/// A rank's thread, seen from the engine's.
pub(super) struct Rank<C> {
    tx: Option<Sender<ToRank<C>>>,
    /// Peers the rank's worker has completed a handshake with, as of its last step.
    connected: Arc<AtomicUsize>,
    /// Writes ahead of their export its worker posted, as of its last step.
    writes_ahead: Arc<AtomicU64>,
    thread: Thread,
    join: Option<JoinHandle<()>>,
}

impl<C: Send + 'static> Rank<C> {
    /// Starts rank `rank`'s thread with its driver; its reports go to `reports`, tagged with
    /// the rank, and wake `engine`.
    pub(super) fn spawn<W>(
        rank: u32,
        mut driver: WorkerDriver<W>,
        hooks: Hooks<C>,
        clock: Arc<dyn Clock>,
        reports: Sender<(u32, W::Report)>,
        engine: Thread,
    ) -> Result<Self>
    where
        W: WorkerMachine<Command = C> + Send + 'static,
        W::Report: Send + 'static,
    {
        let (tx, rx) = mpsc::channel::<ToRank<C>>();
        let connected = Arc::new(AtomicUsize::new(0));
        let peers = connected.clone();
        let writes_ahead = Arc::new(AtomicU64::new(0));
        let ahead = writes_ahead.clone();
        let join = std::thread::Builder::new()
            .name(format!("kvflow-rank{rank}"))
            .spawn(move || {
                driver.set_waker(thread_waker());
                let send = |batch: Vec<W::Report>| {
                    let any = !batch.is_empty();
                    for report in batch {
                        let _ = reports.send((rank, report));
                    }
                    if any {
                        engine.unpark();
                    }
                };
                loop {
                    match drain(&rx, &mut driver, &hooks, &*clock) {
                        Some(batch) => send(batch),
                        None => return,
                    }
                    let now = clock.now();
                    send(driver.step(now));
                    peers.store(driver.machine_ref().connected_peers(), Ordering::Relaxed);
                    ahead.store(driver.machine_ref().counters().writes_ahead, Ordering::Relaxed);
                    std::thread::park_timeout(driver.wait_time(now).map_or(IDLE_WAIT, |w| w.min(IDLE_WAIT)));
                }
            })
            .with_context(|| format!("the thread of rank {rank}"))?;
        Ok(Rank { tx: Some(tx), connected, writes_ahead, thread: join.thread().clone(), join: Some(join) })
    }

    /// Peers the rank's worker has completed a handshake with.
    pub(super) fn connected(&self) -> usize {
        self.connected.load(Ordering::Relaxed)
    }

    /// Writes ahead of their export the rank's worker posted.
    pub(super) fn writes_ahead(&self) -> u64 {
        self.writes_ahead.load(Ordering::Relaxed)
    }

    /// Hands the rank's worker a command of the scheduler.
    pub(super) fn send(&self, command: C) {
        if let Some(tx) = &self.tx {
            let _ = tx.send(ToRank::Command(command));
        }
        self.thread.unpark();
    }

    /// Tells the rank's worker that discovery lost incarnation `instance` of `engine`.
    pub(super) fn engine_lost(&self, engine: &EngineId, instance: u64) {
        if let Some(tx) = &self.tx {
            let _ = tx.send(ToRank::EngineLost(engine.clone(), instance));
        }
        self.thread.unpark();
    }
}

impl<C> Drop for Rank<C> {
    fn drop(&mut self) {
        // A closed channel stops the thread at its next wake-up; wake it now.
        self.tx = None;
        self.thread.unpark();
        if let Some(join) = self.join.take() {
            let _ = join.join();
        }
    }
}

/// Carries out what the engine's thread sent; the reports that follow at once, or `None` when
/// the engine is gone.
fn drain<W: WorkerMachine<Command = C>, C>(
    rx: &Receiver<ToRank<C>>,
    driver: &mut WorkerDriver<W>,
    hooks: &Hooks<C>,
    clock: &dyn Clock,
) -> Option<Vec<W::Report>> {
    let mut batch = Vec::new();
    loop {
        match rx.try_recv() {
            Ok(ToRank::Command(command)) => {
                let now = clock.now();
                match (hooks.writes_ahead)(&command) {
                    WritesAhead::Same => {}
                    WritesAhead::Computed(request, blocks) => hooks.ahead_of.computed(&request, &blocks),
                    WritesAhead::Ended(request) => hooks.ahead_of.ended(&request),
                }
                batch.extend(driver.command(now, command));
            }
            Ok(ToRank::EngineLost(engine, instance)) => {
                batch.extend(driver.engine_lost(clock.now(), &engine, instance));
            }
            Err(TryRecvError::Empty) => return Some(batch),
            Err(TryRecvError::Disconnected) => return None,
        }
    }
}
