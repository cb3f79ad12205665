//! One thread per TP rank, as an engine runs one worker per GPU: the rank's [`WorkerDriver`]
//! (its worker and its transport) lives on it, steps at its own wake-ups (its deadlines, its
//! transport's waker), and trades commands and reports with the engine's thread, which keeps
//! the scheduler and the block allocator. Commands and reports cross on channels, and each
//! side unparks the other.

use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::{JoinHandle, Thread};
use std::time::Duration;

use kv_core::{Clock, EngineId};
use kv_sched_adapter::driver::{thread_waker, WorkerDriver, WorkerMachine};
use kv_sched_adapter::Counters;

/// The longest a rank's thread parks when nothing is due, by default. NIXL keeps the
/// notifications nobody asks for (a peer's stray or forged ones) until a rank fetches them, so
/// an idle rank still fetches now and then; everything else wakes the thread: commands, the
/// transport's waker, and the driver's wait time, which covers its deadlines, its transfers in
/// flight and the notifications its worker waits for.
pub const IDLE_WAIT: Duration = Duration::from_millis(50);

/// What the engine's thread asks of a rank's.
enum ToRank<C> {
    /// A command of the scheduler for the rank's worker.
    Command(C),
    /// Discovery says this incarnation of this engine, and every older one, is gone.
    EngineLost(EngineId, u64),
}

/// What a rank's worker was at, as of its last step.
#[derive(Clone, Copy, Debug, Default)]
pub struct RankStatus {
    /// Peer ranks its worker has completed a handshake with.
    pub connected: usize,
    /// What its worker counted.
    pub counters: Counters,
}

/// Sees each command before the rank's worker does, on the rank's thread (an engine's own
/// bookkeeping, a test's or a demo's accounting).
pub type CommandObserver<C> = Box<dyn FnMut(&C) + Send>;

/// How a rank's thread runs.
pub struct RankOptions<C> {
    /// The longest it parks when nothing is due ([`IDLE_WAIT`] by default).
    pub idle_wait: Duration,
    /// Sees each command first, if set.
    pub observer: Option<CommandObserver<C>>,
}

impl<C> Default for RankOptions<C> {
    fn default() -> Self {
        RankOptions { idle_wait: IDLE_WAIT, observer: None }
    }
}

/// A rank's thread, seen from the engine's. Dropping it stops the thread (after its current
/// step) and joins it.
pub struct RankThread<W: WorkerMachine> {
    tx: Option<Sender<ToRank<W::Command>>>,
    status: Arc<Mutex<RankStatus>>,
    thread: Thread,
    join: Option<JoinHandle<()>>,
}

impl<W> RankThread<W>
where
    W: WorkerMachine + Send + 'static,
    W::Command: Send + 'static,
    W::Report: Send + 'static,
{
    /// Starts rank `rank`'s thread with its driver, on the engine's `clock` (which the driver
    /// also times posts with). Its reports go to `reports`, tagged with the rank, and unpark
    /// `engine` (the thread that reads them).
    pub fn spawn(
        rank: u32,
        mut driver: WorkerDriver<W>,
        clock: Arc<dyn Clock>,
        reports: Sender<(u32, W::Report)>,
        engine: Thread,
        options: RankOptions<W::Command>,
    ) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::channel::<ToRank<W::Command>>();
        let status = Arc::new(Mutex::new(RankStatus::default()));
        let published = status.clone();
        let RankOptions { idle_wait, mut observer } = options;
        driver.set_clock(clock.clone());
        let join = std::thread::Builder::new().name(format!("kvflow-rank{rank}")).spawn(move || {
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
                match drain(&rx, &mut driver, &mut observer, &*clock) {
                    Some(batch) => send(batch),
                    None => return,
                }
                let now = clock.now();
                send(driver.step(now));
                let machine = driver.machine_ref();
                let now_status = RankStatus { connected: machine.connected_peers(), counters: machine.counters() };
                *published.lock().unwrap_or_else(PoisonError::into_inner) = now_status;
                match driver.wait_time(now).map_or(idle_wait, |w| w.min(idle_wait)) {
                    // More to do at once (a transfer's next pieces, say): step aside first for
                    // the threads waiting for this core, as a long post would not.
                    wait if wait.is_zero() => std::thread::yield_now(),
                    wait => std::thread::park_timeout(wait),
                }
            }
        })?;
        Ok(RankThread { tx: Some(tx), status, thread: join.thread().clone(), join: Some(join) })
    }

    /// What the rank's worker was at, as of its last step.
    pub fn status(&self) -> RankStatus {
        *self.status.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Hands the rank's worker a command of the scheduler; the rank carries it out at once
    /// ([`WorkerDriver::command`]), and its reports come back through the engine's channel.
    pub fn send(&self, command: W::Command) {
        if let Some(tx) = &self.tx {
            let _ = tx.send(ToRank::Command(command));
        }
        self.thread.unpark();
    }

    /// Tells the rank's worker that discovery lost incarnation `instance` of `engine` (and
    /// every older one): [`WorkerDriver::engine_lost`].
    pub fn engine_lost(&self, engine: &EngineId, instance: u64) {
        if let Some(tx) = &self.tx {
            let _ = tx.send(ToRank::EngineLost(engine.clone(), instance));
        }
        self.thread.unpark();
    }
}

impl<W: WorkerMachine> Drop for RankThread<W> {
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
fn drain<W: WorkerMachine>(
    rx: &Receiver<ToRank<W::Command>>,
    driver: &mut WorkerDriver<W>,
    observer: &mut Option<CommandObserver<W::Command>>,
    clock: &dyn Clock,
) -> Option<Vec<W::Report>> {
    let mut batch = Vec::new();
    loop {
        match rx.try_recv() {
            Ok(ToRank::Command(command)) => {
                if let Some(observe) = observer.as_mut() {
                    observe(&command);
                }
                batch.extend(driver.command(clock.now(), command));
            }
            Ok(ToRank::EngineLost(engine, instance)) => {
                batch.extend(driver.engine_lost(clock.now(), &engine, instance));
            }
            Err(TryRecvError::Empty) => return Some(batch),
            Err(TryRecvError::Disconnected) => return None,
        }
    }
}
