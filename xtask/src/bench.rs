//! `cargo xtask bench`: runs the criterion benches and prints each against its baseline, then
//! the two-process transport bench, and the end-to-end runs of the demo's engines: pull
//! against push one request at a time and under load, and idle engines.
//!
//! Every number printed was measured in this run: criterion writes its estimates under
//! `target/criterion`, and this task reads them back and prints the ratio of the baseline to
//! kvflow's implementation (above 1 means kvflow is faster).

use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::{json, Value};

use crate::bench_results;
use crate::demo::build_node;
use crate::provision;
use crate::workspace::{self, cargo_command, cargo_env};
use kv_demo::demo::{Demo, DemoConfig, NodeBinary, Report, TopologyArgs};
use kv_demo::proto::TransportKind;

/// The flags of `cargo xtask bench`.
#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Prints one JSON object on stdout instead of the tables.
    #[arg(long)]
    json: bool,
    /// Also writes that object, stamped with the git revision, the host and the date, into a
    /// new file under `bench/results/` (`docs/benchmarks.md` shows the newest: `cargo xtask
    /// docs`).
    #[arg(long)]
    json_out: bool,
    /// Measures less of each bench, to end within a few minutes once built.
    #[arg(long)]
    quick: bool,
    /// The transport of the end-to-end runs (pull against push, idle engines): NIXL over
    /// UCX, or plain TCP. The two-process transport bench always measures NIXL.
    #[arg(long, value_enum, default_value_t = TransportKind::Nixl)]
    transport: TransportKind,
    /// The engines' shapes in the end-to-end runs.
    #[command(flatten)]
    topology: TopologyArgs,
    /// Also runs the VRAM bench (kv-demo's `benches/vram.rs`, with `KVFLOW_GPU=1`): the
    /// connectors' own VRAM-to-VRAM path against one NIXL descriptor and `cuMemcpy` device to
    /// device, in one run. Without a GPU it says why it skipped.
    #[arg(long)]
    gpu: bool,
    /// Runs only these parts (a list: `in-flight,latency`); all of them by default.
    #[arg(long, value_enum, value_delimiter = ',', value_name = "PART[,PART...]")]
    only: Vec<Part>,
}

/// The parts of the bench.
#[derive(Clone, Copy, PartialEq, Eq, Debug, clap::ValueEnum)]
enum Part {
    /// The lease table against a scan (criterion).
    Lease,
    /// The TCP transport's payload tags against none (criterion): what `payload_tags` costs.
    TcpTags,
    /// Two processes over NIXL: kvflow's descriptors against memcpy and raw nixl-sys.
    Transport,
    /// Pull against push, one request at a time: P done to D holding the KV.
    Latency,
    /// Pull against push with 8 and 32 requests in flight and simulated prefill compute.
    InFlight,
    /// Pull against push with requests arriving at a fixed rate (open loop).
    OpenLoop,
    /// The CPU an idle engine uses.
    Idle,
    /// A real model (tiny-llama in 8 layers, 16 MiB of KV a request), one request at a time:
    /// pull against push writing each chunk, and each layer, as P computes it.
    Model,
}

/// One comparison: a criterion group, the operations measured, and which implementation is
/// kvflow's and which the baseline.
struct Comparison {
    part: Part,
    title: &'static str,
    package: &'static str,
    bench: &'static str,
    group: &'static str,
    ops: &'static [&'static str],
    ours: &'static str,
    baseline: &'static str,
}

const COMPARISONS: &[Comparison] = &[
    Comparison {
        part: Part::Lease,
        title: "lease table, 1,000,000 live leases (ns per operation)",
        package: "kv-lease",
        bench: "lease_table",
        group: "lease_table",
        ops: &["poll_nothing_due", "grant", "renew", "release"],
        ours: "indexed",
        baseline: "scan",
    },
    // The same bench binary measured these too: it runs once, for the first.
    Comparison {
        part: Part::Lease,
        title: "lease table, 10,000,000 live leases (ns per operation)",
        package: "kv-lease",
        bench: "lease_table",
        group: "lease_table_10m",
        ops: &["poll_nothing_due", "grant", "renew", "release"],
        ours: "indexed",
        baseline: "scan",
    },
    Comparison {
        part: Part::Lease,
        title: "lease table, 1,000,000 live leases: renewals of ids built to collide under Fx \
                against random ids (ratio below 1: what the collisions cost)",
        package: "kv-lease",
        bench: "lease_table",
        group: "lease_table_collide",
        ops: &["renew"],
        ours: "colliding",
        baseline: "random",
    },
    Comparison {
        part: Part::TcpTags,
        title: "TCP transport, a 16 MiB read between two agents in one process (ns per read): \
                payload bytes tagged against untagged (ratio below 1: what the tags cost)",
        package: "kv-transport-tcp",
        bench: "payload_tags",
        group: "tcp_payload_tags",
        ops: &["read_16mib"],
        ours: "tagged",
        baseline: "untagged",
    },
];

