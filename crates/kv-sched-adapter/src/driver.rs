//! The thin driver: runs a worker state machine over a [`Transport`].
//!
//! It feeds the machine what the transport has (peer events, notifications, finished
//! transfers), then the wake-up, then carries out the machine's actions in order. It holds no
//! lifecycle logic, so swapping the transport (NIXL, the in-memory fake) swaps nothing else.
//! It is synchronous; a tokio engine calls [`WorkerDriver::step`] from its loop, and the
//! simulator calls it at each simulated time.
//!
//! Between steps an engine waits rather than polls: [`WorkerDriver::wait_time`] says how long
//! it may (until the machine's next deadline, and no longer than the transport's poll interval
//! for what the transport cannot signal), and the waker given to [`WorkerDriver::set_waker`]
//! ends the wait early when the transport's own threads queue something. A synchronous engine
//! parks its thread with [`thread_waker`]:
//!
//! ```no_run
//! # use kv_sched_adapter::driver::{thread_waker, WorkerDriver, WorkerMachine};
//! # fn engine<M: WorkerMachine>(driver: &mut WorkerDriver<M>, now: impl Fn() -> kv_core::Time) {
//! driver.set_waker(thread_waker());
//! loop {
//!     let reports = driver.step(now());
//!     // ... hand `reports` to the scheduler, and the scheduler's commands to the machine ...
//!     # drop(reports);
//!     match driver.wait_time(now()) {
//!         Some(wait) => std::thread::park_timeout(wait),
//!         None => std::thread::park(),
//!     }
//! }
//! # }
//! ```
//! Anything else that should wake the engine (its own input) unparks the thread too; a
//! spurious wake-up costs one step that finds nothing to do.
//!
//! A step feeds the machine at most [`MAX_EVENTS_PER_STEP`] of the transport's events and
//! carries out what they asked for before it returns; the rest wait for the next step, which
//! [`WorkerDriver::wait_time`] and [`WorkerDriver::poll_timeout`] then say is due at once. So a
//! peer that floods the transport (a key holder's heartbeats naming ids by the million) can
//! neither grow the machine's pending actions without bound nor keep the engine's thread in one
//! step, away from its scheduler's commands.
//!
//! A notification the transport refuses to send is counted and sent again, in order and within
//! bounds ([`NotificationStats`], and the `resend` module's docs for why the driver and not the
//! machine keeps it); its resends are due at times that [`WorkerDriver::poll_timeout`] and
//! [`WorkerDriver::wait_time`] include. With a clock ([`WorkerDriver::set_clock`]), the driver
//! also times each post (`kvflow_post_time_seconds`); without one it reads no time but the
//! `now` it is given.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::task::{Wake, Waker};
use std::thread::Thread;
use std::time::Duration;

use kv_core::{
    Clock, Descriptors, EngineId, PeerEvent, PreparedId, Time, TransferId, TransferSizes, TransferStatus, Transport,
    TransportError,
};

use crate::common::{Action, Counters, XferToken};
use crate::decode::{DecodeCommand, DecodeReport, DecodeWorker};
use crate::metrics::{InFlight, WorkerMetrics};
use crate::prefill::{PrefillCommand, PrefillReport, PrefillWorker};

mod resend;

use resend::Resends;
pub use resend::{NotificationStats, FIRST_RESEND_DELAY, MAX_PENDING_RESENDS, MAX_SEND_ATTEMPTS};

/// At most this many of the transport's events (peer events and notifications) are fed to the
/// machine in one [`WorkerDriver::step`], and between the actions carried out in
/// [`WorkerDriver::engine_lost`]: the machine's pending actions are then the effects of at most
/// this many inputs (a notification is at most 64 KiB, and a heartbeat's acknowledgement about
/// as big, so about 8 MiB at worst). Before this bound, a key holder's heartbeat flood (250
/// distinct 240-byte ids a heartbeat, about 16 MB/s) kept a P rank in one step for as long as
/// it lasted, and every acknowledgement waited in the machine, none of them ever sent: P grew
/// by 907 MiB in 30 s.
pub const MAX_EVENTS_PER_STEP: usize = 64;

