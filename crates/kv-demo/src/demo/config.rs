//! The demo's settings: [`DemoConfig`], the run the router drives, and [`DemoArgs`], the flags
//! of `cargo xtask demo` that change it, checked by [`DemoConfig::validate`] before anything
//! starts.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Result};
use clap::{Args, Parser, ValueEnum};
use kv_core::PoolShape;

use crate::proto::{AttackPlan, EngineModel, Model, NodeConfig, NodeRole, TransportKind};

/// The flags of `cargo xtask demo`; the defaults are [`DemoConfig::default`]'s.
#[derive(Parser, Debug)]
#[command(name = "cargo xtask demo")]
pub struct DemoArgs {
    /// Pull (D reads P's blocks) or push (P writes into D's).
    #[arg(long, value_enum, default_value_t = Mode::Pull)]
    mode: Mode,
    /// D engines.
    #[arg(long, value_name = "N", default_value_t = DemoConfig::default().decoders)]
    decoders: u32,
    /// Requests the router sends.
    #[arg(long, value_name = "N", default_value_t = DemoConfig::default().requests)]
    requests: u32,
    /// The workload's seed.
    #[arg(long, value_name = "N", default_value_t = DemoConfig::default().seed)]
    seed: u64,
    /// Requests in flight at once (with --rate, at most).
    #[arg(long, value_name = "N", default_value_t = DemoConfig::default().concurrency)]
    concurrency: u32,
    /// Open loop: requests arrive at this many a second, evenly spaced, whether or not
    /// earlier ones have ended (up to --concurrency in flight); without it the router sends
    /// a request whenever one ends (closed loop).
    #[arg(long, value_name = "PER_S")]
    rate: Option<f64>,
    /// The shortest prompt, in tokens (lengths are drawn log-uniformly).
    #[arg(long, value_name = "N", default_value_t = DemoConfig::default().min_tokens)]
    min_tokens: u64,
    /// The longest prompt, in tokens.
    #[arg(long, value_name = "N", default_value_t = DemoConfig::default().max_tokens)]
    max_tokens: u64,
    /// The fraction of single-sample requests (n = 1) of two D blocks or more that arrive on D
    /// as partial prefix hits: D's own prefix cache holds a random whole number of their
    /// blocks (at least one, not all), and D loads only the rest from P (in push mode P
    /// writes only those). 0 sends none.
    #[arg(long, value_name = "F", default_value_t = DemoConfig::default().partial_rate)]
    partial_rate: f64,
    /// P's prefill compute, simulated: microseconds per prompt token, on one GPU that runs
    /// one prompt at a time (0: none beyond filling the blocks).
    #[arg(long, value_name = "US", default_value_t = DemoConfig::default().prefill_us_per_token)]
    prefill_us_per_token: u64,
    /// With simulated compute, P computes each prompt in chunks of this many tokens and
    /// reports each as it ends; in push mode P writes a chunk's blocks into D's while it
    /// computes the next (0: no chunks).
    #[arg(long, value_name = "TOKENS", default_value_t = DemoConfig::default().prefill_chunk_tokens)]
    prefill_chunk_tokens: u64,
    /// The model's layers (8 KV heads of 128, bf16; or, with --mla, one latent of 576);
    /// 32 by default. With --model tiny-llama, its layers (4 by default, at most 32).
    #[arg(long, value_name = "N")]
    layers: Option<u32>,
    /// Run a real model instead of filling blocks with pattern bytes: P computes each prompt
    /// with it (in chunks of --prefill-chunk-tokens), D decodes from the KV it loaded, and the
    /// report compares every token, and the prompt's KV, with one engine's.
    #[arg(long, value_enum, value_name = "MODEL")]
    model: Option<ModelKind>,
    /// With --model: tokens D decodes after P's first.
    #[arg(long, value_name = "N", default_value_t = 16)]
    generate: u32,
    /// With --model: P reports a chunk's blocks when the chunk is whole, and push mode writes
    /// them then, instead of each layer of the chunk as the model stores it.
    #[arg(long)]
    chunk_writes: bool,
    /// With --model: also write the model where Hugging Face's `LlamaForCausalLM` loads it
    /// (config.json, model.safetensors), so that transformers can check the tokens.
    #[arg(long, value_name = "DIR")]
    save_model: Option<PathBuf>,
    #[command(flatten)]
    topology: TopologyArgs,
    /// Blocks in each engine's pool.
    #[arg(long, value_name = "N", default_value_t = DemoConfig::default().blocks)]
    blocks: u32,
    /// The lease P holds an export under, in milliseconds.
    #[arg(long, value_name = "N", default_value_t = DemoConfig::default().lease_ms)]
    lease_ms: u64,
    /// Leaves every D engine running (by default one is killed and restarted part-way).
    #[arg(long)]
    no_kill: bool,
    /// Stops decode0 with SIGSTOP N times, each for 1.5 leases, with its reads in flight.
    #[arg(long, value_name = "N", default_value_t = DemoConfig::default().pause_decode)]
    pause_decode: u32,
    /// Stops P once, past D's push watchdog but within D's quarantine, with its writes in flight.
    #[arg(long)]
    pause_prefill: bool,
    /// Stops the router itself (this process) once, for two leases, while requests are in
    /// flight: the engines must neither strand nor lose blocks meanwhile.
    #[arg(long)]
    pause_router: bool,
    /// Kills P with SIGKILL half-way (in push mode with its writes in flight), and restarts it.
    #[arg(long)]
    kill_prefill: bool,
    /// The transport the engines move KV with: NIXL over UCX, or plain TCP (the baseline).
    #[arg(long, value_enum, default_value_t = TransportKind::Nixl)]
    transport: TransportKind,
    /// Where the engines run: all on loopback, or each in a network namespace of its own
    /// (root only), joined by a bridge, with UCX limited to TCP.
    #[arg(long, value_enum, default_value_t = Hosts::Loopback)]
    hosts: Hosts,
    /// How engines find each other: the router hands out addresses and a peer is lost when
    /// its side channel closes (static), or each engine publishes itself in a real etcd server
    /// that the run starts, under a lease, and one whose lease lapses is lost (etcd).
    #[arg(long, value_enum, default_value_t = DiscoveryKind::Static)]
    discovery: DiscoveryKind,
    /// The etcd lease TTL of an engine's registration, in whole seconds.
    #[arg(long, value_name = "S", default_value_t = DemoConfig::default().etcd_ttl_s)]
    etcd_ttl_s: u64,
    /// The killed D dies as a host does: its veth is deleted (no FIN reaches P), then it is
    /// SIGKILLed, and it stays dead; P must release its exports when its etcd lease lapses.
    /// Needs --hosts netns and --discovery etcd.
    #[arg(long)]
    kill_silently: bool,
    /// Prints each engine's metrics endpoint (http://ADDR/metrics, Prometheus's text format)
    /// to stderr as the engine comes up, to scrape or curl during the run.
    #[arg(long)]
    metrics: bool,
    /// Prints the report as one JSON object.
    #[arg(long)]
    pub json: bool,
    /// Also writes the report, as one JSON object, to FILE.
    #[arg(long, value_name = "FILE")]
    pub json_out: Option<PathBuf>,
}