/// Runs every bench (or those `--only` names), then prints the tables (or one JSON object with
/// `--json`), and with `--json-out` writes that object, stamped, under `bench/results/`.
/// `--quick` measures less of each, to end within a few minutes once built.
pub fn run(args: &BenchArgs) -> Result<()> {
    let BenchArgs { json: quiet, json_out, quick, transport: kind, ref topology, gpu, ref only } = *args;
    let runs = |part: Part| only.is_empty() || only.contains(&part);
    let root = workspace::root();
    // Build the engines first, so that building is not inside any measurement.
    let node = build_node()?;
    let mut report = serde_json::Map::new();
    let criterion = workspace::target_dir(&root).join("criterion");
    // Benches write what criterion does not measure (the lease tables' memory) here.
    let out = vec![("KVFLOW_BENCH_OUT".to_owned(), criterion.display().to_string())];
    let mut benched = Vec::new();
    for c in COMPARISONS.iter().filter(|c| runs(c.part)) {
        if benched.contains(&(c.package, c.bench)) {
            continue;
        }
        benched.push((c.package, c.bench));
        // --noplot: the numbers are read back below; plots are not needed.
        let mut args = vec!["bench", "--locked", "-p", c.package, "--bench", c.bench, "--", "--noplot"];
        if quick {
            args.extend(["--warm-up-time", "0.5", "--measurement-time", "1", "--sample-size", "10"]);
        }
        if quiet {
            // Stdout carries only the JSON object; criterion's own report goes to stderr.
            run_to_stderr(&root, &args, &out)?;
        } else {
            cargo_env(&root, &args, &out)?;
        }
    }
    for c in COMPARISONS.iter().filter(|c| runs(c.part)) {
        let mut rows = Vec::new();
        for op in c.ops {
            let ours = mean_ns(&criterion, c.group, op, c.ours)?;
            let baseline = mean_ns(&criterion, c.group, op, c.baseline)?;
            rows.push((*op, ours, baseline));
        }
        let ops: serde_json::Map<String, Value> = rows
            .iter()
            .map(|&(op, ours, base)| (op.to_owned(), json!({ c.ours: ours, c.baseline: base, "ratio": base / ours })))
            .collect();
        report.insert(c.group.to_owned(), Value::Object(ops));
        if !quiet {
            print_table(c, &rows);
        }
    }
    if runs(Part::Lease) {
        lease_extras(&criterion, &mut report, quiet)?;
    }
    // The transport bench runs two processes over real NIXL/UCX; it needs the runtime.
    if runs(Part::Transport) {
        let nixl =
            provision::ensure().context("the transport bench needs the NIXL runtime (see `cargo xtask setup`)")?;
        let transport = transport_bench(&root, &nixl.envs(), quiet, quick)?;
        // Again with NIXL's UCX thread pool as vLLM's NixlConnector configures it (`num_threads`
        // 4): the pool splits one transfer's descriptors across threads, where there are cores.
        let mut threaded_envs = nixl.envs();
        threaded_envs.push(("KVFLOW_BENCH_UCX_PARAMS".into(), "num_threads=4".into()));
        let threaded = transport_bench(&root, &threaded_envs, quiet, quick)?;
        if let Value::Object(fields) = transport {
            report.extend(fields);
        }
        if let Some(t) = threaded.get("transport") {
            report.insert("transport_num_threads_4".into(), t.clone());
        }
    }
    report.insert("end_to_end_transport".into(), kind.name().into());
    report.insert("end_to_end_topology".into(), topology.describe().into());
    if runs(Part::Latency) {
        let mut latency = latency_bench(node.clone(), kind, topology, quick, quiet)?;
        // The transfers against memcpy, when both ran: the same machine, the same run.
        let memcpy = report.get("transport").and_then(|t| t["memcpy"]["gbps"].as_f64());
        if let Some(memcpy) = memcpy.filter(|m| *m > 0.0) {
            for mode in ["pull", "push"] {
                let gbps = latency[mode]["transfer_gbps"].as_f64().unwrap_or(0.0);
                latency[mode]["transfer_over_memcpy"] = json!(gbps / memcpy);
                if !quiet {
                    println!("{mode}: transfers at {:.2} of memcpy ({gbps:.2} of {memcpy:.2} GB/s)", gbps / memcpy);
                }
            }
        }
        report.insert("pull_vs_push".into(), latency);
    }
    if runs(Part::InFlight) {
        for in_flight in IN_FLIGHT {
            let result = in_flight_bench(node.clone(), kind, topology, in_flight, quick, quiet)?;
            report.insert(format!("in_flight_{in_flight}"), result);
        }
    }
    if runs(Part::OpenLoop) {
        report.insert("open_loop".into(), open_loop_bench(node.clone(), kind, topology, quick, quiet)?);
    }
    if runs(Part::Model) {
        report.insert("model".into(), model_bench(&node, kind, topology, quick, quiet)?);
    }
    if gpu {
        let nixl = provision::ensure().context("the VRAM bench needs the NIXL runtime (see `cargo xtask setup`)")?;
        let mut envs = nixl.envs();
        envs.push(("KVFLOW_GPU".into(), "1".into()));
        report.insert("vram".into(), vram_bench(&root, &envs, quiet, quick)?);
    }
    if runs(Part::Idle) {
        let idle = idle_bench(node, kind, topology, quick, quiet)?;
        report.insert("idle_cpu_percent".into(), idle["max"].clone());
        report.insert("idle_cpu_percent_by_engine".into(), idle["by_engine"].clone());
        report.insert("idle_progress_period".into(), idle["progress_period"].clone());
    }
    let report = Value::Object(report);
    if json_out {
        let flags = json!({
            "quick": quick,
            "only": only.iter().map(|p| format!("{p:?}")).collect::<Vec<_>>(),
            "gpu": gpu,
            "transport": kind.name(),
            "topology": topology.describe(),
        });
        let path = bench_results::write(&root, report.clone(), flags)?;
        eprintln!("xtask: wrote {}; `cargo xtask docs` shows it in docs/benchmarks.md", path.display());
    }
    if quiet {
        println!("{report}");
    }
    Ok(())
}