/// At most this many batches of [`MAX_EVENTS_PER_STEP`] events are taken in before a loss
/// that discovery reports ([`WorkerDriver::engine_lost`]): far more than an engine queues
/// between two steps, and a bound for a flood that never lets the queue run dry.
const MAX_BATCHES_BEFORE_LOSS: usize = 256;

/// A worker machine the driver can run: P's or D's.
pub trait WorkerMachine {
    /// What the machine reports to its scheduler.
    type Report;
    /// What its scheduler tells it ([`PrefillCommand`], [`DecodeCommand`]); hand it over with
    /// [`WorkerDriver::command`], which carries out what follows at once.
    type Command;
    /// A command of its scheduler.
    fn handle_command(&mut self, now: Time, command: Self::Command);
    /// A peer event from the transport (notifications come as [`PeerEvent::Notification`]).
    fn handle_peer_event(&mut self, now: Time, event: PeerEvent);
    /// A transfer the machine asked for ended.
    fn handle_transfer(&mut self, now: Time, token: XferToken, ok: bool);
    /// A read the machine asked for failed part-way, and only the local ranges in `spoiled`
    /// may hold bad bytes ([`TransportError::PartlyFailed`]); by default, a failure like any other.
    fn handle_transfer_spoiled(&mut self, now: Time, token: XferToken, spoiled: Vec<(u64, u64)>) {
        let _ = spoiled;
        self.handle_transfer(now, token, false);
    }
    /// A descriptor list the machine asked to prepare is ready, or could not be made.
    fn handle_prepared(&mut self, now: Time, token: XferToken, result: Result<PreparedId, TransportError>);
    /// A wake-up.
    fn handle_timeout(&mut self, now: Time);
    /// Discovery says incarnation `instance` of `engine`, and every older one, is gone.
    fn handle_engine_lost(&mut self, now: Time, engine: &EngineId, instance: u64);
    /// The next action.
    fn poll_action(&mut self) -> Option<Action<Self::Report>>;
    /// The next wake-up.
    fn poll_timeout(&mut self) -> Option<Time>;
    /// Whether the machine waits for something a peer sends (a completion, an acknowledgement,
    /// a push write's notification), which the transport may not be able to signal.
    fn awaits_peers(&self) -> bool;
    /// What the machine counted.
    fn counters(&self) -> Counters;
    /// Peer ranks connected to it.
    fn connected_peers(&self) -> usize;
    /// Its heartbeat interval (the configuration's): how long after the machine asked for a
    /// notification that the transport refused the driver may still send it.
    fn heartbeat_interval(&self) -> Duration;
    /// How its transport moves whole blocks fastest ([`Transport::descriptors`]); the
    /// machine's configuration (`kv_descriptors`) overrides it.
    fn use_descriptors(&mut self, preferred: Descriptors);
}

macro_rules! worker_machine {
    ($machine:ty, $report:ty, $command:ty) => {
        impl WorkerMachine for $machine {
            type Report = $report;
            type Command = $command;
            fn handle_command(&mut self, now: Time, command: $command) {
                <$machine>::handle_command(self, now, command)
            }
            fn handle_peer_event(&mut self, now: Time, event: PeerEvent) {
                <$machine>::handle_peer_event(self, now, event)
            }
            fn handle_transfer(&mut self, now: Time, token: XferToken, ok: bool) {
                <$machine>::handle_transfer(self, now, token, ok)
            }
            fn handle_transfer_spoiled(&mut self, now: Time, token: XferToken, spoiled: Vec<(u64, u64)>) {
                <$machine>::handle_transfer_spoiled(self, now, token, spoiled)
            }
            fn handle_prepared(&mut self, now: Time, token: XferToken, result: Result<PreparedId, TransportError>) {
                <$machine>::handle_prepared(self, now, token, result)
            }
            fn handle_timeout(&mut self, now: Time) {
                <$machine>::handle_timeout(self, now)
            }
            fn handle_engine_lost(&mut self, now: Time, engine: &EngineId, instance: u64) {
                <$machine>::handle_engine_lost(self, now, engine, instance)
            }
            fn poll_action(&mut self) -> Option<Action<Self::Report>> {
                <$machine>::poll_action(self)
            }
            fn poll_timeout(&mut self) -> Option<Time> {
                <$machine>::poll_timeout(self)
            }
            fn awaits_peers(&self) -> bool {
                <$machine>::awaits_peers(self)
            }
            fn counters(&self) -> Counters {
                <$machine>::counters(self)
            }
            fn connected_peers(&self) -> usize {
                <$machine>::connected_peers(self)
            }
            fn heartbeat_interval(&self) -> Duration {
                <$machine>::heartbeat_interval(self)
            }
            fn use_descriptors(&mut self, preferred: Descriptors) {
                <$machine>::use_descriptors(self, preferred)
            }
        }
    };
}

