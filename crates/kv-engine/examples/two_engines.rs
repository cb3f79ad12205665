//! A P engine and a D engine in one process, each as an engine embeds kvflow: a scheduler on
//! the engine's thread and a thread per TP rank ([`Engine`]), published in a static registry
//! (where D finds P), the connectors' metrics served for Prometheus, and plain TCP as the
//! transport (any `Transport` would do: the binary picks it). P computes a two-block prompt
//! and exports it; the handoff travels to D as JSON, as vLLM's `kv_transfer_params`; D loads it;
//! P frees its blocks as `transferred`. It exits 0 only if D's bytes equal P's, the release was
//! `transferred`, and P's metrics endpoint says so.
//!
//! `cargo run -p kv-engine --example two_engines`

use std::error::Error;
use std::io::{Read, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_core::discovery::{Discovery, EngineRecord, StaticDiscovery};
use kv_core::{AgentName, BlockId, Clock, EngineId, KvLayout, Memory, MemoryKind, PeerAddress, PoolShape, Region};
use kv_core::{RegionBase, RequestId, Role, Transport};
use kv_engine::metrics::{install_recorder, MetricsEndpoint};
use kv_engine::{Engine, ProcessClock, Registration};
use kv_sched_adapter::{Config, DecodeEvent, DecodeScheduler, DecodeState, DecodeWorker, LocalPool};
use kv_sched_adapter::{PrefillEvent, PrefillScheduler, PrefillWorker, ReleaseReason, RemoteRef};
use kv_transport_tcp::{TcpConfig, TcpTransport};

type Fallible<T> = Result<T, Box<dyn Error>>;

const MODEL: &str = "kvflow-example";
/// Bytes of one block: 2 layers, K and V, 4 heads of 8, 16 tokens, 2 bytes each.
const BLOCK: usize = 4096;

/// One rank's pool in host memory, its handshake offer, and its transport with the pool
/// registered; and where peers reach it.
struct Rank {
    memory: kv_cuda::CudaMemory,
    region: Region,
    pool: LocalPool,
    offer: kv_core::Handshake,
}

fn rank(engine: &str, role: Role, clock: &Arc<dyn Clock>) -> Fallible<(Rank, Box<dyn Transport>, PeerAddress)> {
    let layout = KvLayout::split_kv(2, 16, 4, 8, kv_core::Dtype::Bfloat16);
    let shape = PoolShape::new(layout, layout.kv_heads, 8)?;
    let mut memory = kv_cuda::CudaMemory::new();
    let region = memory.allocate(MemoryKind::Host, shape.pool_bytes())?;
    let pool = LocalPool { shape, regions: vec![RegionBase { addr: region.addr, len: region.len }] };
    // The engine's name and incarnation are given here, once: the scheduler takes them from it.
    let offer = pool.offer(&AgentName::new(EngineId::new(engine), 0), 1, 1, role, MODEL);
    let config = TcpConfig { bind: "127.0.0.1:0".parse()?, ..TcpConfig::default() };
    let mut transport = TcpTransport::new(offer.clone(), &config, clock.clone())?;
    transport.register(&region)?;
    let address = PeerAddress(transport.side_channel_addr().to_string());
    Ok((Rank { memory, region, pool, offer }, Box::new(transport), address))
}

/// Publishes `offer`'s engine, reachable at `address`, in `registry`.
fn publish(registry: &StaticDiscovery, offer: &kv_core::Handshake, address: &PeerAddress) -> Fallible<Registration> {
    let record = EngineRecord {
        engine: offer.engine.clone(),
        instance: offer.instance,
        role: offer.role,
        addresses: vec![address.0.clone()],
        layout: offer.layout,
        tp_size: offer.tp_size,
    };
    let registry = registry.clone();
    let connect = move || async move { Ok::<_, std::convert::Infallible>(registry) };
    Ok(Registration::start(connect, record, std::thread::current(), Duration::from_secs(5))?.0)
}

/// `GET /metrics` from `endpoint`, the body.
fn scrape(endpoint: &MetricsEndpoint) -> Fallible<String> {
    let mut stream = std::net::TcpStream::connect(endpoint.addr())?;
    stream.write_all(b"GET /metrics HTTP/1.1\r\nHost: kvflow\r\nConnection: close\r\n\r\n")?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer)?;
    Ok(answer.split_once("\r\n\r\n").map(|(_, body)| body.to_owned()).unwrap_or_default())
}

