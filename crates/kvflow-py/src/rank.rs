//! One TP rank of an engine, for a vLLM worker process: its worker (P's or D's) over a NIXL
//! agent, on a thread of its own (kv-engine's `RankThread`), with the rank's KV pool the
//! caller's memory, registered in place. Commands come in and reports go out as JSON; the
//! clock is the host's, so deadlines from the scheduler's process mean the same here.

use std::sync::mpsc::{self, Receiver};
use std::sync::{Arc, Mutex, PoisonError};

use kv_core::{
    AgentName, Clock, EngineId, KvLayout, MemoryKind, PoolShape, Region, RegionBase, RegionId, Role, Transport,
};
use kv_engine::{HostClock, RankOptions, RankThread};
use kv_sched_adapter::driver::{WorkerDriver, WorkerMachine};
use kv_sched_adapter::{DecodeWorker, LayerProgress, LocalPool, PrefillCommand, PrefillWorker};
use kv_transport_nixl::{NixlConfig, NixlTransport, PortPlan};
use pyo3::prelude::*;

use crate::scheduler::{config, from_json, refuse, to_json};

/// What a rank's thread reports, tagged with its rank.
type Reports<W> = Receiver<(u32, <W as WorkerMachine>::Report)>;

/// A rank's thread and what it reports, by worker kind.
enum Running {
    Prefill(RankThread<PrefillWorker>, Mutex<Reports<PrefillWorker>>),
    Decode(RankThread<DecodeWorker>, Mutex<Reports<DecodeWorker>>),
}

/// One TP rank: `Rank(role, engine, instance, rank, tp, layout, num_blocks, regions,
/// side_bind, kv_transfer_config, model, key=None, device=None)`.
#[pyclass(module = "kvflow._kvflow")]
pub struct Rank {
    /// `None` once closed. Declared first: the thread, and the transport on it, stop before
    /// anything else goes.
    running: Option<Running>,
    offer: Vec<u8>,
    address: String,
    /// P: the chunks the engine step under way computes layer by layer (the step's `Progress`
    /// commands of 0 layers), sent again as their layers are computed.
    layer_steps: Vec<PrefillCommand>,
}

/// Starts a rank's thread for `worker` over `transport`; its reports go to the receiver.
fn start<W>(rank: u32, worker: W, transport: Box<dyn Transport>) -> PyResult<(RankThread<W>, Reports<W>)>
where
    W: WorkerMachine + Send + 'static,
    W::Command: Send + 'static,
    W::Report: Send + 'static,
{
    let (tx, rx) = mpsc::channel();
    let clock: Arc<dyn Clock> = Arc::new(HostClock);
    let driver = WorkerDriver::new(worker, transport);
    let thread = RankThread::spawn(rank, driver, clock, tx, std::thread::current(), RankOptions::default())
        .map_err(|e| refuse("the rank's thread", e))?;
    Ok((thread, rx))
}

