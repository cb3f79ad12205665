//! The typed, validated in-memory form of a scenario file, as `scenarios/FORMAT.md` specifies it.
//!
//! [`Scenario::from_toml_str`] and [`Scenario::load`] read the file with serde, unknown keys
//! refused and defaults applied: a step's [`Event`] and [`Expect`] deserialize from its keys,
//! the `[cluster]` and `[policy]` tables through private mirrors (some of their defaults follow
//! other keys). What serde cannot check is checked on the parsed document, where every value's
//! place is known: that node names are engines of the cluster with the role their event needs,
//! that steps are in time order, that times are finite and not negative, that sizes and counts
//! are not zero, and that request ids are neither empty nor too long. An error says where: the
//! file (when loaded from one), the step (counted from 1, as a reader counts `[[step]]` tables),
//! the key and the value, and the line and column, e.g. `pull.toml: step 3: do: unknown variant
//! `explode`, expected one of `prefill`, ... (line 14, column 6)`.
//!
//! Checks that need the simulation itself are left to the runner; the one the format names is
//! that a push-mode `arrive` that comes before P's `prefill` must carry `prompt_tokens`.
//!
//! ```
//! use std::time::Duration;
//! use kv_core::{RequestId, Time};
//! use kv_testkit::scenario::{Event, Node, Scenario};
//!
//! let scenario = Scenario::from_toml_str(
//!     r#"
//!     name = "pull: D reads a finished prompt"
//!
//!     [[step]]
//!     at_s = 0.0
//!     do = "prefill"
//!     request = "r1"
//!     prompt_tokens = 64
//!     expect = { p_held_blocks = 4 }
//!     "#,
//! )?;
//! assert_eq!(scenario.policy.heartbeat_interval, Duration::from_secs(5));
//! assert_eq!(scenario.steps[0].at, Time::ZERO);
//! assert_eq!(
//!     scenario.steps[0].event,
//!     Some(Event::Prefill {
//!         request: RequestId::new("r1"),
//!         prompt_tokens: 64,
//!         n: 1,
//!         node: Node::PREFILL0,
//!         consumer: None,
//!     })
//! );
//! assert_eq!(scenario.steps[0].expect.as_ref().and_then(|e| e.p_held_blocks), Some(4));
//!
//! let bad = Scenario::from_toml_str("name = \"x\"\n[[step]]\nat_s = 1\ndo = \"explode\"\n").unwrap_err();
//! assert!(bad.to_string().starts_with("step 1: do: unknown variant `explode`"));
//! assert!(bad.to_string().ends_with("(line 4, column 6)"));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::borrow::Cow;
use std::cmp::Ordering;
use std::collections::BTreeMap;
use std::fmt;
use std::fs;
use std::io;
use std::num::NonZeroU32;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Duration;

use kv_core::id::MAX_REQUEST_ID_LEN;
use kv_core::{EngineId, RequestId, Role, Time};
use kv_sched_adapter::{DecodeState, LoadFailurePolicy, Mode, ReleaseReason};
use serde::de::{DeserializeOwned, Error as _, IgnoredAny};
use serde::{Deserialize, Deserializer};
use toml::de::{DeTable, DeValue, ValueDeserializer};
use toml::Spanned;

/// One scenario file: a cluster, its lifecycle policy, and the steps that drive it.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct Scenario {
    /// The free-text `name`.
    pub name: String,
    /// The `[cluster]` table, defaults applied.
    pub cluster: ClusterSpec,
    /// The `[policy]` table, defaults applied.
    pub policy: PolicySpec,
    /// The `[[step]]` tables in file order, which is non-decreasing time order.
    pub steps: Vec<Step>,
}

impl Scenario {
    /// Parses and validates a scenario from TOML text; errors carry no file name.
    pub fn from_toml_str(text: &str) -> Result<Scenario, ScenarioError> {
        Source { text }.scenario()
    }

    /// Reads, parses and validates the scenario file at `path`; errors name the file.
    pub fn load(path: impl AsRef<Path>) -> Result<Scenario, ScenarioError> {
        let path = path.as_ref();
        let text = fs::read_to_string(path).map_err(|source| ScenarioError::Io { path: path.to_owned(), source })?;
        Scenario::from_toml_str(&text).map_err(|e| e.in_file(path))
    }
}

/// The scenario files that `paths` name: a file as given, a folder as every `*.toml` file under
/// it, recursively, sorted by path.
///
/// Symbolic links to files are followed, links to folders are not (so a cycle cannot loop). A
/// folder with no `*.toml` file under it is an error rather than an empty list, so that a
/// mistyped or missing folder cannot pass as "0 failed".
pub fn scenario_files<P: AsRef<Path>>(paths: &[P]) -> Result<Vec<PathBuf>, ScenarioError> {
    let mut files = Vec::new();
    for path in paths {
        let path = path.as_ref();
        let meta = fs::metadata(path).map_err(io_error(path))?;
        if meta.is_dir() {
            let mut found = Vec::new();
            collect_toml_files(path, &mut found)?;
            if found.is_empty() {
                return Err(ScenarioError::NoScenarios { path: path.to_owned() });
            }
            found.sort();
            files.extend(found);
        } else {
            files.push(path.to_owned());
        }
    }
    Ok(files)
}

fn collect_toml_files(dir: &Path, out: &mut Vec<PathBuf>) -> Result<(), ScenarioError> {
    for entry in fs::read_dir(dir).map_err(io_error(dir))? {
        let entry = entry.map_err(io_error(dir))?;
        let path = entry.path();
        let kind = entry.file_type().map_err(io_error(&path))?;
        if kind.is_dir() {
            collect_toml_files(&path, out)?;
        } else if path.extension().is_some_and(|e| e == "toml")
            && (kind.is_file() || (kind.is_symlink() && fs::metadata(&path).is_ok_and(|m| m.is_file())))
        {
            out.push(path);
        }
    }
    Ok(())
}

fn io_error(path: &Path) -> impl Fn(io::Error) -> ScenarioError + '_ {
    move |source| ScenarioError::Io { path: path.to_owned(), source }
}

/// The `[cluster]` table: the engines and the simulated timing.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct ClusterSpec {
    /// `mode` (pull).
    pub mode: Mode,
    /// `prefillers` (1): engines `prefill0` .. `prefill{prefillers - 1}`; at least 1.
    pub prefillers: u32,
    /// `decoders` (1): engines `decode0` .. `decode{decoders - 1}`; at least 1.
    pub decoders: u32,
    /// `prefill_tp` (1): TP ranks of every prefill engine; at least 1.
    pub prefill_tp: u32,
    /// `decode_tp` (1): TP ranks of every decode engine; at least 1.
    pub decode_tp: u32,
    /// `prefill_block_size` (16): tokens per block on P; at least 1.
    pub prefill_block_size: u32,
    /// `decode_block_size` (16): tokens per block on D; at least 1.
    pub decode_block_size: u32,
    /// `num_kv_heads` (8); at least 1.
    pub num_kv_heads: u32,
    /// `mla` (false): the model uses multi-head latent attention.
    pub mla: bool,
    /// `prefill_num_blocks` (1000): pool size of each prefill engine; at least 1.
    pub prefill_num_blocks: u32,
    /// `decode_num_blocks` (1000): pool size of each decode engine; at least 1.
    pub decode_num_blocks: u32,
    /// `step_interval_ms` (10): every engine runs one scheduler step at every multiple of this;
    /// positive.
    pub step_interval: Duration,
    /// `network_latency_ms` (1): one-way delay of every message.
    pub network_latency: Duration,
    /// `transfer_latency_ms` (5): from posting a read or write to its completion.
    pub transfer_latency: Duration,
    /// `worker_handoff_ms` (= `step_interval`): from P's scheduler finishing a request to P's
    /// transfer workers knowing it.
    pub worker_handoff: Duration,
    /// `clock_skew_ms` (none): per engine, the nanoseconds its clock reads ahead of true time
    /// (negative: behind), as [`Time::shifted`] takes them.
    pub clock_skew: BTreeMap<Node, i64>,
}

impl Default for ClusterSpec {
    fn default() -> Self {
        let step_interval = Duration::from_millis(10);
        ClusterSpec {
            mode: Mode::Pull,
            prefillers: 1,
            decoders: 1,
            prefill_tp: 1,
            decode_tp: 1,
            prefill_block_size: 16,
            decode_block_size: 16,
            num_kv_heads: 8,
            mla: false,
            prefill_num_blocks: 1000,
            decode_num_blocks: 1000,
            step_interval,
            network_latency: Duration::from_millis(1),
            transfer_latency: Duration::from_millis(5),
            worker_handoff: step_interval,
            clock_skew: BTreeMap::new(),
        }
    }
}

impl ClusterSpec {
    /// How many engines of `role` the cluster has.
    pub fn engines(&self, role: Role) -> u32 {
        match role {
            Role::Prefill => self.prefillers,
            Role::Decode => self.decoders,
        }
    }

    /// TP ranks of each engine of `role`.
    pub fn tp_size(&self, role: Role) -> u32 {
        match role {
            Role::Prefill => self.prefill_tp,
            Role::Decode => self.decode_tp,
        }
    }

    /// Tokens per block on engines of `role`.
    pub fn block_size(&self, role: Role) -> u32 {
        match role {
            Role::Prefill => self.prefill_block_size,
            Role::Decode => self.decode_block_size,
        }
    }

    /// Pool size, in blocks, of each engine of `role`.
    pub fn num_blocks(&self, role: Role) -> u32 {
        match role {
            Role::Prefill => self.prefill_num_blocks,
            Role::Decode => self.decode_num_blocks,
        }
    }

    /// Whether `node` is one of the cluster's engines.
    pub fn contains(&self, node: Node) -> bool {
        node.index < self.engines(node.role)
    }

    /// Every engine: the prefill engines in order, then the decode engines.
    pub fn nodes(&self) -> impl Iterator<Item = Node> {
        (0..self.prefillers).map(Node::prefill).chain((0..self.decoders).map(Node::decode))
    }

    fn engine_list(&self) -> String {
        let list = |role: Role| match self.engines(role) {
            1 => format!("{}0", role_name(role)),
            n => format!("{0}0..{0}{1}", role_name(role), n - 1),
        };
        format!("{} and {}", list(Role::Prefill), list(Role::Decode))
    }
}

/// The `[policy]` table: the lifecycle settings every engine runs with.
///
/// Only what would stop the simulation (a zero lease or heartbeat) is refused here; settings
/// that the lifecycle code deems unsound together are for it to refuse, as an engine would.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct PolicySpec {
    /// `kv_lease_duration_s` (30 s); positive.
    pub kv_lease_duration: Duration,
    /// `heartbeat_interval_s` (lease / 6); positive.
    pub heartbeat_interval: Duration,
    /// `lease_extension_s` (2 × lease / 3).
    pub lease_extension: Duration,
    /// `decoder_kv_blocks_ttl_s` (480 s).
    pub decoder_kv_blocks_ttl: Duration,
    /// `push_registration_timeout_s` (= `decoder_kv_blocks_ttl`).
    pub push_registration_timeout: Duration,
    /// `push_quarantine_s` (2 × lease): how long D keeps blocks it gave up on at the push
    /// watchdog, unless P confirms that no write can come.
    pub push_quarantine: Duration,
    /// `kv_load_failure_policy` (recompute).
    pub kv_load_failure_policy: LoadFailurePolicy,
    /// `early_notification_capacity` (8192).
    pub early_notification_capacity: usize,
}

impl PolicySpec {
    /// The defaults of the format for a lease of `kv_lease_duration`.
    pub fn with_lease(kv_lease_duration: Duration) -> Self {
        let decoder_kv_blocks_ttl = Duration::from_secs(480);
        PolicySpec {
            kv_lease_duration,
            heartbeat_interval: kv_lease_duration / 6,
            lease_extension: kv_lease_duration * 2 / 3,
            decoder_kv_blocks_ttl,
            push_registration_timeout: decoder_kv_blocks_ttl,
            push_quarantine: kv_lease_duration * 2,
            kv_load_failure_policy: LoadFailurePolicy::Recompute,
            early_notification_capacity: 8192,
        }
    }
}

