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
    /// Every reason, in declaration order.
    pub const ALL: [ReleaseReason; 6] = [
        ReleaseReason::Transferred,
        ReleaseReason::Expired,
        ReleaseReason::Rejected,
        ReleaseReason::Aborted,
        ReleaseReason::Sibling,
        ReleaseReason::PeerLost,
    ];

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
///
/// With the `serde` feature it deserializes from [`ExtraConfig`], the keys an engine already
/// passes in vLLM's `kv_connector_extra_config`, and is validated as it is read:
///
/// ```
/// # #[cfg(feature = "serde")] {
/// # let json = r#"{"kv_lease_duration": 12, "kv_load_failure_policy": "fail"}"#;
/// # fn from_json(json: &str) -> kv_sched_adapter::Config { serde_json::from_str(json).unwrap() }
/// let config = from_json(json);
/// assert_eq!(config.heartbeat_interval, std::time::Duration::from_secs(2)); // lease / 6
/// # }
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[cfg_attr(feature = "serde", derive(serde::Deserialize), serde(try_from = "ExtraConfig"))]
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
    /// How transfers of whole blocks name their bytes: `None` (the default), as the transport
    /// says is fastest for its memory and backend ([`kv_core::Transport::descriptors`]);
    /// `Some` overrides it.
    pub descriptors: Option<kv_core::Descriptors>,
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
            descriptors: None,
        }
    }

    /// The settings `extra` gives, every key it leaves out at vLLM's default for its lease
    /// (`push_registration_timeout` at `decoder_kv_blocks_ttl`), validated.
    pub fn from_extra(extra: &ExtraConfig) -> Result<Config, ConfigError> {
        let lease = seconds("kv_lease_duration", extra.kv_lease_duration)?;
        let d = Config::with_lease(lease.unwrap_or(Duration::from_secs(30)));
        let ttl = seconds("decoder_kv_blocks_ttl", extra.decoder_kv_blocks_ttl)?.unwrap_or(d.decoder_kv_blocks_ttl);
        let timeout = seconds("push_registration_timeout", extra.push_registration_timeout)?.unwrap_or(ttl);
        let config = Config {
            mode: extra.mode.unwrap_or(d.mode),
            heartbeat_interval: seconds("heartbeat_interval", extra.heartbeat_interval)?
                .unwrap_or(d.heartbeat_interval),
            lease_extension: seconds("heartbeat_lease_extension", extra.heartbeat_lease_extension)?
                .unwrap_or(d.lease_extension),
            decoder_kv_blocks_ttl: ttl,
            push_registration_timeout: timeout,
            push_quarantine: seconds("push_quarantine", extra.push_quarantine)?.unwrap_or(d.push_quarantine),
            kv_load_failure_policy: extra.kv_load_failure_policy.unwrap_or(d.kv_load_failure_policy),
            early_notification_capacity: extra.early_notification_capacity.unwrap_or(d.early_notification_capacity),
            read_safety_margin: seconds("read_safety_margin", extra.read_safety_margin)?
                .unwrap_or(d.read_safety_margin),
            descriptors: descriptors(extra.kv_descriptors.as_deref())?,
            ..d
        };
        config.validate()?;
        Ok(config)
    }

    /// Checks the settings that would make the lifecycle unsound.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let positive = [
            ("kv_lease_duration", self.kv_lease_duration),
            ("heartbeat_interval", self.heartbeat_interval),
            ("heartbeat_lease_extension", self.lease_extension),
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

impl TryFrom<ExtraConfig> for Config {
    type Error = ConfigError;

    fn try_from(extra: ExtraConfig) -> Result<Config, ConfigError> {
        Config::from_extra(&extra)
    }
}

