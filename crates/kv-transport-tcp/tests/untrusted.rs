//! The data listener treats whoever connects as untrusted: a data connection must prove the
//! side-channel session of the peer it names, every frame must carry that session's next tag,
//! and a key holder's ranges outside the registrations get an error and no bytes. Forged,
//! replayed, garbled, silent and flooding connections are closed and counted by cause, and the
//! transport goes on serving its real peer throughout.

mod common;

use std::io::Write;
use std::time::{Duration, Instant};

use common::{
    agent, closed_by_peer, config, data_address, drain, duo_with, frame, hello, raw, read_frame, settle, until, Pool,
    RawPeer,
};
use kv_core::side::SideLimits;
use kv_core::{DescriptorPair, PeerEvent, RefusalCause, TransferOp, TransferRequest, TransferStatus, Transport};
use kv_transport_tcp::{DataStatus, TcpConfig};

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

/// A key holder written from the documents alone, handshaked with P as `engine`, once P's
/// engine has taken it in (P serves its data links only then).
fn raw_peer(duo: &mut common::Duo, engine: &str) -> RawPeer {
    let peer = RawPeer::handshake(duo.p.side_channel_addr(), engine, 1);
    until(Duration::from_secs(5), "P to take the raw peer in", || {
        drain(&mut duo.p, &mut duo.p_events);
        duo.p_events.iter().any(|e| matches!(e, PeerEvent::Connected(info) if info.agent == agent(engine)))
    });
    peer
}

fn refused(status: &DataStatus, cause: RefusalCause) -> u64 {
    status.refused_by_cause[cause.index()]
}

fn reported_from(events: &[PeerEvent], from: &str, cause: RefusalCause) -> usize {
    events
        .iter()
        .filter(|e| matches!(e, PeerEvent::Refused { peer: Some(p), cause: c, .. } if *p == agent(from) && *c == cause))
        .count()
}

#[test]
fn a_data_connection_that_cannot_prove_the_session_is_closed_and_counted() {
    let p_pool = Pool::patterned(1, LEN, 1);
    let d_pool = Pool::new(2, LEN);
    let mut duo = duo_with(&p_pool, &d_pool, quick(), quick());
    let addr = data_address(&duo.p_offer.agent_metadata);
    // Everything an eavesdropper on D's data connection saw: D's name, incarnation, a nonce.
    let sniffed = hello("decode", 0, 2, [7; 32], 0);
    let mut version_1 = sniffed.clone();
    version_1[5 + 4] = 1;

    let cases: [(&str, Vec<u8>, RefusalCause); 6] = [
        ("garbage", b"GET / HTTP/1.1\r\nHost: kvflow\r\n\r\n".to_vec(), RefusalCause::Malformed),
        ("a version 1 HELLO", version_1, RefusalCause::Version),
        ("silence past the deadline", Vec::new(), RefusalCause::Timeout),
        ("an agent that is no peer", hello("mallory", 0, 1, [7; 32], 0), RefusalCause::Timeout),
        ("a stale incarnation of the peer", hello("decode", 0, 1, [7; 32], 0), RefusalCause::Stale),
        (
            "D's HELLO replayed with a PROOF that is not the session's",
            [sniffed.clone(), frame(0x06, &[0xab; 32])].concat(),
            RefusalCause::Unauthenticated,
        ),
    ];
    for (what, bytes, cause) in cases {
        let before = duo.p.data_status();
        let mut stream = raw(addr, &bytes);
        assert!(closed_by_peer(&mut stream), "{what}: the connection stayed open");
        until(Duration::from_secs(5), what, || refused(&duo.p.data_status(), cause) == refused(&before, cause) + 1);
        assert_eq!(duo.p.data_status().connections_refused, before.connections_refused + 1, "{what}: one refusal");
        real_read_works(&mut duo, &p_pool, &d_pool);
    }

    // The replay got a CHALLENGE (it named a live peer) and nothing more: no DATA, no ack.
    let sent_before = duo.p.data_status().bytes_sent;
    let mut stream = raw(addr, &sniffed);
    let (kind, body) = read_frame(&mut stream);
    assert_eq!((kind, body.len()), (0x84, 65), "a CHALLENGE, which proves P's session to D alone");
    // Frames an eavesdropper recorded after D's PROOF: tagged under a session it cannot make.
    stream.write_all(&frame(0x06, &[0; 32])).unwrap();
    let mut read = 7u64.to_le_bytes().to_vec();
    read.extend_from_slice(&0u32.to_le_bytes());
    read.extend_from_slice(&1u32.to_le_bytes());
    read.extend_from_slice(&p_pool.addr(0).to_le_bytes());
    read.extend_from_slice(&4096u64.to_le_bytes());
    let _ = stream.write_all(&[frame(0x02, &read), vec![0; 16]].concat());
    assert!(closed_by_peer(&mut stream), "a forged PROOF left the connection open");
    assert_eq!(duo.p.data_status().bytes_sent, sent_before, "nothing was served to the replay");
}

