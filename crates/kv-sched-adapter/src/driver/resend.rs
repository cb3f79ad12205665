//! Notifications the transport failed to send, which the driver sends again within bounds.
//!
//! A notification that never leaves can strand P's blocks: a lost completion, rejection or
//! abort leaves P holding an export until its lease runs out, and a lost "no write will come"
//! keeps D's push blocks in quarantine. So the driver counts every send the transport refuses
//! and tries the notification again, a little later each time.
//!
//! This lives in the driver, not in the machines, because a refused send is the transport's
//! failure, not a step of a request's life: the machine asked for the notification and has
//! moved on, as it would had the notification been lost on the wire, which it must survive
//! anyway (the lease covers it). Resending the same bytes needs nothing the machine knows, and
//! the machine is not told: its only recourse would be what the lease already does, and a
//! refused send is no evidence that the peer is gone (DESIGN.md: a peer is lost only when its
//! side channel closes, a newer incarnation handshakes or discovery says so, never by silence
//! or a transport error alone).
//!
//! The rules, each for a reason:
//!
//! - Order: a peer takes one peer's notifications in the order they were sent (a push
//!   registration before its cancel, a claim before its completion, a renewal before the
//!   abort that ends the request), so while a notification to a peer waits to be sent again,
//!   every later notification to that peer waits behind it, untried; none overtakes another.
//! - Bounded in attempts and in time: at most [`MAX_SEND_ATTEMPTS`] tries, [`FIRST_RESEND_DELAY`]
//!   apart and doubling, and never once the machine's heartbeat interval has passed since it
//!   asked (`WorkerMachine::heartbeat_interval`). By then D's renewals have been sent again
//!   anyway, and a one-shot message arrives at most that interval late (a sixth of a lease by
//!   default), well inside what the lease (and push's quarantine, two leases) already allows for.
//! - Never to a peer that is gone: a peer the transport reports lost, one that a newer
//!   incarnation replaced (a new handshake under its name), one the machine disconnects,
//!   or one the transport no longer knows (`UnknownPeer`, `PeerLost`) gets nothing more; what
//!   waited for it is given up. A peer gone also takes with it every export bound to it (its
//!   loss releases them), so nothing about them is worth sending.
//! - Bounded in memory: at most [`MAX_PENDING_RESENDS`] notifications wait, of all peers; past
//!   that, a peer's oldest waiting notification gives way to its newest (a peer whose sends keep
//!   failing while it floods the rank with heartbeats evicts only its own acknowledgements).
//! - Time comes in: resends are due at a [`Time`], which the driver's `poll_timeout` and
//!   `wait_time` include; nothing here sleeps or reads a clock.

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use kv_core::{AgentName, Time, Transport, TransportError};

/// At most this many tries at one notification: its first send and eight resends, 10 ms,
/// 20 ms, 40 ms, ... apart, the last 2.55 s after the first, unless the heartbeat interval
/// (5 s by default) ends them sooner.
pub const MAX_SEND_ATTEMPTS: u32 = 9;

/// The wait before the first resend; each later one waits twice as long as the one before.
pub const FIRST_RESEND_DELAY: Duration = Duration::from_millis(10);

/// At most this many notifications wait to be sent again, of all peers together: each is at
/// most 64 KiB, so 16 MiB at worst.
pub const MAX_PENDING_RESENDS: usize = 256;

/// What became of the notifications a rank's machine asked its driver to send, beyond those
/// sent at the first try.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct NotificationStats {
    /// Sends the transport refused, each try counted (`kvflow_num_failed_notifications_total`).
    pub failed: u64,
    /// Notifications sent on a later try, after the transport had refused them.
    pub resent: u64,
    /// Notifications given up unsent (`kvflow_notifications_given_up_total`): out of tries or
    /// time, to a peer gone, refused for good (too large), or evicted past the bound.
    pub given_up: u64,
}

/// What a refused send says about trying again.
enum Refusal {
    /// The peer is gone, or never was: nothing more goes to it.
    PeerGone,
    /// These bytes can never be sent (too large, say): the notification is given up.
    Message,
    /// Anything else may pass on a later try (a backend error, a data connection closing).
    Transient,
}

impl Refusal {
    fn of(err: &TransportError) -> Self {
        match err {
            TransportError::UnknownPeer(_) | TransportError::PeerLost(_) => Refusal::PeerGone,
            TransportError::NotificationTooLarge { .. } | TransportError::InvalidTransfer(_) => Refusal::Message,
            _ => Refusal::Transient,
        }
    }
}

/// A notification waiting to be sent again.
#[derive(Debug)]
struct Pending {
    /// When the machine asked for it: its time bound runs from here.
    asked: Time,
    payload: Vec<u8>,
}

/// One peer's notifications waiting, in the order the machine asked for them.
#[derive(Debug)]
struct Queue {
    /// When the first may be tried again.
    due: Time,
    /// Tries at the first so far (0 for one that waited behind another and was never tried).
    attempts: u32,
    waiting: VecDeque<Pending>,
}

/// The driver's notifications waiting to be sent again, per peer.
#[derive(Debug)]
pub(crate) struct Resends {
    /// How long after the machine asked a notification may still be sent.
    window: Duration,
    peers: BTreeMap<AgentName, Queue>,
    /// Notifications waiting, of all peers.
    len: usize,
    stats: NotificationStats,
}