#[pymethods]
impl Rank {
    /// Rank `rank` of `tp` of engine `engine` (incarnation `instance`), `role` `"prefill"` or
    /// `"decode"`: its pool of `num_blocks` blocks of `layout` (JSON, kv-core's `KvLayout`)
    /// lies in `regions` (`(address, length)` the caller keeps alive and unmoved while the
    /// rank runs: host memory, or memory of GPU `device`), and its side channel listens at
    /// `side_bind`
    /// (`"host:port"`, port 0 for any), proving the cluster key `key` holds (`("file", path)`
    /// or `("env", variable)`; without one, the side channel listens on loopback only). With
    /// `shared_port` set, `side_bind` is a port the engine's ranks share (peers dial
    /// `host:port/tpRANK`), and `shared_port=True` makes this process the one that accepts on
    /// it (rank 0's). NIXL's runtime must be prepared first (`prepare_nixl`).
    #[new]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (role, engine, instance, rank, tp, layout, num_blocks, regions, side_bind, kv_transfer_config, model, key=None, device=None, shared_port=None))]
    fn new(
        role: &str,
        engine: &str,
        instance: u64,
        rank: u32,
        tp: u32,
        layout: &str,
        num_blocks: u32,
        regions: Vec<(u64, u64)>,
        side_bind: &str,
        kv_transfer_config: &str,
        model: &str,
        key: Option<(String, String)>,
        device: Option<u32>,
        shared_port: Option<bool>,
    ) -> PyResult<Self> {
        let role = match role {
            "prefill" => Role::Prefill,
            "decode" => Role::Decode,
            other => return Err(refuse("role", format!("{other:?}, not \"prefill\" or \"decode\""))),
        };
        let config = config(kv_transfer_config)?;
        let layout: KvLayout = from_json("layout", layout)?;
        let shape =
            PoolShape::new(layout, layout.heads_per_rank(tp.max(1)), num_blocks).map_err(|e| refuse("pool", e))?;
        let bases = regions.iter().map(|&(addr, len)| RegionBase { addr, len }).collect();
        let pool = LocalPool { shape, regions: bases };
        let offer = pool.offer(&AgentName::new(EngineId::new(engine), rank), tp, instance, role, model);
        let bind = resolve(side_bind)?;
        // The connector's `num_threads` sizes NIXL's UCX thread pool.
        let key = crate::config::key_source(key)?;
        let port_plan = shared_port.map_or(PortPlan::Own, |accept| PortPlan::Shared { accept });
        let nixl = NixlConfig { bind, port_plan, key, ucx_params: config.ucx_params(), ..NixlConfig::default() };
        let mut transport = NixlTransport::new(offer.clone(), &nixl, Arc::new(HostClock))
            .map_err(|e| refuse("the NIXL transport", e))?;
        for (i, &(addr, len)) in (0u64..).zip(&regions) {
            let kind = device.map_or(MemoryKind::Host, MemoryKind::Device);
            let region = Region { id: RegionId(i), kind, addr, len };
            transport.register(&region).map_err(|e| refuse("registering the pool", e))?;
        }
        let address = transport.side_channel_address().to_string();
        let encoded = offer.encode().map_err(|e| refuse("offer", e))?;
        let transport: Box<dyn Transport> = Box::new(transport);
        let running = match role {
            Role::Prefill => {
                let worker = PrefillWorker::new(offer, config, pool).map_err(|e| refuse("worker", e))?;
                let (thread, rx) = start(rank, worker, transport)?;
                Running::Prefill(thread, Mutex::new(rx))
            }
            Role::Decode => {
                let worker = DecodeWorker::new(offer, config, pool).map_err(|e| refuse("worker", e))?;
                let (thread, rx) = start(rank, worker, transport)?;
                Running::Decode(thread, Mutex::new(rx))
            }
        };
        Ok(Rank { running: Some(running), offer: encoded, address, layer_steps: Vec::new() })
    }

    /// The rank's handshake offer, in its wire bytes (P's scheduler is built from rank 0's).
    fn offer(&self) -> &[u8] {
        &self.offer
    }

    /// Where the rank's side channel listens (`host:port`).
    fn address(&self) -> &str {
        &self.address
    }

    /// Hands the rank's worker a command of the scheduler (JSON); it is carried out at once.
    fn command(&self, command: &str) -> PyResult<()> {
        match self.running()? {
            Running::Prefill(thread, _) => thread.send(from_json("command", command)?),
            Running::Decode(thread, _) => thread.send(from_json("command", command)?),
        }
        Ok(())
    }

    /// P, push: the chunks the engine step that starts computes layer by layer, in place of
    /// the last step's: `Progress` commands of P's scheduler (JSON, each with a `part` of 0
    /// layers, as the rank was sent them). `layers_computed` sends them again as their layers
    /// are computed.
    fn layer_steps(&mut self, commands: Vec<String>) -> PyResult<()> {
        if !matches!(self.running()?, Running::Prefill(..)) {
            return Err(refuse("layer_steps", "a decode rank writes no layers"));
        }
        let mut steps = Vec::with_capacity(commands.len());
        for text in commands {
            match from_json("layer step", &text)? {
                step @ PrefillCommand::Progress { part: Some(LayerProgress { layers: 0, .. }), .. } => steps.push(step),
                _ => return Err(refuse("layer step", format!("{text}: not a progress command of 0 layers"))),
            }
        }
        self.layer_steps = steps;
        Ok(())
    }

