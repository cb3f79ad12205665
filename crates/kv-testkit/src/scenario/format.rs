//! The typed, validated in-memory form of a scenario file, as `scenarios/FORMAT.md` specifies it.
//!
//! [`Scenario::from_toml_str`] and [`Scenario::load`] apply every default of the format, resolve
//! node names to engines of the cluster (checking that each has the role its event needs), and
//! refuse unknown keys, steps out of time order, negative or non-finite times, zero sizes and
//! counts, and events that lack a required field. An error says where: the file (when loaded
//! from one), the step (counted from 1, as a reader counts `[[step]]` tables), the field and the
//! value, e.g. `pull.toml: step 3: unknown event "explode" (expected one of: prefill, ...)`.
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
//!     Some(Event::Prefill { request: RequestId::new("r1"), prompt_tokens: 64, n: 1, node: Node::PREFILL0 })
//! );
//! assert_eq!(scenario.steps[0].expect.as_ref().and_then(|e| e.p_held_blocks), Some(4));
//!
//! let bad = Scenario::from_toml_str("name = \"x\"\n[[step]]\nat_s = 1\ndo = \"explode\"\n").unwrap_err();
//! assert!(bad.to_string().starts_with("step 1: unknown event \"explode\""));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::cmp::Ordering;
use std::collections::BTreeMap;
use std::fmt;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use kv_core::id::MAX_REQUEST_ID_LEN;
use kv_core::{EngineId, RequestId, Role, Time};
use toml::{Table, Value};

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
        parse_scenario(text)
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

/// Whether D reads from P or P writes into D (`cluster.mode`).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum TransferMode {
    /// `"pull"`: D reads P's exported blocks.
    Pull,
    /// `"push"`: D registers its blocks and P writes into them.
    Push,
}

impl TransferMode {
    /// The mode's name as scenario files write it.
    pub fn as_str(self) -> &'static str {
        match self {
            TransferMode::Pull => "pull",
            TransferMode::Push => "push",
        }
    }
}

impl fmt::Display for TransferMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The `[cluster]` table: the engines and the simulated timing.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct ClusterSpec {
    /// `mode` (pull).
    pub mode: TransferMode,
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
}

impl Default for ClusterSpec {
    fn default() -> Self {
        let step_interval = Duration::from_millis(10);
        ClusterSpec {
            mode: TransferMode::Pull,
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

/// What D does when a load fails or cannot be made safely (`policy.kv_load_failure_policy`).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum FailurePolicy {
    /// `"fail"`: the request fails.
    Fail,
    /// `"recompute"`: D computes the prompt's KV itself.
    Recompute,
}

impl FailurePolicy {
    /// The policy's name as scenario files write it.
    pub fn as_str(self) -> &'static str {
        match self {
            FailurePolicy::Fail => "fail",
            FailurePolicy::Recompute => "recompute",
        }
    }
}

impl fmt::Display for FailurePolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
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
    /// `kv_load_failure_policy` (recompute).
    pub kv_load_failure_policy: FailurePolicy,
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
            kv_load_failure_policy: FailurePolicy::Recompute,
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
/// Ordered prefill engines first, then by index.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
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
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum Event {
    /// `prefill`: P runs the prompt and finishes it; its blocks are exported under a lease.
    Prefill {
        /// `request` (required).
        request: RequestId,
        /// `prompt_tokens` (required, at least 1).
        prompt_tokens: u64,
        /// `n` (1): with `n > 1`, P registers the siblings `0_r` .. `{n-1}_r`.
        n: u32,
        /// `node` (prefill0): a prefill engine.
        node: Node,
    },
    /// `arrive`: the request, carrying P's transfer parameters, enters D's waiting queue.
    Arrive {
        /// `request` (required): D's id; may be a sibling id.
        request: RequestId,
        /// `node` (decode0): a decode engine.
        node: Node,
        /// `from` (prefill0): a prefill engine.
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
        node: Node,
        /// `prefix_hit` (false): D already has the prompt cached and only tells P it is done.
        prefix_hit: bool,
    },
    /// `reject`: the request reaches D, and D rejects it before admission.
    Reject {
        /// `request` (required).
        request: RequestId,
        /// `node` (decode0): a decode engine.
        node: Node,
        /// `from` (prefill0): a prefill engine.
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
        until: Time,
    },
    /// `delay`: every message from `a` to `b` sent before `until` arrives `by` later.
    Delay {
        /// `a` (required): the sender.
        a: Node,
        /// `b` (required): the receiver, other than `a`.
        b: Node,
        /// `by_ms` (required).
        by: Duration,
        /// `until_s` (required): not before the step's `at_s`.
        until: Time,
    },
    /// `fail_transfer`: the next read or write that `node` posts for `request` fails.
    FailTransfer {
        /// `request` (required).
        request: RequestId,
        /// `node` (required): the engine that posts transfers in this mode, a decode engine in
        /// pull mode and a prefill engine in push mode.
        node: Node,
    },
    /// `garbage`: `from` sends `to` a notification whose payload is `bytes`.
    Garbage {
        /// `from` (required): any engine.
        from: Node,
        /// `to` (required): any engine other than `from`.
        to: Node,
        /// `bytes` (required): the string's UTF-8 bytes.
        bytes: Vec<u8>,
    },
    /// `wait`: nothing; the step only moves time and checks.
    Wait,
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
        }
    }
}

/// Every `do` with its keys, in the format's order.
const EVENTS: [(&str, &[&str]); 12] = [
    ("prefill", &["request", "prompt_tokens", "n", "node"]),
    ("arrive", &["request", "node", "from", "remote_request", "prompt_tokens"]),
    ("schedule", &["request", "node", "prefix_hit"]),
    ("reject", &["request", "node", "from", "remote_request"]),
    ("abort", &["request", "node"]),
    ("crash", &["node", "detect"]),
    ("restart", &["node"]),
    ("partition", &["a", "b", "until_s"]),
    ("delay", &["a", "b", "by_ms", "until_s"]),
    ("fail_transfer", &["request", "node"]),
    ("garbage", &["from", "to", "bytes"]),
    // `node` only says where `d_state` looks.
    ("wait", &["node"]),
];