#[test]
fn a_key_holder_gets_errors_for_ranges_outside_the_registrations_and_forged_frames_end_its_link() {
    let p_pool = Pool::patterned(1, LEN, 9);
    let d_pool = Pool::new(2, LEN);
    let mut duo = duo_with(&p_pool, &d_pool, config(), config());
    let peer = raw_peer(&mut duo, "mallory");
    let mut link = peer.link(true);
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
    link.send(0x02, &body);
    for (pair, &(addr, len)) in ranges[..2].iter().enumerate() {
        let (kind, body) = link.recv();
        assert_eq!(kind, 0x82, "range {pair} outside the registrations: RANGE_ERROR, not bytes");
        let mut expected = 7u64.to_le_bytes().to_vec();
        expected.extend_from_slice(&(pair as u32).to_le_bytes());
        expected.extend_from_slice(&addr.to_le_bytes());
        expected.extend_from_slice(&len.to_le_bytes());
        assert_eq!(body, expected);
    }
    let (kind, body) = link.recv();
    assert_eq!(kind, 0x81, "the range inside is served");
    assert_eq!(body[..20], [&7u64.to_le_bytes()[..], &2u32.to_le_bytes(), &0u64.to_le_bytes()].concat()[..]);
    assert_eq!(body[20..], p_pool.bytes()[100..116]);

    // WRITEs before the pool and across its end: refused, acknowledged as such, memory untouched.
    let before = p_pool.bytes().to_vec();
    for (transfer, addr) in [(8u64, base - 4096), (9, end - 8)] {
        link.write_chunk(transfer, 0, addr, &[0xee; 16]);
        let mut end_body = transfer.to_le_bytes().to_vec();
        end_body.push(0);
        link.send(0x04, &end_body);
        let (kind, body) = link.recv();
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
    link.send(0x05, b"KT not a tagged notification");
    until(Duration::from_secs(5), "the forged notification to be refused", || {
        drain(&mut duo.p, &mut duo.p_events);
        reported_from(&duo.p_events, "mallory", RefusalCause::Unauthenticated) == 1
    });
    assert!(!duo.p_events.iter().any(|e| matches!(e, PeerEvent::Notification(_))));

    // A frame without the link's next tag (here: a READ with a made-up one) ends the link,
    // counted as forged and reported as the peer's.
    let mut forged = frame(0x02, &body_of_read(base, 16));
    forged.extend_from_slice(&[0; 16]);
    link.stream.write_all(&forged).unwrap();
    assert!(closed_by_peer(&mut link.stream), "a forged frame left the link open");
    until(Duration::from_secs(5), "the forged frame to be counted", || duo.p.data_status().frames_forged == 1);
    until(Duration::from_secs(5), "the forgery to be reported", || {
        drain(&mut duo.p, &mut duo.p_events);
        reported_from(&duo.p_events, "mallory", RefusalCause::Unauthenticated) == 2
    });
    real_read_works(&mut duo, &p_pool, &d_pool);
}

fn body_of_read(addr: u64, len: u64) -> Vec<u8> {
    let mut body = 1u64.to_le_bytes().to_vec();
    body.extend_from_slice(&0u32.to_le_bytes());
    body.extend_from_slice(&1u32.to_le_bytes());
    body.extend_from_slice(&addr.to_le_bytes());
    body.extend_from_slice(&len.to_le_bytes());
    body
}

#[test]
fn payload_tags_refuse_bytes_altered_on_the_way() {
    let p_pool = Pool::patterned(1, LEN, 5);
    let d_pool = Pool::new(2, LEN);
    let p_config = TcpConfig { payload_tags: true, ..config() };
    let mut duo = duo_with(&p_pool, &d_pool, p_config, config());
    let peer = raw_peer(&mut duo, "mallory");
    // A READ with payload tags asked for: DATA carries a tag over its bytes (checked by recv).
    let mut link = peer.link(true);
    assert!(link.tagged_writes, "P asked for tagged WRITE payloads");
    link.send(0x02, &body_of_read(p_pool.addr(64), 32));
    let (kind, body) = link.recv();
    assert_eq!((kind, &body[20..]), (0x81, &p_pool.bytes()[64..96]));
    // A WRITE chunk whose bytes differ from what its tag covers: refused as forged.
    let addr = p_pool.addr(0);
    let mut head = common::head(0x03, 20 + 16);
    head.extend_from_slice(&3u64.to_le_bytes());
    head.extend_from_slice(&0u32.to_le_bytes());
    head.extend_from_slice(&addr.to_le_bytes());
    let tag = link.out.tag(&head);
    head.extend_from_slice(&tag);
    head.extend_from_slice(&[0xee; 16]);
    let payload_tag = link.out.tag(&[0xdd; 16]);
    head.extend_from_slice(&payload_tag);
    link.stream.write_all(&head).unwrap();
    assert!(closed_by_peer(&mut link.stream), "an altered payload left the link open");
    until(Duration::from_secs(5), "the altered payload to be counted", || duo.p.data_status().frames_forged == 1);
    real_read_works(&mut duo, &p_pool, &d_pool);
}

#[test]
fn a_flood_of_silent_connections_never_locks_the_real_peer_out() {
    let p_pool = Pool::patterned(1, LEN, 4);
    let d_pool = Pool::new(2, LEN);
    // Four a stage, three a stage from one address: a small budget a flood exceeds at once.
    let limits = SideLimits {
        auth_timeout: Duration::from_secs(5),
        max_unauthenticated: 4,
        max_unauthenticated_per_source: 3,
        ..SideLimits::default()
    };
    let p_config = TcpConfig { side_limits: limits, ..config() };
    let mut duo = duo_with(&p_pool, &d_pool, p_config, config());
    let addr = data_address(&duo.p_offer.agent_metadata);
    until(Duration::from_secs(5), "D's data connection", || duo.p.data_status().incoming == 1);
    // 200 silent connections, each displacing an older one: at most 3 stay pending, no thread
    // is spent on any, and each displaced one is closed and counted.
    let started = Instant::now();
    let mut flood: Vec<_> = (0..200).map(|_| raw(addr, &[])).collect();
    until(Duration::from_secs(5), "the flood to be displaced", || {
        refused(&duo.p.data_status(), RefusalCause::Overloaded) == 197
    });
    assert!(duo.p.data_status().pending_by_stage.iter().sum::<usize>() <= 3, "{:?}", duo.p.data_status());
    assert!(started.elapsed() < Duration::from_secs(4), "displaced at once, not at the deadline");
    for stream in flood.iter_mut().take(197) {
        assert!(closed_by_peer(stream), "a displaced connection stayed open");
    }
    // A real data link still opens and is served while the flood goes on: D's own link breaks
    // and D opens a new one, which says HELLO and so outranks every silent connection.
    let peer = raw_peer(&mut duo, "probe");
    let started = Instant::now();
    flood.extend((0..50).map(|_| raw(addr, &[])));
    let mut link = peer.link(false);
    link.send(0x02, &body_of_read(p_pool.addr(0), 16));
    let (kind, body) = link.recv();
    assert_eq!((kind, &body[20..]), (0x81, &p_pool.bytes()[..16]));
    assert!(started.elapsed() < Duration::from_secs(1), "the key holder waited {:?}", started.elapsed());
    real_read_works(&mut duo, &p_pool, &d_pool);
}

#[test]
fn a_peer_session_holds_a_bounded_number_of_links() {
    let p_pool = Pool::patterned(1, LEN, 6);
    let d_pool = Pool::new(2, LEN);
    let mut duo = duo_with(&p_pool, &d_pool, config(), config());
    let peer = raw_peer(&mut duo, "mallory");
    let bound = kv_transport_tcp::MAX_LINKS_PER_PEER;
    let mut links: Vec<_> = (0..bound + 2).map(|_| peer.link(false)).collect();
    // The newest are served; the two oldest were closed to make room.
    for link in links.iter_mut().skip(2) {
        link.send(0x02, &body_of_read(p_pool.addr(0), 8));
        assert_eq!(link.recv().0, 0x81);
    }
    for link in links.iter_mut().take(2) {
        assert!(closed_by_peer(&mut link.stream), "a link past the bound stayed open");
    }
    until(Duration::from_secs(5), "D's and the bound's links", || duo.p.data_status().incoming == 1 + bound);
    real_read_works(&mut duo, &p_pool, &d_pool);
}

#[test]
fn a_key_holder_that_floods_notifications_is_held_back_and_nothing_is_dropped() {
    let p_pool = Pool::patterned(1, LEN, 7);
    let d_pool = Pool::new(2, LEN);
    let mut duo = duo_with(&p_pool, &d_pool, config(), config());
    let mut peer = raw_peer(&mut duo, "mallory");
    // 200 notifications of 60,000 bytes (12 MB), while P's engine takes nothing in.
    let frames: Vec<Vec<u8>> =
        (0..200u32).map(|i| peer.side.seal_notification(&peer.p, &[i as u8; 60_000]).unwrap()).collect();
    let mut link = peer.link(false);
    let sender = std::thread::spawn(move || {
        for sealed in frames {
            link.send(0x05, &sealed);
        }
        link
    });
    let bound = kv_transport_tcp::MAX_QUEUED_NOTIFICATION_BYTES_PER_PEER;
    until(Duration::from_secs(30), "the flood to reach the bound", || {
        duo.p.data_status().queued_notification_bytes > bound - 2 * 60_100
    });
    // It goes no further, however long the engine takes nothing in.
    std::thread::sleep(Duration::from_millis(500));
    let queued = duo.p.data_status().queued_notification_bytes;
    assert!(queued <= bound, "{queued} bytes of one peer's notifications queued (bound {bound})");
    assert!(!sender.is_finished(), "the sender was held back");
    // As the engine takes them in, the rest arrive: none is dropped.
    let mut received = 0;
    until(Duration::from_secs(20), "every notification", || {
        let mut events = Vec::new();
        drain(&mut duo.p, &mut events);
        received +=
            events.iter().filter(|e| matches!(e, PeerEvent::Notification(n) if n.payload.len() == 60_000)).count();
        received == 200
    });
    assert_eq!(duo.p.data_status().events_dropped, 0);
    drop(sender.join().unwrap());
    real_read_works(&mut duo, &p_pool, &d_pool);
}
