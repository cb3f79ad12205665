//! The typed, validated in-memory form of a scenario file, as `docs/scenario-format.md`
//! specifies it.
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
//! This file holds the public types; `read.rs` reads them from the text and places errors in
//! it, `error.rs` holds the errors, `keys.rs` lists the keys the reader accepts ([`Keys`], read
//! off the same serde types), and `tests.rs` the tests.
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

mod error;
mod keys;
mod read;
#[cfg(test)]
mod tests;

use std::cmp::Ordering;
use std::collections::BTreeMap;
use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

use kv_core::{EngineId, RequestId, Role, Time};
use kv_sched_adapter::{Config, DecodeState, Mode, ReleaseReason};
use serde::Deserialize;

pub use error::{Location, ScenarioError};
pub use keys::Keys;

/// One scenario file: a cluster, its lifecycle policy, and the steps that drive it.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct Scenario {
    /// The free-text `name`.
    pub name: String,
    /// The `[cluster]` table, defaults applied.
    pub cluster: ClusterSpec,
    /// The `[policy]` table, defaults applied, as the connectors' settings (`mode` is the
    /// `[cluster]` table's; what the format has no key for keeps [`Config::with_lease`]'s value).
    /// Only what would stop the simulation (a zero lease or heartbeat) is refused when the file
    /// is read; settings the lifecycle code deems unsound together are for it to refuse, as an
    /// engine would.
    pub policy: Config,
    /// The `[[step]]` tables in file order, which is non-decreasing time order.
    pub steps: Vec<Step>,
}

impl Scenario {
    /// Parses and validates a scenario from TOML text; errors carry no file name.
    pub fn from_toml_str(text: &str) -> Result<Scenario, ScenarioError> {
        read::scenario(text)
    }

