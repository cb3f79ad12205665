//! Configuration, with vLLM NixlConnector's names and defaults, and the small shared enums.
//!
//! An engine that already has vLLM's `kv_transfer_config` builds the connector's [`Config`]
//! from the whole of it ([`KvTransferConfig`], [`Config::from_kv_transfer_config`]); one that
//! has only its `kv_connector_extra_config` from that ([`ExtraConfig`], [`Config::from_extra`]).
//! Every key, with its default (durations in seconds, as vLLM writes them):
//!
//! | `kv_transfer_config` key | default | meaning |
//! |---|---|---|
//! | `kv_connector` | (required) | `NixlConnector`, `NixlPullConnector` or `KvflowConnector`: pull; `NixlPushConnector` or `KvflowPushConnector`: push |
//! | `kv_role` | none | `kv_producer`, `kv_consumer` or `kv_both`, for the engine ([`KvTransferConfig::kv_role`]) |
//! | `kv_load_failure_policy` | `fail` (vLLM's) | `fail` or `recompute`; the extra config's key, if given, must agree |
//! | `kv_connector_extra_config` | `{}` | kvflow's keys, below |
//! | `kv_connector_module_path`, `engine_id` | none | for the engine; the connector does not read them |
//! | `kv_buffer_device`, `kv_buffer_size`, `kv_rank`, `kv_parallel_size`, `kv_ip`, `kv_port`, `enable_permute_local_kv` | vLLM's | vLLM's own; accepted and not read |
//! | any other key | | ignored ([`KvTransferConfig::unknown`]: a newer vLLM's field must not stop the engine) |
//!
//! | `kv_connector_extra_config` key | default | meaning |
//! |---|---|---|
//! | `mode` | from `kv_connector` (else `pull`) | `pull` or `push`; an error if it disagrees with `kv_connector` |
//! | `kv_lease_duration` | 30 | the lease on P's exported blocks |
//! | `heartbeat_interval` | lease / 6 | how often D renews its waiting requests' leases |
//! | `heartbeat_lease_extension` | 2 × lease / 3 | a renewal sets `expiry = max(old, now + this)`; it must exceed `heartbeat_interval` |
//! | `read_safety_margin` | the smaller of 5 and (extension − interval) / 2 | D reads only this long before P's deadline; it must be shorter than extension − interval |
//! | `decoder_kv_blocks_ttl` | 480 | how long D holds blocks for a peer, and keeps a waiting request's lease alive |
//! | `push_registration_timeout` | `decoder_kv_blocks_ttl` | D gives up a push that never came |
//! | `push_quarantine` | 2 × lease | how long D keeps given-up push blocks out of its pool |
//! | `kv_load_failure_policy` | `recompute` (from the extra config alone) | `fail` or `recompute` |
//! | `early_notification_capacity` | 8192 | completions staged before their export |
//! | `kv_descriptors` | `auto` | `auto`, `pairs` or `prepared` |
//! | `backends` | `["UCX"]` | NIXL backends; kvflow runs UCX only, so anything else is an error |
//! | `num_threads` | none: the transport's default | NIXL's UCX thread pool ([`Config::ucx_params`]); vLLM's NixlConnector sets 4 |
//! | `enforce_handshake_compat`, `engine_ttl`, `bidirectional_kv_xfer`, `kv_recompute_threshold` | NixlConnector's | NixlConnector's keys kvflow does not act on: accepted, and named in [`KvTransferConfig::ignored`] for the engine to log at WARNING |
//!
//! Any other key of `kv_connector_extra_config` is an error naming it (a misspelt key of
//! kvflow's must not pass unseen). Where `kv_lease_duration` is left out, NixlConnector's
//! older `VLLM_NIXL_ABORT_REQUEST_TIMEOUT` sets it ([`KvTransferConfig::with_abort_timeout`]).

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

impl Mode {
    /// The mode's name, as configuration writes it.
    pub fn as_str(&self) -> &'static str {
        match self {
            Mode::Pull => "pull",
            Mode::Push => "push",
        }
    }
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

impl LoadFailurePolicy {
    /// The policy's name, as configuration writes it.
    pub fn as_str(&self) -> &'static str {
        match self {
            LoadFailurePolicy::Fail => "fail",
            LoadFailurePolicy::Recompute => "recompute",
        }
    }
}

