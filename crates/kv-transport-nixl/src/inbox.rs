//! What a [`NixlTransport`](crate::NixlTransport) has taken in and its engine has not polled
//! yet, bounded.
//!
//! NIXL keeps every notification that arrives in a list of its own until the transport fetches
//! them, and a peer decides how fast it sends. So the transport fetches at every poll, and keeps
//! what it fetched within bounds: at most [`MAX_QUEUED_NOTIFICATION_BYTES_PER_PEER`] of one
//! peer's notifications and [`MAX_QUEUED_NOTIFICATION_BYTES`] of all peers' wait for the
//! engine, in at most [`MAX_QUEUED_EVENTS`] events. A notification beyond a bound is dropped
//! unread (not opened, so it costs no decryption), and each fetch that dropped some of a peer's
//! says so in one [`PeerEvent::Refused`] of cause [`RefusalCause::Overloaded`] naming how many,
//! which the engine counts (`kvflow_refused_total{cause="overloaded"}`).
//!
//! A dropped notification is a message lost: a renewal or a completion P never heard, which its
//! lease covers, as it covers a D that went silent. Only a peer that sends faster than its engine
//! takes its messages in meets the bound: a key holder's heartbeat flood of 250 distinct 240-byte
//! request ids per notification, at about 16 MB/s, outran a P rank built without optimisation by
//! half, and its backlog (in NIXL's list, then in this queue) grew P by 392 MiB in 30 s.

use std::collections::{BTreeMap, VecDeque};

use kv_core::{AgentName, Notification, PeerEvent, RefusalCause};

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

/// The transport's queue of events for the engine, with the bounds on notifications.
#[derive(Debug, Default)]
pub(crate) struct Inbox {
    events: VecDeque<PeerEvent>,
    /// Bytes of queued notifications, by peer (no entry at zero).
    bytes: BTreeMap<AgentName, usize>,
    /// Bytes of queued notifications of all peers.
    total: usize,
    /// Notifications dropped in the fetch under way, by peer.
    dropped: BTreeMap<AgentName, u64>,
}

impl Inbox {
    /// Queues a peer event (not a notification: see [`Inbox::admit`]).
    pub fn push(&mut self, event: PeerEvent) {
        self.events.push_back(event);
    }

    /// Whether a notification of `len` bytes from `from` may be queued; if not, it is counted
    /// as dropped, and [`Inbox::end_fetch`] reports it.
    pub fn admit(&mut self, from: &AgentName, len: usize) -> bool {
        let queued = self.bytes.get(from).copied().unwrap_or(0);
        let fits = queued + len <= MAX_QUEUED_NOTIFICATION_BYTES_PER_PEER
            && self.total + len <= MAX_QUEUED_NOTIFICATION_BYTES
            && self.events.len() < MAX_QUEUED_EVENTS;
        if !fits {
            *self.dropped.entry(from.clone()).or_default() += 1;
        }
        fits
    }

    /// Queues an admitted notification, opened.
    pub fn push_notification(&mut self, notification: Notification) {
        let len = notification.payload.len();
        *self.bytes.entry(notification.from.clone()).or_default() += len;
        self.total += len;
        self.events.push_back(PeerEvent::Notification(notification));
    }

    /// Ends a fetch: one refusal for each peer whose notifications were dropped, saying how many.
    pub fn end_fetch(&mut self) {
        for (peer, count) in std::mem::take(&mut self.dropped) {
            let queued = self.bytes.get(&peer).copied().unwrap_or(0);
            let reason = format!(
                "{count} notifications from {peer} dropped unread: {queued} bytes of its notifications and {} events wait \
                 (bounds {MAX_QUEUED_NOTIFICATION_BYTES_PER_PEER} bytes a peer, {MAX_QUEUED_NOTIFICATION_BYTES} in all, \
                 {MAX_QUEUED_EVENTS} events)",
                self.events.len()
            );
            tracing::debug!(%peer, count, "notifications dropped: the engine takes them in slower than they come");
            self.events.push_back(PeerEvent::Refused { peer: Some(peer), cause: RefusalCause::Overloaded, reason });
        }
    }

    /// The next event for the engine.
    pub fn pop(&mut self) -> Option<PeerEvent> {
        let event = self.events.pop_front()?;
        if let PeerEvent::Notification(notification) = &event {
            let len = notification.payload.len();
            self.total -= len;
            if let Some(queued) = self.bytes.get_mut(&notification.from) {
                *queued -= len;
                if *queued == 0 {
                    self.bytes.remove(&notification.from);
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

    /// Offers `count` notifications of `len` bytes from `from`; how many were queued.
    fn offer(inbox: &mut Inbox, from: &AgentName, count: usize, len: usize) -> usize {
        let mut queued = 0;
        for _ in 0..count {
            if inbox.admit(from, len) {
                inbox.push_notification(Notification { from: from.clone(), payload: vec![0; len] });
                queued += 1;
            }
        }
        inbox.end_fetch();
        queued
    }

    #[test]
    fn a_flooding_peer_gets_its_share_and_is_told_how_many_were_dropped() {
        let mut inbox = Inbox::default();
        let (flood, d) = (agent("intruder"), agent("decode0"));
        let per_peer = MAX_QUEUED_NOTIFICATION_BYTES_PER_PEER / (60 << 10);
        assert_eq!(offer(&mut inbox, &flood, 1000, 60 << 10), per_peer);
        // The others still get through.
        assert_eq!(offer(&mut inbox, &d, 10, 300), 10);
        let events: Vec<PeerEvent> = std::iter::from_fn(|| inbox.pop()).collect();
        assert_eq!(events.len(), per_peer + 1 + 10);
        let refusal = &events[per_peer];
        assert!(
            matches!(refusal, PeerEvent::Refused { peer: Some(p), cause: RefusalCause::Overloaded, reason }
                if *p == flood && reason.starts_with(&format!("{} notifications from intruder/tp0 dropped", 1000 - per_peer))),
            "{refusal:?}"
        );
        // Taken in, they make room again.
        assert!(inbox.bytes.is_empty() && inbox.total == 0);
        assert_eq!(offer(&mut inbox, &flood, 1, 60 << 10), 1);
    }

    #[test]
    fn peers_together_are_bounded_and_so_are_events() {
        let mut inbox = Inbox::default();
        for i in 0..8 {
            offer(&mut inbox, &agent(&format!("d{i}")), 100, 64 << 10);
        }
        assert!(inbox.total <= MAX_QUEUED_NOTIFICATION_BYTES, "{}", inbox.total);
        assert_eq!(inbox.total, MAX_QUEUED_NOTIFICATION_BYTES, "the first four filled it");
        let mut inbox = Inbox::default();
        assert_eq!(offer(&mut inbox, &agent("d0"), 2 * MAX_QUEUED_EVENTS, 1), MAX_QUEUED_EVENTS);
        // A peer event is never dropped.
        inbox.push(PeerEvent::Lost(agent("d0")));
        assert_eq!(std::iter::from_fn(|| inbox.pop()).count(), MAX_QUEUED_EVENTS + 2);
    }
}
