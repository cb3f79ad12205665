//! What a [`NixlTransport`](crate::NixlTransport) has taken in and its engine has not polled
//! yet, bounded, and the peers whose notifications outrun the engine.
//!
//! NIXL keeps every notification that arrives in a list of its own until the transport fetches
//! them, and a peer decides how fast it sends. So the transport fetches often (at every poll,
//! and on a thread of its own when the engine's falls behind: [`crate::drain`]), and keeps what
//! it fetched within bounds: at most [`MAX_QUEUED_NOTIFICATION_BYTES_PER_PEER`] of one peer's
//! notifications and [`MAX_QUEUED_NOTIFICATION_BYTES`] of all peers' wait for the engine, in at
//! most [`MAX_QUEUED_EVENTS`] events. A notification beyond a bound is dropped unread (not
//! opened, so it costs no decryption), and the drops of each peer are told in one
//! [`PeerEvent::Refused`] of cause [`RefusalCause::Overloaded`] naming how many, which the
//! engine counts (`kvflow_refused_total{cause="overloaded"}`).
//!
//! A dropped notification is a message lost: a renewal or a completion P never heard, which its
//! lease covers, as it covers a D that went silent. A peer that goes on sending faster than its
//! engine takes in, until [`CUT_OFF_AFTER_DROPPED_BYTES`] of its notifications were dropped
//! since its queue was last empty, is cut off: what it has waiting is dropped, nothing more of
//! it is taken in, and the transport closes its side channel ([`Inbox::take_cut`]). That is what
//! bounds the engine's work, as the queues bound its memory: a key holder's heartbeat flood of
//! 250 distinct 240-byte request ids per notification, at about 280 MB/s, outran a P starved of
//! CPU beside busy threads; cut off, it costs P a copy inside NIXL a notification, no more. (It
//! was cut off 0.12 to 0.17 s into the flood.)
//!
//! Notifications from a NIXL agent that has no authenticated side channel (a name nobody
//! handshook under, or one cut off long ago) are never opened; each name's are told in one
//! refusal of cause [`RefusalCause::Unauthenticated`] while it waits, for at most
//! [`MAX_STRANGER_NAMES`] names (the rest are told together).

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

use kv_core::{AgentName, CutOffReason, Notification, PeerEvent, RefusalCause};

/// At most this many bytes of one peer's notifications wait for the engine (64 of the largest
/// a wire message may be): a D renews and completes in notifications of a few hundred bytes to
/// 64 KiB each, and its engine takes them in as they come.
pub const MAX_QUEUED_NOTIFICATION_BYTES_PER_PEER: usize = 4 << 20;

/// At most this many bytes of all peers' notifications wait for the engine, so that no four
/// peers together crowd out the rest.
pub const MAX_QUEUED_NOTIFICATION_BYTES: usize = 16 << 20;

/// At most this many events wait for the engine before a notification is dropped unread
/// (refusals of notifications that fail their tag count among them); a peer's arrival or loss
/// is always queued, as the side channel bounds those.
pub const MAX_QUEUED_EVENTS: usize = 4096;

/// A peer is cut off once this many bytes of its notifications were dropped unread (beyond
/// [`MAX_QUEUED_NOTIFICATION_BYTES_PER_PEER`]) since its queue was last empty: four times what
/// it may have waiting, so that a burst the engine then catches up on is only dropped in part,
/// while a flood is cut off within a fraction of a second (16 MiB is 50 ms of the heartbeat
/// flood above).
pub const CUT_OFF_AFTER_DROPPED_BYTES: usize = 4 * MAX_QUEUED_NOTIFICATION_BYTES_PER_PEER;

/// NIXL names of peers cut off whose notifications are still recognised (and dropped without
/// a word); older ones count as strangers.
const CUT_NAMES_REMEMBERED: usize = 64;

/// At most this many names of strangers wait to be told; the notifications of any further
/// name are told together, as [`FURTHER_STRANGERS`]'.
pub const MAX_STRANGER_NAMES: usize = 16;

/// The name under which strangers beyond [`MAX_STRANGER_NAMES`] are told.
const FURTHER_STRANGERS: &str = "(further names)";