impl Default for PolicySpec {
    fn default() -> Self {
        PolicySpec::with_lease(Duration::from_secs(30))
    }
}

/// One engine of the cluster, as scenario files name it: `prefill0`, `decode1`, ...
///
/// Ordered prefill engines first, then by index. It deserializes from its name; whether the
/// cluster has it is for the reader of the file to check.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Deserialize)]
#[serde(try_from = "String")]
pub struct Node {
    /// Prefill or decode.
    pub role: Role,
    /// The number after the role's name.
    pub index: u32,
}

impl Node {
    /// `prefill0`, where P-side expectations look unless told otherwise.
    pub const PREFILL0: Node = Node { role: Role::Prefill, index: 0 };
    /// `decode0`, where D-side expectations look unless told otherwise.
    pub const DECODE0: Node = Node { role: Role::Decode, index: 0 };

    /// `prefill{index}`.
    pub const fn prefill(index: u32) -> Node {
        Node { role: Role::Prefill, index }
    }

    /// `decode{index}`.
    pub const fn decode(index: u32) -> Node {
        Node { role: Role::Decode, index }
    }

    /// The node a name like `prefill0` or `decode12` denotes, whether or not a cluster has it;
    /// `None` for anything else (`Prefill0`, `decode01`, `decode`).
    pub fn parse(name: &str) -> Option<Node> {
        let (role, digits) = if let Some(digits) = name.strip_prefix("prefill") {
            (Role::Prefill, digits)
        } else if let Some(digits) = name.strip_prefix("decode") {
            (Role::Decode, digits)
        } else {
            return None;
        };
        let canonical = !digits.is_empty()
            && digits.bytes().all(|b| b.is_ascii_digit())
            && (digits.len() == 1 || !digits.starts_with('0'));
        if !canonical {
            return None;
        }
        digits.parse().ok().map(|index| Node { role, index })
    }

    /// The engine's id: its name.
    pub fn engine_id(&self) -> EngineId {
        EngineId::new(self.to_string())
    }
}

impl TryFrom<String> for Node {
    type Error = String;

    fn try_from(name: String) -> Result<Node, String> {
        Node::parse(&name).ok_or_else(|| format!("{name:?} is not an engine name"))
    }
}

impl fmt::Display for Node {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", role_name(self.role), self.index)
    }
}

impl fmt::Debug for Node {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl Ord for Node {
    fn cmp(&self, other: &Self) -> Ordering {
        let key = |n: &Node| (n.role == Role::Decode, n.index);
        key(self).cmp(&key(other))
    }
}

impl PartialOrd for Node {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

fn role_name(role: Role) -> &'static str {
    match role {
        Role::Prefill => "prefill",
        Role::Decode => "decode",
    }
}

/// One `[[step]]`: at `at`, run `event` (if any), then check `expect` (if any).
///
/// A step with neither only moves time.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct Step {
    /// `at_s`: the simulated time of the step; never before the previous step's.
    pub at: Time,
    /// `do` and its fields; `None` when the step has no `do`.
    pub event: Option<Event>,
    /// `expect`; `None` when the step has none (an empty table is `Some`, checking nothing).
    pub expect: Option<Expect>,
}

/// An event (`do`) with its fields, defaults applied and nodes checked against the cluster.
///
/// serde reads it from `{ <do> = { the step's other keys } }`; [`Scenario::from_toml_str`]
/// checks first what serde cannot: nodes, request ids, times and counts.
#[derive(Clone, PartialEq, Eq, Debug, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Event {
    /// `prefill`: P runs the prompt and finishes it; its blocks are exported under a lease.
    Prefill {
        /// `request` (required).
        request: RequestId,
        /// `prompt_tokens` (required, at least 1).
        prompt_tokens: u64,
        /// `n` (1): with `n > 1`, P registers the siblings `0_r` .. `{n-1}_r`.
        #[serde(default = "one")]
        n: u32,
        /// `node` (prefill0): a prefill engine.
        #[serde(default = "prefill0")]
        node: Node,
        /// `consumer` (none): the decode engine the router has already chosen; P binds the
        /// export to it at once.
        consumer: Option<Node>,
    },
    /// `arrive`: the request, carrying P's transfer parameters, enters D's waiting queue.
    Arrive {
        /// `request` (required): D's id; may be a sibling id.
        request: RequestId,
        /// `node` (decode0): a decode engine.
        #[serde(default = "decode0")]
        node: Node,
        /// `from` (prefill0): a prefill engine.
        #[serde(default = "prefill0")]
        from: Node,
        /// `remote_request` (= `request`): P's id for the request.
        remote_request: RequestId,
        /// `prompt_tokens` (P's, if P has run it; at least 1 when given). The runner checks
        /// that a push-mode `arrive` before P's `prefill` has it.
        prompt_tokens: Option<u64>,
    },
    /// `schedule`: D allocates blocks and starts the load.
    Schedule {
        /// `request` (required).
        request: RequestId,
        /// `node` (decode0): a decode engine.
        #[serde(default = "decode0")]
        node: Node,
        /// `prefix_hit` (false): D already has the prompt cached and only tells P it is done.
        #[serde(default)]
        prefix_hit: bool,
        /// `cached_tokens` (0): the prompt's first tokens that D's own prefix cache holds, a
        /// whole number of D blocks; D loads only the blocks after them.
        #[serde(default)]
        cached_tokens: u64,
    },
    /// `reject`: the request reaches D, and D rejects it before admission.
    Reject {
        /// `request` (required).
        request: RequestId,
        /// `node` (decode0): a decode engine.
        #[serde(default = "decode0")]
        node: Node,
        /// `from` (prefill0): a prefill engine.
        #[serde(default = "prefill0")]
        from: Node,
        /// `remote_request` (= `request`): P's id for the request.
        remote_request: RequestId,
    },
    /// `abort`: the router aborts the request on an engine.
    Abort {
        /// `request` (required).
        request: RequestId,
        /// `node` (required, since the format gives no default): any engine.
        node: Node,
    },
    /// `crash`: the engine stops, sending and answering nothing.
    Crash {
        /// `node` (required): any engine.
        node: Node,
        /// `detect` (false): its peers see its side channel close.
        #[serde(default)]
        detect: bool,
    },
    /// `restart`: the engine comes back empty, under a new registration generation.
    Restart {
        /// `node` (required): any engine.
        node: Node,
    },
    /// `partition`: every message between `a` and `b`, both ways, is dropped until `until`.
    Partition {
        /// `a` (required): any engine.
        a: Node,
        /// `b` (required): any engine other than `a`.
        b: Node,
        /// `until_s` (required): not before the step's `at_s`.
        #[serde(rename = "until_s", deserialize_with = "secs_time")]
        until: Time,
    },
    /// `delay`: every message from `a` to `b` sent before `until` arrives `by` later.
    Delay {
        /// `a` (required): the sender.
        a: Node,
        /// `b` (required): the receiver, other than `a`.
        b: Node,
        /// `by_ms` (required).
        #[serde(rename = "by_ms", deserialize_with = "millis")]
        by: Duration,
        /// `until_s` (required): not before the step's `at_s`.
        #[serde(rename = "until_s", deserialize_with = "secs_time")]
        until: Time,
    },
    /// `fail_transfer`: the next read or write that `node` posts for `request` fails.
    FailTransfer {
        /// `request` (required).
        request: RequestId,
        /// `node` (required): the engine that posts transfers in this mode, a decode engine in
        /// pull mode and a prefill engine in push mode.
        node: Node,
        /// `from_block` (none): a D block index of the prompt; the blocks before it arrive
        /// intact and only those from it on fail.
        from_block: Option<u32>,
    },
    /// `garbage`: `from` sends `to` a notification whose payload is `bytes`.
    Garbage {
        /// `from` (required): any engine.
        from: Node,
        /// `to` (required): any engine other than `from`.
        to: Node,
        /// `bytes` (required): the string's UTF-8 bytes.
        #[serde(deserialize_with = "utf8")]
        bytes: Vec<u8>,
    },
    /// `wait`: nothing; the step only moves time and checks.
    Wait,
    /// `pause`: the engine stops for a while, as under SIGSTOP, with its side channel open.
    Pause {
        /// `node` (required): any engine.
        node: Node,
        /// `for_s` (required, positive): how long it stays stopped.
        #[serde(rename = "for_s", deserialize_with = "secs")]
        for_: Duration,
    },
    /// `forge`: `from` sends `to` a well-formed message about `to`'s export `request`, as if it
    /// were that export's consumer.
    Forge {
        /// `from` (required): a decode engine.
        from: Node,
        /// `to` (required): a prefill engine.
        to: Node,
        /// `message` (required).
        message: ForgedMessage,
        /// `request` (required): the export's id on `to`.
        request: RequestId,
        /// `consumers` (1): the count a forged completion carries.
        #[serde(default = "one")]
        consumers: u32,
    },
    /// `intrude`: a peer without the cluster's key opens `to`'s side channel claiming to be
    /// `claimed`, tries the handshake, and hangs up.
    Intrude {
        /// `to` (required): any engine.
        to: Node,
        /// `as` (required): an engine of the cluster other than `to`.
        #[serde(rename = "as")]
        claimed: Node,
    },
}

impl Event {
    /// The event's `do` name.
    pub fn name(&self) -> &'static str {
        match self {
            Event::Prefill { .. } => "prefill",
            Event::Arrive { .. } => "arrive",
            Event::Schedule { .. } => "schedule",
            Event::Reject { .. } => "reject",
            Event::Abort { .. } => "abort",
            Event::Crash { .. } => "crash",
            Event::Restart { .. } => "restart",
            Event::Partition { .. } => "partition",
            Event::Delay { .. } => "delay",
            Event::FailTransfer { .. } => "fail_transfer",
            Event::Garbage { .. } => "garbage",
            Event::Wait => "wait",
            Event::Pause { .. } => "pause",
            Event::Forge { .. } => "forge",
            Event::Intrude { .. } => "intrude",
        }
    }
}

pub use crate::cluster::ForgedMessage;

/// A step's `expect`: what must hold once everything due at the step's time has run.
///
/// A key left out is `None` or an empty map, and is not checked.
#[derive(Clone, PartialEq, Eq, Debug, Deserialize)]
#[serde(default, deny_unknown_fields, expecting = "a table")]
pub struct Expect {
    /// `p_held_blocks`: logical blocks prefill0 holds for export.
    pub p_held_blocks: Option<u64>,
    /// `p_held_blocks_on`: the same, on the named prefill engines.
    pub p_held_blocks_on: BTreeMap<Node, u64>,
    /// `p_pending`: exports on prefill0 not yet released.
    pub p_pending: Option<u64>,
    /// `p_released`: request id to the reason P released its export.
    pub p_released: BTreeMap<RequestId, ReleaseReason>,
    /// `d_held_blocks`: logical blocks decode0 holds for loading or push-waiting requests.
    pub d_held_blocks: Option<u64>,
    /// `d_held_blocks_on`: the same, on the named decode engines.
    pub d_held_blocks_on: BTreeMap<Node, u64>,
    /// `d_state`: request id to its state on [`Expect::d_node`].
    pub d_state: BTreeMap<RequestId, DecodeState>,
    /// `d_blocks_read`: request id to the logical D blocks [`Expect::d_node`] loaded for it.
    pub d_blocks_read: BTreeMap<RequestId, u64>,
    /// `d_tokens_kept`: request id to the tokens of intact KV that [`Expect::d_node`] kept
    /// from a load that failed part-way.
    pub d_tokens_kept: BTreeMap<RequestId, u64>,
    /// Where `d_state`, `d_blocks_read` and `d_tokens_kept` look: the step's `node` when it
    /// has one, else decode0. Always a decode engine of the cluster (a step whose `node` is a
    /// prefill engine cannot check them).
    #[serde(skip)]
    pub d_node: Node,
    /// `notifications_after_expiry`: completions P received for exports it no longer had.
    pub notifications_after_expiry: Option<u64>,
    /// `ignored_messages`: malformed, unknown or unauthorised messages dropped, on all engines.
    pub ignored_messages: Option<u64>,
    /// `corrupt_reads`: loads whose bytes did not match what P computed.
    pub corrupt_reads: Option<u64>,
    /// `written_after_free`: writes that landed in blocks their engine had given back.
    pub written_after_free: Option<u64>,
}

