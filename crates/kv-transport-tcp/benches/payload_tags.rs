//! What tagging the payload bytes costs (`TcpConfig::payload_tags`): D reads 16 MiB of P's
//! pool between two transports in one process over loopback, untagged (frame heads, addresses
//! and acknowledgements are tagged always) and with a Poly1305 tag over every chunk's bytes.
//!
//! `cargo xtask bench` runs this and prints the time of one read each way and their ratio.

// criterion_group! and criterion_main! generate undocumented items.
#![allow(missing_docs)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kv_core::{
    AgentName, DescriptorPair, EngineId, Handshake, KvLayout, MemoryKind, PeerAddress, PeerEvent, Region, RegionId,
    Role, TransferOp, TransferRequest, TransferStatus, Transport,
};
use kv_transport_tcp::{TcpConfig, TcpTransport};

const LEN: usize = 16 << 20;

/// Page-aligned memory that stays put while the transports use it.
struct Pool {
    buf: Vec<u8>,
    offset: usize,
}

impl Pool {
    fn new(fill: u8) -> Pool {
        let buf = vec![fill; LEN + 4096];
        let offset = buf.as_ptr().align_offset(4096);
        Pool { buf, offset }
    }

    fn addr(&self) -> u64 {
        self.buf[self.offset..].as_ptr() as u64
    }

    fn region(&self, id: u64) -> Region {
        Region { id: RegionId(id), kind: MemoryKind::Host, addr: self.addr(), len: LEN as u64 }
    }
}

fn transport(engine: &str, role: Role, payload_tags: bool) -> TcpTransport {
    let agent = AgentName::new(EngineId::new(engine), 0);
    let offer = Handshake::new(&agent, 1, 1, role, "bench", KvLayout::split_kv(2, 16, 2, 64, kv_core::Dtype::Bfloat16));
    let config = TcpConfig { bind: "127.0.0.1:0".parse().expect("loopback"), payload_tags, ..TcpConfig::default() };
    TcpTransport::new(offer, &config, Arc::new(kv_side_tcp::MonotonicClock::start())).expect("a transport")
}

/// P and D connected, D asking for payload tags when `tags`.
fn pair(p_pool: &Pool, d_pool: &Pool, tags: bool) -> (TcpTransport, TcpTransport, AgentName) {
    let (mut p, mut d) = (transport("prefill", Role::Prefill, false), transport("decode", Role::Decode, tags));
    p.register(&p_pool.region(1)).expect("P's pool");
    d.register(&d_pool.region(2)).expect("D's pool");
    d.connect(&PeerAddress(p.side_channel_addr().to_string())).expect("connect");
    let deadline = Instant::now() + Duration::from_secs(10);
    let (mut peer, mut p_knows) = (None, false);
    while peer.is_none() || !p_knows {
        assert!(Instant::now() < deadline, "no handshake");
        if let Some(PeerEvent::Connected(info)) = d.poll_event() {
            peer = Some(info.agent);
        }
        p_knows |= matches!(p.poll_event(), Some(PeerEvent::Connected(_)));
        std::thread::sleep(Duration::from_micros(100));
    }
    (p, d, peer.expect("connected"))
}

fn read(d: &mut TcpTransport, p: &mut TcpTransport, peer: &AgentName, p_pool: &Pool, d_pool: &Pool) {
    let pairs = vec![DescriptorPair {
        local_region: 0,
        local_addr: d_pool.addr(),
        remote_region: 0,
        remote_addr: p_pool.addr(),
        len: LEN as u64,
    }];
    let request = TransferRequest { op: TransferOp::Read, peer: peer.clone(), pairs, notification: None };
    let id = d.post(request).expect("post");
    loop {
        while p.poll_event().is_some() {}
        match d.poll_transfer(id) {
            TransferStatus::Done => return,
            TransferStatus::InProgress => std::thread::yield_now(),
            TransferStatus::Failed(e) => panic!("the read failed: {e}"),
        }
    }
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("tcp_payload_tags");
    group.throughput(Throughput::Bytes(LEN as u64));
    for (name, tags) in [("untagged", false), ("tagged", true)] {
        let (p_pool, d_pool) = (Pool::new(7), Pool::new(0));
        let (mut p, mut d, peer) = pair(&p_pool, &d_pool, tags);
        group.bench_function(BenchmarkId::new("read_16mib", name), |b| {
            b.iter(|| read(&mut d, &mut p, &peer, &p_pool, &d_pool));
        });
        drop((d, p));
        // The transports wrote D's pool behind the compiler's back: read it afresh.
        assert!(std::hint::black_box(&d_pool.buf)[d_pool.offset..d_pool.offset + LEN].iter().all(|&b| b == 7));
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