/// The most bytes of a stranger's name a refusal repeats: the name is whatever the sender put
/// in its notification.
const STRANGER_NAME_BYTES: usize = 96;

/// Who sent notifications that NIXL holds under one agent name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Sender {
    /// A peer connected through the side channel.
    Peer(AgentName),
    /// A peer cut off: its notifications are dropped unread.
    CutOff,
    /// No authenticated side channel.
    Stranger,
}

/// What waits for the engine.
#[derive(Debug)]
enum Queued {
    Event(PeerEvent),
    /// The refusal of a peer's dropped notifications, however many were dropped by the time the
    /// engine takes it ([`Inbox::dropped`]).
    Dropped(AgentName),
    /// The refusal of a stranger's notifications ([`Inbox::strangers`]).
    Stranger(String),
}

/// The transport's queue of events for the engine, with the bounds on notifications.
#[derive(Debug, Default)]
pub(crate) struct Inbox {
    events: VecDeque<Queued>,
    /// Bytes of queued notifications, by peer (no entry at zero).
    bytes: BTreeMap<AgentName, usize>,
    /// Bytes of queued notifications of all peers.
    total: usize,
    /// Notifications dropped and not told yet, by peer (each has its `Queued::Dropped`).
    dropped: BTreeMap<AgentName, u64>,
    /// Bytes of each peer's notifications dropped since its queue was last empty.
    overrun: BTreeMap<AgentName, usize>,
    /// Notifications of strangers not told yet, by name (each has its `Queued::Stranger`).
    strangers: BTreeMap<String, u64>,
    /// Connected peers, by NIXL agent name.
    names: BTreeMap<String, AgentName>,
    /// The NIXL names of the peers cut off most recently, with when a fetch last found
    /// notifications of theirs.
    cut_names: VecDeque<(String, Instant)>,
    /// Peers cut off, with their NIXL names, for the transport to close.
    to_cut: Vec<(AgentName, String, CutOffReason)>,
}

impl Inbox {
    /// Queues a peer event (not a notification: see [`Inbox::admit`]).
    pub fn push(&mut self, event: PeerEvent) {
        self.events.push_back(Queued::Event(event));
    }

    /// `peer` connected as NIXL agent `nixl`: a new connection starts with nothing overrun.
    pub fn connected(&mut self, nixl: &str, peer: &AgentName) {
        self.names.insert(nixl.to_owned(), peer.clone());
        self.overrun.remove(peer);
    }

    /// NIXL agent `nixl` is no longer a connected peer.
    pub fn forget(&mut self, nixl: &str) {
        self.names.remove(nixl);
    }

    /// Who sent what NIXL holds, at `now`, under agent name `nixl`.
    pub fn sender(&mut self, nixl: &str, now: Instant) -> Sender {
        if let Some(peer) = self.names.get(nixl) {
            return Sender::Peer(peer.clone());
        }
        match self.cut_names.iter_mut().find(|(n, _)| n == nixl) {
            Some((_, seen)) => {
                *seen = now;
                Sender::CutOff
            }
            None => Sender::Stranger,
        }
    }

    /// Whether NIXL agent `nixl` was cut off (and is still remembered).
    pub fn is_cut(&self, nixl: &str) -> bool {
        self.cut_names.iter().any(|(n, _)| n == nixl)
    }

    /// How long no fetch has found notifications of NIXL agent `nixl`, cut off, as of `now`;
    /// `None` once it is no longer remembered as cut off.
    pub fn cut_quiet_for(&self, nixl: &str, now: Instant) -> Option<Duration> {
        self.cut_names.iter().find(|(n, _)| n == nixl).map(|(_, seen)| now.saturating_duration_since(*seen))
    }