/// How much of a core an engine with nothing pending uses: one P and one D started, left idle
/// for 60 s (20 with `--quick`). The JSON's `idle_cpu_percent` is the larger of the two, and
/// `idle_cpu_percent_by_engine` has each. Over NIXL, whose idle progress thread's period sets
/// most of that floor, `idle_progress_period` says what the default period costs one request
/// at a time against the old one ([`OLD_PROGRESS_MS`]).
fn idle_bench(
    node: NodeBinary,
    transport: TransportKind,
    topology: &TopologyArgs,
    quick: bool,
    quiet: bool,
) -> Result<Value> {
    let window = Duration::from_secs(if quick { 20 } else { 60 });
    let config = topology.apply(DemoConfig { decoders: 1, kill: false, transport, ..DemoConfig::default() });
    config.validate()?;
    let used = Demo::start(config, node.clone())?.idle_cpu_percent(window)?;
    let most = used.values().copied().fold(0.0, f64::max);
    if !quiet {
        let list: Vec<String> = used.iter().map(|(n, p)| format!("{n} {p:.2}%")).collect();
        println!("\nidle engines, {} s with nothing pending: {} of one core", window.as_secs(), list.join(", "));
    }
    let period = match transport {
        TransportKind::Nixl => progress_period_cost(&node, topology, quick, quiet)?,
        TransportKind::Tcp => Value::Null,
    };
    Ok(json!({ "max": most, "by_engine": used, "window_s": window.as_secs(), "progress_period": period }))
}

/// The idle NIXL progress period the default is measured against: the default before it.
const OLD_PROGRESS_MS: u64 = 10;

