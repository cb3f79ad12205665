//! What a transport's threads share: the side channel, the registered memory, the peers a
//! data connection may authenticate as, the transfers in flight, the queue of received
//! notifications, the engine's waker and the counters.
//!
//! Lock order, where two are held at once: `transfers`, then a connection's queue, then the
//! side channel's own lock; `inbox`, then the side channel's own lock; `peers`, then a
//! connection's slot. No lock is held while a socket
//! blocks, except a region's copy lock (see `memory`), and the waker is woken with no lock held.

use std::collections::{HashMap, VecDeque};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::task::Waker;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kv_core::side::SideLimits;
use kv_core::{
    AgentName, Notification, PeerEvent, RefusalCause, TransferId, TransferOp, TransferStatus, TransportError,
};
use kv_side_tcp::SideChannel;

use crate::memory::Registry;
use crate::DataStatus;

/// How long a peer whose side channel closed may go on sending on its data connections
/// before its loss is reported: what it sent before it closed is taken in first.
pub(crate) const CLOSE_GRACE: Duration = Duration::from_millis(500);

/// At most this many bytes of one peer's notifications wait for the engine: past it, the
/// peer's data connection is not read until the engine takes some in, so TCP's flow control
/// holds the peer back (a D renews and completes in notifications of a few hundred bytes to
/// 64 KiB, which its engine takes in as they come).
pub const MAX_QUEUED_NOTIFICATION_BYTES_PER_PEER: usize = 4 << 20;
/// At most this many bytes of all peers' notifications wait for the engine, likewise.
pub const MAX_QUEUED_NOTIFICATION_BYTES: usize = 16 << 20;

/// What the data connections took in for the engine, and the bytes of notifications in it.
#[derive(Default)]
struct Inbox {
    events: VecDeque<PeerEvent>,
    /// Bytes of queued notifications, by peer (no entry at zero).
    bytes: HashMap<AgentName, usize>,
    total: usize,
}

/// Locks a mutex, taking over the data of a thread that panicked while holding it.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// One descriptor pair of a transfer: local address, remote address, length.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct Pair {
    pub(crate) local: u64,
    pub(crate) remote: u64,
    pub(crate) len: u64,
}

/// A transfer in flight, until the engine polls its outcome.
pub(crate) struct Flight {
    pub(crate) op: TransferOp,
    pub(crate) peer: AgentName,
    /// The outgoing data connection that carries it.
    pub(crate) conn: u64,
    pub(crate) pairs: Arc<[Pair]>,
    /// Reads: how far each pair got.
    received: Vec<PairProgress>,
    /// Replies still to come: a read's unsettled pairs, or a write's acknowledgement.
    unsettled: usize,
    /// The first thing that went wrong; the transfer fails with it once settled.
    error: Option<TransportError>,
    /// A read's notification, sealed and sent once every byte is here.
    pub(crate) notification: Option<Vec<u8>>,
    outcome: Option<TransferStatus>,
}

impl Flight {
    pub(crate) fn new(
        op: TransferOp,
        peer: AgentName,
        conn: u64,
        pairs: Arc<[Pair]>,
        notification: Option<Vec<u8>>,
    ) -> Self {
        let (received, unsettled) = match op {
            TransferOp::Read => (vec![PairProgress::default(); pairs.len()], pairs.len()),
            TransferOp::Write => (Vec::new(), 1),
        };
        Flight { op, peer, conn, pairs, received, unsettled, error: None, notification, outcome: None }
    }
}

