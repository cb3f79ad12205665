//! What the tests share: page-aligned host pools, a clock, a connected pair of transports,
//! waiting helpers, and a raw client that speaks the data protocol by hand.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Wake, Waker};
use std::time::{Duration, Instant};

use kv_core::{
    AgentName, Clock, EngineId, Handshake, KvLayout, MemoryKind, PeerAddress, PeerEvent, Region, RegionId, Role,
    TransferId, TransferStatus, Transport,
};
use kv_transport_tcp::{TcpConfig, TcpTransport};

/// The process's monotonic clock.
pub fn clock() -> Arc<dyn Clock> {
    Arc::new(kv_side_tcp::MonotonicClock::start())
}

pub const PAGE: usize = 4096;

/// Page-aligned host memory that stays where it is for as long as the pool lives.
pub struct Pool {
    buf: Vec<u8>,
    offset: usize,
    len: usize,
    id: u64,
}

impl Pool {
    pub fn new(id: u64, len: usize) -> Pool {
        let buf = vec![0u8; len + PAGE];
        let offset = buf.as_ptr().align_offset(PAGE);
        Pool { buf, offset, len, id }
    }

    /// A pool whose byte `i` is a function of `seed` and `i`.
    pub fn patterned(id: u64, len: usize, seed: u8) -> Pool {
        let mut pool = Pool::new(id, len);
        for (i, b) in pool.bytes_mut().iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(31).wrapping_add(seed).wrapping_add((i >> 12) as u8);
        }
        pool
    }

    pub fn region(&self) -> Region {
        Region { id: RegionId(self.id), kind: MemoryKind::Host, addr: self.addr(0), len: self.len as u64 }
    }

    pub fn addr(&self, at: usize) -> u64 {
        self.buf[self.offset..].as_ptr() as u64 + at as u64
    }

    pub fn bytes(&self) -> &[u8] {
        &self.buf[self.offset..self.offset + self.len]
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.buf[self.offset..self.offset + self.len]
    }
}

pub fn agent(engine: &str) -> AgentName {
    AgentName::new(EngineId::new(engine), 0)
}

pub fn offer(engine: &str, role: Role, instance: u64) -> Handshake {
    Handshake::new(&agent(engine), 1, instance, role, "tcp-test-model", KvLayout::split_kv(2, 16, 2, 64, 2))
}

/// A configuration on loopback, ports chosen by the OS.
pub fn config() -> TcpConfig {
    TcpConfig { bind: "127.0.0.1:0".parse().unwrap(), ..TcpConfig::default() }
}

