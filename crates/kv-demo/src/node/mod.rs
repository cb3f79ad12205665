//! An engine process: a P or D engine of `tp` ranks running kvflow's connectors over
//! `NixlTransport` (or `TcpTransport`, the baseline, as its configuration says), with a
//! host-memory KV pool from kv-cuda, one part per rank. It stands in for vLLM's engine core:
//! it allocates blocks (the same ids on every rank), "computes" a prompt by filling its blocks
//! with [`pattern`] bytes (each rank its heads), checks every byte D receives, and frees blocks
//! when the connector says so. With a model (`--model tiny-llama`), P computes each prompt's
//! KV with it instead (kv-model's tiny-llama, in chunks, each KV head in the pool of the rank
//! that owns it), and D decodes from the KV it loaded: the tokens, not the bytes, are checked,
//! against one engine's (`kvflow-node --one-engine`, [`one_engine`]).
//!
//! The router drives it with [`Command`] lines on stdin and reads [`Event`] lines on stdout.
//! The engine's thread keeps the scheduler side and the block allocator; each rank's worker and
//! transport (one NIXL agent per rank) runs on a thread of its own (`rank.rs`), stepped through
//! [`WorkerDriver`] at its own wake-ups (its deadlines, its transport's waker; a few
//! milliseconds at most over NIXL, whose notifications and completions are polled), exactly as
//! an engine's GPU worker would. Commands and reports cross between them on channels, and each
//! side unparks the other. The bytes (filling, checking, scrubbing) are the payload threads'
//! (`payload.rs`), so that the engine's thread, which serves the control plane, never waits
//! behind a prompt's bytes.
//!
//! Freed blocks are scrubbed with [`pattern::SCRUB`] before they can be allocated again: a read
//! after free then delivers scrub bytes and fails D's check. D also checks that a block it
//! allocates again still holds its scrub, so a write into a freed block (a late push) is
//! counted too. A D engine connects to P when the router says (`Command::Connect`), ahead of
//! the first request.
//!
//! This file runs the process (the engine's thread, the pool, kv-engine's `Engine` and its ranks);
//! `prefill.rs` and `decode.rs` are P's and D's sides, `payload.rs` the payload threads,
//! `transport.rs` the transports, `metrics.rs` the metrics endpoint.

use std::collections::{HashMap, VecDeque};
use std::io::BufRead;
use std::process::ExitCode;
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::sync::Arc;
use std::thread::Thread;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context, Result};
use clap::Parser;
use kv_core::discovery::EngineRecord;
use kv_core::{
    AgentName, BlockId, Clock, EngineId, Handshake, Memory, MemoryKind, PeerAddress, PoolShape, RegionBase, RequestId,
    Role, Time,
};
use kv_engine::Engine as Connector;
use kv_engine::{CommandObserver, Found, ProcessClock, RankOptions, Registration};
use kv_sched_adapter::driver::WorkerMachine;
use kv_sched_adapter::{
    Consumer, DecodeEvent, DecodeScheduler, DecodeState, DecodeWorker, LayerProgress, LocalPool, PrefillCommand,
    PrefillEvent, PrefillScheduler, PrefillWorker, RemoteRef,
};
use kv_testkit::BlockPool;

mod decode;
mod metrics;
pub(crate) mod payload;
mod prefill;
mod transport;

use decode::{DecodeSide, Prepared};
use kv_testkit::pattern;
use payload::{Done, ModelOut, PoolBytes, RankPool, Work, Workers};
use prefill::PrefillSide;
use transport::{transport, AheadOf, Ended, TimedTransport};

use crate::proto::{from_json, wall_ns, write_line, Command, EngineModel, Event, NodeConfig, NodeRole, TransportKind};

/// What a command says of the request a P worker writes ahead for (its chunked prefill).
enum WritesAhead {
    /// Nothing.
    Same,
    /// This request has computed these blocks: writes without a notification from them are its
    /// own.
    Computed(String, Vec<BlockId>),
    /// This request is exported or given up: none of its writes go ahead any more.
    Ended(String),
}

