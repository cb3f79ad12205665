//! `cargo xtask demo`: one P engine and N D engines, each its own process on loopback, moving
//! real bytes over NIXL/UCX under a workload with faults; this process is the router.
//!
//! The router sends prompts to P (lengths from a spread, some with n > 1 siblings), hands P's
//! transfer parameters to a D engine (round robin), rejects some requests on D before
//! admission and aborts others while they wait or load. Part-way it kills one D engine with
//! SIGKILL and restarts it. In push mode D hears of each request first and P writes.
//! `--pause-decode N` stops decode0 with SIGSTOP N times, each for 1.5 leases, with its reads
//! in flight; `--pause-prefill` stops P once, past D's push watchdog but within D's
//! quarantine, with its writes in flight: the fence and the quarantine must hold.
//!
//! P fills every block it computes with bytes derived from the request and block; D checks
//! every byte it receives. After the workload the router waits for P's pool to empty (the
//! killed engine's exports end by peer loss or by their lease), then asks every engine for
//! its counts and prints the report; the exit status is non-zero if any check failed.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command as Process, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use kv_testkit::Rng;
use serde_json::{json, Value};
use xtask::proto::{
    wall_ns, write_line, AttackConfig, AttackResult, Command, Event, Model, NodeConfig, NodeRole, Remote,
    CLUSTER_KEY_ENV,
};

use crate::ci::workspace_root;
use crate::provision;

const USAGE: &str = "usage: cargo xtask demo [--mode pull|push] [--decoders N] [--requests N] [--seed N]
       [--concurrency N] [--min-tokens N] [--max-tokens N] [--layers N] [--blocks N]
       [--lease-ms N] [--no-kill] [--pause-decode N] [--pause-prefill] [--json]";

/// How many attacks `kvflow-attack` makes (see `xtask::attacker`).
const ATTACKS: usize = 9;

/// `cargo xtask attack`: a pull run with decode0 stopped past the lease three times and a push
/// run with P stopped past D's watchdog, each with `kvflow-attack` attacking P throughout.
pub fn attack(args: &[String]) -> Result<()> {
    if let Some(arg) = args.first() {
        bail!("cargo xtask attack takes no arguments, got {arg:?}");
    }
    let node = build_node_and_attacker()?;
    let mut failed = Vec::new();
    for push in [false, true] {
        let config = DemoConfig {
            push,
            requests: 400,
            model: Model { layers: 4, ..DemoConfig::default().model },
            max_tokens: 256,
            lease_ms: 2000,
            pause_decode: if push { 0 } else { 3 },
            pause_prefill: push,
            attack: true,
            ..DemoConfig::default()
        };
        let report = Demo::start(config, node.clone())?.run()?;
        report.print();
        failed.extend(report.failures());
    }
    if !failed.is_empty() {
        bail!("the attack suite failed:\n  {}", failed.join("\n  "));
    }
    Ok(())
}

/// The longest a dead D engine's export may stay held on P after the death: P hears of the
/// death when the engine's side channel closes, and releases what was bound to it at once.
const DEATH_RELEASE_BOUND_MS: u64 = 1000;

/// The run's settings; the defaults end within 60 s on a 2-core machine.
#[derive(Clone, Debug)]
pub struct DemoConfig {
    /// Push mode (P writes) instead of pull (D reads).
    pub push: bool,
    /// D engines.
    pub decoders: u32,
    /// Requests the router sends.
    pub requests: u32,
    /// The workload's seed.
    pub seed: u64,
    /// Requests in flight at once.
    pub concurrency: u32,
    /// Prompt lengths are drawn log-uniformly from this range.
    pub min_tokens: u64,
    /// See `min_tokens`.
    pub max_tokens: u64,
    /// The model.
    pub model: Model,
    /// Blocks per engine's pool.
    pub blocks: u32,
    /// `kv_lease_duration`.
    pub lease_ms: u64,
    /// Kill and restart one D engine part-way.
    pub kill: bool,
    /// Times decode0 is stopped (SIGSTOP) for 1.5 leases.
    pub pause_decode: u32,
    /// Stop P once, past D's push watchdog and within its quarantine.
    pub pause_prefill: bool,
    /// Run `kvflow-attack` against P once the engines are up (see `cargo xtask attack`).
    pub attack: bool,
    /// Fractions of requests D rejects, the router aborts, and that ask for n > 1.
    pub reject_rate: f64,
    /// See `reject_rate`.
    pub abort_rate: f64,
    /// See `reject_rate`.
    pub sibling_rate: f64,
    /// Stop sending new requests after this long.
    pub time_limit: Duration,
}

impl Default for DemoConfig {
    fn default() -> Self {
        DemoConfig {
            push: false,
            decoders: 2,
            requests: 200,
            seed: 1,
            concurrency: 8,
            min_tokens: 16,
            max_tokens: 512,
            // A Llama-3-8B-like layout: 32 layers, 8 KV heads of 128, bf16, 16-token blocks (2 MiB).
            model: Model { layers: 32, kv_heads: 8, head_dim: 128, dtype_bytes: 2, block_tokens: 16 },
            blocks: 384,
            lease_ms: 4000,
            kill: true,
            pause_decode: 0,
            pause_prefill: false,
            attack: false,
            reject_rate: 0.08,
            abort_rate: 0.08,
            sibling_rate: 0.10,
            time_limit: Duration::from_secs(40),
        }
    }
}

/// Parses the demo's flags.
pub fn parse(args: &[String]) -> Result<(DemoConfig, bool)> {
    let mut c = DemoConfig::default();
    let mut json_out = false;
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let mut value = |name: &str| -> Result<u64> {
            let v = it.next().ok_or_else(|| anyhow!("{name} needs a value\n{USAGE}"))?;
            v.parse().map_err(|_| anyhow!("{name} takes a whole number, got {v:?}\n{USAGE}"))
        };
        match flag.as_str() {
            "--mode" => {
                c.push = match it.next().map(String::as_str) {
                    Some("pull") => false,
                    Some("push") => true,
                    other => bail!("--mode takes pull or push, got {other:?}\n{USAGE}"),
                }
            }
            "--decoders" => c.decoders = value("--decoders")? as u32,
            "--requests" => c.requests = value("--requests")? as u32,
            "--seed" => c.seed = value("--seed")?,
            "--concurrency" => c.concurrency = value("--concurrency")? as u32,
            "--min-tokens" => c.min_tokens = value("--min-tokens")?,
            "--max-tokens" => c.max_tokens = value("--max-tokens")?,
            "--layers" => c.model.layers = value("--layers")? as u32,
            "--blocks" => c.blocks = value("--blocks")? as u32,
            "--lease-ms" => c.lease_ms = value("--lease-ms")?,
            "--no-kill" => c.kill = false,
            "--pause-decode" => c.pause_decode = value("--pause-decode")?.try_into().unwrap_or(u32::MAX),
            "--pause-prefill" => c.pause_prefill = true,
            "--json" => json_out = true,
            "-h" | "--help" => bail!("{USAGE}"),
            other => bail!("unknown argument {other:?}\n{USAGE}"),
        }
    }
    c.validate()?;
    Ok((c, json_out))
}

