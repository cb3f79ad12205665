//! What the router and the engine processes say to each other: one JSON object per line,
//! commands on an engine's stdin, events on its stdout.
//!
//! Times an engine reports (`*_at_ns`) are readings of the host's realtime clock, so that
//! the router can compare them across processes on the one host; durations are measured on
//! each engine's monotonic clock.

use std::io::Write;

use kv_core::{Attention, KvLayout, Placement};
use kv_sched_adapter::{DecodeState, PrefillEngine, ReleaseReason, RemoteRef};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// The environment variable in which the demo hands its engines the cluster key (64 hex
/// digits): never on the command line, which any user of the machine can read.
pub const CLUSTER_KEY_ENV: &str = "KVFLOW_CLUSTER_KEY";

/// Which engine a process runs.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NodeRole {
    /// A prefill engine.
    Prefill,
    /// A decode engine.
    Decode,
}

/// Which `Transport` adapter an engine moves KV with.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum TransportKind {
    /// NIXL over UCX (kv-transport-nixl).
    #[default]
    Nixl,
    /// Plain TCP sockets (kv-transport-tcp), the baseline NIXL is compared against.
    Tcp,
}

impl TransportKind {
    /// Its name on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            TransportKind::Nixl => "nixl",
            TransportKind::Tcp => "tcp",
        }
    }
}

/// The model every engine of a run serves: a K/V-split, HND, layer-major layout.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct Model {
    /// Layers.
    pub layers: u32,
    /// KV heads.
    pub kv_heads: u32,
    /// Elements per head.
    pub head_dim: u32,
    /// The element format.
    pub dtype: kv_core::Dtype,
    /// Tokens per block.
    pub block_tokens: u32,
    /// Multi-head latent attention: one latent plane of `head_dim` (`kv_heads` is 1), as
    /// DeepSeek's models cache it, instead of K and V planes of `kv_heads` heads.
    #[serde(default)]
    pub mla: bool,
}

impl Model {
    /// A Llama-3-8B-like model ([`KvLayout::llama3_8b`]): 32 layers, 8 KV heads of 128, bf16.
    pub fn llama3_8b(block_tokens: u32) -> Model {
        let KvLayout { layers, kv_heads, head_dim, dtype, .. } = KvLayout::llama3_8b(block_tokens);
        Model { layers, kv_heads, head_dim, dtype, block_tokens, mla: false }
    }

    /// tiny-llama's KV (`--model tiny-llama`, kv-model's `ModelConfig::TINY_LLAMA`) in `layers`
    /// layers (its own 4, or more: `--layers`): 4 KV heads of 32, f32. The engines check it
    /// against the model they run.
    pub fn tiny_llama(layers: u32, block_tokens: u32) -> Model {
        Model { layers, kv_heads: 4, head_dim: 32, dtype: kv_core::Dtype::Float32, block_tokens, mla: false }
    }

    /// A DeepSeek-like MLA model of `layers` layers: one latent of 576 bf16 elements (512 of
    /// compressed KV and 64 of rotary key) per token.
    pub fn mla(layers: u32, block_tokens: u32) -> Model {
        Model { layers, kv_heads: 1, head_dim: 576, dtype: kv_core::Dtype::Bfloat16, block_tokens, mla: true }
    }

    /// The layout of this model: K/V split (or MLA), HND, one region per layer (as vLLM's caches).
    pub fn layout(&self) -> KvLayout {
        let split = KvLayout::split_kv(self.layers, self.block_tokens, self.kv_heads, self.head_dim, self.dtype);
        let attention = if self.mla { Attention::Mla } else { Attention::SplitKv };
        KvLayout { placement: Placement::LayerMajor, attention, ..split }
    }
}