/// How long the engine waits for its first publication in etcd before it gives up starting.
const PUBLISH_TIMEOUT: Duration = Duration::from_secs(15);

/// The model name every demo engine serves.
pub const MODEL: &str = "kvflow-demo";

// The longest the engine's thread parks when nothing is due: kv-engine's, as its ranks'.
use kv_engine::IDLE_WAIT;

/// `kvflow-node`'s argument.
#[derive(Parser, Debug)]
#[command(name = "kvflow-node", about = "An engine process of `cargo xtask demo`, P or D, driven by its router")]
struct Args {
    /// The engine's configuration, `kv_demo::proto::NodeConfig` as JSON.
    #[arg(value_name = "CONFIG", value_parser = from_json::<NodeConfig>, required_unless_present = "one_engine")]
    config: Option<NodeConfig>,
    /// Instead of an engine of a run: the reference, every request of the
    /// `kv_demo::proto::OneEngineJob` on stdin in one engine at TP 1, a
    /// `kv_demo::proto::OneEngineRun` line each on stdout.
    #[arg(long, conflicts_with = "config")]
    one_engine: bool,
    /// Serve the connectors' metrics in Prometheus's text format at http://ADDR/metrics
    /// (port 0: any free port, reported in `Ready`); overrides the configuration's
    /// `metrics_addr`.
    #[arg(long, value_name = "ADDR")]
    metrics_addr: Option<std::net::SocketAddr>,
}

/// Runs the engine its argument describes; the exit code says whether it stopped cleanly.
pub fn main() -> ExitCode {
    let Args { config, one_engine: reference, metrics_addr } = Args::parse();
    crate::logging::init();
    let result = match config {
        Some(mut config) if !reference => {
            config.metrics_addr = metrics_addr.or(config.metrics_addr);
            run(&config)
        }
        _ => one_engine(),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            let message = format!("{err:#}");
            let _ = write_line(&mut std::io::stdout(), &Event::Error { message: message.clone() });
            eprintln!("kvflow-node: {message}");
            ExitCode::FAILURE
        }
    }
}

fn run(config: &NodeConfig) -> Result<()> {
    // Every event of this process carries its engine and incarnation.
    let span = tracing::info_span!("node", engine = %config.name, instance = config.instance);
    let _entered = span.enter();
    // Before the first transport: it loads NIXL's runtime.
    if config.transport == TransportKind::Nixl {
        kv_transport_nixl::runtime::prepare(None).context("the NIXL runtime")?;
    }
    // Before the connectors are built: they take their metric handles from the recorder.
    let endpoint = config.metrics_addr.map(metrics::serve).transpose().context("the metrics endpoint")?;
    let metrics_port = endpoint.as_ref().map(|e| e.addr().port());
    let (tx, rx) = mpsc::channel();
    let engine = std::thread::current();
    std::thread::spawn(move || read_commands(tx, engine));
    match config.role {
        NodeRole::Prefill => Node::<PrefillSide>::start(config, metrics_port)?.run(rx),
        NodeRole::Decode => Node::<DecodeSide>::start(config, metrics_port)?.run(rx),
    }
}

/// `kvflow-node --one-engine`: the job on stdin, every request in one engine at TP 1 with P's
/// chunk size, a result line each on stdout.
fn one_engine() -> Result<()> {
    let job: crate::proto::OneEngineJob =
        serde_json::from_reader(std::io::stdin().lock()).context("the one-engine job on stdin")?;
    let model = tiny_llama(job.model)?;
    if let Some(dir) = &job.save_model {
        model.save_hf(dir).with_context(|| format!("writing the model to {}", dir.display()))?;
    }
    let mut out = std::io::stdout();
    for (id, prompt) in job.requests {
        let chunk = if job.chunk_tokens == 0 { prompt.len() } else { job.chunk_tokens as usize };
        let alone = model
            .generate_alone(&prompt, chunk, job.model.generate as usize, job.block_tokens)
            .with_context(|| format!("request {id} in one engine"))?;
        let run = crate::proto::OneEngineRun {
            id,
            ids: alone.tokens,
            min_margin: alone.min_margin,
            kv_fingerprint: alone.kv_fingerprint,
            prefill_ns: alone.prefill.as_nanos() as u64,
            decode_ns: alone.decode.as_nanos() as u64,
        };
        write_line(&mut out, &run)?;
    }
    Ok(())
}

