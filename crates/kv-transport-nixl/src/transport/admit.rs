//! Which authenticated peers get their NIXL metadata loaded, and when.
//!
//! An engine cut off ([`super::cut`]) waits out a penalty before a new connection of its loads
//! anything: [`PENALTY_FIRST`], doubled at each cut-off up to [`PENALTY_MAX`]; its connections
//! meanwhile are closed as soon as they authenticate. And while a peer cut off still floods
//! in (what it queued in its own UCX flows until it is quiet), a newcomer's load waits, up to
//! [`MAX_DEFERRAL`]: loading takes nixl-sys's agent lock and waits for UCX's worker lock, which
//! NIXL's progress thread holds nearly throughout a flood (a load took up to 356 ms so), and no
//! fetch runs meanwhile. A flooder that came back as a new incarnation after each cut-off grew
//! P by 268 and 328 MiB that way (`cargo xtask attack --only contended --flood-returns`).

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

use kv_core::side::ConnId;
use kv_core::{EngineId, PeerEvent, PeerInfo, RefusalCause, TransportError};

use super::NixlTransport;

/// How long an engine's connections are refused after its first cut-off.
pub const PENALTY_FIRST: Duration = Duration::from_secs(1);

/// The longest penalty: an engine cut off again and again waits this long each time.
pub const PENALTY_MAX: Duration = Duration::from_secs(60);

/// An engine not cut off for this long after its penalty ended starts again from
/// [`PENALTY_FIRST`].
const FORGIVEN_AFTER: Duration = Duration::from_secs(600);

/// Engines whose penalties are remembered; past that, the one whose penalty ended first is
/// forgotten (a flooder that names itself anew each time is met by the deferral instead).
const PENALISED_ENGINES: usize = 256;

/// The longest a newcomer's metadata waits for a peer cut off to go quiet.
pub const MAX_DEFERRAL: Duration = Duration::from_secs(1);

/// Newcomers that may wait at once; past that, one is loaded at once.
const MAX_DEFERRED: usize = 64;

/// Engines cut off, with how often and until when their connections are refused.
#[derive(Default)]
pub(super) struct Penalties {
    by_engine: BTreeMap<EngineId, Penalty>,
}

#[derive(Clone, Copy, Debug, PartialEq)]
struct Penalty {
    /// Cut-offs since the engine was last forgiven.
    strikes: u32,
    until: Instant,
}

impl Penalties {
    /// `engine` was cut off at `now`: how long its connections are refused from now.
    pub(super) fn strike(&mut self, engine: &EngineId, now: Instant) -> Duration {
        let strikes = match self.by_engine.get(engine) {
            Some(p) if now < p.until + FORGIVEN_AFTER => p.strikes.saturating_add(1),
            _ => 1,
        };
        let length = PENALTY_FIRST.saturating_mul(1u32 << (strikes - 1).min(16)).min(PENALTY_MAX);
        if !self.by_engine.contains_key(engine) && self.by_engine.len() >= PENALISED_ENGINES {
            let first_ended = self.by_engine.iter().min_by_key(|(_, p)| p.until).map(|(e, _)| e.clone());
            if let Some(engine) = first_ended {
                self.by_engine.remove(&engine);
            }
        }
        self.by_engine.insert(engine.clone(), Penalty { strikes, until: now + length });
        length
    }

    /// Whether `engine`'s connections are refused at `now`: for how much longer, and after how
    /// many cut-offs.
    fn refused(&self, engine: &EngineId, now: Instant) -> Option<(Duration, u32)> {
        self.by_engine.get(engine).filter(|p| p.until > now).map(|p| (p.until - now, p.strikes))
    }
}

/// A newcomer whose metadata waits.
pub(super) struct Deferred {
    conn: ConnId,
    info: Box<PeerInfo>,
    since: Instant,
}

impl NixlTransport {
    /// A peer authenticated: refused while its engine's penalty lasts; one that dialed this
    /// engine waits while a peer cut off still floods in; else its metadata loads now.
    pub(super) fn admit(&mut self, conn: ConnId, info: Box<PeerInfo>) {
        if info.dialed.is_none() && !self.cut_agents.is_empty() && self.deferred.len() < MAX_DEFERRED {
            self.deferred.push_back(Deferred { conn, info, since: Instant::now() });
            return;
        }
        self.load_unless_penalised(conn, info);
    }