impl Flight {
    /// How the transfer ends, failed with `error`. A read says which local ranges may hold bad
    /// bytes when some of its bytes arrived whole ([`TransportError::PartlyFailed`]): each
    /// pair's bytes land in order, so what arrived of a pair before the failure is whole,
    /// unless its local range was withdrawn and they were dropped. Otherwise it fails whole.
    fn failed(&self, error: TransportError) -> TransferStatus {
        if self.op == TransferOp::Read {
            let spoiled: Vec<(u64, u64)> = (self.pairs.iter().zip(&self.received))
                .filter_map(|(p, r)| {
                    let whole = if r.dropped { 0 } else { r.arrived };
                    (whole < p.len).then_some((p.local + whole, p.len - whole))
                })
                .collect();
            let total: u64 = self.pairs.iter().map(|p| p.len).sum();
            if spoiled.iter().map(|&(_, len)| len).sum::<u64>() < total {
                return TransferStatus::Failed(TransportError::PartlyFailed { reason: error.to_string(), spoiled });
            }
        }
        TransferStatus::Failed(error)
    }
}

/// How far a read's pair got.
#[derive(Clone, Copy, Default)]
struct PairProgress {
    /// Bytes arrived, in order from the pair's start.
    arrived: u64,
    /// All there, or refused: no more replies come for it.
    settled: bool,
    /// Its local range was withdrawn while it was read: what arrived was dropped.
    dropped: bool,
}

/// What settling a reply did to its transfer.
pub(crate) enum Settled {
    /// More replies are due.
    Pending,
    /// The read's bytes are all here and it has a notification: seal and send it, then call
    /// [`Shared::finish`].
    Notify(AgentName, Vec<u8>),
    /// The outcome is recorded.
    Finished,
}

/// An established side-channel peer, as the data listener checks HELLO against it.
pub(crate) struct Established {
    pub(crate) incarnation: u64,
    /// When its side channel closed, if it did.
    pub(crate) closing_since: Option<Instant>,
    /// Its data connections to us that are serving.
    pub(crate) incoming: usize,
}

/// An authenticated data connection's socket and serving thread.
pub(crate) struct Incoming {
    /// Whose session it proved: agent and incarnation.
    pub(crate) peer: (AgentName, u64),
    pub(crate) stream: Arc<TcpStream>,
    pub(crate) thread: JoinHandle<()>,
}

/// The counters behind [`DataStatus`].
#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) incoming_open: AtomicUsize,
    pub(crate) pending: [AtomicUsize; 3],
    pub(crate) outgoing_open: AtomicUsize,
    pub(crate) refused: [AtomicU64; RefusalCause::ALL.len()],
    pub(crate) frames_refused: AtomicU64,
    pub(crate) frames_forged: AtomicU64,
    pub(crate) ranges_refused: AtomicU64,
    pub(crate) events_dropped: AtomicU64,
    pub(crate) bytes_sent: AtomicU64,
    pub(crate) bytes_received: AtomicU64,
}

impl Counters {
    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }
}

/// Everything a transport shares with its threads.
pub(crate) struct Shared {
    pub(crate) side: SideChannel,
    pub(crate) registry: Registry,
    pub(crate) limits: SideLimits,
    /// Authenticated incoming data connections held at once.
    pub(crate) max_incoming: usize,
    /// Whether this transport asks peers to tag the payloads they send it.
    pub(crate) payload_tags: bool,
    stop: AtomicBool,
    pub(crate) peers: Mutex<HashMap<AgentName, Established>>,
    peers_changed: Condvar,
    /// Bumped whenever `peers` changes, for the data listener's pending connections, which
    /// wait on the listener's runtime rather than block a thread.
    peers_version: tokio::sync::watch::Sender<u64>,
    pub(crate) transfers: Mutex<HashMap<TransferId, Flight>>,
    inbox: Mutex<Inbox>,
    /// Signalled when the engine takes the inbox in: connections waiting for room go on.
    inbox_room: Condvar,
    waker: Mutex<Option<Waker>>,
    pub(crate) incoming: Mutex<HashMap<u64, Incoming>>,
    next_incoming: AtomicU64,
    pub(crate) counters: Counters,
}