/// The models `--model` runs.
#[derive(Clone, Copy, PartialEq, Eq, Debug, ValueEnum)]
pub enum ModelKind {
    /// kv-model's tiny-llama: a Llama-architecture transformer of 4 layers, hidden 256, 8 query
    /// heads over 4 KV heads of 32, vocabulary 4096, f32, its weights drawn from a seed.
    TinyLlama,
}

/// A run with a real model (`--model`): what D generates, and where the model is written.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelRun {
    /// Tokens D decodes after P's first.
    pub generate: u32,
    /// Where the model is written as transformers loads it, if anywhere.
    pub save_dir: Option<PathBuf>,
    /// P reports each layer of a chunk as the model stores it (`--chunk-writes` turns it off).
    pub layer_writes: bool,
}

/// The seed tiny-llama's weights are drawn from in every run.
pub const MODEL_SEED: u64 = 7;

/// tiny-llama's own layers (kv-model's `ModelConfig::TINY_LLAMA`), unless `--layers` says.
pub const TINY_LLAMA_LAYERS: u32 = 4;

/// How the engines of a run find each other.
#[derive(Clone, Copy, PartialEq, Eq, Debug, ValueEnum)]
pub enum DiscoveryKind {
    /// The router hands P's addresses to D with each request.
    Static,
    /// A real etcd server, started and stopped by the run.
    Etcd,
}

/// The flags that shape the engines, which the demo and the end-to-end bench share.
#[derive(Args, Debug, Clone)]
pub struct TopologyArgs {
    /// MLA: one latent plane per token, as DeepSeek's models cache it, instead of K and V.
    #[arg(long)]
    mla: bool,
    /// P's TP size: ranks, each with its own worker, NIXL agent and part of the pool (its heads).
    #[arg(long, value_name = "N", default_value_t = DemoConfig::default().p_tp)]
    p_tp: u32,
    /// D's TP size; a list (`2,4`) gives the D engines theirs in turn, mixing them behind one P.
    #[arg(long, value_name = "N[,N...]", value_delimiter = ',', default_value = "1")]
    d_tp: Vec<u32>,
    /// Tokens per block on P.
    #[arg(long, value_name = "N", default_value_t = DemoConfig::default().model.block_tokens)]
    p_block_tokens: u32,
    /// Tokens per block on D (a multiple of P's or a whole fraction of them; by default P's).
    #[arg(long, value_name = "N")]
    d_block_tokens: Option<u32>,
}

