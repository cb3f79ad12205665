//! A key holder's heartbeat flood: notifications naming 250 fresh request ids of 240 bytes
//! each, sent as fast as its NIXL agent sends them for [`HEARTBEAT_FLOOD_S`] seconds, and sent
//! again from a new incarnation each time P cuts it off. P's memory must stay within the bound
//! throughout, and a legitimate key holder beside it (a [`Witness`]) must be served: its
//! side-channel handshakes within [`PROBE_BOUND_MS`], and its heartbeats answered and its reads
//! of P's pool done within [`STORM_PROBE_BOUND_MS`].
//!
//! The contended flood does the same with P starved of CPU ([`Hog`]).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Result};
use kv_core::{
    AgentName, LeaseState, MemoryKind, Message, PeerEvent, Region, RegionId, RequestId, Transport, TransportError,
};
use kv_transport_nixl::{KeySource, NixlTransport};

use super::hog::Hog;
use super::{Attacker, Outcome};
use crate::proto::{Probes, CLUSTER_KEY_ENV, HEARTBEAT_FLOOD_S, PROBE_BOUND_MS, STORM_PROBE_BOUND_MS};

/// Bytes of each request id the flood names (the attacker sent about 240).
const FLOOD_ID_BYTES: usize = 240;
/// Ids per heartbeat.
const FLOOD_IDS: usize = 250;
/// Incarnations P cut off that the flooder keeps alive, so that what their NIXL agents queued
/// still flows into P after the cut-off, as it would from a flooder that never stops.
const KEPT_CUT_OFF: usize = 4;
/// How often the flood is interrupted for the probes.
const PROBE_EVERY: Duration = Duration::from_secs(1);

/// P's resident memory, sampled every 20 ms on a thread of its own until stopped: the flood's
/// own loop samples it only between sends, and would miss a short peak.
struct RssSampler {
    first: f64,
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<f64>,
}

impl RssSampler {
    fn start(pid: u32) -> RssSampler {
        let first = super::rss_mib_of(pid);
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut peak = first;
            while !s.load(Ordering::Relaxed) {
                peak = peak.max(super::rss_mib_of(pid));
                std::thread::sleep(Duration::from_millis(20));
            }
            peak.max(super::rss_mib_of(pid))
        });
        RssSampler { first, stop, thread }
    }

    /// The highest sample, in MiB.
    fn stop(self) -> f64 {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap_or(self.first)
    }
}

/// A legitimate D rank beside the flood: a key holder's NIXL agent, connected to P before the
/// flood began, with a small pool of its own to read P's into.
struct Witness {
    t: NixlTransport,
    p: AgentName,
    /// Where P's pool starts (from its handshake).
    p_pool: u64,
    pool: Vec<u8>,
    heartbeats: u64,
}

impl Witness {
    /// Waits up to `limit` for P to answer a heartbeat naming a request it does not know (P
    /// stages it and says its lease is unknown), then reads 16 bytes of P's pool; milliseconds
    /// for both.
    fn probe(&mut self, limit: Duration) -> Result<f64, String> {
        let start = Instant::now();
        self.heartbeats += 1;
        let request = RequestId::new(format!("witness-{}", self.heartbeats));
        let beat = Message::Heartbeat { requests: vec![request.clone()] }.encode().map_err(|e| e.to_string())?;
        self.t.send_notification(&self.p, &beat).map_err(|e| format!("heartbeat not sent: {e}"))?;
        loop {
            if start.elapsed() > limit {
                return Err(format!("no answer to a heartbeat within {limit:?}"));
            }
            match self.t.poll_event() {
                Some(PeerEvent::Notification(n)) if n.from == self.p => {
                    if let Ok(Message::HeartbeatAck { renewals }) = Message::decode(&n.payload) {
                        if renewals.iter().any(|r| r.request == request && r.lease == LeaseState::Unknown) {
                            break;
                        }
                    }
                }
                Some(PeerEvent::Lost(peer)) if peer == self.p => return Err("P closed its side channel".into()),
                Some(_) => {}
                None => std::thread::sleep(Duration::from_micros(200)),
            }
        }
        super::read_16(&mut self.t, &self.p, self.pool.as_ptr() as u64, self.p_pool, start + limit)?;
        Ok(start.elapsed().as_secs_f64() * 1e3)
    }
}

