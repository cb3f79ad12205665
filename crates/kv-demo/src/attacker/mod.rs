//! `kvflow-attack`: a process that attacks a running P engine of `cargo xtask attack`, as a
//! local process on the same machine would, one attack after another, and says for each what
//! it tried and what held.
//!
//! For each attack it measures, while the attack is under way, how long a legitimate D (a key
//! holder, named `probe-N`) takes to handshake with P, and how much P's resident memory grew;
//! P must stay alive throughout. What the attack targets must hold too: bad bytes end in an
//! ERROR frame and a closed connection, a peer without the key never handshakes, a second
//! handshake under a live name is refused, and foreign messages change nothing (the router's
//! own checks, corrupt reads and releases credited to live engines, say so at the end).
//!
//! One JSON [`AttackResult`] per line on stdout (and a [`crate::proto::StormNotice`] as each
//! storm begins and ends); the router reads them. Which attacks a run makes is its
//! [`AttackPlan`]: `storms` ([`storms`]: a churn storm, a data-port flood, a sniffer ([`sniff`])
//! and idle metrics connections, each with the demo's availability measured), the others
//! bad bytes, impersonation, foreign messages and the key holders' floods ([`floods`]).

mod floods;
mod heartbeats;
mod hog;
mod sniff;
mod storms;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context, Result};
use clap::Parser;
use kv_core::agent::AgentTable;
use kv_core::side::{ClusterKey, ConnId, SideConfig, SideEndpoint, SideEvent};
use kv_core::{
    AgentName, DescriptorPair, EngineId, Handshake, Message, PeerAddress, PeerEvent, PeerInfo, RequestId, Role, Time,
    TransferOp, TransferRequest, TransferStatus, Transport,
};
use kv_transport_nixl::{KeySource, NixlConfig, NixlTransport};

use crate::e2e::ProcessClock;
use crate::proto::{from_json, AttackConfig, AttackPlan, AttackResult, Probes, TransportKind, CLUSTER_KEY_ENV};

/// `kvflow-attack`'s argument.
#[derive(Parser, Debug)]
#[command(name = "kvflow-attack", about = "Attacks the P engine of `cargo xtask attack` and reports what held")]
struct Args {
    /// What to attack, `kv_demo::proto::AttackConfig` as JSON.
    #[arg(value_name = "CONFIG", value_parser = from_json::<AttackConfig>)]
    config: AttackConfig,
}