impl TopologyArgs {
    /// The shapes in words, for reports: `P TP 4, D TP [2, 4], blocks 16/32 tokens, K/V`.
    pub fn describe(&self) -> String {
        let d_block = self.d_block_tokens.unwrap_or(self.p_block_tokens);
        let attention = if self.mla { "MLA" } else { "K/V" };
        format!(
            "P TP {}, D TP {:?}, blocks {}/{d_block} tokens, {attention}",
            self.p_tp, self.d_tp, self.p_block_tokens
        )
    }

    /// `config` with these engines' shapes, its layer count kept.
    pub fn apply(&self, config: DemoConfig) -> DemoConfig {
        let layers = config.model.layers;
        DemoConfig {
            model: if self.mla {
                Model::mla(layers, self.p_block_tokens)
            } else {
                Model { block_tokens: self.p_block_tokens, mla: false, ..config.model }
            },
            d_block_tokens: self.d_block_tokens.unwrap_or(self.p_block_tokens),
            p_tp: self.p_tp,
            d_tp: self.d_tp.clone(),
            ..config
        }
    }
}

/// Where the engines run.
#[derive(Clone, Copy, PartialEq, Eq, Debug, ValueEnum)]
pub enum Hosts {
    /// Every engine on loopback; UCX moves host memory between processes by CMA.
    Loopback,
    /// Each engine in a network namespace of its own, reached over a bridge; UCX over TCP.
    Netns,
}

/// Who moves the bytes: D reads (pull) or P writes (push).
#[derive(Clone, Copy, PartialEq, Eq, Debug, ValueEnum)]
enum Mode {
    Pull,
    Push,
}

impl DemoArgs {
    /// The run these flags ask for; an error names the flags whose values do not fit together.
    pub fn config(&self) -> Result<DemoConfig> {
        let defaults = DemoConfig::default();
        let model = match self.model {
            None => Model { layers: self.layers.unwrap_or(defaults.model.layers), ..defaults.model },
            Some(ModelKind::TinyLlama) => {
                let layers = self.layers.unwrap_or(TINY_LLAMA_LAYERS);
                if layers == 0 || layers > 32 {
                    bail!("--layers {layers} is out of range for --model tiny-llama: 1 to 32");
                }
                if self.topology.mla {
                    bail!("--mla cannot go with --model tiny-llama, which caches K and V (no latent)");
                }
                Model::tiny_llama(layers, defaults.model.block_tokens)
            }
        };
        let engine_model = self.model.map(|_| ModelRun {
            generate: self.generate,
            save_dir: self.save_model.clone(),
            layer_writes: !self.chunk_writes,
        });
        if engine_model.is_none() && self.save_model.is_some() {
            bail!("--save-model writes the model of --model, and no --model was given");
        }
        // The model's requests are each compared, token for token: every one is decoded, so
        // D rejects none and the router aborts none, and each asks for one sample.
        let (reject_rate, abort_rate, sibling_rate) = match engine_model {
            Some(_) => (0.0, 0.0, 0.0),
            None => (defaults.reject_rate, defaults.abort_rate, defaults.sibling_rate),
        };
        let config = DemoConfig {
            engine_model,
            reject_rate,
            abort_rate,
            sibling_rate,
            push: self.mode == Mode::Push,
            decoders: self.decoders,
            requests: self.requests,
            seed: self.seed,
            concurrency: self.concurrency,
            rate: self.rate,
            min_tokens: self.min_tokens,
            max_tokens: self.max_tokens,
            partial_rate: self.partial_rate,
            prefill_us_per_token: self.prefill_us_per_token,
            prefill_chunk_tokens: self.prefill_chunk_tokens,
            model,
            blocks: self.blocks,
            lease_ms: self.lease_ms,
            kill: !self.no_kill,
            pause_decode: self.pause_decode,
            pause_prefill: self.pause_prefill,
            pause_router: self.pause_router,
            kill_prefill: self.kill_prefill,
            transport: self.transport,
            hosts: self.hosts,
            discovery: self.discovery,
            etcd_ttl_s: self.etcd_ttl_s,
            kill_silently: self.kill_silently,
            print_metrics: self.metrics,
            ..defaults
        };
        let config = self.topology.apply(config);
        config.validate()?;
        Ok(config)
    }
}