    /// Loads the newcomers that waited, once no peer cut off floods in or they waited
    /// [`MAX_DEFERRAL`].
    pub(super) fn admit_deferred(&mut self) {
        while let Some(first) = self.deferred.front() {
            if !self.cut_agents.is_empty() && first.since.elapsed() < MAX_DEFERRAL {
                return;
            }
            let Some(Deferred { conn, info, .. }) = self.deferred.pop_front() else { return };
            self.load_unless_penalised(conn, info);
        }
    }

    /// Connection `conn` was lost: a newcomer that waited on it is dropped, unheard of.
    pub(super) fn drop_deferred(&mut self, conn: ConnId) {
        self.deferred.retain(|d| d.conn != conn);
    }

    fn load_unless_penalised(&mut self, conn: ConnId, info: Box<PeerInfo>) {
        let Some((left, strikes)) = self.penalties.refused(&info.agent.engine, Instant::now()) else {
            return self.connected(conn, info);
        };
        tracing::debug!(peer = %info.agent, strikes, left_ms = left.as_millis() as u64, "connection of an engine cut off refused");
        let error = TransportError::Backend(format!(
            "engine {} was cut off {strikes} time(s) for a notification flood; its connections are refused for {} ms more",
            info.agent.engine,
            left.as_millis()
        ));
        self.drop_peer(conn, &info, RefusalCause::Overloaded, error);
    }

    /// Closes `conn`, whose peer this engine does not take: one it dialed failed to connect
    /// (and may be dialed again), one that dialed it is refused.
    pub(super) fn drop_peer(&mut self, conn: ConnId, info: &PeerInfo, cause: RefusalCause, error: TransportError) {
        self.side.peer_closed(conn);
        let event = match &info.dialed {
            Some(address) => PeerEvent::ConnectFailed { address: address.clone(), error },
            None => PeerEvent::Refused { peer: Some(info.agent.clone()), cause, reason: error.to_string() },
        };
        self.fetcher.inbox().push(event);
    }
}

/// The newcomers waiting, in arrival order.
pub(super) type DeferredQueue = VecDeque<Deferred>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_engine_cut_off_again_waits_twice_as_long_up_to_the_cap_and_is_forgiven_later() {
        let mut penalties = Penalties::default();
        let engine = EngineId::new("flooder");
        let other = EngineId::new("d");
        let t0 = Instant::now();
        assert_eq!(penalties.strike(&engine, t0), PENALTY_FIRST);
        assert_eq!(penalties.refused(&engine, t0), Some((PENALTY_FIRST, 1)));
        assert_eq!(penalties.refused(&other, t0), None, "only the engine cut off is refused");
        assert_eq!(penalties.refused(&engine, t0 + PENALTY_FIRST), None, "the penalty ends");
        let mut at = t0;
        let mut lengths = Vec::new();
        for _ in 0..10 {
            at += Duration::from_secs(1);
            lengths.push(penalties.strike(&engine, at).as_secs());
        }
        assert_eq!(lengths, [2, 4, 8, 16, 32, 60, 60, 60, 60, 60]);
        let later = at + PENALTY_MAX + FORGIVEN_AFTER;
        assert_eq!(penalties.strike(&engine, later), PENALTY_FIRST, "forgiven after a long quiet");
    }

    #[test]
    fn the_penalties_remembered_are_bounded() {
        let mut penalties = Penalties::default();
        let t0 = Instant::now();
        for i in 0..PENALISED_ENGINES + 10 {
            let engine = EngineId::new(format!("e{i}"));
            penalties.strike(&engine, t0 + Duration::from_millis(i as u64));
        }
        assert_eq!(penalties.by_engine.len(), PENALISED_ENGINES);
        let newest = EngineId::new(format!("e{}", PENALISED_ENGINES + 9));
        assert!(penalties.refused(&newest, t0).is_some(), "the newest is kept");
        assert!(penalties.refused(&EngineId::new("e0"), t0).is_none(), "the first to end is forgotten");
    }
}
