//! The transport bench: one 128 MiB prompt's KV moved between two processes over NIXL/UCX.
//!
//! The layout is a 32-layer model with 8 KV heads of 128, bf16, 16-token blocks, laid out
//! layer-major (one region per layer, as vLLM's per-layer caches are): 64 blocks of 2 MiB, in
//! 32 regions of 4 MiB. Each side's pool is a host pool as kv-cuda allocates it (so on
//! transparent huge pages where the kernel gives them). D reads P's pool five ways, and
//! memcpy copies the same bytes between two such pools in D:
//!
//! - memcpy: the ceiling, in one process;
//! - raw: one nixl-sys descriptor over the whole buffer;
//! - merged: kvflow's plan, runs contiguous on both sides merged (one descriptor per layer);
//! - per-block plan: one descriptor per (layer, K or V, block), 32 KiB each. This is what
//!   vLLM's NixlConnector posts for this model: it registers each layer's K and V caches as
//!   separate regions and lists one descriptor per block of each. It is the baseline the
//!   targets name.
//! - per-block whole: one descriptor per (layer, block), 64 KiB, K and V together. kvflow's
//!   layout keeps a block's K and V planes adjacent, so this is the per-block plan kvflow's
//!   own `Granularity::PerBlock` builds: a milder baseline, printed beside the other;
//! - prepared: the whole-block descriptors, prepared once with the peer, the transfer
//!   naming only their indices (NIXL merges runs that are contiguous on both sides).
//!
//! The ways run round-robin, so that each sees the same stretch of a noisy machine: one round
//! to warm up, then `--iters` rounds (25 by default). Each way's median is reported in GB/s.
//! The ratios are paired: each round gives one ratio of two ways' times, taken seconds apart,
//! and the median of those is printed with the 10th and 90th percentiles beside it, so that a
//! machine whose speed drifts during the run moves the spread, not the ratio. `--json` prints
//! one JSON object as the last line.
//!
//! `KVFLOW_BENCH_UCX_PARAMS=num_threads=4` passes UCX backend parameters to both agents (here
//! NIXL's thread pool, as vLLM configures it); the table's title names them. The child
//! process (P) is this binary again, selected by `KVFLOW_BENCH_ROLE`.

use std::time::Duration;

use clap::Parser;
use kv_core::{
    BlockId, DescriptorPair, Granularity, HeadSlice, Initiator, KvLayout, Memory, MemoryKind, Placement, PlanInput,
    PoolShape, PoolSide, PreparedTransfer, Region, RegionBase, Role, TransferOp, TransferPlan, TransferRequest,
    Transport,
};
use kv_cuda::CudaMemory;
use kv_demo::e2e::{
    completion, connect, expect_line, gbps, loopback, median, nixl_skip_reason, offer_with, pair, pattern,
    post_and_wait, post_prepared_and_wait, ran_as_child, round_robin, serve_until_peer_leaves, spawn_self, timed,
    BenchFlags,
};
use kv_transport_nixl::{NixlConfig, NixlTransport};

/// The transport bench: 128 MiB of KV read between two processes over NIXL/UCX, six ways.
#[derive(Parser, Debug)]
#[command(name = "transport")]
struct Args {
    /// Rounds measured after the warm-up round.
    #[arg(long, value_name = "N", default_value_t = 25, value_parser = clap::value_parser!(u32).range(1..))]
    iters: u32,
    #[command(flatten)]
    flags: BenchFlags,
}

const BLOCKS: u32 = 64;
const ROLE: &str = "KVFLOW_BENCH_ROLE";
const SEED: u8 = 7;

/// The e2e model (32 layers, 8 KV heads of 128, bf16, 16-token blocks), laid out layer-major.
fn layout() -> KvLayout {
    KvLayout { placement: Placement::LayerMajor, ..kv_demo::e2e::layout() }
}

fn shape() -> PoolShape {
    PoolShape::new(layout(), 8, BLOCKS).expect("bench layout")
}

/// A pool's layer regions, back to back in one host region.
fn layer_regions(pool: &Region) -> Vec<RegionBase> {
    let s = shape();
    (0..s.region_count())
        .map(|i| RegionBase { addr: pool.addr + u64::from(i) * s.region_len(), len: s.region_len() })
        .collect()
}

/// `KVFLOW_BENCH_UCX_PARAMS=num_threads=4,split_batch_size=8`: more UCX backend parameters.
fn ucx_params() -> Vec<(String, String)> {
    std::env::var("KVFLOW_BENCH_UCX_PARAMS")
        .ok()
        .map(|v| v.split(',').filter_map(|kv| kv.split_once('=')).map(|(k, v)| (k.to_owned(), v.to_owned())).collect())
        .unwrap_or_default()
}