impl Shared {
    pub(crate) fn new(side: SideChannel, limits: SideLimits, max_incoming: usize, payload_tags: bool) -> Self {
        Shared {
            side,
            registry: Registry::default(),
            limits,
            max_incoming,
            payload_tags,
            stop: AtomicBool::new(false),
            peers: Mutex::new(HashMap::new()),
            peers_changed: Condvar::new(),
            peers_version: tokio::sync::watch::Sender::new(0),
            transfers: Mutex::new(HashMap::new()),
            inbox: Mutex::new(Inbox::default()),
            inbox_room: Condvar::new(),
            waker: Mutex::new(None),
            incoming: Mutex::new(HashMap::new()),
            next_incoming: AtomicU64::new(0),
            counters: Counters::default(),
        }
    }

    /// Wakes every thread waiting for the established peers to change.
    pub(crate) fn peers_changed_notify(&self) {
        let _peers = lock(&self.peers);
        self.peers_changed_locked();
    }

    /// As [`Shared::peers_changed_notify`], for a caller that holds the `peers` lock.
    pub(crate) fn peers_changed_locked(&self) {
        self.peers_changed.notify_all();
        self.peers_version.send_modify(|v| *v = v.wrapping_add(1));
    }

    /// A receiver that sees every change of `peers` from now on.
    pub(crate) fn watch_peers(&self) -> tokio::sync::watch::Receiver<u64> {
        self.peers_version.subscribe()
    }