/// The run's settings; the defaults end within 60 s on a 2-core machine.
#[derive(Clone, Debug, PartialEq)]
pub struct DemoConfig {
    /// Push mode (P writes) instead of pull (D reads).
    pub push: bool,
    /// D engines.
    pub decoders: u32,
    /// Requests the router sends.
    pub requests: u32,
    /// The workload's seed.
    pub seed: u64,
    /// Requests in flight at once (with `rate`, at most).
    pub concurrency: u32,
    /// Open loop: requests a second, evenly spaced (`None`: closed loop).
    pub rate: Option<f64>,
    /// Prompt lengths are drawn log-uniformly from this range.
    pub min_tokens: u64,
    /// See `min_tokens`.
    pub max_tokens: u64,
    /// P's simulated prefill compute, microseconds per prompt token (see `NodeConfig`).
    pub prefill_us_per_token: u64,
    /// Tokens per chunk of P's simulated compute (see `NodeConfig`).
    pub prefill_chunk_tokens: u64,
    /// The model, with P's block size.
    pub model: Model,
    /// D's block size.
    pub d_block_tokens: u32,
    /// P's TP size: its ranks, each with its own worker, transport and part of the pool.
    pub p_tp: u32,
    /// D engine `i`'s TP size is `d_tp[i % d_tp.len()]`.
    pub d_tp: Vec<u32>,
    /// Blocks per engine's pool.
    pub blocks: u32,
    /// `kv_lease_duration`.
    pub lease_ms: u64,
    /// Kill and restart one D engine part-way.
    pub kill: bool,
    /// Times decode0 is stopped (SIGSTOP) for 1.5 leases.
    pub pause_decode: u32,
    /// Stop P once, past D's push watchdog and within its quarantine.
    pub pause_prefill: bool,
    /// Stop the router (this process) once, for two leases.
    pub pause_router: bool,
    /// Kill P with SIGKILL half-way and restart it.
    pub kill_prefill: bool,
    /// Run `kvflow-attack` against P once the engines are up, with these attacks (see
    /// `cargo xtask attack`).
    pub attack: Option<AttackPlan>,
    /// Fractions of requests D rejects, the router aborts, and that ask for n > 1.
    pub reject_rate: f64,
    /// See `reject_rate`.
    pub abort_rate: f64,
    /// See `reject_rate`.
    pub sibling_rate: f64,
    /// The fraction of requests of n = 1 and two D blocks or more that D's own prefix cache
    /// partly holds (pull mode only).
    pub partial_rate: f64,
    /// Stop sending new requests after this long.
    pub time_limit: Duration,
    /// The transport the engines move KV with.
    pub transport: TransportKind,
    /// Where the engines run.
    pub hosts: Hosts,
    /// How the engines find each other.
    pub discovery: DiscoveryKind,
    /// The etcd lease TTL of an engine's registration, in seconds.
    pub etcd_ttl_s: u64,
    /// The killed D's network is cut before it is killed, and it is not restarted.
    pub kill_silently: bool,
    /// Print each engine's metrics endpoint as it comes up.
    pub print_metrics: bool,
    /// Run a real model (`--model`) instead of pattern bytes.
    pub engine_model: Option<ModelRun>,
    /// How often an idle NIXL progress thread wakes, in milliseconds (`None`: the
    /// transport's default); the idle bench compares two.
    pub nixl_progress_ms: Option<u64>,
    /// A soak (`cargo xtask soak`): traffic until its time is up, a fault every minute.
    pub soak: Option<SoakPlan>,
}

/// A soak's length and how often it samples the engine processes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SoakPlan {
    /// Minutes of traffic.
    pub minutes: u32,
    /// Between samples.
    pub sample_every: Duration,
}

impl Default for DemoConfig {
    fn default() -> Self {
        DemoConfig {
            push: false,
            decoders: 2,
            requests: 200,
            seed: 1,
            concurrency: 8,
            rate: None,
            min_tokens: 16,
            max_tokens: 512,
            prefill_us_per_token: 0,
            prefill_chunk_tokens: 64,
            // A Llama-3-8B-like layout: 32 layers, 8 KV heads of 128, bf16, 16-token blocks (2 MiB).
            model: Model::llama3_8b(16),
            d_block_tokens: 16,
            p_tp: 1,
            d_tp: vec![1],
            blocks: 384,
            lease_ms: 4000,
            kill: true,
            pause_decode: 0,
            pause_prefill: false,
            pause_router: false,
            kill_prefill: false,
            transport: TransportKind::Nixl,
            hosts: Hosts::Loopback,
            discovery: DiscoveryKind::Static,
            etcd_ttl_s: 2,
            kill_silently: false,
            print_metrics: false,
            attack: None,
            reject_rate: 0.08,
            abort_rate: 0.08,
            sibling_rate: 0.10,
            partial_rate: 0.15,
            time_limit: Duration::from_secs(40),
            engine_model: None,
            nixl_progress_ms: None,
            soak: None,
        }
    }
}

