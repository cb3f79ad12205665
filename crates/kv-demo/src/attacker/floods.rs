//! Floods from key holders and at the engine's other doors: offers at and over the side
//! channel's size limit, a key holder's data connection under another engine's name, and idle
//! connections on the metrics endpoint. (The heartbeat flood is in `heartbeats.rs`.)

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{anyhow, Result};
use kv_core::side::{ClusterKey, ConnId, FrameHeader, SideConfig, SideEndpoint, SideEvent, MAX_SEALED_FRAME};
use kv_core::wire::MAX_HANDSHAKE_BYTES;
use kv_core::{AgentName, PeerAddress, Time};

use super::{Attacker, Outcome};
use crate::proto::CLUSTER_KEY_ENV;

/// A key holder's side channel driven by hand over a plain socket: kv-core's endpoint, and the
/// frames it would send, which the attacker may send otherwise.
struct RawSide {
    side: SideEndpoint,
    socket: TcpStream,
    start: Instant,
}

impl RawSide {
    fn now(&self) -> Time {
        Time::from_nanos(self.start.elapsed().as_nanos() as u64)
    }

    /// Connects to `addr` as `offer`'s agent and sends HELLO.
    fn connect(addr: SocketAddr, key: ClusterKey, offer: kv_core::Handshake) -> Result<RawSide> {
        let side = SideEndpoint::new(SideConfig::new(key), offer).map_err(|e| anyhow!("{e}"))?;
        let socket = TcpStream::connect(addr)?;
        socket.set_read_timeout(Some(Duration::from_secs(5)))?;
        let mut raw = RawSide { side, socket, start: Instant::now() };
        let mut nonce = [0u8; 32];
        getrandom::fill(&mut nonce).map_err(|e| anyhow!("{e}"))?;
        let now = raw.now();
        raw.side.handle_connect(now, ConnId(1), PeerAddress(addr.to_string()), nonce);
        raw.flush(usize::MAX)?;
        Ok(raw)
    }

    /// Writes up to `frames` of what the endpoint queued; returns the rest.
    fn flush(&mut self, frames: usize) -> Result<Vec<Vec<u8>>> {
        let mut rest = Vec::new();
        let mut sent = 0;
        while let Some(t) = self.side.poll_transmit() {
            if sent < frames {
                self.socket.write_all(&t.bytes)?;
                sent += 1;
            } else {
                rest.push(t.bytes);
            }
        }
        Ok(rest)
    }

    /// Reads until the endpoint has an event; writes what it queues up to `frames` frames.
    fn until_event(&mut self, frames: usize) -> Result<(Option<SideEvent>, Vec<Vec<u8>>)> {
        let mut buf = [0u8; 64 * 1024];
        loop {
            let held = self.flush(frames)?;
            if !held.is_empty() {
                return Ok((None, held));
            }
            if let Some(event) = self.side.poll_event() {
                return Ok((Some(event), Vec::new()));
            }
            let n = self.socket.read(&mut buf)?;
            if n == 0 {
                return Ok((None, Vec::new()));
            }
            let now = self.now();
            self.side.handle_bytes(now, ConnId(1), &buf[..n]);
        }
    }
}

/// Whether P closed `socket` within `limit` (reading and dropping what it sent).
fn closed_within(socket: &mut TcpStream, limit: Duration) -> bool {
    let _ = socket.set_read_timeout(Some(Duration::from_millis(50)));
    let deadline = Instant::now() + limit;
    let mut buf = [0u8; 4096];
    while Instant::now() < deadline {
        match socket.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
            Err(_) => return true,
        }
    }
    false
}

impl Attacker {
    fn key(&self) -> Result<ClusterKey> {
        let hex = std::env::var(CLUSTER_KEY_ENV).map_err(|_| anyhow!("no cluster key in {CLUSTER_KEY_ENV}"))?;
        ClusterKey::from_hex(&hex).map_err(|e| anyhow!("{e}"))
    }