/// kv-model's tiny-llama in the layers and with the weights `model` names.
fn tiny_llama(model: EngineModel) -> Result<kv_model::TinyLlama> {
    Ok(kv_model::TinyLlama::from_seed(tiny_llama_config(model), model.seed)?)
}

fn tiny_llama_config(model: EngineModel) -> kv_model::ModelConfig {
    kv_model::ModelConfig { layers: model.layers as usize, ..kv_model::ModelConfig::TINY_LLAMA }
}

/// The model engine `config` runs, if it runs one; an error if its KV is not the model's.
fn engine_model(config: &NodeConfig) -> Result<Option<kv_model::TinyLlama>> {
    let Some(model) = config.engine_model else { return Ok(None) };
    let c = tiny_llama_config(model);
    let expected = crate::proto::Model::tiny_llama(model.layers, config.model.block_tokens);
    let dims = (c.layers as u32, c.kv_heads as u32, c.head_dim as u32);
    if config.model != expected || dims != (expected.layers, expected.kv_heads, expected.head_dim) {
        return Err(anyhow!("the engine's KV layout {:?} is not tiny-llama's {dims:?} in f32", config.model));
    }
    Ok(Some(tiny_llama(model)?))
}

/// Reads command lines until stdin closes (the router is gone), which means shut down; each
/// command unparks the engine's thread.
fn read_commands(tx: Sender<Result<Command, String>>, engine: Thread) {
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let parsed = serde_json::from_str(&line).map_err(|e| format!("bad command {line:?}: {e}"));
        if tx.send(parsed).is_err() {
            return;
        }
        engine.unpark();
    }
    let _ = tx.send(Ok(Command::Shutdown));
    engine.unpark();
}

/// A rank's worker-to-be: its handshake offer, its pool, and its transport with the port its
/// side channel listens on.
struct RankStart {
    offer: Handshake,
    pool: LocalPool,
    transport: TimedTransport,
    ahead_of: AheadOf,
    port: u16,
}

/// Payload work the engine handed over, as it will take it back.
enum Tag {
    /// P filled part `part` of prompt `id`'s blocks.
    Filled { id: String, part: usize },
    /// D's blocks for a waiting request hold their scrub, and those of its prefix its own
    /// cache holds are filled: the load can start.
    /// `extra`: with a model, the blocks for the tokens D decodes, after the prompt's.
    Prepared { id: RequestId, blocks: Vec<BlockId>, extra: Vec<BlockId>, cached: usize },
    /// D checked the bytes of a request whose KV it held at `ready_at_ns` (with a model:
    /// decoded from them, from `first_at_ns`, when it held P's first token too).
    Verified { id: RequestId, blocks: Vec<BlockId>, ready_at_ns: u64, prepared: Prepared, bytes: u64, first_at_ns: u64 },
    /// Freed blocks hold their scrub: they can be allocated again.
    Scrubbed { blocks: Vec<BlockId> },
}

/// A prompt P runs: its blocks, and when its simulated compute ends.
struct Prompt {
    id: String,
    prompt_tokens: u64,
    n: u32,
    consumer: Option<Consumer>,
    blocks: Vec<BlockId>,
    /// When P's one GPU starts and is done computing it (`prefill_us_per_token`); its export
    /// waits for the end and for its blocks' filling, whichever ends last.
    start: Instant,
    due: Instant,
    /// Blocks per part of the filling (a chunk's; all of them when it is not chunked), and
    /// which parts are filled.
    part_blocks: usize,
    filled: Vec<bool>,
    /// What was last reported computed to the connector (chunked prefill): its blocks, of
    /// them those computed in every layer, and the layers of the rest.
    reported: (usize, usize, u32),
    /// With a model: the prompt's token ids (each part of the filling is a chunk of its
    /// compute, one after another), and the first token once the last chunk chose it.
    model: Option<Arc<[u32]>>,
    first: Option<crate::proto::Choice>,
}

