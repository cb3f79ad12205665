//! D's heartbeat planning: which request ids to renew with which P rank, and when.
//!
//! D tracks a request from the moment it enters the waiting queue until its load ends. Each
//! peer (a P rank) gets at most one heartbeat per interval, naming every tracked request of
//! that peer; a peer's first tracked request makes its first heartbeat due at once, so that P
//! learns early which D engine an export is bound to. Iteration is in key order, so a seeded
//! simulation replays exactly.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use kv_core::{RequestId, Time};

#[derive(Clone, Debug)]
struct PeerBeat {
    requests: BTreeSet<RequestId>,
    next_due: Time,
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

    /// Starts renewing `request` with `peer`.
    pub fn track(&mut self, peer: P, request: RequestId, now: Time) {
        let beat = self.peers.entry(peer).or_insert_with(|| PeerBeat { requests: BTreeSet::new(), next_due: now });
        if beat.requests.is_empty() {
            beat.next_due = beat.next_due.min(now);
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
    fn beats_at_once_then_at_the_interval() {
        let mut hb = HeartbeatPlanner::new(Duration::from_secs(5));
        assert_eq!(hb.poll(t(0)), None);
        hb.track("p0", "r1".into(), t(1000));
        assert_eq!(hb.next_due(), Some(t(1000)));
        assert_eq!(hb.poll(t(1000)), Some(("p0", vec!["r1".into()])));
        assert_eq!(hb.poll(t(1000)), None);
        hb.track("p0", "r2".into(), t(2000));
        assert_eq!(hb.poll(t(5999)), None, "a new request joins the next beat");
        assert_eq!(hb.poll(t(6000)), Some(("p0", vec!["r1".into(), "r2".into()])));
        hb.untrack(&"p0", &"r1".into());
        hb.untrack(&"p0", &"r2".into());
        assert_eq!(hb.next_due(), None);
        assert_eq!(hb.poll(t(20_000)), None);
        // After an idle spell, a new request beats at once again.
        hb.track("p0", "r3".into(), t(30_000));
        assert_eq!(hb.poll(t(30_000)), Some(("p0", vec!["r3".into()])));
    }

    #[test]
    fn each_peer_has_its_own_schedule() {
        let mut hb = HeartbeatPlanner::new(Duration::from_secs(5));
        hb.track("p0", "a".into(), t(0));
        assert_eq!(hb.poll(t(0)), Some(("p0", vec!["a".into()])));
        hb.track("p1", "b".into(), t(1000));
        assert_eq!(hb.poll(t(1000)), Some(("p1", vec!["b".into()])));
        assert_eq!(hb.next_due(), Some(t(5000)));
        hb.forget(&"p0");
        assert_eq!(hb.next_due(), Some(t(6000)));
        assert!(hb.is_tracked(&"p1", &"b".into()));
    }
}
