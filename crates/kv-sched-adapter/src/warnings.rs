//! The WARNING lines operators watch for (a lease that expired, a peer lost, a peer refused),
//! one line each, rate-limited: a peer that can cause them must not fill the engine's disk.
//! Of each kind at most [`PER_WINDOW`] lines are logged in a [`WINDOW`]; the first line after
//! a window that left some out says how many.

use std::time::Duration;

use kv_core::{AgentName, EngineId, RefusalCause, RequestId, Time};

use crate::common::Consumer;
use crate::config::ReleaseReason;

/// The window the limit counts in.
pub const WINDOW: Duration = Duration::from_secs(10);

/// Lines of one kind logged in a window at most.
pub const PER_WINDOW: u32 = 5;

/// What a line says happened.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Kind {
    /// P released an export unread because its lease ran out.
    Expired,
    /// P released an export because the engine that held it was seen gone.
    ReleasedForLoss,
    /// A peer's connection was lost.
    PeerLost,
    /// The transport refused a peer, or its input.
    Refused,
    /// A claim named another prompt or other blocks than P's export: P refused it, D heard so.
    ClaimRefused,
    /// D: the export a handoff names is gone at P (a replayed or late handoff).
    ExportGone,
    /// D: a P rank a handoff names cannot be reached.
    Unreachable,
}

impl Kind {
    const COUNT: usize = 7;

    fn index(self) -> usize {
        self as usize
    }
}

#[derive(Clone, Copy, Default, Debug)]
struct Window {
    start: Option<Time>,
    logged: u32,
    left_out: u64,
}

/// One rank's lines: its name, and the limit's books, one window a kind.
#[derive(Debug)]
pub(crate) struct Warnings {
    local: AgentName,
    windows: [Window; Kind::COUNT],
}

impl Warnings {
    /// The lines of the rank `local`.
    pub(crate) fn new(local: AgentName) -> Self {
        Warnings { local, windows: Default::default() }
    }

    /// Whether a line of `kind` may be logged at `now`: `Some(n)` with the lines of its kind
    /// left out before it (0 mostly), `None` if this one is left out.
    fn admit(&mut self, kind: Kind, now: Time) -> Option<u64> {
        let window = &mut self.windows[kind.index()];
        if window.start.is_none_or(|start| now.saturating_since(start) >= WINDOW) {
            window.start = Some(now);
            window.logged = 0;
        }
        if window.logged >= PER_WINDOW {
            window.left_out += 1;
            return None;
        }
        window.logged += 1;
        Some(std::mem::take(&mut window.left_out))
    }

    /// Logs that the transport refused `peer` (or its input) for `cause`, within the limit.
    pub(crate) fn refused(&mut self, now: Time, peer: Option<&AgentName>, cause: RefusalCause, reason: &str) {
        if let Some(left_out) = self.admit(Kind::Refused, now) {
            let peer = peer.map_or_else(|| "an unnamed peer".to_owned(), AgentName::to_string);
            tracing::warn!(engine = %self.local, %peer, ?cause, %reason, left_out, "peer refused");
        }
    }

    /// P: logs, within the limit, export `id` of `blocks` blocks released unread because its
    /// lease ran out or the engine that held it (`owner`) was seen gone; other releases are the
    /// lifecycle working, and log nothing here.
    pub(crate) fn released(
        &mut self,
        now: Time,
        id: &RequestId,
        reason: ReleaseReason,
        blocks: usize,
        owner: Option<&Consumer>,
    ) {
        let kind = match reason {
            ReleaseReason::Expired => Kind::Expired,
            ReleaseReason::PeerLost => Kind::ReleasedForLoss,
            _ => return,
        };
        let Some(left_out) = self.admit(kind, now) else { return };
        let owner = owner.map_or_else(|| "no engine claimed it".to_owned(), ToString::to_string);
        let engine = &self.local;
        if kind == Kind::Expired {
            tracing::warn!(
                request = %id, %engine, owner, blocks, left_out,
                "export released: its lease expired before the decode engine read it (its blocks are free again)"
            );
        } else {
            tracing::warn!(
                request = %id, %engine, owner, blocks, left_out,
                "export released: the decode engine that held it was seen gone"
            );
        }
    }