worker_machine!(PrefillWorker, PrefillReport, PrefillCommand);
worker_machine!(DecodeWorker, DecodeReport, DecodeCommand);

/// A worker machine and the transport of its rank.
pub struct WorkerDriver<M> {
    machine: M,
    transport: Box<dyn Transport>,
    in_flight: BTreeMap<TransferId, (XferToken, InFlight)>,
    /// The bytes of each transfer posted, for its metrics.
    sizes: TransferSizes,
    metrics: WorkerMetrics,
    /// The last step stopped at [`MAX_EVENTS_PER_STEP`] events, at this time: the transport
    /// may hold more, so the next step is due at once.
    backlog: Option<Time>,
    /// Notifications the transport refused, to send again.
    resends: Resends,
    /// The engine's clock, to time posts with; none, and posts are not timed.
    clock: Option<Arc<dyn Clock>>,
}

impl<M: WorkerMachine> WorkerDriver<M> {
    /// Runs `machine` over `transport`. With the `metrics` feature, the rank's metrics are
    /// registered here (see [`crate::metrics`]).
    pub fn new(mut machine: M, transport: Box<dyn Transport>) -> Self {
        machine.use_descriptors(transport.descriptors());
        let agent = transport.agent();
        let metrics = WorkerMetrics::new(&agent.engine, agent.rank);
        let resends = Resends::new(machine.heartbeat_interval());
        WorkerDriver {
            machine,
            transport,
            in_flight: BTreeMap::new(),
            sizes: TransferSizes::default(),
            metrics,
            backlog: None,
            resends,
            clock: None,
        }
    }

    /// Gives the driver the engine's clock, with which it times each post
    /// (`kvflow_post_time_seconds`: from calling the transport's `post` or `post_prepared` to
    /// its return). It reads it for nothing else: the machine's time is still the `now` given
    /// to each call.
    pub fn set_clock(&mut self, clock: Arc<dyn Clock>) {
        self.clock = Some(clock);
    }

    /// Hands the machine a command of its scheduler and carries out what it asks for at once
    /// (a read, a write, a notification go out now, not at the next step); returns its reports.
    pub fn command(&mut self, now: Time, command: M::Command) -> Vec<M::Report> {
        self.machine.handle_command(now, command);
        self.flush(now)
    }

    /// The machine (after calling it, call [`WorkerDriver::flush`]: [`WorkerDriver::command`]
    /// does both for a command).
    pub fn machine(&mut self) -> &mut M {
        &mut self.machine
    }

    /// The machine, read-only.
    pub fn machine_ref(&self) -> &M {
        &self.machine
    }

    /// The transport.
    pub fn transport(&mut self) -> &mut dyn Transport {
        self.transport.as_mut()
    }

    /// Feeds the machine what the transport has (at most [`MAX_EVENTS_PER_STEP`] events),
    /// wakes it, and carries out its actions; returns its reports for the scheduler.
    pub fn step(&mut self, now: Time) -> Vec<M::Report> {
        // Every event of this step carries the rank's engine and TP rank.
        let agent = self.transport.agent();
        let span = tracing::debug_span!("step", engine = %agent.engine, rank = agent.rank);
        let _entered = span.enter();
        let more = self.take_events(now, MAX_EVENTS_PER_STEP);
        self.backlog = more.then_some(now);
        let ids: Vec<TransferId> = self.in_flight.keys().copied().collect();
        for id in ids {
            match self.transport.poll_transfer(id) {
                TransferStatus::InProgress => {}
                TransferStatus::Done => {
                    let (token, transfer) = self.in_flight.remove(&id).expect("in flight");
                    self.metrics.ended(&transfer, now, true);
                    self.machine.handle_transfer(now, token, true);
                }
                TransferStatus::Failed(err) => {
                    tracing::debug!(?id, %err, "transfer failed");
                    let (token, transfer) = self.in_flight.remove(&id).expect("in flight");
                    self.metrics.ended(&transfer, now, false);
                    match err {
                        TransportError::PartlyFailed { spoiled, .. } => {
                            self.machine.handle_transfer_spoiled(now, token, spoiled)
                        }
                        _ => self.machine.handle_transfer(now, token, false),
                    }
                }
            }
        }
        self.machine.handle_timeout(now);
        self.flush(now)
    }