/// Probes of one kind: successes within a bound, the slowest, and what went wrong.
struct Tally {
    probes: Probes,
    misses: Vec<String>,
}

impl Tally {
    fn new(what: &str, bound_ms: f64) -> Self {
        Tally { probes: Probes { what: what.to_owned(), bound_ms, ..Probes::default() }, misses: Vec::new() }
    }

    fn add(&mut self, outcome: Result<f64, String>) {
        self.probes.total += 1;
        match outcome {
            Ok(ms) if ms <= self.probes.bound_ms => {
                self.probes.ok += 1;
                self.probes.max_ms = self.probes.max_ms.max(ms);
            }
            Ok(ms) => self.misses.push(format!("{ms:.0} ms")),
            Err(e) => self.misses.push(e),
        }
    }

    fn said(&self) -> String {
        let p = &self.probes;
        let misses =
            if self.misses.is_empty() { String::new() } else { format!(" (missed: {})", self.misses.join("; ")) };
        format!(
            "a key holder's {} {} of {} within {} ms (slowest {:.1} ms){misses}",
            p.what, p.ok, p.total, p.bound_ms, p.max_ms
        )
    }
}

impl Attacker {
    /// A key holder's NIXL transport as incarnation `instance` of `engine`, handshaked with P.
    fn nixl_peer(&self, engine: &str, instance: u64) -> Result<(NixlTransport, kv_core::PeerInfo)> {
        let mut t = self.transport(engine, instance, KeySource::Env(CLUSTER_KEY_ENV.into()))?;
        let info = Self::handshake(&mut t, &self.p_address(), Duration::from_secs(10))
            .map_err(|e| anyhow!("{engine} incarnation {instance} could not handshake: {e}"))?;
        Ok((t, *info))
    }

    fn nixl_witness(&self, engine: &str) -> Result<Witness> {
        let pool = vec![0u8; 4096];
        let mut t = self.transport(engine, 1, KeySource::Env(CLUSTER_KEY_ENV.into()))?;
        let region =
            Region { id: RegionId(1), kind: MemoryKind::Host, addr: pool.as_ptr() as u64, len: pool.len() as u64 };
        t.register(&region).map_err(|e| anyhow!("the witness's pool: {e}"))?;
        let info = Self::handshake(&mut t, &self.p_address(), Duration::from_secs(10))
            .map_err(|e| anyhow!("the witness could not handshake: {e}"))?;
        let p_pool = info.handshake.regions.first().ok_or_else(|| anyhow!("P offers no region"))?.addr;
        Ok(Witness { t, p: info.agent, p_pool, pool, heartbeats: 0 })
    }