/// Why P released an export, as an expectation names it (`expect.p_released`).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub enum ReleaseReasonName {
    /// `"transferred"`: the export's completion count was reached.
    Transferred,
    /// `"expired"`: its lease ran out.
    Expired,
    /// `"rejected"`: D rejected the request before admission.
    Rejected,
    /// `"aborted"`: D aborted the request, or gave up its load, and told P.
    Aborted,
    /// `"sibling"`: a parallel-sampling sibling's completion released it.
    Sibling,
    /// `"peer_lost"`: the D engine that had renewed it or started loading it was seen gone.
    PeerLost,
}

impl ReleaseReasonName {
    /// Every reason, in the format's order.
    pub const ALL: [ReleaseReasonName; 6] = [
        ReleaseReasonName::Transferred,
        ReleaseReasonName::Expired,
        ReleaseReasonName::Rejected,
        ReleaseReasonName::Aborted,
        ReleaseReasonName::Sibling,
        ReleaseReasonName::PeerLost,
    ];

    /// The reason's name as scenario files write it.
    pub fn as_str(self) -> &'static str {
        match self {
            ReleaseReasonName::Transferred => "transferred",
            ReleaseReasonName::Expired => "expired",
            ReleaseReasonName::Rejected => "rejected",
            ReleaseReasonName::Aborted => "aborted",
            ReleaseReasonName::Sibling => "sibling",
            ReleaseReasonName::PeerLost => "peer_lost",
        }
    }

    /// The reason a scenario file's name denotes.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|r| r.as_str() == name)
    }
}

impl fmt::Display for ReleaseReasonName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where a request stands on a D engine, as an expectation names it (`expect.d_state`).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub enum DState {
    /// `"waiting"`: arrived, not scheduled.
    Waiting,
    /// `"loading"`: scheduled: reading, or registered and waiting for P's write.
    Loading,
    /// `"ready"`: its KV is in place.
    Ready,
    /// `"failed"`: the load failed or could not be made safely, and the policy is `fail`.
    Failed,
    /// `"recompute"`: the load failed or could not be made safely, and the policy is
    /// `recompute`.
    Recompute,
    /// `"gone"`: aborted or rejected, nothing held.
    Gone,
}

impl DState {
    /// Every state, in the format's order.
    pub const ALL: [DState; 6] =
        [DState::Waiting, DState::Loading, DState::Ready, DState::Failed, DState::Recompute, DState::Gone];

    /// The state's name as scenario files write it.
    pub fn as_str(self) -> &'static str {
        match self {
            DState::Waiting => "waiting",
            DState::Loading => "loading",
            DState::Ready => "ready",
            DState::Failed => "failed",
            DState::Recompute => "recompute",
            DState::Gone => "gone",
        }
    }

    /// The state a scenario file's name denotes.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|s| s.as_str() == name)
    }
}

impl fmt::Display for DState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A step's `expect`: what must hold once everything due at the step's time has run.
///
/// A key left out is `None` or an empty map, and is not checked.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct Expect {
    /// `p_held_blocks`: logical blocks prefill0 holds for export.
    pub p_held_blocks: Option<u64>,
    /// `p_held_blocks_on`: the same, on the named prefill engines.
    pub p_held_blocks_on: BTreeMap<Node, u64>,
    /// `p_pending`: exports on prefill0 not yet released.
    pub p_pending: Option<u64>,
    /// `p_released`: request id to the reason P released its export.
    pub p_released: BTreeMap<RequestId, ReleaseReasonName>,
    /// `d_held_blocks`: logical blocks decode0 holds for loading or push-waiting requests.
    pub d_held_blocks: Option<u64>,
    /// `d_held_blocks_on`: the same, on the named decode engines.
    pub d_held_blocks_on: BTreeMap<Node, u64>,
    /// `d_state`: request id to its state on [`Expect::d_state_node`].
    pub d_state: BTreeMap<RequestId, DState>,
    /// Where `d_state` looks: the step's `node` when it has one, else decode0. Always a decode
    /// engine of the cluster (a step whose `node` is a prefill engine cannot check `d_state`).
    pub d_state_node: Node,
    /// `notifications_after_expiry`: completions P received for exports it no longer had.
    pub notifications_after_expiry: Option<u64>,
    /// `ignored_messages`: malformed, unknown or unauthorised messages dropped, on all engines.
    pub ignored_messages: Option<u64>,
    /// `corrupt_reads`: loads whose bytes did not match what P computed.
    pub corrupt_reads: Option<u64>,
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
            d_state_node: Node::DECODE0,
            notifications_after_expiry: None,
            ignored_messages: None,
            corrupt_reads: None,
        }
    }
}

impl Expect {
    /// Whether the expectation checks nothing (`expect = {}`).
    pub fn is_empty(&self) -> bool {
        *self == Expect { d_state_node: self.d_state_node, ..Expect::default() }
    }
}

const EXPECT_KEYS: [&str; 10] = [
    "p_held_blocks",
    "p_held_blocks_on",
    "p_pending",
    "p_released",
    "d_held_blocks",
    "d_held_blocks_on",
    "d_state",
    "notifications_after_expiry",
    "ignored_messages",
    "corrupt_reads",
];

/// Where in a scenario an error is: the file, when the scenario was loaded from one, and the
/// step, counted from 1. It displays as a prefix: `path: step 3: `, `step 3: `, or nothing.
#[derive(Clone, PartialEq, Eq, Debug, Default)]
pub struct Location {
    /// The scenario file.
    pub file: Option<PathBuf>,
    /// The `[[step]]` table, counted from 1 in file order.
    pub step: Option<usize>,
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
    #[error("{location}invalid TOML: {message}")]
    Syntax {
        /// The file, if any (no step: TOML syntax is checked before steps are told apart).
        location: Location,
        /// The line, column and what the TOML parser said.
        message: String,
    },
    /// The text is TOML, but not a valid scenario.
    #[error("{location}{message}")]
    Invalid {
        /// The file and step, where there are.
        location: Location,
        /// What is wrong, naming the field and the value.
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

// ---- parsing ----

/// Where the parser is: the step for error locations, and the table's prefix for field names.
#[derive(Clone, Copy)]
struct Ctx {
    step: Option<usize>,
    prefix: &'static str,
}

impl Ctx {
    const TOP: Ctx = Ctx { step: None, prefix: "" };

    fn err(&self, message: impl Into<String>) -> ScenarioError {
        ScenarioError::Invalid { location: Location { file: None, step: self.step }, message: message.into() }
    }

    fn field(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }
}

/// A TOML value as an error message shows it.
fn show(value: &Value) -> String {
    match value {
        Value::String(s) => format!("{s:?}"),
        Value::Integer(i) => i.to_string(),
        Value::Float(x) => format!("{x:?}"),
        Value::Boolean(b) => b.to_string(),
        Value::Datetime(d) => d.to_string(),
        Value::Array(_) => "an array".to_owned(),
        Value::Table(_) => "a table".to_owned(),
    }
}

fn syntax_error(text: &str, error: &toml::de::Error) -> ScenarioError {
    let place = error
        .span()
        .and_then(|span| text.get(..span.start))
        .map(|before| {
            let line = before.matches('\n').count() + 1;
            let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
            format!("line {line}, column {column}: ")
        })
        .unwrap_or_default();
    ScenarioError::Syntax { location: Location::default(), message: format!("{place}{}", error.message().trim_end()) }
}

fn check_keys(table: &Table, allowed: &[&str], ctx: Ctx, context: &str) -> Result<(), ScenarioError> {
    match table.keys().find(|k| !allowed.contains(&k.as_str())) {
        Some(key) => {
            Err(ctx.err(format!("unknown key {:?}{context} (expected one of: {})", ctx.field(key), allowed.join(", "))))
        }
        None => Ok(()),
    }
}

fn as_table<'a>(value: &'a Value, field: &str, ctx: Ctx) -> Result<&'a Table, ScenarioError> {
    value.as_table().ok_or_else(|| ctx.err(format!("{field} must be a table, not {}", show(value))))
}