    /// Feeds the machine up to `limit` of the transport's events: one ordered stream, in which
    /// a lost peer's notifications come before its loss. Whether it stopped at the limit (the
    /// transport may hold more).
    fn take_events(&mut self, now: Time, limit: usize) -> bool {
        for _ in 0..limit {
            let Some(event) = self.transport.poll_event() else { return false };
            match &event {
                // Gone, or a newer incarnation under its name: what waited for it is not for it.
                PeerEvent::Lost(peer) => self.resends.forget(peer),
                PeerEvent::Connected(info) => self.resends.forget(&info.agent),
                _ => {}
            }
            self.machine.handle_peer_event(now, event);
        }
        true
    }

    /// Discovery says incarnation `instance` of `engine`, and every older one, is gone (its
    /// registration lapsed): the machine learns what the transport already has from it, then
    /// the loss, and the transport drops its agents. Returns the machine's reports.
    pub fn engine_lost(&mut self, now: Time, engine: &EngineId, instance: u64) -> Vec<M::Report> {
        let agent = self.transport.agent();
        let span =
            tracing::debug_span!("engine_lost", engine = %agent.engine, rank = agent.rank, lost = %engine, instance);
        let _entered = span.enter();
        // What was queued before the loss, a batch at a time, each batch's actions carried out
        // before the next, so that they never pile up in the machine; at most
        // `MAX_BATCHES_BEFORE_LOSS` batches, so that a peer flooding the transport cannot keep
        // the rank from the loss (what it sent after that comes after the loss, and is taken as
        // from a peer gone: counted and ignored).
        let mut reports = Vec::new();
        let mut more = true;
        for _ in 0..MAX_BATCHES_BEFORE_LOSS {
            more = self.take_events(now, MAX_EVENTS_PER_STEP);
            reports.extend(self.carry_out(now));
            if !more {
                break;
            }
        }
        self.backlog = more.then_some(now);
        self.machine.handle_engine_lost(now, engine, instance);
        reports.extend(self.flush(now));
        reports
    }

    /// Carries out the machine's pending actions; returns its reports.
    pub fn flush(&mut self, now: Time) -> Vec<M::Report> {
        let agent = self.transport.agent();
        let span = tracing::debug_span!("flush", engine = %agent.engine, rank = agent.rank);
        let _entered = span.enter();
        let reports = self.carry_out(now);
        self.metrics.update(&self.machine.counters(), self.machine.connected_peers());
        self.metrics.notifications(&self.resends.stats());
        reports
    }

    /// Sends again the notifications due, then carries out the machine's pending actions, in
    /// order; returns its reports.
    fn carry_out(&mut self, now: Time) -> Vec<M::Report> {
        self.resends.resend_due(now, self.transport.as_mut());
        let mut reports = Vec::new();
        while let Some(action) = self.machine.poll_action() {
            match action {
                Action::Connect(address) => {
                    if let Err(error) = self.transport.connect(&address) {
                        self.machine.handle_peer_event(now, PeerEvent::ConnectFailed { address, error });
                    }
                }
                Action::Send { to, payload } => self.resends.send(now, &to, payload, self.transport.as_mut()),
                Action::Post { token, request } => {
                    let transfer = InFlight { posted: now, bytes: request.bytes(), descriptors: request.pairs.len() };
                    let started = self.clock.as_ref().map(|clock| clock.now());
                    let result = self.transport.post(request);
                    self.timed(started, &result);
                    self.posted(now, token, transfer, result);
                }
                Action::Prepare { token, peer, ranges } => {
                    let result = self.transport.prepare(peer.as_ref(), &ranges);
                    if let Ok(id) = &result {
                        self.sizes.prepared(peer.as_ref(), &ranges, *id);
                    }
                    self.machine.handle_prepared(now, token, result);
                }
                Action::PostPrepared { token, request } => {
                    let bytes = self.sizes.of_prepared(&request);
                    let transfer = InFlight { posted: now, bytes, descriptors: request.local_indices.len() };
                    let started = self.clock.as_ref().map(|clock| clock.now());
                    let result = self.transport.post_prepared(request);
                    self.timed(started, &result);
                    self.posted(now, token, transfer, result);
                }
                Action::Disconnect(peer) => {
                    self.resends.forget(&peer);
                    self.transport.disconnect(&peer);
                }
                Action::Report(report) => reports.push(report),
            }
        }
        reports
    }

