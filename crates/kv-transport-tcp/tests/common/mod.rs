//! What the tests share: page-aligned host pools, a clock, a connected pair of transports,
//! waiting helpers, and a raw client that speaks the data protocol by hand.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Wake, Waker};
use std::time::{Duration, Instant};

use kv_core::agent::AgentTable;
use kv_core::side::{ClusterKey, ConnId, FrameTags, LinkRole, SideConfig, SideEndpoint, SideEvent};
use kv_core::{
    AgentName, Clock, EngineId, Handshake, KvLayout, MemoryKind, PeerAddress, PeerEvent, Region, RegionId, Role, Time,
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
    Handshake::new(
        &agent(engine),
        1,
        instance,
        role,
        "tcp-test-model",
        KvLayout::split_kv(2, 16, 2, 64, kv_core::Dtype::Bfloat16),
    )
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

/// The data address in a peer's agent metadata, read through kv-core's registration table.
pub fn data_address(metadata: &[u8]) -> SocketAddr {
    let (table, _) = AgentTable::decode(metadata, "tcp").expect("the TCP transport's agent metadata");
    table.data.expect("a data address")
}

/// A frame header as the crate docs lay it out (the side channel's): the length of the kind and
/// the body, u32 big-endian, then the kind.
pub fn head(kind: u8, body_len: usize) -> Vec<u8> {
    let mut out = ((body_len + 1) as u32).to_be_bytes().to_vec();
    out.push(kind);
    out
}

/// The kind and body length a header says.
pub fn parse_head(head: [u8; 5]) -> (u8, usize) {
    (head[4], u32::from_be_bytes([head[0], head[1], head[2], head[3]]) as usize - 1)
}

/// A frame: header, body.
pub fn frame(kind: u8, body: &[u8]) -> Vec<u8> {
    let mut out = head(kind, body.len());
    out.extend_from_slice(body);
    out
}

/// HELLO as the crate docs lay it out.
pub fn hello(engine: &str, rank: u32, incarnation: u64, nonce: [u8; 32], flags: u8) -> Vec<u8> {
    let mut body = b"KVTD\x03".to_vec();
    body.push(flags);
    body.extend_from_slice(&nonce);
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

/// Reads one untagged frame: kind and body.
pub fn read_frame(stream: &mut TcpStream) -> (u8, Vec<u8>) {
    let mut header = [0u8; 5];
    stream.read_exact(&mut header).unwrap();
    let (kind, len) = parse_head(header);
    let mut body = vec![0u8; len];
    stream.read_exact(&mut body).unwrap();
    (kind, body)
}

/// A key holder written from the documents alone: kv-core's side-channel endpoint over a plain
/// socket as decode agent `engine`, then data links it builds frame by frame.
pub struct RawPeer {
    pub side: SideEndpoint,
    /// The P agent it handshook with, and P's offer.
    pub p: AgentName,
    pub p_offer: Handshake,
    /// Its side-channel socket, kept open: its close is the peer's loss.
    pub socket: TcpStream,
}

impl RawPeer {
    /// Handshakes with the side channel at `addr` under the zero key the tests' transports use.
    pub fn handshake(addr: SocketAddr, engine: &str, incarnation: u64) -> RawPeer {
        // The TCP transport's metadata: a data address where nothing listens, no regions.
        let mut my_offer = offer(engine, Role::Decode, incarnation);
        let table = AgentTable { data: Some(([127, 0, 0, 1], 9).into()), ..AgentTable::new("tcp") };
        my_offer.agent_metadata = table.encode(&[]).unwrap();
        let mut side = SideEndpoint::new(SideConfig::new(ClusterKey::none()), my_offer).unwrap();
        let mut socket = TcpStream::connect(addr).unwrap();
        socket.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        side.handle_connect(Time::ZERO, ConnId(1), PeerAddress(addr.to_string()), [incarnation as u8; 32]);
        let mut buf = [0u8; 64 * 1024];
        loop {
            while let Some(t) = side.poll_transmit() {
                socket.write_all(&t.bytes).unwrap();
            }
            match side.poll_event() {
                Some(SideEvent::Connected { info, .. }) => {
                    return RawPeer { side, p: info.agent.clone(), p_offer: info.handshake, socket };
                }
                Some(other) => panic!("the raw peer's handshake failed: {other:?}"),
                None => {}
            }
            let n = socket.read(&mut buf).unwrap();
            assert!(n > 0, "P closed the side channel");
            side.handle_bytes(Time::ZERO, ConnId(1), &buf[..n]);
        }
    }

    /// Opens a data link to P's listener: HELLO, P's CHALLENGE (checked), PROOF.
    pub fn link(&self, payload_tags: bool) -> RawLink {
        let secret = self.side.link_secret(&self.p, "kvflow-tcp-data-v2").expect("a session with P");
        let me = self.side.offer();
        let nonce_c = [0x5a; 32];
        let mut transcript = hello(me.engine.as_str(), me.rank, me.instance, nonce_c, u8::from(payload_tags));
        let mut stream = raw(data_address(&self.p_offer.agent_metadata), &transcript);
        let (kind, body) = read_frame(&mut stream);
        assert_eq!(kind, 0x84, "P answers HELLO with CHALLENGE");
        let (nonce_l, mac_l) = (body[..32].try_into().unwrap(), &body[33..]);
        transcript.extend_from_slice(&frame(kind, &body)[..5 + 33]);
        assert!(secret.verify_listener_mac(&transcript, mac_l), "P proved the session");
        stream.write_all(&frame(0x06, &secret.connector_mac(&transcript, mac_l))).unwrap();
        let (out, incoming) = secret.frame_tags(LinkRole::Connector, &nonce_c, &nonce_l, &transcript);
        RawLink { stream, out, incoming, tagged_writes: body[32] & 1 == 1, tagged_data: payload_tags }
    }
}

/// An authenticated data link, frames built by hand.
pub struct RawLink {
    pub stream: TcpStream,
    pub out: FrameTags,
    pub incoming: FrameTags,
    /// P asked for WRITE payloads to be tagged.
    pub tagged_writes: bool,
    /// This side asked for DATA payloads to be tagged.
    pub tagged_data: bool,
}

impl RawLink {
    /// Sends a frame whose body is all control, with its tag.
    pub fn send(&mut self, kind: u8, body: &[u8]) {
        let mut bytes = frame(kind, body);
        let tag = self.out.tag(&bytes);
        bytes.extend_from_slice(&tag);
        self.stream.write_all(&bytes).unwrap();
    }

    /// Sends a WRITE chunk: transfer, pair, P's address, then the data (tagged if P asked).
    pub fn write_chunk(&mut self, transfer: u64, pair: u32, addr: u64, data: &[u8]) {
        let mut head = head(0x03, 20 + data.len());
        head.extend_from_slice(&transfer.to_le_bytes());
        head.extend_from_slice(&pair.to_le_bytes());
        head.extend_from_slice(&addr.to_le_bytes());
        let tag = self.out.tag(&head);
        head.extend_from_slice(&tag);
        head.extend_from_slice(data);
        if self.tagged_writes {
            let tag = self.out.tag(data);
            head.extend_from_slice(&tag);
        }
        self.stream.write_all(&head).unwrap();
    }

    /// Reads one frame and checks its tag (and DATA's payload tag if asked for): kind and body.
    pub fn recv(&mut self) -> (u8, Vec<u8>) {
        let mut header = [0u8; 5];
        self.stream.read_exact(&mut header).unwrap();
        let (kind, len) = parse_head(header);
        let control = if kind == 0x81 { 20 } else { len };
        let mut covered = header.to_vec();
        covered.resize(5 + control, 0);
        self.stream.read_exact(&mut covered[5..]).unwrap();
        let mut tag = [0u8; 16];
        self.stream.read_exact(&mut tag).unwrap();
        assert!(self.incoming.verify(&covered, &tag), "P's frame carries the link's next tag");
        let mut body = covered.split_off(5);
        if control < len {
            let mut data = vec![0u8; len - control];
            self.stream.read_exact(&mut data).unwrap();
            if self.tagged_data {
                self.stream.read_exact(&mut tag).unwrap();
                assert!(self.incoming.verify(&data, &tag), "DATA's bytes carry their tag");
            }
            body.extend_from_slice(&data);
        }
        (kind, body)
    }
}
