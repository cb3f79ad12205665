//! An engine process: a P or D engine running kvflow's connectors over `NixlTransport` (or
//! `TcpTransport`, the baseline, as its configuration says), with a host-memory KV pool from
//! kv-cuda. It stands in for vLLM's engine core: it allocates
//! blocks, "computes" a prompt by filling its blocks with [`pattern`] bytes, checks every
//! byte D receives, and frees blocks when the connector says so.
//!
//! The router drives it with [`Command`] lines on stdin and reads [`Event`] lines on stdout.
//! Its loop waits for a command or its next wake-up (a few milliseconds at most over NIXL,
//! whose notifications and completions are polled; TCP wakes it for everything), then steps its worker through
//! [`WorkerDriver`], exactly as an engine's step would.
//!
//! Freed blocks are scrubbed with [`pattern::SCRUB`]: a read after free then delivers scrub
//! bytes and fails D's check. D also checks that a block it allocates again still holds its
//! scrub, so a write into a freed block (a late push) is counted too.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::io::BufRead;
use std::process::ExitCode;
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::sync::Arc;
use std::task::Waker;
use std::thread::Thread;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context, Result};
use clap::Parser;
use kv_core::{
    AgentName, BlockId, Clock, EngineId, Handshake, Memory, MemoryKind, PeerAddress, PeerEvent, PollIntervals,
    PoolShape, PreparedId, PreparedTransfer, Region, RegionBase, RegionId, RequestId, Role, Time, TransferId,
    TransferRequest, TransferStatus, Transport, TransportError,
};
use kv_sched_adapter::driver::{thread_waker, WorkerDriver, WorkerMachine};
use kv_sched_adapter::{
    Consumer, Counters, DecodeCommand, DecodeEvent, DecodeReport, DecodeScheduler, DecodeState, DecodeWorker,
    LocalPool, PrefillCommand, PrefillEvent, PrefillReport, PrefillScheduler, PrefillWorker,
};
use kv_testkit::BlockPool;
use kv_transport_nixl::{KeySource, NixlConfig, NixlTransport};
use kv_transport_tcp::{TcpConfig, TcpTransport};

use crate::e2e::ProcessClock;
use crate::pattern;
use crate::proto::{
    from_json, wall_ns, write_line, Command, Event, NodeConfig, NodeRole, Remote, TransportKind, CLUSTER_KEY_ENV,
};

/// The model name every demo engine serves.
pub const MODEL: &str = "kvflow-demo";

/// The longest the loop parks when the driver has nothing due: NIXL keeps the notifications
/// nobody asks for (a key holder's stray or forged ones) until the engine fetches them, so an
/// idle engine still fetches now and then. Everything else wakes the loop: the router's
/// commands unpark it, the transport's waker announces side-channel events, and the driver's
/// wait time covers deadlines, transfers in flight and the notifications a worker waits for.
const IDLE_WAIT: Duration = Duration::from_millis(50);

/// `kvflow-node`'s argument.
#[derive(Parser, Debug)]
#[command(name = "kvflow-node", about = "An engine process of `cargo xtask demo`, P or D, driven by its router")]
struct Args {
    /// The engine's configuration, `xtask::proto::NodeConfig` as JSON.
    #[arg(value_name = "CONFIG", value_parser = from_json::<NodeConfig>)]
    config: NodeConfig,
}