    /// Counts `count` notifications from NIXL agent `nixl`, which has no authenticated side
    /// channel, to be told in one refusal.
    pub fn stranger(&mut self, nixl: &str, count: usize) {
        let mut name = nixl.to_owned();
        if name.len() > STRANGER_NAME_BYTES {
            let mut end = STRANGER_NAME_BYTES;
            while !name.is_char_boundary(end) {
                end -= 1;
            }
            name.truncate(end);
            name.push('…');
        }
        if !self.strangers.contains_key(&name) && self.strangers.len() >= MAX_STRANGER_NAMES {
            // A sender that names itself anew each time grows nothing.
            name = FURTHER_STRANGERS.to_owned();
        }
        match self.strangers.get_mut(&name) {
            Some(waiting) => *waiting += count as u64,
            None => {
                self.strangers.insert(name.clone(), count as u64);
                self.events.push_back(Queued::Stranger(name));
            }
        }
    }

    /// Whether a notification of `len` bytes from `from` may be queued. If not, it is dropped
    /// and told ([`Inbox::pop`]), and once the peer's drops since its queue was last empty reach
    /// [`CUT_OFF_AFTER_DROPPED_BYTES`] it is cut off.
    pub fn admit(&mut self, from: &AgentName, len: usize, now: Instant) -> bool {
        let queued = self.bytes.get(from).copied().unwrap_or(0);
        let fits = queued + len <= MAX_QUEUED_NOTIFICATION_BYTES_PER_PEER
            && self.total + len <= MAX_QUEUED_NOTIFICATION_BYTES
            && self.events.len() < MAX_QUEUED_EVENTS;
        if fits {
            return true;
        }
        match self.dropped.get_mut(from) {
            Some(count) => *count += 1,
            None => {
                self.dropped.insert(from.clone(), 1);
                self.events.push_back(Queued::Dropped(from.clone()));
            }
        }
        let overrun = self.overrun.entry(from.clone()).or_default();
        *overrun += len;
        if *overrun >= CUT_OFF_AFTER_DROPPED_BYTES {
            self.cut_off(from, CutOffReason::NotificationFlood, now);
        }
        false
    }

    /// Stops taking in `peer`'s notifications: drops what it has waiting (and the refusal of
    /// its drops), and hands it to the transport to close.
    fn cut_off(&mut self, peer: &AgentName, reason: CutOffReason, now: Instant) {
        let nixl: Vec<String> = self.names.iter().filter(|(_, p)| *p == peer).map(|(n, _)| n.clone()).collect();
        for name in &nixl {
            self.names.remove(name);
            if self.cut_names.len() == CUT_NAMES_REMEMBERED {
                self.cut_names.pop_front();
            }
            self.cut_names.push_back((name.clone(), now));
        }
        self.events.retain(|queued| match queued {
            Queued::Event(PeerEvent::Notification(n)) => n.from != *peer,
            Queued::Dropped(p) => p != peer,
            _ => true,
        });
        self.total -= self.bytes.remove(peer).unwrap_or(0);
        self.dropped.remove(peer);
        self.overrun.remove(peer);
        for name in nixl {
            self.to_cut.push((peer.clone(), name, reason));
        }
    }

    /// Queues an admitted notification, opened.
    pub fn push_notification(&mut self, notification: Notification) {
        let len = notification.payload.len();
        *self.bytes.entry(notification.from.clone()).or_default() += len;
        self.total += len;
        self.events.push_back(Queued::Event(PeerEvent::Notification(notification)));
    }

    /// The peers cut off since the last call, with the NIXL name each was cut off under: the
    /// transport closes each one's side channel (if that name is still the peer's).
    pub fn take_cut(&mut self) -> Vec<(AgentName, String, CutOffReason)> {
        std::mem::take(&mut self.to_cut)
    }