impl DemoConfig {
    /// Checks that the settings describe a run that can work, naming the flags that set them.
    pub fn validate(&self) -> Result<()> {
        if self.decoders == 0 || self.requests == 0 || self.concurrency == 0 || self.model.layers == 0 {
            bail!(
                "--decoders ({}), --requests ({}), --concurrency ({}) and --layers ({}) must be positive",
                self.decoders,
                self.requests,
                self.concurrency,
                self.model.layers
            );
        }
        if let Some(rate) = self.rate.filter(|r| !(r.is_finite() && *r > 0.0)) {
            bail!("--rate {rate} must be a positive number of requests a second");
        }
        if !(0.0..=1.0).contains(&self.partial_rate) {
            bail!("--partial-rate {} is out of range: it is a fraction, 0 to 1", self.partial_rate);
        }
        if self.min_tokens == 0 || self.min_tokens > self.max_tokens {
            bail!("need 0 < --min-tokens ({}) <= --max-tokens ({})", self.min_tokens, self.max_tokens);
        }
        let tps = std::iter::once(&self.p_tp).chain(&self.d_tp);
        if self.d_tp.is_empty() || tps.clone().any(|&tp| tp == 0 || tp > 64) {
            bail!("--p-tp ({}) and --d-tp ({:?}) must be between 1 and 64", self.p_tp, self.d_tp);
        }
        if self.model.block_tokens == 0 || self.d_block_tokens == 0 {
            bail!(
                "--p-block-tokens ({}) and --d-block-tokens ({}) must be positive",
                self.model.block_tokens,
                self.d_block_tokens
            );
        }
        // The smaller blocks need the most of them.
        let tokens = self.model.block_tokens.min(self.d_block_tokens);
        let largest = self.max_tokens.div_ceil(u64::from(tokens));
        if largest > u64::from(self.blocks) {
            bail!(
                "a prompt of --max-tokens {} needs {largest} blocks of {tokens} tokens, more than a pool of --blocks {}",
                self.max_tokens,
                self.blocks
            );
        }
        if self.attack.is_some() && self.hosts != Hosts::Loopback {
            bail!("the attack runs on loopback, not --hosts netns");
        }
        match self.attack {
            Some(AttackPlan::Storms) if self.transport != TransportKind::Tcp => {
                bail!(
                    "the storms attack the TCP data path; they run against --transport tcp, not {}",
                    self.transport.name()
                )
            }
            Some(AttackPlan::Messages | AttackPlan::MessagesShort | AttackPlan::ContendedFlood { .. })
                if self.transport != TransportKind::Nixl =>
            {
                bail!("the attack drives NIXL itself; it runs against --transport nixl, not {}", self.transport.name())
            }
            _ => {}
        }
        if self.discovery == DiscoveryKind::Etcd && !(2..=60).contains(&self.etcd_ttl_s) {
            bail!("--etcd-ttl-s {} is out of range: etcd's leases last 2 to 60 s here", self.etcd_ttl_s);
        }
        if self.kill_silently {
            if !self.kill || self.hosts != Hosts::Netns || self.discovery != DiscoveryKind::Etcd {
                bail!(
                    "--kill-silently cuts a D engine's veth and needs etcd to see it go: it needs --hosts netns \
                     (not {:?}), --discovery etcd (not {:?}), and no --no-kill",
                    self.hosts,
                    self.discovery
                );
            }
            if self.decoders < 2 {
                bail!("--kill-silently leaves the killed D dead: it needs --decoders 2 or more, not {}", self.decoders);
            }
            // P must release the dead D's exports by its lapse, not by their lease.
            if self.lease_ms < (self.etcd_ttl_s + 2) * 1000 {
                bail!(
                    "--kill-silently needs --lease-ms ({}) of at least --etcd-ttl-s ({}) + 2 s, so that only \
                     the lapse can release the dead D's exports in time",
                    self.lease_ms,
                    self.etcd_ttl_s
                );
            }
        }
        if let Some(run) = &self.engine_model {
            self.validate_model(run)?;
        }
        if self.lease_ms < 600 {
            bail!("--lease-ms {} is too short: heartbeats go every lease / 6 and reads need a margin", self.lease_ms);
        }
        Ok(())
    }

