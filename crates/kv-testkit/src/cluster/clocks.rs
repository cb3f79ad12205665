//! Each engine's clock: the cluster's true time plus the engine's skew (`clock_skew_ms`).
//!
//! Everything an engine does with time runs on its own clock: its scheduler's exports (the
//! lease deadlines P hands the router), its workers' steps, commands and wake-ups, and its
//! side channel, whose handshake stamps the offer with that clock, so that a peer learns the
//! offset only by sampling it there, over the network. The cluster itself (the scenario's
//! `at_s`, the step grid, the network's delays, the trace) keeps true time, and turns an
//! engine's wake-up back into true time to schedule it.
//!
//! kv-core's [`Time`] cannot read below its origin, so every clock also reads one common lead,
//! the size of the most negative skew: the engine furthest behind reads zero at the start.
//! Engines' clocks have origins of their own anyway ([`Time`]); what the skews set, and all
//! that an engine can observe, is how far each two clocks disagree, and that is exactly the
//! difference of their skews. Without a negative skew there is no lead: a clock without skew
//! reads true time.

use std::collections::BTreeMap;

use kv_core::{EngineId, Time};

use super::ClusterError;
use crate::scenario::ClusterSpec;

/// The widest spread of skews this runner takes (about 146 years): a clock further ahead
/// would come near the end of [`Time`], where deadlines saturate.
const MAX_SPREAD_NANOS: i64 = i64::MAX / 2;

/// Every engine's clock, as an offset from true time.
#[derive(Clone, Debug, Default)]
pub(super) struct Clocks {
    /// Per engine, how far its clock reads ahead of true time, lead included (never negative).
    offsets: BTreeMap<EngineId, i64>,
}

impl Clocks {
    /// The clocks `spec.clock_skew` describes; a skew for an engine the cluster lacks, or
    /// skews spread wider than this runner can represent, are errors.
    pub fn new(spec: &ClusterSpec) -> Result<Self, ClusterError> {
        if let Some(node) = spec.clock_skew.keys().find(|n| !spec.contains(**n)) {
            return Err(ClusterError(format!("clock_skew_ms names {node}, which the cluster does not have")));
        }
        let skew = |node| spec.clock_skew.get(&node).copied().unwrap_or(0);
        let lead = spec.nodes().map(skew).min().unwrap_or(0).min(0).saturating_neg();
        let mut offsets = BTreeMap::new();
        for node in spec.nodes() {
            let offset = lead.checked_add(skew(node)).filter(|o| *o <= MAX_SPREAD_NANOS).ok_or_else(|| {
                ClusterError(format!(
                    "clock_skew_ms spreads the engines' clocks over more than {} s",
                    MAX_SPREAD_NANOS / 1_000_000_000
                ))
            })?;
            offsets.insert(node.engine_id(), offset);
        }
        Ok(Clocks { offsets })
    }

    /// How far `engine`'s clock reads ahead of true time.
    pub fn offset(&self, engine: &EngineId) -> i64 {
        self.offsets.get(engine).copied().unwrap_or(0)
    }

    /// Every engine's offset.
    pub fn offsets(&self) -> impl Iterator<Item = (&EngineId, i64)> {
        self.offsets.iter().map(|(engine, offset)| (engine, *offset))
    }

    /// What `engine`'s clock reads at true time `t`.
    pub fn local(&self, engine: &EngineId, t: Time) -> Time {
        t.shifted(self.offset(engine))
    }

    /// The true time at which `engine`'s clock reads `t` (the origin, if it read `t` before).
    pub fn true_time(&self, engine: &EngineId, t: Time) -> Time {
        t.shifted(self.offset(engine).saturating_neg())
    }
}

/// `nanos` as a trace says it: `2.500000000s ahead of` or `behind` true time.
pub(super) fn describe_skew(nanos: i64) -> String {
    let size = Time::from_nanos(nanos.unsigned_abs());
    if nanos < 0 {
        format!("{size} behind")
    } else {
        format!("{size} ahead of")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scenario::format::Node;

    fn spec(skews: &[(Node, i64)]) -> ClusterSpec {
        ClusterSpec { decoders: 2, clock_skew: skews.iter().copied().collect(), ..ClusterSpec::default() }
    }

    #[test]
    fn clocks_differ_by_their_skews_and_none_reads_below_the_origin() {
        let (p0, d0, d1) = (Node::PREFILL0.engine_id(), Node::DECODE0.engine_id(), Node::decode(1).engine_id());
        // No negative skew: no lead, and an engine without skew reads true time.
        let clocks = Clocks::new(&spec(&[(Node::DECODE0, 2_500_000_000)])).unwrap();
        assert_eq!(clocks.local(&p0, Time::from_millis(100)), Time::from_millis(100));
        assert_eq!(clocks.local(&d0, Time::from_millis(100)), Time::from_millis(2_600));
        assert_eq!(clocks.true_time(&d0, Time::from_millis(2_600)), Time::from_millis(100));
        // decode1 is 10 s behind: every clock leads by 10 s, and decode1 starts at zero.
        let clocks = Clocks::new(&spec(&[(Node::DECODE0, 2_500_000_000), (Node::decode(1), -10_000_000_000)])).unwrap();
        assert_eq!(clocks.local(&d1, Time::ZERO), Time::ZERO);
        assert_eq!(clocks.local(&p0, Time::ZERO), Time::from_millis(10_000));
        assert_eq!(clocks.local(&d0, Time::from_millis(1)), Time::from_millis(12_501));
        assert_eq!(clocks.true_time(&d0, Time::from_millis(12_501)), Time::from_millis(1));
        assert_eq!(clocks.true_time(&d0, Time::from_millis(5)), Time::ZERO);
        assert_eq!(describe_skew(-2_500_000_000), "2.500000000s behind");
        assert_eq!(describe_skew(1), "0.000000001s ahead of");
    }

    #[test]
    fn skews_the_cluster_cannot_have_are_refused() {
        let err = Clocks::new(&spec(&[(Node::decode(2), 1)])).unwrap_err();
        assert_eq!(err.0, "clock_skew_ms names decode2, which the cluster does not have");
        let err = Clocks::new(&spec(&[(Node::DECODE0, i64::MAX / 2), (Node::decode(1), -1)])).unwrap_err();
        assert_eq!(err.0, "clock_skew_ms spreads the engines' clocks over more than 4611686018 s");
        assert!(Clocks::new(&spec(&[(Node::DECODE0, i64::MAX / 2)])).is_ok());
    }
}