impl DemoConfig {
    fn validate(&self) -> Result<()> {
        if self.decoders == 0 || self.requests == 0 || self.concurrency == 0 || self.model.layers == 0 {
            bail!(
                "--decoders ({}), --requests ({}), --concurrency ({}) and --layers ({}) must be positive",
                self.decoders,
                self.requests,
                self.concurrency,
                self.model.layers
            );
        }
        if self.min_tokens == 0 || self.min_tokens > self.max_tokens {
            bail!("need 0 < --min-tokens ({}) <= --max-tokens ({})", self.min_tokens, self.max_tokens);
        }
        let largest = self.max_tokens.div_ceil(u64::from(self.model.block_tokens));
        if largest > u64::from(self.blocks) {
            bail!(
                "a prompt of --max-tokens {} needs {largest} blocks of {} tokens, more than a pool of --blocks {}",
                self.max_tokens,
                self.model.block_tokens,
                self.blocks
            );
        }
        if self.lease_ms < 600 {
            bail!("--lease-ms {} is too short: heartbeats go every lease / 6 and reads need a margin", self.lease_ms);
        }
        Ok(())
    }

    /// The stops the run makes: (engine, when that many requests were issued, for how long).
    fn pauses(&self) -> VecDeque<Pause> {
        let mut pauses = VecDeque::new();
        let lease = Duration::from_millis(self.lease_ms);
        for k in 0..self.pause_decode {
            let at_issued = self.requests * (k + 1) / (self.pause_decode + 2);
            pauses.push_back(Pause { engine: "decode0".into(), at_issued, length: lease * 3 / 2 });
        }
        if self.pause_prefill {
            // Past the watchdog (decoder_ttl_ms) by half the quarantine (two leases).
            let length = Duration::from_millis(self.node(NodeRole::Decode, "", 0).decoder_ttl_ms) + lease;
            pauses.push_back(Pause { engine: "prefill0".into(), at_issued: self.requests / 4, length });
        }
        pauses.make_contiguous().sort_by_key(|p| p.at_issued);
        pauses
    }

    fn node(&self, role: NodeRole, name: &str, instance: u64) -> NodeConfig {
        NodeConfig {
            role,
            name: name.to_owned(),
            instance,
            push: self.push,
            num_blocks: self.blocks,
            model: self.model,
            lease_ms: self.lease_ms,
            read_safety_margin_ms: self.lease_ms / 4,
            decoder_ttl_ms: self.lease_ms * 5,
        }
    }
}

/// `cargo xtask demo`.
pub fn run(args: &[String]) -> Result<()> {
    let (config, json_out) = parse(args)?;
    let node = build_node()?;
    let report = Demo::start(config, node)?.run()?;
    if json_out {
        println!("{}", report.json());
    } else {
        report.print();
    }
    let failures = report.failures();
    if !failures.is_empty() {
        bail!("the demo failed its checks:\n  {}", failures.join("\n  "));
    }
    Ok(())
}

/// Provisions NIXL and builds `kvflow-node`; returns its path and the environment it needs.
/// `KVFLOW_NODE_BIN` names a `kvflow-node` built elsewhere instead (for a machine without a
/// toolchain, with `KVFLOW_NIXL_DIR` pointing at its runtime).
pub fn build_node() -> Result<NodeBinary> {
    if let Some(path) = std::env::var_os("KVFLOW_NODE_BIN") {
        return Ok(NodeBinary { path: PathBuf::from(path), envs: Vec::new() });
    }
    let root = workspace_root();
    let nixl = provision::ensure().context("the demo's engines need NIXL (see `cargo xtask setup`)")?;
    let envs = nixl.envs();
    crate::ci::cargo_env(
        &root,
        &["build", "--locked", "-q", "-p", "xtask", "--features", "nixl", "--bin", "kvflow-node"],
        &envs,
    )?;
    let target = std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| root.join("target"));
    Ok(NodeBinary { path: target.join("debug").join("kvflow-node"), envs })
}

/// As [`build_node`], and the attacker beside it.
pub fn build_node_and_attacker() -> Result<NodeBinary> {
    let node = build_node()?;
    if std::env::var_os("KVFLOW_NODE_BIN").is_none() {
        let args = ["build", "--locked", "-q", "-p", "xtask", "--features", "nixl", "--bin", "kvflow-attack"];
        crate::ci::cargo_env(&workspace_root(), &args, &node.envs)?;
    }
    Ok(node)
}

/// The engine binary and its environment.
#[derive(Clone)]
pub struct NodeBinary {
    path: PathBuf,
    envs: Vec<(String, String)>,
}

/// A running engine process.
struct Node {
    role: NodeRole,
    instance: u64,
    child: Child,
    stdin: ChildStdin,
    port: Option<u16>,
}

/// An event from an engine process, or its end.
enum FromNode {
    Event(Event),
    Exited,
    /// From the attacker: one attack's result, or its end.
    Attack(AttackResult),
    AttackerExited,
}

/// The router's name for the attacker process in its event channel.
const ATTACKER: &str = "attacker";

/// One export (P's request id, which D's request shares): where it went and how it ended.
#[derive(Default, Debug)]
struct Track {
    parent: String,
    decode: Option<(String, u64)>,
    finished_at_ns: Option<u64>,
    outcome: Option<String>,
    ready_at_ns: Option<u64>,
    freed: Option<(String, u64)>,
}

/// What the router decided for a request.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Fate {
    Normal,
    Reject,
    /// Abort on D this long after it arrives.
    Abort(Duration),
}

struct Request {
    id: String,
    prompt_tokens: u64,
    n: u32,
    fate: Fate,
}