    /// Records how long the transport took to accept a transfer posted at `started` (on the
    /// clock, if the driver has one); a refused post is not timed.
    fn timed(&self, started: Option<Time>, result: &Result<TransferId, TransportError>) {
        if let (Some(clock), Some(started), Ok(_)) = (&self.clock, started, result) {
            self.metrics.post_time(clock.now().saturating_since(started));
        }
    }

    /// Records a transfer the transport took, or tells the machine it refused it.
    fn posted(&mut self, now: Time, token: XferToken, transfer: InFlight, result: Result<TransferId, TransportError>) {
        self.metrics.posted();
        match result {
            Ok(id) => {
                self.in_flight.insert(id, (token, transfer));
            }
            Err(err) => {
                tracing::debug!(%err, "transfer refused");
                self.metrics.ended(&transfer, now, false);
                self.machine.handle_transfer(now, token, false);
            }
        }
    }

    /// When the machine next wants a [`WorkerDriver::step`], or a refused notification is due to
    /// be sent again; transport activity may come sooner. After a step that left events in the
    /// transport ([`MAX_EVENTS_PER_STEP`]), that step's time.
    pub fn poll_timeout(&mut self) -> Option<Time> {
        [self.machine.poll_timeout(), self.resends.next_due(), self.backlog].into_iter().flatten().min()
    }

    /// Hands the transport the waker that ends an engine's wait when the transport's own
    /// threads queue something ([`Transport::set_waker`]).
    pub fn set_waker(&mut self, waker: Waker) {
        self.transport.set_waker(waker);
    }

    /// How long the engine may wait from `now` before its next [`WorkerDriver::step`]: until
    /// the machine's next deadline or the next resend of a refused notification, and no longer
    /// than the transport's poll interval while transfers are in flight or the machine awaits a
    /// peer; `None` when nothing is due and only the waker (or the engine's own input) can
    /// bring work. Zero after a step that left events in the transport
    /// ([`MAX_EVENTS_PER_STEP`]).
    pub fn wait_time(&mut self, now: Time) -> Option<Duration> {
        if self.backlog.is_some() {
            return Some(Duration::ZERO);
        }
        let intervals = self.transport.poll_intervals();
        let due = [self.machine.poll_timeout(), self.resends.next_due()].into_iter().flatten().min();
        let deadline = due.map(|at| at.saturating_since(now));
        let transfers = if self.in_flight.is_empty() { None } else { intervals.transfers };
        let peers = if self.machine.awaits_peers() { intervals.notifications } else { None };
        [deadline, transfers, peers].into_iter().flatten().min()
    }

    /// Whether the last step stopped at [`MAX_EVENTS_PER_STEP`] events, so that the transport
    /// may hold more and the next step is due at once.
    pub fn backlogged(&self) -> bool {
        self.backlog.is_some()
    }

    /// Transfers posted and not yet ended.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// What became of the notifications the machine asked to send: sends the transport
    /// refused, notifications sent again after that, and those given up.
    pub fn notifications(&self) -> NotificationStats {
        self.resends.stats()
    }

    /// Notifications the transport refused that wait to be sent again.
    pub fn resends_waiting(&self) -> usize {
        self.resends.waiting()
    }
}

/// A waker that unparks the calling thread: for an engine that waits with
/// [`std::thread::park_timeout`] (see the module docs).
pub fn thread_waker() -> Waker {
    Waker::from(Arc::new(Unpark(std::thread::current())))
}

struct Unpark(Thread);

impl Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.0.unpark();
    }
}

#[cfg(test)]
mod tests;