fn main() -> Fallible<()> {
    // Before any connector is built: they take their metric handles from the recorder.
    let recorder = install_recorder()?;
    let endpoint = MetricsEndpoint::serve("127.0.0.1:0".parse()?, move || recorder.render())?;
    let clock: Arc<dyn Clock> = Arc::new(ProcessClock::start());
    let config = Config::default();
    let registry = StaticDiscovery::new(Vec::new());

    let (mut p_rank, p_transport, p_address) = rank("prefill0", Role::Prefill, &clock)?;
    let p_worker = PrefillWorker::new(p_rank.offer.clone(), config, p_rank.pool.clone())?;
    let p_scheduler = PrefillScheduler::new(&p_rank.offer, vec![p_address.clone()], config)?;
    let mut p = Engine::start(p_scheduler, vec![(p_worker, p_transport)], clock.clone())?;
    let _p_published = publish(&registry, &p_rank.offer, &p_address)?;

    let (d_rank, d_transport, d_address) = rank("decode0", Role::Decode, &clock)?;
    let d_worker = DecodeWorker::new(d_rank.offer.clone(), config, d_rank.pool.clone())?;
    let mut d = Engine::start(
        DecodeScheduler::new(EngineId::new("decode0"), 1, config)?,
        vec![(d_worker, d_transport)],
        clock.clone(),
    )?;
    let _d_published = publish(&registry, &d_rank.offer, &d_address)?;

    // D finds P in the registry and connects ahead of its first request.
    let runtime = tokio::runtime::Builder::new_current_thread().build()?;
    let found = runtime.block_on(registry.resolve(&EngineId::new("prefill0")))?.ok_or("P is not published")?;
    let addresses = found.addresses.iter().map(|a| PeerAddress(a.clone())).collect();
    let prefill =
        kv_sched_adapter::PrefillEngine { engine: found.engine, addresses, tp_size: found.tp_size, pp_size: 1 };
    d.scheduler().handle_connect(prefill);

    // P computed a prompt of 32 tokens into its blocks 0 and 1, and exports them.
    let computed: Vec<u8> = (0..2 * BLOCK).map(|i| (i % 251) as u8).collect();
    p_rank.memory.write(p_rank.region.id, 0, &computed)?;
    let request = RequestId::new("req-1");
    let prompt = kv_core::Prompt::len_only(32);
    let remote =
        p.scheduler().handle_finished(clock.now(), request.clone(), vec![BlockId(0), BlockId(1)], prompt, None)?;
    // The router carries the handoff to D as JSON, inside vLLM's kv_transfer_params.
    let params = serde_json::to_string(&remote)?;
    println!("kv_transfer_params: {params}");
    let remote: RemoteRef = serde_json::from_str(&params)?;
    d.scheduler().handle_arrive(request.clone(), remote, prompt)?;
    d.scheduler().handle_schedule(request.clone(), vec![BlockId(4), BlockId(5)], false)?;

    let (mut freed, mut ready, deadline) = (None, false, Instant::now() + Duration::from_secs(10));
    while !(ready && freed.is_some()) && Instant::now() < deadline {
        for event in p.poll()? {
            if let PrefillEvent::Free { reason, .. } = event {
                freed = Some(reason);
            }
        }
        for event in d.poll()? {
            if let DecodeEvent::Ended { state, .. } = event {
                ready = state == DecodeState::Ready;
            }
        }
        p.wait(Duration::from_millis(5));
    }
    let mut got = vec![0; 2 * BLOCK];
    d_rank.memory.read(d_rank.region.id, 4 * BLOCK as u64, &mut got)?;
    let metrics = scrape(&endpoint)?;
    let counted = metrics.lines().any(|l| {
        l.starts_with("kvflow_releases_total{") && l.contains(r#"reason="transferred""#) && l.ends_with("} 1")
    });
    println!("D ready: {ready}; bytes equal: {}; P released as {freed:?}; metrics say so: {counted}", got == computed);
    if !(ready && got == computed && freed == Some(ReleaseReason::Transferred) && counted) {
        return Err("the KV did not cross whole, or P did not release it as transferred".into());
    }
    Ok(())
}
