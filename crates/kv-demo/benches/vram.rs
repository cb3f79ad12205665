//! The VRAM bench: a 256 MiB KV pool in device memory moved between two processes on one GPU
//! over NIXL/UCX, against a plain device-to-device copy (`cuMemcpy` between two device regions of
//! one process, through kv-cuda) of the same bytes, in the same run. Beside one descriptor, 128
//! prepared block descriptors and a write, it times the connectors' own path: D's read as
//! kv-core plans it, posted as the transport says is faster for this memory
//! (`Transport::descriptors`), against one descriptor and against the copy.
//!
//! The ways run round-robin, so that each sees the same stretch of the machine: one round to
//! warm up (UCX maps the peer's memory on first use), then `--iters` rounds (20 by default); the
//! median of each is reported in GB/s (bytes moved per second, each byte counted once) and
//! against the copy. `--json` prints one JSON object as the last line. P is this binary again,
//! selected by `KVFLOW_BENCH_ROLE`. Without `KVFLOW_GPU=1`, a device or the NIXL runtime it
//! says why it skipped and exits 0. `--host` runs the same ways over host pools (the copy is then
//! a memcpy), which needs only the NIXL runtime.

use std::time::Duration;

use clap::Parser;
use kv_core::{
    BlockId, Descriptors, Granularity, HeadSlice, Initiator, Memory, MemoryKind, PlanInput, PoolSide, PreparedTransfer,
    Role, TransferOp, TransferPlan, TransferRequest, Transport,
};
use kv_cuda::CudaMemory;
use kv_demo::e2e::{
    completion, connect, expect_line, gbps, gpu_skip_reason, loopback, median, nixl_skip_reason, offer, pair, pattern,
    post_and_wait, post_prepared_and_wait, ran_as_child, round_robin, serve_until_peer_leaves, shape, spawn_self,
    timed, transport, transport_with, BenchFlags, BLOCKS, POOL_BYTES,
};
use kv_transport_nixl::NixlConfig;

/// The VRAM bench: a 256 MiB pool moved between two processes over NIXL, against a copy.
#[derive(Parser, Debug)]
#[command(name = "vram")]
struct Args {
    /// Rounds measured after the warm-up round.
    #[arg(long, value_name = "N", default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..))]
    iters: u32,
    /// Moves host pools instead of GPU memory (the copy is then a memcpy); needs no GPU.
    #[arg(long)]
    host: bool,
    /// A UCX backend parameter for D's agent, by NIXL's name (`num_threads=4`); repeatable.
    #[arg(long = "ucx-param", value_name = "KEY=VALUE", value_parser = key_value)]
    ucx_params: Vec<(String, String)>,
    #[command(flatten)]
    flags: BenchFlags,
}

fn key_value(arg: &str) -> Result<(String, String), String> {
    arg.split_once('=')
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .ok_or_else(|| format!("expected KEY=VALUE, got {arg:?}"))
}

const ROLE: &str = "KVFLOW_BENCH_ROLE";
/// The pools' kind, for the child: `host` or `device`.
const KIND: &str = "KVFLOW_BENCH_KIND";
const SEED: u8 = 5;
/// The stride of the scattered read's blocks in D's pool, coprime to [`BLOCKS`].
const SCATTER: u32 = 37;

/// The pools' kind: host memory with `--host`, else GPU 0's.
fn pool_kind(host: bool) -> MemoryKind {
    if host {
        MemoryKind::Host
    } else {
        MemoryKind::Device(0)
    }
}

/// P: a filled pool, served until D goes away.
fn prefill_child() {
    let kind = pool_kind(std::env::var(KIND).as_deref() == Ok("host"));
    let mut memory = CudaMemory::new();
    let pool = memory.allocate(kind, POOL_BYTES).expect("P's pool");
    memory.write(pool.id, 0, &pattern(SEED, POOL_BYTES as usize)).expect("fill P's pool");
    let mut t = transport(offer("bench-prefill", Role::Prefill, &pool), &[pool]).expect("P's transport");
    println!("READY {}", t.side_channel_addr().port());
    serve_until_peer_leaves(&mut t);
}