fn as_str<'a>(value: &'a Value, field: &str, ctx: Ctx) -> Result<&'a str, ScenarioError> {
    value.as_str().ok_or_else(|| ctx.err(format!("{field} must be a string, not {}", show(value))))
}

fn as_bool(value: &Value, field: &str, ctx: Ctx) -> Result<bool, ScenarioError> {
    value.as_bool().ok_or_else(|| ctx.err(format!("{field} must be true or false, not {}", show(value))))
}

/// An integer of at least `min` that fits `T`.
fn as_count<T: TryFrom<i64> + Bounded>(value: &Value, field: &str, ctx: Ctx, min: i64) -> Result<T, ScenarioError> {
    let n = value.as_integer().ok_or_else(|| ctx.err(format!("{field} must be an integer, not {}", show(value))))?;
    if n < min {
        return Err(ctx.err(format!("{field} must be at least {min}, not {n}")));
    }
    T::try_from(n).map_err(|_| ctx.err(format!("{field} {n} is too large (at most {})", T::MAX)))
}

/// The largest value of an unsigned integer type, for messages.
trait Bounded {
    const MAX: u64;
}

impl Bounded for u32 {
    const MAX: u64 = u32::MAX as u64;
}

impl Bounded for u64 {
    const MAX: u64 = u64::MAX;
}

impl Bounded for usize {
    const MAX: u64 = usize::MAX as u64;
}

/// A non-negative, finite number of `unit`s (integer or float) as nanoseconds.
fn as_nanos(value: &Value, field: &str, ctx: Ctx, nanos_per_unit: f64) -> Result<u64, ScenarioError> {
    let x = match value {
        Value::Integer(i) => *i as f64,
        Value::Float(x) => *x,
        _ => return Err(ctx.err(format!("{field} must be a number, not {}", show(value)))),
    };
    if !x.is_finite() {
        return Err(ctx.err(format!("{field} must be finite, not {}", show(value))));
    }
    if x < 0.0 {
        return Err(ctx.err(format!("{field} must not be negative, not {}", show(value))));
    }
    let nanos = (x * nanos_per_unit).round();
    // 2^64 as f64 is exact; anything at or above it does not fit.
    if nanos >= 18_446_744_073_709_551_616.0 {
        return Err(ctx.err(format!("{field} {} is too large", show(value))));
    }
    Ok(nanos as u64)
}

const NANOS_PER_SEC: f64 = 1e9;
const NANOS_PER_MS: f64 = 1e6;

fn as_request(value: &Value, field: &str, ctx: Ctx) -> Result<RequestId, ScenarioError> {
    let id = as_str(value, field, ctx)?;
    check_request(id, field, ctx)
}

fn check_request(id: &str, field: &str, ctx: Ctx) -> Result<RequestId, ScenarioError> {
    if id.is_empty() {
        return Err(ctx.err(format!("{field} must not be empty")));
    }
    if id.len() > MAX_REQUEST_ID_LEN {
        return Err(ctx.err(format!("{field} is {} bytes long (at most {MAX_REQUEST_ID_LEN})", id.len())));
    }
    Ok(RequestId::new(id))
}

/// Resolves a node name against `cluster`; `label` starts the message, `role` is the role the
/// use needs, `context` ends a wrong-role message.
fn resolve_node(
    name: &str,
    label: &str,
    ctx: Ctx,
    cluster: &ClusterSpec,
    role: Option<Role>,
    context: &str,
) -> Result<Node, ScenarioError> {
    let Some(node) = Node::parse(name) else {
        return Err(
            ctx.err(format!("{label} {name:?} is not an engine name (this cluster has {})", cluster.engine_list()))
        );
    };
    if !cluster.contains(node) {
        let count = match node.role {
            Role::Prefill => "prefillers",
            Role::Decode => "decoders",
        };
        return Err(ctx.err(format!("{label} {name:?} does not exist ({count} = {})", cluster.engines(node.role))));
    }
    match role {
        Some(role) if role != node.role => {
            Err(ctx.err(format!("{label} {name:?} must be a {} engine{context}", role_name(role))))
        }
        _ => Ok(node),
    }
}

fn parse_scenario(text: &str) -> Result<Scenario, ScenarioError> {
    let root: Table = text.parse().map_err(|e| syntax_error(text, &e))?;
    let ctx = Ctx::TOP;
    check_keys(&root, &["name", "cluster", "policy", "step"], ctx, "")?;
    let name = match root.get("name") {
        Some(v) => as_str(v, "name", ctx)?.to_owned(),
        None => return Err(ctx.err("name is missing")),
    };
    let cluster = match root.get("cluster") {
        Some(v) => parse_cluster(as_table(v, "cluster", ctx)?)?,
        None => ClusterSpec::default(),
    };
    let policy = match root.get("policy") {
        Some(v) => parse_policy(as_table(v, "policy", ctx)?)?,
        None => PolicySpec::default(),
    };
    let tables: &[Value] = match root.get("step") {
        Some(Value::Array(steps)) => steps,
        Some(other) => {
            return Err(ctx.err(format!("step must be an array of tables ([[step]]), not {}", show(other))));
        }
        None => &[],
    };
    let mut steps = Vec::with_capacity(tables.len());
    let mut previous: Option<(u64, String)> = None;
    for (i, value) in tables.iter().enumerate() {
        let ctx = Ctx { step: Some(i + 1), prefix: "" };
        let table =
            value.as_table().ok_or_else(|| ctx.err(format!("must be a table ([[step]]), not {}", show(value))))?;
        let (step, at) = parse_step(table, ctx, &cluster, previous.as_ref())?;
        steps.push(step);
        previous = Some(at);
    }
    Ok(Scenario { name, cluster, policy, steps })
}

