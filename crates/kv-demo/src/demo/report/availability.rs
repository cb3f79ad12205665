//! The demo's availability during a storm, against the quiet window before it.

use serde::Serialize;

use crate::proto::{AttackResult, STORM_THROUGHPUT_SHARE};

/// How the demo fared during a storm, against the quiet window before it.
#[derive(Clone, Debug, Serialize)]
pub struct Availability {
    /// The storm.
    pub attack: String,
    /// Requests whose KV D came to hold per second, in the quiet window and in the storm's. In
    /// an open loop the quiet window's counts at most the offered rate: above it, the demo is
    /// catching up on requests an earlier storm delayed, which is no baseline.
    pub quiet_rps: f64,
    /// See `quiet_rps`.
    pub storm_rps: f64,
    /// Transfers that failed in the storm's window.
    pub failed_transfers: usize,
}

impl Availability {
    /// The demo's availability over each storm `attacks` reported, from the times the router
    /// heard each request's KV ready and each transfer end.
    /// `offered`: the open loop's rate, if it is one.
    pub(super) fn of(
        attacks: &[AttackResult],
        ready_at: &[u64],
        transfer_at: &[(u64, bool)],
        offered: Option<f64>,
    ) -> Vec<Availability> {
        let rate = |(from, to): (u64, u64)| {
            let n = ready_at.iter().filter(|&&t| t >= from && t < to).count();
            n as f64 / ((to.saturating_sub(from)) as f64 / 1e9).max(1e-3)
        };
        attacks
            .iter()
            .filter_map(|a| {
                let (window, quiet) = (a.window_ns?, a.quiet_ns?);
                Some(Availability {
                    attack: a.attack.clone(),
                    quiet_rps: offered.map_or(rate(quiet), |offered| rate(quiet).min(offered)),
                    storm_rps: rate(window),
                    failed_transfers: transfer_at
                        .iter()
                        .filter(|(t, ok)| !ok && *t >= window.0 && *t < window.1)
                        .count(),
                })
            })
            .collect()
    }

    pub(super) fn failures(&self) -> Vec<String> {
        let mut f = Vec::new();
        if self.storm_rps < STORM_THROUGHPUT_SHARE * self.quiet_rps || self.quiet_rps == 0.0 {
            f.push(format!(
                "{}: the demo ran at {:.1} requests a second under the storm, against {:.1} in the quiet window before it (bound {:.0}%)",
                self.attack,
                self.storm_rps,
                self.quiet_rps,
                STORM_THROUGHPUT_SHARE * 100.0
            ));
        }
        if self.failed_transfers > 0 {
            f.push(format!("{}: {} transfers failed under the storm", self.attack, self.failed_transfers));
        }
        f
    }
}