impl Prompt {
    /// Its first blocks whose parts are all filled.
    fn filled_blocks(&self) -> usize {
        let parts = self.filled.iter().take_while(|f| **f).count();
        (parts * self.part_blocks).min(self.blocks.len())
    }

    fn is_filled(&self) -> bool {
        self.filled.iter().all(|f| *f)
    }
}

/// What both engine kinds have: the clock, the pool (every rank's part) and its blocks, the
/// payload threads, and stdout.
struct Engine {
    name: String,
    clock: Arc<ProcessClock>,
    /// The pool's bytes, shared with the payload threads.
    pool: Arc<PoolBytes>,
    blocks: BlockPool,
    /// Blocks freed at least once (and so scrubbed); others were never written.
    scrubbed: Vec<bool>,
    written_after_free: u64,
    payload: Workers<Tag>,
    ended: Receiver<Ended>,
    out: std::io::Stdout,
}

impl Engine {
    /// Allocates every rank's part of the pool, and builds each rank's transport (registered)
    /// and handshake offer.
    fn start(config: &NodeConfig, role: Role) -> Result<(Engine, Vec<RankStart>)> {
        let layout = config.model.layout();
        let tp = config.tp.max(1);
        let shape = PoolShape::new(layout, layout.heads_per_rank(tp), config.num_blocks)
            .map_err(|e| anyhow!("pool of {} blocks: {e}", config.num_blocks))?;
        let clock = Arc::new(ProcessClock::start());
        let mut memory = host_memory();
        let (tx, ended) = mpsc::channel();
        let (mut ranks, mut starts) = (Vec::new(), Vec::new());
        for rank in 0..tp {
            let region = payload::at_low_priority(|| memory.allocate(MemoryKind::Host, shape.pool_bytes()))
                .context("the KV pool")?;
            let regions = (0..shape.region_count())
                .map(|i| RegionBase { addr: region.addr + u64::from(i) * shape.region_len(), len: shape.region_len() })
                .collect();
            let agent = AgentName::new(EngineId::new(config.name.clone()), rank);
            let pool = LocalPool { shape, regions };
            let offer = pool.offer(&agent, tp, config.instance, role, MODEL);
            let (mut inner, port, listeners) = transport(config, &offer, clock.clone())?;
            metrics::watch(&config.name, rank, listeners);
            inner.register(&region).with_context(|| format!("registering rank {rank}'s KV pool"))?;
            let ahead_of = AheadOf::new(pool.clone());
            let transport = TimedTransport::new(inner, tx.clone(), ahead_of.clone());
            ranks.push(RankPool { region, shape, first_head: layout.first_head(rank, tp) });
            starts.push(RankStart { offer, pool, transport, ahead_of, port });
        }
        let pool = Arc::new(PoolBytes::new(memory, ranks, engine_model(config)?));
        let engine = Engine {
            name: config.name.clone(),
            clock,
            payload: Workers::spawn(pool.clone(), std::thread::current())?,
            pool,
            blocks: BlockPool::new(config.num_blocks),
            scrubbed: vec![false; config.num_blocks as usize],
            written_after_free: 0,
            ended,
            out: std::io::stdout(),
        };
        Ok((engine, starts))
    }

    fn now(&self) -> Time {
        self.clock.now()
    }

    fn emit(&mut self, event: &Event) {
        // The router reads every line; if it is gone, stdin closes and the loop ends.
        let _ = write_line(&mut self.out, event);
    }

    /// The layout every rank shares, and the shape of one rank's part of the pool.
    fn shape(&self) -> PoolShape {
        self.pool.shape()
    }