/// A host pool from kv-cuda, registered with a transport whose handshake lists its layers.
fn pool_and_transport(memory: &mut CudaMemory, engine: &str, role: Role) -> (Region, NixlTransport) {
    let pool = memory.allocate(MemoryKind::Host, shape().pool_bytes()).expect("a host pool");
    let ucx_workers = std::env::var("KVFLOW_BENCH_UCX_WORKERS").ok().and_then(|v| v.parse().ok());
    let config = NixlConfig { ucx_workers, ucx_params: ucx_params(), ..loopback() };
    let offer = offer_with(engine, role, layout(), BLOCKS, layer_regions(&pool));
    let t = kv_demo::e2e::transport_with(offer, &[pool], &config).expect("NIXL transport");
    (pool, t)
}

fn prefill_child() {
    let mut memory = CudaMemory::new();
    let (pool, mut t) = pool_and_transport(&mut memory, "bench-prefill", Role::Prefill);
    memory.write(pool.id, 0, &pattern(SEED, pool.len as usize)).expect("fill P's pool");
    println!("READY {}", t.side_channel_addr().port());
    serve_until_peer_leaves(&mut t);
}

fn plan(local: &[RegionBase], remote: &[RegionBase], granularity: Granularity) -> TransferPlan {
    let blocks: Vec<BlockId> = (0..BLOCKS).map(BlockId).collect();
    let input = PlanInput {
        prefill: PoolSide { shape: shape(), regions: remote, blocks: &blocks },
        decode: PoolSide { shape: shape(), regions: local, blocks: &blocks },
        skip_tokens: 0,
        slice: HeadSlice { prefill_rank: 0, prefill_head: 0, decode_head: 0, heads: 8 },
        initiator: Initiator::Decode,
    };
    TransferPlan::build(&input, granularity).expect("bench plan")
}

fn read(t: &mut NixlTransport, peer: &kv_core::AgentName, pairs: &[DescriptorPair]) -> Duration {
    let request = TransferRequest {
        op: TransferOp::Read,
        peer: peer.clone(),
        pairs: pairs.to_vec(),
        notification: Some(completion("bench")),
    };
    // Timed from the post: building the request is not the transport's work.
    post_and_wait(t, request).expect("bench read")
}

fn read_prepared(t: &mut NixlTransport, request: &PreparedTransfer) -> Duration {
    post_prepared_and_wait(t, request.clone()).expect("bench read")
}

/// Splits each whole-block descriptor into its planes (K, then V), as a connector that
/// registers K and V separately lists them.
fn split_planes(pairs: &[DescriptorPair], plane: u64) -> Vec<DescriptorPair> {
    pairs
        .iter()
        .flat_map(|p| {
            assert_eq!(p.len % plane, 0, "a whole-block descriptor holds whole planes");
            (0..p.len / plane).map(move |i| DescriptorPair {
                local_addr: p.local_addr + i * plane,
                remote_addr: p.remote_addr + i * plane,
                len: plane,
                ..*p
            })
        })
        .collect()
}

/// The `q` quantile (nearest rank) of `values`.
fn quantile(values: &[f64], q: f64) -> f64 {
    kv_demo::stats::quantile(values, q).unwrap_or(f64::NAN)
}

/// How much faster the merged plan was than another way, round by round.
struct Paired {
    median: f64,
    p10: f64,
    p90: f64,
}

impl Paired {
    /// `other[r] / merged[r]` for every round `r`: above 1 means the merged plan was faster.
    fn new(merged: &[Duration], other: &[Duration]) -> Paired {
        let ratios: Vec<f64> = merged.iter().zip(other).map(|(m, o)| o.as_secs_f64() / m.as_secs_f64()).collect();
        Paired { median: quantile(&ratios, 0.5), p10: quantile(&ratios, 0.1), p90: quantile(&ratios, 0.9) }
    }

    fn text(&self) -> String {
        format!("{:.2} ({:.2}..{:.2})", self.median, self.p10, self.p90)
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({ "median": round3(self.median), "p10": round3(self.p10), "p90": round3(self.p90) })
    }
}

/// `x` to three decimals, as the report prints it.
fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