impl Default for Expect {
    fn default() -> Self {
        Expect {
            p_held_blocks: None,
            p_held_blocks_on: BTreeMap::new(),
            p_pending: None,
            p_released: BTreeMap::new(),
            d_held_blocks: None,
            d_held_blocks_on: BTreeMap::new(),
            d_state: BTreeMap::new(),
            d_blocks_read: BTreeMap::new(),
            d_tokens_kept: BTreeMap::new(),
            d_node: Node::DECODE0,
            notifications_after_expiry: None,
            ignored_messages: None,
            corrupt_reads: None,
            written_after_free: None,
        }
    }
}

impl Expect {
    /// Whether the expectation checks nothing (`expect = {}`).
    pub fn is_empty(&self) -> bool {
        *self == Expect { d_node: self.d_node, ..Expect::default() }
    }
}

/// Where in a scenario an error is. It displays as a prefix naming the file and the step:
/// `path: step 3: `, `step 3: `, or nothing.
#[derive(Clone, PartialEq, Eq, Debug, Default)]
pub struct Location {
    /// The scenario file.
    pub file: Option<PathBuf>,
    /// The `[[step]]` table, counted from 1 in file order.
    pub step: Option<usize>,
    /// The key the error is about, dotted from the step (`until_s`, `expect.d_state.r1`) or,
    /// outside steps, from the top of the file (`cluster.mode`).
    pub key: Option<String>,
    /// The line and the column, both counted from 1, where the text the error is about starts.
    pub line_column: Option<(usize, usize)>,
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(file) = &self.file {
            write!(f, "{}: ", file.display())?;
        }
        if let Some(step) = self.step {
            write!(f, "step {step}: ")?;
        }
        Ok(())
    }
}

/// Why a scenario, or the list of scenario files, could not be had.
#[derive(Debug, thiserror::Error)]
pub enum ScenarioError {
    /// A file or folder could not be read.
    #[error("cannot read {}: {source}", path.display())]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// What the operating system said.
        #[source]
        source: io::Error,
    },
    /// A folder given to [`scenario_files`] holds no `*.toml` file.
    #[error("no *.toml scenario file under {}", path.display())]
    NoScenarios {
        /// The folder.
        path: PathBuf,
    },
    /// The text is not valid TOML.
    #[error("{location}invalid TOML: {}{message}", match location.line_column {
        Some((line, column)) => format!("line {line}, column {column}: "),
        None => String::new(),
    })]
    Syntax {
        /// The file and the line and column, where known (no step: TOML syntax is checked
        /// before steps are told apart).
        location: Location,
        /// What the TOML parser said.
        message: String,
    },
    /// The text is TOML, but not a valid scenario.
    #[error("{location}{message}{}", match location.line_column {
        Some((line, column)) => format!(" (line {line}, column {column})"),
        None => String::new(),
    })]
    Invalid {
        /// The file, step, key, line and column, where there are.
        location: Location,
        /// What is wrong, naming the key and the value.
        message: String,
    },
}

impl ScenarioError {
    /// Where in the scenario the error is, for syntax and validity errors.
    pub fn location(&self) -> Option<&Location> {
        match self {
            ScenarioError::Syntax { location, .. } | ScenarioError::Invalid { location, .. } => Some(location),
            ScenarioError::Io { .. } | ScenarioError::NoScenarios { .. } => None,
        }
    }

    fn in_file(mut self, path: &Path) -> Self {
        if let ScenarioError::Syntax { location, .. } | ScenarioError::Invalid { location, .. } = &mut self {
            location.file = Some(path.to_owned());
        }
        self
    }
}

// ---- reading the file ----

/// A name with where it was written.
type Name = Spanned<String>;

/// A number of seconds or milliseconds, integer or float, with where it was written.
type Number = Spanned<f64>;

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a table")]
struct FileHead {
    name: String,
    #[serde(default)]
    cluster: ClusterFile,
    #[serde(default)]
    policy: PolicyFile,
    /// Taken out before and read step by step; declared so that an unknown key's message lists it.
    #[serde(default, rename = "step")]
    _steps: IgnoredAny,
}

/// `[cluster]`; a key left out takes [`ClusterSpec::default`]'s value.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, expecting = "a table")]
struct ClusterFile {
    mode: Option<Mode>,
    prefillers: Option<NonZeroU32>,
    decoders: Option<NonZeroU32>,
    prefill_tp: Option<NonZeroU32>,
    decode_tp: Option<NonZeroU32>,
    prefill_block_size: Option<NonZeroU32>,
    decode_block_size: Option<NonZeroU32>,
    num_kv_heads: Option<NonZeroU32>,
    mla: Option<bool>,
    prefill_num_blocks: Option<NonZeroU32>,
    decode_num_blocks: Option<NonZeroU32>,
    step_interval_ms: Option<Number>,
    network_latency_ms: Option<Number>,
    transfer_latency_ms: Option<Number>,
    worker_handoff_ms: Option<Number>,
    #[serde(default)]
    clock_skew_ms: BTreeMap<Name, Number>,
}

/// `[policy]`; a key left out takes [`PolicySpec::with_lease`]'s value.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, expecting = "a table")]
struct PolicyFile {
    kv_lease_duration_s: Option<Number>,
    heartbeat_interval_s: Option<Number>,
    lease_extension_s: Option<Number>,
    decoder_kv_blocks_ttl_s: Option<Number>,
    push_registration_timeout_s: Option<Number>,
    push_quarantine_s: Option<Number>,
    kv_load_failure_policy: Option<LoadFailurePolicy>,
    early_notification_capacity: Option<usize>,
}

fn one() -> u32 {
    1
}

fn prefill0() -> Node {
    Node::PREFILL0
}

fn decode0() -> Node {
    Node::DECODE0
}

const NANOS_PER_SEC: f64 = 1e9;
const NANOS_PER_MS: f64 = 1e6;

/// `x` units of `nanos_per_unit` nanoseconds, when that is a non-negative, finite number of
/// nanoseconds that fits a `u64`.
fn nanos(x: f64, nanos_per_unit: f64) -> Option<u64> {
    let nanos = (x * nanos_per_unit).round();
    // 2^64 as f64 is exact; anything at or above it does not fit.
    (x.is_finite() && x >= 0.0 && nanos < 18_446_744_073_709_551_616.0).then_some(nanos as u64)
}

fn units<'de, D: Deserializer<'de>>(d: D, nanos_per_unit: f64) -> Result<Duration, D::Error> {
    let x = f64::deserialize(d)?;
    let nanos = nanos(x, nanos_per_unit).ok_or_else(|| D::Error::custom(format!("{x} is no duration")))?;
    Ok(Duration::from_nanos(nanos))
}

fn secs<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    units(d, NANOS_PER_SEC)
}

fn millis<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    units(d, NANOS_PER_MS)
}

fn secs_time<'de, D: Deserializer<'de>>(d: D) -> Result<Time, D::Error> {
    units(d, NANOS_PER_SEC).map(|d| Time::from_nanos(d.as_nanos() as u64))
}

fn utf8<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
    String::deserialize(d).map(String::into_bytes)
}

/// The role a node key of an event needs, and what a wrong-role message ends with.
fn role_of(event: &str, key: &str, mode: Mode) -> (Option<Role>, String) {
    let context = format!(" for do = {event:?}");
    match (event, key) {
        ("prefill", "node") | ("arrive" | "reject", "from") | ("forge", "to") => (Some(Role::Prefill), context),
        ("prefill", "consumer") | ("arrive" | "schedule" | "reject", "node") | ("forge", "from") => {
            (Some(Role::Decode), context)
        }
        // Only the side that posts transfers can have one fail: D's reads, or P's writes.
        ("fail_transfer", "node") => match mode {
            Mode::Pull => (Some(Role::Decode), format!("{context} in pull mode")),
            Mode::Push => (Some(Role::Prefill), format!("{context} in push mode")),
        },
        _ => (None, context),
    }
}

/// The scenario's text, which every error is placed in.
struct Source<'a> {
    text: &'a str,
}

/// Where a span of the text falls in the document.
struct Place {
    step: Option<usize>,
    /// The keys from the step (or the top of the file) down to the one the span is in.
    keys: Vec<String>,
    /// Whether the span is the last key itself rather than its value.
    on_key: bool,
    line_column: Option<(usize, usize)>,
}

impl<'a> Source<'a> {
    fn scenario(&self) -> Result<Scenario, ScenarioError> {
        let mut root = DeTable::parse(self.text).map_err(|e| self.syntax_error(&e))?;
        let steps = root.get_mut().remove("step");
        let head: FileHead = self.de(Spanned::new(root.span(), DeValue::Table(root.into_inner())), None)?;
        let cluster = self.cluster(head.cluster)?;
        let policy = self.policy(head.policy)?;
        let items = match steps.map(|s| (s.span(), s.into_inner())) {
            None => Vec::new(),
            Some((_, DeValue::Array(items))) => items.into_iter().collect(),
            Some((span, _)) => {
                let text = self.text(&span);
                return Err(self.about(span, format!("must be an array of tables ([[step]]), not {text}")));
            }
        };
        let mut steps: Vec<Step> = Vec::with_capacity(items.len());
        let mut previous = None;
        for item in items {
            let (step, at) = self.step(item, &cluster, previous)?;
            steps.push(step);
            previous = Some(at);
        }
        Ok(Scenario { name: head.name, cluster, policy, steps })
    }

    fn cluster(&self, file: ClusterFile) -> Result<ClusterSpec, ScenarioError> {
        let d = ClusterSpec::default();
        let count = |value: Option<NonZeroU32>, default: u32| value.map_or(default, NonZeroU32::get);
        let millis = |value: &Option<Number>, default: Duration| {
            value.as_ref().map_or(Ok(default), |v| self.duration(v, NANOS_PER_MS))
        };
        let step_interval = millis(&file.step_interval_ms, d.step_interval)?;
        if let (Some(value), true) = (&file.step_interval_ms, step_interval.is_zero()) {
            return Err(self.about(value.span(), format!("must be positive, not {}", self.text(&value.span()))));
        }
        let mut cluster = ClusterSpec {
            mode: file.mode.unwrap_or(d.mode),
            prefillers: count(file.prefillers, d.prefillers),
            decoders: count(file.decoders, d.decoders),
            prefill_tp: count(file.prefill_tp, d.prefill_tp),
            decode_tp: count(file.decode_tp, d.decode_tp),
            prefill_block_size: count(file.prefill_block_size, d.prefill_block_size),
            decode_block_size: count(file.decode_block_size, d.decode_block_size),
            num_kv_heads: count(file.num_kv_heads, d.num_kv_heads),
            mla: file.mla.unwrap_or(d.mla),
            prefill_num_blocks: count(file.prefill_num_blocks, d.prefill_num_blocks),
            decode_num_blocks: count(file.decode_num_blocks, d.decode_num_blocks),
            step_interval,
            network_latency: millis(&file.network_latency_ms, d.network_latency)?,
            transfer_latency: millis(&file.transfer_latency_ms, d.transfer_latency)?,
            worker_handoff: millis(&file.worker_handoff_ms, step_interval)?,
            clock_skew: BTreeMap::new(),
        };
        for (name, skew) in &file.clock_skew_ms {
            let node = self.node(name.get_ref(), name.span(), &cluster, None, "")?;
            let nanos = (*skew.get_ref() * NANOS_PER_MS).round();
            // ±2^63 as f64 is exact; anything beyond does not fit an i64.
            if !(-9_223_372_036_854_775_808.0..9_223_372_036_854_775_808.0).contains(&nanos) {
                return Err(self.about(skew.span(), format!("{} is out of range", self.text(&skew.span()))));
            }
            cluster.clock_skew.insert(node, nanos as i64);
        }
        Ok(cluster)
    }