/// Polls `check` until it holds, or fails the test after `timeout` naming `what`.
pub fn until(timeout: Duration, what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !check() {
        assert!(Instant::now() < deadline, "timed out after {timeout:?} waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Every event a transport has now.
pub fn drain(t: &mut TcpTransport, into: &mut Vec<PeerEvent>) {
    while let Some(event) = t.poll_event() {
        into.push(event);
    }
}

/// Polls a transfer until it settles, while `other` keeps taking its events in.
pub fn settle(
    t: &mut TcpTransport,
    id: TransferId,
    other: &mut TcpTransport,
    seen: &mut Vec<PeerEvent>,
) -> TransferStatus {
    let mut status = TransferStatus::InProgress;
    until(Duration::from_secs(20), "a transfer to settle", || {
        drain(other, seen);
        status = t.poll_transfer(id);
        status != TransferStatus::InProgress
    });
    status
}

/// A prefill transport `p` and a decode transport `d`, each with its pool registered,
/// connected (both saw `Connected`).
pub struct Duo {
    pub p: TcpTransport,
    pub d: TcpTransport,
    /// The handshake `d` received from `p`.
    pub p_offer: Handshake,
    pub p_events: Vec<PeerEvent>,
    pub d_events: Vec<PeerEvent>,
}

pub fn duo(p_pool: &Pool, d_pool: &Pool) -> Duo {
    duo_with(p_pool, d_pool, config(), config())
}

pub fn duo_with(p_pool: &Pool, d_pool: &Pool, p_config: TcpConfig, d_config: TcpConfig) -> Duo {
    duo_of(&[p_pool], d_pool, p_config, d_config)
}

/// As [`duo_with`], with several regions registered on P before the handshake.
pub fn duo_of(p_pools: &[&Pool], d_pool: &Pool, p_config: TcpConfig, d_config: TcpConfig) -> Duo {
    let mut p = TcpTransport::new(offer("prefill", Role::Prefill, 1), &p_config, clock()).unwrap();
    let mut d = TcpTransport::new(offer("decode", Role::Decode, 2), &d_config, clock()).unwrap();
    for pool in p_pools {
        p.register(&pool.region()).unwrap();
    }
    d.register(&d_pool.region()).unwrap();
    d.connect(&PeerAddress(p.side_channel_addr().to_string())).unwrap();
    let (mut p_events, mut d_events) = (Vec::new(), Vec::new());
    let connected = |events: &[PeerEvent]| events.iter().any(|e| matches!(e, PeerEvent::Connected(_)));
    until(Duration::from_secs(10), "both sides to connect", || {
        drain(&mut p, &mut p_events);
        drain(&mut d, &mut d_events);
        connected(&p_events) && connected(&d_events)
    });
    let p_offer = d_events
        .iter()
        .find_map(|e| match e {
            PeerEvent::Connected(info) => Some(info.handshake.clone()),
            _ => None,
        })
        .unwrap();
    Duo { p, d, p_offer, p_events, d_events }
}

/// A waker that records that it was woken.
#[derive(Default)]
pub struct Flag(AtomicBool);

impl Wake for Flag {
    fn wake(self: Arc<Self>) {
        self.0.store(true, Ordering::SeqCst);
    }
}

impl Flag {
    pub fn waker(self: &Arc<Self>) -> Waker {
        Waker::from(self.clone())
    }

    /// Waits for a wake (only the flag is watched: the transport is not polled meanwhile).
    pub fn wait(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while !self.0.swap(false, Ordering::SeqCst) {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        true
    }
}

/// The data address and token in a peer's agent metadata, read by hand from the layout
/// the crate documents: "KVTC" | version | family | IP | port u16 | token [32] | ...
pub fn data_capability(metadata: &[u8]) -> (SocketAddr, [u8; 32]) {
    assert_eq!(&metadata[..6], b"KVTC\x01\x04", "an IPv4 data address");
    let ip = std::net::Ipv4Addr::new(metadata[6], metadata[7], metadata[8], metadata[9]);
    let port = u16::from_le_bytes([metadata[10], metadata[11]]);
    let mut token = [0u8; 32];
    token.copy_from_slice(&metadata[12..44]);
    (SocketAddr::from((ip, port)), token)
}

/// A frame: kind, little-endian length, body.
pub fn frame(kind: u8, body: &[u8]) -> Vec<u8> {
    let mut out = vec![kind];
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(body);
    out
}

/// HELLO as the crate docs lay it out.
pub fn hello(token: &[u8; 32], engine: &str, rank: u32, incarnation: u64) -> Vec<u8> {
    let mut body = b"KVTD\x01".to_vec();
    body.extend_from_slice(token);
    body.extend_from_slice(&incarnation.to_le_bytes());
    body.extend_from_slice(&rank.to_le_bytes());
    body.extend_from_slice(engine.as_bytes());
    frame(0x01, &body)
}

/// A raw data connection that sends `bytes` at once.
pub fn raw(addr: SocketAddr, bytes: &[u8]) -> TcpStream {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    stream.write_all(bytes).unwrap();
    stream
}

/// Whether the other side closed `stream` (a read sees the end, or a reset).
pub fn closed_by_peer(stream: &mut TcpStream) -> bool {
    let mut buf = [0u8; 64];
    loop {
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => return true,
            Ok(_) => continue,
        }
    }
}

/// Reads one frame: kind and body.
pub fn read_frame(stream: &mut TcpStream) -> (u8, Vec<u8>) {
    let mut head = [0u8; 5];
    stream.read_exact(&mut head).unwrap();
    let mut body = vec![0u8; u32::from_le_bytes([head[1], head[2], head[3], head[4]]) as usize];
    stream.read_exact(&mut body).unwrap();
    (head[0], body)
}