    /// Checks what a run with a real model needs, naming the flags.
    fn validate_model(&self, run: &ModelRun) -> Result<()> {
        if self.prefill_us_per_token > 0 {
            bail!(
                "--prefill-us-per-token {} simulates compute, and --model computes for real: give one of them",
                self.prefill_us_per_token
            );
        }
        if !self.prefill_chunk_tokens.is_multiple_of(u64::from(self.model.block_tokens)) {
            bail!(
                "with --model, P reports a chunk's blocks computed as the chunk ends: --prefill-chunk-tokens {} \
                 must be a whole number of --p-block-tokens {} (or 0, the whole prompt at once)",
                self.prefill_chunk_tokens,
                self.model.block_tokens
            );
        }
        // tiny-llama's positions (its rotary table): the prompt and what D decodes.
        if run.generate == 0 || self.max_tokens + u64::from(run.generate) > 4096 {
            bail!(
                "--generate {} must be positive, and with --max-tokens {} within the model's 4096 positions",
                run.generate,
                self.max_tokens
            );
        }
        // D also holds the tokens it decodes.
        let tokens = self.model.block_tokens.min(self.d_block_tokens);
        let largest = (self.max_tokens + u64::from(run.generate)).div_ceil(u64::from(tokens));
        if largest > u64::from(self.blocks) {
            bail!(
                "a prompt of --max-tokens {} and --generate {} needs {largest} blocks of {tokens} tokens on D, more \
                 than a pool of --blocks {}",
                self.max_tokens,
                run.generate,
                self.blocks
            );
        }
        Ok(())
    }

    /// The stops the run makes: (engine, when that many requests were issued, for how long).
    pub(super) fn pauses(&self) -> VecDeque<Pause> {
        let mut pauses = VecDeque::new();
        let lease = Duration::from_millis(self.lease_ms);
        for k in 0..self.pause_decode {
            let at_issued = self.requests * (k + 1) / (self.pause_decode + 2);
            pauses.push_back(Pause { engine: "decode0".into(), at_issued, length: lease * 3 / 2 });
        }
        if self.pause_prefill {
            // Past the watchdog (decoder_ttl_ms) by half the quarantine (two leases).
            let length = Duration::from_millis(self.node(NodeRole::Decode, "", 0).decoder_ttl_ms) + lease;
            pauses.push_back(Pause { engine: "prefill0".into(), at_issued: self.requests / 4, length });
        }
        if self.pause_router {
            pauses.push_back(Pause { engine: ROUTER.into(), at_issued: self.requests * 9 / 10, length: lease * 2 });
        }
        pauses.make_contiguous().sort_by_key(|p| p.at_issued);
        pauses
    }

    /// The model every engine of the run (and the one-engine reference) runs, if it runs one.
    pub(super) fn node_model(&self) -> Option<EngineModel> {
        let run = self.engine_model.as_ref()?;
        let (seed, layers, generate, layer_progress) = (MODEL_SEED, self.model.layers, run.generate, run.layer_writes);
        Some(EngineModel { seed, layers, generate, layer_progress })
    }

    /// The configuration of engine `name`, incarnation `instance`.
    pub(super) fn node(&self, role: NodeRole, name: &str, instance: u64) -> NodeConfig {
        NodeConfig {
            role,
            name: name.to_owned(),
            instance,
            push: self.push,
            num_blocks: self.blocks,
            model: self.model_of(role),
            lease_ms: self.lease_ms,
            read_safety_margin_ms: self.lease_ms / 4,
            decoder_ttl_ms: self.lease_ms * 5,
            transport: self.transport,
            tp: match role {
                NodeRole::Prefill => self.p_tp,
                NodeRole::Decode => self.decode_tp(name),
            },
            host: None,
            discovery: None,
            metrics_addr: None,
            prefill_us_per_token: self.prefill_us_per_token,
            prefill_chunk_tokens: self.prefill_chunk_tokens,
            engine_model: self.node_model(),
            nixl_progress_ms: self.nixl_progress_ms,
        }
    }

    /// D engine `name`'s blocks: tokens per block, and the bytes of one block over all its
    /// ranks (each rank's part times its TP size: with MLA every rank holds the whole latent).
    pub(super) fn decode_block(&self, name: &str) -> (u32, u64) {
        let model = self.model_of(NodeRole::Decode);
        let (layout, tp) = (model.layout(), self.decode_tp(name).max(1));
        let rank_bytes = PoolShape::new(layout, layout.heads_per_rank(tp), 1).map_or(0, |shape| shape.block_bytes());
        (model.block_tokens, rank_bytes * u64::from(tp))
    }

