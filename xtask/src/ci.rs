//! `cargo xtask ci`: what CI runs, in the order that fails fastest.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Parser;

use crate::demo::DemoArgs;
use crate::provision;
use crate::workspace::{self, cargo, cargo_env};

/// Runs the fmt check, provisions libclang, protoc, etcd, promtool and the NIXL runtime (see
/// [`provision::ensure`]), then clippy with `-D warnings` and every test of the workspace, with
/// the provisioned paths in their environment, the examples, `cargo package` of every library
/// crate, then a short demo in each mode over each transport, short demos of a real model
/// (tiny-llama), the attack suite, a 4-minute soak, kvflow's Python package beside vLLM (`cargo xtask vllm`),
/// and transformers' check of every token the model demos generated.
/// Each part's time is printed as it ends, and all of them at the end (docs/testing.md's
/// "How long" is read from them).
pub fn run() -> Result<()> {
    let root = workspace::root();
    let mut timed = Timed::default();
    timed.part("fmt check", || cargo(&root, &["fmt", "--all", "--", "--check"]))?;
    let nixl = timed.part("provisioning", || {
        provision::ensure()
            .context("cannot provision what nixl-sys, etcd-client and the demo need (see `cargo xtask setup`)")
    })?;
    let envs = nixl.envs();
    for (key, value) in &envs {
        eprintln!("xtask: {key}={value}");
    }
    // The `nixl` feature adds what needs both adapters: the demo's engine binary, and the
    // test and bench of kv-cuda's pools moved by NixlTransport.
    let clippy =
        ["clippy", "--workspace", "--all-targets", "--locked", "--features", "kv-demo/nixl", "--", "-D", "warnings"];
    timed.part("clippy", || cargo_env(&root, &clippy, &envs))?;
    timed.part("workspace tests", || {
        cargo_env(&root, &["test", "--workspace", "--locked", "--features", "kv-demo/nixl"], &envs)
    })?;
    timed.part("examples", || {
        // The examples a user runs first (`cargo test` only builds them).
        cargo(&root, &["run", "--locked", "-q", "-p", "kv-demo", "--example", "pull_pair"])?;
        for example in ["pull_pair_nixl", "pull_pair_tcp"] {
            cargo_env(
                &root,
                &["run", "--locked", "-q", "-p", "kv-demo", "--features", "nixl", "--example", example],
                &envs,
            )?;
        }
        // Two engines as an engine embeds kvflow (kv-engine), over TCP, with their metrics endpoint.
        cargo(&root, &["run", "--locked", "-q", "-p", "kv-engine", "--example", "two_engines"])
    })?;
    // Every library crate packages and builds from its package, as a user's dependency would.
    // Cargo takes its own unpublished packages for immutable registry crates: it reuses their
    // unpacked sources and their build artifacts by name and version. Fresh ones, each run.
    let packaging = Instant::now();
    forget_packaged_sources();
    let verify = root.join("target").join("package-verify");
    let _ = std::fs::remove_dir_all(&verify);
    let verify = verify.display().to_string();
    let package = [
        "package",
        "--workspace",
        "--exclude",
        "xtask",
        "--exclude",
        "kv-demo",
        // A Python wheel, which maturin packages (`cargo xtask vllm` builds and installs it).
        "--exclude",
        "kvflow-py",
        "--locked",
        "--allow-dirty",
        "--target-dir",
        &verify,
    ];
    cargo_env(&root, &package, &envs)?;
    // A second build of every library and its dependencies: gone once verified, since CI's
    // disk is not ours to fill.
    let _ = std::fs::remove_dir_all(&verify);
    timed.record("packaging", packaging);
    // Short demos, real processes: each mode over each transport, then P at TP 2 into D at TP 4
    // and back, MLA from TP 2 into TP 1, P's 16-token blocks into D's 32-token ones and P's
    // 32-token blocks pushed into D's 16-token ones as they are computed, and every
    // engine in a network namespace of its own with UCX over TCP (root only, as CI is). Any
    // corrupt read, block written after free, or block held after the drain fails them; D
    // checks every row by layer, plane, head and token. The namespaces' run finds engines
    // through a real etcd, and one D dies silently there (its veth deleted, then SIGKILLed):
    // P must release its exports within the etcd lease TTL plus 1 s, by the lapse alone (the
    // KV lease is longer). Two push runs compute their prompts on a simulated GPU, in chunks
    // whose blocks P writes into D's before the export.
    let short = ["--requests", "40", "--layers", "4", "--max-tokens", "256"];
    let topologies: [&[&str]; 10] = [
        &["--transport", "nixl", "--mode", "pull"],
        &["--transport", "nixl", "--mode", "push"],
        &["--transport", "tcp", "--mode", "pull"],
        &["--transport", "tcp", "--mode", "push", "--prefill-us-per-token", "100"],
        &["--p-tp", "2", "--d-tp", "4"],
        &["--p-tp", "4", "--d-tp", "2", "--mode", "push", "--prefill-us-per-token", "100"],
        &["--mla", "--p-tp", "2", "--d-tp", "1"],
        &["--p-block-tokens", "16", "--d-block-tokens", "32"],
        &["--p-block-tokens", "32", "--d-block-tokens", "16", "--mode", "push", "--prefill-us-per-token", "100"],
        &[
            "--hosts",
            "netns",
            "--p-tp",
            "2",
            "--d-tp",
            "1,2",
            "--discovery",
            "etcd",
            "--kill-silently",
            "--lease-ms",
            "5000",
        ],
    ];
    let demos = Instant::now();
    for topology in topologies {
        let lease: &[&str] = if topology.contains(&"--lease-ms") { &[] } else { &["--lease-ms", "2000"] };
        let flags = [topology, &short[..], lease].concat();
        eprintln!("xtask: cargo xtask demo {}", flags.join(" "));
        // Through the demo's own parser, so that these are the flags a user would type.
        let args = DemoArgs::try_parse_from(std::iter::once("demo").chain(flags.iter().copied()))?;
        crate::demo::run(&args).with_context(|| format!("the short demo with {}", topology.join(" ")))?;
    }
    timed.record("short demos", demos);
    // A real model's KV through kvflow (issue 33): tiny-llama computes every prompt on P (in
    // chunks of 64 tokens, written ahead in push mode), D decodes 16 tokens from what it
    // loaded, and each request's tokens and prompt KV must equal one engine's; one D is killed
    // part-way (its requests sent again), and some requests are partial prefix hits whose
    // prefix D computes itself. transformers checks every token once the virtualenv is up.
    let models = Instant::now();
    let model_demos = workspace::target_dir(&root).join("model-demos");
    let _ = std::fs::remove_dir_all(&model_demos);
    std::fs::create_dir_all(&model_demos)?;
    let model_dir = model_demos.join("tiny-llama");
    let model_topologies: [(&str, &[&str]); 5] = [
        ("pull", &["--mode", "pull"]),
        ("push", &["--mode", "push"]),
        ("p-tp2-d-tp1", &["--p-tp", "2", "--d-tp", "1"]),
        ("p-tp1-d-tp2-push", &["--p-tp", "1", "--d-tp", "2", "--mode", "push"]),
        ("blocks-16-32", &["--p-block-tokens", "16", "--d-block-tokens", "32"]),
    ];
    let mut model_reports = Vec::new();
    for (name, topology) in model_topologies {
        let report = model_demos.join(format!("{name}.json"));
        let (report_arg, model_arg) = (report.display().to_string(), model_dir.display().to_string());
        let mut flags =
            vec!["--model", "tiny-llama", "--requests", "24", "--lease-ms", "2000", "--json-out", &report_arg];
        flags.extend(topology);
        if model_reports.is_empty() {
            flags.extend(["--save-model", &model_arg]);
        }
        eprintln!("xtask: cargo xtask demo {}", flags.join(" "));
        let args = DemoArgs::try_parse_from(std::iter::once("demo").chain(flags.iter().copied()))?;
        crate::demo::run(&args).with_context(|| format!("the model demo with {}", topology.join(" ")))?;
        model_reports.push(report);
    }
    timed.record("model demos", models);
    // The engines under attack, and stopped past their lease, in both modes (about a minute).
    eprintln!("xtask: cargo xtask attack");
    timed.part("attack suite", || {
        crate::demo::attack(&crate::demo::AttackArgs::default()).context("the attack suite")
    })?;
    // Four minutes of steady traffic with a process killed or stopped every minute, the
    // engines' memory and descriptors sampled (docs/operating.md, the soak).
    eprintln!("xtask: cargo xtask soak --minutes 4");
    let soak = crate::demo::SoakArgs::try_parse_from(["soak", "--minutes", "4"])?;
    timed.part("soak", || crate::demo::soak(&soak).context("the 4-minute soak"))?;
    // vLLM on this CPU in a pinned virtualenv (provisioned once, about 3 minutes), kvflow's
    // wheel built and installed beside it, and the Python tests.
    eprintln!("xtask: cargo xtask vllm");
    timed.part("cargo xtask vllm", || crate::vllm::run().context("cargo xtask vllm"))?;
    timed.part("token check", || crate::vllm::check_model_tokens(&model_dir, &model_reports))?;
    timed.summary();
    Ok(())
}