/// Everything an engine process is started with (its one argument, as JSON).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct NodeConfig {
    /// P or D.
    pub role: NodeRole,
    /// The engine's id.
    pub name: String,
    /// Its incarnation: 1, and one more at each restart.
    pub instance: u64,
    /// `true` for push mode.
    pub push: bool,
    /// Blocks in its KV pool.
    pub num_blocks: u32,
    /// The model.
    pub model: Model,
    /// `kv_lease_duration`, in milliseconds.
    pub lease_ms: u64,
    /// D's read safety margin before P's deadline, in milliseconds.
    pub read_safety_margin_ms: u64,
    /// `decoder_kv_blocks_ttl` and `push_registration_timeout`, in milliseconds.
    pub decoder_ttl_ms: u64,
    /// The transport adapter.
    pub transport: TransportKind,
    /// TP ranks: one worker, transport and part of the pool each, on a thread of its own.
    #[serde(default = "one")]
    pub tp: u32,
    /// The address its side channels (and TCP data listeners) bind to and peers reach it at:
    /// its network namespace's, or loopback (`None`).
    #[serde(default)]
    pub host: Option<std::net::Ipv4Addr>,
    /// The etcd registry it publishes itself in and watches, if the run has one (`None`: the
    /// static default, in which the router hands out addresses and engines are lost only by
    /// their side channels).
    #[serde(default)]
    pub discovery: Option<EtcdSettings>,
    /// Where it serves its metrics in Prometheus's text format (`GET /metrics`); port 0 takes
    /// any free port, which `Ready` reports. `None`: no metrics (`kvflow-node --metrics-addr`
    /// sets it too).
    #[serde(default)]
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// P's prefill compute, simulated: a prompt of `t` tokens takes `t` times this many
    /// microseconds on P's one GPU, which runs one prompt at a time (its blocks are filled
    /// meanwhile); 0 adds nothing to the filling.
    #[serde(default)]
    pub prefill_us_per_token: u64,
    /// With simulated compute, P computes a prompt in chunks of this many tokens and tells
    /// its connector as each ends (`PrefillScheduler::handle_progress`): in push mode the
    /// finished blocks are written into D's while the rest computes. 0: no chunks (the export
    /// at the end moves everything).
    #[serde(default)]
    pub prefill_chunk_tokens: u64,
    /// A real model instead of pattern bytes (`--model tiny-llama`): P computes each prompt
    /// with it, in chunks of `prefill_chunk_tokens` (the whole prompt at once for 0), and D
    /// decodes from the KV it loaded.
    #[serde(default)]
    pub engine_model: Option<EngineModel>,
    /// How often NIXL's progress thread wakes when idle, in milliseconds (`None`:
    /// kv-transport-nixl's default), for experiments with the idle floor.
    #[serde(default)]
    pub nixl_progress_ms: Option<u64>,
}

/// The model an engine runs (`--model tiny-llama`): kv-model's tiny-llama, its weights drawn
/// from `seed`.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct EngineModel {
    /// The weights' seed.
    pub seed: u64,
    /// Its layers (tiny-llama's 4, or more: `--layers`).
    pub layers: u32,
    /// Tokens D decodes after the first (P's).
    pub generate: u32,
    /// P reports each layer of a chunk to its connector as the model stores it
    /// (`PrefillScheduler::handle_layer_progress`): in push mode each layer goes into D's
    /// blocks while the next computes. Otherwise a chunk is reported once whole.
    #[serde(default)]
    pub layer_progress: bool,
}

/// A greedy choice of the model: the token and its logit's lead over the runner-up.
#[derive(Clone, Copy, PartialEq, Debug, Serialize, Deserialize)]
pub struct Choice {
    /// The token.
    pub token: u32,
    /// Its lead.
    pub margin: f32,
}

/// What D generated for a request from the KV it loaded (`--model`).
#[derive(Clone, PartialEq, Debug, Serialize, Deserialize)]
pub struct Generated {
    /// P's first token, then each D decoded.
    pub ids: Vec<u32>,
    /// The control: the tokens D decodes after the same first token from zeroed KV.
    pub zeroed_ids: Vec<u32>,
    /// kv-model's fingerprint of the prompt's KV as D held it when it began to decode.
    pub kv_fingerprint: u64,
    /// The smallest lead of a token D chose over its runner-up.
    pub min_margin: f32,
    /// When D held both the KV and P's first token (wall clock, ns): it could stream the
    /// first token and decode on.
    pub first_at_ns: u64,
    /// D's decode of the tokens after the first, in nanoseconds.
    pub decode_ns: u64,
}

/// What `kvflow-node --one-engine` computes, read from its stdin: every request in one engine
/// at TP 1, the reference a disaggregated run must equal.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct OneEngineJob {
    /// The model.
    pub model: EngineModel,
    /// P's chunk size (0: the whole prompt at once).
    pub chunk_tokens: u64,
    /// Tokens per block of its pool.
    pub block_tokens: u32,
    /// Writes the model where transformers loads it from, first.
    #[serde(default)]
    pub save_model: Option<std::path::PathBuf>,
    /// Each request's id and prompt.
    pub requests: Vec<(String, Vec<u32>)>,
}

