//! The demo's processes: starting each engine (`kvflow-node`) with
//! its configuration and the cluster key, reading its event lines on a thread of its own into
//! the router's channel, and stopping them all at the end.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command as Process, Stdio};
use std::time::{Duration, Instant};

use crate::proto::{
    write_line, AttackConfig, AttackResult, Command, Event, NodeRole, OneEngineJob, OneEngineRun, Sighting,
    StormNotice, CLUSTER_KEY_ENV,
};
use anyhow::{bail, Context, Result};

use super::router::PKillPhase;
use super::Demo;

/// The engine binary (`kvflow-node`, with `kvflow-watch` and `kvflow-attack` beside it where a
/// run needs them) and the environment it runs with (the NIXL runtime's).
#[derive(Clone)]
pub struct NodeBinary {
    path: PathBuf,
    envs: Vec<(String, String)>,
}

impl NodeBinary {
    /// `kvflow-node` at `path`, run with `envs`.
    pub fn new(path: PathBuf, envs: Vec<(String, String)>) -> Self {
        NodeBinary { path, envs }
    }
}

/// A running engine process.
pub(super) struct Node {
    /// P or D.
    pub(super) role: NodeRole,
    /// Its incarnation.
    pub(super) instance: u64,
    pub(super) child: Child,
    stdin: ChildStdin,
    /// Its rank 0's side-channel port, once it said it is ready; `None` again once it is killed.
    pub(super) port: Option<u16>,
    /// Every rank's side-channel port, by rank, once it said it is ready.
    pub(super) ports: Vec<u16>,
    /// Where the router scrapes its metrics, once it said it is ready.
    pub(super) metrics: Option<std::net::SocketAddr>,
    /// A D engine: every rank of it has connected to P (the router asked it to, ahead of
    /// traffic), so the router routes to it first.
    pub(super) connected: bool,
}

/// The router's watch on etcd (`kvflow-watch`); it stops when its stdin closes.
pub(super) struct Watcher {
    child: Child,
    stdin: Option<ChildStdin>,
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.stdin = None;
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The router's name for its watch in its event channel.
const WATCHER: &str = "kvflow-watch";

/// An event from an engine process, or its end.
pub(super) enum FromNode {
    Event(Event),
    /// From the router's watch on etcd.
    Sighting(Sighting),
    Exited,
    /// From the attacker: one attack's result, a storm beginning or ending, or its end.
    Attack(AttackResult),
    Storm(StormNotice),
    AttackerExited,
}

/// The router's name for the attacker process in its event channel.
pub(super) const ATTACKER: &str = "attacker";

/// Sends `signal` (`STOP`, `CONT`) to process `pid`.
pub(super) fn signal(pid: u32, signal: &str) -> Result<()> {
    let status = Process::new("kill").arg(format!("-{signal}")).arg(pid.to_string()).status()?;
    if !status.success() {
        bail!("kill -{signal} {pid} failed: {status}");
    }
    Ok(())
}

impl Demo {
    /// Starts the attacker once no stop of P is ahead (a stopped P answers nobody, and the
    /// attacks measure how P answers): at once in a pull run, after P's stop in a push run.
    pub(super) fn attack_if_due(&mut self) -> Result<()> {
        let p_stop_ahead = self.pauses.iter().any(|p| p.engine == "prefill0")
            || self.paused.as_ref().is_some_and(|(p, ..)| p.engine == "prefill0");
        if self.config.attack.is_some() && !self.attacker_started && !p_stop_ahead {
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
            transport: self.config.transport,
            metrics_port: p.metrics.map(|addr| addr.port()),
            plan: self.config.attack.unwrap_or_default(),
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
                    Err(e) => match serde_json::from_str(&line) {
                        Ok(notice) => FromNode::Storm(notice),
                        Err(_) => {
                            FromNode::Event(Event::Error { message: format!("unreadable attacker line {line:?}: {e}") })
                        }
                    },
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

    /// Starts `kvflow-watch` on the run's etcd and waits until it watches.
    pub(super) fn start_watcher(&mut self) -> Result<()> {
        let settings = self.etcd_settings.clone().context("no etcd")?;
        let path = self.binary.path.with_file_name("kvflow-watch");
        let mut child = self
            .child(&path, serde_json::to_string(&settings)?)
            .stdin(Stdio::piped())
            .spawn()
            .with_context(|| format!("cannot start {}", path.display()))?;
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().expect("piped");
        let (sender, watching) = (self.sender.clone(), std::sync::mpsc::channel());
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let sighting = serde_json::from_str(&line)
                    .unwrap_or_else(|e| Sighting::Error { message: format!("unreadable line {line:?}: {e}") });
                if matches!(sighting, Sighting::Watching) {
                    let _ = watching.0.send(());
                }
                if sender.send((WATCHER.to_owned(), 0, FromNode::Sighting(sighting))).is_err() {
                    return;
                }
            }
        });
        self.watcher = Some(Watcher { child, stdin });
        watching
            .1
            .recv_timeout(Duration::from_secs(15))
            .map_err(|_| anyhow::anyhow!("{WATCHER} did not start watching etcd at {:?}", settings.endpoints))
    }