/// The connector's keys in vLLM's `kv_connector_extra_config`, as an engine already has them:
/// every key optional (a key left out takes vLLM's default, derived from the lease where vLLM
/// derives it), durations in seconds as vLLM writes them, and, with the `serde` feature,
/// unknown keys refused. [`Config::from_extra`] turns it into validated settings.
#[derive(Clone, Default, PartialEq, Debug)]
#[cfg_attr(feature = "serde", derive(serde::Deserialize), serde(default, deny_unknown_fields))]
pub struct ExtraConfig {
    /// `mode`: `"pull"` (the default) or `"push"`.
    pub mode: Option<Mode>,
    /// `kv_lease_duration` (30 s): the lease on P's exported blocks.
    pub kv_lease_duration: Option<f64>,
    /// `heartbeat_interval` (lease / 6): how often D renews its waiting requests' leases.
    pub heartbeat_interval: Option<f64>,
    /// `heartbeat_lease_extension` (2 × lease / 3): a renewal's `expiry = max(old, now + this)`.
    pub heartbeat_lease_extension: Option<f64>,
    /// `decoder_kv_blocks_ttl` (480 s).
    pub decoder_kv_blocks_ttl: Option<f64>,
    /// `push_registration_timeout` (= `decoder_kv_blocks_ttl`): D gives up a push that never came.
    pub push_registration_timeout: Option<f64>,
    /// `push_quarantine` (2 × lease): how long D keeps given-up push blocks out of its pool.
    pub push_quarantine: Option<f64>,
    /// `kv_load_failure_policy` (`"recompute"`, or `"fail"`).
    pub kv_load_failure_policy: Option<LoadFailurePolicy>,
    /// `early_notification_capacity` (8192): completions staged before their export.
    pub early_notification_capacity: Option<usize>,
    /// `read_safety_margin` (5 s): D starts a read only this long before P's deadline.
    pub read_safety_margin: Option<f64>,
    /// `kv_descriptors` (`"auto"`): how transfers of whole blocks name their bytes:
    /// `"pairs"` (merged address pairs), `"prepared"` (prepared lists, by index), or `"auto"`,
    /// whichever the transport says is fastest for its memory and backend.
    pub kv_descriptors: Option<String>,
}

/// The `kv_descriptors` setting: `None` for `auto` (or left out).
fn descriptors(value: Option<&str>) -> Result<Option<kv_core::Descriptors>, ConfigError> {
    match value {
        None | Some("auto") => Ok(None),
        Some("pairs") => Ok(Some(kv_core::Descriptors::Pairs)),
        Some("prepared") => Ok(Some(kv_core::Descriptors::Prepared)),
        Some(other) => Err(ConfigError::Descriptors { value: other.to_owned() }),
    }
}

/// `value` seconds of the setting `key`, when it is a finite, non-negative number that fits.
fn seconds(key: &'static str, value: Option<f64>) -> Result<Option<Duration>, ConfigError> {
    value.map(|s| Duration::try_from_secs_f64(s).map_err(|_| ConfigError::Seconds { key, value: s })).transpose()
}

