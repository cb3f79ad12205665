//! The engine code of the `pull_pair` examples, whatever the transport: P finishes a two-block
//! prompt and exports it, D reads it into its own pool, P frees its blocks as `transferred`,
//! and the bytes are compared. Each example only says how a rank gets its memory and its
//! transport, and how time passes ([`Net`]): swapping the transport is that and nothing else.

#![allow(dead_code)] // Each example uses the part it needs.

use std::error::Error;
use std::time::Duration;

use kv_core::{
    AgentName, BlockId, EngineId, Handshake, KvLayout, Memory, MemoryKind, PeerAddress, PoolShape, Region, RegionBase,
    RequestId, Role, Time, Transport,
};
use kv_sched_adapter::driver::{WorkerDriver, WorkerMachine};
use kv_sched_adapter::{
    Config, ConfigError, DecodeEvent, DecodeScheduler, DecodeState, DecodeWorker, LocalPool, PrefillEvent,
    PrefillScheduler, PrefillWorker,
};

pub type Fallible<T> = Result<T, Box<dyn Error>>;

/// What differs between transports.
pub trait Net {
    /// The model name both engines serve.
    const MODEL: &'static str;
    /// The engines' clock.
    fn now(&self) -> Time;
    /// Memory for `engine`'s pool.
    fn memory(&mut self, engine: &str) -> Box<dyn Memory>;
    /// `offer`'s transport with `region` registered, and where peers reach it.
    fn transport(&mut self, offer: &Handshake, region: &Region) -> Fallible<(Box<dyn Transport>, PeerAddress)>;
    /// Lets up to `most` pass, or less if a transport has news.
    fn wait(&mut self, most: Duration);
}

/// One TP rank of an engine: its pool in memory, and its worker over its transport.
/// The driver comes first: it drops first, so the transport lets go of the pool before the
/// memory behind it is freed.
struct Rank<W> {
    driver: WorkerDriver<W>,
    memory: Box<dyn Memory>,
    region: Region,
    address: PeerAddress,
}

fn rank<N: Net, W: WorkerMachine>(
    net: &mut N,
    engine: &str,
    role: Role,
    worker: impl Fn(Handshake, LocalPool) -> Result<W, ConfigError>,
) -> Fallible<Rank<W>> {
    let layout = KvLayout::split_kv(2, 16, 4, 8, kv_core::Dtype::Bfloat16);
    let shape = PoolShape::new(layout, layout.kv_heads, 8)?;
    let mut memory = net.memory(engine);
    let region = memory.allocate(MemoryKind::Host, shape.pool_bytes())?;
    let pool = LocalPool { shape, regions: vec![RegionBase { addr: region.addr, len: region.len }] };
    let offer = pool.offer(&AgentName::new(EngineId::new(engine), 0), 1, 1, role, N::MODEL);
    let (transport, address) = net.transport(&offer, &region)?;
    let mut driver = WorkerDriver::new(worker(offer, pool)?, transport);
    driver.set_waker(kv_sched_adapter::driver::thread_waker());
    Ok(Rank { driver, memory, region, address })
}