/// vLLM's `kv_role`: what the engine does with KV caches.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
#[cfg_attr(feature = "serde", derive(serde::Deserialize))]
pub enum KvRole {
    /// `kv_producer`: a prefill engine (P).
    #[cfg_attr(feature = "serde", serde(rename = "kv_producer"))]
    Producer,
    /// `kv_consumer`: a decode engine (D).
    #[cfg_attr(feature = "serde", serde(rename = "kv_consumer"))]
    Consumer,
    /// `kv_both`: either, as the router sends it requests.
    #[cfg_attr(feature = "serde", serde(rename = "kv_both"))]
    Both,
}

/// Why P released an export.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize), serde(rename_all = "snake_case"))]
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
    /// D starts a read only if it has at least this long before P's deadline (clock uncertainty
    /// added), and accepts its bytes only if it ended that long before. It must be shorter than
    /// `lease_extension - heartbeat_interval`, what a renewed lease has left when the next
    /// heartbeat is acknowledged, or loads late in a heartbeat cycle would always be fenced;
    /// [`Config::default_read_margin`] by default.
    pub read_safety_margin: Duration,
    /// How transfers of whole blocks name their bytes: `None` (the default), as the transport
    /// says is fastest for its memory and backend ([`kv_core::Transport::descriptors`]);
    /// `Some` overrides it.
    pub descriptors: Option<kv_core::Descriptors>,
    /// `num_threads`: the size of NIXL's UCX thread pool, which splits a transfer's descriptors
    /// across threads; `None` leaves the transport's default. The connectors do not use it:
    /// the engine hands [`Config::ucx_params`] to its NIXL transport (kv-transport-nixl's
    /// `NixlConfig::ucx_params`).
    pub num_threads: Option<u32>,
}

impl Config {
    /// The most [`Config::default_read_margin`] keeps: vLLM's safety margin before a deadline.
    pub const MAX_DEFAULT_READ_MARGIN: Duration = Duration::from_secs(5);

    /// vLLM's defaults for a given lease: heartbeats at lease / 6, extension 2 × lease / 3, and
    /// the read margin that follows them (lease / 4, at most 5 s).
    pub fn with_lease(kv_lease_duration: Duration) -> Self {
        let heartbeat_interval = kv_lease_duration / 6;
        let lease_extension = kv_lease_duration * 2 / 3;
        Config {
            mode: Mode::Pull,
            kv_lease_duration,
            heartbeat_interval,
            lease_extension,
            decoder_kv_blocks_ttl: Duration::from_secs(480),
            push_registration_timeout: Duration::from_secs(480),
            push_quarantine: kv_lease_duration * 2,
            kv_load_failure_policy: LoadFailurePolicy::Recompute,
            early_notification_capacity: 8192,
            read_safety_margin: Config::default_read_margin(heartbeat_interval, lease_extension),
            descriptors: None,
            num_threads: None,
        }
    }

    /// The read margin that follows the heartbeat cycle: half of what a renewed lease has left,
    /// at the least, when the next heartbeat's acknowledgement lands
    /// ([`kv_lease::renewal_slack`]: `lease_extension - heartbeat_interval`), and at most
    /// [`Config::MAX_DEFAULT_READ_MARGIN`]. The other half is for the heartbeat's round trip,
    /// the clock offset's uncertainty and the read itself, so a healthy queued load reads at
    /// any point of the cycle.
    pub fn default_read_margin(heartbeat_interval: Duration, lease_extension: Duration) -> Duration {
        (kv_lease::renewal_slack(heartbeat_interval, lease_extension) / 2).min(Config::MAX_DEFAULT_READ_MARGIN)
    }

    /// The UCX backend parameters these settings ask NIXL for, by NIXL's names: for the engine
    /// to pass to its NIXL transport (kv-transport-nixl's `NixlConfig::ucx_params`), since the
    /// connectors know no transport.
    ///
    /// ```
    /// let config = kv_sched_adapter::Config { num_threads: Some(4), ..Default::default() };
    /// assert_eq!(config.ucx_params(), vec![("num_threads".to_owned(), "4".to_owned())]);
    /// ```
    pub fn ucx_params(&self) -> Vec<(String, String)> {
        self.num_threads.map(|n| ("num_threads".to_owned(), n.to_string())).into_iter().collect()
    }