    /// A process of the run: its one argument, the provisioned environment and the cluster
    /// key, its stdout piped to the router.
    fn child(&self, path: &Path, arg: String) -> Process {
        let mut command = Process::new(path);
        command
            .arg(arg)
            .envs(self.binary.envs.iter().map(|(k, v)| (k, v)))
            .env(CLUSTER_KEY_ENV, &self.key)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        self.model_threads(&mut command);
        command
    }

    /// With a model, every process computes with one thread (candle's matmuls take theirs
    /// from `RAYON_NUM_THREADS`), the engines and the reference alike: the same thread count
    /// everywhere, and no engine's compute spread over the cores its peers' transfers need.
    fn model_threads(&self, command: &mut Process) {
        if self.config.engine_model.is_some() {
            command.env("RAYON_NUM_THREADS", "1");
        }
    }

    /// `kvflow-node --one-engine`: every request of `job` in one engine at TP 1, the reference.
    pub(super) fn one_engine(&self, job: &OneEngineJob) -> Result<Vec<OneEngineRun>> {
        let mut command = Process::new(&self.binary.path);
        command
            .arg("--one-engine")
            .envs(self.binary.envs.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        self.model_threads(&mut command);
        let mut child = command.spawn().with_context(|| format!("cannot start {}", self.binary.path.display()))?;
        let mut stdin = child.stdin.take().expect("piped");
        serde_json::to_writer(&mut stdin, job)?;
        drop(stdin);
        let stdout = child.stdout.take().expect("piped");
        let runs = BufReader::new(stdout)
            .lines()
            .map(|line| Ok(serde_json::from_str::<OneEngineRun>(&line?)?))
            .collect::<Result<Vec<_>>>();
        let status = child.wait()?;
        if !status.success() {
            bail!("kvflow-node --one-engine exited with {status}");
        }
        runs
    }

    /// The address engine `name` is reached at: its namespace's, or loopback.
    pub(super) fn host_ip(&self, name: &str) -> std::net::Ipv4Addr {
        let host = self.network.as_ref().and_then(|n| n.host(name));
        host.map_or(std::net::Ipv4Addr::LOCALHOST, |h| h.ip)
    }

    /// Starts engine `name`, incarnation `instance`; its lines come to the router's channel.
    /// With `--hosts netns` it runs in its namespace, its side channels on its address, and
    /// UCX over TCP on its veth alone.
    pub(super) fn spawn(&mut self, role: NodeRole, name: &str, instance: u64) -> Result<()> {
        let host = self.network.as_ref().and_then(|n| n.host(name)).cloned();
        let mut node_config = self.config.node(role, name, instance);
        node_config.host = host.as_ref().map(|h| h.ip);
        node_config.discovery = self.etcd_settings.clone();
        // Its metrics on its own address, on any free port: it says which in `Ready`.
        node_config.metrics_addr = Some((self.host_ip(name), 0).into());
        let config = serde_json::to_string(&node_config)?;
        let mut command = match &host {
            None => self.child(&self.binary.path, config),
            Some(host) => {
                let mut command = self.child(Path::new("ip"), "netns".into());
                command.args(["exec", &host.ns]).arg(&self.binary.path).arg(config);
                command.env("UCX_TLS", "tcp").env("UCX_NET_DEVICES", &host.device);
                command
            }
        };
        let mut child = command
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
        let node =
            Node { role, instance, child, stdin, port: None, ports: Vec::new(), metrics: None, connected: false };
        // A killed incarnation is reaped here, by now long dead (the router does not wait for
        // it when it kills it).
        if let Some(mut old) = self.nodes.insert(name.to_owned(), node) {
            let _ = old.child.kill();
            let _ = old.child.wait();
        }
        Ok(())
    }

    /// Sends `command` to engine `name`; an engine that cannot be reached is an error of the run.
    pub(super) fn send(&mut self, name: &str, command: &Command) {
        let Some(node) = self.nodes.get_mut(name) else { return };
        // What the router sends a host that died silently is lost, as on a network.
        if self.kill.as_ref().is_some_and(|k| k.silent && k.engine == name && k.instance == node.instance) {
            return;
        }
        if let Err(err) = write_line(&mut node.stdin, command) {
            // P told to die at its next write may be dead before the router sees it exit: what
            // it is sent meanwhile is lost with it, as `prefill_kill_progress` accounts for.
            let dying = matches!(&self.p_kill, Some(k) if name == "prefill0"
                && k.instance == node.instance && matches!(k.phase, PKillPhase::Dying(_)));
            if !dying {
                self.errors.push(format!("cannot reach {name}: {err}"));
            }
        }
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
            let fields = crate::procfs::stat(pid)?;
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

    /// Stops the attacker, resumes a stopped engine, and ends every engine: a shutdown command,
    /// then a kill after 5 s.
    pub(super) fn shutdown(&mut self) {
        // Engines withdraw their registrations as they stop: that is no loss to report.
        self.watcher = None;
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
