//! D's heartbeat planning: which request ids to renew with which P rank, and when.
//!
//! D tracks a request from the moment it enters the waiting queue until its load ends. D claims
//! each new request with a renewal of its own at once, so that P learns which D engine an
//! export is bound to without waiting for a beat; the planner then renews it with the peer's
//! beats. Each peer (a P rank) gets at most one heartbeat per interval, naming every tracked
//! request of that peer; a peer with nothing tracked has no beat due, and its next tracked
//! request (claimed at once by the caller) makes one due an interval later. Iteration is in key
//! order, so a seeded simulation replays exactly.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use kv_core::{RequestId, Time};

#[derive(Clone, Debug)]
struct PeerBeat {
    requests: BTreeSet<RequestId>,
    next_due: Time,
}

/// What a renewed lease has left, at the least, when D learns of the next renewal, but for the
/// heartbeat's round trip: `extension - interval` (zero when beats come no faster than the
/// extension they grant, and leases lapse between them).
///
/// A beat D sends at `t` renews to at least `t + extension` on P (P renews when the beat
/// arrives, after `t`), and D learns that deadline a round trip later. Until the next beat's
/// acknowledgement lands, at `t + interval` plus a round trip, that deadline is the newest D
/// knows, so `extension - interval` less the round trip is the least D has in hand at any
/// point of the cycle: a read margin must be shorter, or a healthy load scheduled late in a
/// cycle is fenced.
///
/// ```
/// use std::time::Duration;
/// // vLLM's defaults for a 30 s lease: beats every 5 s, each extending the lease to 20 s ahead.
/// assert_eq!(kv_lease::renewal_slack(Duration::from_secs(5), Duration::from_secs(20)), Duration::from_secs(15));
/// ```
pub fn renewal_slack(interval: Duration, extension: Duration) -> Duration {
    extension.saturating_sub(interval)
}

/// Heartbeats due, per peer, at a fixed interval.
#[derive(Clone, Debug)]
pub struct HeartbeatPlanner<P> {
    interval: Duration,
    peers: BTreeMap<P, PeerBeat>,
}

impl<P: Ord + Clone> HeartbeatPlanner<P> {
    /// A planner that beats every `interval`.
    pub fn new(interval: Duration) -> Self {
        HeartbeatPlanner { interval, peers: BTreeMap::new() }
    }

    /// Starts renewing `request` with `peer`; the caller has just claimed it with a renewal of
    /// its own, so the peer's next beat is due no sooner than an interval from now.
    pub fn track(&mut self, peer: P, request: RequestId, now: Time) {
        let interval = self.interval;
        let beat =
            self.peers.entry(peer).or_insert_with(|| PeerBeat { requests: BTreeSet::new(), next_due: now + interval });
        if beat.requests.is_empty() {
            beat.next_due = now + interval;
        }
        beat.requests.insert(request);
    }

    /// Stops renewing `request` with `peer`.
    pub fn untrack(&mut self, peer: &P, request: &RequestId) {
        if let Some(beat) = self.peers.get_mut(peer) {
            beat.requests.remove(request);
        }
    }

    /// Forgets `peer` (it was lost).
    pub fn forget(&mut self, peer: &P) {
        self.peers.remove(peer);
    }

    /// Whether `request` is tracked with `peer`.
    pub fn is_tracked(&self, peer: &P, request: &RequestId) -> bool {
        self.peers.get(peer).is_some_and(|b| b.requests.contains(request))
    }

    /// The next heartbeat due at `now`: the peer and the ids to renew.
    pub fn poll(&mut self, now: Time) -> Option<(P, Vec<RequestId>)> {
        let (peer, beat) = self.peers.iter_mut().find(|(_, b)| !b.requests.is_empty() && b.next_due <= now)?;
        beat.next_due = now + self.interval;
        Some((peer.clone(), beat.requests.iter().cloned().collect()))
    }

    /// When the next heartbeat is due, if any request is tracked.
    pub fn next_due(&self) -> Option<Time> {
        self.peers.values().filter(|b| !b.requests.is_empty()).map(|b| b.next_due).min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(ms: u64) -> Time {
        Time::from_millis(ms)
    }

    #[test]
    fn beats_an_interval_after_the_claim_then_at_the_interval() {
        let mut hb = HeartbeatPlanner::new(Duration::from_secs(5));
        assert_eq!(hb.poll(t(0)), None);
        hb.track("p0", "r1".into(), t(1000));
        assert_eq!(hb.next_due(), Some(t(6000)), "the caller claimed r1 itself at 1 s");
        assert_eq!(hb.poll(t(5999)), None);
        assert_eq!(hb.poll(t(6000)), Some(("p0", vec!["r1".into()])));
        assert_eq!(hb.poll(t(6000)), None);
        hb.track("p0", "r2".into(), t(7000));
        assert_eq!(hb.poll(t(10_999)), None, "a new request joins the next beat");
        assert_eq!(hb.poll(t(11_000)), Some(("p0", vec!["r1".into(), "r2".into()])));
        hb.untrack(&"p0", &"r1".into());
        hb.untrack(&"p0", &"r2".into());
        assert_eq!(hb.next_due(), None);
        assert_eq!(hb.poll(t(20_000)), None);
        // After an idle spell, the next request's claim starts a new schedule.
        hb.track("p0", "r3".into(), t(30_000));
        assert_eq!(hb.poll(t(34_999)), None);
        assert_eq!(hb.poll(t(35_000)), Some(("p0", vec!["r3".into()])));
    }

    #[test]
    fn the_slack_is_what_the_newest_acknowledged_deadline_leaves_before_the_next_beat_lands() {
        let (interval, extension) = (Duration::from_millis(1500), Duration::from_secs(6));
        assert_eq!(renewal_slack(interval, extension), Duration::from_millis(4500));
        assert_eq!(renewal_slack(extension, interval), Duration::ZERO);
        // D beats at 0.1 s and 1.6 s; P renews each on arrival, 1 ms later, and acknowledges.
        let mut hb = HeartbeatPlanner::new(interval);
        hb.track("p0", "r1".into(), t(100));
        let first_ack_deadline = t(101) + extension;
        assert_eq!(hb.next_due(), Some(t(1600)));
        // The next acknowledgement lands at 1.602 s: until then D has the first deadline in hand.
        let left = first_ack_deadline.saturating_since(t(1602));
        assert_eq!(left, renewal_slack(interval, extension) - Duration::from_millis(1));
    }

    #[test]
    fn each_peer_has_its_own_schedule() {
        let mut hb = HeartbeatPlanner::new(Duration::from_secs(5));
        hb.track("p0", "a".into(), t(0));
        hb.track("p1", "b".into(), t(1000));
        assert_eq!(hb.next_due(), Some(t(5000)));
        assert_eq!(hb.poll(t(5000)), Some(("p0", vec!["a".into()])));
        assert_eq!(hb.next_due(), Some(t(6000)));
        hb.forget(&"p1");
        assert_eq!(hb.next_due(), Some(t(10_000)));
        assert!(hb.is_tracked(&"p0", &"a".into()));
        assert!(!hb.is_tracked(&"p1", &"b".into()));
    }
}
