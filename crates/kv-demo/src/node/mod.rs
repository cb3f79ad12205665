//! An engine process: a P or D engine of `tp` ranks running kvflow's connectors over
//! `NixlTransport` (or `TcpTransport`, the baseline, as its configuration says), with a
//! host-memory KV pool from kv-cuda, one part per rank. It stands in for vLLM's engine core:
//! it allocates blocks (the same ids on every rank), "computes" a prompt by filling its blocks
//! with [`pattern`] bytes (each rank its heads), checks every byte D receives, and frees blocks
//! when the connector says so.
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
use kv_engine::{CommandObserver, Found, ProcessClock, RankOptions, RankThread, Registration};
use kv_sched_adapter::driver::{WorkerDriver, WorkerMachine};
use kv_sched_adapter::{
    Consumer, DecodeEvent, DecodeReport, DecodeScheduler, DecodeState, DecodeWorker, LocalPool, PrefillCommand,
    PrefillEvent, PrefillReport, PrefillScheduler, PrefillWorker, RemoteRef,
};
use kv_testkit::BlockPool;

mod metrics;
mod payload;
mod transport;

use crate::proto::{from_json, wall_ns, write_line, Command, Event, NodeConfig, NodeRole, TransportKind};
use kv_testkit::pattern;
use payload::{PoolBytes, RankPool, Work, Workers};
use transport::{transport, AheadOf, Ended, TimedTransport};

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

/// The longest a thread parks when nothing is due: NIXL keeps the notifications nobody asks
/// for (a key holder's stray or forged ones) until a rank fetches them, so an idle rank still
/// fetches now and then. Everything else wakes the threads: the router's commands and the
/// ranks' reports unpark the engine's, the scheduler's commands and the transport's waker a
/// rank's, and a rank's driver's wait time covers its deadlines, transfers in flight and the
/// notifications its worker waits for.
const IDLE_WAIT: Duration = Duration::from_millis(50);

/// `kvflow-node`'s argument.
#[derive(Parser, Debug)]
#[command(name = "kvflow-node", about = "An engine process of `cargo xtask demo`, P or D, driven by its router")]
struct Args {
    /// The engine's configuration, `kv_demo::proto::NodeConfig` as JSON.
    #[arg(value_name = "CONFIG", value_parser = from_json::<NodeConfig>)]
    config: NodeConfig,
    /// Serve the connectors' metrics in Prometheus's text format at http://ADDR/metrics
    /// (port 0: any free port, reported in `Ready`); overrides the configuration's
    /// `metrics_addr`.
    #[arg(long, value_name = "ADDR")]
    metrics_addr: Option<std::net::SocketAddr>,
}