    /// P, push: model layers `0..layers` of the step's chunks (`layer_steps`) are computed, or,
    /// with `layers` None, every layer (the step's forward is done): hands the rank a
    /// `Progress` command of each chunk that says so, and the rank writes what is new of them
    /// into the blocks D registered. Returns the commands sent.
    #[pyo3(signature = (layers=None))]
    fn layers_computed(&self, layers: Option<u32>) -> PyResult<usize> {
        let Running::Prefill(thread, _) = self.running()? else {
            return Err(refuse("layers_computed", "a decode rank writes no layers"));
        };
        for step in &self.layer_steps {
            let PrefillCommand::Progress { request, blocks, consumer, part, transfer } = step else { continue };
            let part = match (layers, part) {
                (Some(layers), Some(part)) => Some(LayerProgress { layers, ..*part }),
                _ => None,
            };
            let (request, blocks, consumer, transfer) =
                (request.clone(), blocks.clone(), consumer.clone(), transfer.clone());
            thread.send(PrefillCommand::Progress { request, blocks, consumer, part, transfer });
        }
        Ok(self.layer_steps.len())
    }

    /// The reports since the last call (JSON), for the scheduler's `report`.
    fn reports(&self) -> PyResult<Vec<String>> {
        fn drain<T: serde::Serialize>(rx: &Mutex<Receiver<(u32, T)>>) -> PyResult<Vec<String>> {
            let rx = rx.lock().unwrap_or_else(PoisonError::into_inner);
            rx.try_iter().map(|(_, report)| to_json(&report)).collect()
        }
        match self.running()? {
            Running::Prefill(_, rx) => drain(rx),
            Running::Decode(_, rx) => drain(rx),
        }
    }

    /// Stops the rank's thread (after its current step) and drops its NIXL agent; the pool's
    /// memory may go after this returns.
    fn close(&mut self, py: Python<'_>) {
        let running = self.running.take();
        py.detach(move || drop(running));
    }
}

impl Rank {
    fn running(&self) -> PyResult<&Running> {
        self.running.as_ref().ok_or_else(|| refuse("rank", "closed"))
    }
}

/// Loads NIXL's runtime from `dir` (the folder holding `libnixl_capi.so`, as the `nixl_cu12`
/// wheel installs it), before any rank; it sets no environment variable, so it is safe in a
/// process whose threads run (vLLM's workers). Returns the folder loaded.
#[pyfunction]
pub fn prepare_nixl(dir: std::path::PathBuf) -> PyResult<String> {
    kv_transport_nixl::runtime::prepare(Some(&dir))
        .map(|dir| dir.display().to_string())
        .map_err(|e| refuse("the NIXL runtime", e))
}

/// The host clock's reading, in nanoseconds: the time a scheduler's calls take.
#[pyfunction]
pub fn now_ns() -> u64 {
    HostClock.now().as_nanos()
}

/// Where the side channel listens, from `host:port` as NixlConnector's users write
/// `VLLM_NIXL_SIDE_CHANNEL_HOST`: an IP literal, `localhost` or a host name (its first IPv4
/// address, else its first address).
fn resolve(side_bind: &str) -> PyResult<std::net::SocketAddr> {
    use std::net::ToSocketAddrs;
    let addresses: Vec<std::net::SocketAddr> = side_bind
        .to_socket_addrs()
        .map_err(|e| refuse("side_bind", format!("{side_bind:?} does not resolve: {e}")))?
        .collect();
    addresses
        .iter()
        .find(|a| a.is_ipv4())
        .or(addresses.first())
        .copied()
        .ok_or_else(|| refuse("side_bind", format!("{side_bind:?} resolves to no address")))
}
