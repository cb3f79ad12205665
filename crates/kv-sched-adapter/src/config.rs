//! Configuration, with vLLM NixlConnector's names and defaults, and the small shared enums.

use std::fmt;
use std::time::Duration;

/// Whether D reads from P or P writes into D.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
#[cfg_attr(feature = "serde", derive(serde::Deserialize), serde(rename_all = "snake_case"))]
pub enum Mode {
    /// D reads P's exported blocks.
    Pull,
    /// D registers its blocks and P writes into them.
    Push,
}

/// What D does when a load fails or cannot be made safely.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
#[cfg_attr(feature = "serde", derive(serde::Deserialize), serde(rename_all = "snake_case"))]
pub enum LoadFailurePolicy {
    /// Fail the request.
    Fail,
    /// Compute the prompt's KV locally instead.
    Recompute,
}

/// Why P released an export.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
#[cfg_attr(feature = "serde", derive(serde::Deserialize), serde(rename_all = "snake_case"))]
pub enum ReleaseReason {
    /// The completion count was reached (D's reads, or P's writes, finished; a prefix hit says done too).
    Transferred,
    /// The lease ran out.
    Expired,
    /// D rejected the request before admission.
    Rejected,
    /// D aborted the request, or gave up its load, and told P.
    Aborted,
    /// A parallel-sampling sibling's completion released it.
    Sibling,
    /// The D engine that had renewed it or started loading it was seen gone.
    PeerLost,
}

impl ReleaseReason {
    /// The reason's name, as scenario files and reports write it.
    pub fn as_str(&self) -> &'static str {
        match self {
            ReleaseReason::Transferred => "transferred",
            ReleaseReason::Expired => "expired",
            ReleaseReason::Rejected => "rejected",
            ReleaseReason::Aborted => "aborted",
            ReleaseReason::Sibling => "sibling",
            ReleaseReason::PeerLost => "peer_lost",
        }
    }
}

impl fmt::Display for ReleaseReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The connector's settings; [`Config::default`] gives vLLM's defaults.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Config {
    /// Pull or push.
    pub mode: Mode,
    /// `kv_lease_duration`: the lease on P's exported blocks.
    pub kv_lease_duration: Duration,
    /// How often D renews the leases of its waiting requests.
    pub heartbeat_interval: Duration,
    /// A renewal sets `expiry = max(old, now + lease_extension)`.
    pub lease_extension: Duration,
    /// `decoder_kv_blocks_ttl`: how long D holds blocks for a peer.
    pub decoder_kv_blocks_ttl: Duration,
    /// D gives up a push that never came, after this.
    pub push_registration_timeout: Duration,
    /// How long D keeps given-up push blocks out of its pool at most, unless P confirms first
    /// that no write can come (or is seen gone): 2 × `kv_lease_duration` by default.
    pub push_quarantine: Duration,
    /// `kv_load_failure_policy`.
    pub kv_load_failure_policy: LoadFailurePolicy,
    /// Completions that reached P before their export, kept until it registers (oldest evicted).
    pub early_notification_capacity: usize,
    /// D starts a read only if it has at least this long before P's deadline (clock uncertainty added).
    pub read_safety_margin: Duration,
}

impl Config {
    /// vLLM's defaults for a given lease: heartbeats at lease / 6, extension 2 × lease / 3.
    pub fn with_lease(kv_lease_duration: Duration) -> Self {
        Config {
            mode: Mode::Pull,
            kv_lease_duration,
            heartbeat_interval: kv_lease_duration / 6,
            lease_extension: kv_lease_duration * 2 / 3,
            decoder_kv_blocks_ttl: Duration::from_secs(480),
            push_registration_timeout: Duration::from_secs(480),
            push_quarantine: kv_lease_duration * 2,
            kv_load_failure_policy: LoadFailurePolicy::Recompute,
            early_notification_capacity: 8192,
            read_safety_margin: Duration::from_secs(5),
        }
    }

    /// Checks the settings that would make the lifecycle unsound.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let positive = [
            ("kv_lease_duration", self.kv_lease_duration),
            ("heartbeat_interval", self.heartbeat_interval),
            ("lease_extension", self.lease_extension),
            ("push_registration_timeout", self.push_registration_timeout),
        ];
        if let Some((name, _)) = positive.iter().find(|(_, d)| d.is_zero()) {
            return Err(ConfigError::Zero { name });
        }
        // A heartbeat must land before the extension it granted runs out, or leases lapse
        // between beats while D is still waiting.
        if self.heartbeat_interval >= self.lease_extension {
            return Err(ConfigError::HeartbeatTooSlow {
                heartbeat_interval: self.heartbeat_interval,
                lease_extension: self.lease_extension,
            });
        }
        Ok(())
    }
}

impl Default for Config {
    fn default() -> Self {
        Config::with_lease(Duration::from_secs(30))
    }
}

/// Settings that cannot work together.
#[derive(Clone, PartialEq, Eq, Debug, thiserror::Error)]
pub enum ConfigError {
    /// A duration that must be positive is zero.
    #[error("{name} must be positive")]
    Zero {
        /// The setting.
        name: &'static str,
    },
    /// Heartbeats come no faster than the extension they grant.
    #[error("heartbeat interval {heartbeat_interval:?} must be shorter than the lease extension {lease_extension:?}")]
    HeartbeatTooSlow {
        /// The interval.
        heartbeat_interval: Duration,
        /// The extension.
        lease_extension: Duration,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_follow_vllm() {
        let c = Config::default();
        assert_eq!(c.heartbeat_interval, Duration::from_secs(5));
        assert_eq!(c.lease_extension, Duration::from_secs(20));
        assert_eq!(c.validate(), Ok(()));
        let slow = Config { heartbeat_interval: Duration::from_secs(25), ..c };
        assert_eq!(
            slow.validate().unwrap_err().to_string(),
            "heartbeat interval 25s must be shorter than the lease extension 20s"
        );
        let zero = Config { kv_lease_duration: Duration::ZERO, ..c };
        assert_eq!(zero.validate().unwrap_err().to_string(), "kv_lease_duration must be positive");
    }
}