/// The attacker process's entry point.
pub fn main() -> std::process::ExitCode {
    let Args { config } = Args::parse();
    crate::logging::init();
    match run(config) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("kvflow-attack: {err:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

struct Attacker {
    config: AttackConfig,
    clock: Arc<ProcessClock>,
    probes: u32,
    /// P's TCP data listener, once learned.
    data: Option<std::net::SocketAddr>,
}

fn run(config: AttackConfig) -> Result<()> {
    kv_transport_nixl::runtime::prepare(None).context("the NIXL runtime")?;
    let plan = config.plan;
    let mut a = Attacker { config, clock: Arc::new(ProcessClock::start()), probes: 0, data: None };
    match plan {
        AttackPlan::Storms => return storms(&mut a),
        AttackPlan::ContendedFlood { returns } => {
            return a.report("heartbeat-flood-contended", |a| a.heartbeat_flood(true, returns))
        }
        AttackPlan::Messages | AttackPlan::MessagesShort => {}
    }
    // Foreign messages first, while the router's requests are in flight.
    a.report("foreign-messages", Attacker::foreign_messages)?;
    a.report("notifications-under-another-name", Attacker::forged_sender_name)?;
    a.report("impersonate-without-key", Attacker::impersonate_without_key)?;
    a.report("impersonate-live-incarnation", Attacker::impersonate_live_incarnation)?;
    a.report("random-bytes", |a| a.raw_flood(200, |i| random_bytes(i, 1024)))?;
    a.report("huge-length-prefix", |a| {
        a.raw_flood(200, |i| {
            let mut bytes = u32::MAX.to_be_bytes().to_vec();
            bytes.extend(random_bytes(i, 512));
            bytes
        })
    })?;
    a.report("wrong-protocol-version", Attacker::wrong_version)?;
    a.report("slowloris", Attacker::slowloris)?;
    a.report("idle-beyond-the-bound", Attacker::idle_flood)?;
    a.report("oversized-offer", Attacker::oversized_offer)?;
    if a.config.metrics_port.is_some() {
        a.report("metrics-idle-connections", Attacker::metrics_idle)?;
    }
    if plan == AttackPlan::Messages {
        a.report("heartbeat-flood", |a| a.heartbeat_flood(false, false))?;
    }
    Ok(())
}

/// The storms, over the TCP transport: the sniffer records throughout, and replays last.
fn storms(a: &mut Attacker) -> Result<()> {
    if a.config.transport != TransportKind::Tcp {
        anyhow::bail!(
            "the storms attack the TCP transport's data path; this run moves KV over {:?}",
            a.config.transport
        );
    }
    // The sniffer watches P's data port (a scout key holder reads it from P's handshake; an
    // eavesdropper without the key would see it in the traffic).
    let data = a.data_address()?;
    let sniffer = sniff::Sniffer::start(data.port());
    // A live key holder whose data link the sniffer sees from its first byte (the engines'
    // own links open before the attacker starts; a restarted D's may fall in a storm).
    let witness = a.witness()?;
    a.report("churn-storm", Attacker::churn_storm)?;
    a.report("data-port-flood", Attacker::data_port_flood)?;
    a.report("sniff-and-impersonate", move |a| a.sniff_and_impersonate(sniffer, data))?;
    a.report("key-holder-under-another-name-on-the-data-path", move |a| a.impersonate_on_data_path(data))?;
    drop(witness);
    if a.config.metrics_port.is_some() {
        a.report("metrics-idle-connections", Attacker::metrics_idle)?;
    }
    Ok(())
}

/// The TCP transport's agent metadata for a peer with no data path: a data address where
/// nothing listens (127.0.0.1:9), no registered regions.
fn tcp_stub_metadata() -> Vec<u8> {
    let table = AgentTable { data: Some(([127, 0, 0, 1], 9).into()), ..AgentTable::new("tcp") };
    table.encode(&[]).expect("a table of no registrations fits a handshake")
}

/// Deterministic junk for connection `i`.
fn random_bytes(i: usize, len: usize) -> Vec<u8> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ (i as u64).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A HELLO frame (docs/side-channel.md) for `engine`, with `version`, asking for whichever
/// rank listens (P's own port).
fn hello(engine: &str, version: u16) -> Vec<u8> {
    let mut body = b"KVSC".to_vec();
    body.extend_from_slice(&version.to_be_bytes());
    body.extend_from_slice(&kv_core::side::ANY_RANK.to_be_bytes());
    body.push(1);
    body.push(engine.len() as u8);
    body.extend_from_slice(engine.as_bytes());
    body.extend_from_slice(&0u32.to_be_bytes());
    body.extend_from_slice(&1u64.to_be_bytes());
    body.extend_from_slice(&[7u8; 32]);
    let mut frame = ((body.len() + 1) as u32).to_be_bytes().to_vec();
    frame.push(1);
    frame.extend(body);
    frame
}

/// Reads what the listener sends until it closes, up to `deadline` (one deadline for a whole
/// flood, so that a listener that closes nothing costs seconds, not minutes); whether it
/// closed, and the text of an ERROR frame if the first frame is one.
fn until_closed(stream: &mut TcpStream, deadline: Instant) -> (bool, Option<String>) {
    let _ = stream.set_read_timeout(Some(Duration::from_millis(20)));
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    // At least one read, however late: what a closed socket holds is there already.
    let closed = loop {
        match stream.read(&mut buf) {
            Ok(0) => break true,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
            // A reset is a close too.
            Err(_) => break true,
        }
        if Instant::now() >= deadline {
            break false;
        }
    };
    let error = (got.len() > 5 && got[4] == 5).then(|| String::from_utf8_lossy(&got[5..]).into_owned());
    (closed, error)
}

impl Attacker {
    fn p_address(&self) -> PeerAddress {
        PeerAddress(format!("127.0.0.1:{}", self.config.p_port))
    }

    /// A handshake offer of a D engine that P accepts (no memory: none is needed to talk).
    fn offer(&self, engine: &str, instance: u64) -> Handshake {
        let agent = AgentName::new(EngineId::new(engine), 0);
        let model = crate::node::MODEL;
        Handshake {
            num_blocks: 1,
            ..Handshake::new(&agent, 1, instance, Role::Decode, model, self.config.model.layout())
        }
    }

    fn transport(&self, engine: &str, instance: u64, key: KeySource) -> Result<NixlTransport> {
        let config = NixlConfig { bind: "127.0.0.1:0".parse().expect("loopback"), key, ..NixlConfig::default() };
        NixlTransport::new(self.offer(engine, instance), &config, self.clock.clone())
            .with_context(|| format!("a transport for {engine}"))
    }

    /// Connects `t` to P and waits up to `limit` for the outcome.
    fn handshake(t: &mut NixlTransport, address: &PeerAddress, limit: Duration) -> Result<Box<PeerInfo>, String> {
        t.connect(address).map_err(|e| e.to_string())?;
        connected(t, limit)
    }

    /// How long a fresh key holder's side-channel handshake with P takes now, in milliseconds:
    /// from its TCP connect to its `Connected`, all four flights, driven by kv-core's
    /// [`SideEndpoint`] over a plain socket. (A full NIXL peer then spends about 30 ms more
    /// loading P's metadata into UCX, on its own side.)
    fn probe(&mut self) -> Option<f64> {
        self.timed_probe(Duration::from_secs(5)).ok()
    }

    /// As [`Attacker::probe`], given up after `limit`; the error says why it failed.
    fn timed_probe(&mut self, limit: Duration) -> Result<f64, String> {
        self.probes += 1;
        let hex = std::env::var(CLUSTER_KEY_ENV).map_err(|_| "no cluster key".to_owned())?;
        let key = ClusterKey::from_hex(&hex).map_err(|e| e.to_string())?;
        let mut offer = self.offer(&format!("probe-{}", self.probes), 1);
        if self.config.transport == TransportKind::Tcp {
            // So that P's transport takes the probe as a peer rather than dropping it.
            offer.agent_metadata = tcp_stub_metadata();
        }
        let mut side = SideEndpoint::new(SideConfig::new(key), offer).map_err(|e| e.to_string())?;
        let mut nonce = [0u8; 32];
        getrandom::fill(&mut nonce).map_err(|e| e.to_string())?;
        let start = Instant::now();
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], self.config.p_port));
        let mut stream = TcpStream::connect_timeout(&addr, limit).map_err(|e| format!("connect: {e}"))?;
        let _ = stream.set_nodelay(true);
        let now = |start: Instant| Time::from_nanos(start.elapsed().as_nanos() as u64);
        side.handle_connect(now(start), ConnId(1), self.p_address(), nonce);
        let mut buf = [0u8; 64 * 1024];
        loop {
            while let Some(t) = side.poll_transmit() {
                stream.write_all(&t.bytes).map_err(|e| format!("write: {e}"))?;
            }
            match side.poll_event() {
                Some(SideEvent::Connected { .. }) => return Ok(start.elapsed().as_secs_f64() * 1e3),
                Some(other) => return Err(format!("{other:?}")),
                None => {}
            }
            if side.poll_close().is_some() {
                return Err("closed".into());
            }
            let left = limit.saturating_sub(start.elapsed());
            if left.is_zero() {
                return Err(format!("no handshake within {limit:?}"));
            }
            let _ = stream.set_read_timeout(Some(left));
            let n = stream.read(&mut buf).map_err(|e| format!("read: {e}"))?;
            if n == 0 {
                return Err("P closed the connection".into());
            }
            side.handle_bytes(now(start), ConnId(1), &buf[..n]);
        }
    }

    fn rss_mib(&self) -> f64 {
        rss_mib_of(self.config.p_pid)
    }

    fn p_alive(&self) -> bool {
        crate::procfs::stat(self.config.p_pid).is_some_and(|fields| fields.first().is_some_and(|s| s != "Z"))
    }

    /// Runs `attack`, which returns (tried, held, detail) and calls [`Attacker::measure`] at its
    /// peak; prints the result.
    fn report(&mut self, name: &str, attack: impl FnOnce(&mut Self) -> Result<Outcome>) -> Result<()> {
        let before = self.rss_mib();
        let outcome = attack(self)?;
        let result = AttackResult {
            attack: name.to_owned(),
            tried: outcome.tried,
            held: outcome.held,
            detail: outcome.detail,
            probe_ms: outcome.probe_ms,
            rss_growth_mib: (outcome.peak_rss - before).max(0.0),
            p_alive: self.p_alive(),
            probes: outcome.probes,
            window_ns: outcome.window_ns,
            quiet_ns: outcome.quiet_ns,
        };
        println!("{}", serde_json::to_string(&result)?);
        Ok(())
    }

    /// The probe and P's memory, at an attack's peak.
    fn measure(&mut self) -> (Option<f64>, f64) {
        let probe = self.probe();
        (probe, self.rss_mib())
    }

    /// A key holder that handshook as `intruder` sends aborts, completions, heartbeats and
    /// rejections for every request id the router uses, for 3 s.
    fn foreign_messages(&mut self) -> Result<Outcome> {
        let mut t = self.transport("intruder", 1, KeySource::Env(CLUSTER_KEY_ENV.into()))?;
        let p = Self::handshake(&mut t, &self.p_address(), Duration::from_secs(5))
            .map_err(|e| anyhow!("the intruder could not handshake: {e}"))?
            .agent;
        let ids: Vec<RequestId> = (0..self.config.requests)
            .flat_map(|i| {
                let id = format!("req-{i}");
                [id.clone(), format!("0_{id}"), format!("1_{id}")]
            })
            .map(RequestId::new)
            .collect();
        let (mut sent, mut failed) = (0u64, 0u64);
        let start = Instant::now();
        let mut peak = (None, 0.0);
        while start.elapsed() < Duration::from_secs(3) {
            for id in &ids {
                for message in [
                    Message::Abort { request: id.clone() },
                    Message::Completion { request: id.clone(), expected_consumers: 1 },
                    Message::Heartbeat { requests: vec![id.clone()] },
                    Message::Rejection { request: id.clone() },
                ] {
                    let payload = message.encode().map_err(|e| anyhow!("{e}"))?;
                    match t.send_notification(&p, &payload) {
                        Ok(()) => sent += 1,
                        Err(_) => failed += 1,
                    }
                }
            }
            while t.poll_event().is_some() {}
            if peak.0.is_none() {
                peak = self.measure();
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(Outcome {
            tried: format!(
                "a key holder sent {sent} aborts, completions, heartbeats and rejections for {} request ids it never claimed",
                ids.len()
            ),
            held: failed == 0,
            detail: format!(
                "{failed} sends failed; the router checks that no export was released for them (corrupt reads, releases credited to live engines)"
            ),
            probe_ms: peak.0,
            peak_rss: peak.1,
            ..Outcome::default()
        })
    }

    /// A key holder handshakes as `intruder2`, then makes a NIXL agent of its own under the
    /// live D's NIXL agent name, loads P's metadata into it, and posts completions, aborts and
    /// heartbeats as that D: untagged, and with a tag of its own making. P must open none of
    /// them (the router checks P counted them as unauthenticated and released nothing).
    fn forged_sender_name(&mut self) -> Result<Outcome> {
        let mut t = self.transport("intruder2", 1, KeySource::Env(CLUSTER_KEY_ENV.into()))?;
        let info = Self::handshake(&mut t, &self.p_address(), Duration::from_secs(5))
            .map_err(|e| anyhow!("intruder2 could not handshake: {e}"))?;
        let md = kv_transport_nixl::nixl_agent_metadata(&info.handshake.agent_metadata).map_err(|e| anyhow!(e))?;
        let live = AgentName::new(EngineId::new(self.config.live_decode.clone()), 0);
        let name = kv_transport_nixl::nixl_name(&live, self.config.live_instance);
        let agent = nixl_sys::Agent::new(&name).map_err(|e| anyhow!("agent {name}: {e}"))?;
        let (_, params) = agent.get_plugin_params("UCX").map_err(|e| anyhow!("UCX parameters: {e}"))?;
        let backend = agent.create_backend("UCX", &params).map_err(|e| anyhow!("UCX backend: {e}"))?;
        let p = agent.load_remote_md(md).map_err(|e| anyhow!("P's metadata: {e}"))?;
        let (mut sent, mut failed) = (0u64, 0u64);
        let mut peak = (None, 0.0);
        for i in 0..self.config.requests {
            let id = RequestId::new(format!("req-{i}"));
            for message in [
                Message::Completion { request: id.clone(), expected_consumers: 1 },
                Message::Abort { request: id.clone() },
                Message::Heartbeat { requests: vec![id.clone()] },
            ] {
                let payload = message.encode().map_err(|e| anyhow!("{e}"))?;
                // Untagged, and with a tag of the attacker's making.
                let mut tagged = b"KT".to_vec();
                tagged.extend_from_slice(&(u64::from(i) + 1).to_be_bytes());
                tagged.extend_from_slice(&payload);
                tagged.extend_from_slice(&random_bytes(i as usize, 16));
                for bytes in [payload, tagged] {
                    match agent.send_notification(&p, &bytes, Some(&backend)) {
                        Ok(()) => sent += 1,
                        Err(_) => failed += 1,
                    }
                }
            }
            if i == self.config.requests / 2 {
                peak = self.measure();
            }
        }
        while t.poll_event().is_some() {}
        Ok(Outcome {
            tried: format!(
                "a key holder's own NIXL agent named {name} posted {sent} completions, aborts and heartbeats as that engine"
            ),
            held: sent > 0,
            detail: format!(
                "{failed} posts failed; the router checks P counted them unauthenticated and released nothing for them"
            ),
            probe_ms: peak.0,
            peak_rss: peak.1,
            ..Outcome::default()
        })
    }

    /// A peer without the key claims a live D's name, at its incarnation and the next.
    fn impersonate_without_key(&mut self) -> Result<Outcome> {
        let (name, instance) = (self.config.live_decode.clone(), self.config.live_instance);
        let mut refusals = Vec::new();
        let mut held = true;
        let wrong = std::env::temp_dir().join(format!("kvflow-attack-wrong-key-{}", std::process::id()));
        let hex: String = random_bytes(1, 32).iter().map(|b| format!("{b:02x}")).collect();
        std::fs::write(&wrong, hex)?;
        // As a key file should be: the owner's alone (else the transport warns).
        std::fs::set_permissions(&wrong, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
        for (key, what) in [(KeySource::None, "no key"), (KeySource::File(wrong.clone()), "a wrong key")] {
            for incarnation in [instance, instance + 1] {
                let mut t = self.transport(&name, incarnation, key.clone())?;
                match Self::handshake(&mut t, &self.p_address(), Duration::from_secs(5)) {
                    Ok(_) => {
                        held = false;
                        refusals.push(format!("{what}, incarnation {incarnation}: ACCEPTED"));
                    }
                    Err(e) => refusals.push(format!("{what}, incarnation {incarnation}: {e}")),
                }
            }
        }
        let _ = std::fs::remove_file(&wrong);
        let (probe_ms, peak_rss) = self.measure();
        Ok(Outcome {
            tried: format!(
                "handshakes as {name} (incarnations {instance} and {}) with no key and a wrong key",
                instance + 1
            ),
            held,
            detail: refusals.join("; "),
            probe_ms,
            peak_rss,
            ..Outcome::default()
        })
    }

    /// A key holder claims a live D's name at the live incarnation.
    fn impersonate_live_incarnation(&mut self) -> Result<Outcome> {
        let (name, instance) = (self.config.live_decode.clone(), self.config.live_instance);
        let mut t = self.transport(&name, instance, KeySource::Env(CLUSTER_KEY_ENV.into()))?;
        let result = Self::handshake(&mut t, &self.p_address(), Duration::from_secs(5));
        let (probe_ms, peak_rss) = self.measure();
        Ok(Outcome {
            tried: format!("a key holder handshakes as the live {name} incarnation {instance}"),
            held: result.is_err(),
            detail: match result {
                Ok(_) => "accepted: it would replace the live engine".into(),
                Err(e) => format!("refused: {e}"),
            },
            probe_ms,
            peak_rss,
            ..Outcome::default()
        })
    }

    /// `count` connections, each sending `bytes(i)`; each must end in an ERROR and a close.
    fn raw_flood(&mut self, count: usize, bytes: impl Fn(usize) -> Vec<u8>) -> Result<Outcome> {
        let mut streams = Vec::new();
        for i in 0..count {
            let mut s = TcpStream::connect(("127.0.0.1", self.config.p_port))?;
            let _ = s.write_all(&bytes(i));
            streams.push(s);
        }
        let (probe_ms, peak_rss) = self.measure();
        let mut closed_with_error = 0;
        let mut sample = None;
        let deadline = Instant::now() + Duration::from_secs(8);
        for s in &mut streams {
            let (closed, error) = until_closed(s, deadline);
            if closed && error.is_some() {
                closed_with_error += 1;
            }
            sample = sample.or(error);
        }
        Ok(Outcome {
            tried: format!("{count} connections sending bad bytes"),
            held: closed_with_error == count,
            detail: format!(
                "{closed_with_error} of {count} got an ERROR frame and a close; e.g. {:?}",
                sample.unwrap_or_default()
            ),
            probe_ms,
            peak_rss,
            ..Outcome::default()
        })
    }

    fn wrong_version(&mut self) -> Result<Outcome> {
        let mut s = TcpStream::connect(("127.0.0.1", self.config.p_port))?;
        s.write_all(&hello("decode-old", 99))?;
        let (probe_ms, peak_rss) = self.measure();
        let (closed, error) = until_closed(&mut s, Instant::now() + Duration::from_secs(6));
        let error = error.unwrap_or_default();
        Ok(Outcome {
            tried: "a HELLO of side protocol version 99".into(),
            held: closed && error.contains("version"),
            detail: format!("closed: {closed}, error: {error:?}"),
            probe_ms,
            peak_rss,
            ..Outcome::default()
        })
    }

    /// 100 connections, each sending a HELLO one byte every 100 ms.
    fn slowloris(&mut self) -> Result<Outcome> {
        let frame = hello("decode-slow", kv_core::side::SIDE_PROTOCOL_VERSION);
        let mut streams: Vec<TcpStream> =
            (0..100).filter_map(|_| TcpStream::connect(("127.0.0.1", self.config.p_port)).ok()).collect();
        let start = Instant::now();
        let mut peak = (None, 0.0);
        let mut closed = vec![false; streams.len()];
        for byte in &frame {
            for (i, s) in streams.iter_mut().enumerate() {
                if !closed[i] && s.write_all(&[*byte]).is_err() {
                    closed[i] = true;
                }
            }
            if start.elapsed() > Duration::from_secs(1) && peak.0.is_none() {
                peak = self.measure();
            }
            if start.elapsed() > Duration::from_secs(8) {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let mut ended = 0;
        // Past the handshake deadline (5 s) of the last one to arrive.
        let deadline = Instant::now() + Duration::from_secs(8);
        for s in &mut streams {
            if until_closed(s, deadline).0 {
                ended += 1;
            }
        }
        Ok(Outcome {
            tried: format!("{} connections trickling a HELLO one byte per 100 ms", streams.len()),
            held: ended == streams.len(),
            detail: format!("{ended} of {} were closed by P (evicted, or past the handshake deadline)", streams.len()),
            probe_ms: peak.0,
            peak_rss: peak.1,
            ..Outcome::default()
        })
    }

    /// 1000 connections that say nothing, far beyond the bound on those waiting for HELLO from
    /// one address.
    fn idle_flood(&mut self) -> Result<Outcome> {
        let mut streams = Vec::new();
        for _ in 0..1000 {
            match TcpStream::connect(("127.0.0.1", self.config.p_port)) {
                Ok(s) => streams.push(s),
                Err(_) => break,
            }
        }
        std::thread::sleep(Duration::from_millis(200));
        let (probe_ms, peak_rss) = self.measure();
        let mut ended = 0;
        for s in &mut streams {
            if until_closed(s, Instant::now() + Duration::from_millis(20)).0 {
                ended += 1;
            }
        }
        let open = streams.len() - ended;
        let bound = kv_core::side::SideLimits::default().max_unauthenticated_per_source;
        Ok(Outcome {
            tried: format!("{} idle connections held open", streams.len()),
            held: open <= bound,
            detail: format!(
                "P closed {ended} of them at once; {open} were still open (bound {bound} waiting for HELLO from one address)"
            ),
            probe_ms,
            peak_rss,
            ..Outcome::default()
        })
    }
}

/// The resident memory of process `pid`, in MiB (zero once it is gone).
fn rss_mib_of(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kb: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0.0);
    kb / 1024.0
}

/// Reads 16 bytes of `peer`'s memory at `remote` into `local` over `t`, polling until it ends
/// or `deadline` passes: a key holder's read of P's pool, as the probes make it.
fn read_16(t: &mut dyn Transport, peer: &AgentName, local: u64, remote: u64, deadline: Instant) -> Result<(), String> {
    let pairs =
        vec![DescriptorPair { local_region: 0, local_addr: local, remote_region: 0, remote_addr: remote, len: 16 }];
    let read = TransferRequest { op: TransferOp::Read, peer: peer.clone(), pairs, notification: None };
    let id = t.post(read).map_err(|e| format!("the read was not posted: {e}"))?;
    loop {
        match t.poll_transfer(id) {
            TransferStatus::Done => return Ok(()),
            TransferStatus::InProgress if Instant::now() < deadline => std::thread::sleep(Duration::from_micros(200)),
            TransferStatus::InProgress => return Err("no read by its deadline".into()),
            TransferStatus::Failed(e) => return Err(format!("the read failed: {e}")),
        }
    }
}

/// Polls `t` until it connects to a peer (or fails to), up to `limit`.
fn connected(t: &mut dyn Transport, limit: Duration) -> Result<Box<PeerInfo>, String> {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        match t.poll_event() {
            Some(PeerEvent::Connected(info)) => return Ok(info),
            Some(PeerEvent::ConnectFailed { error, .. }) => return Err(error.to_string()),
            Some(_) => {}
            None => std::thread::sleep(Duration::from_micros(200)),
        }
    }
    Err(format!("no handshake within {limit:?}"))
}

/// What an attack saw.
#[derive(Default)]
struct Outcome {
    tried: String,
    held: bool,
    detail: String,
    probe_ms: Option<f64>,
    peak_rss: f64,
    /// A storm's probes, and its window with the quiet one before it.
    probes: Vec<Probes>,
    window_ns: Option<(u64, u64)>,
    quiet_ns: Option<(u64, u64)>,
}