    /// The TP size of D engine `name` (`decode<i>`): the list's entries in turn.
    fn decode_tp(&self, name: &str) -> u32 {
        let index = name.strip_prefix("decode").and_then(|i| i.parse::<usize>().ok()).unwrap_or(0);
        self.d_tp.get(index % self.d_tp.len().max(1)).copied().unwrap_or(1)
    }

    /// The model as engines of `role` run it: P's or D's block size.
    pub(super) fn model_of(&self, role: NodeRole) -> Model {
        match role {
            NodeRole::Prefill => self.model,
            NodeRole::Decode => Model { block_tokens: self.d_block_tokens, ..self.model },
        }
    }
}

/// The name a [`Pause`] of the router itself goes by.
pub(super) const ROUTER: &str = "router";

/// A stop of one engine (or the router, [`ROUTER`]) with SIGSTOP, then SIGCONT.
#[derive(Clone, Debug)]
pub(super) struct Pause {
    /// The engine stopped.
    pub(super) engine: String,
    /// When: once this many requests were issued.
    pub(super) at_issued: u32,
    /// For how long.
    pub(super) length: Duration,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The run `cargo xtask demo FLAGS` asks for, or the error it prints.
    fn parse(flags: &[&str]) -> Result<DemoConfig, String> {
        let args = DemoArgs::try_parse_from(std::iter::once("demo").chain(flags.iter().copied()));
        args.map_err(|e| e.to_string())?.config().map_err(|e| format!("{e:#}"))
    }

    /// `--model tiny-llama` without `--layers` runs the model kv-model defines, in its own
    /// layers and KV heads (the literals stand in kv-demo because the router's side builds
    /// without kv-model).
    #[cfg(feature = "nixl")]
    #[test]
    fn tiny_llama_runs_in_kv_models_own_layers() {
        let own = kv_model::ModelConfig::TINY_LLAMA;
        assert_eq!(TINY_LLAMA_LAYERS as usize, own.layers);
        let m = parse(&["--model", "tiny-llama"]).unwrap().model;
        assert_eq!(
            (m.layers as usize, m.kv_heads as usize, m.head_dim as usize),
            (own.layers, own.kv_heads, own.head_dim)
        );
    }

    #[test]
    fn no_flags_ask_for_the_default_run() {
        assert_eq!(parse(&[]), Ok(DemoConfig::default()));
    }

    #[test]
    fn the_flags_set_what_they_name() {
        let flags =
            ["--mode", "push", "--requests", "40", "--layers", "4", "--max-tokens", "256", "--lease-ms", "2000"];
        let expected = DemoConfig {
            push: true,
            requests: 40,
            model: Model { layers: 4, ..DemoConfig::default().model },
            max_tokens: 256,
            lease_ms: 2000,
            ..DemoConfig::default()
        };
        assert_eq!(parse(&flags), Ok(expected));
        let flags = ["--decoders", "3", "--seed", "9", "--concurrency", "2", "--min-tokens", "32", "--blocks", "64"];
        let c = parse(&flags).unwrap();
        assert_eq!((c.decoders, c.seed, c.concurrency, c.min_tokens, c.blocks), (3, 9, 2, 32, 64));
        assert_eq!(parse(&["--partial-rate", "0"]).unwrap().partial_rate, 0.0);
        assert_eq!(parse(&["--prefill-us-per-token", "100"]).unwrap().prefill_us_per_token, 100);
        assert_eq!(parse(&[]).unwrap().prefill_us_per_token, 0, "no simulated compute by default");
        assert_eq!(parse(&["--prefill-chunk-tokens", "32"]).unwrap().prefill_chunk_tokens, 32);
        assert_eq!(parse(&["--rate", "12.5"]).unwrap().rate, Some(12.5));
        assert_eq!(parse(&[]).unwrap().rate, None, "closed loop by default");
        assert_eq!(parse(&["--rate", "0"]), Err("--rate 0 must be a positive number of requests a second".into()));
        let c = parse(&["--no-kill", "--pause-decode", "2", "--pause-prefill", "--metrics"]).unwrap();
        assert_eq!((c.kill, c.pause_decode, c.pause_prefill, c.print_metrics), (false, 2, true, true));
    }

    #[test]
    fn a_d_block_is_counted_over_all_of_its_engines_ranks() {
        // 32 layers, K and V, 8 heads of 128, bf16, 16 tokens: 2 MiB however the heads are split.
        let c = parse(&["--d-tp", "1,2"]).unwrap();
        assert_eq!(c.decode_block("decode0"), (16, 2 << 20));
        assert_eq!(c.decode_block("decode1"), (16, 2 << 20));
        // MLA: every rank holds the whole latent (576 bf16 a token), so two ranks hold it twice.
        let c = parse(&["--mla", "--d-tp", "1,2", "--d-block-tokens", "32"]).unwrap();
        assert_eq!(c.decode_block("decode0"), (32, 32 * 576 * 2 * 32));
        assert_eq!(c.decode_block("decode1"), (32, 2 * 32 * 576 * 2 * 32));
    }