/// One request of a [`OneEngineJob`], as one engine runs it (one line of its stdout each).
#[derive(Clone, PartialEq, Debug, Serialize, Deserialize)]
pub struct OneEngineRun {
    /// The request.
    pub id: String,
    /// The first token and those decoded after it.
    pub ids: Vec<u32>,
    /// The smallest lead of a chosen token.
    pub min_margin: f32,
    /// The prompt's KV's fingerprint.
    pub kv_fingerprint: u64,
    /// The prefill (to the first token) and the decode, in nanoseconds.
    pub prefill_ns: u64,
    /// See `prefill_ns`.
    pub decode_ns: u64,
}

/// Where the run's etcd is and how long an engine's registration outlives its last renewal.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EtcdSettings {
    /// Client URLs (`http://10.77.3.1:2379`).
    pub endpoints: Vec<String>,
    /// The key prefix of this run's records.
    pub prefix: String,
    /// The registration lease's TTL, in whole seconds.
    pub ttl_s: u64,
}

#[cfg(feature = "nixl")]
impl EtcdSettings {
    /// The etcd adapter's configuration for this registry.
    pub fn config(&self) -> kv_discovery_etcd::EtcdConfig {
        kv_discovery_etcd::EtcdConfig {
            endpoints: self.endpoints.clone(),
            prefix: self.prefix.clone(),
            ttl: std::time::Duration::from_secs(self.ttl_s),
        }
    }
}

/// What `kvflow-watch` reports of the registry: one JSON object per line.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum Sighting {
    /// Its watch began.
    Watching,
    /// An engine published itself (or again, as a new incarnation).
    Up {
        /// The engine.
        engine: String,
        /// Its incarnation.
        instance: u64,
        /// Each rank's side-channel address.
        addresses: Vec<String>,
        /// When the watcher saw it (realtime clock, ns).
        at_ns: u64,
    },
    /// An engine's registration is gone (withdrawn, or its lease lapsed).
    Down {
        /// The engine.
        engine: String,
        /// The incarnation that is gone.
        instance: u64,
        /// When the watcher saw it (realtime clock, ns).
        at_ns: u64,
    },
    /// The watch failed; it goes on if it can.
    Error {
        /// What.
        message: String,
    },
}

fn one() -> u32 {
    1
}

impl NodeConfig {
    /// The connector configuration this engine runs with.
    pub fn connector(&self) -> kv_sched_adapter::Config {
        use std::time::Duration;
        let mut c = kv_sched_adapter::Config::with_lease(Duration::from_millis(self.lease_ms));
        c.mode = if self.push { kv_sched_adapter::Mode::Push } else { kv_sched_adapter::Mode::Pull };
        c.read_safety_margin = Duration::from_millis(self.read_safety_margin_ms);
        c.decoder_kv_blocks_ttl = Duration::from_millis(self.decoder_ttl_ms);
        c.push_registration_timeout = Duration::from_millis(self.decoder_ttl_ms);
        c
    }
}

/// How D is done with a request.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// Its KV is in place and every byte checked.
    Ok,
    /// Its KV is in place but a byte is not what P computed.
    Corrupt,
    /// D rejected it before admission.
    Rejected,
    /// The router aborted it.
    Aborted,
    /// Its load failed (policy `fail`).
    Failed,
    /// Its load failed and it is computed again (policy `recompute`).
    Recompute,
    /// D's connector refused the request.
    Refused,
}

impl Outcome {
    /// Its name, as the report writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Corrupt => "corrupt",
            Outcome::Rejected => "rejected",
            Outcome::Aborted => "aborted",
            Outcome::Failed => "failed",
            Outcome::Recompute => "recompute",
            Outcome::Refused => "refused",
        }
    }

    /// How a load that ended in `state` without D's KV in place ended (`Gone`: aborted).
    pub fn ended(state: DecodeState) -> Self {
        match state {
            DecodeState::Recompute => Outcome::Recompute,
            DecodeState::Gone => Outcome::Aborted,
            _ => Outcome::Failed,
        }
    }
}