    /// Waits up to [`CLOSE_GRACE`] for `agent` at `incarnation` to be seen gone (its side
    /// channel closed, or lost), unless `closed` says the transport closed the connection
    /// first; whether it was.
    pub(crate) fn await_peer_gone(&self, agent: &AgentName, incarnation: u64, closed: &dyn Fn() -> bool) -> bool {
        let deadline = Instant::now() + CLOSE_GRACE;
        let mut peers = lock(&self.peers);
        loop {
            let gone = peers.get(agent).is_none_or(|e| e.incarnation != incarnation || e.closing_since.is_some());
            let now = Instant::now();
            // `closed` is asked under the peers lock, which a close takes to notify: no wake is missed.
            if gone || self.stopping() || closed() || now >= deadline {
                return gone;
            }
            peers = self.peers_changed.wait_timeout(peers, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    /// Whether the transport is being dropped.
    pub(crate) fn stopping(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    /// Tells every thread to stop, including any waiting for a peer to be established.
    pub(crate) fn begin_stop(&self) {
        self.stop.store(true, Ordering::Release);
        self.peers_changed_notify();
    }

    /// Wakes the engine, if it gave a waker.
    pub(crate) fn wake(&self) {
        let waker = lock(&self.waker).clone();
        if let Some(waker) = waker {
            waker.wake();
        }
    }

    pub(crate) fn set_waker(&self, waker: Waker) {
        *lock(&self.waker) = Some(waker);
    }

    /// Whether something waits for the engine: a received event, or a settled transfer.
    pub(crate) fn has_ready(&self) -> bool {
        !lock(&self.inbox).events.is_empty() || lock(&self.transfers).values().any(|f| f.outcome.is_some())
    }

    /// Queues an event from a data connection, or counts it dropped when the queue holds
    /// `max_queued_events`; wakes the engine.
    pub(crate) fn queue_event(&self, event: PeerEvent) {
        {
            let mut inbox = lock(&self.inbox);
            if inbox.events.len() >= self.limits.max_queued_events {
                Counters::add(&self.counters.events_dropped, 1);
                tracing::warn!(bound = self.limits.max_queued_events, "data-path event queue full; event dropped");
                return;
            }
            inbox.events.push_back(event);
        }
        self.wake();
    }

    /// Opens a sealed notification that a data connection authenticated as `from` carried,
    /// and queues it, or its refusal when it does not open. Past the bounds on queued
    /// notification bytes it first waits for the engine to take some in (the connection is not
    /// read meanwhile, which holds the peer back), for as long as `go_on` says; a connection
    /// that ends meanwhile leaves its notification undelivered.
    pub(crate) fn deliver(&self, from: &AgentName, sealed: &[u8], go_on: &dyn Fn() -> bool) {
        let len = sealed.len();
        let mut inbox = lock(&self.inbox);
        loop {
            let queued = inbox.bytes.get(from).copied().unwrap_or(0);
            // One notification always fits an empty queue, whatever its size.
            let peer_fits = queued == 0 || queued + len <= MAX_QUEUED_NOTIFICATION_BYTES_PER_PEER;
            let all_fit = inbox.total == 0 || inbox.total + len <= MAX_QUEUED_NOTIFICATION_BYTES;
            if peer_fits && all_fit {
                break;
            }
            if !go_on() {
                return;
            }
            inbox = self.inbox_room.wait_timeout(inbox, crate::frame::TICK).unwrap_or_else(|e| e.into_inner()).0;
        }
        let event = match self.side.open(from, sealed) {
            Ok(payload) => PeerEvent::Notification(Notification { from: from.clone(), payload }),
            Err(e) => PeerEvent::Refused { peer: Some(from.clone()), cause: e.cause(), reason: e.to_string() },
        };
        if inbox.events.len() >= self.limits.max_queued_events {
            Counters::add(&self.counters.events_dropped, 1);
            tracing::warn!(bound = self.limits.max_queued_events, "data-path event queue full; event dropped");
            return;
        }
        if matches!(event, PeerEvent::Notification(_)) {
            *inbox.bytes.entry(from.clone()).or_default() += len;
            inbox.total += len;
        }
        inbox.events.push_back(event);
        drop(inbox);
        self.wake();
    }

    /// Every event the data connections queued, oldest first; connections waiting for room go on.
    pub(crate) fn take_inbox(&self) -> VecDeque<PeerEvent> {
        let mut inbox = lock(&self.inbox);
        let events = std::mem::take(&mut inbox.events);
        inbox.bytes.clear();
        inbox.total = 0;
        drop(inbox);
        self.inbox_room.notify_all();
        events
    }

    /// Counts an incoming connection closed before it authenticated (or displaced), by cause.
    pub(crate) fn refuse_connection(&self, cause: RefusalCause, reason: &str) {
        Counters::add(&self.counters.refused[cause.index()], 1);
        tracing::debug!(cause = cause.as_str(), reason, "data connection refused");
    }

    /// Whether a data connection of `agent` at `incarnation` may go on: the transport runs,
    /// the peer is established, and its side channel did not close (or closed less than
    /// [`CLOSE_GRACE`] ago and the connection is in the middle of something).
    pub(crate) fn keep_serving(&self, agent: &AgentName, incarnation: u64, idle: bool) -> bool {
        if self.stopping() {
            return false;
        }
        match lock(&self.peers).get(agent) {
            Some(e) if e.incarnation == incarnation => {
                e.closing_since.is_none_or(|since| !idle && since.elapsed() < CLOSE_GRACE)
            }
            _ => false,
        }
    }

    /// The incoming data connections of a closing peer (that incarnation) are done.
    pub(crate) fn closing_settled(&self, agent: &AgentName, incarnation: u64) -> bool {
        lock(&self.peers).get(agent).is_none_or(|e| e.incarnation != incarnation || e.incoming == 0)
    }

    /// A peer's incoming data connection ended: its closing may now settle.
    pub(crate) fn incoming_ended(&self, agent: &AgentName, incarnation: u64) {
        if let Some(e) = lock(&self.peers).get_mut(agent).filter(|e| e.incarnation == incarnation) {
            e.incoming = e.incoming.saturating_sub(1);
        }
        self.wake();
    }

    /// The transfers' outcome, once: `Done` unless an error was recorded.
    fn settle_outcome(flight: &mut Flight) {
        if flight.outcome.is_none() {
            flight.outcome = Some(match flight.error.take() {
                Some(e) => flight.failed(e),
                None => TransferStatus::Done,
            });
        }
    }

    /// Records `status` as the outcome of `id` unless it has one, and wakes the engine.
    pub(crate) fn finish(&self, id: TransferId, status: TransferStatus) {
        if let Some(flight) = lock(&self.transfers).get_mut(&id) {
            flight.outcome.get_or_insert(status);
        }
        self.wake();
    }

    /// Records the first error of `id`; it fails once its replies are in.
    pub(crate) fn flight_error(&self, id: TransferId, error: TransportError) {
        if let Some(flight) = lock(&self.transfers).get_mut(&id) {
            flight.error.get_or_insert(error);
        }
    }

    /// Fails every unsettled transfer that connection `conn` carries, and wakes the engine.
    pub(crate) fn fail_flights(&self, conn: u64, why: &TransportError) {
        let mut failed = 0;
        for flight in lock(&self.transfers).values_mut().filter(|f| f.conn == conn && f.outcome.is_none()) {
            flight.outcome = Some(flight.failed(why.clone()));
            failed += 1;
        }
        if failed > 0 {
            tracing::debug!(conn, failed, error = %why, "transfers failed with their data connection");
            self.wake();
        }
    }

    /// Where the bytes of a DATA frame go: `Ok(Some(local address))`, `Ok(None)` to drop
    /// them (the transfer's outcome is out: the engine may have reused the memory), or `Err`
    /// when the frame does not fit the transfer it names (the peer broke the protocol).
    pub(crate) fn read_target(
        &self,
        conn: u64,
        id: TransferId,
        pair: u32,
        offset: u64,
        len: u64,
    ) -> Result<Option<Pair>, String> {
        let transfers = lock(&self.transfers);
        let flight = transfers
            .get(&id)
            .filter(|f| f.conn == conn && f.op == TransferOp::Read)
            .ok_or_else(|| format!("DATA for {id:?}, which is no read in flight on this connection"))?;
        let (p, &PairProgress { arrived: received, settled, .. }) = flight
            .pairs
            .get(pair as usize)
            .zip(flight.received.get(pair as usize))
            .ok_or_else(|| format!("DATA for pair {pair} of {id:?}, which has {}", flight.pairs.len()))?;
        let fits = offset.checked_add(len).is_some_and(|end| end <= p.len);
        if settled || offset != received || !fits {
            return Err(format!(
                "DATA {offset}+{len} for pair {pair} of {id:?} ({} bytes, {received} received{})",
                p.len,
                if settled { ", settled" } else { "" }
            ));
        }
        // Until the outcome is out, the rest of a read that failed in part still lands: the
        // engine keeps what arrived whole (`PartlyFailed`).
        Ok(flight.outcome.is_none().then_some(*p))
    }

    /// `len` bytes of a read's pair arrived (or were dropped, with `error`).
    pub(crate) fn read_progress(&self, id: TransferId, pair: u32, len: u64, error: Option<TransportError>) -> Settled {
        let mut transfers = lock(&self.transfers);
        let Some(flight) = transfers.get_mut(&id) else { return Settled::Finished };
        let p_len = flight.pairs[pair as usize].len;
        let entry = &mut flight.received[pair as usize];
        if let Some(error) = error {
            entry.dropped = true;
            flight.error.get_or_insert(error);
        }
        entry.arrived += len;
        if entry.arrived == p_len && !entry.settled {
            entry.settled = true;
            flight.unsettled -= 1;
        }
        Self::read_settled(flight)
    }

    /// The listener refused a read's pair.
    pub(crate) fn range_refused(
        &self,
        conn: u64,
        id: TransferId,
        pair: u32,
        error: TransportError,
    ) -> Result<Settled, String> {
        let mut transfers = lock(&self.transfers);
        let flight = transfers
            .get_mut(&id)
            .filter(|f| f.conn == conn && f.op == TransferOp::Read)
            .ok_or_else(|| format!("RANGE_ERROR for {id:?}, which is no read in flight on this connection"))?;
        let entry = flight
            .received
            .get_mut(pair as usize)
            .filter(|e| !e.settled)
            .ok_or_else(|| format!("RANGE_ERROR for pair {pair} of {id:?}, which is not a pair in flight"))?;
        entry.settled = true;
        flight.unsettled -= 1;
        flight.error.get_or_insert(error);
        Ok(Self::read_settled(flight))
    }

    fn read_settled(flight: &mut Flight) -> Settled {
        if flight.unsettled > 0 || flight.outcome.is_some() {
            return Settled::Pending;
        }
        match flight.notification.take() {
            Some(payload) if flight.error.is_none() => Settled::Notify(flight.peer.clone(), payload),
            _ => {
                Self::settle_outcome(flight);
                Settled::Finished
            }
        }
    }

    /// A write's acknowledgement: `error` if the listener refused it.
    pub(crate) fn write_acked(&self, conn: u64, id: TransferId, error: Option<TransportError>) -> Result<(), String> {
        {
            let mut transfers = lock(&self.transfers);
            let flight = transfers
                .get_mut(&id)
                .filter(|f| f.conn == conn && f.op == TransferOp::Write && f.unsettled == 1)
                .ok_or_else(|| format!("WRITE_ACK for {id:?}, which is no write in flight on this connection"))?;
            flight.unsettled = 0;
            if let Some(error) = error {
                flight.error.get_or_insert(error);
            }
            Self::settle_outcome(flight);
        }
        self.wake();
        Ok(())
    }

    /// The outcome of `id`, once; `None` while it is in flight.
    pub(crate) fn take_outcome(&self, id: TransferId) -> Option<TransferStatus> {
        let mut transfers = lock(&self.transfers);
        match transfers.get(&id) {
            None => Some(TransferStatus::Failed(TransportError::UnknownTransfer(id))),
            Some(f) if f.outcome.is_some() => transfers.remove(&id).and_then(|f| f.outcome),
            Some(_) => None,
        }
    }

    /// A fresh id for an authenticated incoming connection; later ones have larger ids.
    pub(crate) fn next_incoming(&self) -> u64 {
        self.next_incoming.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Joins the threads of incoming connections that ended, closing their sockets.
    pub(crate) fn reap_incoming(&self) {
        let done: Vec<Incoming> = {
            let mut incoming = lock(&self.incoming);
            let ids: Vec<u64> = incoming.iter().filter(|(_, c)| c.thread.is_finished()).map(|(&id, _)| id).collect();
            ids.into_iter().filter_map(|id| incoming.remove(&id)).collect()
        };
        for conn in done {
            let _ = conn.thread.join();
        }
    }

    /// What the data path holds and has refused.
    pub(crate) fn status(&self) -> DataStatus {
        let c = &self.counters;
        let refused_by_cause = std::array::from_fn(|i| c.refused[i].load(Ordering::Relaxed));
        DataStatus {
            incoming: c.incoming_open.load(Ordering::Relaxed),
            pending_by_stage: std::array::from_fn(|i| c.pending[i].load(Ordering::Relaxed)),
            outgoing: c.outgoing_open.load(Ordering::Relaxed),
            connections_refused: refused_by_cause.iter().sum(),
            refused_by_cause,
            frames_refused: c.frames_refused.load(Ordering::Relaxed),
            frames_forged: c.frames_forged.load(Ordering::Relaxed),
            ranges_refused: c.ranges_refused.load(Ordering::Relaxed),
            events_dropped: c.events_dropped.load(Ordering::Relaxed),
            queued_notification_bytes: lock(&self.inbox).total,
            bytes_sent: c.bytes_sent.load(Ordering::Relaxed),
            bytes_received: c.bytes_received.load(Ordering::Relaxed),
        }
    }
}