const CLUSTER_KEYS: [&str; 15] = [
    "mode",
    "prefillers",
    "decoders",
    "prefill_tp",
    "decode_tp",
    "prefill_block_size",
    "decode_block_size",
    "num_kv_heads",
    "mla",
    "prefill_num_blocks",
    "decode_num_blocks",
    "step_interval_ms",
    "network_latency_ms",
    "transfer_latency_ms",
    "worker_handoff_ms",
];

fn parse_cluster(table: &Table) -> Result<ClusterSpec, ScenarioError> {
    let ctx = Ctx { step: None, prefix: "cluster." };
    check_keys(table, &CLUSTER_KEYS, ctx, "")?;
    let d = ClusterSpec::default();
    let positive = |key: &str, default: u32| -> Result<u32, ScenarioError> {
        table.get(key).map_or(Ok(default), |v| as_count(v, &ctx.field(key), ctx, 1))
    };
    let millis = |key: &str| -> Result<Option<Duration>, ScenarioError> {
        table.get(key).map(|v| as_nanos(v, &ctx.field(key), ctx, NANOS_PER_MS).map(Duration::from_nanos)).transpose()
    };
    let mode = match table.get("mode") {
        None => d.mode,
        Some(v) => match as_str(v, "cluster.mode", ctx)? {
            "pull" => TransferMode::Pull,
            "push" => TransferMode::Push,
            _ => return Err(ctx.err(format!("cluster.mode must be \"pull\" or \"push\", not {}", show(v)))),
        },
    };
    let step_interval = millis("step_interval_ms")?.unwrap_or(d.step_interval);
    if step_interval.is_zero() {
        return Err(ctx.err("cluster.step_interval_ms must be positive, not 0"));
    }
    Ok(ClusterSpec {
        mode,
        prefillers: positive("prefillers", d.prefillers)?,
        decoders: positive("decoders", d.decoders)?,
        prefill_tp: positive("prefill_tp", d.prefill_tp)?,
        decode_tp: positive("decode_tp", d.decode_tp)?,
        prefill_block_size: positive("prefill_block_size", d.prefill_block_size)?,
        decode_block_size: positive("decode_block_size", d.decode_block_size)?,
        num_kv_heads: positive("num_kv_heads", d.num_kv_heads)?,
        mla: table.get("mla").map_or(Ok(d.mla), |v| as_bool(v, "cluster.mla", ctx))?,
        prefill_num_blocks: positive("prefill_num_blocks", d.prefill_num_blocks)?,
        decode_num_blocks: positive("decode_num_blocks", d.decode_num_blocks)?,
        step_interval,
        network_latency: millis("network_latency_ms")?.unwrap_or(d.network_latency),
        transfer_latency: millis("transfer_latency_ms")?.unwrap_or(d.transfer_latency),
        worker_handoff: millis("worker_handoff_ms")?.unwrap_or(step_interval),
    })
}

const POLICY_KEYS: [&str; 7] = [
    "kv_lease_duration_s",
    "heartbeat_interval_s",
    "lease_extension_s",
    "decoder_kv_blocks_ttl_s",
    "push_registration_timeout_s",
    "kv_load_failure_policy",
    "early_notification_capacity",
];

fn parse_policy(table: &Table) -> Result<PolicySpec, ScenarioError> {
    let ctx = Ctx { step: None, prefix: "policy." };
    check_keys(table, &POLICY_KEYS, ctx, "")?;
    let secs = |key: &str| -> Result<Option<Duration>, ScenarioError> {
        table.get(key).map(|v| as_nanos(v, &ctx.field(key), ctx, NANOS_PER_SEC).map(Duration::from_nanos)).transpose()
    };
    let lease = secs("kv_lease_duration_s")?.unwrap_or(Duration::from_secs(30));
    if lease.is_zero() {
        return Err(ctx.err("policy.kv_lease_duration_s must be positive, not 0"));
    }
    let d = PolicySpec::with_lease(lease);
    let heartbeat_interval = secs("heartbeat_interval_s")?.unwrap_or(d.heartbeat_interval);
    if heartbeat_interval.is_zero() {
        // Zero would have D renew forever without time moving.
        return Err(ctx.err(format!(
            "policy.heartbeat_interval_s must be positive, not 0 (the default is kv_lease_duration_s / 6 = {:?})",
            d.heartbeat_interval
        )));
    }
    let decoder_kv_blocks_ttl = secs("decoder_kv_blocks_ttl_s")?.unwrap_or(d.decoder_kv_blocks_ttl);
    let kv_load_failure_policy = match table.get("kv_load_failure_policy") {
        None => d.kv_load_failure_policy,
        Some(v) => match as_str(v, "policy.kv_load_failure_policy", ctx)? {
            "fail" => FailurePolicy::Fail,
            "recompute" => FailurePolicy::Recompute,
            _ => {
                return Err(ctx
                    .err(format!("policy.kv_load_failure_policy must be \"fail\" or \"recompute\", not {}", show(v))));
            }
        },
    };
    Ok(PolicySpec {
        kv_lease_duration: lease,
        heartbeat_interval,
        lease_extension: secs("lease_extension_s")?.unwrap_or(d.lease_extension),
        decoder_kv_blocks_ttl,
        push_registration_timeout: secs("push_registration_timeout_s")?.unwrap_or(decoder_kv_blocks_ttl),
        kv_load_failure_policy,
        early_notification_capacity: table
            .get("early_notification_capacity")
            .map_or(Ok(d.early_notification_capacity), |v| as_count(v, "policy.early_notification_capacity", ctx, 0))?,
    })
}

