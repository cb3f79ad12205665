//! The demo's router: the [`Demo`] run that issues the workload to the engines, hands P's
//! exports to D engines, aborts and rejects, kills, stops and restarts engines on schedule,
//! handles every event the engines report, and drains at the end.
//!
//! Fields are visible to the sibling modules: `processes` starts and stops what the router
//! drives, and `report` reads what it saw.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::process::Child;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use kv_core::{EngineId, PeerAddress, RequestId};
use kv_sched_adapter::{PrefillEngine, RemoteRef};
use kv_testkit::Rng;
use serde_json::{json, Value};

use super::config::{DemoConfig, DiscoveryKind, Hosts, Pause, ROUTER};
use super::metrics::{promtool_check, Scrape};
use super::model::ModelRequest;
use super::processes::{signal, FromNode, Node, NodeBinary, ATTACKER};
use super::report::Report;
use crate::proto::{wall_ns, AttackResult, Command, EtcdSettings, Event, NodeRole, Sighting};

mod faults;
mod hearing;
mod soak;
mod track;

pub(super) use soak::{Soak, SoakSample};
pub(super) use track::{Partial, Track};

/// How long a silently dying D engine lives on, cut off, before it is killed: long enough
/// that whatever it sends goes nowhere, short of its own lease noticing.
const SILENT_KILL_AFTER: Duration = Duration::from_millis(300);

/// How long past the time limit (and the engines' stops and three leases) a run still waits for
/// its attacker to finish, traffic going on meanwhile.
const ATTACKER_OVERRUN: Duration = Duration::from_secs(60);

/// What the router decided for a request.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Fate {
    Normal,
    Reject,
    /// Abort on D this long after it arrives.
    Abort(Duration),
}

/// A request of the workload and what the router decided for it.
struct Request {
    id: String,
    prompt_tokens: u64,
    n: u32,
    fate: Fate,
    /// A partial prefix hit: the draw that picks how many of its D blocks D's own
    /// cache holds, once the D engine (and so its block size) is known.
    partial: Option<u64>,
    /// With a model: the prompt's token ids, and the request of the workload this one
    /// stands for (itself, or the one it sends again after a loss).
    prompt_ids: Option<Vec<u32>>,
    original: String,
}