/// Settings that cannot work together.
#[derive(Clone, PartialEq, Debug, thiserror::Error)]
pub enum ConfigError {
    /// A duration that must be positive is zero.
    #[error("{name} must be positive, not 0")]
    Zero {
        /// The setting.
        name: &'static str,
    },
    /// `kv_descriptors` names no choice.
    #[error("kv_descriptors is {value:?}; it must be \"auto\", \"pairs\" or \"prepared\"")]
    Descriptors {
        /// The value given.
        value: String,
    },
    /// A worker's handshake offer does not describe its pool or its role.
    #[error("the handshake offer's {field} is {offer}, but the pool's is {pool}")]
    Offer {
        /// The field that disagrees.
        field: &'static str,
        /// The offer's value.
        offer: String,
        /// The pool's.
        pool: String,
    },
    /// A scheduler with no TP ranks.
    #[error("a scheduler needs at least one TP rank, got {tp}")]
    NoRanks {
        /// The ranks given.
        tp: u32,
    },
    /// A prefill engine's worker addresses do not split into its pipeline stages.
    #[error("{workers} worker addresses do not split into {pp} pipeline stages")]
    Stages {
        /// Addresses given.
        workers: u32,
        /// Pipeline stages asked for.
        pp: u32,
    },
    /// A duration in seconds that is negative, not a number, or too large.
    #[error("{key} = {value:?} is not a duration in seconds")]
    Seconds {
        /// The setting.
        key: &'static str,
        /// What it was given.
        value: f64,
    },
    /// Heartbeats come no faster than the extension they grant.
    #[error(
        "heartbeat_interval {heartbeat_interval:?} must be shorter than heartbeat_lease_extension {lease_extension:?}"
    )]
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
            "heartbeat_interval 25s must be shorter than heartbeat_lease_extension 20s"
        );
        let zero = Config { kv_lease_duration: Duration::ZERO, ..c };
        assert_eq!(zero.validate().unwrap_err().to_string(), "kv_lease_duration must be positive, not 0");
    }

    /// What `json` (a `kv_connector_extra_config`) reads as: the settings, or the error's text.
    #[cfg(feature = "serde")]
    fn read(json: &str) -> Result<Config, String> {
        serde_json::from_str::<Config>(json).map_err(|e| e.to_string())
    }

    #[cfg(feature = "serde")]
    #[test]
    fn extra_config_reads_vllm_keys_in_seconds_with_defaults_from_the_lease() {
        let secs = Duration::from_secs;
        assert_eq!(read("{}"), Ok(Config::default()));
        let c = read(r#"{"kv_lease_duration": 12}"#).unwrap();
        assert_eq!((c.heartbeat_interval, c.lease_extension, c.push_quarantine), (secs(2), secs(8), secs(24)));
        let c = read(r#"{"mode": "push", "decoder_kv_blocks_ttl": 60, "kv_load_failure_policy": "fail"}"#).unwrap();
        assert_eq!((c.mode, c.kv_load_failure_policy), (Mode::Push, LoadFailurePolicy::Fail));
        assert_eq!((c.decoder_kv_blocks_ttl, c.push_registration_timeout), (secs(60), secs(60)));
        let c = read(r#"{"heartbeat_interval": 0.5, "heartbeat_lease_extension": 2.5, "read_safety_margin": 1}"#);
        let c = c.unwrap();
        assert_eq!(
            (c.heartbeat_interval, c.lease_extension),
            (Duration::from_millis(500), Duration::from_millis(2500))
        );
        assert_eq!(c.read_safety_margin, secs(1));
        assert_eq!(read(r#"{"kv_descriptors": "auto"}"#).unwrap().descriptors, None);
        assert_eq!(read(r#"{"kv_descriptors": "pairs"}"#).unwrap().descriptors, Some(kv_core::Descriptors::Pairs));
        let prepared = read(r#"{"kv_descriptors": "prepared"}"#).unwrap().descriptors;
        assert_eq!(prepared, Some(kv_core::Descriptors::Prepared));
    }

    #[cfg(feature = "serde")]
    #[test]
    fn extra_config_refuses_bad_values_naming_key_and_value() {
        let check = |json: &str, expected: &str| {
            let err = read(json).unwrap_err();
            assert!(err.contains(expected), "{json}: {err:?} does not say {expected:?}");
        };
        check(r#"{"kv_lease_duration": -3}"#, "kv_lease_duration = -3.0 is not a duration in seconds");
        check(r#"{"push_quarantine": 1e300}"#, "push_quarantine = 1e300 is not a duration in seconds");
        check(r#"{"kv_lease_duration": 0}"#, "kv_lease_duration must be positive, not 0");
        check(
            r#"{"heartbeat_interval": 30}"#,
            "heartbeat_interval 30s must be shorter than heartbeat_lease_extension 20s",
        );
        check(r#"{"kv_lease_durations": 30}"#, "unknown field `kv_lease_durations`");
        check(r#"{"kv_load_failure_policy": "retry"}"#, "unknown variant `retry`");
        check(r#"{"kv_lease_duration": "30"}"#, "invalid type: string \"30\"");
        check(
            r#"{"kv_descriptors": "indices"}"#,
            r#"kv_descriptors is "indices"; it must be "auto", "pairs" or "prepared""#,
        );
    }
}