/// Parses one step; `previous` is the previous step's time, in nanoseconds and as written.
fn parse_step(
    table: &Table,
    ctx: Ctx,
    cluster: &ClusterSpec,
    previous: Option<&(u64, String)>,
) -> Result<(Step, (u64, String)), ScenarioError> {
    let name = table.get("do").map(|v| as_str(v, "do", ctx)).transpose()?;
    let (fields, context): (&[&str], String) = match name {
        None => (&["node"], " for a step without do".to_owned()),
        Some(name) => match EVENTS.iter().find(|(n, _)| *n == name) {
            Some((_, fields)) => (fields, format!(" for do = {name:?}")),
            None => {
                let names: Vec<&str> = EVENTS.iter().map(|(n, _)| *n).collect();
                return Err(ctx.err(format!("unknown event {name:?} (expected one of: {})", names.join(", "))));
            }
        },
    };
    let allowed: Vec<&str> = ["at_s", "do", "expect"].iter().chain(fields).copied().collect();
    check_keys(table, &allowed, ctx, &context)?;

    let at_value = table.get("at_s").ok_or_else(|| ctx.err("at_s is missing"))?;
    let at_nanos = as_nanos(at_value, "at_s", ctx, NANOS_PER_SEC)?;
    let at_text = show(at_value);
    if let Some((previous, previous_text)) = previous {
        if at_nanos < *previous {
            return Err(ctx.err(format!("at_s {at_text} is earlier than the previous step's {previous_text}")));
        }
    }
    let at = Time::from_nanos(at_nanos);

    let event = match name {
        None => None,
        Some(name) => Some(parse_event(name, table, ctx, cluster, at)?),
    };

    let expect = match table.get("expect") {
        None => None,
        Some(v) => {
            let step_node = match table.get("node") {
                Some(v) => Some(resolve_node(as_str(v, "node", ctx)?, "node", ctx, cluster, None, "")?),
                None => None,
            };
            Some(parse_expect(as_table(v, "expect", ctx)?, ctx, cluster, step_node)?)
        }
    };
    // A `node` on a step without `do` (or with `wait`) and without `expect` says nothing, but it
    // must still name an engine.
    if let (None | Some(Event::Wait), None, Some(v)) = (&event, &expect, table.get("node")) {
        resolve_node(as_str(v, "node", ctx)?, "node", ctx, cluster, None, "")?;
    }
    Ok((Step { at, event, expect }, (at_nanos, at_text)))
}

fn parse_event(name: &str, table: &Table, ctx: Ctx, cluster: &ClusterSpec, at: Time) -> Result<Event, ScenarioError> {
    let context = format!(" for do = {name:?}");
    let missing = |key: &str| ctx.err(format!("do = {name:?} needs {key}"));
    let optional_request = |key: &str| table.get(key).map(|v| as_request(v, key, ctx)).transpose();
    let required_request = |key: &str| optional_request(key)?.ok_or_else(|| missing(key));
    let node = |key: &str, role: Option<Role>, default: Option<Node>| -> Result<Node, ScenarioError> {
        match table.get(key) {
            Some(v) => resolve_node(as_str(v, key, ctx)?, key, ctx, cluster, role, &context),
            None => default.ok_or_else(|| missing(key)),
        }
    };
    let flag = |key: &str| table.get(key).map_or(Ok(false), |v| as_bool(v, key, ctx));
    let tokens = |key: &str| table.get(key).map(|v| as_count::<u64>(v, key, ctx, 1)).transpose();
    let until = || -> Result<Time, ScenarioError> {
        let value = table.get("until_s").ok_or_else(|| missing("until_s"))?;
        let until = Time::from_nanos(as_nanos(value, "until_s", ctx, NANOS_PER_SEC)?);
        if until < at {
            let at_text = table.get("at_s").map(show).unwrap_or_default();
            return Err(ctx.err(format!("until_s {} is earlier than at_s {at_text}", show(value))));
        }
        Ok(until)
    };
    let distinct = |(a_key, a): (&str, Node), (b_key, b): (&str, Node)| {
        if a == b {
            Err(ctx.err(format!("{a_key} and {b_key} are both {:?}{context}; they must differ", a.to_string())))
        } else {
            Ok((a, b))
        }
    };
    let (p, d) = (Some(Role::Prefill), Some(Role::Decode));
    let event = match name {
        "prefill" => Event::Prefill {
            request: required_request("request")?,
            prompt_tokens: tokens("prompt_tokens")?.ok_or_else(|| missing("prompt_tokens"))?,
            n: table.get("n").map_or(Ok(1), |v| as_count(v, "n", ctx, 1))?,
            node: node("node", p, Some(Node::PREFILL0))?,
        },
        "arrive" => {
            let request = required_request("request")?;
            Event::Arrive {
                node: node("node", d, Some(Node::DECODE0))?,
                from: node("from", p, Some(Node::PREFILL0))?,
                remote_request: optional_request("remote_request")?.unwrap_or_else(|| request.clone()),
                prompt_tokens: tokens("prompt_tokens")?,
                request,
            }
        }
        "schedule" => Event::Schedule {
            request: required_request("request")?,
            node: node("node", d, Some(Node::DECODE0))?,
            prefix_hit: flag("prefix_hit")?,
        },
        "reject" => {
            let request = required_request("request")?;
            Event::Reject {
                node: node("node", d, Some(Node::DECODE0))?,
                from: node("from", p, Some(Node::PREFILL0))?,
                remote_request: optional_request("remote_request")?.unwrap_or_else(|| request.clone()),
                request,
            }
        }
        "abort" => Event::Abort { request: required_request("request")?, node: node("node", None, None)? },
        "crash" => Event::Crash { node: node("node", None, None)?, detect: flag("detect")? },
        "restart" => Event::Restart { node: node("node", None, None)? },
        "partition" => {
            let (a, b) = distinct(("a", node("a", None, None)?), ("b", node("b", None, None)?))?;
            Event::Partition { a, b, until: until()? }
        }
        "delay" => {
            let (a, b) = distinct(("a", node("a", None, None)?), ("b", node("b", None, None)?))?;
            let by = table.get("by_ms").ok_or_else(|| missing("by_ms"))?;
            Event::Delay { a, b, by: Duration::from_nanos(as_nanos(by, "by_ms", ctx, NANOS_PER_MS)?), until: until()? }
        }
        "fail_transfer" => {
            // Only the side that posts transfers can have one fail: D's reads, or P's writes.
            let poster = match cluster.mode {
                TransferMode::Pull => d,
                TransferMode::Push => p,
            };
            let context = format!("{context} in {} mode", cluster.mode);
            let node = match table.get("node") {
                Some(v) => resolve_node(as_str(v, "node", ctx)?, "node", ctx, cluster, poster, &context)?,
                None => return Err(missing("node")),
            };
            Event::FailTransfer { request: required_request("request")?, node }
        }
        "garbage" => {
            let (from, to) = distinct(("from", node("from", None, None)?), ("to", node("to", None, None)?))?;
            let bytes = table.get("bytes").ok_or_else(|| missing("bytes"))?;
            Event::Garbage { from, to, bytes: as_str(bytes, "bytes", ctx)?.as_bytes().to_vec() }
        }
        "wait" => Event::Wait,
        // `parse_step` has already refused names outside EVENTS.
        other => return Err(ctx.err(format!("unknown event {other:?}"))),
    };
    Ok(event)
}