    fn policy(&self, file: PolicyFile) -> Result<PolicySpec, ScenarioError> {
        let secs = |value: &Option<Number>| value.as_ref().map(|v| self.duration(v, NANOS_PER_SEC)).transpose();
        let positive = |value: &Option<Number>, got: Duration, note: &str| match value {
            Some(value) if got.is_zero() => {
                Err(self.about(value.span(), format!("must be positive, not {}{note}", self.text(&value.span()))))
            }
            _ => Ok(got),
        };
        let lease = secs(&file.kv_lease_duration_s)?.unwrap_or(Duration::from_secs(30));
        let d = PolicySpec::with_lease(positive(&file.kv_lease_duration_s, lease, "")?);
        let heartbeat = secs(&file.heartbeat_interval_s)?.unwrap_or(d.heartbeat_interval);
        // Zero would have D renew forever without time moving.
        let note = format!(" (the default is kv_lease_duration_s / 6 = {:?})", d.heartbeat_interval);
        let ttl = secs(&file.decoder_kv_blocks_ttl_s)?.unwrap_or(d.decoder_kv_blocks_ttl);
        Ok(PolicySpec {
            heartbeat_interval: positive(&file.heartbeat_interval_s, heartbeat, &note)?,
            lease_extension: secs(&file.lease_extension_s)?.unwrap_or(d.lease_extension),
            decoder_kv_blocks_ttl: ttl,
            push_registration_timeout: secs(&file.push_registration_timeout_s)?.unwrap_or(ttl),
            push_quarantine: secs(&file.push_quarantine_s)?.unwrap_or(d.push_quarantine),
            kv_load_failure_policy: file.kv_load_failure_policy.unwrap_or(d.kv_load_failure_policy),
            early_notification_capacity: file.early_notification_capacity.unwrap_or(d.early_notification_capacity),
            ..d
        })
    }

    /// Reads one `[[step]]`; `previous` is the previous step's time and where it was written.
    fn step(
        &self,
        item: Spanned<DeValue<'a>>,
        cluster: &ClusterSpec,
        previous: Option<(Time, Range<usize>)>,
    ) -> Result<(Step, (Time, Range<usize>)), ScenarioError> {
        let span = item.span();
        let DeValue::Table(mut fields) = item.into_inner() else {
            let text = self.text(&span);
            return Err(self.about(span, format!("must be a table ([[step]]), not {text}")));
        };
        // `at_s`, `do` and `expect` are every step's; the other keys are its event's.
        let name: Option<Name> = fields.remove("do").map(|v| self.de(v, None)).transpose()?;
        let expect = fields.remove("expect");
        let at_s: Number = match fields.remove("at_s") {
            Some(value) => self.de(value, None)?,
            None => return Err(self.about(span, "at_s is missing")),
        };
        let at = Time::from_nanos(self.duration(&at_s, NANOS_PER_SEC)?.as_nanos() as u64);
        if let Some((previous, previous_span)) = &previous {
            if at < *previous {
                let (text, before) = (self.text(&at_s.span()), self.text(previous_span));
                return Err(self.about(at_s.span(), format!("{text} is earlier than the previous step's {before}")));
            }
        }

        let kind = name.as_ref().map_or("wait", |n| n.get_ref().as_str());
        self.check_event(kind, &fields, cluster, (at, &at_s))?;
        // Already checked to name an engine of the cluster.
        let step_node = fields.get("node").and_then(|v| Some((Node::parse(v.get_ref().as_str()?)?, v.span())));
        if kind == "wait" {
            // A step that only waits (or has no `do`) may name the node its expectations read.
            fields.remove("node");
            if let Some((key, _)) = fields.iter().next() {
                let context = name.as_ref().map_or("a step without do".to_owned(), |_| "do = \"wait\"".to_owned());
                let message =
                    format!("unknown key {:?} for {context} (expected one of: at_s, do, expect, node)", key.get_ref());
                return Err(self.invalid(key.span(), |_, _| message));
            }
        } else if matches!(kind, "arrive" | "reject") && !fields.contains_key("remote_request") {
            if let Some(request) = fields.get("request").cloned() {
                fields.insert(Spanned::new(request.span(), Cow::Borrowed("remote_request")), request);
            }
        }
        let mut tagged = DeTable::new();
        let tag = name.as_ref().map_or(span.clone(), Spanned::span);
        tagged
            .insert(Spanned::new(tag, Cow::Owned(kind.to_owned())), Spanned::new(span.clone(), DeValue::Table(fields)));
        let event: Event = self.de(Spanned::new(span, DeValue::Table(tagged)), Some(&format!("do = {kind:?}")))?;
        let expect = expect.map(|e| self.expect(e, cluster, step_node)).transpose()?;
        let event = name.map(|_| event);
        Ok((Step { at, event, expect }, (at, at_s.span())))
    }

    /// What serde cannot check of an event's keys: that nodes are engines of the cluster with
    /// the role the event needs, that request ids fit, and that times and counts make sense.
    fn check_event(
        &self,
        event: &str,
        fields: &DeTable<'_>,
        cluster: &ClusterSpec,
        (at, at_s): (Time, &Number),
    ) -> Result<(), ScenarioError> {
        for (key, value) in fields.iter() {
            let (key, span) = (key.get_ref().as_ref(), value.span());
            let text = self.text(&span);
            match (key, value.get_ref()) {
                ("node" | "from" | "to" | "a" | "b" | "consumer" | "as", DeValue::String(name)) => {
                    let (role, context) = role_of(event, key, cluster.mode);
                    self.node(name, span, cluster, role, &context)?;
                }
                ("request" | "remote_request", DeValue::String(id)) => self.request(id, span)?,
                (_, DeValue::Integer(_) | DeValue::Float(_)) => {
                    let x: Number = self.de(value.clone(), None)?;
                    match key {
                        "until_s" | "for_s" | "by_ms" => {
                            let per_unit = if key == "by_ms" { NANOS_PER_MS } else { NANOS_PER_SEC };
                            let d = self.duration(&x, per_unit)?;
                            if key == "until_s" && Time::from_nanos(d.as_nanos() as u64) < at {
                                let at_text = self.text(&at_s.span());
                                return Err(self.about(span, format!("{text} is earlier than at_s {at_text}")));
                            }
                            if key == "for_s" && d.is_zero() {
                                return Err(self.about(span, format!("must be positive, not {text}")));
                            }
                        }
                        "prompt_tokens" | "n" if *x.get_ref() < 1.0 => {
                            return Err(self.about(span, format!("must be at least 1, not {text}")));
                        }
                        "cached_tokens"
                            if *x.get_ref() >= 0.0 && *x.get_ref() % f64::from(cluster.decode_block_size) != 0.0 =>
                        {
                            let block = cluster.decode_block_size;
                            let what =
                                format!("must be a whole number of D blocks (decode_block_size = {block}), not {text}");
                            return Err(self.about(span, what));
                        }
                        _ => {}
                    }
                }
                _ => {}
            }
        }
        for (a, b) in [("a", "b"), ("from", "to"), ("to", "as")] {
            let name = |key| fields.get(key).and_then(|v| Some((v.get_ref().as_str()?, v.span())));
            if let (Some((a_name, _)), Some((b_name, span))) = (name(a), name(b)) {
                if a_name == b_name {
                    let message = format!("{a} and {b} are both {a_name:?} for do = {event:?}; they must differ");
                    return Err(self.invalid(span, |_, _| message));
                }
            }
        }
        Ok(())
    }

    /// Reads a step's `expect`; `step_node` is the step's `node` and where it was written.
    fn expect(
        &self,
        value: Spanned<DeValue<'a>>,
        cluster: &ClusterSpec,
        step_node: Option<(Node, Range<usize>)>,
    ) -> Result<Expect, ScenarioError> {
        // serde says what is wrong with an `expect` that is no table, or with a map that is not one.
        for (key, map) in value.get_ref().as_table().into_iter().flatten() {
            for (name, _) in map.get_ref().as_table().into_iter().flatten() {
                let (name, span) = (name.get_ref().as_ref(), name.span());
                let role = match key.get_ref().as_ref() {
                    "p_held_blocks_on" => Role::Prefill,
                    "d_held_blocks_on" => Role::Decode,
                    "p_released" | "d_state" | "d_blocks_read" | "d_tokens_kept" => {
                        self.request(name, span)?;
                        continue;
                    }
                    _ => continue,
                };
                self.node(name, span, cluster, Some(role), "")?;
            }
        }
        let mut expect: Expect = self.de(value, None)?;
        let on_d = [
            ("d_state", expect.d_state.is_empty()),
            ("d_blocks_read", expect.d_blocks_read.is_empty()),
            ("d_tokens_kept", expect.d_tokens_kept.is_empty()),
        ];
        match step_node {
            Some((node, _)) if node.role == Role::Decode => expect.d_node = node,
            Some((node, span)) => {
                if let Some((key, _)) = on_d.iter().find(|(_, empty)| !empty) {
                    let message = format!(
                        "expect.{key} is read on the step's node, and {node} is not a decode engine; \
                         check {key} in a step of its own"
                    );
                    return Err(self.invalid(span, |_, _| message));
                }
            }
            None => {}
        }
        Ok(expect)
    }

    /// Resolves an engine name written at `span` against `cluster`; `role` is the role its use
    /// needs, `context` ends a wrong-role message.
    fn node(
        &self,
        name: &str,
        span: Range<usize>,
        cluster: &ClusterSpec,
        role: Option<Role>,
        context: &str,
    ) -> Result<Node, ScenarioError> {
        let Some(node) = Node::parse(name) else {
            let what = format!("{name:?} is not an engine name (this cluster has {})", cluster.engine_list());
            return Err(self.about(span, what));
        };
        if !cluster.contains(node) {
            let count = match node.role {
                Role::Prefill => "prefillers",
                Role::Decode => "decoders",
            };
            return Err(self.about(span, format!("{name:?} does not exist ({count} = {})", cluster.engines(node.role))));
        }
        match role {
            Some(role) if role != node.role => {
                Err(self.about(span, format!("{name:?} must be a {} engine{context}", role_name(role))))
            }
            _ => Ok(node),
        }
    }

    fn request(&self, id: &str, span: Range<usize>) -> Result<(), ScenarioError> {
        if id.is_empty() {
            return Err(self.about(span, "must not be empty"));
        }
        if id.len() > MAX_REQUEST_ID_LEN {
            return Err(self.about(span, format!("is {} bytes long (at most {MAX_REQUEST_ID_LEN})", id.len())));
        }
        Ok(())
    }

    /// A non-negative, finite number of units of `nanos_per_unit` nanoseconds.
    fn duration(&self, value: &Number, nanos_per_unit: f64) -> Result<Duration, ScenarioError> {
        let (x, span) = (*value.get_ref(), value.span());
        match nanos(x, nanos_per_unit) {
            Some(nanos) => Ok(Duration::from_nanos(nanos)),
            None if !x.is_finite() => Err(self.about(span, format!("must be finite, not {x:?}"))),
            None if x < 0.0 => Err(self.about(span.clone(), format!("must not be negative, not {}", self.text(&span)))),
            None => Err(self.about(span.clone(), format!("{} is too large", self.text(&span)))),
        }
    }

