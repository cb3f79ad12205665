//! The data listener treats whoever connects as untrusted: forged, garbled, silent and
//! oversized connections are closed and counted, a peer's ranges outside the registrations
//! get an error and no bytes, and the transport goes on serving its real peer throughout.

mod common;

use std::io::Write;
use std::time::Duration;

use common::{
    agent, closed_by_peer, config, data_capability, drain, duo_with, frame, hello, raw, read_frame, settle, until, Pool,
};
use kv_core::side::SideLimits;
use kv_core::{DescriptorPair, PeerEvent, RefusalCause, TransferOp, TransferRequest, TransferStatus, Transport};
use kv_transport_tcp::TcpConfig;

const LEN: usize = 64 * 1024;

fn quick() -> TcpConfig {
    TcpConfig {
        side_limits: SideLimits { auth_timeout: Duration::from_millis(700), ..SideLimits::default() },
        ..config()
    }
}

/// D reads P's first 4 KiB, and the bytes are P's.
fn real_read_works(duo: &mut common::Duo, p_pool: &Pool, d_pool: &Pool) {
    let pairs = vec![DescriptorPair {
        local_region: 0,
        local_addr: d_pool.addr(0),
        remote_region: 0,
        remote_addr: p_pool.addr(0),
        len: 4096,
    }];
    let id = duo
        .d
        .post(TransferRequest { op: TransferOp::Read, peer: agent("prefill"), pairs, notification: None })
        .unwrap();
    assert_eq!(settle(&mut duo.d, id, &mut duo.p, &mut duo.p_events), TransferStatus::Done);
    assert_eq!(d_pool.bytes()[..4096], p_pool.bytes()[..4096]);
}

fn malformed_from(events: &[PeerEvent], from: &str) -> usize {
    events
        .iter()
        .filter(|e| matches!(e, PeerEvent::Refused { peer: Some(p), cause: RefusalCause::Malformed, .. } if *p == agent(from)))
        .count()
}

#[test]
fn forged_data_connections_are_closed_and_counted_and_the_real_peer_is_still_served() {
    let p_pool = Pool::patterned(1, LEN, 1);
    let d_pool = Pool::new(2, LEN);
    let mut duo = duo_with(&p_pool, &d_pool, quick(), quick());
    let (addr, token) = data_capability(&duo.p_offer.agent_metadata);
    let refused = |duo: &common::Duo| (duo.p.data_status().connections_refused, duo.p.data_status().frames_refused);

    let cases: [(&str, Vec<u8>, (u64, u64)); 5] = [
        ("a wrong token", hello(&[0; 32], "decode", 0, 2), (1, 0)),
        ("garbage", b"GET / HTTP/1.1\r\nHost: kvflow\r\n\r\n".to_vec(), (2, 1)),
        ("silence past the deadline", Vec::new(), (3, 1)),
        ("an agent that is no peer", hello(&token, "mallory", 0, 1), (4, 1)),
        ("a stale incarnation of the peer", hello(&token, "decode", 0, 1), (5, 1)),
    ];
    for (what, bytes, expected) in cases {
        let mut stream = raw(addr, &bytes);
        assert!(closed_by_peer(&mut stream), "{what}: the connection stayed open");
        until(Duration::from_secs(5), what, || refused(&duo) == expected);
        real_read_works(&mut duo, &p_pool, &d_pool);
    }

    // A connection that proves the token and names the real peer, then sends a length far
    // over its kind's bound: closed before anything is read, counted, reported as the peer's.
    let mut bytes = hello(&token, "decode", 0, 2);
    bytes.extend_from_slice(&[0x02, 0xff, 0xff, 0xff, 0xff]);
    let mut stream = raw(addr, &bytes);
    assert!(closed_by_peer(&mut stream), "an oversized length left the connection open");
    until(Duration::from_secs(5), "the oversized frame to be counted", || refused(&duo) == (5, 2));
    until(Duration::from_secs(5), "the refusal to be reported", || {
        drain(&mut duo.p, &mut duo.p_events);
        malformed_from(&duo.p_events, "decode") == 1
    });
    real_read_works(&mut duo, &p_pool, &d_pool);
}