fn parse_expect(
    table: &Table,
    step: Ctx,
    cluster: &ClusterSpec,
    step_node: Option<Node>,
) -> Result<Expect, ScenarioError> {
    let ctx = Ctx { step: step.step, prefix: "expect." };
    check_keys(table, &EXPECT_KEYS, ctx, "")?;
    let count = |key: &str| table.get(key).map(|v| as_count::<u64>(v, &ctx.field(key), ctx, 0)).transpose();
    let sub_table = |key: &str| table.get(key).map(|v| as_table(v, &ctx.field(key), ctx)).transpose();
    let blocks_on = |key: &str, role: Role| -> Result<BTreeMap<Node, u64>, ScenarioError> {
        let mut map = BTreeMap::new();
        for (name, value) in sub_table(key)?.into_iter().flatten() {
            let label = format!("{} key", ctx.field(key));
            let node = resolve_node(name, &label, ctx, cluster, Some(role), "")?;
            map.insert(node, as_count(value, &format!("{}.{name}", ctx.field(key)), ctx, 0)?);
        }
        Ok(map)
    };
    let by_request = |key: &str, names: &[&str]| -> Result<BTreeMap<RequestId, (&str, String)>, ScenarioError> {
        let mut map = BTreeMap::new();
        for (id, value) in sub_table(key)?.into_iter().flatten() {
            let field = format!("{}.{id}", ctx.field(key));
            let request = check_request(id, &format!("{} key", ctx.field(key)), ctx)?;
            let name = as_str(value, &field, ctx)?;
            if !names.contains(&name) {
                return Err(ctx.err(format!("{field} must be one of {}, not {}", names.join(", "), show(value))));
            }
            map.insert(request, (name, field));
        }
        Ok(map)
    };
    let reasons: Vec<&str> = ReleaseReasonName::ALL.iter().map(|r| r.as_str()).collect();
    let states: Vec<&str> = DState::ALL.iter().map(|s| s.as_str()).collect();
    let mut p_released = BTreeMap::new();
    for (request, (name, field)) in by_request("p_released", &reasons)? {
        let reason = ReleaseReasonName::from_name(name).ok_or_else(|| ctx.err(format!("{field}: {name:?}")))?;
        p_released.insert(request, reason);
    }
    let mut d_state = BTreeMap::new();
    for (request, (name, field)) in by_request("d_state", &states)? {
        let state = DState::from_name(name).ok_or_else(|| ctx.err(format!("{field}: {name:?}")))?;
        d_state.insert(request, state);
    }
    let d_state_node = match step_node {
        Some(node) if !d_state.is_empty() && node.role != Role::Decode => {
            return Err(ctx.err(format!(
                "expect.d_state is read on the step's node, and {node:?} is not a decode engine; \
                 check d_state in a step of its own"
            )));
        }
        Some(node) if node.role == Role::Decode => node,
        _ => Node::DECODE0,
    };
    Ok(Expect {
        p_held_blocks: count("p_held_blocks")?,
        p_held_blocks_on: blocks_on("p_held_blocks_on", Role::Prefill)?,
        p_pending: count("p_pending")?,
        p_released,
        d_held_blocks: count("d_held_blocks")?,
        d_held_blocks_on: blocks_on("d_held_blocks_on", Role::Decode)?,
        d_state,
        d_state_node,
        notifications_after_expiry: count("notifications_after_expiry")?,
        ignored_messages: count("ignored_messages")?,
        corrupt_reads: count("corrupt_reads")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn public_dir() -> PathBuf {
        // CI checks `shared/` out beside the repository, at the same relative place.
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/scenarios/public")
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

    #[test]
    fn every_public_scenario_parses() {
        let dir = public_dir();
        assert!(dir.is_dir(), "the public scenarios are missing: {} is not a folder", dir.display());
        let files = scenario_files(&[&dir]).map_err(|e| e.to_string());
        let files = files.as_deref().unwrap_or_else(|e| panic!("{e}"));
        assert!(files.len() >= 11, "expected the public scenarios under {}, found {files:?}", dir.display());
        for file in files {
            if let Err(e) = Scenario::load(file) {
                panic!("{e}");
            }
        }

        let siblings = Scenario::load(dir.join("siblings.toml")).map_err(|e| e.to_string());
        let siblings = siblings.as_ref().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            siblings.steps[0].event,
            Some(Event::Prefill { request: "r1".into(), prompt_tokens: 64, n: 4, node: Node::PREFILL0 })
        );
        let last = siblings.steps[3].expect.as_ref().map(|e| e.p_released.clone()).unwrap_or_default();
        assert_eq!(last.get(&RequestId::new("0_r1")), Some(&ReleaseReasonName::Transferred));
        assert_eq!(last.get(&RequestId::new("3_r1")), Some(&ReleaseReasonName::Sibling));

        let early = Scenario::load(dir.join("early-completion.toml")).map_err(|e| e.to_string());
        let early = early.as_ref().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(early.cluster.worker_handoff, Duration::from_millis(200));
        assert_eq!(early.steps[1].at, Time::from_millis(10));
    }

    #[test]
    fn a_minimal_file_gets_every_default() {
        let s = parse("name = \"minimal\"");
        assert_eq!((s.name.as_str(), s.steps.len()), ("minimal", 0));
        assert_eq!(s.cluster, ClusterSpec::default());
        let c = &s.cluster;
        assert_eq!((c.mode, c.prefillers, c.decoders, c.prefill_tp, c.decode_tp), (TransferMode::Pull, 1, 1, 1, 1));
        assert_eq!((c.prefill_block_size, c.decode_block_size, c.num_kv_heads, c.mla), (16, 16, 8, false));
        assert_eq!((c.prefill_num_blocks, c.decode_num_blocks), (1000, 1000));
        assert_eq!(c.step_interval, Duration::from_millis(10));
        assert_eq!(c.network_latency, Duration::from_millis(1));
        assert_eq!(c.transfer_latency, Duration::from_millis(5));
        assert_eq!(c.worker_handoff, Duration::from_millis(10));
        let p = &s.policy;
        assert_eq!(p.kv_lease_duration, Duration::from_secs(30));
        assert_eq!(p.heartbeat_interval, Duration::from_secs(5));
        assert_eq!(p.lease_extension, Duration::from_secs(20));
        assert_eq!(p.decoder_kv_blocks_ttl, Duration::from_secs(480));
        assert_eq!(p.push_registration_timeout, Duration::from_secs(480));
        assert_eq!(p.kv_load_failure_policy, FailurePolicy::Recompute);
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

        let s = parse(&steps(
            "[cluster]\nmode = \"push\"\nstep_interval_ms = 20\nworker_handoff_ms = 0.5\nmla = true\n\
             [policy]\nkv_lease_duration_s = 60\nheartbeat_interval_s = 1\nlease_extension_s = 7.5\n\
             push_registration_timeout_s = 3\nkv_load_failure_policy = \"fail\"\nearly_notification_capacity = 0",
        ));
        assert_eq!((s.cluster.mode, s.cluster.mla), (TransferMode::Push, true));
        assert_eq!(s.cluster.worker_handoff, Duration::from_micros(500));
        assert_eq!(s.policy.heartbeat_interval, Duration::from_secs(1));
        assert_eq!(s.policy.lease_extension, Duration::from_millis(7500));
        assert_eq!(s.policy.push_registration_timeout, Duration::from_secs(3));
        assert_eq!(s.policy.kv_load_failure_policy, FailurePolicy::Fail);
        assert_eq!(s.policy.early_notification_capacity, 0);
    }

    #[test]
    fn every_event_parses_with_its_defaults() {
        let s = parse(&steps(
            r#"
            [cluster]
            prefillers = 2
            decoders = 2

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
            at_s = 7
            "#,
        ));
        let r = RequestId::new;
        let events: Vec<Option<Event>> = s.steps.iter().map(|s| s.event.clone()).collect();
        let expected = vec![
            Some(Event::Prefill { request: r("r1"), prompt_tokens: 64, n: 1, node: Node::PREFILL0 }),
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
            Some(Event::Schedule { request: r("r1"), node: Node::DECODE0, prefix_hit: true }),
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
            Some(Event::FailTransfer { request: r("r1"), node: Node::decode(1) }),
            Some(Event::Garbage { from: Node::decode(1), to: Node::PREFILL0, bytes: b"%%".to_vec() }),
            Some(Event::Wait),
            None,
        ];
        assert_eq!(events, expected);
        let names: Vec<&str> = events.iter().flatten().map(Event::name).collect();
        let format_names: Vec<&str> = EVENTS.iter().map(|(n, _)| *n).collect();
        let mut unique = names.clone();
        unique.dedup();
        assert_eq!(unique, format_names);
        assert_eq!(s.steps[1].at, Time::from_millis(10));
        assert!(s.steps.iter().all(|s| s.expect.is_none()));
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
            expect = { p_held_blocks = 4, p_held_blocks_on = { prefill1 = 3 }, p_pending = 1, p_released = { r1 = "transferred", r2 = "expired", r3 = "rejected", r4 = "aborted", "0_r5" = "sibling", r6 = "peer_lost" }, d_held_blocks = 0, d_held_blocks_on = { decode1 = 2 }, d_state = { r1 = "waiting", r2 = "loading", r3 = "ready", r4 = "failed", r5 = "recompute", r6 = "gone" }, notifications_after_expiry = 0, ignored_messages = 2, corrupt_reads = 1 }
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
            d_state = { r1 = "ready" }
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
                (r("0_r5"), ReleaseReasonName::Sibling),
                (r("r1"), ReleaseReasonName::Transferred),
                (r("r2"), ReleaseReasonName::Expired),
                (r("r3"), ReleaseReasonName::Rejected),
                (r("r4"), ReleaseReasonName::Aborted),
                (r("r6"), ReleaseReasonName::PeerLost),
            ]
        );
        assert_eq!(e.d_state.into_values().collect::<Vec<_>>(), DState::ALL.to_vec());
        assert_eq!(e.d_state_node, Node::DECODE0);
        assert_eq!((e.notifications_after_expiry, e.ignored_messages, e.corrupt_reads), (Some(0), Some(2), Some(1)));

        let on_decode1 = |i: usize| s.steps[i].expect.as_ref().map(|e| e.d_state_node);
        assert_eq!((on_decode1(1), on_decode1(2)), (Some(Node::decode(1)), Some(Node::decode(1))));
        let empty = s.steps[3].expect.as_ref();
        assert_eq!(empty.map(Expect::is_empty), Some(true));
        assert_eq!(empty.map(|e| e.d_state_node), Some(Node::DECODE0));
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
            ("title = \"x\"".into(), "unknown key \"title\" (expected one of: name, cluster, policy, step)"),
            (String::new(), "name is missing"),
            ("name = 3".into(), "name must be a string, not 3"),
            (steps("cluster = 3"), "cluster must be a table, not 3"),
            (steps("step = 3"), "step must be an array of tables ([[step]]), not 3"),
            (steps("step = [1]"), "step 1: must be a table ([[step]]), not 1"),
            (steps("[cluster]\nprefillerz = 2"), "unknown key \"cluster.prefillerz\" (expected one of: mode, "),
            (steps("[policy]\nlease_s = 2"), "unknown key \"policy.lease_s\" (expected one of: kv_lease_duration_s, "),
            (steps("[cluster]\nprefill_tp = 0"), "cluster.prefill_tp must be at least 1, not 0"),
            (steps("[cluster]\ndecode_block_size = -16"), "cluster.decode_block_size must be at least 1, not -16"),
            (steps("[cluster]\ndecoders = 5000000000"), "cluster.decoders 5000000000 is too large (at most 4294967295)"),
            (steps("[cluster]\nnum_kv_heads = 8.0"), "cluster.num_kv_heads must be an integer, not 8.0"),
            (steps("[cluster]\nmla = \"yes\""), "cluster.mla must be true or false, not \"yes\""),
            (steps("[cluster]\nmode = \"teleport\""), "cluster.mode must be \"pull\" or \"push\", not \"teleport\""),
            (steps("[cluster]\nstep_interval_ms = 0"), "cluster.step_interval_ms must be positive, not 0"),
            (steps("[cluster]\nnetwork_latency_ms = -1"), "cluster.network_latency_ms must not be negative, not -1"),
            (steps("[policy]\nkv_lease_duration_s = -30"), "policy.kv_lease_duration_s must not be negative, not -30"),
            (steps("[policy]\nkv_lease_duration_s = 0"), "policy.kv_lease_duration_s must be positive, not 0"),
            (steps("[policy]\nheartbeat_interval_s = 0"), "policy.heartbeat_interval_s must be positive, not 0"),
            (steps("[policy]\ndecoder_kv_blocks_ttl_s = inf"), "policy.decoder_kv_blocks_ttl_s must be finite, not inf"),
            (steps("[policy]\nkv_load_failure_policy = \"retry\""), "policy.kv_load_failure_policy must be \"fail\""),
            (steps("[policy]\nearly_notification_capacity = -1"), "policy.early_notification_capacity must be at"),
            (steps("[[step]]\nat_s = 1\ndo = \"explode\""), "step 1: unknown event \"explode\" (expected one of: prefill, "),
            (steps("[[step]]\nat_s = 1\ndo = 3"), "step 1: do must be a string, not 3"),
            (
                steps("[[step]]\nat_s = 0\ndo = \"prefill\"\nrequest = \"r1\"\nprompt = 64"),
                "step 1: unknown key \"prompt\" for do = \"prefill\" (expected one of: at_s, do, expect, request, ",
            ),
            (
                steps("[[step]]\nat_s = 0\nrequest = \"r1\""),
                "step 1: unknown key \"request\" for a step without do (expected one of: at_s, do, expect, node)",
            ),
            (
                steps(&format!("{prefill}expect = {{ p_held = 4 }}")),
                "step 1: unknown key \"expect.p_held\" (expected one of: p_held_blocks, ",
            ),
            (steps("[[step]]\ndo = \"wait\""), "step 1: at_s is missing"),
            (steps("[[step]]\nat_s = -1.0"), "step 1: at_s must not be negative, not -1.0"),
            (steps("[[step]]\nat_s = nan"), "step 1: at_s must be finite, not NaN"),
            (steps("[[step]]\nat_s = 1e30"), "step 1: at_s 1e30 is too large"),
            (steps("[[step]]\nat_s = \"1\""), "step 1: at_s must be a number, not \"1\""),
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
                steps("[[step]]\nat_s = 0\ndo = \"prefill\"\nrequest = \"r1\""),
                "step 1: do = \"prefill\" needs prompt_tokens",
            ),
            (steps("[[step]]\nat_s = 0\ndo = \"schedule\""), "step 1: do = \"schedule\" needs request"),
            (steps("[[step]]\nat_s = 0\ndo = \"abort\"\nrequest = \"r1\""), "step 1: do = \"abort\" needs node"),
            (steps("[[step]]\nat_s = 0\ndo = \"crash\""), "step 1: do = \"crash\" needs node"),
            (
                steps("[[step]]\nat_s = 0\ndo = \"garbage\"\nfrom = \"decode0\"\nto = \"prefill0\""),
                "step 1: do = \"garbage\" needs bytes",
            ),
            (
                steps("[[step]]\nat_s = 0\ndo = \"partition\"\na = \"decode0\"\nb = \"prefill0\""),
                "step 1: do = \"partition\" needs until_s",
            ),
            (
                steps("[[step]]\nat_s = 0\ndo = \"delay\"\na = \"decode0\"\nb = \"prefill0\"\nuntil_s = 1"),
                "step 1: do = \"delay\" needs by_ms",
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
                "step 1: prompt_tokens must be an integer, not \"64\"",
            ),
            (
                steps("[[step]]\nat_s = 0\ndo = \"prefill\"\nrequest = \"\"\nprompt_tokens = 64"),
                "step 1: request must not be empty",
            ),
            (
                steps("[[step]]\nat_s = 0\ndo = \"schedule\"\nrequest = \"r1\"\nprefix_hit = 1"),
                "step 1: prefix_hit must be true or false, not 1",
            ),
            (steps(&format!("{prefill}expect = 4")), "step 1: expect must be a table, not 4"),
            (
                steps(&format!("{prefill}expect = {{ p_held_blocks = -1 }}")),
                "step 1: expect.p_held_blocks must be at least 0, not -1",
            ),
            (
                steps(&format!("{prefill}expect = {{ p_released = {{ r1 = \"gone\" }} }}")),
                "step 1: expect.p_released.r1 must be one of transferred, expired, rejected, aborted, sibling, \
                 peer_lost, not \"gone\"",
            ),
            (
                steps(&format!("{prefill}expect = {{ d_state = {{ r1 = \"done\" }} }}")),
                "step 1: expect.d_state.r1 must be one of waiting, loading, ready, failed, recompute, gone, not \"done\"",
            ),
            (
                steps(&format!("{prefill}expect = {{ p_released = \"r1\" }}")),
                "step 1: expect.p_released must be a table, not \"r1\"",
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
            e.as_deref().and_then(|e| e.split(" (expected").next()),
            Some(format!("{}: step 2: unknown event \"explode\"", file.display()).as_str())
        );
        let location = Scenario::load(&file).err().and_then(|e| e.location().cloned());
        assert_eq!(location, Some(Location { file: Some(file.clone()), step: Some(2) }));

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
    fn names_read_back_as_the_format_writes_them() {
        for reason in ReleaseReasonName::ALL {
            assert_eq!(ReleaseReasonName::from_name(reason.as_str()), Some(reason));
            assert_eq!(reason.to_string(), reason.as_str());
        }
        for state in DState::ALL {
            assert_eq!(DState::from_name(state.as_str()), Some(state));
        }
        assert_eq!(ReleaseReasonName::PeerLost.to_string(), "peer_lost");
        assert_eq!(ReleaseReasonName::from_name("PeerLost"), None);
        assert_eq!(
            (TransferMode::Push.to_string(), FailurePolicy::Recompute.to_string()),
            ("push".into(), "recompute".into())
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