/// A run: the engines and the router's view of the requests.
pub struct Demo {
    pub(super) config: DemoConfig,
    pub(super) binary: NodeBinary,
    /// The cluster key every engine of this run holds, as 64 hex digits.
    pub(super) key: String,
    /// With `--hosts netns`, each engine's namespace; removed when the run ends.
    pub(super) network: Option<super::netns::Network>,
    /// With `--discovery etcd`: the run's etcd server (held for its drop, which stops it once
    /// the run is over), the settings the engines get, and the router's own watch
    /// (`kvflow-watch`).
    _etcd: Option<super::etcd::EtcdServer>,
    pub(super) etcd_settings: Option<EtcdSettings>,
    pub(super) watcher: Option<super::processes::Watcher>,
    /// What the watch saw published: engine, by name, to its incarnation and addresses.
    registry: BTreeMap<String, (u64, Vec<String>)>,
    /// Registrations the watch saw go: engine, incarnation, when (ns).
    pub(super) lapses: Vec<(String, u64, u64)>,
    pub(super) nodes: BTreeMap<String, Node>,
    pub(super) events: Receiver<(String, u64, FromNode)>,
    pub(super) sender: Sender<(String, u64, FromNode)>,
    /// Requests not sent yet.
    queue: VecDeque<Request>,
    /// The workload's draws, and the next request's number: under attack the workload goes on
    /// until the attacker is done, so that each storm has traffic to measure.
    rng: Rng,
    next_request: u32,
    /// Prompts a busy P sent back, to send again from this time.
    retries: VecDeque<(Instant, String)>,
    /// With a model: requests lost, to send again from this time.
    resends: VecDeque<(Instant, Request)>,
    /// Exports that found no live D engine, to hand over when one is up.
    undelivered: VecDeque<(String, String, RemoteRef, Fate)>,
    /// Requests sent, by id, with their exports.
    open: HashMap<String, (Request, Vec<String>)>,
    pub(super) tracks: BTreeMap<String, Track>,
    /// With a model: each request of the workload, by id, with the ids it was sent as.
    pub(super) model_requests: BTreeMap<String, ModelRequest>,
    aborts: Vec<(Instant, String)>,
    next_decode: usize,
    /// When the router last asked D engines not yet connected to P how far they are.
    cold_polled: Instant,
    cold_polls: u64,
    pub(super) issued: u32,
    /// When the last request went out.
    last_issued: Instant,
    completed: u32,
    pub(super) kill: Option<Kill>,
    /// P killed with SIGKILL (`--kill-prefill`).
    pub(super) p_kill: Option<PKill>,
    /// A soak's earlier kills, of D and of P (the last of each is `kill` and `p_kill`).
    pub(super) past_kills: Vec<Kill>,
    pub(super) past_p_kills: Vec<PKill>,
    pub(super) soak: Option<Soak>,
    /// Stops still to make, the one in progress (its process and when it ends), and those made.
    pub(super) pauses: VecDeque<Pause>,
    pub(super) paused: Option<(Pause, u32, Instant, u64)>,
    /// Stops made, with when each began and ended (wall clock, ns).
    pub(super) paused_done: Vec<(Pause, u64, u64)>,
    /// The attacker process while it runs, and what it reported.
    pub(super) attacker: Option<Child>,
    pub(super) attacker_started: bool,
    pub(super) attacks: Vec<AttackResult>,
    /// The storm the attacker says is raging: the router stops and kills no engine meanwhile.
    pub(super) storm: Option<String>,
    pub(super) transfers: Vec<(u64, u64, bool)>,
    /// When each request's KV was ready at D (wall clock, ns), and when each transfer's end was
    /// heard and whether it failed: a storm's availability against its quiet window.
    pub(super) ready_at: Vec<u64>,
    pub(super) transfer_at: Vec<(u64, bool)>,
    /// Each engine incarnation's metrics, scraped at the end or just before its kill.
    pub(super) scrapes: Vec<Scrape>,
    /// Incarnations that could not be scraped when they were due, and why.
    pub(super) unscraped: Vec<String>,
    pub(super) errors: Vec<String>,
    started: Instant,
    pub(super) progress: indicatif::ProgressBar,
}

/// `--kill-prefill`: the P incarnation killed, and how far its death and restart are.
pub(super) struct PKill {
    pub(super) instance: u64,
    /// When it died (wall clock, ns; 0 while it is dying).
    pub(super) at_ns: u64,
    pub(super) phase: PKillPhase,
    /// It died right after posting a push write (else it posted none within the wait, and
    /// was killed outright).
    pub(super) mid_write: bool,
}

/// How far a P kill is.
pub(super) enum PKillPhase {
    /// Told to die at its next write, since then.
    Dying(Instant),
    /// Dead; restarts at that time.
    Down(Instant),
    /// A new incarnation runs.
    Back,
}

/// The D engine killed part-way.
pub(super) struct Kill {
    pub(super) engine: String,
    pub(super) instance: u64,
    pub(super) at_ns: u64,
    restart_at: Option<Instant>,
    /// Died silently: its network was cut (at `at_ns`) before it was killed; not restarted.
    pub(super) silent: bool,
}