    /// Deserializes `value`; `context` names what is read when the error's place has no key of
    /// its own (a missing field, or an unknown one at the top of a step).
    fn de<T: DeserializeOwned>(&self, value: Spanned<DeValue<'a>>, context: Option<&str>) -> Result<T, ScenarioError> {
        T::deserialize(ValueDeserializer::from(value)).map_err(|e| {
            let message = e.message().trim_end().to_owned();
            self.invalid(e.span().unwrap_or_default(), |keys, on_key| {
                let keys = if on_key { &keys[..keys.len() - 1] } else { keys };
                match (keys.join("."), context) {
                    (subject, _) if !subject.is_empty() => format!("{subject}: {message}"),
                    (_, Some(context)) => format!("{context}: {message}"),
                    (_, None) => message,
                }
            })
        })
    }

    /// An error about the key at `span` (or its value), which `what` completes: "<key> <what>".
    fn about(&self, span: Range<usize>, what: impl fmt::Display) -> ScenarioError {
        self.invalid(span, |keys, on_key| match keys.split_last() {
            Some((_, [])) if on_key => format!("key {what}"),
            Some((_, parent)) if on_key => format!("{} key {what}", parent.join(".")),
            Some(_) => format!("{} {what}", keys.join(".")),
            None => what.to_string(),
        })
    }

    /// An error at `span`, whose message `message` writes from the keys down to it.
    fn invalid(&self, span: Range<usize>, message: impl FnOnce(&[String], bool) -> String) -> ScenarioError {
        let place = self.place(span);
        let message = message(&place.keys, place.on_key);
        let key = (!place.keys.is_empty()).then(|| place.keys.join("."));
        ScenarioError::Invalid {
            location: Location { file: None, step: place.step, key, line_column: place.line_column },
            message,
        }
    }

    fn syntax_error(&self, error: &toml::de::Error) -> ScenarioError {
        let line_column = error.span().map(|span| self.line_column(span.start));
        ScenarioError::Syntax {
            location: Location { line_column, ..Location::default() },
            message: error.message().trim_end().to_owned(),
        }
    }

    /// Finds the step and keys whose text holds `span`, in a fresh parse of the text (the
    /// first one was taken apart to deserialize it).
    fn place(&self, span: Range<usize>) -> Place {
        let mut place = Place { step: None, keys: Vec::new(), on_key: false, line_column: None };
        // An empty span is the document's own (a key missing at the top): no key holds it.
        if span.is_empty() {
            return place;
        }
        place.line_column = Some(self.line_column(span.start));
        let Ok(root) = DeTable::parse(self.text) else { return place };
        let root = Spanned::new(root.span(), DeValue::Table(root.into_inner()));
        place.on_key = find(&root, span.start, &mut place.keys).unwrap_or(false);
        // `step` is the array of steps (anything else is refused before a step is read).
        if let [step, index, ..] = place.keys.as_slice() {
            if let (true, Ok(index)) = (step == "step", index.parse::<usize>()) {
                place.step = Some(index + 1);
                place.keys.drain(..2);
            }
        }
        place
    }

    fn text(&self, span: &Range<usize>) -> &'a str {
        self.text.get(span.clone()).unwrap_or_default().trim()
    }

    fn line_column(&self, offset: usize) -> (usize, usize) {
        let before = self.text.get(..offset).unwrap_or(self.text);
        let line = before.matches('\n').count() + 1;
        let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
        (line, column)
    }
}