/// Runs the pair over `net`; fails unless D holds P's bytes and P freed its blocks.
pub fn pull_pair<N: Net>(net: &mut N) -> Fallible<()> {
    let config = Config::default();
    let mut p_rank = rank(net, "prefill0", Role::Prefill, |o, pool| PrefillWorker::new(o, config, pool))?;
    let mut d_rank = rank(net, "decode0", Role::Decode, |o, pool| DecodeWorker::new(o, config, pool))?;
    let offer = p_rank.driver.machine_ref().offer().clone();
    let mut p = PrefillScheduler::new(&offer, vec![p_rank.address.clone()], config)?;
    let mut d = DecodeScheduler::new(EngineId::new("decode0"), 1, config)?;

    // P computed the prompt into its blocks 0 and 1 (a pattern here), and exports them.
    let block = 4096; // bytes of one block: 2 layers, K and V, 4 heads of 8, 16 tokens, 2 bytes each
    p_rank.memory.write(p_rank.region.id, 0, &(0..2 * block).map(|i| (i % 251) as u8).collect::<Vec<_>>())?;
    let request = RequestId::new("req-1");
    let prompt = kv_core::Prompt::len_only(32);
    let remote = p.handle_finished(net.now(), request.clone(), vec![BlockId(0), BlockId(1)], prompt, None)?;
    // The router hands D the parameters; D admits the request and gives it blocks 4 and 5.
    d.handle_arrive(request.clone(), remote, prompt)?;
    d.handle_schedule(request.clone(), vec![BlockId(4), BlockId(5)], false)?;

    // Both engines' loops: scheduler events to the workers, worker reports to the schedulers.
    let (mut freed, mut ready) = (None, false);
    for _ in 0..5000 {
        while let Some(event) = p.poll_event() {
            match event {
                PrefillEvent::ToWorker { command, .. } => {
                    for report in p_rank.driver.command(net.now(), command) {
                        p.handle_report(0, report)?;
                    }
                }
                PrefillEvent::Free { blocks, reason, .. } => freed = Some((blocks, reason)),
            }
        }
        while let Some(event) = d.poll_event() {
            match event {
                DecodeEvent::ToWorker { command, .. } => {
                    for report in d_rank.driver.command(net.now(), command) {
                        d.handle_report(0, report)?;
                    }
                }
                DecodeEvent::Ended { state, .. } => ready = state == DecodeState::Ready,
                DecodeEvent::Free { .. } => {}
            }
        }
        for report in p_rank.driver.step(net.now()) {
            p.handle_report(0, report)?;
        }
        for report in d_rank.driver.step(net.now()) {
            d.handle_report(0, report)?;
        }
        if ready && freed.is_some() {
            break;
        }
        // Sleep until the sooner of the two workers' deadlines, or a transport's news.
        let due = [p_rank.driver.wait_time(net.now()), d_rank.driver.wait_time(net.now())];
        net.wait(due.into_iter().flatten().min().unwrap_or(Duration::from_millis(50)).max(Duration::from_micros(1)));
    }
    let (blocks, reason) = freed.ok_or("P never freed the export")?;
    // D's blocks 4 and 5 hold P's blocks 0 and 1, byte for byte.
    let (mut sent, mut got) = (vec![0; 2 * block], vec![0; 2 * block]);
    p_rank.memory.read(p_rank.region.id, 0, &mut sent)?;
    d_rank.memory.read(d_rank.region.id, 4 * block as u64, &mut got)?;
    println!("D holds the KV: {ready}, {} bytes equal: {}; P freed {blocks:?} as {reason}", got.len(), got == sent);
    if !(ready && got == sent) {
        return Err("D did not get P's KV".into());
    }
    Ok(())
}

/// Both engines in this process over a real transport that `make` builds (with the process's
/// clock), their pools in kv-cuda's host memory; a wait parks until a transport's waker or
/// the deadline.
#[cfg(feature = "nixl")]
pub struct Sockets<F> {
    clock: std::sync::Arc<kv_demo::e2e::ProcessClock>,
    make: F,
}

#[cfg(feature = "nixl")]
impl<F> Sockets<F>
where
    F: FnMut(&Handshake, std::sync::Arc<dyn kv_core::Clock>) -> Fallible<(Box<dyn Transport>, PeerAddress)>,
{
    pub fn new(make: F) -> Self {
        Sockets { clock: std::sync::Arc::new(kv_demo::e2e::ProcessClock::start()), make }
    }
}

#[cfg(feature = "nixl")]
impl<F> Net for Sockets<F>
where
    F: FnMut(&Handshake, std::sync::Arc<dyn kv_core::Clock>) -> Fallible<(Box<dyn Transport>, PeerAddress)>,
{
    const MODEL: &'static str = "kvflow-example";

    fn now(&self) -> Time {
        kv_core::Clock::now(&*self.clock)
    }

    fn memory(&mut self, _engine: &str) -> Box<dyn Memory> {
        Box::new(kv_cuda::CudaMemory::new())
    }

    fn transport(&mut self, offer: &Handshake, region: &Region) -> Fallible<(Box<dyn Transport>, PeerAddress)> {
        let (mut transport, address) = (self.make)(offer, self.clock.clone())?;
        transport.register(region)?;
        Ok((transport, address))
    }

    fn wait(&mut self, most: Duration) {
        std::thread::park_timeout(most);
    }
}