#[test]
fn a_raw_read_or_write_outside_the_registrations_gets_an_error_and_touches_nothing() {
    let p_pool = Pool::patterned(1, LEN, 9);
    let d_pool = Pool::new(2, LEN);
    let mut duo = duo_with(&p_pool, &d_pool, config(), config());
    let (addr, token) = data_capability(&duo.p_offer.agent_metadata);
    let mut stream = raw(addr, &hello(&token, "decode", 0, 2));
    let base = p_pool.addr(0);
    let end = p_pool.addr(LEN);

    // READ transfer 7: before the pool, across its end, and inside it.
    let ranges: [(u64, u64); 3] = [(base - 4096, 16), (end - 8, 16), (base + 100, 16)];
    let mut body = 7u64.to_le_bytes().to_vec();
    body.extend_from_slice(&0u32.to_le_bytes());
    body.extend_from_slice(&(ranges.len() as u32).to_le_bytes());
    for (addr, len) in ranges {
        body.extend_from_slice(&addr.to_le_bytes());
        body.extend_from_slice(&len.to_le_bytes());
    }
    stream.write_all(&frame(0x02, &body)).unwrap();
    for (pair, &(addr, len)) in ranges[..2].iter().enumerate() {
        let (kind, body) = read_frame(&mut stream);
        assert_eq!(kind, 0x82, "range {pair} outside the registrations: RANGE_ERROR, not bytes");
        let mut expected = 7u64.to_le_bytes().to_vec();
        expected.extend_from_slice(&(pair as u32).to_le_bytes());
        expected.extend_from_slice(&addr.to_le_bytes());
        expected.extend_from_slice(&len.to_le_bytes());
        assert_eq!(body, expected);
    }
    let (kind, body) = read_frame(&mut stream);
    assert_eq!(kind, 0x81, "the range inside is served");
    assert_eq!(body[..20], [&7u64.to_le_bytes()[..], &2u32.to_le_bytes(), &0u64.to_le_bytes()].concat()[..]);
    assert_eq!(body[20..], p_pool.bytes()[100..116]);

    // WRITEs before the pool and across its end: refused, acknowledged as such, memory untouched.
    let before = p_pool.bytes().to_vec();
    for (transfer, addr) in [(8u64, base - 4096), (9, end - 8)] {
        let mut chunk = transfer.to_le_bytes().to_vec();
        chunk.extend_from_slice(&0u32.to_le_bytes());
        chunk.extend_from_slice(&addr.to_le_bytes());
        chunk.extend_from_slice(&[0xee; 16]);
        stream.write_all(&frame(0x03, &chunk)).unwrap();
        let mut end_body = transfer.to_le_bytes().to_vec();
        end_body.push(0);
        stream.write_all(&frame(0x04, &end_body)).unwrap();
        let (kind, body) = read_frame(&mut stream);
        assert_eq!(kind, 0x83);
        let mut expected = transfer.to_le_bytes().to_vec();
        expected.push(1);
        expected.extend_from_slice(&0u32.to_le_bytes());
        expected.extend_from_slice(&addr.to_le_bytes());
        expected.extend_from_slice(&16u64.to_le_bytes());
        assert_eq!(body, expected, "WRITE_ACK names the refused range");
    }
    assert_eq!(p_pool.bytes(), &before[..], "a refused write touched memory");
    assert_eq!(duo.p.data_status().ranges_refused, 4);

    // A notification without the peer's session tag is refused, never delivered.
    stream.write_all(&frame(0x05, b"KT not a tagged notification")).unwrap();
    until(Duration::from_secs(5), "the forged notification to be refused", || {
        drain(&mut duo.p, &mut duo.p_events);
        !duo.p_events.iter().all(|e| !matches!(e, PeerEvent::Refused { peer: Some(_), .. }))
    });
    assert!(!duo.p_events.iter().any(|e| matches!(e, PeerEvent::Notification(_))));
    real_read_works(&mut duo, &p_pool, &d_pool);
}

#[test]
fn incoming_data_connections_are_bounded() {
    let p_pool = Pool::patterned(1, LEN, 4);
    let d_pool = Pool::new(2, LEN);
    let p_config = TcpConfig { max_data_connections: 3, ..quick() };
    let mut duo = duo_with(&p_pool, &d_pool, p_config, quick());
    let (addr, _) = data_capability(&duo.p_offer.agent_metadata);
    until(Duration::from_secs(5), "D's data connection", || duo.p.data_status().incoming == 1);
    let silent: Vec<_> = (0..2).map(|_| raw(addr, &[])).collect();
    until(Duration::from_secs(5), "three open connections", || duo.p.data_status().incoming == 3);
    let mut one_more = raw(addr, &[]);
    assert!(closed_by_peer(&mut one_more), "a connection over the bound stayed open");
    assert_eq!(duo.p.data_status().connections_refused, 1);
    real_read_works(&mut duo, &p_pool, &d_pool);
    // The silent ones are closed at the HELLO deadline, and their places are free again.
    until(Duration::from_secs(5), "the silent connections to be closed", || duo.p.data_status().incoming == 1);
    assert_eq!(duo.p.data_status().connections_refused, 3);
    drop(silent);
    let started = std::time::Instant::now();
    let mut again = raw(addr, &[]);
    assert!(closed_by_peer(&mut again));
    assert!(started.elapsed() >= Duration::from_millis(500), "closed at accept, not at the HELLO deadline");
    assert_eq!(duo.p.data_status().connections_refused, 4);
}