impl Demo {
    /// Starts the engines and waits until they listen.
    pub fn start(config: DemoConfig, binary: NodeBinary) -> Result<Demo> {
        let (sender, events) = mpsc::channel();
        let mut rng = Rng::new(config.seed);
        let queue = (0..config.requests).map(|i| workload(&config, &mut rng, i)).collect();
        let next_request = config.requests;
        let progress = indicatif::ProgressBar::new(u64::from(config.requests));
        progress.set_style(
            indicatif::ProgressStyle::with_template("{spinner} {elapsed:>3} [{bar:40}] {pos}/{len} requests {msg}")
                .expect("template")
                .progress_chars("=> "),
        );
        let mut key = [0u8; 32];
        getrandom::fill(&mut key).map_err(|e| anyhow!("no randomness for the cluster key: {e}"))?;
        let pauses = config.pauses();
        let network = match config.hosts {
            Hosts::Loopback => None,
            Hosts::Netns => {
                let engines: Vec<String> = std::iter::once("prefill0".to_owned())
                    .chain((0..config.decoders).map(|i| format!("decode{i}")))
                    .collect();
                Some(super::netns::Network::create(&engines).context("the engines' network namespaces")?)
            }
        };
        let etcd = match config.discovery {
            DiscoveryKind::Static => None,
            DiscoveryKind::Etcd => {
                let ip = network.as_ref().map_or(std::net::Ipv4Addr::LOCALHOST, |n| n.gateway());
                Some(super::etcd::EtcdServer::start(ip).context("the run's etcd")?)
            }
        };
        let etcd_settings = etcd.as_ref().map(|server| EtcdSettings {
            endpoints: vec![server.endpoint.clone()],
            prefix: format!("/kvflow-demo-{}", std::process::id()),
            ttl_s: config.etcd_ttl_s,
        });
        let mut demo = Demo {
            config,
            binary,
            key: key.iter().map(|b| format!("{b:02x}")).collect(),
            network,
            _etcd: etcd,
            etcd_settings,
            watcher: None,
            registry: BTreeMap::new(),
            lapses: Vec::new(),
            nodes: BTreeMap::new(),
            events,
            sender,
            queue,
            rng,
            next_request,
            retries: VecDeque::new(),
            resends: VecDeque::new(),
            undelivered: VecDeque::new(),
            open: HashMap::new(),
            tracks: BTreeMap::new(),
            model_requests: BTreeMap::new(),
            aborts: Vec::new(),
            next_decode: 0,
            cold_polled: Instant::now(),
            cold_polls: 0,
            issued: 0,
            last_issued: Instant::now(),
            completed: 0,
            kill: None,
            p_kill: None,
            past_kills: Vec::new(),
            past_p_kills: Vec::new(),
            soak: None,
            pauses,
            paused: None,
            paused_done: Vec::new(),
            attacker: None,
            attacker_started: false,
            attacks: Vec::new(),
            storm: None,
            transfers: Vec::new(),
            ready_at: Vec::new(),
            transfer_at: Vec::new(),
            scrapes: Vec::new(),
            unscraped: Vec::new(),
            errors: Vec::new(),
            started: Instant::now(),
            progress,
        };
        if demo.etcd_settings.is_some() {
            demo.start_watcher()?;
        }
        demo.spawn(NodeRole::Prefill, "prefill0", 1)?;
        for i in 0..demo.config.decoders {
            demo.spawn(NodeRole::Decode, &format!("decode{i}"), 1)?;
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        while demo.nodes.values().any(|n| n.port.is_none()) || !demo.all_published() {
            demo.pump(Duration::from_millis(50))?;
            if Instant::now() > deadline {
                bail!(
                    "the engines did not start (and publish themselves) within 60 s: {}; published: {:?}",
                    demo.errors.join("; "),
                    demo.registry
                );
            }
            if !demo.errors.is_empty() {
                bail!("the engines did not start: {}", demo.errors.join("; "));
            }
        }
        demo.check_published()?;
        demo.await_connections()?;
        demo.started = Instant::now();
        demo.soak = demo.config.soak.map(|plan| Soak::new(plan, demo.started));
        Ok(demo)
    }

    /// Whether the router's watch has seen every engine published as the incarnation it runs
    /// (always, without etcd).
    fn all_published(&self) -> bool {
        self.etcd_settings.is_none()
            || self.nodes.iter().all(|(name, n)| self.registry.get(name).is_some_and(|(i, _)| *i == n.instance))
    }

    /// Every engine published the addresses its ranks listen at.
    fn check_published(&self) -> Result<()> {
        if self.etcd_settings.is_none() {
            return Ok(());
        }
        for (name, node) in &self.nodes {
            let ip = self.host_ip(name);
            let listening: Vec<String> = node.ports.iter().map(|port| format!("{ip}:{port}")).collect();
            let published = self.registry.get(name).map(|(_, a)| a);
            if published != Some(&listening) {
                bail!("{name} published {published:?} in etcd, but its ranks listen at {listening:?}");
            }
        }
        Ok(())
    }

    /// P as D reaches it: its ranks' side-channel addresses, by rank.
    fn prefill_engine(&self) -> PrefillEngine {
        let ip = self.host_ip("prefill0");
        let addresses: Vec<PeerAddress> =
            self.nodes["prefill0"].ports.iter().map(|port| PeerAddress(format!("{ip}:{port}"))).collect();
        PrefillEngine { engine: EngineId::new("prefill0"), tp_size: addresses.len() as u32, addresses, pp_size: 1 }
    }

    /// Waits until every rank of every D engine has connected to P ahead of traffic, as a
    /// router sends an engine requests once it is ready: otherwise the run's first requests
    /// measure the handshake and the UCX endpoint's wire-up rather than the path.
    fn await_connections(&mut self) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let waiting: Vec<String> = self.cold_decoders();
            if waiting.is_empty() {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("D engines {waiting:?} did not connect to P within 10 s of starting");
            }
            self.poll_cold(Instant::now());
            self.pump(Duration::from_millis(10))?;
        }
    }

    /// D engines up whose ranks have not all connected to P yet.
    fn cold_decoders(&self) -> Vec<String> {
        self.nodes
            .iter()
            .filter(|(_, n)| n.role == NodeRole::Decode && n.port.is_some() && !n.connected)
            .map(|(name, _)| name.clone())
            .collect()
    }

    /// Asks the D engines not yet connected to P how far they are, every 10 ms (their
    /// `Stats` answer marks them connected), and every 100 ms asks them to connect again: a
    /// refused handshake is not retried by itself.
    fn poll_cold(&mut self, now: Instant) {
        if now < self.cold_polled + Duration::from_millis(10) {
            return;
        }
        self.cold_polled = now;
        self.cold_polls += 1;
        // While P is down (killed, not back yet) there is nothing to connect to.
        let p_up = self.nodes.get("prefill0").is_some_and(|p| p.port.is_some());
        for name in self.cold_decoders() {
            if p_up && self.cold_polls.is_multiple_of(10) {
                self.connect_ahead(&name);
            }
            self.send(&name, &Command::Stats);
        }
    }

    /// Tells D engine `decode` to connect to P now.
    fn connect_ahead(&mut self, decode: &str) {
        let command = Command::Connect { prefill: self.prefill_engine() };
        self.send(decode, &command);
    }

    /// The next live D engine, round robin: of those connected to P, if any is.
    fn pick_decode(&mut self) -> Option<String> {
        let up = |n: &super::processes::Node| n.role == NodeRole::Decode && n.port.is_some();
        let warm = self.nodes.values().any(|n| up(n) && n.connected);
        let live: Vec<String> =
            self.nodes.iter().filter(|(_, n)| up(n) && (n.connected || !warm)).map(|(name, _)| name.clone()).collect();
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
        while self.completed < self.next_request
            || self.restarting()
            || self.paused.is_some()
            || self.attacker.is_some()
            || (self.config.attack.is_some() && !self.attacker_started)
            || self.soaking(Instant::now())
        {
            let now = Instant::now();
            self.soak_step(now)?;
            if self.config.kill && self.kill.is_none() && self.issued >= kill_after && self.storm.is_none() {
                self.kill_decode()?;
            }
            if self.config.kill_prefill && self.p_kill.is_none() && self.issued >= self.config.requests / 2 {
                self.kill_prefill();
            }
            self.prefill_kill_progress()?;
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
            self.poll_cold(now);
            self.pump(Duration::from_millis(2))?;
            let stopped: Duration = self.paused_done.iter().map(|(p, _, _)| p.length).sum();
            // Requests end within three leases of the last one sent (past the limit, an attacker
            // still running keeps traffic going: its attacks take longer on a loaded machine).
            let leases = Duration::from_millis(self.config.lease_ms * 3);
            let settled_by = limit.max(self.last_issued) + stopped + leases;
            if now > settled_by && self.completed < self.next_request {
                self.errors.push(format!("{} requests never finished", self.next_request - self.completed));
                break;
            }
            if now > limit + stopped + leases + ATTACKER_OVERRUN {
                self.errors.push(format!(
                    "the run did not end {} s past its time limit: attacker running {}, an engine restarting {}, \
                     one stopped {}, {} requests open",
                    (stopped + leases + ATTACKER_OVERRUN).as_secs(),
                    self.attacker.is_some(),
                    self.restarting(),
                    self.paused.is_some(),
                    self.next_request - self.completed
                ));
                break;
            }
        }
        self.progress.finish_and_clear();
        let elapsed = self.started.elapsed();
        let drain = self.drain()?;
        // A soak's last sample: every engine after the drain.
        self.soak_sample(Instant::now());
        self.scrape_live();
        self.shutdown();
        let promtool = promtool_check(&self.scrapes);
        // With a model, the reference: every request in one engine, with the engines stopped.
        let model = self.config.node_model().map(|model| self.model_report(model));
        Ok(Report::new(&self, elapsed, drain, promtool, model))
    }

    /// Sends prompts P sent back, then new requests while fewer than `concurrency` are open.
    fn issue(&mut self, now: Instant) {
        while self.resends.front().is_some_and(|(at, _)| *at <= now) {
            let (_, request) = self.resends.pop_front().expect("front");
            self.queue.push_front(request);
        }
        while self.retries.front().is_some_and(|(at, _)| *at <= now) {
            let (_, id) = self.retries.pop_front().expect("front");
            if let Some((r, exports)) = self.open.get(&id) {
                // The same consumer as the first time: P binds the exports to it again.
                let consumer = self.tracks.get(&exports[0]).and_then(|t| t.decode.clone());
                let command = Command::Prefill {
                    id: id.clone(),
                    prompt_tokens: r.prompt_tokens,
                    n: r.n,
                    consumer,
                    prompt_ids: r.prompt_ids.clone(),
                };
                self.send("prefill0", &command);
            }
        }
        for _ in 0..self.undelivered.len() {
            let (export, parent, remote, fate) = self.undelivered.pop_front().expect("counted");
            self.dispatch(&export, &parent, remote, fate);
        }
        if self.nodes.get("prefill0").is_none_or(|p| p.port.is_none()) {
            // P is down (killed, not back yet): nothing goes to it.
            return;
        }
        while self.open.len() < self.config.concurrency as usize {
            if let Some(rate) = self.config.rate {
                // Open loop: the i-th request arrives i / rate seconds after traffic began.
                let due = self.started + Duration::from_secs_f64(f64::from(self.issued) / rate);
                if now < due {
                    return;
                }
            }
            if self.queue.is_empty() && (self.attacker.is_some() || self.soaking(now)) {
                // Under attack, traffic goes on until the attacker is done; in a soak, until
                // its time is up.
                let i = self.next_request;
                self.next_request += 1;
                self.queue.push_back(workload(&self.config, &mut self.rng, i));
                self.progress.inc_length(1);
            }
            let Some(request) = self.queue.pop_front() else { return };
            self.issued += 1;
            self.last_issued = now;
            let (id, tokens, n) = (request.id.clone(), request.prompt_tokens, request.n);
            let prompt_ids = request.prompt_ids.clone();
            if let Some(ids) = &prompt_ids {
                let entry = self.model_requests.entry(request.original.clone());
                entry.or_insert_with(|| ModelRequest::new(ids.clone())).sent_as.push(id.clone());
            }
            let exports: Vec<String> =
                if n > 1 { (0..n).map(|i| format!("{i}_{id}")).collect() } else { vec![id.clone()] };
            let submitted = wall_ns();
            for export in &exports {
                let track = self.tracks.entry(export.clone()).or_default();
                track.parent = id.clone();
                track.submitted_at_ns = Some(submitted);
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
            let fate = request.fate;
            // Open before D hears of it: dispatch reads the request's partial-hit draw there.
            self.open.insert(id.clone(), (request, exports.clone()));
            if self.config.push {
                // D hears first: it allocates and registers its blocks with P.
                let prefill = self.prefill_engine();
                let remote = |export: &String| RemoteRef {
                    prefill: prefill.clone(),
                    request: RequestId::new(export.clone()),
                    instance: None,
                    prompt_tokens: tokens,
                    prompt_digest: None,
                    export: None,
                    consumer: None,
                };
                self.dispatch(&exports[0], &id, remote(&exports[0]), fate);
                if fate == Fate::Reject {
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
            self.send("prefill0", &Command::Prefill { id, prompt_tokens: tokens, n, consumer, prompt_ids });
        }
    }

    /// Hands an export to a D engine: the one named at prefill, else the next live one;
    /// arrival, or rejection before admission.
    fn dispatch(&mut self, export: &str, parent: &str, remote: RemoteRef, fate: Fate) {
        let named = self.tracks.get(export).and_then(|t| t.decode.clone());
        let up = |n: &super::processes::Node, instance| n.instance == instance && n.port.is_some();
        let decode = match named {
            Some((decode, instance)) if self.nodes.get(&decode).is_some_and(|n| up(n, instance)) => decode,
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
        let partial = self.partial_hit(parent, &decode, remote.prompt_tokens);
        let track = self.tracks.entry(export.to_owned()).or_default();
        track.parent = parent.to_owned();
        track.decode = Some((decode.clone(), instance));
        track.partial = partial;
        let command = match fate {
            Fate::Reject => Command::Reject { id: export.to_owned(), remote },
            _ => {
                let cached_tokens = partial.map_or(0, |p| p.cached as u64 * u64::from(p.block_tokens));
                let prompt_ids = self.open.get(parent).and_then(|(r, _)| r.prompt_ids.clone());
                let first_token = track.first.map(|c| c.token);
                Command::Arrive { id: export.to_owned(), remote, cached_tokens, prompt_ids, first_token }
            }
        };
        self.send(&decode, &command);
        if let Fate::Abort(after) = fate {
            self.aborts.push((Instant::now() + after, export.to_owned()));
        }
    }

    /// How much of request `parent`'s prompt of `prompt_tokens` D engine `decode`'s own prefix
    /// cache holds, if the workload made it a partial prefix hit: at least one of its D blocks,
    /// not all. `None` for a prompt of one D block.
    fn partial_hit(&self, parent: &str, decode: &str, prompt_tokens: u64) -> Option<Partial> {
        let draw = self.open.get(parent).and_then(|(r, _)| r.partial)?;
        let (block_tokens, block_bytes) = self.config.decode_block(decode);
        let blocks = kv_core::blocks_for_tokens(prompt_tokens, block_tokens) as usize;
        let cached = 1 + (draw % blocks.checked_sub(1).filter(|&n| n > 0)? as u64) as usize;
        Some(Partial { blocks, cached, block_tokens, block_bytes })
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

    /// Handles what the engines said, waiting up to `wait` for the first of it.
    pub(super) fn pump(&mut self, wait: Duration) -> Result<()> {
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

    fn finish_export(&mut self, export: &str, outcome: &str, ready_at_ns: Option<u64>) {
        let Some(track) = self.tracks.get_mut(export) else { return };
        track.outcome = Some(outcome.to_owned());
        track.ready_at_ns = ready_at_ns;
        let parent = track.parent.clone();
        let Some((_, exports)) = self.open.get(&parent) else { return };
        if exports.iter().all(|e| self.tracks.get(e).is_some_and(|t| t.outcome.is_some())) {
            let (request, _) = self.open.remove(&parent).expect("open");
            self.completed += 1;
            self.progress.inc(1);
            if outcome != "ok" {
                self.send_again(request);
            }
        }
    }

    /// Waits until P's pool is empty or the lease has run out twice over, then collects every
    /// engine's pool checks (held blocks, blocks written after free).
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
                FromNode::Event(Event::Stats { held_blocks, written_after_free, writes_ahead, .. })
                    if live.contains(&(name.clone(), instance)) =>
                {
                    let counts = json!({
                        "held_blocks": held_blocks,
                        "written_after_free": written_after_free,
                        "writes_ahead": writes_ahead,
                    });
                    stats.insert(name, counts);
                }
                other => self.on_event(&name, instance, other),
            }
        }
        Ok(stats)
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
    let d_blocks = kv_core::blocks_for_tokens(prompt_tokens, config.d_block_tokens);
    let eligible = n == 1 && fate != Fate::Reject && d_blocks >= 2;
    let partial = (eligible && rng.chance(config.partial_rate)).then(|| rng.below(1 << 30));
    // tiny-llama's vocabulary: any of its 4096 tokens.
    let prompt_ids = config.engine_model.as_ref().map(|_| (0..prompt_tokens).map(|_| rng.below(4096) as u32).collect());
    let id = format!("req-{i}");
    Request { original: id.clone(), id, prompt_tokens, n, fate, partial, prompt_ids }
}
