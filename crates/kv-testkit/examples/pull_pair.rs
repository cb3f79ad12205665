//! The smallest P and D pair: kvflow's real connectors over kv-testkit's in-memory transport.
//!
//! P finishes a two-block prompt and exports it, D reads it into its own pool, and P frees
//! its blocks as `transferred`. `cargo run -p kv-testkit --example pull_pair`; the same engine
//! code runs over NIXL once `FakeTransport` is swapped for `kv_transport_nixl::NixlTransport`.

use std::error::Error;
use std::time::Duration;

use kv_core::{
    AgentName, BlockId, EngineId, Handshake, KvLayout, Memory, MemoryKind, PeerAddress, PoolShape, RegionBase,
    RegionId, RequestId, Role, Transport,
};
use kv_sched_adapter::driver::{WorkerDriver, WorkerMachine};
use kv_sched_adapter::{
    Config, ConfigError, DecodeEvent, DecodeScheduler, DecodeState, DecodeWorker, LocalPool, PrefillEvent,
    PrefillScheduler, PrefillWorker,
};
use kv_testkit::{FakeHeap, FakeNetwork, InMemoryMemory, ManualClock, NetConfig, FAKE_MODEL};

/// One TP rank of an engine: its pool in memory, and its worker over its transport.
fn rank<W: WorkerMachine>(
    net: &FakeNetwork,
    engine: &str,
    role: Role,
    base: u64,
    worker: impl Fn(Handshake, LocalPool) -> Result<W, ConfigError>,
) -> Result<(InMemoryMemory, RegionId, WorkerDriver<W>), Box<dyn Error>> {
    let layout = KvLayout::split_kv(2, 16, 4, 8, 2);
    let shape = PoolShape::new(layout, layout.kv_heads, 8)?;
    let heap = FakeHeap::with_base(base);
    let mut memory = InMemoryMemory::new(heap.clone());
    let region = memory.allocate(MemoryKind::Host, shape.pool_bytes())?;
    let pool = LocalPool { shape, regions: vec![RegionBase { addr: region.addr, len: region.len }] };
    let agent = AgentName::new(EngineId::new(engine), 0);
    let offer = pool.offer(&agent, 1, 1, role, FAKE_MODEL);
    let mut transport = net.transport(agent, PeerAddress(engine.into()), heap, offer.clone())?;
    transport.register(&region)?;
    Ok((memory, region.id, WorkerDriver::new(worker(offer, pool)?, Box::new(transport))))
}

fn main() -> Result<(), Box<dyn Error>> {
    let clock = ManualClock::default();
    let net = FakeNetwork::new(1, clock.clone(), NetConfig::default());
    let config = Config::default();
    let (mut p_memory, p_region, mut p_rank) =
        rank(&net, "prefill0", Role::Prefill, 0x1000_0000, |o, pool| PrefillWorker::new(o, config, pool))?;
    let (d_memory, d_region, mut d_rank) =
        rank(&net, "decode0", Role::Decode, 0x9000_0000, |o, pool| DecodeWorker::new(o, config, pool))?;
    let mut p = PrefillScheduler::new(EngineId::new("prefill0"), 1, vec![PeerAddress("prefill0".into())], config)?;
    let mut d = DecodeScheduler::new(1, config)?;

    // P computed the prompt into its blocks 0 and 1 (a pattern here), and exports them.
    let block = 4096; // bytes of one block: 2 layers, K and V, 4 heads of 8, 16 tokens, 2 bytes each
    p_memory.write(p_region, 0, &(0..2 * block).map(|i| (i % 251) as u8).collect::<Vec<_>>())?;
    let request = RequestId::new("req-1");
    let remote = p.handle_finished(clock.now(), request.clone(), vec![BlockId(0), BlockId(1)], 32, None)?;
    // The router hands D the parameters; D admits the request and gives it blocks 4 and 5.
    d.handle_arrive(request.clone(), remote)?;
    d.handle_schedule(request.clone(), vec![BlockId(4), BlockId(5)], false)?;

    // Both engines' loops: scheduler events to the workers, worker reports to the schedulers.
    let (mut freed, mut ready) = (None, false);
    for _ in 0..200 {
        while let Some(event) = p.poll_event() {
            match event {
                PrefillEvent::ToWorker { command, .. } => p_rank.machine().handle_command(clock.now(), command),
                PrefillEvent::Free { blocks, reason, .. } => freed = Some((blocks, reason)),
            }
        }
        while let Some(event) = d.poll_event() {
            match event {
                DecodeEvent::ToWorker { command, .. } => d_rank.machine().handle_command(clock.now(), command),
                DecodeEvent::Ended { state, .. } => ready = state == DecodeState::Ready,
                DecodeEvent::Free { .. } => {}
            }
        }
        for report in p_rank.step(clock.now()) {
            p.handle_report(0, report)?;
        }
        for report in d_rank.step(clock.now()) {
            d.handle_report(0, report)?;
        }
        if ready && freed.is_some() {
            break;
        }
        clock.advance(Duration::from_millis(1));
    }
    let (blocks, reason) = freed.ok_or("P never freed the export")?;
    // D's blocks 4 and 5 hold P's blocks 0 and 1, byte for byte.
    let (mut sent, mut got) = (vec![0; 2 * block], vec![0; 2 * block]);
    p_memory.read(p_region, 0, &mut sent)?;
    d_memory.read(d_region, 4 * block as u64, &mut got)?;
    println!("D holds the KV: {ready}, {} bytes equal: {}; P freed {blocks:?} as {reason}", got.len(), got == sent);
    assert!(ready && got == sent, "D did not get P's KV");
    Ok(())
}