/// A run: the engines and the router's view of the requests.
pub struct Demo {
    config: DemoConfig,
    binary: NodeBinary,
    /// The cluster key every engine of this run holds, as 64 hex digits.
    key: String,
    nodes: BTreeMap<String, Node>,
    events: Receiver<(String, u64, FromNode)>,
    sender: Sender<(String, u64, FromNode)>,
    /// Requests not sent yet.
    queue: VecDeque<Request>,
    /// Prompts a busy P sent back, to send again from this time.
    retries: VecDeque<(Instant, String)>,
    /// Exports that found no live D engine, to hand over when one is up.
    undelivered: VecDeque<(String, String, Remote, Fate)>,
    /// Requests sent, by id, with their exports.
    open: HashMap<String, (Request, Vec<String>)>,
    tracks: BTreeMap<String, Track>,
    aborts: Vec<(Instant, String)>,
    next_decode: usize,
    issued: u32,
    completed: u32,
    kill: Option<Kill>,
    /// Stops still to make, the one in progress (its process and when it ends), and those made.
    pauses: VecDeque<Pause>,
    paused: Option<(Pause, u32, Instant, u64)>,
    /// Stops made, with when each began and ended (wall clock, ns).
    paused_done: Vec<(Pause, u64, u64)>,
    /// The attacker process while it runs, and what it reported.
    attacker: Option<Child>,
    attacker_started: bool,
    attacks: Vec<AttackResult>,
    transfers: Vec<(u64, u64, bool)>,
    errors: Vec<String>,
    started: Instant,
    progress: indicatif::ProgressBar,
}

/// A stop of one engine with SIGSTOP, then SIGCONT.
#[derive(Clone, Debug)]
struct Pause {
    engine: String,
    at_issued: u32,
    length: Duration,
}

/// Sends `signal` (`STOP`, `CONT`) to process `pid`.
fn signal(pid: u32, signal: &str) -> Result<()> {
    let status = Process::new("kill").arg(format!("-{signal}")).arg(pid.to_string()).status()?;
    if !status.success() {
        bail!("kill -{signal} {pid} failed: {status}");
    }
    Ok(())
}

/// The D engine killed part-way.
struct Kill {
    engine: String,
    instance: u64,
    at_ns: u64,
    restart_at: Option<Instant>,
}