/// The router's commands.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum Command {
    /// P: run a prompt and export it; with `n > 1`, as siblings `0_id` .. `{n-1}_id`.
    Prefill {
        /// The request.
        id: String,
        /// Its prompt.
        prompt_tokens: u64,
        /// Parallel samples.
        n: u32,
        /// The D engine (name and incarnation) the router has already chosen, if it has.
        #[serde(default)]
        consumer: Option<(String, u64)>,
        /// The prompt's token ids, for an engine that runs a model (`prompt_tokens` of them).
        #[serde(default)]
        prompt_ids: Option<Vec<u32>>,
    },
    /// D: a request with P's parameters enters the waiting queue; D schedules it when it
    /// has blocks.
    Arrive {
        /// D's request id.
        id: String,
        /// P's parameters.
        remote: RemoteRef,
        /// Prompt tokens D's own prefix cache already holds (a whole number of D's blocks,
        /// from the start): D loads only the rest from P. Pull mode only.
        #[serde(default)]
        cached_tokens: u64,
        /// For an engine that runs a model: the prompt's token ids, and P's first token once
        /// P has chosen it (in push mode D hears first, and [`Command::FirstToken`] follows).
        #[serde(default)]
        prompt_ids: Option<Vec<u32>>,
        /// See `prompt_ids`.
        #[serde(default)]
        first_token: Option<u32>,
    },
    /// D, with a model: P's first token for a request that arrived before P chose it.
    FirstToken {
        /// D's request id.
        id: String,
        /// The token.
        token: u32,
    },
    /// D: reject a request before admission.
    Reject {
        /// D's request id.
        id: String,
        /// P's parameters.
        remote: RemoteRef,
    },
    /// D: the router aborts a request.
    Abort {
        /// D's request id.
        id: String,
    },
    /// D: connect to a P engine ahead of its first request.
    Connect {
        /// P's engine, its workers' side-channel addresses by global rank, and its parallelism.
        prefill: PrefillEngine,
    },
    /// Report [`Event::Stats`].
    Stats,
    /// P: die by SIGKILL right after posting the next push write, so that it dies with that
    /// write in flight (the attack suite's kill of P mid-write).
    DieDuringWrite,
    /// Exit.
    Shutdown,
}

/// What an engine reports.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum Event {
    /// Up: its ranks' side channels listen on `ports`, by rank.
    Ready {
        /// Each rank's side-channel port.
        ports: Vec<u16>,
        /// The port its metrics endpoint listens on, if it serves one.
        #[serde(default)]
        metrics_port: Option<u16>,
    },
    /// P exported a request (one event per sibling).
    Exported {
        /// The router's request id (the parent of siblings).
        id: String,
        /// P's parameters for D.
        remote: RemoteRef,
        /// When P finished the prompt.
        finished_at_ns: u64,
        /// With a model: the first token P chose.
        #[serde(default)]
        first: Option<Choice>,
    },
    /// P has no room for the prompt now; the router tries again later.
    Busy {
        /// The request.
        id: String,
    },
    /// P freed an export's blocks.
    Freed {
        /// P's request id.
        id: String,
        /// Why.
        reason: ReleaseReason,
        /// When.
        at_ns: u64,
    },
    /// D is done with a request.
    Outcome {
        /// D's request id.
        id: String,
        /// How it ended.
        outcome: Outcome,
        /// KV bytes D checked (for `ok` and `corrupt`).
        bytes: u64,
        /// When its KV was in place (for `ok` and `corrupt`).
        ready_at_ns: u64,
        /// How long D's engine spent, before the load, checking that the blocks it allocated
        /// for it still held their scrub bytes (the demo's own check for writes after free,
        /// which a real engine does not make), and filling those its prefix cache holds of a
        /// partial prefix hit (a real engine's cache already holds them); that work ended at
        /// `prepared_at_ns`. The KV latency leaves out what of it fell after P finished.
        #[serde(default)]
        scrub_check_ns: u64,
        /// When that work ended (0: none was done).
        #[serde(default)]
        prepared_at_ns: u64,
        /// With a model (`ok` only): what D generated from the KV.
        #[serde(default)]
        generated: Option<Generated>,
    },
    /// A transfer this engine posted ended.
    Transfer {
        /// Bytes moved.
        bytes: u64,
        /// From post to completion, in nanoseconds.
        took_ns: u64,
        /// Whether it succeeded.
        ok: bool,
        /// The request its notification names (P's request id for D's reads), if it carries
        /// a completion; for a push write ahead, the request it writes from.
        #[serde(default)]
        request: Option<String>,
        /// It carries the request's completion (D's reads, P's final writes; not a write
        /// ahead): the transfer that decides when D holds the KV.
        #[serde(default)]
        completes: bool,
    },
    /// The demo's own checks of the pool, on [`Command::Stats`] (the connector's counts are
    /// on the engine's metrics endpoint).
    Stats {
        /// Blocks of the pool still allocated.
        held_blocks: u64,
        /// Blocks found written after they were freed, when allocated again.
        written_after_free: u64,
        /// Peers each rank has completed a handshake with, by rank.
        #[serde(default)]
        connected: Vec<u64>,
        /// P, push: writes its ranks posted while a prompt still computed.
        #[serde(default)]
        writes_ahead: u64,
    },
    /// Something went wrong that the report must show.
    Error {
        /// What.
        message: String,
    },
}