    /// Bytes of `blocks` blocks over every rank.
    fn bytes(&self, blocks: usize) -> u64 {
        blocks as u64 * self.shape().block_bytes() * self.pool.rank_count() as u64
    }

    /// With a model, a request's prompt as the model takes it: `prompt_ids`, checked against
    /// `prompt_tokens`, the model's vocabulary, and its positions with `decoded` tokens after
    /// the prompt; `None` without a model. The error names the request and the values.
    fn model_prompt(
        &self,
        id: &str,
        prompt_tokens: u64,
        prompt_ids: Option<Vec<u32>>,
        decoded: usize,
    ) -> Result<Option<Arc<[u32]>>, String> {
        let Some(model) = self.pool.model() else {
            return match prompt_ids {
                Some(_) => Err(format!("{id}: prompt token ids, but this engine runs no model")),
                None => Ok(None),
            };
        };
        let c = model.config();
        let ids = prompt_ids.ok_or_else(|| format!("{id}: no prompt token ids for the engine's model"))?;
        if ids.len() as u64 != prompt_tokens || ids.is_empty() || ids.len() + decoded > c.max_positions {
            return Err(format!(
                "{id}: {} prompt token ids for a prompt of {prompt_tokens} tokens, and {decoded} to decode (the model \
                 takes up to {} positions)",
                ids.len(),
                c.max_positions
            ));
        }
        if let Some(bad) = ids.iter().find(|&&t| t as usize >= c.vocab) {
            return Err(format!("{id}: prompt token {bad} is outside the model's vocabulary of {}", c.vocab));
        }
        Ok(Some(ids.into()))
    }

    /// Takes `count` blocks, and says which of them were freed before: their scrub is to be
    /// checked (a write into a freed block, a late push, is counted).
    fn allocate(&mut self, count: usize) -> Option<(Vec<BlockId>, Vec<BlockId>)> {
        let blocks = self.blocks.allocate(count)?;
        let freed = blocks.iter().copied().filter(|b| self.scrubbed[b.0 as usize]).collect();
        Some((blocks, freed))
    }

    /// Drops a reference to each block; those now free are scrubbed on every rank before
    /// they can be allocated again.
    fn release(&mut self, blocks: &[BlockId]) -> Result<()> {
        let freed = self.blocks.release_later(blocks).map_err(|b| anyhow!("{}: block {b} freed twice", self.name))?;
        if !freed.is_empty() {
            self.payload.submit(Tag::Scrubbed { blocks: freed.clone() }, Work::Scrub { blocks: freed });
        }
        Ok(())
    }

    /// Takes back the next payload work done, after counting what it found; scrubbed blocks
    /// go back to the pool here, and the rest is the side's.
    fn take_done(&mut self) -> Result<Option<Done<Tag>>> {
        while let Some(done) = self.payload.try_done() {
            if let Some(failed) = done.failed {
                return Err(anyhow!("{}: payload work failed: {failed}", self.name));
            }
            self.written_after_free += done.written_after_free;
            match &done.tag {
                Tag::Scrubbed { blocks } => {
                    for block in blocks {
                        self.scrubbed[block.0 as usize] = true;
                    }
                    self.blocks.give_back(blocks);
                }
                _ => return Ok(Some(done)),
            }
        }
        Ok(None)
    }

    /// Reports the transfers that ended.
    fn report_transfers(&mut self) {
        while let Ok(Ended { bytes, took, ok, request, completes }) = self.ended.try_recv() {
            self.emit(&Event::Transfer { bytes, took_ns: took.as_nanos() as u64, ok, request, completes });
        }
    }

    /// Reports the demo's own checks of the pool, and the peers each rank is connected to.
    fn stats(&mut self, connected: Vec<u64>, writes_ahead: u64) {
        let event = Event::Stats {
            held_blocks: self.blocks.held() as u64,
            written_after_free: self.written_after_free,
            connected,
            writes_ahead,
        };
        self.emit(&event);
    }
}