    /// The settings `extra` gives, every key it leaves out at vLLM's default for its lease
    /// (`push_registration_timeout` at `decoder_kv_blocks_ttl`, the read margin following the
    /// heartbeat interval and extension), validated.
    pub fn from_extra(extra: &ExtraConfig) -> Result<Config, ConfigError> {
        backends(extra.backends.as_deref())?;
        let lease = seconds("kv_lease_duration", extra.kv_lease_duration)?;
        let d = Config::with_lease(lease.unwrap_or(Duration::from_secs(30)));
        let ttl = seconds("decoder_kv_blocks_ttl", extra.decoder_kv_blocks_ttl)?.unwrap_or(d.decoder_kv_blocks_ttl);
        let timeout = seconds("push_registration_timeout", extra.push_registration_timeout)?.unwrap_or(ttl);
        let heartbeat_interval =
            seconds("heartbeat_interval", extra.heartbeat_interval)?.unwrap_or(d.heartbeat_interval);
        let lease_extension =
            seconds("heartbeat_lease_extension", extra.heartbeat_lease_extension)?.unwrap_or(d.lease_extension);
        let config = Config {
            mode: extra.mode.unwrap_or(d.mode),
            heartbeat_interval,
            lease_extension,
            decoder_kv_blocks_ttl: ttl,
            push_registration_timeout: timeout,
            push_quarantine: seconds("push_quarantine", extra.push_quarantine)?.unwrap_or(d.push_quarantine),
            kv_load_failure_policy: extra.kv_load_failure_policy.unwrap_or(d.kv_load_failure_policy),
            early_notification_capacity: extra.early_notification_capacity.unwrap_or(d.early_notification_capacity),
            read_safety_margin: seconds("read_safety_margin", extra.read_safety_margin)?
                .unwrap_or_else(|| Config::default_read_margin(heartbeat_interval, lease_extension)),
            descriptors: descriptors(extra.kv_descriptors.as_deref())?,
            num_threads: extra.num_threads,
            ..d
        };
        config.validate()?;
        Ok(config)
    }