/// The host's realtime clock, in nanoseconds since the epoch.
pub fn wall_ns() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

/// A message given as JSON on a binary's command line (clap's value parser for the one argument
/// of `kvflow-node` and `kvflow-attack`).
pub fn from_json<T: DeserializeOwned>(text: &str) -> Result<T, serde_json::Error> {
    serde_json::from_str(text)
}

/// Writes one message as a line and flushes.
pub fn write_line<T: Serialize>(out: &mut impl Write, message: &T) -> std::io::Result<()> {
    let mut line = serde_json::to_vec(message).map_err(std::io::Error::other)?;
    line.push(b'\n');
    out.write_all(&line)?;
    out.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fields_added_later_default_when_absent() {
        let line = r#"{"Transfer":{"bytes":4,"took_ns":5,"ok":true}}"#;
        let Ok(Event::Transfer { request, .. }) = serde_json::from_str(line) else { panic!("{line}") };
        assert_eq!(request, None);
        let prefill = r#"{"engine":"prefill0","addresses":[],"tp_size":1,"pp_size":1}"#;
        let remote = format!(
            r#"{{"prefill":{prefill},"request":"req-1","instance":null,"prompt_tokens":3,"export":null,"consumer":null}}"#
        );
        let line = format!(r#"{{"Arrive":{{"id":"req-1","remote":{remote}}}}}"#);
        let Ok(Command::Arrive { cached_tokens, .. }) = serde_json::from_str(&line) else { panic!("{line}") };
        assert_eq!(cached_tokens, 0);
    }
}

/// What the router tells the attacker.
#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct AttackConfig {
    /// P's side-channel port on loopback.
    pub p_port: u16,
    /// P's process id, for its resident memory and liveness.
    pub p_pid: u32,
    /// The model every engine serves (a handshake must match it).
    pub model: Model,
    /// A D engine that is alive, and its incarnation: the one to impersonate.
    pub live_decode: String,
    /// See `live_decode`.
    pub live_instance: u64,
    /// The router names requests `req-0` to `req-{requests - 1}`.
    pub requests: u32,
    /// The transport the engines run: the data-path attacks (sniffing, the data-port flood)
    /// are the TCP transport's.
    #[serde(default)]
    pub transport: TransportKind,
    /// P's metrics endpoint's port, if it serves one.
    #[serde(default)]
    pub metrics_port: Option<u16>,
    /// Which attacks to run ([`AttackPlan`]).
    #[serde(default)]
    pub plan: AttackPlan,
}

/// Which attacks a run makes: the attack suite spreads them over its runs, so that each run
/// stays short and what one measures (a storm's throughput) is not blurred by another.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AttackPlan {
    /// Bad bytes, impersonation, foreign messages, floods of idle connections, an oversized
    /// offer, and a key holder's heartbeat flood of distinct ids for `heartbeat_flood_s`.
    #[default]
    Messages,
    /// The same without the heartbeat flood (a push run, after P's stop).
    MessagesShort,
    /// A key holder's heartbeat flood of distinct ids for `heartbeat_flood_s`, with P starved
    /// of CPU: confined to one core beside busy threads, the flood sent from the others.
    ContendedFlood {
        /// The flooder comes back as a new incarnation each time P cuts it off.
        returns: bool,
    },
    /// Storms that must leave the demo available: a churn storm on the side channel, a flood
    /// of idle sockets on the TCP data port, a sniffer that replays what it captured (root),
    /// and idle connections on the metrics endpoint.
    Storms,
}

/// How long the heartbeat flood lasts.
pub const HEARTBEAT_FLOOD_S: u64 = 30;