/// The host-memory pool the demo's engines keep their KV in: kv-cuda's, which hands the
/// transport the region's kind (host memory registers as DRAM).
fn host_memory() -> Box<dyn Memory> {
    Box::new(kv_cuda::CudaMemory::new())
}

/// An engine process, P or D: kv-engine's engine (the connector's scheduler and a thread per
/// rank), the demo's engine around it, and what only its side keeps.
struct Node<S: Side> {
    /// The scheduler, and each TP rank's thread. Declared before `engine`: the ranks'
    /// transports let go of the pool before the memory behind it is freed.
    connector: Connector<S::Scheduler>,
    engine: Engine,
    side: S,
    /// The engine's registration in etcd, and the engines it finds lost; `None` without etcd.
    registration: Option<(Registration, Receiver<Found>)>,
}

/// A command of side `S`'s scheduler for a worker.
type Cmd<S> = <<S as Side>::Worker as WorkerMachine>::Command;

/// What differs between P and D: the worker and its scheduler, and how the side handles the
/// router's commands and the scheduler's events.
trait Side: Sized {
    /// A rank's worker.
    type Worker: WorkerMachine<Report: Send + 'static, Command: Send + 'static> + Send + 'static;
    /// Its scheduler.
    type Scheduler: kv_engine::Scheduler<Worker = Self::Worker, Error: Send + Sync + 'static>;
    /// The role the ranks' handshake offers carry.
    const ROLE: Role;
    /// The side and the scheduler of engine `config`, whose ranks make offers like `offer`
    /// (rank 0's) and listen at `addresses`, by rank.
    fn new(config: &NodeConfig, offer: &Handshake, addresses: Vec<PeerAddress>) -> Result<(Self, Self::Scheduler)>;
    /// The worker of the rank that offers `offer` and keeps `pool`.
    fn worker(config: &NodeConfig, offer: &Handshake, pool: LocalPool) -> Result<Self::Worker>;
    /// What a command says of the request the worker writes ahead for (P's chunked prefill).
    fn writes_ahead(command: &Cmd<Self>) -> WritesAhead {
        let _ = command;
        WritesAhead::Same
    }
    /// Carries out what the scheduler asks until nothing is left.
    fn settle(node: &mut Node<Self>) -> Result<()>;
    /// Handles a command of the router other than `Stats` and `Shutdown`.
    fn handle(node: &mut Node<Self>, command: Command) -> Result<()>;
    /// Takes back payload work done (its tag, what it found, how long it took).
    fn handle_done(node: &mut Node<Self>, done: Done<Tag>) -> Result<()>;
    /// When the side next has something to do by itself, if ever.
    fn next_due(&self) -> Option<Instant> {
        None
    }
}