    /// P: logs, within the limit, that `from` claimed export `id` for another prompt or other
    /// blocks (`why`), and that the export was released.
    pub(crate) fn claim_refused(&mut self, now: Time, id: &RequestId, from: &Consumer, why: &str) {
        if let Some(left_out) = self.admit(Kind::ClaimRefused, now) {
            tracing::warn!(
                request = %id, engine = %self.local, claimant = %from, reason = %why, left_out,
                "claim refused, export released (rejected): the handoff the decode engine holds was not made for its prompt"
            );
        }
    }

    /// D: logs, within the limit, that P engine `prefill` refused this engine's claim of its
    /// request `prefill_request` for D's `request`: D computes the prompt as its load-failure
    /// policy says.
    pub(crate) fn handoff_refused(
        &mut self,
        now: Time,
        request: &RequestId,
        prefill: &EngineId,
        prefill_request: &RequestId,
    ) {
        if let Some(left_out) = self.admit(Kind::ClaimRefused, now) {
            tracing::warn!(
                %request, engine = %self.local, %prefill, %prefill_request, reason = "other_prompt", left_out,
                "handoff refused: P computed another prompt or holds other blocks than the handoff names; the load fails (kv_load_failure_policy)"
            );
        }
    }

    /// D: logs, within the limit, that P's rank `peer` no longer holds the export D's
    /// `request` names (released already: a replayed handoff, or one that came after the
    /// lease); the load fails.
    pub(crate) fn export_gone(&mut self, now: Time, request: &RequestId, peer: &AgentName) {
        if let Some(left_out) = self.admit(Kind::ExportGone, now) {
            tracing::warn!(
                %request, engine = %self.local, %peer, left_out,
                "handoff refused: P no longer holds the export (released already: a replayed or late handoff); the load fails (kv_load_failure_policy)"
            );
        }
    }

    /// D: logs, within the limit, that P's rank `peer`, which a handoff names, cannot be
    /// reached; the loads that need it fail.
    pub(crate) fn unreachable(&mut self, now: Time, peer: &AgentName, error: &dyn std::fmt::Display) {
        if let Some(left_out) = self.admit(Kind::Unreachable, now) {
            tracing::warn!(engine = %self.local, %peer, %error, left_out, "cannot reach prefill rank; its loads fail (kv_load_failure_policy)");
        }
    }

    /// Logs that `peer`'s connection was lost, within the limit.
    pub(crate) fn peer_lost(&mut self, now: Time, peer: &AgentName) {
        if let Some(left_out) = self.admit(Kind::PeerLost, now) {
            tracing::warn!(engine = %self.local, %peer, left_out, "peer lost: its side channel closed, or a newer incarnation replaced it");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_kind_logs_a_few_lines_a_window_and_then_says_how_many_it_left_out() {
        let mut warnings = Warnings::new(AgentName::new(kv_core::EngineId::new("prefill0"), 0));
        let t0 = Time::from_millis(1_000);
        let logged: Vec<Option<u64>> = (0..8).map(|_| warnings.admit(Kind::Expired, t0)).collect();
        assert_eq!(logged, [Some(0), Some(0), Some(0), Some(0), Some(0), None, None, None]);
        assert_eq!(warnings.admit(Kind::PeerLost, t0), Some(0), "another kind has its own window");
        let later = t0.saturating_add(WINDOW - Duration::from_millis(1));
        assert_eq!(warnings.admit(Kind::Expired, later), None, "still the same window");
        let next = t0.saturating_add(WINDOW);
        assert_eq!(warnings.admit(Kind::Expired, next), Some(4), "the first of the next window counts those left out");
        assert_eq!(warnings.admit(Kind::Expired, next), Some(0));
    }
}