fn main() {
    if ran_as_child(ROLE, prefill_child) {
        return;
    }
    let Args { iters, flags } = Args::parse();
    if let Some(reason) = nixl_skip_reason() {
        eprintln!("transport bench skipped: {reason}");
        std::process::exit(if std::env::var("CI").is_ok_and(|v| v == "true") { 1 } else { 0 });
    }
    let (mut child, mut out) = spawn_self(&[], &[(ROLE, "prefill")]).expect("spawn the P process");
    let port: u16 = expect_line(&mut out, "READY").expect("P's port").parse().expect("port");

    let mut memory = CudaMemory::new();
    let (pool, mut d) = pool_and_transport(&mut memory, "bench-decode", Role::Decode);
    let info = connect(&mut d, port).expect("handshake with P");
    let remote = info.handshake.regions.clone();
    let local = layer_regions(&pool);
    let total = shape().pool_bytes();
    let raw = vec![pair(pool.addr, remote[0].addr, total)];
    let merged = plan(&local, &remote, Granularity::Merged);
    // Per-block descriptors prepared once per side; the transfer names (layer, block) indices.
    let s = shape();
    let local_bases: Vec<u64> = local.iter().map(|r| r.addr).collect();
    let remote_bases: Vec<u64> = remote.iter().map(|r| r.addr).collect();
    let local_list = d.prepare(None, &s.block_descriptors(&local_bases)).expect("prepare local");
    let remote_list = d.prepare(Some(&info.agent), &s.block_descriptors(&remote_bases)).expect("prepare remote");
    let indices: Vec<u32> = (0..32).flat_map(|l| (0..BLOCKS).map(move |b| s.descriptor_index(l, b))).collect();
    let prepared = PreparedTransfer {
        op: TransferOp::Read,
        peer: info.agent.clone(),
        local: local_list,
        local_indices: indices.clone(),
        remote: remote_list,
        remote_indices: indices,
        notification: Some(completion("bench")),
    };
    let whole_blocks = plan(&local, &remote, Granularity::PerBlock);
    let per_block = split_planes(whole_blocks.pairs(), s.plane_bytes());
    assert_eq!(merged.bytes(), total);
    assert_eq!(per_block.iter().map(|p| p.len).sum::<u64>(), total);

    // memcpy's source and sink: two more pools of the same kind, in this process.
    let expected = pattern(SEED, total as usize);
    let source = memory.allocate(MemoryKind::Host, total).expect("memcpy's source");
    let sink = memory.allocate(MemoryKind::Host, total).expect("memcpy's sink");
    memory.write(source.id, 0, &expected).expect("fill memcpy's source");
    let ways: [(&str, usize); 6] = [
        ("memcpy", 1),
        ("raw nixl-sys", raw.len()),
        ("merged plan", merged.len()),
        ("per-block plan", per_block.len()),
        ("per-block whole", whole_blocks.len()),
        ("prepared blocks", prepared.local_indices.len()),
    ];
    let samples = round_robin(ways.len(), iters, |way| match way {
        0 => timed(|| memory.copy(sink.id, 0, source.id, 0, total).expect("memcpy")),
        1 => read(&mut d, &info.agent, &raw),
        2 => read(&mut d, &info.agent, merged.pairs()),
        3 => read(&mut d, &info.agent, &per_block),
        4 => read(&mut d, &info.agent, whole_blocks.pairs()),
        _ => read_prepared(&mut d, &prepared),
    });
    // What arrived is P's pool, byte for byte, and memcpy copied it whole.
    for (what, region) in [("D's pool", pool), ("memcpy's sink", sink)] {
        let mut back = vec![0u8; total as usize];
        memory.read(region.id, 0, &mut back).expect("read back");
        assert!(back == expected, "the bytes in {what} differ from P's");
    }
    let [_, raw_s, merged_s, block_s, whole_s, _] = samples.as_slice() else { unreachable!("six ways") };
    let ratios = [
        ("merged_over_raw", "merged / raw", Paired::new(merged_s, raw_s), "target >= 0.9"),
        ("merged_over_per_block", "merged / per-block", Paired::new(merged_s, block_s), "target >= 1.8"),
        ("merged_over_per_block_whole", "merged / per-block whole", Paired::new(merged_s, whole_s), ""),
    ];
    let results: Vec<(&str, usize, Duration)> =
        ways.iter().zip(samples).map(|((name, n), samples)| (*name, *n, median(samples))).collect();
    let params: Vec<String> = ucx_params().iter().map(|(k, v)| format!("{k}={v}")).collect();
    let params = if params.is_empty() { "UCX defaults".to_owned() } else { params.join(",") };
    let raw_gbps = results.iter().find(|r| r.0 == "raw nixl-sys").map(|r| gbps(total, r.2)).unwrap_or(0.0);
    println!("\ntransport: {} MiB between two processes, {params}, median of {iters} rounds", total >> 20);
    println!("{:<16} {:>12} {:>10} {:>12}", "way", "descriptors", "GB/s", "vs raw");
    for (name, descriptors, d) in &results {
        let g = gbps(total, *d);
        println!("{name:<16} {descriptors:>12} {g:>10.2} {:>11.2}x", g / raw_gbps);
    }
    println!("paired ratios, median of the rounds (10th..90th percentile):");
    for (_, label, ratio, target) in &ratios {
        println!("  {label:<26} {:<20} {target}", ratio.text());
    }
    if flags.json {
        // serde_json escapes what the environment put in `params`; format! would not.
        let mut fields = serde_json::Map::new();
        fields.insert("bytes".into(), total.into());
        fields.insert("iters".into(), iters.into());
        fields.insert("ucx_params".into(), params.clone().into());
        for (name, n, d) in &results {
            let way = serde_json::json!({ "descriptors": n, "gbps": round3(gbps(total, *d)) });
            fields.insert(name.replace(' ', "_"), way);
        }
        for (key, _, ratio, _) in &ratios {
            fields.insert((*key).to_owned(), ratio.json());
        }
        println!("{}", serde_json::json!({ "transport": fields }));
    }
    drop(d);
    let _ = child.wait();
}