/// The time each part of the run took, in order.
#[derive(Default)]
struct Timed {
    parts: Vec<(&'static str, Duration)>,
}

impl Timed {
    /// Runs `part`, and records and prints how long it took, whether it passed or failed.
    fn part<T>(&mut self, name: &'static str, part: impl FnOnce() -> Result<T>) -> Result<T> {
        let started = Instant::now();
        let result = part();
        self.record(name, started);
        result
    }

    /// Records and prints that `name` ran from `started` until now.
    fn record(&mut self, name: &'static str, started: Instant) {
        let took = started.elapsed();
        eprintln!("xtask: {name} took {:.0} s", took.as_secs_f64());
        self.parts.push((name, took));
    }

    /// Prints every part's time and their total.
    fn summary(&self) {
        eprintln!("xtask: cargo xtask ci passed; each part's time:");
        for (name, took) in &self.parts {
            eprintln!("  {name:<20} {:>6.0} s", took.as_secs_f64());
        }
        let total: Duration = self.parts.iter().map(|(_, took)| *took).sum();
        eprintln!("  {:<20} {:>6.0} s", "total", total.as_secs_f64());
    }
}

/// The library crates `cargo package` verifies.
const PACKAGES: [&str; 11] = [
    "kv-discovery-etcd",
    "kv-engine",
    "kv-model",
    "kv-core",
    "kv-lease",
    "kv-sched-adapter",
    "kv-testkit",
    "kv-cuda",
    "kv-side-tcp",
    "kv-transport-nixl",
    "kv-transport-tcp",
];

/// Removes cargo's unpacked copies of this workspace's own packages from earlier `cargo
/// package` runs. Cargo verifies a package against its workspace siblings through a local
/// registry whose sources it unpacks under `$CARGO_HOME/registry/src/-<hash>/` and reuses when
/// name and version match, so a second run would compile against the first run's sources.
fn forget_packaged_sources() {
    let home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")));
    let Some(src) = home.map(|h| h.join("registry").join("src")) else { return };
    let Ok(registries) = std::fs::read_dir(&src) else { return };
    // Local registries are the ones not named after an index host.
    for registry in registries.flatten().filter(|r| r.file_name().to_string_lossy().starts_with('-')) {
        let Ok(entries) = std::fs::read_dir(registry.path()) else { continue };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            // The library crates share xtask's (the workspace's) version.
            let ours = PACKAGES.iter().any(|p| name == format!("{p}-{}", env!("CARGO_PKG_VERSION")));
            if ours {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
    }
}