/// Runs the engine its argument describes; the exit code says whether it stopped cleanly.
pub fn main() -> ExitCode {
    let Args { mut config, metrics_addr } = Args::parse();
    config.metrics_addr = metrics_addr.or(config.metrics_addr);
    crate::logging::init();
    match run(&config) {
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
    // Before any thread: it sets the environment NIXL reads.
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
    Prepared { id: RequestId, blocks: Vec<BlockId>, cached: usize },
    /// D checked the bytes of a request whose KV it held at `ready_at_ns`.
    Verified { id: RequestId, blocks: Vec<BlockId>, ready_at_ns: u64, prepared: Prepared, bytes: u64 },
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
    /// Of its blocks, the first ones reported computed to the connector (chunked prefill).
    reported: usize,
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
            let region = memory.allocate(MemoryKind::Host, shape.pool_bytes()).context("the KV pool")?;
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
        let pool = Arc::new(PoolBytes::new(memory, ranks));
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
    fn take_done(&mut self) -> Result<Option<(Tag, Duration, bool)>> {
        while let Some(done) = self.payload.try_done() {
            if let Some(failed) = done.failed {
                return Err(anyhow!("{}: payload work failed: {failed}", self.name));
            }
            self.written_after_free += done.written_after_free;
            match done.tag {
                Tag::Scrubbed { blocks } => {
                    for block in &blocks {
                        self.scrubbed[block.0 as usize] = true;
                    }
                    self.blocks.give_back(&blocks);
                }
                tag => return Ok(Some((tag, done.took, done.intact))),
            }
        }
        Ok(None)
    }

    /// Reports the transfers that ended.
    fn report_transfers(&mut self) {
        while let Ok((bytes, took, ok, request)) = self.ended.try_recv() {
            self.emit(&Event::Transfer { bytes, took_ns: took.as_nanos() as u64, ok, request });
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

/// An engine process, P or D: the engine, its rank's worker, and what only its side keeps.
struct Node<S: Side> {
    /// Each TP rank's thread, by rank. Declared before `engine`: the ranks' transports let go
    /// of the pool before the memory behind it is freed.
    ranks: Vec<RankThread<S::Worker>>,
    engine: Engine,
    /// What the ranks' workers report, by rank.
    reports: Receiver<(u32, <S::Worker as WorkerMachine>::Report)>,
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
    type Worker: WorkerMachine<Report: Send, Command: Send + 'static> + Send + 'static;
    /// The role the ranks' handshake offers carry.
    const ROLE: Role;
    /// The scheduler side of engine `config`, whose ranks make offers like `offer` (rank 0's)
    /// and listen at `addresses`, by rank.
    fn new(config: &NodeConfig, offer: &Handshake, addresses: Vec<PeerAddress>) -> Result<Self>;
    /// The worker of the rank that offers `offer` and keeps `pool`.
    fn worker(config: &NodeConfig, offer: &Handshake, pool: LocalPool) -> Result<Self::Worker>;
    /// What a command says of the request the worker writes ahead for (P's chunked prefill).
    fn writes_ahead(command: &Cmd<Self>) -> WritesAhead {
        let _ = command;
        WritesAhead::Same
    }
    /// Hands the scheduler a report of rank `rank`'s worker.
    fn handle_report(&mut self, rank: u32, report: <Self::Worker as WorkerMachine>::Report) -> Result<()>;
    /// Carries out what the scheduler asks until nothing is left.
    fn settle(node: &mut Node<Self>) -> Result<()>;
    /// Handles a command of the router other than `Stats` and `Shutdown`.
    fn handle(node: &mut Node<Self>, command: Command) -> Result<()>;
    /// Takes back payload work done (`took` from handing it over; `intact` for a check).
    fn handle_done(node: &mut Node<Self>, tag: Tag, took: Duration, intact: bool) -> Result<()>;
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
        let side = S::new(config, offer, addresses).context("the connector")?;
        let (tx, reports) = mpsc::channel();
        let mut ranks = Vec::new();
        for (rank, start) in (0u32..).zip(starts) {
            let worker = S::worker(config, &start.offer, start.pool).context("the connector")?;
            let driver = WorkerDriver::new(worker, Box::new(start.transport));
            // The demo names each write ahead for the prompt it writes from (its report).
            let ahead_of = start.ahead_of;
            let observer: CommandObserver<Cmd<S>> = Box::new(move |command| match S::writes_ahead(command) {
                WritesAhead::Same => {}
                WritesAhead::Computed(request, blocks) => ahead_of.computed(&request, &blocks),
                WritesAhead::Ended(request) => ahead_of.ended(&request),
            });
            let options = RankOptions { idle_wait: IDLE_WAIT, observer: Some(observer) };
            let clock: Arc<dyn Clock> = engine.clock.clone();
            let thread = RankThread::spawn(rank, driver, clock, tx.clone(), std::thread::current(), options)
                .with_context(|| format!("the thread of rank {rank}"))?;
            ranks.push(thread);
        }
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
        let mut node = Node { engine, ranks, reports, side, registration };
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
                Found::Lost { engine, instance } => {
                    for rank in &self.ranks {
                        rank.engine_lost(&engine, instance);
                    }
                }
                Found::Fatal(message) => return Err(anyhow!("discovery: {message}")),
            }
        }
        Ok(())
    }

    /// Hands the scheduler what the ranks reported and the side the payload work done, and
    /// carries out what follows.
    fn step(&mut self) -> Result<()> {
        while let Ok((rank, report)) = self.reports.try_recv() {
            self.side.handle_report(rank, report)?;
        }
        while let Some((tag, took, intact)) = self.engine.take_done()? {
            S::handle_done(self, tag, took, intact)?;
        }
        S::settle(self)
    }

    /// Handles one command; `false` to stop.
    fn handle(&mut self, command: Command) -> Result<bool> {
        match command {
            Command::Stats => {
                let connected = self.ranks.iter().map(|r| r.status().connected as u64).collect();
                let writes_ahead = self.ranks.iter().map(|r| r.status().counters.writes_ahead).sum();
                self.engine.stats(connected, writes_ahead);
            }
            Command::Shutdown => return Ok(false),
            Command::DieDuringWrite => transport::die_during_next_write(),
            other => S::handle(self, other)?,
        }
        Ok(true)
    }

    /// Hands rank `rank`'s worker a command of the scheduler; what it reports comes back
    /// through `reports`.
    fn pass_to_worker(&mut self, rank: u32, command: Cmd<S>) -> Result<()> {
        let worker = self.ranks.get(rank as usize).ok_or_else(|| anyhow!("the scheduler named rank {rank}"))?;
        worker.send(command);
        Ok(())
    }
}

/// P's side: its scheduler, and its simulated GPU.
struct PrefillSide {
    scheduler: PrefillScheduler,
    /// Simulated compute per prompt token.
    per_token: Duration,
    /// When the GPU is done with the prompts it was given.
    gpu_free: Instant,
    /// Prompts on the GPU or being filled, not yet exported, in the GPU's order.
    prompts: Vec<Prompt>,
    /// Tokens per chunk of the simulated compute, each reported as it ends (`None`: no chunks).
    chunk: Option<u64>,
}

impl PrefillSide {
    /// The tokens of `prompt` computed by `now`, in whole chunks (all of them once it is due).
    fn chunked_tokens(&self, prompt: &Prompt, now: Instant) -> u64 {
        let Some(chunk) = self.chunk else { return 0 };
        let per_token = self.per_token.as_nanos().max(1);
        let tokens = (now.saturating_duration_since(prompt.start).as_nanos() / per_token) as u64;
        (tokens / chunk * chunk).min(prompt.prompt_tokens)
    }

    /// When the next chunk of `prompt` ends (its compute's end at the latest).
    fn next_chunk(&self, prompt: &Prompt, now: Instant) -> Instant {
        let Some(chunk) = self.chunk else { return prompt.due };
        let next = self.chunked_tokens(prompt, now) + chunk;
        let at = prompt.start + self.per_token.saturating_mul(u32::try_from(next).unwrap_or(u32::MAX));
        at.min(prompt.due)
    }
}

impl Side for PrefillSide {
    type Worker = PrefillWorker;
    const ROLE: Role = Role::Prefill;

    fn new(config: &NodeConfig, offer: &Handshake, addresses: Vec<PeerAddress>) -> Result<Self> {
        let scheduler = PrefillScheduler::new(offer, addresses, config.connector())?;
        let per_token = Duration::from_micros(config.prefill_us_per_token);
        let chunk = (config.prefill_chunk_tokens > 0 && !per_token.is_zero()).then_some(config.prefill_chunk_tokens);
        Ok(PrefillSide { scheduler, per_token, gpu_free: Instant::now(), prompts: Vec::new(), chunk })
    }

    fn worker(config: &NodeConfig, offer: &Handshake, pool: LocalPool) -> Result<PrefillWorker> {
        Ok(PrefillWorker::new(offer.clone(), config.connector(), pool)?)
    }

    fn writes_ahead(command: &PrefillCommand) -> WritesAhead {
        match command {
            PrefillCommand::Progress { request, blocks, .. } => {
                WritesAhead::Computed(request.as_str().to_owned(), blocks.clone())
            }
            PrefillCommand::Export { request, .. } | PrefillCommand::Abandon { request } => {
                WritesAhead::Ended(request.as_str().to_owned())
            }
        }
    }

    fn handle_report(&mut self, rank: u32, report: PrefillReport) -> Result<()> {
        Ok(self.scheduler.handle_report(rank, report)?)
    }

    fn settle(node: &mut Node<Self>) -> Result<()> {
        let now = Instant::now();
        let mut i = 0;
        while i < node.side.prompts.len() {
            let prompt = &node.side.prompts[i];
            if prompt.due <= now && prompt.is_filled() {
                let prompt = node.side.prompts.remove(i);
                node.computed(prompt)?;
            } else {
                i += 1;
            }
        }
        node.progress(now)?;
        node.drain()
    }

    fn next_due(&self) -> Option<Instant> {
        let now = Instant::now();
        // One computed but not yet filled waits for its filling, which wakes the loop.
        let waiting = self.prompts.iter().filter(|p| p.due > now || p.is_filled());
        waiting.map(|p| self.next_chunk(p, now)).min()
    }

    fn handle(node: &mut Node<Self>, command: Command) -> Result<()> {
        match command {
            Command::Prefill { id, prompt_tokens, n, consumer } => {
                let consumer = consumer.map(|(engine, instance)| Consumer { engine: EngineId::new(engine), instance });
                node.prefill(id, prompt_tokens, n, consumer)?;
            }
            other => node.engine.emit(&Event::Error { message: format!("a prefill engine cannot {other:?}") }),
        }
        Ok(())
    }

    fn handle_done(node: &mut Node<Self>, tag: Tag, _took: Duration, _intact: bool) -> Result<()> {
        match tag {
            Tag::Filled { id, part } => {
                let prompt = node.side.prompts.iter_mut().find(|p| p.id == id);
                let filled = prompt.and_then(|p| p.filled.get_mut(part));
                let filled = filled.ok_or_else(|| anyhow!("filled part {part} of {id}, which P does not compute"))?;
                *filled = true;
                Ok(())
            }
            _ => Err(anyhow!("a prefill engine handed over work it does not do")),
        }
    }
}

impl Node<PrefillSide> {
    /// Starts a prompt: allocates its blocks and hands their filling to the payload threads;
    /// [`Node::computed`] exports them.
    fn prefill(&mut self, id: String, prompt_tokens: u64, n: u32, consumer: Option<Consumer>) -> Result<()> {
        let count = kv_core::blocks_for_tokens(prompt_tokens, self.engine.shape().layout.block_tokens) as usize;
        if count == 0 || n == 0 {
            let message = format!("prefill of {id}: {prompt_tokens} prompt tokens and n = {n}; both must be positive");
            self.engine.emit(&Event::Error { message });
            return Ok(());
        }
        if self.side.prompts.iter().any(|p| p.id == id) {
            self.engine.emit(&Event::Error { message: format!("prefill of {id}: P is computing it already") });
            return Ok(());
        }
        let Some((blocks, freed)) = self.engine.allocate(count) else {
            self.engine.emit(&Event::Busy { id });
            return Ok(());
        };
        let seed = pattern::seed(&self.engine.name, &id);
        // A prompt computed in chunks is filled chunk by chunk, each part on its own payload
        // thread, so that the first chunks are ready for their writes ahead early.
        let block_tokens = u64::from(self.engine.shape().layout.block_tokens.max(1));
        let part_blocks = match self.side.chunk {
            Some(chunk) if n == 1 => usize::try_from(chunk / block_tokens).unwrap_or(usize::MAX).max(1),
            _ => count,
        };
        let parts = blocks.len().div_ceil(part_blocks);
        for (part, part_of) in blocks.chunks(part_blocks).enumerate() {
            let freed = freed.iter().copied().filter(|b| part_of.contains(b)).collect();
            let work = Work::Fill { seed, blocks: part_of.to_vec(), freed, first: part * part_blocks };
            self.engine.payload.submit(Tag::Filled { id: id.clone(), part }, work);
        }
        // One GPU, one prompt at a time: this one starts when the GPU is done with those before.
        let compute = self.side.per_token.saturating_mul(u32::try_from(prompt_tokens).unwrap_or(u32::MAX));
        let start = self.side.gpu_free.max(Instant::now());
        let due = start + compute;
        self.side.gpu_free = due;
        let filled = vec![false; parts];
        let prompt = Prompt { id, prompt_tokens, n, consumer, blocks, start, due, part_blocks, filled, reported: 0 };
        self.side.prompts.push(prompt);
        Ok(())
    }

    /// Tells the connector the blocks of the chunks computed by `now` and filled (a prompt
    /// of siblings is not written ahead: it exports at its end).
    fn progress(&mut self, now: Instant) -> Result<()> {
        let block_tokens = u64::from(self.engine.shape().layout.block_tokens.max(1));
        for i in 0..self.side.prompts.len() {
            let prompt = &self.side.prompts[i];
            let computed = (self.side.chunked_tokens(prompt, now) / block_tokens) as usize;
            let blocks = computed.min(prompt.filled_blocks());
            if prompt.n != 1 || blocks <= prompt.reported {
                continue;
            }
            let (id, done, consumer) =
                (RequestId::new(prompt.id.clone()), prompt.blocks[..blocks].to_vec(), prompt.consumer.clone());
            self.side.prompts[i].reported = blocks;
            self.side.scheduler.handle_progress(id, done, consumer)?;
        }
        Ok(())
    }

    /// A prompt is computed: exports its blocks, once per sibling.
    fn computed(&mut self, prompt: Prompt) -> Result<()> {
        let Prompt { id, prompt_tokens, n, consumer, blocks, .. } = prompt;
        // allocate() took one reference; each further sibling export holds its own.
        for _ in 1..n {
            self.engine.blocks.retain(&blocks);
        }
        let ids: Vec<String> = if n > 1 { (0..n).map(|i| format!("{i}_{id}")).collect() } else { vec![id.clone()] };
        let now = self.engine.now();
        for export in ids {
            let remote = self.side.scheduler.handle_finished(
                now,
                RequestId::new(export),
                blocks.clone(),
                prompt_tokens,
                consumer.clone(),
            )?;
            let event = Event::Exported { id: id.clone(), remote, finished_at_ns: wall_ns() };
            self.engine.emit(&event);
        }
        self.drain()
    }

    /// Carries the scheduler's events to the worker and the pool until none is left.
    fn drain(&mut self) -> Result<()> {
        while let Some(event) = self.side.scheduler.poll_event() {
            match event {
                PrefillEvent::ToWorker { rank, command } => self.pass_to_worker(rank, command)?,
                PrefillEvent::Free { request, blocks, reason } => {
                    self.engine.release(&blocks)?;
                    let event = Event::Freed {
                        id: request.as_str().to_owned(),
                        reason: reason.as_str().to_owned(),
                        at_ns: wall_ns(),
                    };
                    self.engine.emit(&event);
                }
            }
        }
        Ok(())
    }
}

/// A request D knows of.
struct Load {
    remote: RemoteRef,
    /// Prompt tokens D's own prefix cache holds already (the router says so): D loads the rest.
    cached_tokens: u64,
    blocks: Vec<BlockId>,
    aborted: bool,
    /// The demo's own work on `blocks` before the load.
    prepared: Prepared,
}

/// The demo's own work on a load's blocks before it starts: checking the scrub bytes of those
/// freed before, and filling those D's prefix cache holds. The KV latency leaves it out.
#[derive(Clone, Copy, Default, Debug)]
struct Prepared {
    /// From handing the work over to its end.
    took: Duration,
    /// When it ended (wall clock, ns; 0: none was done).
    at_ns: u64,
}

/// D's side: its scheduler, and the requests it knows of.
struct DecodeSide {
    scheduler: DecodeScheduler,
    loads: HashMap<RequestId, Load>,
    /// Arrived, not yet given blocks, in arrival order.
    waiting: VecDeque<RequestId>,
}

impl Side for DecodeSide {
    type Worker = DecodeWorker;
    const ROLE: Role = Role::Decode;

    fn new(config: &NodeConfig, _offer: &Handshake, addresses: Vec<PeerAddress>) -> Result<Self> {
        let scheduler =
            DecodeScheduler::new(EngineId::new(config.name.clone()), addresses.len() as u32, config.connector())?;
        Ok(DecodeSide { scheduler, loads: HashMap::new(), waiting: VecDeque::new() })
    }

    fn worker(config: &NodeConfig, offer: &Handshake, pool: LocalPool) -> Result<DecodeWorker> {
        Ok(DecodeWorker::new(offer.clone(), config.connector(), pool)?)
    }

    fn handle_report(&mut self, rank: u32, report: DecodeReport) -> Result<()> {
        Ok(self.scheduler.handle_report(rank, report)?)
    }

    fn settle(node: &mut Node<Self>) -> Result<()> {
        node.schedule()?;
        node.drain()
    }

    fn handle(node: &mut Node<Self>, command: Command) -> Result<()> {
        match command {
            Command::Arrive { id, remote, cached_tokens } => {
                let id = RequestId::new(id);
                match node.side.scheduler.handle_arrive(id.clone(), remote.clone()) {
                    Ok(()) => {
                        let load = Load {
                            remote,
                            cached_tokens,
                            blocks: Vec::new(),
                            aborted: false,
                            prepared: Prepared::default(),
                        };
                        node.side.loads.insert(id.clone(), load);
                        node.side.waiting.push_back(id);
                    }
                    Err(err) => {
                        node.engine.emit(&Event::Error { message: format!("{}: {err}", node.engine.name) });
                        node.outcome(&id, "refused", 0);
                    }
                }
            }
            Command::Reject { id, remote } => {
                let id = RequestId::new(id);
                match node.side.scheduler.handle_reject(id.clone(), remote.clone()) {
                    Ok(()) => node.outcome(&id, "rejected", 0),
                    Err(err) => {
                        node.engine.emit(&Event::Error { message: format!("{}: {err}", node.engine.name) });
                        node.outcome(&id, "refused", 0);
                    }
                }
            }
            Command::Connect { prefill } => node.side.scheduler.handle_connect(prefill),
            Command::Abort { id } => {
                let id = RequestId::new(id);
                if let Some(load) = node.side.loads.get_mut(&id) {
                    load.aborted = true;
                }
                // The outcome follows with the scheduler's `Ended`; a request already done stays done.
                node.side.scheduler.handle_abort(&id);
            }
            other => node.engine.emit(&Event::Error { message: format!("a decode engine cannot {other:?}") }),
        }
        Self::settle(node)
    }

    fn handle_done(node: &mut Node<Self>, tag: Tag, took: Duration, intact: bool) -> Result<()> {
        match tag {
            Tag::Prepared { id, blocks, cached } => node.prepared(id, blocks, cached, took),
            Tag::Verified { id, blocks, ready_at_ns, prepared, bytes } => {
                let outcome = if intact { "ok" } else { "corrupt" };
                node.outcome_at(&id, outcome, bytes, ready_at_ns, prepared);
                // The engine decodes and is done with the blocks.
                node.engine.release(&blocks)
            }
            _ => Err(anyhow!("a decode engine handed over work it does not do")),
        }
    }
}

impl Node<DecodeSide> {
    fn outcome(&mut self, id: &RequestId, outcome: &str, bytes: u64) {
        self.outcome_at(id, outcome, bytes, wall_ns(), Prepared::default());
    }

    fn outcome_at(&mut self, id: &RequestId, outcome: &str, bytes: u64, ready_at_ns: u64, prepared: Prepared) {
        let event = Event::Outcome {
            id: id.as_str().to_owned(),
            outcome: outcome.to_owned(),
            bytes,
            ready_at_ns,
            scrub_check_ns: prepared.took.as_nanos() as u64,
            prepared_at_ns: prepared.at_ns,
        };
        self.engine.emit(&event);
    }

    /// The request P computed the prompt of: the parent of P's sibling exports.
    fn parent(remote: &RemoteRef) -> RequestId {
        remote.request.parent().unwrap_or_else(|| remote.request.clone())
    }

    /// Gives blocks to waiting requests, first come first served, while the pool has them.
    fn schedule(&mut self) -> Result<()> {
        while let Some(id) = self.side.waiting.front().cloned() {
            if self.side.scheduler.state(&id) != Some(DecodeState::Waiting) {
                self.side.waiting.pop_front();
                continue;
            }
            let Some(load) = self.side.loads.get(&id) else {
                self.side.waiting.pop_front();
                continue;
            };
            let tokens = self.engine.shape().layout.block_tokens;
            let count = kv_core::blocks_for_tokens(load.remote.prompt_tokens, tokens).max(1) as usize;
            // Whole blocks of D's own prefix cache, from the prompt's start.
            let cached = usize::try_from(load.cached_tokens / u64::from(tokens)).unwrap_or(usize::MAX).min(count);
            let seed = pattern::seed(load.remote.prefill.engine.as_str(), Self::parent(&load.remote).as_str());
            let Some((blocks, freed)) = self.engine.allocate(count) else { break };
            self.side.waiting.pop_front();
            // D's prefix cache holds the KV P computed for its first `cached` blocks: the same
            // bytes. The check at `Ready` then finds them intact and the read's in the blocks
            // after.
            let work = Work::Fill { seed, blocks: blocks[..cached].to_vec(), freed, first: 0 };
            self.engine.payload.submit(Tag::Prepared { id, blocks, cached }, work);
        }
        Ok(())
    }

    /// The blocks of request `id` are ready for its load (`took`: the demo's scrub checks and
    /// prefix-cache fills, which the KV latency leaves out): hands them to the scheduler, or
    /// frees them if the request ended meanwhile.
    fn prepared(&mut self, id: RequestId, blocks: Vec<BlockId>, cached: usize, took: Duration) -> Result<()> {
        let waiting = self.side.scheduler.state(&id) == Some(DecodeState::Waiting);
        let Some(load) = self.side.loads.get_mut(&id).filter(|_| waiting) else {
            return self.engine.release(&blocks);
        };
        load.blocks = blocks.clone();
        load.prepared = Prepared { took, at_ns: wall_ns() };
        if let Err(err) = self.side.scheduler.handle_schedule_cached(id.clone(), blocks.clone(), cached) {
            self.side.loads.remove(&id);
            self.engine.emit(&Event::Error { message: format!("{}: {err}", self.engine.name) });
            self.outcome(&id, "refused", 0);
            return self.engine.release(&blocks);
        }
        Ok(())
    }

    /// Carries the scheduler's events to the worker and the pool until none is left.
    fn drain(&mut self) -> Result<()> {
        while let Some(event) = self.side.scheduler.poll_event() {
            match event {
                DecodeEvent::ToWorker { rank, command } => self.pass_to_worker(rank, command)?,
                DecodeEvent::Ended { request, state: DecodeState::Ready, .. } => {
                    // The KV is in place now; checking it is the demo's work, not the load's.
                    let ready_at_ns = wall_ns();
                    let Some(load) = self.side.loads.remove(&request) else { continue };
                    let seed = pattern::seed(load.remote.prefill.engine.as_str(), Self::parent(&load.remote).as_str());
                    let bytes = self.engine.bytes(load.blocks.len());
                    let work = Work::Check { seed, blocks: load.blocks.clone(), tokens: load.remote.prompt_tokens };
                    let (blocks, prepared) = (load.blocks, load.prepared);
                    self.engine
                        .payload
                        .submit(Tag::Verified { id: request, blocks, ready_at_ns, prepared, bytes }, work);
                }
                DecodeEvent::Ended { request, state, .. } => {
                    // A rejection was reported when it was made; it has no load.
                    let Some(load) = self.side.loads.get(&request) else { continue };
                    let aborted = load.aborted || state == DecodeState::Gone;
                    if load.blocks.is_empty() {
                        self.side.loads.remove(&request);
                    }
                    self.outcome(&request, if aborted { "aborted" } else { state.as_str() }, 0);
                }
                DecodeEvent::Free { request, blocks } => {
                    self.side.loads.remove(&request);
                    self.engine.release(&blocks)?;
                }
            }
        }
        Ok(())
    }
}