    /// The settings of vLLM's whole `kv_transfer_config`, as its users write it, validated.
    ///
    /// The connector's name gives the mode (an extra-config `mode` must agree with it), and
    /// `kv_load_failure_policy` is read at the top level, as vLLM reads it, `fail` when left
    /// out, as in vLLM (the extra config's, kvflow's own key, must agree with it); every other
    /// key is [`Config::from_extra`]'s.
    ///
    /// ```
    /// # #[cfg(feature = "serde")] {
    /// use kv_sched_adapter::{Config, KvTransferConfig, LoadFailurePolicy, Mode};
    /// let json = r#"{"kv_connector": "NixlConnector", "kv_role": "kv_consumer",
    ///                "kv_connector_extra_config": {"kv_lease_duration": 9}}"#;
    /// let transfer: KvTransferConfig = serde_json::from_str(json).unwrap();
    /// let config = Config::from_kv_transfer_config(&transfer).unwrap();
    /// assert_eq!((config.mode, config.kv_load_failure_policy), (Mode::Pull, LoadFailurePolicy::Fail));
    /// assert_eq!(config.read_safety_margin, std::time::Duration::from_millis(2250)); // (6 s - 1.5 s) / 2
    /// # }
    /// ```
    pub fn from_kv_transfer_config(transfer: &KvTransferConfig) -> Result<Config, ConfigError> {
        let extra = &transfer.kv_connector_extra_config;
        let mode = match transfer.kv_connector.as_str() {
            "NixlConnector" | "NixlPullConnector" | "KvflowConnector" => Mode::Pull,
            "NixlPushConnector" | "KvflowPushConnector" => Mode::Push,
            other => return Err(ConfigError::Connector { name: other.to_owned() }),
        };
        if let Some(extra_mode) = extra.mode.filter(|m| *m != mode) {
            return Err(ConfigError::ModeDisagrees { connector: transfer.kv_connector.clone(), mode, extra_mode });
        }
        let policy = transfer.kv_load_failure_policy.unwrap_or(LoadFailurePolicy::Fail);
        if let Some(extra_policy) = extra.kv_load_failure_policy.filter(|p| *p != policy) {
            return Err(ConfigError::PolicyDisagrees {
                policy,
                defaulted: transfer.kv_load_failure_policy.is_none(),
                extra_policy,
            });
        }
        Config::from_extra(&ExtraConfig { mode: Some(mode), kv_load_failure_policy: Some(policy), ..extra.clone() })
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
        // Just before a heartbeat's acknowledgement lands, the newest deadline D knows is the
        // previous beat's, `lease_extension - heartbeat_interval` (less a round trip) away: a
        // margin as long would fence every load scheduled then (issue 30: a fixed 5 s margin
        // fenced a 9 s lease's reads late in each cycle, and every read of shorter leases).
        if self.read_safety_margin >= kv_lease::renewal_slack(self.heartbeat_interval, self.lease_extension) {
            return Err(ConfigError::MarginTooLong {
                read_safety_margin: self.read_safety_margin,
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
    /// `read_safety_margin` (the smaller of 5 s and (extension − interval) / 2): D starts a
    /// read only this long before P's deadline; it must be shorter than extension − interval.
    pub read_safety_margin: Option<f64>,
    /// `kv_descriptors` (`"auto"`): how transfers of whole blocks name their bytes:
    /// `"pairs"` (merged address pairs), `"prepared"` (prepared lists, by index), or `"auto"`,
    /// whichever the transport says is fastest for its memory and backend.
    pub kv_descriptors: Option<String>,
    /// `backends` (`["UCX"]`): NIXL's backends, as vLLM's NixlConnector takes them; kvflow's
    /// NIXL transport runs UCX only, so any other list is an error.
    pub backends: Option<Vec<String>>,
    /// `num_threads` (none: the transport's default; vLLM's NixlConnector sets 4): the size of
    /// NIXL's UCX thread pool ([`Config::num_threads`]).
    pub num_threads: Option<u32>,
    /// NixlConnector's `enforce_handshake_compat`: accepted, not acted on (kvflow's handshake
    /// always checks compatibility).
    pub enforce_handshake_compat: Option<bool>,
    /// NixlConnector's `engine_ttl` (seconds): accepted, not acted on (kvflow forgets a peer
    /// when its side channel closes, or discovery says it is gone).
    pub engine_ttl: Option<f64>,
    /// NixlConnector's `bidirectional_kv_xfer`: accepted, not acted on.
    pub bidirectional_kv_xfer: Option<bool>,
    /// NixlConnector's `kv_recompute_threshold` (tokens): accepted, not acted on.
    pub kv_recompute_threshold: Option<i64>,
}

impl ExtraConfig {
    /// The NixlConnector keys given that kvflow accepts and does not act on.
    pub fn ignored_nixl_keys(&self) -> Vec<&'static str> {
        [
            ("enforce_handshake_compat", self.enforce_handshake_compat.is_some()),
            ("engine_ttl", self.engine_ttl.is_some()),
            ("bidirectional_kv_xfer", self.bidirectional_kv_xfer.is_some()),
            ("kv_recompute_threshold", self.kv_recompute_threshold.is_some()),
        ]
        .into_iter()
        .filter_map(|(key, given)| given.then_some(key))
        .collect()
    }
}

/// vLLM's whole `kv_transfer_config`, as its users write it (`--kv-transfer-config`), for
/// [`Config::from_kv_transfer_config`]: every key vLLM 0.33 has. The keys vLLM reads for
/// itself are accepted and not read; keys it does not know (a newer vLLM's) are ignored and
/// named in [`KvTransferConfig::unknown`].
#[derive(Clone, Default, PartialEq, Debug)]
#[cfg_attr(feature = "serde", derive(serde::Deserialize))]
pub struct KvTransferConfig {
    /// `kv_connector` (required): `NixlConnector`, `NixlPullConnector` or `KvflowConnector`
    /// for pull, `NixlPushConnector` or `KvflowPushConnector` for push.
    pub kv_connector: String,
    /// `kv_role` (none): for the engine, which builds P's or D's side of the connector.
    pub kv_role: Option<KvRole>,
    /// `kv_load_failure_policy` (`"fail"`, as vLLM's), read here as vLLM reads it.
    pub kv_load_failure_policy: Option<LoadFailurePolicy>,
    /// `kv_connector_extra_config` (`{}`): kvflow's keys ([`ExtraConfig`]).
    #[cfg_attr(feature = "serde", serde(default))]
    pub kv_connector_extra_config: ExtraConfig,
    /// `kv_connector_module_path` (none): where vLLM loads the connector from (kvflow's is
    /// `kvflow.vllm`); for the engine.
    pub kv_connector_module_path: Option<String>,
    /// `engine_id` (none: vLLM makes one up): for the engine.
    pub engine_id: Option<String>,
    /// `kv_buffer_device` (vLLM's `"cuda"`): vLLM's; not read.
    pub kv_buffer_device: Option<String>,
    /// `kv_buffer_size` (vLLM's 1e9): vLLM's; not read.
    pub kv_buffer_size: Option<f64>,
    /// `kv_rank` (none): vLLM's; not read.
    pub kv_rank: Option<i64>,
    /// `kv_parallel_size` (vLLM's 1): vLLM's; not read.
    pub kv_parallel_size: Option<i64>,
    /// `kv_ip` (vLLM's `"127.0.0.1"`): vLLM's; not read (kvflow's side channel has its own).
    pub kv_ip: Option<String>,
    /// `kv_port` (vLLM's 14579): vLLM's; not read.
    pub kv_port: Option<i64>,
    /// `enable_permute_local_kv` (vLLM's false): vLLM's; not read.
    pub enable_permute_local_kv: Option<bool>,
    /// The top-level keys given that this list does not name (fields a newer vLLM added):
    /// ignored, so that an upgrade of vLLM does not stop the engine at startup.
    #[cfg_attr(feature = "serde", serde(flatten))]
    pub unknown: UnknownKeys,
}

/// One key of vLLM's `kv_transfer_config`, or of its `kv_connector_extra_config`, as kvflow
/// takes it: a row of the settings tables in `docs/vllm.md`, which `cargo xtask docs` writes
/// from [`TRANSFER_SETTINGS`] and [`EXTRA_SETTINGS`].
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct SettingDoc {
    /// The key, as vLLM's users write it.
    pub key: &'static str,
    /// Its value when left out.
    pub default: &'static str,
    /// What kvflow does with it.
    pub meaning: &'static str,
}

const fn setting(key: &'static str, default: &'static str, meaning: &'static str) -> SettingDoc {
    SettingDoc { key, default, meaning }
}

/// Every key of [`KvTransferConfig`], in its order (a test holds the list to the type's
/// fields, so a key added there without a row here fails it).
pub const TRANSFER_SETTINGS: &[SettingDoc] = &[
    setting("kv_connector", "(required)", "`KvflowConnector` (pull) or `KvflowPushConnector` (push), the classes of `kvflow.vllm`"),
    setting("kv_role", "none", "`kv_producer` (P), `kv_consumer` (D) or `kv_both`: which sides of the connector the engine builds"),
    setting("kv_load_failure_policy", "`fail`", "what D does with a load that failed: `fail` the request, or `recompute` the prompt; the extra config's key, if given, must agree"),
    setting("kv_connector_extra_config", "`{}`", "kvflow's keys, and those of NixlConnector's it takes (the next table)"),
    setting("kv_connector_module_path", "none", "`kvflow.vllm`: where vLLM loads the connector from"),
    setting("engine_id", "vLLM makes one up", "the engine's name on the side channel; vLLM appends `_dp<rank>` per data-parallel engine, and push proxies name P by it"),
    setting("kv_buffer_device", "`cuda`", "vLLM's; not read"),
    setting("kv_buffer_size", "1e9", "vLLM's; not read"),
    setting("kv_rank", "none", "vLLM's; not read"),
    setting("kv_parallel_size", "1", "vLLM's; not read"),
    setting("kv_ip", "`127.0.0.1`", "vLLM's; not read (the side channel's host is `VLLM_NIXL_SIDE_CHANNEL_HOST`)"),
    setting("kv_port", "14579", "vLLM's; not read (the side channel's port is `VLLM_NIXL_SIDE_CHANNEL_PORT`)"),
    setting("enable_permute_local_kv", "false", "vLLM's; not read"),
];

/// Every key of [`ExtraConfig`], in its order (a test holds the list to the type's fields).
pub const EXTRA_SETTINGS: &[SettingDoc] = &[
    setting("mode", "the connector's", "`pull` or `push`; must agree with `kv_connector`"),
    setting("kv_lease_duration", "30 s", "the lease on P's exports: P frees a request's blocks once it runs out without a renewal"),
    setting("heartbeat_interval", "lease / 6", "how often D renews the leases of the requests it waits on"),
    setting("heartbeat_lease_extension", "2 × lease / 3", "a renewal sets a lease's expiry to the later of its own and now plus this; must be longer than `heartbeat_interval`"),
    setting("decoder_kv_blocks_ttl", "480 s", "how long D waits on one request: past it, D stops renewing P's lease and gives the load up under `kv_load_failure_policy`"),
    setting("push_registration_timeout", "`decoder_kv_blocks_ttl`", "D gives up a push that never came, after this"),
    setting("push_quarantine", "2 × lease", "how long D keeps given-up push blocks out of its pool at most, unless P confirms first that no write can come"),
    setting("kv_load_failure_policy", "the top level's", "kvflow's own name for the top-level key; must agree with it"),
    setting("early_notification_capacity", "8192", "P's messages kept while they wait for their export (the oldest evicted)"),
    setting("read_safety_margin", "(extension − interval) / 2, at most 5 s", "D starts a read only this long before P's deadline; must be shorter than extension − interval"),
    setting("kv_descriptors", "`auto`", "how transfers name whole blocks: `pairs` (merged address pairs), `prepared` (prepared lists, by index) or `auto` (the transport's choice)"),
    setting("backends", "`[\"UCX\"]`", "NixlConnector's: NIXL's backends; kvflow runs UCX only, and any other list stops the engine, naming it"),
    setting("num_threads", "the transport's", "NixlConnector's: the size of NIXL's UCX thread pool (NixlConnector sets 4)"),
    setting("enforce_handshake_compat", "none", "NixlConnector's: accepted, not acted on (kvflow's handshake always checks compatibility); one WARNING names it"),
    setting("engine_ttl", "none", "NixlConnector's: accepted, not acted on (kvflow forgets a peer when its side channel closes); one WARNING names it"),
    setting("bidirectional_kv_xfer", "none", "NixlConnector's: accepted, not acted on; one WARNING names it"),
    setting("kv_recompute_threshold", "none", "NixlConnector's: accepted, not acted on; one WARNING names it"),
];

/// The names of keys given and not known, in the order given; their values are dropped unread.
#[derive(Clone, Default, PartialEq, Eq, Debug)]
pub struct UnknownKeys(pub Vec<String>);

#[cfg(feature = "serde")]
impl<'de> serde::Deserialize<'de> for UnknownKeys {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Names;
        impl<'de> serde::de::Visitor<'de> for Names {
            type Value = UnknownKeys;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a map")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<UnknownKeys, A::Error> {
                let mut names = Vec::new();
                while let Some(name) = map.next_key::<String>()? {
                    map.next_value::<serde::de::IgnoredAny>()?;
                    names.push(name);
                }
                Ok(UnknownKeys(names))
            }
        }
        deserializer.deserialize_map(Names)
    }
}

/// What a `kv_transfer_config` gave that kvflow does not act on, for the engine to log.
#[derive(Clone, Default, PartialEq, Eq, Debug)]
pub struct Ignored {
    /// Top-level keys kvflow does not know: log at debug.
    pub top_level: Vec<String>,
    /// NixlConnector's extra-config keys kvflow does not act on: log at WARNING.
    pub nixl_keys: Vec<&'static str>,
}

impl KvTransferConfig {
    /// What this configuration gives that kvflow does not act on.
    pub fn ignored(&self) -> Ignored {
        Ignored { top_level: self.unknown.0.clone(), nixl_keys: self.kv_connector_extra_config.ignored_nixl_keys() }
    }