fn main() {
    if ran_as_child(ROLE, prefill_child) {
        return;
    }
    let Args { iters, host, ucx_params, flags } = Args::parse();
    let kind = pool_kind(host);
    if let Some(reason) = if host { nixl_skip_reason() } else { gpu_skip_reason() } {
        eprintln!("vram bench skipped: {reason}");
        return;
    }
    let kind_name = if host { "host" } else { "device" };
    let (mut child, mut out) = spawn_self(&[], &[(ROLE, "prefill"), (KIND, kind_name)]).expect("spawn the P process");
    let port: u16 = expect_line(&mut out, "READY").expect("P's port").parse().expect("port");

    let mut memory = CudaMemory::new();
    let pool = memory.allocate(kind, POOL_BYTES).expect("D's pool");
    // The copy's source: the same bytes as P's pool, on the same GPU.
    let source = memory.allocate(kind, POOL_BYTES).expect("the copy's source");
    let expected = pattern(SEED, POOL_BYTES as usize);
    memory.write(source.id, 0, &expected).expect("fill the copy's source");
    let config = NixlConfig { ucx_params, ..loopback() };
    let mut d = transport_with(offer("bench-decode", Role::Decode, &pool), &[pool], &config).expect("D's transport");
    let info = connect(&mut d, port).expect("handshake with P");
    let remote = info.handshake.regions[0];

    let whole = vec![pair(pool.addr, remote.addr, POOL_BYTES)];
    let read =
        TransferRequest { op: TransferOp::Read, peer: info.agent.clone(), pairs: whole.clone(), notification: None };
    let write = TransferRequest { op: TransferOp::Write, peer: info.agent.clone(), pairs: whole, notification: None };
    let s = shape();
    let local_list = d.prepare(None, &s.block_descriptors(&[pool.addr])).expect("prepare D's blocks");
    let remote_list = d.prepare(Some(&info.agent), &s.block_descriptors(&[remote.addr])).expect("prepare P's blocks");
    let blocks = PreparedTransfer {
        op: TransferOp::Read,
        peer: info.agent.clone(),
        local: local_list,
        local_indices: (0..BLOCKS).collect(),
        remote: remote_list,
        remote_indices: (0..BLOCKS).collect(),
        notification: Some(completion("bench")),
    };

    // The connectors' own path: D's read of every block as kv-core plans it (merged pairs),
    // posted the way the transport says is faster for this memory (`Transport::descriptors`),
    // as a DecodeWorker with `kv_descriptors = "auto"` does.
    let all: Vec<BlockId> = (0..BLOCKS).map(BlockId).collect();
    let (local_bases, remote_bases) = ([kv_core::RegionBase { addr: pool.addr, len: POOL_BYTES }], [remote]);
    let input = PlanInput {
        prefill: PoolSide { shape: s, regions: &remote_bases, blocks: &all },
        decode: PoolSide { shape: s, regions: &local_bases, blocks: &all },
        skip_tokens: 0,
        slice: HeadSlice { prefill_rank: 0, prefill_head: 0, decode_head: 0, heads: s.heads },
        initiator: Initiator::Decode,
    };
    let plan = TransferPlan::build(&input, Granularity::Merged).expect("the connectors' plan");
    let choice = d.descriptors();
    let ours = TransferRequest {
        op: TransferOp::Read,
        peer: info.agent.clone(),
        pairs: plan.pairs().to_vec(),
        notification: Some(completion("bench")),
    };
    let ours_name = format!("kvflow ({})", choice.as_str());
    let ours_descriptors = if choice == Descriptors::Pairs { plan.len() } else { BLOCKS as usize };
    // The same read into blocks scattered over D's pool, as an engine's block table is once its
    // free list has churned: D's k-th block is block 37 k mod 128, so no two neighbours merge and
    // the plan holds one pair per block.
    let scattered: Vec<BlockId> = (0..BLOCKS).map(|k| BlockId(k * SCATTER % BLOCKS)).collect();
    let input = PlanInput { decode: PoolSide { blocks: &scattered, ..input.decode }, ..input };
    let plan = TransferPlan::build(&input, Granularity::Merged).expect("the connectors' scattered plan");
    let spread = TransferRequest { pairs: plan.pairs().to_vec(), ..ours.clone() };
    let spread_name = format!("kvflow scattered ({})", choice.as_str());
    let spread_descriptors = if choice == Descriptors::Pairs { plan.len() } else { BLOCKS as usize };
    let spread_blocks = PreparedTransfer { local_indices: scattered.iter().map(|b| b.0).collect(), ..blocks.clone() };

    let copy_name = if host { "memcpy" } else { "cuMemcpy DtoD" };
    let ways: [(&str, usize); 7] = [
        (copy_name, 1),
        ("NIXL read", 1),
        ("NIXL read blocks", BLOCKS as usize),
        ("NIXL write", 1),
        ("NIXL read scattered", BLOCKS as usize),
        (&spread_name, spread_descriptors),
        (&ours_name, ours_descriptors),
    ];
    let scattered_read = |d: &mut kv_transport_nixl::NixlTransport| match choice {
        Descriptors::Pairs => post_and_wait(d, spread.clone()).expect("the connectors' scattered read"),
        _ => post_prepared_and_wait(d, spread_blocks.clone()).expect("the connectors' scattered read"),
    };
    let samples = round_robin(ways.len(), iters, |way| match way {
        0 => timed(|| memory.copy(pool.id, 0, source.id, 0, POOL_BYTES).expect("device copy")),
        1 => post_and_wait(&mut d, read.clone()).expect("read"),
        2 => post_prepared_and_wait(&mut d, blocks.clone()).expect("prepared read"),
        3 => post_and_wait(&mut d, write.clone()).expect("write"),
        4 => post_prepared_and_wait(&mut d, spread_blocks.clone()).expect("prepared scattered read"),
        5 => scattered_read(&mut d),
        _ if choice == Descriptors::Pairs => post_and_wait(&mut d, ours.clone()).expect("the connectors' read"),
        _ => post_prepared_and_wait(&mut d, blocks.clone()).expect("the connectors' read"),
    });
    // What D's pool holds is P's pool, byte for byte (every way but the scattered one moved the
    // same bytes, and the connectors' contiguous read ran last).
    let mut back = vec![0u8; POOL_BYTES as usize];
    memory.read(pool.id, 0, &mut back).expect("read D's pool back");
    assert!(back == expected, "the bytes in D's pool differ from P's");
    // The scattered read puts P's k-th block into D's block 37 k mod 128.
    scattered_read(&mut d);
    memory.read(pool.id, 0, &mut back).expect("read D's pool back");
    let block = (POOL_BYTES / u64::from(BLOCKS)) as usize;
    for (k, to) in scattered.iter().enumerate() {
        let to = to.0 as usize;
        assert!(
            back[to * block..][..block] == expected[k * block..][..block],
            "D's block {to} does not hold P's block {k} after the scattered read"
        );
    }

    let results: Vec<(&str, usize, Duration)> =
        ways.iter().zip(samples).map(|((name, n), samples)| (*name, *n, median(samples))).collect();
    let copy_gbps = gbps(POOL_BYTES, results[0].2);
    let what = if host { "host to host" } else { "VRAM to VRAM on one GPU" };
    println!("\nvram: {} MiB {what}, two processes for NIXL, median of {iters}", POOL_BYTES >> 20);
    // Given to UCX by the transport unless the environment sets it: it decides UCX's path for
    // reads.
    let get = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY";
    match std::env::var(get) {
        Ok(value) => println!("{get}={value} (from the environment)"),
        Err(_) => println!("UCX settings from the transport: {}", kv_transport_nixl::engine_config(None)),
    }
    println!("{:<26} {:>12} {:>10} {:>10} {:>10}", "way", "descriptors", "ms", "GB/s", "vs copy");
    for (name, descriptors, d) in &results {
        let g = gbps(POOL_BYTES, *d);
        let ms = d.as_secs_f64() * 1e3;
        println!("{name:<26} {descriptors:>12} {ms:>10.3} {g:>10.1} {:>9.2}x", g / copy_gbps);
    }
    let single_gbps = gbps(POOL_BYTES, results[1].2);
    let (ours_gbps, spread_gbps) = (gbps(POOL_BYTES, results[6].2), gbps(POOL_BYTES, results[5].2));
    for (what, g) in [("the connectors' path", ours_gbps), ("scattered over D's pool", spread_gbps)] {
        println!(
            "{what}: {:.2} of one NIXL descriptor (target >= 0.9), {:.2} of the copy (target >= 0.8)",
            g / single_gbps,
            g / copy_gbps
        );
    }
    if flags.json {
        let mut fields = serde_json::Map::new();
        fields.insert("kind".into(), kind_name.into());
        fields.insert("bytes".into(), POOL_BYTES.into());
        fields.insert("iters".into(), iters.into());
        for (name, n, d) in &results {
            let gbps = (gbps(POOL_BYTES, *d) * 1000.0).round() / 1000.0;
            fields.insert(name.replace(' ', "_"), serde_json::json!({ "descriptors": n, "gbps": gbps }));
        }
        fields.insert(
            "connectors".into(),
            serde_json::json!({
                "descriptors": choice.as_str(),
                "over_single_descriptor": ours_gbps / single_gbps,
                "over_copy": ours_gbps / copy_gbps,
            }),
        );
        fields.insert(
            "connectors_scattered".into(),
            serde_json::json!({
                "descriptors": choice.as_str(),
                "over_single_descriptor": spread_gbps / single_gbps,
                "over_copy": spread_gbps / copy_gbps,
            }),
        );
        println!("{}", serde_json::json!({ "vram": fields }));
    }
    drop(d);
    let _ = child.wait();
}