    /// Reads, parses and validates the scenario file at `path`; errors name the file.
    pub fn load(path: impl AsRef<Path>) -> Result<Scenario, ScenarioError> {
        let path = path.as_ref();
        let text = fs::read_to_string(path).map_err(error::io(path))?;
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
        let meta = fs::metadata(path).map_err(error::io(path))?;
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
    for entry in fs::read_dir(dir).map_err(error::io(dir))? {
        let entry = entry.map_err(error::io(dir))?;
        let path = entry.path();
        let kind = entry.file_type().map_err(error::io(&path))?;
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
    /// `prefill_pp` (1), kvflow's own key: pipeline stages of every prefill engine, each
    /// `prefill_tp` ranks holding its share of the simulated model's layers; it must divide
    /// them.
    pub prefill_pp: u32,
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
            prefill_pp: 1,
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

    /// Workers (agents) of each engine of `role`: its TP ranks in every pipeline stage.
    pub fn workers(&self, role: Role) -> u32 {
        match role {
            Role::Prefill => self.prefill_tp * self.prefill_pp,
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
        #[serde(default = "read::one")]
        n: u32,
        /// `node` (prefill0): a prefill engine.
        #[serde(default = "read::prefill0")]
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
        #[serde(default = "read::decode0")]
        node: Node,
        /// `from` (prefill0): a prefill engine.
        #[serde(default = "read::prefill0")]
        from: Node,
        /// `remote_request` (= `request`): P's id for the request.
        remote_request: RequestId,
        /// `prompt_tokens` (P's, if P has run it; at least 1 when given). The runner checks
        /// that a push-mode `arrive` before P's `prefill` has it.
        prompt_tokens: Option<u64>,
        /// `prefill_pp` (P's), kvflow's own key: the pipeline stages P's parameters claim, as a
        /// router with a stale view would hand them.
        #[serde(default)]
        prefill_pp: Option<u32>,
    },
    /// `schedule`: D allocates blocks and starts the load.
    Schedule {
        /// `request` (required).
        request: RequestId,
        /// `node` (decode0): a decode engine.
        #[serde(default = "read::decode0")]
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
        /// `request` (required): D's id for the request it turns away.
        request: RequestId,
        /// `node` (decode0): the decode engine that rejects it.
        #[serde(default = "read::decode0")]
        node: Node,
        /// `from` (prefill0): the prefill engine whose export the rejection releases.
        #[serde(default = "read::prefill0")]
        from: Node,
        /// `remote_request` (= `request`): P's id, which the rejection names.
        remote_request: RequestId,
        /// `prefill_tp` (P's), kvflow's own key: the TP size P's parameters claim, as a router
        /// with a stale or mistaken view would hand them; one that does not map onto D's TP
        /// leaves the rejection with no P rank to go to.
        #[serde(default)]
        prefill_tp: Option<u32>,
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
        #[serde(rename = "until_s", deserialize_with = "read::secs_time")]
        until: Time,
    },
    /// `delay`: every message from `a` to `b` sent before `until` arrives `by` later.
    Delay {
        /// `a` (required): the sender.
        a: Node,
        /// `b` (required): the receiver, other than `a`.
        b: Node,
        /// `by_ms` (required).
        #[serde(rename = "by_ms", deserialize_with = "read::millis")]
        by: Duration,
        /// `until_s` (required): not before the step's `at_s`.
        #[serde(rename = "until_s", deserialize_with = "read::secs_time")]
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
        #[serde(deserialize_with = "read::utf8")]
        bytes: Vec<u8>,
    },
    /// `wait`: nothing; the step only moves time and checks.
    Wait,
    /// `pause`: the engine stops for a while, as under SIGSTOP, with its side channel open.
    Pause {
        /// `node` (required): any engine.
        node: Node,
        /// `for_s` (required, positive): how long it stays stopped.
        #[serde(rename = "for_s", deserialize_with = "read::secs")]
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
        #[serde(default = "read::one")]
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
    /// `begin_prefill` (kvflow's own event): P starts a chunked
    /// prefill of one prompt; it exports at `finish_prefill` or gives up at `abandon_prefill`.
    BeginPrefill {
        /// `request` (required).
        request: RequestId,
        /// `prompt_tokens` (required, at least 1).
        prompt_tokens: u64,
        /// `node` (prefill0): a prefill engine.
        #[serde(default = "read::prefill0")]
        node: Node,
        /// `consumer` (none): the decode engine the router has already chosen.
        consumer: Option<Node>,
    },
    /// `progress` (the project's own event): P's chunked prefill has computed the prompt's
    /// first `tokens` tokens; in push mode the whole blocks among them are written ahead.
    /// With `layers`, P computes a chunk layer by layer: the tokens up to `tokens` are
    /// computed in model layers `0..layers`, those before `whole_tokens` in every layer.
    Progress {
        /// `request` (required).
        request: RequestId,
        /// `tokens` (required, at least 1).
        tokens: u64,
        /// `layers` (none; at least 1): the model layers computed of the chunk.
        #[serde(default)]
        layers: Option<u32>,
        /// `whole_tokens` (0; only with `layers`, at most `tokens`): the tokens before the
        /// chunk, computed in every layer.
        #[serde(default)]
        whole_tokens: Option<u64>,
        /// `node` (prefill0): a prefill engine.
        #[serde(default = "read::prefill0")]
        node: Node,
    },
    /// `finish_prefill` (the project's own event): P finishes the chunked prefill and exports.
    FinishPrefill {
        /// `request` (required).
        request: RequestId,
        /// `node` (prefill0): a prefill engine.
        #[serde(default = "read::prefill0")]
        node: Node,
    },
    /// `abandon_prefill` (the project's own event): P gives the chunked prefill up.
    AbandonPrefill {
        /// `request` (required).
        request: RequestId,
        /// `node` (prefill0): a prefill engine.
        #[serde(default = "read::prefill0")]
        node: Node,
    },
    /// `lapse` (kvflow's own event): the engine's discovery
    /// registration lapses, and every other running engine learns that its current
    /// incarnation is gone. It crashes and cuts off nothing by itself.
    Lapse {
        /// `node` (required): any engine.
        node: Node,
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
            Event::Lapse { .. } => "lapse",
            Event::BeginPrefill { .. } => "begin_prefill",
            Event::Progress { .. } => "progress",
            Event::FinishPrefill { .. } => "finish_prefill",
            Event::AbandonPrefill { .. } => "abandon_prefill",
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
    /// `rejections_unsent`, kvflow's own key: rejections D could not send because P's
    /// parameters mapped onto no P rank, on all engines.
    pub rejections_unsent: Option<u64>,
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
            rejections_unsent: None,
        }
    }
}

impl Expect {
    /// Whether the expectation checks nothing (`expect = {}`).
    pub fn is_empty(&self) -> bool {
        *self == Expect { d_node: self.d_node, ..Expect::default() }
    }
}