/// Pushes onto `path` the way to the deepest key or value whose text holds `at` (keys, and
/// indices of arrays), and says whether that is a key itself; `None` (and `path` as it was)
/// when nothing in `value` holds it.
///
/// Children are searched whether or not the parent's span holds `at`: a `[table]` or
/// `[[array]]` element spans only its header.
fn find(value: &Spanned<DeValue<'_>>, at: usize, path: &mut Vec<String>) -> Option<bool> {
    match value.get_ref() {
        DeValue::Table(table) => {
            for (key, child) in table.iter() {
                path.push(key.get_ref().to_string());
                if key.span().contains(&at) {
                    return Some(true);
                }
                if let Some(on_key) = find(child, at, path) {
                    return Some(on_key);
                }
                path.pop();
            }
        }
        DeValue::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                path.push(i.to_string());
                if let Some(on_key) = find(item, at, path) {
                    return Some(on_key);
                }
                path.pop();
            }
        }
        _ => {}
    }
    value.span().contains(&at).then_some(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A folder of the shared scenarios; CI checks `shared/` out beside the repository, at the
    /// same relative place.
    fn shared(folder: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/scenarios").join(folder)
    }

    fn parse(text: &str) -> Scenario {
        match Scenario::from_toml_str(text) {
            Ok(scenario) => scenario,
            Err(e) => panic!("{e}\nin:\n{text}"),
        }
    }

    fn steps(body: &str) -> String {
        format!("name = \"t\"\n{body}")
    }

    /// The events of a file with a cluster of two prefill and two decode engines.
    fn events(body: &str) -> Vec<Option<Event>> {
        let s = parse(&steps(&format!("[cluster]\nprefillers = 2\ndecoders = 2\n{body}")));
        s.steps.into_iter().map(|s| s.event).collect()
    }

    #[test]
    fn every_shared_and_own_scenario_parses() {
        let own = Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios");
        for (dir, at_least) in [(shared("public"), 11), (shared("next"), 4), (own, 40)] {
            assert!(dir.is_dir(), "the scenarios are missing: {} is not a folder", dir.display());
            let files = scenario_files(&[&dir]).map_err(|e| e.to_string());
            let files = files.as_deref().unwrap_or_else(|e| panic!("{e}"));
            assert!(files.len() >= at_least, "expected scenarios under {}, found {files:?}", dir.display());
            for file in files {
                if let Err(e) = Scenario::load(file) {
                    panic!("{e}");
                }
            }
        }

        let siblings = Scenario::load(shared("public").join("siblings.toml")).map_err(|e| e.to_string());
        let siblings = siblings.as_ref().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            siblings.steps[0].event,
            Some(Event::Prefill {
                request: "r1".into(),
                prompt_tokens: 64,
                n: 4,
                node: Node::PREFILL0,
                consumer: None
            })
        );
        let last = siblings.steps[3].expect.as_ref().map(|e| e.p_released.clone()).unwrap_or_default();
        assert_eq!(last.get(&RequestId::new("0_r1")), Some(&ReleaseReason::Transferred));
        assert_eq!(last.get(&RequestId::new("3_r1")), Some(&ReleaseReason::Sibling));

        let early = Scenario::load(shared("public").join("early-completion.toml")).map_err(|e| e.to_string());
        let early = early.as_ref().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(early.cluster.worker_handoff, Duration::from_millis(200));
        assert_eq!(early.steps[1].at, Time::from_millis(10));

        let intrude = Scenario::load(shared("next").join("intrude-before-handshake.toml")).map_err(|e| e.to_string());
        let intrude = intrude.as_ref().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(intrude.steps[0].event, Some(Event::Intrude { to: Node::PREFILL0, claimed: Node::DECODE0 }));
    }

    #[test]
    fn a_minimal_file_gets_every_default() {
        let s = parse("name = \"minimal\"");
        assert_eq!((s.name.as_str(), s.steps.len()), ("minimal", 0));
        assert_eq!(s.cluster, ClusterSpec::default());
        let c = &s.cluster;
        assert_eq!((c.mode, c.prefillers, c.decoders, c.prefill_tp, c.decode_tp), (Mode::Pull, 1, 1, 1, 1));
        assert_eq!((c.prefill_block_size, c.decode_block_size, c.num_kv_heads, c.mla), (16, 16, 8, false));
        assert_eq!((c.prefill_num_blocks, c.decode_num_blocks), (1000, 1000));
        assert_eq!(c.step_interval, Duration::from_millis(10));
        assert_eq!(c.network_latency, Duration::from_millis(1));
        assert_eq!(c.transfer_latency, Duration::from_millis(5));
        assert_eq!(c.worker_handoff, Duration::from_millis(10));
        assert!(c.clock_skew.is_empty());
        let p = &s.policy;
        assert_eq!(p.kv_lease_duration, Duration::from_secs(30));
        assert_eq!(p.heartbeat_interval, Duration::from_secs(5));
        assert_eq!(p.lease_extension, Duration::from_secs(20));
        assert_eq!(p.decoder_kv_blocks_ttl, Duration::from_secs(480));
        assert_eq!(p.push_registration_timeout, Duration::from_secs(480));
        assert_eq!(p.push_quarantine, Duration::from_secs(60));
        assert_eq!(p.kv_load_failure_policy, LoadFailurePolicy::Recompute);
        assert_eq!(p.early_notification_capacity, 8192);
    }

    #[test]
    fn defaults_follow_the_values_they_derive_from() {
        let s = parse(&steps(
            "[cluster]\nstep_interval_ms = 20\n[policy]\nkv_lease_duration_s = 60\ndecoder_kv_blocks_ttl_s = 100",
        ));
        assert_eq!(s.cluster.worker_handoff, Duration::from_millis(20));
        assert_eq!(s.policy.heartbeat_interval, Duration::from_secs(10));
        assert_eq!(s.policy.lease_extension, Duration::from_secs(40));
        assert_eq!(s.policy.push_registration_timeout, Duration::from_secs(100));
        assert_eq!(s.policy.push_quarantine, Duration::from_secs(120));

        let s = parse(&steps(
            "[cluster]\nmode = \"push\"\nstep_interval_ms = 20\nworker_handoff_ms = 0.5\nmla = true\n\
             clock_skew_ms = { decode0 = -2500, prefill0 = 0.25 }\n\
             [policy]\nkv_lease_duration_s = 60\nheartbeat_interval_s = 1\nlease_extension_s = 7.5\n\
             push_registration_timeout_s = 3\npush_quarantine_s = 4.5\nkv_load_failure_policy = \"fail\"\n\
             early_notification_capacity = 0",
        ));
        assert_eq!((s.cluster.mode, s.cluster.mla), (Mode::Push, true));
        assert_eq!(s.cluster.worker_handoff, Duration::from_micros(500));
        assert_eq!(s.cluster.clock_skew, BTreeMap::from([(Node::PREFILL0, 250_000), (Node::DECODE0, -2_500_000_000)]));
        assert_eq!(s.policy.heartbeat_interval, Duration::from_secs(1));
        assert_eq!(s.policy.lease_extension, Duration::from_millis(7500));
        assert_eq!(s.policy.push_registration_timeout, Duration::from_secs(3));
        assert_eq!(s.policy.push_quarantine, Duration::from_millis(4500));
        assert_eq!(s.policy.kv_load_failure_policy, LoadFailurePolicy::Fail);
        assert_eq!(s.policy.early_notification_capacity, 0);
    }

    #[test]
    fn every_event_parses_with_its_defaults() {
        let events = events(
            r#"
            [[step]]
            at_s = 0
            do = "prefill"
            request = "r1"
            prompt_tokens = 64
            [[step]]
            at_s = 0.01
            do = "arrive"
            request = "r1"
            [[step]]
            at_s = 0.01
            do = "arrive"
            request = "0_r2-0123abcd"
            node = "decode1"
            from = "prefill1"
            remote_request = "0_r2"
            prompt_tokens = 32
            [[step]]
            at_s = 0.02
            do = "schedule"
            request = "r1"
            prefix_hit = true
            [[step]]
            at_s = 0.03
            do = "reject"
            request = "r3"
            [[step]]
            at_s = 0.04
            do = "abort"
            request = "r1"
            node = "prefill1"
            [[step]]
            at_s = 1
            do = "crash"
            node = "decode1"
            [[step]]
            at_s = 2
            do = "restart"
            node = "decode1"
            [[step]]
            at_s = 3
            do = "partition"
            a = "prefill0"
            b = "decode0"
            until_s = 4.5
            [[step]]
            at_s = 3
            do = "delay"
            a = "decode0"
            b = "prefill0"
            by_ms = 250
            until_s = 3
            [[step]]
            at_s = 5
            do = "fail_transfer"
            request = "r1"
            node = "decode1"
            [[step]]
            at_s = 5
            do = "garbage"
            from = "decode1"
            to = "prefill0"
            bytes = "%%"
            [[step]]
            at_s = 6
            do = "wait"
            [[step]]
            at_s = 6
            do = "pause"
            node = "prefill1"
            for_s = 1.5
            [[step]]
            at_s = 6
            do = "forge"
            from = "decode1"
            to = "prefill0"
            message = "completion"
            request = "r1"
            [[step]]
            at_s = 6
            do = "intrude"
            to = "prefill1"
            as = "decode0"
            [[step]]
            at_s = 7
            "#,
        );
        let r = RequestId::new;
        let expected = vec![
            Some(Event::Prefill { request: r("r1"), prompt_tokens: 64, n: 1, node: Node::PREFILL0, consumer: None }),
            Some(Event::Arrive {
                request: r("r1"),
                node: Node::DECODE0,
                from: Node::PREFILL0,
                remote_request: r("r1"),
                prompt_tokens: None,
            }),
            Some(Event::Arrive {
                request: r("0_r2-0123abcd"),
                node: Node::decode(1),
                from: Node::prefill(1),
                remote_request: r("0_r2"),
                prompt_tokens: Some(32),
            }),
            Some(Event::Schedule { request: r("r1"), node: Node::DECODE0, prefix_hit: true, cached_tokens: 0 }),
            Some(Event::Reject {
                request: r("r3"),
                node: Node::DECODE0,
                from: Node::PREFILL0,
                remote_request: r("r3"),
            }),
            Some(Event::Abort { request: r("r1"), node: Node::prefill(1) }),
            Some(Event::Crash { node: Node::decode(1), detect: false }),
            Some(Event::Restart { node: Node::decode(1) }),
            Some(Event::Partition { a: Node::PREFILL0, b: Node::DECODE0, until: Time::from_millis(4500) }),
            Some(Event::Delay {
                a: Node::DECODE0,
                b: Node::PREFILL0,
                by: Duration::from_millis(250),
                until: Time::from_millis(3000),
            }),
            Some(Event::FailTransfer { request: r("r1"), node: Node::decode(1), from_block: None }),
            Some(Event::Garbage { from: Node::decode(1), to: Node::PREFILL0, bytes: b"%%".to_vec() }),
            Some(Event::Wait),
            Some(Event::Pause { node: Node::prefill(1), for_: Duration::from_millis(1500) }),
            Some(Event::Forge {
                from: Node::decode(1),
                to: Node::PREFILL0,
                message: ForgedMessage::Completion,
                request: r("r1"),
                consumers: 1,
            }),
            Some(Event::Intrude { to: Node::prefill(1), claimed: Node::DECODE0 }),
            None,
        ];
        assert_eq!(events, expected);
        let mut names: Vec<&str> = events.iter().flatten().map(Event::name).collect();
        names.dedup();
        let format_names = [
            "prefill",
            "arrive",
            "schedule",
            "reject",
            "abort",
            "crash",
            "restart",
            "partition",
            "delay",
            "fail_transfer",
            "garbage",
            "wait",
            "pause",
            "forge",
            "intrude",
        ];
        assert_eq!(names, format_names);
    }

    #[test]
    fn the_new_event_keys_parse() {
        let events = events(
            r#"
            [[step]]
            at_s = 0
            do = "prefill"
            request = "r1"
            prompt_tokens = 64
            consumer = "decode1"
            [[step]]
            at_s = 0
            do = "schedule"
            request = "r1"
            node = "decode1"
            cached_tokens = 32
            [[step]]
            at_s = 0
            do = "fail_transfer"
            request = "r1"
            node = "decode0"
            from_block = 2
            [[step]]
            at_s = 0
            do = "forge"
            from = "decode0"
            to = "prefill1"
            message = "abort"
            request = "r1"
            consumers = 3
            [[step]]
            at_s = 0
            do = "forge"
            from = "decode0"
            to = "prefill1"
            message = "heartbeat"
            request = "r1"
            [[step]]
            at_s = 0
            do = "forge"
            from = "decode1"
            to = "prefill0"
            message = "reject"
            request = "r1"
            consumers = 0
            [[step]]
            at_s = 0
            do = "intrude"
            to = "decode0"
            as = "decode1"
            "#,
        );
        let r = RequestId::new;
        let forge =
            |from, to, message, consumers| Some(Event::Forge { from, to, message, request: r("r1"), consumers });
        assert_eq!(
            events,
            vec![
                Some(Event::Prefill {
                    request: r("r1"),
                    prompt_tokens: 64,
                    n: 1,
                    node: Node::PREFILL0,
                    consumer: Some(Node::decode(1)),
                }),
                Some(Event::Schedule { request: r("r1"), node: Node::decode(1), prefix_hit: false, cached_tokens: 32 }),
                Some(Event::FailTransfer { request: r("r1"), node: Node::DECODE0, from_block: Some(2) }),
                forge(Node::DECODE0, Node::prefill(1), ForgedMessage::Abort, 3),
                forge(Node::DECODE0, Node::prefill(1), ForgedMessage::Heartbeat, 1),
                forge(Node::decode(1), Node::PREFILL0, ForgedMessage::Reject, 0),
                Some(Event::Intrude { to: Node::DECODE0, claimed: Node::decode(1) }),
            ]
        );
    }

    #[test]
    fn every_expectation_parses() {
        let s = parse(&steps(
            r#"
            [cluster]
            prefillers = 2
            decoders = 2
            [[step]]
            at_s = 0.5
            expect = { p_held_blocks = 4, p_held_blocks_on = { prefill1 = 3 }, p_pending = 1, p_released = { r1 = "transferred", r2 = "expired", r3 = "rejected", r4 = "aborted", "0_r5" = "sibling", r6 = "peer_lost" }, d_held_blocks = 0, d_held_blocks_on = { decode1 = 2 }, d_state = { r1 = "waiting", r2 = "loading", r3 = "ready", r4 = "failed", r5 = "recompute", r6 = "gone" }, notifications_after_expiry = 0, ignored_messages = 2, corrupt_reads = 1, written_after_free = 0, d_blocks_read = { r1 = 4, r2 = 0 }, d_tokens_kept = { r3 = 32 } }
            [[step]]
            at_s = 0.5
            do = "schedule"
            request = "r1"
            node = "decode1"
            expect = { d_state = { r1 = "loading" } }
            [[step]]
            at_s = 0.6
            node = "decode1"
            [step.expect]
            d_blocks_read = { r1 = 2 }
            d_tokens_kept = { r1 = 16 }
            [[step]]
            at_s = 0.7
            do = "crash"
            node = "prefill1"
            expect = {}
            "#,
        ));
        let e = s.steps[0].expect.clone().unwrap_or_default();
        let r = RequestId::new;
        assert_eq!((e.p_held_blocks, e.p_pending, e.d_held_blocks), (Some(4), Some(1), Some(0)));
        assert_eq!(e.p_held_blocks_on, BTreeMap::from([(Node::prefill(1), 3)]));
        assert_eq!(e.d_held_blocks_on, BTreeMap::from([(Node::decode(1), 2)]));
        assert_eq!(
            e.p_released.into_iter().collect::<Vec<_>>(),
            vec![
                (r("0_r5"), ReleaseReason::Sibling),
                (r("r1"), ReleaseReason::Transferred),
                (r("r2"), ReleaseReason::Expired),
                (r("r3"), ReleaseReason::Rejected),
                (r("r4"), ReleaseReason::Aborted),
                (r("r6"), ReleaseReason::PeerLost),
            ]
        );
        use DecodeState::*;
        assert_eq!(e.d_state.into_values().collect::<Vec<_>>(), vec![Waiting, Loading, Ready, Failed, Recompute, Gone]);
        assert_eq!(e.d_node, Node::DECODE0);
        assert_eq!((e.notifications_after_expiry, e.ignored_messages, e.corrupt_reads), (Some(0), Some(2), Some(1)));
        assert_eq!(e.written_after_free, Some(0));
        assert_eq!(e.d_blocks_read, BTreeMap::from([(r("r1"), 4), (r("r2"), 0)]));
        assert_eq!(e.d_tokens_kept, BTreeMap::from([(r("r3"), 32)]));

        let on_decode1 = |i: usize| s.steps[i].expect.as_ref().map(|e| e.d_node);
        assert_eq!((on_decode1(1), on_decode1(2)), (Some(Node::decode(1)), Some(Node::decode(1))));
        let third = s.steps[2].expect.clone().unwrap_or_default();
        assert_eq!(
            (third.d_blocks_read, third.d_tokens_kept),
            (BTreeMap::from([(r("r1"), 2)]), BTreeMap::from([(r("r1"), 16)]))
        );
        let empty = s.steps[3].expect.as_ref();
        assert_eq!(empty.map(Expect::is_empty), Some(true));
        assert_eq!(empty.map(|e| e.d_node), Some(Node::DECODE0));
    }

    /// Parses `input` and checks that it fails with a message that starts with `expected`.
    fn check_error(input: &str, expected: &str) {
        match Scenario::from_toml_str(input) {
            Ok(_) => panic!("accepted, but expected {expected:?}:\n{input}"),
            Err(e) => {
                let message = e.to_string();
                assert!(message.starts_with(expected), "got {message:?}\nexpected {expected:?}\nfor:\n{input}");
            }
        }
    }

    #[test]
    fn bad_inputs_say_where_and_what() {
        let prefill = "[[step]]\nat_s = 0\ndo = \"prefill\"\nrequest = \"r1\"\nprompt_tokens = 64\n";
        let cases: &[(String, &str)] = &[
            ("name = ".into(), "invalid TOML: line 1, column 8: "),
            ("title = \"x\"".into(), "unknown field `title`, expected one of `name`, `cluster`, `policy`, `step`"),
            (String::new(), "missing field `name`"),
            ("name = 3".into(), "name: invalid type: integer `3`, expected a string"),
            (steps("cluster = 3"), "cluster: invalid type: integer `3`, expected a table"),
            (steps("step = 3"), "step must be an array of tables ([[step]]), not 3"),
            (steps("step = [1]"), "step 1: must be a table ([[step]]), not 1"),
            (steps("[cluster]\nprefillerz = 2"), "cluster: unknown field `prefillerz`, expected one of `mode`, "),
            (steps("[policy]\nlease_s = 2"), "policy: unknown field `lease_s`, expected one of `kv_lease_duration_s`, "),
            (steps("[cluster]\nprefill_tp = 0"), "cluster.prefill_tp: invalid value: integer `0`, expected a nonzero u32"),
            (
                steps("[cluster]\ndecode_block_size = -16"),
                "cluster.decode_block_size: invalid value: integer `-16`, expected a nonzero u32",
            ),
            (
                steps("[cluster]\ndecoders = 5000000000"),
                "cluster.decoders: invalid value: integer `5000000000`, expected a nonzero u32",
            ),
            (
                steps("[cluster]\nnum_kv_heads = 8.0"),
                "cluster.num_kv_heads: invalid type: floating point `8.0`, expected a nonzero u32",
            ),
            (steps("[cluster]\nmla = \"yes\""), "cluster.mla: invalid type: string \"yes\", expected a boolean"),
            (steps("[cluster]\nmode = \"teleport\""), "cluster.mode: unknown variant `teleport`, expected `pull` or `push`"),
            (steps("[cluster]\nstep_interval_ms = 0"), "cluster.step_interval_ms must be positive, not 0"),
            (steps("[cluster]\nnetwork_latency_ms = -1"), "cluster.network_latency_ms must not be negative, not -1"),
            (
                steps("[cluster]\nclock_skew_ms = { decode1 = 5 }"),
                "cluster.clock_skew_ms key \"decode1\" does not exist (decoders = 1)",
            ),
            (steps("[cluster]\nclock_skew_ms = { decode0 = 1e300 }"), "cluster.clock_skew_ms.decode0 1e300 is out of range"),
            (steps("[policy]\nkv_lease_duration_s = -30"), "policy.kv_lease_duration_s must not be negative, not -30"),
            (steps("[policy]\nkv_lease_duration_s = 0"), "policy.kv_lease_duration_s must be positive, not 0"),
            (steps("[policy]\nheartbeat_interval_s = 0"), "policy.heartbeat_interval_s must be positive, not 0"),
            (steps("[policy]\ndecoder_kv_blocks_ttl_s = inf"), "policy.decoder_kv_blocks_ttl_s must be finite, not inf"),
            (steps("[policy]\npush_quarantine_s = -1.5"), "policy.push_quarantine_s must not be negative, not -1.5"),
            (
                steps("[policy]\nkv_load_failure_policy = \"retry\""),
                "policy.kv_load_failure_policy: unknown variant `retry`, expected `fail` or `recompute`",
            ),
            (
                steps("[policy]\nearly_notification_capacity = -1"),
                "policy.early_notification_capacity: invalid value: integer `-1`, expected usize",
            ),
            (steps("[[step]]\nat_s = 1\ndo = \"explode\""), "step 1: do: unknown variant `explode`, expected one of `prefill`, "),
            (steps("[[step]]\nat_s = 1\ndo = 3"), "step 1: do: invalid type: integer `3`, expected a string"),
            (
                steps("[[step]]\nat_s = 0\ndo = \"prefill\"\nrequest = \"r1\"\nprompt = 64"),
                "step 1: do = \"prefill\": unexpected keys in table: prompt, available keys: request, prompt_tokens, ",
            ),
            (
                steps("[[step]]\nat_s = 0\nrequest = \"r1\""),
                "step 1: unknown key \"request\" for a step without do (expected one of: at_s, do, expect, node)",
            ),
            (
                steps(&format!("{prefill}expect = {{ p_held = 4 }}")),
                "step 1: expect: unknown field `p_held`, expected one of `p_held_blocks`, ",
            ),
            (steps("[[step]]\ndo = \"wait\""), "step 1: at_s is missing"),
            (steps("[[step]]\nat_s = -1.0"), "step 1: at_s must not be negative, not -1.0"),
            (steps("[[step]]\nat_s = nan"), "step 1: at_s must be finite, not NaN"),
            (steps("[[step]]\nat_s = 1e30"), "step 1: at_s 1e30 is too large"),
            (steps("[[step]]\nat_s = \"1\""), "step 1: at_s: invalid type: string \"1\", expected f64"),
            (
                steps("[[step]]\nat_s = 0.0\n[[step]]\nat_s = 2.0\n[[step]]\nat_s = 1.0"),
                "step 3: at_s 1.0 is earlier than the previous step's 2.0",
            ),
            (
                steps("[cluster]\ndecoders = 2\n[[step]]\nat_s = 0\ndo = \"arrive\"\nrequest = \"r1\"\nnode = \"decode5\""),
                "step 1: node \"decode5\" does not exist (decoders = 2)",
            ),
            (
                steps("[[step]]\nat_s = 0\ndo = \"crash\"\nnode = \"prefill1\""),
                "step 1: node \"prefill1\" does not exist (prefillers = 1)",
            ),
            (
                steps("[cluster]\ndecoders = 3\n[[step]]\nat_s = 0\ndo = \"crash\"\nnode = \"gpu0\""),
                "step 1: node \"gpu0\" is not an engine name (this cluster has prefill0 and decode0..decode2)",
            ),
            (
                steps("[[step]]\nat_s = 0\ndo = \"restart\"\nnode = \"decode01\""),
                "step 1: node \"decode01\" is not an engine name",
            ),
            (
                steps("[[step]]\nat_s = 0\ndo = \"schedule\"\nrequest = \"r1\"\nnode = \"prefill0\""),
                "step 1: node \"prefill0\" must be a decode engine for do = \"schedule\"",
            ),
            (
                steps("[[step]]\nat_s = 0\ndo = \"prefill\"\nrequest = \"r1\"\nprompt_tokens = 64\nnode = \"decode0\""),
                "step 1: node \"decode0\" must be a prefill engine for do = \"prefill\"",
            ),
            (
                steps("[[step]]\nat_s = 0\ndo = \"reject\"\nrequest = \"r1\"\nfrom = \"decode0\""),
                "step 1: from \"decode0\" must be a prefill engine for do = \"reject\"",
            ),
            (
                steps("[[step]]\nat_s = 0\ndo = \"fail_transfer\"\nrequest = \"r1\"\nnode = \"prefill0\""),
                "step 1: node \"prefill0\" must be a decode engine for do = \"fail_transfer\" in pull mode",
            ),
            (
                steps("[cluster]\nmode = \"push\"\n[[step]]\nat_s = 0\ndo = \"fail_transfer\"\nrequest = \"r1\"\nnode = \"decode0\""),
                "step 1: node \"decode0\" must be a prefill engine for do = \"fail_transfer\" in push mode",
            ),
            (
                steps("[[step]]\nat_s = 0\ndo = \"prefill\"\nrequest = \"r1\""),
                "step 1: do = \"prefill\": missing field `prompt_tokens`",
            ),
            (steps("[[step]]\nat_s = 0\ndo = \"schedule\""), "step 1: do = \"schedule\": missing field `request`"),
            (steps("[[step]]\nat_s = 0\ndo = \"abort\"\nrequest = \"r1\""), "step 1: do = \"abort\": missing field `node`"),
            (steps("[[step]]\nat_s = 0\ndo = \"crash\""), "step 1: do = \"crash\": missing field `node`"),
            (
                steps("[[step]]\nat_s = 0\ndo = \"garbage\"\nfrom = \"decode0\"\nto = \"prefill0\""),
                "step 1: do = \"garbage\": missing field `bytes`",
            ),
            (
                steps("[[step]]\nat_s = 0\ndo = \"partition\"\na = \"decode0\"\nb = \"prefill0\""),
                "step 1: do = \"partition\": missing field `until_s`",
            ),
            (
                steps("[[step]]\nat_s = 0\ndo = \"delay\"\na = \"decode0\"\nb = \"prefill0\"\nuntil_s = 1"),
                "step 1: do = \"delay\": missing field `by_ms`",
            ),
            (
                steps("[[step]]\nat_s = 0\ndo = \"delay\"\na = \"decode0\"\nb = \"prefill0\"\nby_ms = -5\nuntil_s = 1"),
                "step 1: by_ms must not be negative, not -5",
            ),
            (
                steps("[[step]]\nat_s = 2.0\ndo = \"partition\"\na = \"decode0\"\nb = \"prefill0\"\nuntil_s = 1.5"),
                "step 1: until_s 1.5 is earlier than at_s 2.0",
            ),
            (
                steps("[[step]]\nat_s = 0\ndo = \"partition\"\na = \"decode0\"\nb = \"decode0\"\nuntil_s = 1"),
                "step 1: a and b are both \"decode0\" for do = \"partition\"; they must differ",
            ),
            (
                steps("[[step]]\nat_s = 0\ndo = \"prefill\"\nrequest = \"r1\"\nprompt_tokens = 64\nn = 0"),
                "step 1: n must be at least 1, not 0",
            ),
            (
                steps("[[step]]\nat_s = 0\ndo = \"prefill\"\nrequest = \"r1\"\nprompt_tokens = 0"),
                "step 1: prompt_tokens must be at least 1, not 0",
            ),
            (
                steps("[[step]]\nat_s = 0\ndo = \"prefill\"\nrequest = \"r1\"\nprompt_tokens = \"64\""),
                "step 1: prompt_tokens: invalid type: string \"64\", expected u64",
            ),
            (
                steps("[[step]]\nat_s = 0\ndo = \"prefill\"\nrequest = \"\"\nprompt_tokens = 64"),
                "step 1: request must not be empty",
            ),
            (
                steps(&format!("[[step]]\nat_s = 0\ndo = \"abort\"\nnode = \"decode0\"\nrequest = \"{}\"", "r".repeat(257))),
                "step 1: request is 257 bytes long (at most 256)",
            ),
            (
                steps("[[step]]\nat_s = 0\ndo = \"schedule\"\nrequest = \"r1\"\nprefix_hit = 1"),
                "step 1: prefix_hit: invalid type: integer `1`, expected a boolean",
            ),
            (steps(&format!("{prefill}expect = 4")), "step 1: expect: invalid type: integer `4`, expected a table"),
            (
                steps(&format!("{prefill}expect = {{ p_held_blocks = -1 }}")),
                "step 1: expect.p_held_blocks: invalid value: integer `-1`, expected u64",
            ),
            (
                steps(&format!("{prefill}expect = {{ p_released = {{ r1 = \"gone\" }} }}")),
                "step 1: expect.p_released.r1: unknown variant `gone`, expected one of `transferred`, `expired`, \
                 `rejected`, `aborted`, `sibling`, `peer_lost`",
            ),
            (
                steps(&format!("{prefill}expect = {{ d_state = {{ r1 = \"done\" }} }}")),
                "step 1: expect.d_state.r1: unknown variant `done`, expected one of `waiting`, `loading`, `ready`, \
                 `failed`, `recompute`, `gone`",
            ),
            (
                steps(&format!("{prefill}expect = {{ p_released = \"r1\" }}")),
                "step 1: expect.p_released: invalid type: string \"r1\", expected a map",
            ),
            (
                steps(&format!("{prefill}expect = {{ d_held_blocks_on = {{ prefill0 = 1 }} }}")),
                "step 1: expect.d_held_blocks_on key \"prefill0\" must be a decode engine",
            ),
            (
                steps(&format!("{prefill}expect = {{ p_held_blocks_on = {{ prefill3 = 1 }} }}")),
                "step 1: expect.p_held_blocks_on key \"prefill3\" does not exist (prefillers = 1)",
            ),
            (
                steps(&format!("{prefill}expect = {{ p_released = {{ \"\" = \"expired\" }} }}")),
                "step 1: expect.p_released key must not be empty",
            ),
            (
                steps(&format!("{prefill}node = \"prefill0\"\nexpect = {{ d_state = {{ r1 = \"ready\" }} }}")),
                "step 1: expect.d_state is read on the step's node, and prefill0 is not a decode engine",
            ),
            (steps("[[step]]\nat_s = 0\nnode = \"decode1\""), "step 1: node \"decode1\" does not exist (decoders = 1)"),
        ];
        for (input, expected) in cases {
            check_error(input, expected);
        }
    }

    #[test]
    fn bad_new_keys_say_where_and_what() {
        let two = "[cluster]\nprefillers = 2\ndecoders = 2\n[[step]]\nat_s = 1\n";
        let cases: &[(&str, &str)] = &[
            (
                "do = \"prefill\"\nrequest = \"r1\"\nprompt_tokens = 64\nconsumer = \"prefill1\"",
                "step 1: consumer \"prefill1\" must be a decode engine for do = \"prefill\"",
            ),
            (
                "do = \"prefill\"\nrequest = \"r1\"\nprompt_tokens = 64\nconsumer = \"decode2\"",
                "step 1: consumer \"decode2\" does not exist (decoders = 2)",
            ),
            ("do = \"pause\"\nnode = \"decode0\"", "step 1: do = \"pause\": missing field `for_s`"),
            ("do = \"pause\"\nfor_s = 1", "step 1: do = \"pause\": missing field `node`"),
            ("do = \"pause\"\nnode = \"decode0\"\nfor_s = 0", "step 1: for_s must be positive, not 0"),
            ("do = \"pause\"\nnode = \"decode0\"\nfor_s = -2.5", "step 1: for_s must not be negative, not -2.5"),
            ("do = \"pause\"\nnode = \"decode0\"\nfor_s = \"1\"", "step 1: for_s: invalid type: string \"1\", expected f64"),
            (
                "do = \"forge\"\nfrom = \"prefill1\"\nto = \"prefill0\"\nmessage = \"abort\"\nrequest = \"r1\"",
                "step 1: from \"prefill1\" must be a decode engine for do = \"forge\"",
            ),
            (
                "do = \"forge\"\nfrom = \"decode1\"\nto = \"decode0\"\nmessage = \"abort\"\nrequest = \"r1\"",
                "step 1: to \"decode0\" must be a prefill engine for do = \"forge\"",
            ),
            (
                "do = \"forge\"\nfrom = \"decode1\"\nto = \"prefill0\"\nmessage = \"hello\"\nrequest = \"r1\"",
                "step 1: message: unknown variant `hello`, expected one of `completion`, `abort`, `heartbeat`, `reject`",
            ),
            (
                "do = \"forge\"\nfrom = \"decode1\"\nto = \"prefill0\"\nmessage = \"abort\"",
                "step 1: do = \"forge\": missing field `request`",
            ),
            (
                "do = \"forge\"\nfrom = \"decode1\"\nto = \"prefill0\"\nrequest = \"r1\"",
                "step 1: do = \"forge\": missing field `message`",
            ),
            (
                "do = \"forge\"\nfrom = \"decode1\"\nto = \"prefill0\"\nmessage = \"completion\"\nrequest = \"r1\"\nconsumers = -1",
                "step 1: consumers: invalid value: integer `-1`, expected u32",
            ),
            ("do = \"intrude\"\nto = \"prefill0\"", "step 1: do = \"intrude\": missing field `as`"),
            (
                "do = \"intrude\"\nto = \"prefill0\"\nas = \"prefill0\"",
                "step 1: to and as are both \"prefill0\" for do = \"intrude\"; they must differ",
            ),
            ("do = \"intrude\"\nto = \"prefill0\"\nas = \"decode7\"", "step 1: as \"decode7\" does not exist (decoders = 2)"),
            (
                "do = \"intrude\"\nto = \"prefill0\"\nas = \"eve\"",
                "step 1: as \"eve\" is not an engine name (this cluster has prefill0..prefill1 and decode0..decode1)",
            ),
            (
                "do = \"schedule\"\nrequest = \"r1\"\ncached_tokens = 20",
                "step 1: cached_tokens must be a whole number of D blocks (decode_block_size = 16), not 20",
            ),
            (
                "do = \"schedule\"\nrequest = \"r1\"\ncached_tokens = -16",
                "step 1: cached_tokens: invalid value: integer `-16`, expected u64",
            ),
            (
                "do = \"fail_transfer\"\nrequest = \"r1\"\nnode = \"decode0\"\nfrom_block = -1",
                "step 1: from_block: invalid value: integer `-1`, expected u32",
            ),
            (
                "do = \"crash\"\nnode = \"decode0\"\ncached_tokens = 16",
                "step 1: do = \"crash\": unexpected keys in table: cached_tokens, available keys: node, detect",
            ),
            ("do = \"crash\"\nnode = 3", "step 1: node: invalid type: integer `3`, expected a string"),
            ("do = \"arrive\"\nrequest = \"r1\"\nprompt_tokens = 0", "step 1: prompt_tokens must be at least 1, not 0"),
            ("do = \"arrive\"\nrequest = 7", "step 1: request: invalid type: integer `7`, expected a string"),
            (
                "do = \"wait\"\nnode = \"decode1\"\nfor_s = 1",
                "step 1: unknown key \"for_s\" for do = \"wait\" (expected one of: at_s, do, expect, node)",
            ),
            ("expect = { written_after_free = -1 }", "step 1: expect.written_after_free: invalid value: integer `-1`"),
            (
                "expect = { d_blocks_read = { r1 = \"all\" } }",
                "step 1: expect.d_blocks_read.r1: invalid type: string \"all\", expected u64",
            ),
            ("expect = { d_tokens_kept = { \"\" = 1 } }", "step 1: expect.d_tokens_kept key must not be empty"),
            (
                "do = \"abort\"\nrequest = \"r1\"\nnode = \"prefill1\"\nexpect = { d_blocks_read = { r1 = 1 } }",
                "step 1: expect.d_blocks_read is read on the step's node, and prefill1 is not a decode engine; check \
                 d_blocks_read in a step of its own",
            ),
            (
                "node = \"prefill0\"\nexpect = { d_tokens_kept = { r1 = 1 } }",
                "step 1: expect.d_tokens_kept is read on the step's node, and prefill0 is not a decode engine",
            ),
        ];
        for (body, expected) in cases {
            check_error(&steps(&format!("{two}{body}")), expected);
        }
    }

    #[test]
    fn errors_carry_the_step_the_key_and_the_line_and_column() {
        let text = "name = \"x\"\n[[step]]\nat_s = 1\n\n[[step]]\nat_s = 2\ndo = \"crash\"\nnode = \"decode3\"\n";
        let e = Scenario::from_toml_str(text).err();
        let location = e.as_ref().and_then(|e| e.location().cloned());
        let expected = Location { file: None, step: Some(2), key: Some("node".into()), line_column: Some((8, 8)) };
        assert_eq!(location, Some(expected));
        let message = e.map(|e| e.to_string());
        assert_eq!(
            message.as_deref(),
            Some("step 2: node \"decode3\" does not exist (decoders = 1) (line 8, column 8)")
        );

        // serde's own errors are placed the same way: on the value, on an unknown key, or on the
        // step's table for a key that is missing.
        let at = |step, key: Option<&str>, line, column| Location {
            file: None,
            step,
            key: key.map(str::to_owned),
            line_column: Some((line, column)),
        };
        let cases = [
            ("[cluster]\nmode = \"teleport\"\n", at(None, Some("cluster.mode"), 3, 8)),
            ("[[step]]\nat_s = 0\ndo = \"explode\"\n", at(Some(1), Some("do"), 4, 6)),
            ("[[step]]\nat_s = 0\ndo = \"prefill\"\nrequest = \"r\"\n", at(Some(1), None, 2, 1)),
            ("step = [{ at_s = 0 }, { at_s = 1, do = \"wait\", bogus = 1 }]", at(Some(2), Some("bogus"), 2, 48)),
            (
                "[[step]]\nat_s = 0\nexpect = { d_state = { r1 = \"x\" } }\n",
                at(Some(1), Some("expect.d_state.r1"), 4, 29),
            ),
            ("[[step]]\nat_s = 0\n[step.expect]\np_pending = -1\n", at(Some(1), Some("expect.p_pending"), 5, 13)),
        ];
        for (body, expected) in cases {
            let e = Scenario::from_toml_str(&steps(body)).err();
            let location = e.as_ref().and_then(|e| e.location().cloned());
            assert_eq!(location, Some(expected), "{e:?} for {body:?}");
        }
    }

    #[test]
    fn a_step_may_only_move_time() {
        let s = parse(&steps("[[step]]\nat_s = 0.25\n[[step]]\nat_s = 0.25"));
        let at: Vec<Time> = s.steps.iter().map(|s| s.at).collect();
        assert_eq!(at, vec![Time::from_millis(250); 2]);
        assert!(s.steps.iter().all(|s| s.event.is_none() && s.expect.is_none()));
    }

    /// A fresh, empty folder under the system's temporary folder.
    fn scratch(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("kv-testkit-scenario-{}-{tag}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let made = fs::create_dir_all(&dir);
        assert!(made.is_ok(), "cannot create {}: {made:?}", dir.display());
        dir
    }

    fn write(path: &Path, text: &str) {
        if let Some(parent) = path.parent() {
            assert!(fs::create_dir_all(parent).is_ok(), "cannot create {}", parent.display());
        }
        assert!(fs::write(path, text).is_ok(), "cannot write {}", path.display());
    }

    #[test]
    fn errors_from_a_file_name_it() {
        let dir = scratch("load");
        let file = dir.join("bad.toml");
        write(&file, "name = \"x\"\n[[step]]\nat_s = 1\n[[step]]\nat_s = 2\ndo = \"explode\"\n");
        let e = Scenario::load(&file).err().map(|e| e.to_string());
        assert_eq!(
            e.as_deref().and_then(|e| e.split(", expected").next()),
            Some(format!("{}: step 2: do: unknown variant `explode`", file.display()).as_str())
        );
        assert!(e.as_deref().is_some_and(|e| e.ends_with("(line 6, column 6)")), "{e:?}");
        let location = Scenario::load(&file).err().and_then(|e| e.location().cloned());
        let expected =
            Location { file: Some(file.clone()), step: Some(2), key: Some("do".into()), line_column: Some((6, 6)) };
        assert_eq!(location, Some(expected));

        write(&file, "name = \"x\"\n\n[cluster\n");
        let e = Scenario::load(&file).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.starts_with(&format!("{}: invalid TOML: line 3, column", file.display())), "{e}");

        let missing = dir.join("missing.toml");
        let e = Scenario::load(&missing).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.starts_with(&format!("cannot read {}: ", missing.display())), "{e}");
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn folders_expand_to_their_toml_files_sorted() {
        let dir = scratch("files");
        for name in ["b.toml", "a.toml", "sub/z.toml", "sub/deeper/c.toml", "notes.md", "a.toml.bak"] {
            write(&dir.join(name), "name = \"x\"\n");
        }
        let single = dir.join("notes.md");
        let files = scenario_files(&[dir.clone(), single.clone()]).map_err(|e| e.to_string());
        let expected: Vec<PathBuf> = ["a.toml", "b.toml", "sub/deeper/c.toml", "sub/z.toml", "notes.md"]
            .iter()
            .map(|name| dir.join(name))
            .collect();
        assert_eq!(files, Ok(expected));

        let empty = dir.join("empty");
        assert!(fs::create_dir_all(&empty).is_ok());
        let e = scenario_files(&[&empty]).err().map(|e| e.to_string());
        assert_eq!(e, Some(format!("no *.toml scenario file under {}", empty.display())));
        let gone = dir.join("gone");
        let e = scenario_files(&[&gone]).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.starts_with(&format!("cannot read {}: ", gone.display())), "{e}");
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_library_names_read_back_as_the_format_writes_them() {
        use ReleaseReason::*;
        for reason in [Transferred, Expired, Rejected, Aborted, Sibling, PeerLost] {
            let text = steps(&format!("[[step]]\nat_s = 0\nexpect = {{ p_released = {{ r1 = \"{reason}\" }} }}"));
            let got = parse(&text).steps[0].expect.as_ref().and_then(|e| e.p_released.values().next().copied());
            assert_eq!(got, Some(reason));
        }
        use DecodeState::*;
        for state in [Waiting, Loading, Ready, Failed, Recompute, Gone] {
            let text =
                steps(&format!("[[step]]\nat_s = 0\nexpect = {{ d_state = {{ r1 = \"{}\" }} }}", state.as_str()));
            let got = parse(&text).steps[0].expect.as_ref().and_then(|e| e.d_state.values().next().copied());
            assert_eq!(got, Some(state));
        }
        for (name, mode) in [("pull", Mode::Pull), ("push", Mode::Push)] {
            assert_eq!(parse(&steps(&format!("[cluster]\nmode = \"{name}\""))).cluster.mode, mode);
        }
        for (name, policy) in [("fail", LoadFailurePolicy::Fail), ("recompute", LoadFailurePolicy::Recompute)] {
            let text = steps(&format!("[policy]\nkv_load_failure_policy = \"{name}\""));
            assert_eq!(parse(&text).policy.kv_load_failure_policy, policy);
        }
        check_error(
            &steps("[[step]]\nat_s = 0\nexpect = { p_released = { r1 = \"PeerLost\" } }"),
            "step 1: expect.p_released.r1: unknown variant `PeerLost`",
        );

        assert_eq!(Node::parse("decode12"), Some(Node::decode(12)));
        assert_eq!(Node::decode(12).to_string(), "decode12");
        assert_eq!(Node::PREFILL0.engine_id(), EngineId::new("prefill0"));
        for bad in ["decode", "decode01", "Decode1", "decode-1", "prefill 0", "prefill99999999999"] {
            assert_eq!(Node::parse(bad), None, "{bad}");
        }
        assert!(Node::prefill(7) < Node::DECODE0);
        let cluster = ClusterSpec { prefillers: 2, decoders: 1, ..ClusterSpec::default() };
        assert_eq!(cluster.nodes().collect::<Vec<_>>(), vec![Node::prefill(0), Node::prefill(1), Node::decode(0)]);
        assert!(!cluster.contains(Node::decode(1)));
    }
}