    #[test]
    fn a_bad_value_is_an_error_that_names_the_flag_and_the_value() {
        let check = |flags: &[&str], expected: &[&str]| {
            let err = parse(flags).expect_err("a bad value");
            for part in expected {
                assert!(err.contains(part), "{flags:?}: {err:?} does not name {part:?}");
            }
        };
        check(&["--requests", "abc"], &["--requests", "abc"]);
        check(&["--requests", "99999999999"], &["--requests", "99999999999"]);
        check(&["--pause-decode", "4294967296"], &["--pause-decode", "4294967296"]);
        check(&["--mode", "sideways"], &["--mode", "sideways"]);
        check(&["--decoders", "0"], &["--decoders (0)"]);
        check(&["--min-tokens", "600"], &["--min-tokens (600)", "--max-tokens (512)"]);
        check(&["--max-tokens", "8192"], &["--max-tokens 8192", "--blocks 384"]);
        check(&["--lease-ms", "100"], &["--lease-ms 100"]);
        check(&["--partial-rate", "1.5"], &["--partial-rate 1.5"]);
        check(&["--partial-rate", "NaN"], &["--partial-rate NaN"]);
        check(&["--bogus"], &["--bogus"]);
        check(&["--kill-silently"], &["--kill-silently", "--hosts netns", "Loopback", "--discovery etcd"]);
        let silent = ["--kill-silently", "--hosts", "netns", "--discovery", "etcd"];
        check(&[&silent[..], &["--etcd-ttl-s", "3"]].concat(), &["--lease-ms (4000)", "--etcd-ttl-s (3)"]);
        check(&[&silent[..], &["--lease-ms", "5000", "--decoders", "1"]].concat(), &["--decoders 2", "not 1"]);
        check(&["--discovery", "etcd", "--etcd-ttl-s", "1"], &["--etcd-ttl-s 1"]);
        check(&["--model", "tiny-llama", "--layers", "33"], &["--layers 33", "--model tiny-llama", "1 to 32"]);
        check(&["--model", "tiny-llama", "--layers", "0"], &["--layers 0", "1 to 32"]);
        check(&["--model", "tiny-llama", "--mla"], &["--mla", "--model tiny-llama"]);
        check(&["--model", "gpt-9"], &["--model", "gpt-9"]);
        check(&["--model", "tiny-llama", "--prefill-us-per-token", "100"], &["--prefill-us-per-token 100"]);
        check(&["--model", "tiny-llama", "--prefill-chunk-tokens", "24"], &["--prefill-chunk-tokens 24", "16"]);
        check(&["--model", "tiny-llama", "--generate", "0"], &["--generate 0"]);
        check(&["--model", "tiny-llama", "--max-tokens", "4090"], &["--generate 16", "--max-tokens 4090"]);
        check(&["--save-model", "/tmp/m"], &["--save-model", "no --model"]);
    }

    #[test]
    fn model_runs_tiny_llama_at_the_topology_asked() {
        let c = parse(&["--model", "tiny-llama", "--p-tp", "2", "--d-block-tokens", "32", "--generate", "20"]).unwrap();
        assert_eq!(c.model, Model::tiny_llama(4, 16));
        assert_eq!((c.p_tp, c.d_block_tokens), (2, 32));
        assert_eq!(c.model_of(NodeRole::Decode), Model::tiny_llama(4, 32));
        assert_eq!(c.engine_model, Some(ModelRun { generate: 20, save_dir: None, layer_writes: true }));
        assert_eq!((c.reject_rate, c.abort_rate, c.sibling_rate), (0.0, 0.0, 0.0));
        let node = c.node(NodeRole::Decode, "decode0", 1);
        let layer_progress = true;
        assert_eq!(node.engine_model, Some(EngineModel { seed: MODEL_SEED, layers: 4, generate: 20, layer_progress }));
        assert_eq!(parse(&[]).unwrap().node(NodeRole::Prefill, "prefill0", 1).engine_model, None);
        let deep = parse(&["--model", "tiny-llama", "--layers", "8"]).unwrap();
        assert_eq!(deep.model, Model::tiny_llama(8, 16));
        assert_eq!(deep.node(NodeRole::Prefill, "prefill0", 1).engine_model.map(|m| m.layers), Some(8));
    }
}