    fn p_socket(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.config.p_port))
    }

    /// Key holders prove the key, then one sends a SEALED frame whose length is one past the
    /// limit, and eight send offers as large as the limit allows, of metadata no transport
    /// takes: P must refuse the first at its length, and the rest without holding them.
    pub(super) fn oversized_offer(&mut self) -> Result<Outcome> {
        let key = self.key()?;
        let mut notes = Vec::new();
        let mut held = true;
        // One past the limit: refused as soon as its length is in.
        let mut raw = RawSide::connect(self.p_socket(), key.clone(), self.offer("oversized", 1))?;
        let (_, held_back) = raw.until_event(1)?;
        let mut header = ((MAX_SEALED_FRAME + 1) as u32).to_be_bytes().to_vec();
        header.push(4);
        raw.socket.write_all(&header)?;
        let refused = closed_within(&mut raw.socket, Duration::from_secs(2));
        held &= refused;
        notes.push(format!(
            "a SEALED frame claiming {} bytes after PROOF: {} ({} frame of its own left unsent)",
            MAX_SEALED_FRAME + 1,
            if refused { "closed at once" } else { "STILL OPEN" },
            held_back.len()
        ));
        // As large as allowed, eight at once, metadata of nothing: P takes each handshake,
        // then drops the peer whose metadata its transport cannot load (or refuses one whose
        // handshake it could not finish in time); either way it closes every connection.
        let before = self.rss_mib();
        let offers: Vec<kv_core::Handshake> = (0..8)
            .map(|i| {
                let mut offer = self.offer(&format!("oversized-{i}"), 1);
                offer.agent_metadata = vec![0xab; MAX_HANDSHAKE_BYTES - 4096];
                offer
            })
            .collect();
        let addr = self.p_socket();
        let sending = std::thread::scope(|scope| {
            let threads: Vec<_> = offers
                .into_iter()
                .map(|offer| {
                    let key = key.clone();
                    scope.spawn(move || -> String {
                        let mut raw = match RawSide::connect(addr, key, offer) {
                            Ok(raw) => raw,
                            Err(e) => return format!("not connected ({e})"),
                        };
                        let outcome = match raw.until_event(usize::MAX) {
                            Ok((Some(SideEvent::Connected { .. }), _)) => "handshook".to_owned(),
                            Ok((Some(SideEvent::ConnectFailed { error, .. }), _)) => format!("refused ({error})"),
                            Ok((other, _)) => format!("{other:?}"),
                            // P closed the connection while the offer was being written.
                            Err(e) => format!("closed while sending ({e})"),
                        };
                        let closed = closed_within(&mut raw.socket, Duration::from_secs(8));
                        format!("{outcome}, {}", if closed { "closed by P" } else { "STILL OPEN" })
                    })
                })
                .collect();
            let mut peak = before;
            while threads.iter().any(|t| !t.is_finished()) {
                peak = peak.max(self.rss_mib());
                std::thread::sleep(Duration::from_millis(50));
            }
            let outcomes: Vec<String> = threads.into_iter().map(|t| t.join().unwrap_or_default()).collect();
            (outcomes, peak)
        });
        let (outcomes, peak) = sending;
        let open = outcomes.iter().filter(|o| o.contains("STILL OPEN")).count();
        held &= open == 0;
        notes.push(format!("8 offers of {} bytes at once: {}", MAX_HANDSHAKE_BYTES - 4096, outcomes.join("; ")));
        let (probe_ms, rss) = self.measure();
        Ok(Outcome {
            tried: "key holders sent a SEALED frame over the size limit, and 8 offers at it".into(),
            held,
            detail: notes.join("; "),
            probe_ms,
            peak_rss: peak.max(rss),
            ..Outcome::default()
        })
    }

    /// A key holder, handshaked under a name of its own, opens a TCP data connection under the
    /// live D's name and answers P's CHALLENGE with a PROOF made with its own session.
    pub(super) fn impersonate_on_data_path(&mut self, data: SocketAddr) -> Result<Outcome> {
        let key = self.key()?;
        let mut offer = self.offer("intruder3", 1);
        // The TCP transport's metadata (a data address where nothing listens, no regions), so
        // that P keeps the session open.
        offer.agent_metadata = super::tcp_stub_metadata();
        let mut raw = RawSide::connect(self.p_socket(), key, offer)?;
        let (event, _) = raw.until_event(usize::MAX)?;
        let Some(SideEvent::Connected { info, .. }) = event else {
            return Err(anyhow!("the intruder could not handshake: {event:?}"));
        };
        let p: AgentName = info.agent;
        let secret = raw.side.link_secret(&p, "kvflow-tcp-data-v2").ok_or_else(|| anyhow!("no session with P"))?;
        let name = self.config.live_decode.as_bytes();
        let mut hello = FrameHeader { kind: 0x01, body_len: 4 + 1 + 1 + 32 + 8 + 4 + name.len() }.to_bytes().to_vec();
        hello.extend_from_slice(b"KVTD\x03\x00");
        hello.extend_from_slice(&[0x33; 32]);
        hello.extend_from_slice(&self.config.live_instance.to_le_bytes());
        hello.extend_from_slice(&0u32.to_le_bytes());
        hello.extend_from_slice(name);
        let mut s = TcpStream::connect(data)?;
        s.write_all(&hello)?;
        s.set_read_timeout(Some(Duration::from_secs(3)))?;
        let mut challenge = [0u8; 5 + 65];
        s.read_exact(&mut challenge)?;
        let mut transcript = hello.clone();
        transcript.extend_from_slice(&challenge[..5 + 33]);
        let ours = secret.verify_listener_mac(&transcript, &challenge[5 + 33..]);
        let mut proof = FrameHeader { kind: 0x06, body_len: 32 }.to_bytes().to_vec();
        proof.extend_from_slice(&secret.connector_mac(&transcript, &challenge[5 + 33..]));
        s.write_all(&proof)?;
        let closed = closed_within(&mut s, Duration::from_secs(2));
        let (probe_ms, peak_rss) = self.measure();
        drop(raw);
        Ok(Outcome {
            tried: format!(
                "a key holder (intruder3) opened a data connection as {} and answered with its own session's PROOF",
                self.config.live_decode
            ),
            held: closed && !ours,
            detail: format!(
                "P's CHALLENGE {} the intruder's session; P {} the connection after its PROOF",
                if ours { "VERIFIED under" } else { "was not made with" },
                if closed { "closed" } else { "DID NOT CLOSE" }
            ),
            probe_ms,
            peak_rss,
            ..Outcome::default()
        })
    }

    /// 20 idle connections on P's metrics endpoint, then a scrape, which must answer within 1 s.
    pub(super) fn metrics_idle(&mut self) -> Result<Outcome> {
        let Some(port) = self.config.metrics_port else {
            return Err(anyhow!("P serves no metrics endpoint"));
        };
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let took = crate::prometheus::idle_connections_then_scrape(addr, 20, Duration::from_secs(15));
        let (probe_ms, peak_rss) = self.measure();
        Ok(Outcome {
            tried: format!("20 idle connections held open on P's metrics endpoint {addr}, then a scrape"),
            held: took.as_ref().is_ok_and(|t| *t <= Duration::from_secs(1)),
            detail: match took {
                Ok(t) => format!("the scrape answered in {:.1} ms (bound 1000 ms)", t.as_secs_f64() * 1e3),
                Err(e) => format!("the scrape failed: {e:#}"),
            },
            probe_ms,
            peak_rss,
            ..Outcome::default()
        })
    }
}