impl Resends {
    /// Resends of notifications for at most `window` after the machine asked for them.
    pub fn new(window: Duration) -> Self {
        Resends { window, peers: BTreeMap::new(), len: 0, stats: NotificationStats::default() }
    }

    /// Sends `payload` to `to` now, unless notifications to `to` wait to be sent again: then it
    /// waits behind them.
    pub fn send(&mut self, now: Time, to: &AgentName, payload: Vec<u8>, transport: &mut dyn Transport) {
        let pending = Pending { asked: now, payload };
        if self.peers.contains_key(to) {
            self.make_room(to);
            self.peers.get_mut(to).expect("waiting").waiting.push_back(pending);
            self.len += 1;
            return;
        }
        let Err(err) = transport.send_notification(to, &pending.payload) else { return };
        self.stats.failed += 1;
        match Refusal::of(&err) {
            Refusal::Transient if self.len < MAX_PENDING_RESENDS => {
                tracing::debug!(peer = %to, %err, "notification not sent; it is sent again later");
                let due = now + delay(1);
                self.peers.insert(to.clone(), Queue { due, attempts: 1, waiting: VecDeque::from([pending]) });
                self.len += 1;
            }
            _ => {
                tracing::debug!(peer = %to, %err, "notification not sent, and given up");
                self.stats.given_up += 1;
            }
        }
    }

    /// Sends again, in order, the notifications due at `now`: each peer's until one is refused.
    pub fn resend_due(&mut self, now: Time, transport: &mut dyn Transport) {
        let due: Vec<AgentName> = self.peers.iter().filter(|(_, q)| q.due <= now).map(|(p, _)| p.clone()).collect();
        for peer in due {
            let mut queue = self.peers.remove(&peer).expect("due");
            self.len -= queue.waiting.len();
            self.resend(now, &peer, &mut queue, transport);
            if !queue.waiting.is_empty() {
                self.len += queue.waiting.len();
                self.peers.insert(peer, queue);
            }
        }
    }

    fn resend(&mut self, now: Time, peer: &AgentName, queue: &mut Queue, transport: &mut dyn Transport) {
        while let Some(first) = queue.waiting.front() {
            if now.saturating_since(first.asked) >= self.window {
                tracing::debug!(%peer, "notification given up: not sent within the heartbeat interval");
                self.give_up_first(queue);
                continue;
            }
            let Err(err) = transport.send_notification(peer, &first.payload) else {
                if queue.attempts > 0 {
                    self.stats.resent += 1;
                }
                queue.waiting.pop_front();
                queue.attempts = 0;
                continue;
            };
            self.stats.failed += 1;
            queue.attempts += 1;
            match Refusal::of(&err) {
                Refusal::PeerGone => {
                    tracing::debug!(%peer, %err, "notifications given up: the peer is gone");
                    self.stats.given_up += queue.waiting.len() as u64;
                    queue.waiting.clear();
                }
                Refusal::Transient if queue.attempts < MAX_SEND_ATTEMPTS => {
                    tracing::debug!(%peer, %err, attempts = queue.attempts, "notification not sent again");
                    queue.due = now + delay(queue.attempts);
                    return;
                }
                _ => {
                    tracing::debug!(%peer, %err, attempts = queue.attempts, "notification given up");
                    self.give_up_first(queue);
                }
            }
        }
    }

    fn give_up_first(&mut self, queue: &mut Queue) {
        queue.waiting.pop_front();
        queue.attempts = 0;
        self.stats.given_up += 1;
    }

    /// Makes room for one more notification to `to`, which has some waiting: at the bound, its
    /// oldest gives way.
    fn make_room(&mut self, to: &AgentName) {
        if self.len < MAX_PENDING_RESENDS {
            return;
        }
        let queue = self.peers.get_mut(to).expect("waiting");
        tracing::debug!(peer = %to, "notification given up: too many wait to be sent again");
        queue.waiting.pop_front();
        queue.attempts = 0;
        self.len -= 1;
        self.stats.given_up += 1;
    }

    /// `peer` is gone (lost, replaced by a newer incarnation, or disconnected): what waited for
    /// it is given up.
    pub fn forget(&mut self, peer: &AgentName) {
        if let Some(queue) = self.peers.remove(peer) {
            tracing::debug!(%peer, waiting = queue.waiting.len(), "notifications given up: the peer is gone");
            self.len -= queue.waiting.len();
            self.stats.given_up += queue.waiting.len() as u64;
        }
    }

    /// When the next resend is due.
    pub fn next_due(&self) -> Option<Time> {
        self.peers.values().map(|q| q.due).min()
    }

    /// Notifications waiting to be sent again.
    pub fn waiting(&self) -> usize {
        self.len
    }

    /// What became of the notifications so far.
    pub fn stats(&self) -> NotificationStats {
        self.stats
    }
}

/// The wait after the `attempts`-th refused try: 10 ms, then twice as long each time.
fn delay(attempts: u32) -> Duration {
    FIRST_RESEND_DELAY * 2u32.saturating_pow(attempts.saturating_sub(1).min(16))
}