    /// The next event for the engine.
    pub fn pop(&mut self) -> Option<PeerEvent> {
        let event = match self.events.pop_front()? {
            Queued::Event(event) => event,
            Queued::Dropped(peer) => {
                let count = self.dropped.remove(&peer).unwrap_or(0);
                let queued = self.bytes.get(&peer).copied().unwrap_or(0);
                let reason = format!(
                    "{count} notifications from {peer} dropped unread: {queued} bytes of its notifications and {} events wait \
                     (bounds {MAX_QUEUED_NOTIFICATION_BYTES_PER_PEER} bytes a peer, {MAX_QUEUED_NOTIFICATION_BYTES} in all, \
                     {MAX_QUEUED_EVENTS} events)",
                    self.events.len()
                );
                tracing::debug!(%peer, count, "notifications dropped: the engine takes them in slower than they come");
                return Some(PeerEvent::Refused { peer: Some(peer), cause: RefusalCause::Overloaded, reason });
            }
            Queued::Stranger(name) => {
                let count = self.strangers.remove(&name).unwrap_or(0);
                let reason =
                    format!("{count} notifications from NIXL agent {name:?}, which has no authenticated side channel");
                return Some(PeerEvent::Refused { peer: None, cause: RefusalCause::Unauthenticated, reason });
            }
        };
        if let PeerEvent::Notification(notification) = &event {
            let len = notification.payload.len();
            self.total -= len;
            if let Some(queued) = self.bytes.get_mut(&notification.from) {
                *queued -= len;
                if *queued == 0 {
                    // Caught up with this peer: what it overran before is forgiven.
                    self.bytes.remove(&notification.from);
                    self.overrun.remove(&notification.from);
                }
            }
        }
        Some(event)
    }

    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use kv_core::EngineId;

    use super::*;

    fn agent(name: &str) -> AgentName {
        AgentName::new(EngineId::new(name), 0)
    }

    /// An inbox in which each of `peers` is connected under its own NIXL name.
    fn inbox_of(peers: &[&AgentName]) -> Inbox {
        let mut inbox = Inbox::default();
        for peer in peers {
            inbox.connected(&format!("{peer}#1"), peer);
        }
        inbox
    }

    /// Offers `count` notifications of `len` bytes from `from`; how many were queued.
    fn offer(inbox: &mut Inbox, from: &AgentName, count: usize, len: usize) -> usize {
        let mut queued = 0;
        for _ in 0..count {
            if inbox.admit(from, len, Instant::now()) {
                inbox.push_notification(Notification { from: from.clone(), payload: vec![0; len] });
                queued += 1;
            }
        }
        queued
    }

    #[test]
    fn a_flooding_peer_gets_its_share_and_is_told_how_many_were_dropped() {
        let (flood, d) = (agent("intruder"), agent("decode0"));
        let mut inbox = inbox_of(&[&flood, &d]);
        let per_peer = MAX_QUEUED_NOTIFICATION_BYTES_PER_PEER / (60 << 10);
        // Two fetches' worth, short of the cut-off: one refusal tells every drop.
        assert_eq!(offer(&mut inbox, &flood, 100, 60 << 10), per_peer);
        assert_eq!(offer(&mut inbox, &flood, 100, 60 << 10), 0);
        // The others still get through.
        assert_eq!(offer(&mut inbox, &d, 10, 300), 10);
        let events: Vec<PeerEvent> = std::iter::from_fn(|| inbox.pop()).collect();
        assert_eq!(events.len(), per_peer + 1 + 10);
        let refusal = &events[per_peer];
        assert!(
            matches!(refusal, PeerEvent::Refused { peer: Some(p), cause: RefusalCause::Overloaded, reason }
                if *p == flood && reason.starts_with(&format!("{} notifications from intruder/tp0 dropped", 200 - per_peer))),
            "{refusal:?}"
        );
        // Taken in, they make room again, and the overrun is forgiven.
        assert!(inbox.bytes.is_empty() && inbox.total == 0 && inbox.overrun.is_empty());
        assert_eq!(offer(&mut inbox, &flood, 1, 60 << 10), 1);
        assert!(inbox.take_cut().is_empty());
    }