/// Runs the engine its argument describes; the exit code says whether it stopped cleanly.
pub fn main() -> ExitCode {
    let Args { config } = Args::parse();
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
    let span = tracing::info_span!("engine", name = %config.name, instance = config.instance);
    let _entered = span.enter();
    // Before any thread: it sets the environment NIXL reads.
    if config.transport == TransportKind::Nixl {
        kv_transport_nixl::runtime::prepare(None).context("the NIXL runtime")?;
    }
    let (tx, rx) = mpsc::channel();
    let engine = std::thread::current();
    std::thread::spawn(move || read_commands(tx, engine));
    match config.role {
        NodeRole::Prefill => Node::<PrefillSide>::start(config)?.run(rx),
        NodeRole::Decode => Node::<DecodeSide>::start(config)?.run(rx),
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

/// A transfer that ended: bytes, post-to-end time, success.
type Ended = (u64, Duration, bool);

/// The transport, timing each transfer it posts from post to completion.
struct TimedTransport {
    inner: Box<dyn Transport>,
    posted: HashMap<TransferId, (Instant, u64)>,
    local_lists: HashMap<PreparedId, Vec<u64>>,
    ended: Sender<Ended>,
}

impl TimedTransport {
    /// Starts timing a transfer from `start`, taken before the post: UCX may move the bytes
    /// inside the post call itself.
    fn posted(&mut self, id: TransferId, start: Instant, bytes: u64) -> TransferId {
        self.posted.insert(id, (start, bytes));
        id
    }
}

impl Transport for TimedTransport {
    fn agent(&self) -> &AgentName {
        self.inner.agent()
    }
    fn register(&mut self, region: &Region) -> Result<(), TransportError> {
        self.inner.register(region)
    }
    fn deregister(&mut self, region: RegionId) -> Result<(), TransportError> {
        self.inner.deregister(region)
    }
    fn connect(&mut self, address: &PeerAddress) -> Result<(), TransportError> {
        self.inner.connect(address)
    }
    fn post(&mut self, request: TransferRequest) -> Result<TransferId, TransportError> {
        let bytes = request.pairs.iter().map(|p| p.len).sum();
        let start = Instant::now();
        let id = self.inner.post(request)?;
        Ok(self.posted(id, start, bytes))
    }
    fn prepare(&mut self, peer: Option<&AgentName>, ranges: &[(u64, u64)]) -> Result<PreparedId, TransportError> {
        let id = self.inner.prepare(peer, ranges)?;
        if peer.is_none() {
            self.local_lists.insert(id, ranges.iter().map(|r| r.1).collect());
        }
        Ok(id)
    }
    fn post_prepared(&mut self, request: PreparedTransfer) -> Result<TransferId, TransportError> {
        let lens = self.local_lists.get(&request.local);
        let bytes = request.local_indices.iter().filter_map(|&i| lens.and_then(|l| l.get(i as usize))).sum();
        let start = Instant::now();
        let id = self.inner.post_prepared(request)?;
        Ok(self.posted(id, start, bytes))
    }
    fn poll_transfer(&mut self, id: TransferId) -> TransferStatus {
        let status = self.inner.poll_transfer(id);
        if !matches!(status, TransferStatus::InProgress) {
            if let Some((start, bytes)) = self.posted.remove(&id) {
                let _ = self.ended.send((bytes, start.elapsed(), matches!(status, TransferStatus::Done)));
            }
        }
        status
    }
    fn send_notification(&mut self, peer: &AgentName, payload: &[u8]) -> Result<(), TransportError> {
        self.inner.send_notification(peer, payload)
    }
    fn poll_event(&mut self) -> Option<PeerEvent> {
        self.inner.poll_event()
    }
    fn set_waker(&mut self, waker: Waker) {
        self.inner.set_waker(waker)
    }
    fn poll_intervals(&self) -> PollIntervals {
        self.inner.poll_intervals()
    }
}

/// What both engine kinds have: the clock, the pool's memory and blocks, and stdout.
struct Engine {
    name: String,
    clock: Arc<ProcessClock>,
    memory: Box<dyn Memory>,
    region: Region,
    shape: PoolShape,
    blocks: BlockPool,
    /// Blocks freed at least once (and so scrubbed); others were never written.
    scrubbed: Vec<bool>,
    written_after_free: u64,
    ended: Receiver<Ended>,
    out: std::io::Stdout,
    chunk: Vec<u8>,
}

impl Engine {
    /// Allocates and registers the pool, and builds the rank's transport and handshake offer.
    fn start(config: &NodeConfig, role: Role) -> Result<(Engine, Handshake, TimedTransport, u16)> {
        let layout = config.model.layout();
        let shape = PoolShape::new(layout, layout.kv_heads, config.num_blocks)
            .map_err(|e| anyhow!("pool of {} blocks: {e}", config.num_blocks))?;
        let mut memory = host_memory();
        let region = memory.allocate(MemoryKind::Host, shape.pool_bytes()).context("the KV pool")?;
        let regions = (0..shape.region_count())
            .map(|i| RegionBase { addr: region.addr + u64::from(i) * shape.region_len(), len: shape.region_len() })
            .collect();
        let agent = AgentName::new(EngineId::new(config.name.clone()), 0);
        let offer = LocalPool { shape, regions }.offer(&agent, 1, config.instance, role, MODEL);
        let clock = Arc::new(ProcessClock::start());
        // The router's key, when it gave one; without it the side channel is loopback-only anyway.
        let key = match std::env::var_os(CLUSTER_KEY_ENV) {
            Some(_) => KeySource::Env(CLUSTER_KEY_ENV.to_owned()),
            None => KeySource::None,
        };
        let bind = "127.0.0.1:0".parse().expect("loopback");
        let (mut inner, port): (Box<dyn Transport>, u16) = match config.transport {
            TransportKind::Nixl => {
                let nixl = NixlConfig { bind, key, ..NixlConfig::default() };
                let t = NixlTransport::new(offer.clone(), &nixl, clock.clone()).context("the NIXL transport")?;
                let port = t.side_channel_addr().port();
                (Box::new(t), port)
            }
            TransportKind::Tcp => {
                let tcp = TcpConfig { bind, key, ..TcpConfig::default() };
                let t = TcpTransport::new(offer.clone(), &tcp, clock.clone()).context("the TCP transport")?;
                let port = t.side_channel_addr().port();
                (Box::new(t), port)
            }
        };
        inner.register(&region).context("registering the KV pool")?;
        let (tx, ended) = mpsc::channel();
        let transport = TimedTransport { inner, posted: HashMap::new(), local_lists: HashMap::new(), ended: tx };
        let engine = Engine {
            name: config.name.clone(),
            clock,
            memory,
            region,
            shape,
            blocks: BlockPool::new(config.num_blocks),
            scrubbed: vec![false; config.num_blocks as usize],
            written_after_free: 0,
            ended,
            out: std::io::stdout(),
            chunk: vec![0; shape.layer_block_bytes() as usize],
        };
        Ok((engine, offer, transport, port))
    }

    fn now(&self) -> Time {
        self.clock.now()
    }

    fn emit(&mut self, event: &Event) {
        // The router reads every line; if it is gone, stdin closes and the loop ends.
        let _ = write_line(&mut self.out, event);
    }

    fn pool(&self, offer: &Handshake) -> LocalPool {
        LocalPool { shape: self.shape, regions: offer.regions.clone() }
    }

    /// The byte offset of `(layer, block)` in the pool region.
    fn offset(&self, layer: u32, block: BlockId) -> u64 {
        let at = self.shape.plane_offset(layer, block.0, 0);
        u64::from(at.region) * self.shape.region_len() + at.offset
    }

    /// The chunks of the block at `position` of a prompt, one per plane of `layer`, in the
    /// order they lie in the layer's part of the block.
    fn chunks(&self, layer: u32, position: usize) -> impl Iterator<Item = pattern::Chunk> {
        let (layout, shape) = (self.shape.layout, self.shape);
        (0..layout.planes()).map(move |plane| pattern::Chunk {
            layer,
            plane,
            // One rank holds every head (or MLA's one latent).
            first_head: 0,
            heads: shape.heads,
            first_token: position as u64 * u64::from(layout.block_tokens),
            tokens: layout.block_tokens,
            row_bytes: shape.head_bytes_per_token() as usize,
            order: layout.order,
        })
    }

    /// Fills `blocks`, in prompt order, with the prompt's bytes.
    fn fill(&mut self, seed: u64, blocks: &[BlockId]) -> Result<()> {
        let plane_bytes = self.shape.plane_bytes() as usize;
        for (position, &block) in blocks.iter().enumerate() {
            for layer in 0..self.shape.layout.layers {
                for (i, chunk) in self.chunks(layer, position).enumerate() {
                    pattern::fill(&mut self.chunk[i * plane_bytes..(i + 1) * plane_bytes], seed, &chunk);
                }
                let at = self.offset(layer, block);
                self.memory.write(self.region.id, at, &self.chunk)?;
            }
        }
        Ok(())
    }

    /// Whether `blocks`, in prompt order, hold the bytes of a prompt of `tokens` tokens.
    fn check(&mut self, seed: u64, blocks: &[BlockId], tokens: u64) -> Result<bool> {
        let plane_bytes = self.shape.plane_bytes() as usize;
        let mut all = true;
        for (position, &block) in blocks.iter().enumerate() {
            for layer in 0..self.shape.layout.layers {
                let at = self.offset(layer, block);
                self.memory.read(self.region.id, at, &mut self.chunk)?;
                for (i, chunk) in self.chunks(layer, position).enumerate() {
                    all &= pattern::check(&self.chunk[i * plane_bytes..(i + 1) * plane_bytes], seed, &chunk, tokens);
                }
            }
        }
        Ok(all)
    }

    /// Takes `count` blocks, counting any freed block that no longer holds its scrub.
    fn allocate(&mut self, count: usize) -> Result<Option<Vec<BlockId>>> {
        let Some(blocks) = self.blocks.allocate(count) else { return Ok(None) };
        for &block in &blocks {
            if !self.scrubbed[block.0 as usize] {
                continue;
            }
            for layer in 0..self.shape.layout.layers {
                let at = self.offset(layer, block);
                self.memory.read(self.region.id, at, &mut self.chunk)?;
                if !pattern::is_scrub(&self.chunk) {
                    self.written_after_free += 1;
                    break;
                }
            }
        }
        Ok(Some(blocks))
    }

    /// Drops a reference to each block and scrubs those now free.
    fn release(&mut self, blocks: &[BlockId]) -> Result<()> {
        let freed = self.blocks.release(blocks).map_err(|b| anyhow!("{}: block {b} freed twice", self.name))?;
        self.chunk.fill(pattern::SCRUB);
        for block in freed {
            for layer in 0..self.shape.layout.layers {
                let at = self.offset(layer, block);
                self.memory.write(self.region.id, at, &self.chunk)?;
            }
            self.scrubbed[block.0 as usize] = true;
        }
        Ok(())
    }

    /// Reports the transfers that ended.
    fn report_transfers(&mut self) {
        while let Ok((bytes, took, ok)) = self.ended.try_recv() {
            self.emit(&Event::Transfer { bytes, took_ns: took.as_nanos() as u64, ok });
        }
    }

    fn stats(&mut self, counters: Counters) {
        let counters = [
            ("ignored_messages", counters.ignored_messages),
            ("foreign_messages", counters.foreign_messages),
            ("refused", counters.refused),
            ("unauthenticated", counters.unauthenticated),
            ("late_reads", counters.late_reads),
            ("quarantined", counters.quarantined),
            ("duplicate_messages", counters.duplicate_messages),
            ("rejections_unsent", counters.rejections_unsent),
            ("notifications_after_expiry", counters.notifications_after_expiry),
            ("late_messages", counters.late_messages),
            ("early_staged", counters.early_staged),
            ("early_evicted", counters.early_evicted),
            ("transfers_failed", counters.transfers_failed),
            ("reads_fenced", counters.reads_fenced),
            ("prepared_reads", counters.prepared_reads),
            ("prepared_writes", counters.prepared_writes),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect::<BTreeMap<_, _>>();
        let event = Event::Stats {
            held_blocks: self.blocks.held() as u64,
            written_after_free: self.written_after_free,
            counters,
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
    engine: Engine,
    worker: WorkerDriver<S::Worker>,
    side: S,
}

/// What differs between P and D: the worker and its scheduler, and how the side handles the
/// router's commands and the scheduler's events.
trait Side: Sized {
    /// The rank's worker.
    type Worker: WorkerMachine;
    /// A command of the scheduler for the worker.
    type ToWorker;
    /// The role the rank's handshake offer carries.
    const ROLE: Role;
    /// The worker and the side of engine `config`, whose rank offers `offer`, keeps `pool`, and
    /// listens at `address`.
    fn new(
        config: &NodeConfig,
        offer: &Handshake,
        pool: LocalPool,
        address: PeerAddress,
    ) -> Result<(Self::Worker, Self)>;
    /// Hands the worker a command of the scheduler.
    fn handle_command(worker: &mut Self::Worker, now: Time, command: Self::ToWorker);
    /// Hands the scheduler a report of the worker.
    fn handle_report(&mut self, report: <Self::Worker as WorkerMachine>::Report) -> Result<()>;
    /// The worker's counters, for the router's report.
    fn counters(worker: &Self::Worker) -> Counters;
    /// Carries out what the scheduler asks until nothing is left.
    fn settle(node: &mut Node<Self>, now: Time) -> Result<()>;
    /// Handles a command of the router other than `Stats` and `Shutdown`.
    fn handle(node: &mut Node<Self>, command: Command) -> Result<()>;
}

impl<S: Side> Node<S> {
    /// Starts the engine and its side, and tells the router it is ready.
    fn start(config: &NodeConfig) -> Result<Self> {
        let (engine, offer, transport, port) = Engine::start(config, S::ROLE)?;
        let address = PeerAddress(format!("127.0.0.1:{port}"));
        let (machine, side) = S::new(config, &offer, engine.pool(&offer), address).context("the connector")?;
        let mut node = Node { engine, worker: WorkerDriver::new(machine, Box::new(transport)), side };
        node.engine.emit(&Event::Ready { port });
        Ok(node)
    }

    /// The engine's loop: the router's commands, a step, then a wait for the next thing to do
    /// (the driver's wait time, the transport's waker, a command), until told to stop.
    fn run(mut self, rx: Receiver<Result<Command, String>>) -> Result<()> {
        self.worker.set_waker(thread_waker());
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
            let now = self.engine.now();
            self.step(now)?;
            self.engine.report_transfers();
            let wait = self.worker.wait_time(self.engine.now()).map_or(IDLE_WAIT, |w| w.min(IDLE_WAIT));
            std::thread::park_timeout(wait);
        }
    }

    /// Steps the worker and carries out what follows.
    fn step(&mut self, now: Time) -> Result<()> {
        for report in self.worker.step(now) {
            self.side.handle_report(report)?;
        }
        S::settle(self, now)
    }

    /// Handles one command; `false` to stop.
    fn handle(&mut self, command: Command) -> Result<bool> {
        match command {
            Command::Stats => {
                let counters = S::counters(self.worker.machine_ref());
                self.engine.stats(counters);
            }
            Command::Shutdown => return Ok(false),
            other => S::handle(self, other)?,
        }
        Ok(true)
    }

    /// Hands the worker a command of the scheduler, and the scheduler what the worker reports
    /// at once.
    fn pass_to_worker(&mut self, now: Time, command: S::ToWorker) -> Result<()> {
        S::handle_command(self.worker.machine(), now, command);
        for report in self.worker.flush(now) {
            self.side.handle_report(report)?;
        }
        Ok(())
    }
}

/// P's side: its scheduler.
struct PrefillSide {
    scheduler: PrefillScheduler,
}

impl Side for PrefillSide {
    type Worker = PrefillWorker;
    type ToWorker = PrefillCommand;
    const ROLE: Role = Role::Prefill;

    fn new(
        config: &NodeConfig,
        offer: &Handshake,
        pool: LocalPool,
        address: PeerAddress,
    ) -> Result<(PrefillWorker, Self)> {
        let connector = config.connector();
        let engine = EngineId::new(config.name.clone());
        let scheduler = PrefillScheduler::new(engine, config.instance, vec![address], connector)?;
        Ok((PrefillWorker::new(offer.clone(), connector, pool)?, PrefillSide { scheduler }))
    }

    fn handle_command(worker: &mut PrefillWorker, now: Time, command: PrefillCommand) {
        worker.handle_command(now, command);
    }

    fn handle_report(&mut self, report: PrefillReport) -> Result<()> {
        Ok(self.scheduler.handle_report(0, report)?)
    }

    fn counters(worker: &PrefillWorker) -> Counters {
        worker.counters()
    }

    fn settle(node: &mut Node<Self>, now: Time) -> Result<()> {
        node.drain(now)
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
}

impl Node<PrefillSide> {
    /// Runs a prompt: allocates its blocks, fills them, and exports them (once per sibling).
    fn prefill(&mut self, id: String, prompt_tokens: u64, n: u32, consumer: Option<Consumer>) -> Result<()> {
        let count = kv_core::blocks_for_tokens(prompt_tokens, self.engine.shape.layout.block_tokens) as usize;
        if count == 0 || n == 0 {
            let message = format!("prefill of {id}: {prompt_tokens} prompt tokens and n = {n}; both must be positive");
            self.engine.emit(&Event::Error { message });
            return Ok(());
        }
        let Some(blocks) = self.engine.allocate(count)? else {
            self.engine.emit(&Event::Busy { id });
            return Ok(());
        };
        self.engine.fill(pattern::seed(&self.engine.name, &id), &blocks)?;
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
            let event = Event::Exported { id: id.clone(), remote: Remote::from(&remote), finished_at_ns: wall_ns() };
            self.engine.emit(&event);
        }
        self.drain(now)
    }

    /// Carries the scheduler's events to the worker and the pool until none is left.
    fn drain(&mut self, now: Time) -> Result<()> {
        while let Some(event) = self.side.scheduler.poll_event() {
            match event {
                PrefillEvent::ToWorker { command, .. } => self.pass_to_worker(now, command)?,
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
    remote: Remote,
    blocks: Vec<BlockId>,
    aborted: bool,
    /// Time spent checking the scrub bytes of `blocks` when they were allocated.
    scrub_check: Duration,
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
    type ToWorker = DecodeCommand;
    const ROLE: Role = Role::Decode;

    fn new(config: &NodeConfig, offer: &Handshake, pool: LocalPool, _: PeerAddress) -> Result<(DecodeWorker, Self)> {
        let connector = config.connector();
        let side = DecodeSide {
            scheduler: DecodeScheduler::new(1, connector)?,
            loads: HashMap::new(),
            waiting: VecDeque::new(),
        };
        Ok((DecodeWorker::new(offer.clone(), connector, pool)?, side))
    }

    fn handle_command(worker: &mut DecodeWorker, now: Time, command: DecodeCommand) {
        worker.handle_command(now, command);
    }

    fn handle_report(&mut self, report: DecodeReport) -> Result<()> {
        Ok(self.scheduler.handle_report(0, report)?)
    }

    fn counters(worker: &DecodeWorker) -> Counters {
        worker.counters()
    }

    fn settle(node: &mut Node<Self>, now: Time) -> Result<()> {
        node.schedule()?;
        node.drain(now)
    }

    fn handle(node: &mut Node<Self>, command: Command) -> Result<()> {
        match command {
            Command::Arrive { id, remote } => {
                let id = RequestId::new(id);
                match node.side.scheduler.handle_arrive(id.clone(), remote.to_ref()) {
                    Ok(()) => {
                        node.side.loads.insert(
                            id.clone(),
                            Load { remote, blocks: Vec::new(), aborted: false, scrub_check: Duration::ZERO },
                        );
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
                match node.side.scheduler.handle_reject(id.clone(), remote.to_ref()) {
                    Ok(()) => node.outcome(&id, "rejected", 0),
                    Err(err) => {
                        node.engine.emit(&Event::Error { message: format!("{}: {err}", node.engine.name) });
                        node.outcome(&id, "refused", 0);
                    }
                }
            }
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
        let now = node.engine.now();
        Self::settle(node, now)
    }
}

impl Node<DecodeSide> {
    fn outcome(&mut self, id: &RequestId, outcome: &str, bytes: u64) {
        self.outcome_at(id, outcome, bytes, wall_ns(), Duration::ZERO);
    }

    fn outcome_at(&mut self, id: &RequestId, outcome: &str, bytes: u64, ready_at_ns: u64, scrub_check: Duration) {
        let scrub_check_ns = scrub_check.as_nanos() as u64;
        let event = Event::Outcome {
            id: id.as_str().to_owned(),
            outcome: outcome.to_owned(),
            bytes,
            ready_at_ns,
            scrub_check_ns,
        };
        self.engine.emit(&event);
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
            let tokens = self.engine.shape.layout.block_tokens;
            let count = kv_core::blocks_for_tokens(load.remote.prompt_tokens, tokens).max(1) as usize;
            let checking = Instant::now();
            let Some(blocks) = self.engine.allocate(count)? else { break };
            let scrub_check = checking.elapsed();
            self.side.waiting.pop_front();
            if let Err(err) = self.side.scheduler.handle_schedule(id.clone(), blocks.clone(), false) {
                self.engine.release(&blocks)?;
                self.engine.emit(&Event::Error { message: format!("{}: {err}", self.engine.name) });
                continue;
            }
            let load = self.side.loads.get_mut(&id).expect("present");
            load.blocks = blocks;
            load.scrub_check = scrub_check;
        }
        Ok(())
    }

    /// Carries the scheduler's events to the worker and the pool until none is left.
    fn drain(&mut self, now: Time) -> Result<()> {
        while let Some(event) = self.side.scheduler.poll_event() {
            match event {
                DecodeEvent::ToWorker { command, .. } => self.pass_to_worker(now, command)?,
                DecodeEvent::Ended { request, state: DecodeState::Ready } => {
                    // The KV is in place now; checking it is the demo's work, not the load's.
                    let ready_at_ns = wall_ns();
                    let Some(load) = self.side.loads.remove(&request) else { continue };
                    let remote_id = RequestId::new(load.remote.request.clone());
                    let parent = remote_id.parent().unwrap_or(remote_id);
                    let seed = pattern::seed(&load.remote.engine, parent.as_str());
                    let ok = self.engine.check(seed, &load.blocks, load.remote.prompt_tokens)?;
                    let bytes = load.blocks.len() as u64 * self.engine.shape.block_bytes();
                    let outcome = if ok { "ok" } else { "corrupt" };
                    self.outcome_at(&request, outcome, bytes, ready_at_ns, load.scrub_check);
                    // The engine decodes and is done with the blocks.
                    self.engine.release(&load.blocks)?;
                }
                DecodeEvent::Ended { request, state } => {
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