impl<S: Side> Node<S> {
    /// Starts the engine, its side and a thread per rank, and tells the router it is ready
    /// (and where its metrics are, if it serves them: `metrics_port`).
    fn start(config: &NodeConfig, metrics_port: Option<u16>) -> Result<Self> {
        let (engine, starts) = Engine::start(config, S::ROLE)?;
        let ports: Vec<u16> = starts.iter().map(|r| r.port).collect();
        let ip = config.host.unwrap_or(std::net::Ipv4Addr::LOCALHOST);
        let addresses = ports.iter().map(|port| PeerAddress(format!("{ip}:{port}"))).collect();
        let offer = &starts.first().context("an engine of no ranks")?.offer;
        let (side, scheduler) = S::new(config, offer, addresses).context("the connector")?;
        let (mut ranks, mut observers) = (Vec::new(), Vec::new());
        for start in starts {
            let worker = S::worker(config, &start.offer, start.pool).context("the connector")?;
            ranks.push((worker, Box::new(start.transport) as Box<dyn kv_core::Transport>));
            // The demo names each write ahead for the prompt it writes from (its report).
            let ahead_of = start.ahead_of;
            let observer: CommandObserver<Cmd<S>> = Box::new(move |command| match S::writes_ahead(command) {
                WritesAhead::Same => {}
                WritesAhead::Computed(request, blocks) => ahead_of.computed(&request, &blocks),
                WritesAhead::Ended(request) => ahead_of.ended(&request),
            });
            observers.push(Some(observer));
        }
        let clock: Arc<dyn Clock> = engine.clock.clone();
        let connector = Connector::start_with(scheduler, ranks, clock, |rank| RankOptions {
            observer: observers.get_mut(rank as usize).and_then(Option::take),
            ..RankOptions::default()
        })
        .map_err(|e| anyhow!("{e}"))?;
        let registration = match &config.discovery {
            None => None,
            Some(settings) => {
                let record = EngineRecord {
                    engine: EngineId::new(config.name.clone()),
                    instance: config.instance,
                    role: S::ROLE,
                    addresses: ports.iter().map(|port| format!("{ip}:{port}")).collect(),
                    layout: config.model.layout(),
                    tp_size: config.tp.max(1),
                };
                let config = settings.config();
                let connect = move || kv_discovery_etcd::EtcdDiscovery::connect(config);
                Some(Registration::start(connect, record, std::thread::current(), PUBLISH_TIMEOUT)?)
            }
        };
        let mut node = Node { connector, engine, side, registration };
        node.engine.emit(&Event::Ready { ports, metrics_port });
        Ok(node)
    }

    /// The engine's loop: the router's commands, the ranks' reports, then a wait for the next
    /// thing to do (a command or a report unparks it), until told to stop.
    fn run(mut self, rx: Receiver<Result<Command, String>>) -> Result<()> {
        loop {
            loop {
                match rx.try_recv() {
                    Ok(Ok(command)) => {
                        if !self.handle(command)? {
                            return Ok(());
                        }
                    }
                    Ok(Err(message)) => {
                        let _ = write_line(&mut std::io::stdout(), &Event::Error { message });
                    }
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => return Ok(()),
                }
            }
            self.take_losses()?;
            self.step()?;
            self.engine.report_transfers();
            let due = self.side.next_due().map(|at| at.saturating_duration_since(Instant::now()));
            std::thread::park_timeout(due.map_or(IDLE_WAIT, |d| d.min(IDLE_WAIT)));
        }
    }

    /// Tells every rank of the engines discovery found lost; a registration that cannot go
    /// on ends the engine.
    fn take_losses(&mut self) -> Result<()> {
        let Some((_, found)) = &self.registration else { return Ok(()) };
        while let Ok(found) = found.try_recv() {
            match found {
                Found::Lost { engine, instance } => self.connector.engine_lost(&engine, instance),
                Found::Fatal(message) => return Err(anyhow!("discovery: {message}")),
            }
        }
        Ok(())
    }

    /// Hands the side the payload work done, and carries out what follows (the side's
    /// `settle` polls the connector, which hands the scheduler what the ranks reported).
    fn step(&mut self) -> Result<()> {
        while let Some(done) = self.engine.take_done()? {
            S::handle_done(self, done)?;
        }
        S::settle(self)
    }

    /// Handles one command; `false` to stop.
    fn handle(&mut self, command: Command) -> Result<bool> {
        match command {
            Command::Stats => {
                let status = self.connector.status();
                let connected = status.iter().map(|r| r.connected as u64).collect();
                let writes_ahead = status.iter().map(|r| r.counters.writes_ahead).sum();
                self.engine.stats(connected, writes_ahead);
            }
            Command::Shutdown => return Ok(false),
            Command::DieDuringWrite => transport::die_during_next_write(),
            other => S::handle(self, other)?,
        }
        Ok(true)
    }

    /// Hands the ranks the scheduler's commands and the scheduler the ranks' reports until
    /// neither has more; the scheduler's events for the engine, in order.
    fn poll(&mut self) -> Result<Vec<<S::Scheduler as kv_engine::Scheduler>::Event>> {
        self.connector.poll().map_err(|e| anyhow!("{}: {e}", self.engine.name))
    }
}