    /// The flood (see the module's docs); `contended`: with P starved of CPU ([`Hog`]) from
    /// a second before it to its end; `returns`: the flooder comes back as a new incarnation
    /// each time P cuts it off (else it stops there, as a peer does that sees its side
    /// channel closed; the probes go on).
    pub(super) fn heartbeat_flood(&mut self, contended: bool, returns: bool) -> Result<Outcome> {
        let engine = if contended { "flooder-contended" } else { "flooder" };
        let mut witness = self.nixl_witness(if contended { "witness-contended" } else { "witness" })?;
        let hog = if contended {
            let hog = Hog::start(self.config.p_pid)?;
            std::thread::sleep(Duration::from_secs(1));
            Some(hog)
        } else {
            None
        };
        let mut incarnation = 1;
        let (mut t, mut p) = self.nixl_peer(engine, incarnation).map(|(t, info)| (t, info.agent))?;
        let mut cut_off: VecDeque<NixlTransport> = VecDeque::new();
        let rss = RssSampler::start(self.config.p_pid);
        let before = rss.first;
        let (mut sent, mut failed, mut ids, mut came_back) = (0u64, 0u64, 0u64, Vec::new());
        let mut failed_returns = 0u64;
        // When P first cut it off (a flooder that does not come back).
        let mut cut_at = None;
        let mut handshakes = Tally::new("handshakes", PROBE_BOUND_MS);
        let mut served = Tally::new("heartbeats answered and reads of P's pool", STORM_PROBE_BOUND_MS);
        let start = Instant::now();
        let mut probed = Instant::now();
        while start.elapsed() < Duration::from_secs(HEARTBEAT_FLOOD_S) {
            if cut_at.is_some() {
                // Cut off, and not coming back: nothing to send on; the probes go on.
                std::thread::sleep(PROBE_EVERY.saturating_sub(probed.elapsed()));
            } else {
                let requests: Vec<RequestId> = (0..FLOOD_IDS)
                    .map(|i| {
                        RequestId::new(format!("flood-{:020}-{}", ids + i as u64, "x".repeat(FLOOD_ID_BYTES - 27)))
                    })
                    .collect();
                let payload = Message::Heartbeat { requests }.encode().map_err(|e| anyhow!("{e}"))?;
                match t.send_notification(&p, &payload) {
                    Ok(()) => {
                        sent += 1;
                        ids += FLOOD_IDS as u64;
                    }
                    Err(TransportError::UnknownPeer(_) | TransportError::PeerLost(_)) if returns => {
                        // Cut off: back as a new incarnation, the old one's NIXL agent kept alive.
                        let back = Instant::now();
                        incarnation += 1;
                        match self.nixl_peer(engine, incarnation) {
                            Ok((next, info)) => {
                                cut_off.push_back(std::mem::replace(&mut t, next));
                                if cut_off.len() > KEPT_CUT_OFF {
                                    cut_off.pop_front();
                                }
                                p = info.agent;
                                came_back.push(back.elapsed().as_secs_f64() * 1e3);
                            }
                            // It tries again.
                            Err(_) => {
                                failed_returns += 1;
                                std::thread::sleep(Duration::from_millis(20));
                            }
                        }
                    }
                    Err(TransportError::UnknownPeer(_) | TransportError::PeerLost(_)) => {
                        cut_at = Some(start.elapsed());
                    }
                    Err(_) => failed += 1,
                }
            }
            if probed.elapsed() >= PROBE_EVERY {
                probed = Instant::now();
                // Its acknowledgements are read once a second: a sender that reads them slowly.
                while t.poll_event().is_some() {}
                handshakes.add(self.timed_probe(Duration::from_millis(STORM_PROBE_BOUND_MS as u64)));
                served.add(witness.probe(Duration::from_millis(STORM_PROBE_BOUND_MS as u64)));
            }
        }
        let peak = rss.stop();
        drop(t);
        drop(cut_off);
        let starved = hog.map(|hog| {
            let core = hog.core;
            drop(hog);
            format!(
                ", P confined to core {core} beside {} busy threads and the flood sent from the other cores",
                Hog::THREADS
            )
        });
        let rate = ids as f64 / cut_at.unwrap_or_else(|| start.elapsed()).as_secs_f64().max(1e-3);
        let held = sent > 0 && handshakes.probes.total > 0 && served.probes.total > 0;
        let cut_offs = if returns {
            let slowest = came_back.iter().copied().fold(0.0, f64::max);
            format!(
                "it came back as a new incarnation {} times after P closed its side channel (slowest return \
                 {slowest:.0} ms; {failed_returns} returns failed; P refuses an engine cut off for a while, and the \
                 flooder sends on until it hears so)",
                came_back.len()
            )
        } else {
            match cut_at {
                Some(at) => format!("P cut it off {:.2} s into the flood", at.as_secs_f64()),
                None => "P did not cut it off".to_owned(),
            }
        };
        Ok(Outcome {
            tried: format!(
                "a key holder sent {sent} heartbeats naming {ids} distinct {FLOOD_ID_BYTES}-byte request ids ({rate:.0} ids a second while it could send){}; {cut_offs}",
                starved.unwrap_or_default(),
            ),
            held,
            detail: format!(
                "{failed} sends failed; P's resident memory {before:.0} MiB before, {peak:.0} MiB at most (growth {:.1} MiB); {}; {}",
                peak - before,
                handshakes.said(),
                served.said(),
            ),
            probe_ms: Some(handshakes.probes.max_ms),
            peak_rss: peak,
            probes: vec![handshakes.probes, served.probes],
            ..Outcome::default()
        })
    }
}