    /// NixlConnector's older `VLLM_NIXL_ABORT_REQUEST_TIMEOUT` (seconds, the environment's
    /// text in `value`) as the lease, where `kv_lease_duration` is left out: the configuration
    /// to use, and a warning that names the old variable when it was taken. An error names a
    /// value that is not a number of seconds.
    pub fn with_abort_timeout(mut self, value: Option<&str>) -> Result<(Self, Option<String>), ConfigError> {
        let Some(text) = value else { return Ok((self, None)) };
        let seconds: f64 = text
            .trim()
            .parse()
            .map_err(|_| ConfigError::Environment { name: ABORT_TIMEOUT_ENV, value: text.to_owned() })?;
        if let Some(lease) = self.kv_connector_extra_config.kv_lease_duration {
            let note = format!(
                "{ABORT_TIMEOUT_ENV}={text} is not read: kv_connector_extra_config sets kv_lease_duration {lease} s"
            );
            return Ok((self, Some(note)));
        }
        self.kv_connector_extra_config.kv_lease_duration = Some(seconds);
        let note = format!(
            "{ABORT_TIMEOUT_ENV}={text} sets the lease on P's exports (kv_lease_duration {seconds} s): it is \
             NixlConnector's old name; set kv_connector_extra_config's kv_lease_duration instead"
        );
        Ok((self, Some(note)))
    }
}

/// NixlConnector's older environment variable for how long P holds a request's blocks for D.
pub const ABORT_TIMEOUT_ENV: &str = "VLLM_NIXL_ABORT_REQUEST_TIMEOUT";

/// The NIXL backends kvflow runs.
const BACKENDS: [&str; 1] = ["UCX"];

/// The `backends` setting: left out, or UCX alone.
fn backends(value: Option<&[String]>) -> Result<(), ConfigError> {
    match value {
        None => Ok(()),
        Some(given) if given.iter().map(String::as_str).eq(BACKENDS) => Ok(()),
        Some(given) => Err(ConfigError::Backends { given: given.to_vec() }),
    }
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
    /// `kv_connector` names no connector of kvflow's.
    #[error(
        "kv_connector {name:?} is not kvflow's: NixlConnector, NixlPullConnector and KvflowConnector pull, \
         NixlPushConnector and KvflowPushConnector push"
    )]
    Connector {
        /// The name given.
        name: String,
    },
    /// The extra config's `mode` is not the one `kv_connector` names.
    #[error("kv_connector_extra_config has mode {:?}, but kv_connector {connector:?} is {}", extra_mode.as_str(), mode.as_str())]
    ModeDisagrees {
        /// The connector's name.
        connector: String,
        /// Its mode.
        mode: Mode,
        /// The extra config's.
        extra_mode: Mode,
    },
    /// The extra config's `kv_load_failure_policy` is not the one vLLM reads at the top level.
    #[error(
        "kv_connector_extra_config has kv_load_failure_policy {:?}, but kv_transfer_config has {:?}{}; \
         vLLM reads the top level's",
        extra_policy.as_str(),
        policy.as_str(),
        if *defaulted { " (vLLM's default, left out)" } else { "" }
    )]
    PolicyDisagrees {
        /// The top level's.
        policy: LoadFailurePolicy,
        /// Whether the top level left it out.
        defaulted: bool,
        /// The extra config's.
        extra_policy: LoadFailurePolicy,
    },
    /// `backends` names a NIXL backend other than UCX.
    #[error("backends {given:?} is not supported: kvflow runs NIXL's UCX backend only, [\"UCX\"]")]
    Backends {
        /// The backends given.
        given: Vec<String>,
    },
    /// The read margin is as long as what a renewed lease has left when the next heartbeat is
    /// acknowledged, so loads scheduled late in a heartbeat cycle could never read.
    #[error(
        "read_safety_margin {read_safety_margin:?} must be shorter than heartbeat_lease_extension \
         {lease_extension:?} minus heartbeat_interval {heartbeat_interval:?} ({:?}), what a renewed lease \
         has left when the next heartbeat is acknowledged",
        lease_extension.saturating_sub(*heartbeat_interval)
    )]
    MarginTooLong {
        /// The margin.
        read_safety_margin: Duration,
        /// The heartbeat interval.
        heartbeat_interval: Duration,
        /// The extension.
        lease_extension: Duration,
    },
    /// An environment variable's value is not what it must be.
    #[error("{name}={value:?} is not a number of seconds")]
    Environment {
        /// The variable.
        name: &'static str,
        /// Its value.
        value: String,
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
mod tests;