impl Demo {
    /// Starts the engines and waits until they listen.
    pub fn start(config: DemoConfig, binary: NodeBinary) -> Result<Demo> {
        let (sender, events) = mpsc::channel();
        let mut rng = Rng::new(config.seed);
        let queue = (0..config.requests).map(|i| workload(&config, &mut rng, i)).collect();
        let progress = indicatif::ProgressBar::new(u64::from(config.requests));
        progress.set_style(
            indicatif::ProgressStyle::with_template("{spinner} {elapsed:>3} [{bar:40}] {pos}/{len} requests {msg}")
                .expect("template")
                .progress_chars("=> "),
        );
        let mut key = [0u8; 32];
        getrandom::fill(&mut key).map_err(|e| anyhow::anyhow!("no randomness for the cluster key: {e}"))?;
        let pauses = config.pauses();
        let mut demo = Demo {
            config,
            binary,
            key: key.iter().map(|b| format!("{b:02x}")).collect(),
            nodes: BTreeMap::new(),
            events,
            sender,
            queue,
            retries: VecDeque::new(),
            undelivered: VecDeque::new(),
            open: HashMap::new(),
            tracks: BTreeMap::new(),
            aborts: Vec::new(),
            next_decode: 0,
            issued: 0,
            completed: 0,
            kill: None,
            pauses,
            paused: None,
            paused_done: Vec::new(),
            attacker: None,
            attacker_started: false,
            attacks: Vec::new(),
            transfers: Vec::new(),
            errors: Vec::new(),
            started: Instant::now(),
            progress,
        };
        demo.spawn(NodeRole::Prefill, "prefill0", 1)?;
        for i in 0..demo.config.decoders {
            demo.spawn(NodeRole::Decode, &format!("decode{i}"), 1)?;
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        while demo.nodes.values().any(|n| n.port.is_none()) {
            demo.pump(Duration::from_millis(50))?;
            if Instant::now() > deadline {
                bail!("the engines did not start within 60 s: {}", demo.errors.join("; "));
            }
        }
        demo.started = Instant::now();
        Ok(demo)
    }

    /// Starts the attacker once no stop of P is ahead (a stopped P answers nobody, and the
    /// attacks measure how P answers): at once in a pull run, after P's stop in a push run.
    fn attack_if_due(&mut self) -> Result<()> {
        let p_stop_ahead = self.pauses.iter().any(|p| p.engine == "prefill0")
            || self.paused.as_ref().is_some_and(|(p, ..)| p.engine == "prefill0");
        if self.config.attack && !self.attacker_started && !p_stop_ahead {
            self.attacker_started = true;
            self.start_attacker()?;
        }
        Ok(())
    }

    /// Starts `kvflow-attack` against P, impersonating decode0.
    fn start_attacker(&mut self) -> Result<()> {
        let p = &self.nodes["prefill0"];
        let config = AttackConfig {
            p_port: p.port.expect("up"),
            p_pid: p.child.id(),
            model: self.config.model,
            live_decode: "decode0".into(),
            live_instance: self.nodes["decode0"].instance,
            requests: self.config.requests,
        };
        let path = self.binary.path.with_file_name("kvflow-attack");
        let mut child = self
            .child(&path, serde_json::to_string(&config)?)
            .stdin(Stdio::null())
            .spawn()
            .with_context(|| format!("cannot start {}", path.display()))?;
        let stdout = child.stdout.take().expect("piped");
        let sender = self.sender.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let from = match serde_json::from_str(&line) {
                    Ok(result) => FromNode::Attack(result),
                    Err(e) => {
                        FromNode::Event(Event::Error { message: format!("unreadable attacker line {line:?}: {e}") })
                    }
                };
                if sender.send((ATTACKER.to_owned(), 0, from)).is_err() {
                    return;
                }
            }
            let _ = sender.send((ATTACKER.to_owned(), 0, FromNode::AttackerExited));
        });
        self.attacker = Some(child);
        self.progress.set_message("attacker started");
        Ok(())
    }

    /// A process of the run: its one argument, the provisioned environment and the cluster
    /// key, its stdout piped to the router.
    fn child(&self, path: &std::path::Path, arg: String) -> Process {
        let mut command = Process::new(path);
        command
            .arg(arg)
            .envs(self.binary.envs.iter().map(|(k, v)| (k, v)))
            .env(CLUSTER_KEY_ENV, &self.key)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        command
    }

    fn spawn(&mut self, role: NodeRole, name: &str, instance: u64) -> Result<()> {
        let config = serde_json::to_string(&self.config.node(role, name, instance))?;
        let mut child = self
            .child(&self.binary.path, config)
            .stdin(Stdio::piped())
            .spawn()
            .with_context(|| format!("cannot start {} for {name}", self.binary.path.display()))?;
        let stdin = child.stdin.take().expect("piped");
        let stdout = child.stdout.take().expect("piped");
        let (sender, who) = (self.sender.clone(), name.to_owned());
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if !line.starts_with('{') {
                    // Not the protocol: a library's log line (UCX logs to stdout). Pass it on.
                    eprintln!("{who}: {line}");
                    continue;
                }
                let event = serde_json::from_str(&line)
                    .unwrap_or_else(|e| Event::Error { message: format!("unreadable line {line:?}: {e}") });
                if sender.send((who.clone(), instance, FromNode::Event(event))).is_err() {
                    return;
                }
            }
            let _ = sender.send((who, instance, FromNode::Exited));
        });
        self.nodes.insert(name.to_owned(), Node { role, instance, child, stdin, port: None });
        Ok(())
    }

    fn send(&mut self, name: &str, command: &Command) {
        let Some(node) = self.nodes.get_mut(name) else { return };
        if let Err(err) = write_line(&mut node.stdin, command) {
            self.errors.push(format!("cannot reach {name}: {err}"));
        }
    }

    fn prefill_address(&self) -> String {
        format!("127.0.0.1:{}", self.nodes["prefill0"].port.unwrap_or(0))
    }

    /// The next live D engine, round robin.
    fn pick_decode(&mut self) -> Option<String> {
        let live: Vec<String> = self
            .nodes
            .iter()
            .filter(|(_, n)| n.role == NodeRole::Decode && n.port.is_some())
            .map(|(name, _)| name.clone())
            .collect();
        if live.is_empty() {
            return None;
        }
        self.next_decode = (self.next_decode + 1) % live.len();
        Some(live[self.next_decode].clone())
    }

    /// Runs the workload, drains, stops the engines, and reports.
    pub fn run(mut self) -> Result<Report> {
        let kill_after = self.config.requests * 2 / 5;
        let limit = self.started + self.config.time_limit;
        // The run ends when every request has ended, the killed engine is back up, and no
        // engine is stopped.
        while self.completed < self.config.requests
            || self.restarting()
            || self.paused.is_some()
            || self.attacker.is_some()
            || (self.config.attack && !self.attacker_started)
        {
            let now = Instant::now();
            if self.config.kill && self.kill.is_none() && self.issued >= kill_after {
                self.kill_decode()?;
            }
            self.pause_if_due(now)?;
            self.attack_if_due()?;
            self.restart_if_due()?;
            if now < limit {
                self.issue(now);
            } else if !self.queue.is_empty() {
                let dropped = self.queue.len();
                self.queue.clear();
                self.errors.push(format!("time limit: {dropped} requests were never sent"));
                self.completed += dropped as u32;
            } else {
                // Prompts P sent back, and exports waiting for a D engine, still go.
                self.issue(now);
            }
            self.fire_aborts(now);
            self.pump(Duration::from_millis(2))?;
            let stopped: Duration = self.paused_done.iter().map(|(p, _, _)| p.length).sum();
            if now > limit + stopped + Duration::from_millis(self.config.lease_ms * 3) {
                self.errors.push(format!("{} requests never finished", self.config.requests - self.completed));
                break;
            }
        }
        self.progress.finish_and_clear();
        let elapsed = self.started.elapsed();
        let drain = self.drain()?;
        self.shutdown();
        Ok(Report::new(&self, elapsed, drain))
    }

    /// Sends prompts P sent back, then new requests while fewer than `concurrency` are open.
    fn issue(&mut self, now: Instant) {
        while self.retries.front().is_some_and(|(at, _)| *at <= now) {
            let (_, id) = self.retries.pop_front().expect("front");
            if let Some((r, exports)) = self.open.get(&id) {
                // The same consumer as the first time: P binds the exports to it again.
                let consumer = self.tracks.get(&exports[0]).and_then(|t| t.decode.clone());
                let command = Command::Prefill { id: id.clone(), prompt_tokens: r.prompt_tokens, n: r.n, consumer };
                self.send("prefill0", &command);
            }
        }
        for _ in 0..self.undelivered.len() {
            let (export, parent, remote, fate) = self.undelivered.pop_front().expect("counted");
            self.dispatch(&export, &parent, remote, fate);
        }
        while self.open.len() < self.config.concurrency as usize {
            let Some(request) = self.queue.pop_front() else { return };
            self.issued += 1;
            let (id, tokens, n) = (request.id.clone(), request.prompt_tokens, request.n);
            let exports: Vec<String> =
                if n > 1 { (0..n).map(|i| format!("{i}_{id}")).collect() } else { vec![id.clone()] };
            for export in &exports {
                self.tracks.entry(export.clone()).or_default().parent = id.clone();
            }
            // D loads sibling 0 once and serves the other siblings from its prefix cache, as
            // vLLM does; P releases their exports when sibling 0 completes.
            if request.fate != Fate::Reject {
                for export in &exports[1..] {
                    self.tracks.get_mut(export).expect("tracked").outcome = Some("prefix_cache".into());
                }
            }
            // The router picks D before it sends the prompt to P, and names it: P binds the
            // exports to that engine at once, so they go with it if it dies.
            if !self.config.push {
                if let Some(decode) = self.pick_decode() {
                    let chosen = (decode.clone(), self.nodes[&decode].instance);
                    for export in &exports {
                        self.tracks.get_mut(export).expect("tracked").decode = Some(chosen.clone());
                    }
                }
            }
            if self.config.push {
                // D hears first: it allocates and registers its blocks with P.
                let address = self.prefill_address();
                let remote = |export: &String| Remote {
                    engine: "prefill0".into(),
                    request: export.clone(),
                    addresses: vec![address.clone()],
                    instance: 0,
                    prompt_tokens: tokens,
                    export: None,
                    consumer: None,
                };
                self.dispatch(&exports[0], &id, remote(&exports[0]), request.fate);
                if request.fate == Fate::Reject {
                    // D rejects the whole request: every sibling's export, on the same engine,
                    // which P binds the family to (a rejection from another is foreign).
                    let chosen = self.tracks.get(&exports[0]).and_then(|t| t.decode.clone());
                    for export in &exports[1..] {
                        self.tracks.get_mut(export).expect("tracked").decode = chosen.clone();
                    }
                    for export in &exports[1..] {
                        self.dispatch(export, &id, remote(export), Fate::Reject);
                    }
                }
            }
            let consumer = self.tracks.get(&exports[0]).and_then(|t| t.decode.clone());
            self.send("prefill0", &Command::Prefill { id: id.clone(), prompt_tokens: tokens, n, consumer });
            self.open.insert(id, (request, exports));
        }
    }

    /// Hands an export to a D engine: the one named at prefill, else the next live one;
    /// arrival, or rejection before admission.
    fn dispatch(&mut self, export: &str, parent: &str, remote: Remote, fate: Fate) {
        let named = self.tracks.get(export).and_then(|t| t.decode.clone());
        let decode = match named {
            Some((decode, instance)) if self.nodes.get(&decode).is_some_and(|n| n.instance == instance) => decode,
            // The engine P bound it to is gone: P releases it; the request is lost with it.
            Some(_) => return self.finish_export(export, "lost", None),
            None => match self.pick_decode() {
                Some(decode) => decode,
                None => {
                    // The only D engine is down: hand it over once one is back.
                    self.undelivered.push_back((export.to_owned(), parent.to_owned(), remote, fate));
                    return;
                }
            },
        };
        let instance = self.nodes[&decode].instance;
        let track = self.tracks.entry(export.to_owned()).or_default();
        track.parent = parent.to_owned();
        track.decode = Some((decode.clone(), instance));
        let command = match fate {
            Fate::Reject => Command::Reject { id: export.to_owned(), remote },
            _ => Command::Arrive { id: export.to_owned(), remote },
        };
        self.send(&decode, &command);
        if let Fate::Abort(after) = fate {
            self.aborts.push((Instant::now() + after, export.to_owned()));
        }
    }

    fn fire_aborts(&mut self, now: Instant) {
        let due: Vec<String> = self.aborts.iter().filter(|(t, _)| *t <= now).map(|(_, id)| id.clone()).collect();
        self.aborts.retain(|(t, _)| *t > now);
        for id in due {
            let Some(track) = self.tracks.get(&id) else { continue };
            if track.outcome.is_some() {
                continue;
            }
            let Some((decode, instance)) = track.decode.clone() else { continue };
            if self.nodes.get(&decode).is_some_and(|n| n.instance == instance) {
                self.send(&decode, &Command::Abort { id });
            }
        }
    }

    fn kill_decode(&mut self) -> Result<()> {
        let engine = format!("decode{}", self.config.decoders - 1);
        let node = self.nodes.get_mut(&engine).expect("started");
        node.child.kill().with_context(|| format!("cannot kill {engine}"))?;
        let _ = node.child.wait();
        let at_ns = wall_ns();
        let instance = node.instance;
        node.port = None;
        self.progress.set_message(format!("killed {engine}"));
        // Its requests are lost with it; the router does not retry them.
        let lost: Vec<String> = self
            .tracks
            .iter()
            .filter(|(_, t)| t.outcome.is_none() && t.decode.as_ref() == Some(&(engine.clone(), instance)))
            .map(|(id, _)| id.clone())
            .collect();
        for id in lost {
            self.finish_export(&id, "lost", None);
        }
        self.kill =
            Some(Kill { engine, instance, at_ns, restart_at: Some(Instant::now() + Duration::from_millis(500)) });
        Ok(())
    }

    /// Stops the next engine due, or resumes the stopped one when its time is up.
    fn pause_if_due(&mut self, now: Instant) -> Result<()> {
        if let Some((pause, pid, until, began)) = &self.paused {
            if now >= *until {
                signal(*pid, "CONT")?;
                self.progress.set_message(format!("resumed {}", pause.engine));
                self.paused_done.push((pause.clone(), *began, wall_ns()));
                self.paused = None;
            }
            return Ok(());
        }
        if self.pauses.front().is_none_or(|p| p.at_issued > self.issued) {
            return Ok(());
        }
        let pause = self.pauses.pop_front().expect("checked");
        // A killed engine that is not back yet cannot be stopped: skip that stop.
        let Some(node) = self.nodes.get(&pause.engine).filter(|n| n.port.is_some()) else {
            self.errors.push(format!("{} was down when it was due to be stopped", pause.engine));
            return Ok(());
        };
        signal(node.child.id(), "STOP")?;
        self.progress.set_message(format!("stopped {} for {} ms", pause.engine, pause.length.as_millis()));
        self.paused = Some((pause.clone(), node.child.id(), now + pause.length, wall_ns()));
        Ok(())
    }

    /// Whether the killed engine is not yet back up.
    fn restarting(&self) -> bool {
        self.kill.as_ref().is_some_and(|k| self.nodes.get(&k.engine).is_none_or(|n| n.port.is_none()))
    }

    fn restart_if_due(&mut self) -> Result<()> {
        let Some(kill) = &mut self.kill else { return Ok(()) };
        if kill.restart_at.is_none_or(|t| t > Instant::now()) {
            return Ok(());
        }
        kill.restart_at = None;
        let engine = kill.engine.clone();
        let instance = self.nodes[&engine].instance + 1;
        self.spawn(NodeRole::Decode, &engine, instance)?;
        self.progress.set_message(format!("restarted {engine}"));
        Ok(())
    }

    /// Handles what the engines said, waiting up to `wait` for the first of it.
    fn pump(&mut self, wait: Duration) -> Result<()> {
        let mut next = match self.events.recv_timeout(wait) {
            Ok(e) => Some(e),
            Err(RecvTimeoutError::Timeout) => None,
            Err(RecvTimeoutError::Disconnected) => bail!("every engine is gone"),
        };
        while let Some((name, instance, from)) = next {
            self.on_event(&name, instance, from);
            next = self.events.try_recv().ok();
        }
        Ok(())
    }

    fn on_event(&mut self, name: &str, instance: u64, from: FromNode) {
        let from = match from {
            FromNode::Attack(result) => {
                self.progress.set_message(format!("attack {}", result.attack));
                return self.attacks.push(result);
            }
            FromNode::AttackerExited => {
                if let Some(mut child) = self.attacker.take() {
                    match child.wait() {
                        Ok(status) if status.success() => {}
                        status => self.errors.push(format!("the attacker failed: {status:?}")),
                    }
                }
                return;
            }
            FromNode::Event(Event::Error { message }) if name == ATTACKER => return self.errors.push(message),
            other => other,
        };
        let current = self.nodes.get(name).is_some_and(|n| n.instance == instance);
        let event = match from {
            FromNode::Exited => {
                let killed = self.kill.as_ref().is_some_and(|k| k.engine == name) && !current;
                if current && self.nodes.get(name).is_some_and(|n| n.port.is_some()) && !killed {
                    self.errors.push(format!("{name} (instance {instance}) exited unexpectedly"));
                    if let Some(node) = self.nodes.get_mut(name) {
                        node.port = None;
                    }
                }
                return;
            }
            FromNode::Event(event) => event,
            FromNode::Attack(_) | FromNode::AttackerExited => return,
        };
        if !current {
            // A killed incarnation's last words.
            return;
        }
        match event {
            Event::Ready { port } => {
                if let Some(node) = self.nodes.get_mut(name) {
                    node.port = Some(port);
                }
            }
            Event::Exported { id, remote, finished_at_ns } => {
                let export = remote.request.clone();
                let fate = self.open.get(&id).map_or(Fate::Normal, |(r, _)| r.fate);
                let track = self.tracks.entry(export.clone()).or_default();
                track.finished_at_ns = Some(finished_at_ns);
                // Sibling 0 goes to D; so do the others when D rejects the whole request.
                if !self.config.push && (track.outcome.is_none() || fate == Fate::Reject) {
                    self.dispatch(&export, &id, remote, fate);
                }
            }
            Event::Busy { id } => self.retries.push_back((Instant::now() + Duration::from_millis(20), id)),
            Event::Freed { id, reason, at_ns } => {
                self.tracks.entry(id).or_default().freed = Some((reason, at_ns));
            }
            Event::Outcome { id, outcome, ready_at_ns, .. } => {
                let track = self.tracks.get(&id);
                let from_here = track.and_then(|t| t.decode.as_ref()).is_some_and(|(d, i)| d == name && *i == instance);
                if from_here && track.is_some_and(|t| t.outcome.is_none()) {
                    let ready = (outcome == "ok" || outcome == "corrupt").then_some(ready_at_ns);
                    self.finish_export(&id, &outcome, ready);
                }
            }
            Event::Transfer { bytes, took_ns, ok } => self.transfers.push((bytes, took_ns, ok)),
            Event::Stats { .. } => {}
            Event::Error { message } => self.errors.push(format!("{name}: {message}")),
        }
    }

    fn finish_export(&mut self, export: &str, outcome: &str, ready_at_ns: Option<u64>) {
        let Some(track) = self.tracks.get_mut(export) else { return };
        track.outcome = Some(outcome.to_owned());
        track.ready_at_ns = ready_at_ns;
        let parent = track.parent.clone();
        let Some((_, exports)) = self.open.get(&parent) else { return };
        if exports.iter().all(|e| self.tracks.get(e).is_some_and(|t| t.outcome.is_some())) {
            self.open.remove(&parent);
            self.completed += 1;
            self.progress.inc(1);
        }
    }

    /// Waits until P's pool is empty or the lease has run out twice over, then collects every
    /// engine's counts.
    fn drain(&mut self) -> Result<BTreeMap<String, Value>> {
        let deadline = Instant::now() + Duration::from_millis(self.config.lease_ms * 2 + 2000);
        loop {
            let stats = self.collect_stats()?;
            let held: u64 = stats.values().map(|s| s["held_blocks"].as_u64().unwrap_or(0)).sum();
            if held == 0 || Instant::now() > deadline {
                return Ok(stats);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Asks every live engine for its counts and waits for them all.
    fn collect_stats(&mut self) -> Result<BTreeMap<String, Value>> {
        let live: Vec<(String, u64)> =
            self.nodes.iter().filter(|(_, n)| n.port.is_some()).map(|(k, n)| (k.clone(), n.instance)).collect();
        for (name, _) in &live {
            self.send(name, &Command::Stats);
        }
        let mut stats = BTreeMap::new();
        let deadline = Instant::now() + Duration::from_secs(10);
        while stats.len() < live.len() {
            let wait = deadline.saturating_duration_since(Instant::now());
            let (name, instance, from) = self.events.recv_timeout(wait).map_err(|_| {
                anyhow!("engines did not report their counts: {:?}", live.iter().map(|l| &l.0).collect::<Vec<_>>())
            })?;
            match from {
                FromNode::Event(Event::Stats { held_blocks, written_after_free, counters })
                    if live.contains(&(name.clone(), instance)) =>
                {
                    stats.insert(
                        name,
                        json!({ "held_blocks": held_blocks, "written_after_free": written_after_free, "counters": counters }),
                    );
                }
                other => self.on_event(&name, instance, other),
            }
        }
        Ok(stats)
    }

    /// Leaves the started engines idle for `window` and returns the share of one core each
    /// used meanwhile, in percent (from `/proc/PID/stat`), then stops them.
    pub fn idle_cpu_percent(mut self, window: Duration) -> Result<BTreeMap<String, f64>> {
        let ticks_per_s: f64 = Process::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
            .unwrap_or(100.0);
        let cpu_ticks = |pid: u32| -> Option<f64> {
            let fields = xtask::procfs::stat(pid)?;
            Some(fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?)
        };
        let pids: Vec<(String, u32)> = self.nodes.iter().map(|(n, node)| (n.clone(), node.child.id())).collect();
        let before: Vec<Option<f64>> = pids.iter().map(|(_, pid)| cpu_ticks(*pid)).collect();
        let start = Instant::now();
        while start.elapsed() < window {
            self.pump(Duration::from_millis(100))?;
        }
        let elapsed = start.elapsed().as_secs_f64();
        let mut used = BTreeMap::new();
        for ((name, pid), before) in pids.iter().zip(before) {
            let (Some(a), Some(b)) = (before, cpu_ticks(*pid)) else { bail!("cannot read {name}'s CPU time") };
            used.insert(name.clone(), (b - a) / ticks_per_s / elapsed * 100.0);
        }
        self.shutdown();
        Ok(used)
    }

    fn shutdown(&mut self) {
        if let Some(mut child) = self.attacker.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if let Some((_, pid, _, _)) = self.paused.take() {
            let _ = signal(pid, "CONT");
        }
        let live: Vec<String> = self.nodes.iter().filter(|(_, n)| n.port.is_some()).map(|(k, _)| k.clone()).collect();
        for name in &live {
            self.send(name, &Command::Shutdown);
        }
        for node in self.nodes.values_mut() {
            let deadline = Instant::now() + Duration::from_secs(5);
            while node.child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = node.child.kill();
            let _ = node.child.wait();
        }
    }
}

/// The `i`-th request of the workload.
fn workload(config: &DemoConfig, rng: &mut Rng, i: u32) -> Request {
    // Log-uniform prompt lengths: many short prompts, some long ones.
    let (lo, hi) = ((config.min_tokens as f64).ln(), (config.max_tokens as f64).ln());
    let u = rng.below(1 << 30) as f64 / f64::from(1u32 << 30);
    let prompt_tokens = ((lo + u * (hi - lo)).exp().round() as u64).clamp(config.min_tokens, config.max_tokens);
    let n = if rng.chance(config.sibling_rate) { 2 + rng.below(3) as u32 } else { 1 };
    let fate = if rng.chance(config.reject_rate) {
        Fate::Reject
    } else if rng.chance(config.abort_rate) {
        Fate::Abort(Duration::from_millis(rng.below(40)))
    } else {
        Fate::Normal
    };
    Request { id: format!("req-{i}"), prompt_tokens, n, fate }
}

fn percentile(values: &[u64], p: f64) -> u64 {
    xtask::stats::quantile(values, p / 100.0).unwrap_or(0)
}

/// What a run measured.
pub struct Report {
    mode: &'static str,
    requests: u32,
    exports: usize,
    outcomes: BTreeMap<String, u64>,
    releases: BTreeMap<String, u64>,
    bytes: u64,
    transfers: usize,
    transfers_failed: usize,
    transfer_gbps: f64,
    run_gbps: f64,
    elapsed: Duration,
    transfer_p50_us: u64,
    transfer_p99_us: u64,
    kv_p50_us: u64,
    kv_p99_us: u64,
    kv_samples: usize,
    killed: Option<String>,
    pauses: Vec<(String, u64)>,
    attacks: Option<Vec<AttackResult>>,
    /// Exports released as `peer_lost` while the D engine they went to was alive.
    released_for_live_engines: usize,
    held_after_death_ms: Option<u64>,
    longest_held_after_death: Option<String>,
    /// The killed engine's exports still held at its death, by how P released them.
    dead_engine_releases: BTreeMap<String, u64>,
    lease_ms: u64,
    corrupt_reads: u64,
    written_after_free: u64,
    held_after_drain: BTreeMap<String, u64>,
    unreleased_exports: usize,
    counters: BTreeMap<String, u64>,
    errors: Vec<String>,
}

impl Report {
    fn new(demo: &Demo, elapsed: Duration, stats: BTreeMap<String, Value>) -> Report {
        let mut outcomes = BTreeMap::new();
        let mut releases = BTreeMap::new();
        for track in demo.tracks.values() {
            *outcomes.entry(track.outcome.clone().unwrap_or_else(|| "unfinished".into())).or_insert(0) += 1;
            if let Some((reason, _)) = &track.freed {
                *releases.entry(reason.clone()).or_insert(0) += 1;
            }
        }
        let done: Vec<_> = demo.transfers.iter().filter(|t| t.2).collect();
        let bytes: u64 = done.iter().map(|t| t.0).sum();
        let busy_ns: u64 = done.iter().map(|t| t.1).sum();
        let took: Vec<u64> = done.iter().map(|t| t.1 / 1000).collect();
        let kv: Vec<u64> = demo
            .tracks
            .values()
            .filter_map(|t| Some(t.ready_at_ns?.saturating_sub(t.finished_at_ns?) / 1000))
            .collect();
        let mut longest_held_after_death = None;
        let held_after_death_ms = demo.kill.as_ref().map(|k| {
            demo.tracks
                .iter()
                .filter(|(_, t)| t.decode.as_ref().is_some_and(|(d, i)| *d == k.engine && *i == k.instance))
                // A block is held from its export (which may come after the death, in push
                // mode) until it is freed.
                .filter_map(|(id, t)| Some((id, t.freed.as_ref()?, t.finished_at_ns?.max(k.at_ns))))
                .map(|(id, (reason, freed), from)| (*freed, from, format!("{id}, released as {reason}")))
                // P cannot release anything while it is stopped: count from its resume.
                .map(|(freed, from, what)| {
                    let p_stops = demo.paused_done.iter().filter(|(p, _, _)| p.engine == "prefill0");
                    let from = p_stops
                        .filter(|&&(_, began, ended)| began < freed && ended > from)
                        .fold(from, |from, &(_, _, ended)| from.max(ended));
                    ((freed.saturating_sub(from)) / 1_000_000, what)
                })
                .max()
                .map_or(0, |(ms, what)| {
                    longest_held_after_death = Some(what);
                    ms
                })
        });
        let mut dead_engine_releases = BTreeMap::new();
        if let Some(k) = &demo.kill {
            let dead = demo
                .tracks
                .values()
                .filter(|t| t.decode.as_ref().is_some_and(|(d, i)| *d == k.engine && *i == k.instance));
            // What the promise is about: exports still held when the engine died.
            for (reason, _) in dead.filter_map(|t| t.freed.as_ref()).filter(|(_, at)| *at >= k.at_ns) {
                *dead_engine_releases.entry(reason.clone()).or_insert(0) += 1;
            }
        }
        let mut counters = BTreeMap::new();
        let mut held_after_drain = BTreeMap::new();
        let (mut written_after_free, mut corrupt_reads) = (0, 0);
        for (name, s) in &stats {
            held_after_drain.insert(name.clone(), s["held_blocks"].as_u64().unwrap_or(0));
            written_after_free += s["written_after_free"].as_u64().unwrap_or(0);
            if let Some(map) = s["counters"].as_object() {
                for (k, v) in map {
                    *counters.entry(k.clone()).or_insert(0) += v.as_u64().unwrap_or(0);
                }
            }
        }
        corrupt_reads += outcomes.get("corrupt").copied().unwrap_or(0);
        Report {
            mode: if demo.config.push { "push" } else { "pull" },
            requests: demo.config.requests,
            exports: demo.tracks.len(),
            releases,
            bytes,
            transfers: done.len(),
            transfers_failed: demo.transfers.len() - done.len(),
            transfer_gbps: if busy_ns == 0 { 0.0 } else { bytes as f64 / busy_ns as f64 },
            run_gbps: bytes as f64 / elapsed.as_nanos().max(1) as f64,
            elapsed,
            transfer_p50_us: percentile(&took, 50.0),
            transfer_p99_us: percentile(&took, 99.0),
            kv_p50_us: percentile(&kv, 50.0),
            kv_p99_us: percentile(&kv, 99.0),
            kv_samples: kv.len(),
            killed: demo.kill.as_ref().map(|k| k.engine.clone()),
            pauses: demo.paused_done.iter().map(|(p, _, _)| (p.engine.clone(), p.length.as_millis() as u64)).collect(),
            attacks: demo.config.attack.then(|| demo.attacks.clone()),
            released_for_live_engines: demo
                .tracks
                .values()
                .filter(|t| t.freed.as_ref().is_some_and(|(reason, _)| reason == "peer_lost"))
                .filter(|t| {
                    let killed = demo.kill.as_ref().map(|k| (k.engine.clone(), k.instance));
                    t.decode.is_some() && t.decode != killed
                })
                .count(),
            held_after_death_ms,
            longest_held_after_death,
            dead_engine_releases,
            lease_ms: demo.config.lease_ms,
            corrupt_reads,
            written_after_free,
            unreleased_exports: demo
                .tracks
                .values()
                .filter(|t| t.finished_at_ns.is_some() && t.freed.is_none())
                .count(),
            held_after_drain,
            counters,
            outcomes,
            errors: demo.errors.clone(),
        }
    }

    /// Every check the run failed, in words; empty when it passed.
    pub fn failures(&self) -> Vec<String> {
        let mut f = Vec::new();
        if self.corrupt_reads > 0 {
            f.push(format!("{} corrupt reads", self.corrupt_reads));
        }
        if self.written_after_free > 0 {
            f.push(format!("{} blocks written after they were freed", self.written_after_free));
        }
        let held: u64 = self.held_after_drain.values().sum();
        if held > 0 {
            f.push(format!("{held} blocks still held after the drain: {:?}", self.held_after_drain));
        }
        if self.unreleased_exports > 0 {
            f.push(format!("{} exports P never released", self.unreleased_exports));
        }
        if let Some(ms) = self.held_after_death_ms.filter(|&ms| ms > DEATH_RELEASE_BOUND_MS) {
            f.push(format!(
                "a block stayed held {ms} ms after its D engine died, longer than {DEATH_RELEASE_BOUND_MS} ms (lease {} ms): {}",
                self.lease_ms,
                self.longest_held_after_death.as_deref().unwrap_or("?")
            ));
        }
        if let Some(n) = self.outcomes.get("unfinished") {
            f.push(format!("{n} exports never finished"));
        }
        if self.released_for_live_engines > 0 {
            f.push(format!(
                "{} exports released as peer_lost while their D engine was alive",
                self.released_for_live_engines
            ));
        }
        if let Some(attacks) = &self.attacks {
            if attacks.len() < ATTACKS {
                f.push(format!("the attacker reported {} of {ATTACKS} attacks", attacks.len()));
            }
            f.extend(attacks.iter().flat_map(AttackResult::failures));
            // The attacks that P must have noticed, by its own counts.
            for counter in ["foreign_messages", "unauthenticated"] {
                if self.counters.get(counter).copied().unwrap_or(0) == 0 {
                    f.push(format!("P counted no {counter} under attack"));
                }
            }
        }
        f.extend(self.errors.iter().cloned());
        f
    }

    /// The report as one JSON object.
    pub fn json(&self) -> Value {
        json!({
            "mode": self.mode,
            "requests": self.requests,
            "exports": self.exports,
            "outcomes": self.outcomes,
            "releases_on_p": self.releases,
            "bytes_moved": self.bytes,
            "transfers": self.transfers,
            "transfers_failed": self.transfers_failed,
            "transfer_gbps": self.transfer_gbps,
            "run_gbps": self.run_gbps,
            "elapsed_s": self.elapsed.as_secs_f64(),
            "transfer_latency_us": { "p50": self.transfer_p50_us, "p99": self.transfer_p99_us },
            "kv_latency_us": { "p50": self.kv_p50_us, "p99": self.kv_p99_us, "samples": self.kv_samples },
            "killed": self.killed,
            "attacks": self.attacks,
            "released_for_live_engines": self.released_for_live_engines,
            "pauses_ms": self.pauses.iter().map(|(e, ms)| json!({ "engine": e, "ms": ms })).collect::<Vec<_>>(),
            "longest_held_after_death_ms": self.held_after_death_ms,
            "dead_engine_releases": self.dead_engine_releases,
            "lease_ms": self.lease_ms,
            "corrupt_reads": self.corrupt_reads,
            "written_after_free": self.written_after_free,
            "held_after_drain": self.held_after_drain,
            "unreleased_exports": self.unreleased_exports,
            "counters": self.counters,
            "errors": self.errors,
            "passed": self.failures().is_empty(),
        })
    }

    /// The latencies alone, for the bench.
    pub fn latency_json(&self) -> Value {
        json!({
            "kv_latency_us": { "p50": self.kv_p50_us, "p99": self.kv_p99_us, "samples": self.kv_samples },
            "transfer_latency_us": { "p50": self.transfer_p50_us, "p99": self.transfer_p99_us },
            "transfer_gbps": self.transfer_gbps,
        })
    }

    /// The report as text.
    pub fn print(&self) {
        let list = |m: &BTreeMap<String, u64>| m.iter().map(|(k, v)| format!("{k} {v}")).collect::<Vec<_>>().join(", ");
        println!(
            "kvflow demo, {} mode: {} requests ({} exports) in {:.1} s",
            self.mode,
            self.requests,
            self.exports,
            self.elapsed.as_secs_f64()
        );
        println!("  outcomes on D        {}", list(&self.outcomes));
        println!("  releases on P        {}", list(&self.releases));
        println!(
            "  bytes moved          {:.2} GiB in {} transfers ({} failed): {:.2} GB/s per transfer (bytes over time in flight), {:.2} GB/s over the run",
            self.bytes as f64 / f64::from(1u32 << 30),
            self.transfers,
            self.transfers_failed,
            self.transfer_gbps,
            self.run_gbps
        );
        println!(
            "  transfer latency     p50 {:.2} ms, p99 {:.2} ms (post to completion)",
            self.transfer_p50_us as f64 / 1e3,
            self.transfer_p99_us as f64 / 1e3
        );
        println!(
            "  P done -> D holds KV p50 {:.2} ms, p99 {:.2} ms ({} requests)",
            self.kv_p50_us as f64 / 1e3,
            self.kv_p99_us as f64 / 1e3,
            self.kv_samples
        );
        match (&self.killed, self.held_after_death_ms) {
            (Some(engine), Some(ms)) => {
                let list = self.dead_engine_releases.iter().map(|(k, v)| format!("{k} {v}")).collect::<Vec<_>>();
                println!(
                    "  {engine} killed         its exports on P were all released within {ms} ms of its death \
                     (bound {DEATH_RELEASE_BOUND_MS} ms, lease {} ms); those held at its death: {}",
                    self.lease_ms,
                    if list.is_empty() { "none were held".to_owned() } else { list.join(", ") }
                )
            }
            _ => println!("  no engine killed"),
        }
        if !self.pauses.is_empty() {
            let list: Vec<String> = self.pauses.iter().map(|(e, ms)| format!("{e} {ms} ms")).collect();
            println!("  stopped (SIGSTOP)    {} (lease {} ms)", list.join(", "), self.lease_ms);
        }
        for a in self.attacks.iter().flatten() {
            let probe = a.probe_ms.map_or_else(|| "none".to_owned(), |ms| format!("{ms:.1} ms"));
            println!(
                "  attack {:<28} {}: {} (legit handshake {probe}, P +{:.1} MiB, P {}): {}",
                a.attack,
                if a.failures().is_empty() { "held" } else { "GOT THROUGH" },
                a.tried,
                a.rss_growth_mib,
                if a.p_alive { "alive" } else { "DEAD" },
                a.detail
            );
        }
        println!("  released, D alive    {}", self.released_for_live_engines);
        println!("  corrupt reads        {}", self.corrupt_reads);
        println!("  written after free   {}", self.written_after_free);
        println!("  held after drain     {}", list(&self.held_after_drain));
        println!("  connector counters   {}", list(&self.counters));
        for e in &self.errors {
            println!("  error: {e}");
        }
        println!("  {}", if self.failures().is_empty() { "PASSED" } else { "FAILED" });
    }
}