/// What the default NIXL progress period costs: P done to D holds KV p50, pull, one request
/// of 32 MiB at a time, at [`OLD_PROGRESS_MS`] and at the default in turns (3 pairs, 5 without
/// `--quick`), and the median of each pair's ratio, default over old.
fn progress_period_cost(node: &NodeBinary, topology: &TopologyArgs, quick: bool, quiet: bool) -> Result<Value> {
    let base = topology.apply(whole_requests(DemoConfig { requests: 20, concurrency: 1, ..DemoConfig::default() }));
    let (mut old, mut default, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..if quick { 3 } else { 5 } {
        for (ms, into) in [(Some(OLD_PROGRESS_MS), &mut old), (None, &mut default)] {
            let config = DemoConfig { nixl_progress_ms: ms, ..base.clone() };
            let report = run_checked(node, config, &format!("a run at NIXL progress period {ms:?} ms"))?;
            into.push(report.latency_json()["kv_latency_us"]["p50"].as_f64().unwrap_or(0.0));
        }
        if let (Some(o), Some(d)) = (old.last(), default.last()) {
            ratios.push(if *o > 0.0 { d / o } else { 0.0 });
        }
    }
    let ratio = kv_demo::stats::quantile(&ratios, 0.5).unwrap_or(0.0);
    if !quiet {
        println!(
            "NIXL progress period: P done -> D holds KV p50 at the default over at {OLD_PROGRESS_MS} ms, one request at a time: {ratio:.3} (median of {} pairs)",
            ratios.len()
        );
    }
    Ok(
        json!({ "old_ms": OLD_PROGRESS_MS, "kv_p50_us_old": old, "kv_p50_us_default": default, "default_over_old": ratio }),
    )
}

/// Pull against push, end to end between processes: the time from P finishing a prompt to D
/// holding its KV, one request at a time so that no queue is measured.
fn latency_bench(
    node: NodeBinary,
    transport: TransportKind,
    topology: &TopologyArgs,
    quick: bool,
    quiet: bool,
) -> Result<Value> {
    let requests = if quick { 20 } else { 100 };
    let base =
        topology.apply(whole_requests(DemoConfig { requests, concurrency: 1, transport, ..DemoConfig::default() }));
    let mut results = pull_and_push(&node, &base, "one at a time")?;
    for mode in ["pull", "push"] {
        // Each request's P done to D holds KV over its own completing transfer's time, p50.
        results[mode]["kv_over_transfer_p50"] = results[mode]["kv_over_transfer"]["p50"].clone();
    }
    let p50 = |mode: &str| results[mode]["kv_latency_us"]["p50"].as_f64().unwrap_or(0.0);
    let (pull, push) = (p50("pull"), p50("push"));
    results.insert("pull_over_push_p50".into(), json!(if push > 0.0 { pull / push } else { 0.0 }));
    if !quiet {
        println!(
            "\npull vs push over {}: P done -> D holds KV, {requests} requests of 32 MiB, one at a time",
            transport.name()
        );
        println!("{:<6} {:>12} {:>12} {:>16}", "mode", "p50 ms", "p99 ms", "transfer p50 ms");
        for mode in ["pull", "push"] {
            let r = &results[mode];
            let ms = |v: &Value| v.as_f64().unwrap_or(0.0) / 1e3;
            println!(
                "{mode:<6} {:>12.2} {:>12.2} {:>16.2}",
                ms(&r["kv_latency_us"]["p50"]),
                ms(&r["kv_latency_us"]["p99"]),
                ms(&r["transfer_latency_us"]["p50"])
            );
        }
        println!("pull p50 / push p50 = {:.2}", pull / push.max(1.0));
        for mode in ["pull", "push"] {
            let ratio = results[mode]["kv_over_transfer_p50"].as_f64().unwrap_or(0.0);
            println!("{mode}: P done -> D holds KV p50 is {ratio:.2} times the transfer's");
        }
    }
    Ok(Value::Object(results))
}

/// `config` with one D engine and requests of 256 tokens (16 blocks of 2 MiB, 32 MiB of KV),
/// every one whole: none rejected, aborted, split into siblings or partly cached, and no
/// engine killed.
fn whole_requests(config: DemoConfig) -> DemoConfig {
    DemoConfig {
        decoders: 1,
        min_tokens: 256,
        max_tokens: 256,
        kill: false,
        reject_rate: 0.0,
        abort_rate: 0.0,
        sibling_rate: 0.0,
        partial_rate: 0.0,
        ..config
    }
}

/// Runs `base` in pull mode, then in push mode, each on engines of its own; each mode's
/// latencies (`Report::latency_json`) by its name. A run that fails its checks fails the bench
/// (`what` says which runs these were).
fn pull_and_push(node: &NodeBinary, base: &DemoConfig, what: &str) -> Result<serde_json::Map<String, Value>> {
    base.validate()?;
    let mut results = serde_json::Map::new();
    for push in [false, true] {
        let mode = if push { "push" } else { "pull" };
        let report = run_checked(node, DemoConfig { push, ..base.clone() }, &format!("the {mode} run ({what})"))?;
        results.insert(mode.into(), report.latency_json());
    }
    Ok(results)
}

/// Runs the demo with `config`; a run that fails its checks fails the bench, `what` naming it.
fn run_checked(node: &NodeBinary, config: DemoConfig, what: &str) -> Result<Report> {
    let report = Demo::start(config, node.clone())?.run()?;
    let failures = report.failures();
    if !failures.is_empty() {
        bail!("{what} failed its checks: {}", failures.join("; "));
    }
    Ok(report)
}

/// The model bench's model: tiny-llama in this many layers, prompts of [`MODEL_PROMPT_TOKENS`]
/// (4 KV heads of 32, f32, K and V: 8 KiB a token over the layers, 16 MiB a prompt), and P's
/// chunks.
const MODEL_LAYERS: u32 = 8;
const MODEL_PROMPT_TOKENS: u64 = 2048;
const MODEL_CHUNK_TOKENS: u64 = 256;

/// P done to D holds KV on a real model (kv-model's tiny-llama, [`MODEL_LAYERS`] layers),
/// one request of 16 MiB of KV at a time, "P done" being the end of the last layer's compute
/// of the last chunk: pull (`model.pull`), push writing each chunk's blocks once P computed
/// the chunk (`model.push_chunks`), and push writing each layer of a chunk as the model
/// stores it (`model.push`). Every run's tokens and prompt KV are checked against one
/// engine's, as the model demos' are.
fn model_bench(
    node: &NodeBinary,
    transport: TransportKind,
    topology: &TopologyArgs,
    quick: bool,
    quiet: bool,
) -> Result<Value> {
    let requests = if quick { 3 } else { 8 };
    let block_tokens = DemoConfig::default().model.block_tokens;
    let base = topology.apply(whole_requests(DemoConfig {
        requests,
        concurrency: 1,
        transport,
        model: kv_demo::proto::Model::tiny_llama(MODEL_LAYERS, block_tokens),
        prefill_chunk_tokens: MODEL_CHUNK_TOKENS,
        ..DemoConfig::default()
    }));
    // Every prompt of the same length (whole_requests makes them 256 tokens).
    let base = DemoConfig { min_tokens: MODEL_PROMPT_TOKENS, max_tokens: MODEL_PROMPT_TOKENS, ..base };
    let mut results = serde_json::Map::new();
    for (mode, push, layer_writes) in [("pull", false, false), ("push_chunks", true, false), ("push", true, true)] {
        let engine_model = Some(kv_demo::demo::ModelRun { generate: 4, save_dir: None, layer_writes });
        let config = DemoConfig { push, engine_model, ..base.clone() };
        config.validate()?;
        let report = run_checked(node, config, &format!("the {mode} run (the model, one at a time)"))?;
        results.insert(mode.into(), report.latency_json());
    }
    let p50 = |mode: &str| results[mode]["kv_latency_us"]["p50"].as_f64().unwrap_or(0.0);
    let (pull, chunked, layered) = (p50("pull"), p50("push_chunks"), p50("push"));
    let over = |x: f64| json!(if pull > 0.0 { x / pull } else { 0.0 });
    results.insert("push_chunks_over_pull".into(), over(chunked));
    results.insert("push_over_pull".into(), over(layered));
    results.insert("layers".into(), json!(MODEL_LAYERS));
    results.insert("prompt_tokens".into(), json!(MODEL_PROMPT_TOKENS));
    results.insert("chunk_tokens".into(), json!(MODEL_CHUNK_TOKENS));
    if !quiet {
        println!(
            "\nreal model over {}: tiny-llama in {MODEL_LAYERS} layers, {requests} prompts of {MODEL_PROMPT_TOKENS} tokens (16 MiB of KV), one at a time, P in chunks of {MODEL_CHUNK_TOKENS}",
            transport.name()
        );
        println!("{:<12} {:>18} {:>18}", "mode", "P done->KV p50 ms", "P done->KV p99 ms");
        for mode in ["pull", "push_chunks", "push"] {
            let ms = |v: &Value| v.as_f64().unwrap_or(0.0) / 1e3;
            let r = &results[mode]["kv_latency_us"];
            println!("{mode:<12} {:>18.2} {:>18.2}", ms(&r["p50"]), ms(&r["p99"]));
        }
        let pull = pull.max(1.0);
        println!(
            "over pull: push writing each chunk {:.2}, push writing each layer {:.2}",
            chunked / pull,
            layered / pull
        );
    }
    Ok(Value::Object(results))
}

/// The loads of the in-flight bench: requests the router keeps in flight.
const IN_FLIGHT: [u32; 2] = [8, 32];

/// P's simulated prefill compute in the in-flight bench: 100 µs a token, about what one H100
/// takes for a Llama-3-8B prompt (some 10,000 tokens a second); a 256-token prompt computes in
/// 25.6 ms, one prompt at a time.
const PREFILL_US_PER_TOKEN: u64 = 100;

/// Pull against push under load: the router keeps `in_flight` requests of 256 tokens (32 MiB
/// of KV) in flight, P computes each for [`PREFILL_US_PER_TOKEN`] a token on its one simulated
/// GPU, and the figures are from the router's submit to D holding the KV (what time to first
/// token feels) and the requests per second, each mode in its own run with the same workload.
fn in_flight_bench(
    node: NodeBinary,
    transport: TransportKind,
    topology: &TopologyArgs,
    in_flight: u32,
    quick: bool,
    quiet: bool,
) -> Result<Value> {
    // Enough requests that the p50 is a median of many (the first `in_flight` fill the pipe).
    let requests = in_flight * if quick { 4 } else { 12 };
    let what = format!("{in_flight} in flight");
    under_load(node, transport, topology, requests, in_flight, None, &what, quiet)
}

/// The open-loop arrival rate: a request of 256 tokens every 125 ms, a fifth of what the
/// simulated GPU computes ([`PREFILL_US_PER_TOKEN`]: 39 a second) and well under what this
/// 2-core machine moves and checks, so that submit to KV is the time one request takes, with
/// little queueing.
const OPEN_LOOP_RATE: f64 = 8.0;

/// Pull against push at a fixed arrival rate ([`OPEN_LOOP_RATE`]), whether or not earlier
/// requests have ended (at most 64 in flight): what time to first token feels below
/// saturation, where push's overlap of compute and transfer shortens every request. In a
/// closed loop the requests in flight over the throughput fix the mean latency (Little's
/// law), so there push can only gain what it gains in throughput.
fn open_loop_bench(
    node: NodeBinary,
    transport: TransportKind,
    topology: &TopologyArgs,
    quick: bool,
    quiet: bool,
) -> Result<Value> {
    let requests = if quick { 24 } else { 80 };
    let what = format!("{OPEN_LOOP_RATE} requests a second");
    let mut results = under_load(node, transport, topology, requests, 64, Some(OPEN_LOOP_RATE), &what, quiet)?;
    if let Value::Object(map) = &mut results {
        map.insert("rate_per_s".into(), json!(OPEN_LOOP_RATE));
    }
    Ok(results)
}

/// Runs `requests` of 256 tokens at most `in_flight` at once (and at `rate` a second if
/// given) in pull mode, then push mode; prints the table (`what` names the load).
#[allow(clippy::too_many_arguments)]
fn under_load(
    node: NodeBinary,
    transport: TransportKind,
    topology: &TopologyArgs,
    requests: u32,
    in_flight: u32,
    rate: Option<f64>,
    what: &str,
    quiet: bool,
) -> Result<Value> {
    let blocks_per_request = 256 / DemoConfig::default().model.block_tokens;
    let base = topology.apply(whole_requests(DemoConfig {
        requests,
        concurrency: in_flight,
        rate,
        prefill_us_per_token: PREFILL_US_PER_TOKEN,
        // Every request in flight holds its blocks on P and on D, with room to spare.
        blocks: (in_flight * blocks_per_request * 2).max(DemoConfig::default().blocks),
        transport,
        ..DemoConfig::default()
    }));
    let chunk = base.prefill_chunk_tokens;
    let mut results = pull_and_push(&node, &base, what)?;
    let p50 = |mode: &str| results[mode]["submit_to_kv_us"]["p50"].as_f64().unwrap_or(0.0);
    let rps = |mode: &str| results[mode]["throughput_rps"].as_f64().unwrap_or(0.0);
    let (pull, push) = (p50("pull"), p50("push"));
    let (pull_rps, push_rps) = (rps("pull"), rps("push"));
    results.insert("pull_over_push_p50".into(), json!(if push > 0.0 { pull / push } else { 0.0 }));
    let throughput = if pull_rps > 0.0 { push_rps / pull_rps } else { 0.0 };
    results.insert("push_over_pull_throughput".into(), json!(throughput));
    results.insert("prefill_us_per_token".into(), json!(PREFILL_US_PER_TOKEN));
    results.insert("prefill_chunk_tokens".into(), json!(chunk));
    results.insert("requests".into(), json!(requests));
    if !quiet {
        println!(
            "\npull vs push over {}: {what}, {requests} requests of 32 MiB, prefill {PREFILL_US_PER_TOKEN} us/token in chunks of {chunk}",
            transport.name()
        );
        println!(
            "{:<6} {:>18} {:>18} {:>14} {:>16}",
            "mode", "submit->KV p50 ms", "submit->KV p99 ms", "requests/s", "P done->KV p50"
        );
        for mode in ["pull", "push"] {
            let r = &results[mode];
            let ms = |v: &Value| v.as_f64().unwrap_or(0.0) / 1e3;
            println!(
                "{mode:<6} {:>18.2} {:>18.2} {rps:>14.1} {:>16.2}",
                ms(&r["submit_to_kv_us"]["p50"]),
                ms(&r["submit_to_kv_us"]["p99"]),
                ms(&r["kv_latency_us"]["p50"]),
                rps = r["throughput_rps"].as_f64().unwrap_or(0.0)
            );
        }
        println!("pull p50 / push p50 = {:.2}, push / pull throughput = {throughput:.2}", pull / push.max(1.0));
    }
    Ok(Value::Object(results))
}

/// Runs `$CARGO args...` with its stdout sent to our stderr.
fn run_to_stderr(root: &Path, args: &[&str], envs: &[(String, String)]) -> Result<()> {
    use std::os::fd::AsFd;
    let stderr = std::io::stderr().as_fd().try_clone_to_owned().context("cannot duplicate stderr")?;
    let mut command = cargo_command(root, args, envs);
    command.stdout(std::process::Stdio::from(stderr));
    workspace::run_cargo(command, args)
}

/// Runs the two-process transport bench (kv-demo's `benches/transport.rs`); prints its table, or
/// returns its JSON object.
fn transport_bench(root: &Path, envs: &[(String, String)], quiet: bool, quick: bool) -> Result<Value> {
    // Its JSON always: the latency bench's transfers are compared with its memcpy.
    let (stdout, stderr) = bench_binary(root, envs, "transport", quick.then_some("11"))?;
    if !quiet {
        stdout.lines().filter(|l| !l.starts_with('{')).for_each(|l| println!("{l}"));
    }
    if !stdout.lines().any(|l| l.starts_with('{')) {
        // It skipped, and said why (outside CI, where a skip fails).
        let why = stderr.lines().rev().find(|l| l.contains("skipped")).unwrap_or("no JSON").to_owned();
        return Ok(json!({ "transport": { "skipped": why } }));
    }
    last_json(&stdout, "transport")
}

/// Runs the VRAM bench (kv-demo's `benches/vram.rs`); prints its table unless `quiet`, and
/// returns its JSON object, or `{"skipped": why}` where it could not run (no GPU, say).
fn vram_bench(root: &Path, envs: &[(String, String)], quiet: bool, quick: bool) -> Result<Value> {
    // Its JSON always, for `--json-out`; its table is the lines before.
    let (stdout, stderr) = bench_binary(root, envs, "vram", quick.then_some("5"))?;
    if let Some(line) = stderr.lines().find(|l| l.starts_with("vram bench skipped")) {
        if !quiet {
            println!("\n{line}: the GPU figures are pending (docs/testing.md, the GPU checks)");
        }
        return Ok(json!({ "skipped": line.trim_start_matches("vram bench skipped: ") }));
    }
    if !quiet {
        stdout.lines().filter(|l| !l.starts_with('{')).for_each(|l| println!("{l}"));
    }
    Ok(last_json(&stdout, "vram")?["vram"].clone())
}

/// Runs kv-demo's two-process bench `name` (`benches/{name}.rs`) with `envs`, `--json` (its
/// table, then its JSON object as the last line) and `--iters` as given; its stdout and stderr
/// (which is passed on as well).
fn bench_binary(root: &Path, envs: &[(String, String)], name: &str, iters: Option<&str>) -> Result<(String, String)> {
    let mut args = vec!["bench", "--locked", "-p", "kv-demo", "--features", "nixl", "--bench", name, "--", "--json"];
    if let Some(iters) = iters {
        args.extend(["--iters", iters]);
    }
    let output = cargo_command(root, &args, envs)
        .output()
        .with_context(|| format!("cannot start {}", workspace::cargo_bin()))?;
    let (stdout, stderr) = (String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    eprint!("{stderr}");
    if !output.status.success() {
        bail!("the {name} bench failed ({}):\n{stdout}", output.status);
    }
    Ok((stdout.into_owned(), stderr.into_owned()))
}

/// The JSON object a bench printed last on stdout.
fn last_json(stdout: &str, name: &str) -> Result<Value> {
    let last = stdout
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .with_context(|| format!("the {name} bench printed no JSON"))?;
    serde_json::from_str(last).with_context(|| format!("the {name} bench's JSON does not parse"))
}

fn print_table(c: &Comparison, rows: &[(&str, f64, f64)]) {
    println!("\n{}", c.title);
    println!("{:<20} {:>14} {:>14} {:>14}", "operation", c.ours, c.baseline, format!("{}/{}", c.baseline, c.ours));
    for &(op, ours, base) in rows {
        println!("{op:<20} {:>14} {:>14} {:>13.1}x", human_ns(ours), human_ns(base), base / ours);
    }
}

fn human_ns(ns: f64) -> String {
    match ns {
        n if n >= 1e6 => format!("{:.2} ms", n / 1e6),
        n if n >= 1e3 => format!("{:.2} µs", n / 1e3),
        n => format!("{n:.1} ns"),
    }
}

/// The lease tables' figures beyond the comparisons: the ten-million table under its JSON
/// name `lease_table_10m`, the colliding ids' renewals over random ids'
/// (`lease_table.collide_over_random`), and the memory each table took (`memory_bytes`).
fn lease_extras(criterion: &Path, report: &mut serde_json::Map<String, Value>, quiet: bool) -> Result<()> {
    let collide = mean_ns(criterion, "lease_table_collide", "renew", "colliding")?;
    let random = mean_ns(criterion, "lease_table_collide", "renew", "random")?;
    let path = criterion.join("lease_table_memory.json");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("the lease bench wrote no {}", path.display()))?;
    let memory: Value = serde_json::from_str(&text).with_context(|| format!("cannot parse {}", path.display()))?;
    // The scan table on the lease table's own hasher: the structures alone compared.
    let mut same_hash = Vec::new();
    for op in ["poll_nothing_due", "grant", "renew", "release"] {
        let indexed = mean_ns(criterion, "lease_table", op, "indexed")?;
        same_hash.push((op, indexed, mean_ns(criterion, "lease_table", op, "scan_foldhash")?));
    }
    if let Some(Value::Object(table)) = report.get_mut("lease_table") {
        table.insert("collide_over_random".into(), json!(collide / random));
        table.insert("memory_bytes".into(), memory["lease_table"].clone());
        for &(op, indexed, same) in &same_hash {
            if let Some(Value::Object(row)) = table.get_mut(op) {
                row.insert("scan_foldhash".into(), json!(same));
                row.insert("ratio_same_hash".into(), json!(same / indexed));
            }
        }
    }
    if let Some(Value::Object(table)) = report.get_mut("lease_table_10m") {
        table.insert("memory_bytes".into(), memory["lease_table_10m"].clone());
    }
    report.remove("lease_table_collide");
    if !quiet {
        println!("\nthe same 1,000,000 leases against a scan table on the lease table's own hasher (foldhash)");
        for &(op, indexed, same) in &same_hash {
            println!("{op:<20} {:>14} {:>14} {:>13.1}x", human_ns(indexed), human_ns(same), same / indexed);
        }
        println!(
            "colliding ids renewed in {} against random ids' {}: {:.2}x",
            human_ns(collide),
            human_ns(random),
            collide / random
        );
        for (group, m) in memory.as_object().into_iter().flatten() {
            let per = |bytes: &Value| bytes.as_f64().unwrap_or(0.0) / m["live"].as_f64().unwrap_or(1.0).max(1.0);
            println!(
                "{group}: {} live leases took {:.0} bytes each in the indexed table, {:.0} in the scan table",
                m["live"],
                per(&m["indexed_bytes"]),
                per(&m["scan_bytes"])
            );
        }
    }
    Ok(())
}

/// Criterion's mean estimate, in nanoseconds, of `group/op/imp` from this run.
fn mean_ns(criterion: &Path, group: &str, op: &str, imp: &str) -> Result<f64> {
    let path = criterion.join(group).join(op).join(imp).join("new").join("estimates.json");
    let text = std::fs::read_to_string(&path).with_context(|| format!("criterion wrote no {}", path.display()))?;
    let value: Value = serde_json::from_str(&text).with_context(|| format!("cannot parse {}", path.display()))?;
    value["mean"]["point_estimate"].as_f64().with_context(|| format!("no mean estimate in {}", path.display()))
}