/// What the attacker says before a storm and after it, so that the router keeps its own faults
/// (engines stopped or killed) out of the storm's window.
#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct StormNotice {
    /// The storm's name.
    pub storm: String,
    /// Whether it begins (else it ended).
    pub active: bool,
}

/// How a key holder fared during a storm or a flood: its handshakes, data connections,
/// heartbeats answered.
#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct Probes {
    /// What was probed, as the key holder's: `handshakes`, `data connections`.
    pub what: String,
    /// How long each may take, in milliseconds.
    #[serde(default = "storm_probe_bound_ms")]
    pub bound_ms: f64,
    /// Those that succeeded within `bound_ms`.
    pub ok: u32,
    /// Those tried.
    pub total: u32,
    /// The slowest that succeeded, in milliseconds.
    pub max_ms: f64,
}

impl Default for Probes {
    fn default() -> Self {
        Probes { what: String::new(), bound_ms: STORM_PROBE_BOUND_MS, ok: 0, total: 0, max_ms: 0.0 }
    }
}

fn storm_probe_bound_ms() -> f64 {
    STORM_PROBE_BOUND_MS
}

/// What one attack tried and what held.
#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct AttackResult {
    /// Its name.
    pub attack: String,
    /// What it did, in words.
    pub tried: String,
    /// Whether what it targeted held (see `detail`).
    pub held: bool,
    /// What was seen.
    pub detail: String,
    /// How long a key holder's handshake with P took during the attack, in milliseconds.
    pub probe_ms: Option<f64>,
    /// P's resident memory at the attack's peak, less before it, in MiB.
    pub rss_growth_mib: f64,
    /// Whether P was alive at the end of the attack.
    pub p_alive: bool,
    /// A storm's probes of a key holder's handshakes or data connections.
    #[serde(default)]
    pub probes: Vec<Probes>,
    /// A storm's window, and a quiet window of the same run just before it, in the router's
    /// wall-clock nanoseconds: the router compares the demo's throughput and failed transfers
    /// in the two.
    #[serde(default)]
    pub window_ns: Option<(u64, u64)>,
    /// See `window_ns`.
    #[serde(default)]
    pub quiet_ns: Option<(u64, u64)>,
}

/// The longest a key holder's handshake may take during an attack.
pub const PROBE_BOUND_MS: f64 = 100.0;
/// The most P's memory may grow under an attack.
pub const RSS_BOUND_MIB: f64 = 64.0;
/// During a storm: each probe of a key holder must succeed within this long...
pub const STORM_PROBE_BOUND_MS: f64 = 1000.0;
/// ... and at least this share of them must.
pub const STORM_PROBES_OK: f64 = 0.95;
/// During a storm the demo keeps at least this share of its throughput in the quiet window.
pub const STORM_THROUGHPUT_SHARE: f64 = 0.5;

impl AttackResult {
    /// Every way the attack got through, in words; empty when everything held.
    pub fn failures(&self) -> Vec<String> {
        let mut f = Vec::new();
        if !self.held {
            f.push(format!("{}: did not hold: {}", self.attack, self.detail));
        }
        if !self.p_alive {
            f.push(format!("{}: P died", self.attack));
        }
        match self.probe_ms {
            // A storm's own probes judge it (its single probe comes as the flood drains).
            _ if !self.probes.is_empty() => {}
            Some(ms) if ms <= PROBE_BOUND_MS => {}
            Some(ms) => {
                f.push(format!("{}: a key holder's handshake took {ms:.1} ms (bound {PROBE_BOUND_MS} ms)", self.attack))
            }
            None => f.push(format!("{}: a key holder could not handshake during the attack", self.attack)),
        }
        if self.rss_growth_mib > RSS_BOUND_MIB {
            f.push(format!("{}: P grew by {:.1} MiB (bound {RSS_BOUND_MIB} MiB)", self.attack, self.rss_growth_mib));
        }
        for p in &self.probes {
            if f64::from(p.ok) < STORM_PROBES_OK * f64::from(p.total) || p.total == 0 {
                f.push(format!(
                    "{}: a key holder's {} succeeded {} of {} within {} ms (bound {:.0}%)",
                    self.attack,
                    p.what,
                    p.ok,
                    p.total,
                    p.bound_ms,
                    STORM_PROBES_OK * 100.0
                ));
            }
        }
        f
    }
}