    #[test]
    fn a_peer_that_keeps_outrunning_the_engine_is_cut_off_and_its_backlog_dropped() {
        let (flood, d) = (agent("intruder"), agent("decode0"));
        let mut inbox = inbox_of(&[&flood, &d]);
        let len = 60 << 10;
        let per_peer = MAX_QUEUED_NOTIFICATION_BYTES_PER_PEER / len;
        assert_eq!(offer(&mut inbox, &d, 3, 300), 3);
        // Its share, then drops up to the cut-off (the last drop cuts it off).
        let to_cut = CUT_OFF_AFTER_DROPPED_BYTES.div_ceil(len);
        assert_eq!(offer(&mut inbox, &flood, per_peer + to_cut - 1, len), per_peer);
        assert!(inbox.take_cut().is_empty(), "one drop short of the cut-off");
        assert_eq!(offer(&mut inbox, &flood, 1, len), 0);
        assert_eq!(
            inbox.take_cut(),
            vec![(flood.clone(), "intruder/tp0#1".to_owned(), CutOffReason::NotificationFlood)]
        );
        assert!(inbox.take_cut().is_empty(), "handed over once");
        // Nothing of it waits, and nothing more of it is taken in: its NIXL name is known cut.
        let now = Instant::now();
        assert_eq!(inbox.sender("intruder/tp0#1", now), Sender::CutOff);
        assert_eq!(inbox.sender("decode0/tp0#1", now), Sender::Peer(d.clone()));
        assert_eq!(inbox.cut_quiet_for("intruder/tp0#1", now + Duration::from_secs(1)), Some(Duration::from_secs(1)));
        assert_eq!(inbox.cut_quiet_for("decode0/tp0#1", now), None);
        assert_eq!(inbox.total, 900);
        let events: Vec<PeerEvent> = std::iter::from_fn(|| inbox.pop()).collect();
        assert_eq!(events.len(), 3, "{events:?}");
        assert!(events.iter().all(|e| matches!(e, PeerEvent::Notification(n) if n.from == d)));
    }

    #[test]
    fn strangers_are_told_in_one_refusal_a_name_and_their_names_are_bounded() {
        let mut inbox = Inbox::default();
        assert_eq!(inbox.sender("forger#1", Instant::now()), Sender::Stranger);
        inbox.stranger("forger#1", 3);
        inbox.stranger("forger#1", 4);
        // A sender that names itself anew every time.
        for i in 0..1000 {
            inbox.stranger(&format!("{i}{}", "x".repeat(200)), 1);
        }
        assert_eq!(inbox.strangers.len(), MAX_STRANGER_NAMES + 1);
        let events: Vec<PeerEvent> = std::iter::from_fn(|| inbox.pop()).collect();
        assert_eq!(events.len(), MAX_STRANGER_NAMES + 1);
        let PeerEvent::Refused { peer: None, cause: RefusalCause::Unauthenticated, reason } = &events[0] else {
            panic!("{:?}", events[0])
        };
        assert!(reason.starts_with("7 notifications from NIXL agent \"forger#1\""), "{reason}");
        let told: u64 = events
            .iter()
            .map(|e| match e {
                PeerEvent::Refused { reason, .. } => reason.split(' ').next().unwrap().parse::<u64>().unwrap(),
                other => panic!("{other:?}"),
            })
            .sum();
        assert_eq!(told, 1007, "every notification told");
        assert!(events.iter().all(|e| matches!(e, PeerEvent::Refused { reason, .. } if reason.len() < 200)));
    }

    #[test]
    fn peers_together_are_bounded_and_so_are_events() {
        let peers: Vec<AgentName> = (0..8).map(|i| agent(&format!("d{i}"))).collect();
        let mut inbox = inbox_of(&peers.iter().collect::<Vec<_>>());
        for peer in &peers {
            offer(&mut inbox, peer, 100, 64 << 10);
        }
        assert!(inbox.total <= MAX_QUEUED_NOTIFICATION_BYTES, "{}", inbox.total);
        assert_eq!(inbox.total, MAX_QUEUED_NOTIFICATION_BYTES, "the first four filled it");
        let mut inbox = inbox_of(&[&peers[0]]);
        assert_eq!(offer(&mut inbox, &peers[0], 2 * MAX_QUEUED_EVENTS, 1), MAX_QUEUED_EVENTS);
        // A peer event is never dropped.
        inbox.push(PeerEvent::Lost(peers[0].clone()));
        assert_eq!(std::iter::from_fn(|| inbox.pop()).count(), MAX_QUEUED_EVENTS + 2);
    }
}
