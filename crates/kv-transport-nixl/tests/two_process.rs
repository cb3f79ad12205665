//! Real NIXL/UCX between two processes on loopback: reads and writes of 64 blocks with a
//! notification, a large read in pieces that a small one posted after it overtakes, remote ranges checked against the peer's registrations, handshake refusals on
//! both sides, bad handshake bytes, a killed peer (reported lost within a second, waking the
//! engine parked on the transport's waker), the cluster key (only its holders handshake, and
//! their notifications open), a peer that sends faster than the engine takes in (dropped beyond
//! the bound, and told), a peer that keeps outrunning it (cut off, while another peer's
//! notifications are taken in), a transport made, used and dropped inside a tokio runtime and on
//! a plain thread, and one made before the runtime was prepared.
//!
//! Each test runs as the parent; it starts this test binary again as the child (selected by
//! `KVFLOW_TEST_ROLE`), so that each NIXL agent has its own process (the runtime test keeps
//! both in one).

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Wake, Waker};
use std::time::{Duration, Instant};

use common::*;
use kv_core::{
    DescriptorPair, Handshake, Message, PeerAddress, PeerEvent, PreparedTransfer, RequestId, Role, TransferOp,
    TransferRequest, TransferStatus, Transport, TransportError,
};
use kv_transport_nixl::{KeySource, NixlConfig, NixlError, NixlTransport};

const BLOCKS: usize = 64;

fn role() -> Option<String> {
    std::env::var(ROLE).ok()
}

/// The listener child: serves one peer, then reports what it received and exits.
/// `KVFLOW_TEST_FILL` makes it fill its pool first (it is the source of a read).
fn listener_child(role: Role) {
    let mut pool = HostPool::new(BLOCKS);
    let fill = std::env::var("KVFLOW_TEST_FILL").is_ok();
    if fill {
        for b in 0..BLOCKS {
            pool.fill(b, 7);
        }
    }
    let block_tokens = std::env::var("KVFLOW_TEST_BLOCK_TOKENS").map_or(16, |v| v.parse().unwrap());
    let tp = std::env::var("KVFLOW_TEST_TP").map_or(1, |v| v.parse().unwrap());
    let mut t = transport(offer("listener", role, tp, block_tokens, &pool, BLOCKS as u32), &pool);
    println!("READY {}", t.side_channel_addr().port());
    // The connection after which it naps (the first by default).
    let nap_at: usize = std::env::var("KVFLOW_TEST_NAP_AT").map_or(1, |v| v.parse().unwrap());
    let mut connections = 0;
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        while let Some(event) = t.poll_event() {
            match event {
                PeerEvent::Connected(info) => {
                    println!("CONNECTED {}", info.agent);
                    connections += 1;
                    // An engine busy elsewhere: NIXL takes in what the peer sends meanwhile.
                    if let Ok(nap) = std::env::var("KVFLOW_TEST_NAP_MS").map(|n| n.parse().unwrap()) {
                        if connections == nap_at {
                            std::thread::sleep(Duration::from_millis(nap));
                        }
                    }
                }
                PeerEvent::CutOff { peer, reason } => println!("CUT OFF {peer} {}", reason.as_str()),
                PeerEvent::Refused { peer, cause, reason } => {
                    println!("REFUSED {}: {cause:?} {reason}", peer.map_or_else(|| "?".to_owned(), |p| p.to_string()))
                }
                PeerEvent::Lost(agent) => println!("LOST {agent}"),
                PeerEvent::ConnectFailed { .. } => {}
                PeerEvent::Notification(note) => {
                    let message =
                        Message::decode(&note.payload).map(|m| format!("{m:?}")).unwrap_or_else(|e| e.to_string());
                    // A write's notification arrives after its bytes: check them now.
                    let verified = fill || (0..BLOCKS).all(|b| pool.holds(b, BLOCKS - 1 - b, 9));
                    println!("NOTIFIED {} {message} verified={verified}", note.from);
                }
            }
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn start_listener(
    test: &str,
    role: Role,
    env: &[(&str, String)],
) -> (std::process::Child, std::io::BufReader<std::process::ChildStdout>, u16) {
    let role_name = match role {
        Role::Prefill => "prefill",
        Role::Decode => "decode",
    };
    let (child, mut out) = spawn_child(test, role_name, env);
    let port: u16 = expect_line(&mut out, "READY").parse().unwrap();
    (child, out, port)
}

fn child_main() -> bool {
    match role().as_deref() {
        Some("prefill") => listener_child(Role::Prefill),
        Some("decode") => listener_child(Role::Decode),
        Some("unprepared") => unprepared_child(),
        Some("flooder") => flooder_child(),
        _ => return false,
    }
    true
}

/// A D that connects to the P at `KVFLOW_TEST_P_PORT` and sends it 600 notifications of
/// 60 000 bytes (36 MB) as fast as it can, then says how many went and whether P closed its
/// side channel.
fn flooder_child() {
    let port: u16 = std::env::var("KVFLOW_TEST_P_PORT").unwrap().parse().unwrap();
    let pool = HostPool::new(1);
    let mut t = transport(offer("flooder", Role::Decode, 1, 16, &pool, 1), &pool);
    let info = connect(&mut t, port);
    println!("FLOODING");
    let (mut sent, mut failed) = (0, 0);
    for i in 0..600 {
        match t.send_notification(&info.agent, &vec![i as u8; 60_000]) {
            Ok(()) => sent += 1,
            Err(_) => failed += 1,
        }
    }
    println!("SENT {sent} FAILED {failed}");
    let deadline = Instant::now() + Duration::from_secs(20);
    let closed = loop {
        match next_event(&mut t, deadline.saturating_duration_since(Instant::now())) {
            Some(PeerEvent::Lost(agent)) if agent == info.agent => break true,
            Some(_) => {}
            None => break false,
        }
    };
    println!("P CLOSED {closed}");
}

/// A fresh process that makes a transport without preparing the runtime first.
fn unprepared_child() {
    let pool = HostPool::new(1);
    let config = NixlConfig { bind: "127.0.0.1:0".parse().unwrap(), ..NixlConfig::default() };
    match NixlTransport::new(offer("early", Role::Prefill, 1, 16, &pool, 1), &config, clock()) {
        Err(e) => println!("ERROR {e:?}"),
        Ok(_) => println!("ERROR none: the transport was made"),
    }
}

fn connect(t: &mut kv_transport_nixl::NixlTransport, port: u16) -> kv_core::PeerInfo {
    t.connect(&PeerAddress(format!("127.0.0.1:{port}"))).unwrap();
    match next_event(t, Duration::from_secs(10)) {
        Some(PeerEvent::Connected(info)) => *info,
        other => panic!("expected a connection, got {other:?}"),
    }
}

/// Pairs local block `l` with remote block `r`, one descriptor each (blocks are reversed so
/// that nothing lines up by accident).
fn pairs(local: &HostPool, remote: &kv_core::RegionBase) -> Vec<DescriptorPair> {
    (0..BLOCKS)
        .map(|b| DescriptorPair {
            local_region: 0,
            local_addr: local.base().addr + (b * BLOCK_BYTES) as u64,
            remote_region: 0,
            remote_addr: remote.addr + ((BLOCKS - 1 - b) * BLOCK_BYTES) as u64,
            len: BLOCK_BYTES as u64,
        })
        .collect()
}

/// A P child with its pool filled, and D connected to it with an empty pool of its own.
fn reader_of_filled_p(
    test: &str,
) -> (
    std::process::Child,
    std::io::BufReader<std::process::ChildStdout>,
    HostPool,
    kv_transport_nixl::NixlTransport,
    kv_core::PeerInfo,
) {
    let (child, out, port) = start_listener(test, Role::Prefill, &[("KVFLOW_TEST_FILL", "1".into())]);
    let pool = HostPool::new(BLOCKS);
    let mut d = transport(offer("decode0", Role::Decode, 1, 16, &pool, BLOCKS as u32), &pool);
    let info = connect(&mut d, port);
    (child, out, pool, d, info)
}

/// D's block b holds what P filled its block BLOCKS-1-b with.
fn assert_reversed_copy_of_p(pool: &HostPool) {
    for b in 0..BLOCKS {
        assert!(pool.holds(b, BLOCKS - 1 - b, 7), "block {b} differs from P's block {}", BLOCKS - 1 - b);
    }
}

fn wait_done(t: &mut kv_transport_nixl::NixlTransport, id: kv_core::TransferId) {
    let start = Instant::now();
    loop {
        match t.poll_transfer(id) {
            TransferStatus::Done => return,
            TransferStatus::InProgress => {
                assert!(start.elapsed() < Duration::from_secs(30), "transfer did not finish in 30 s");
                std::thread::sleep(Duration::from_micros(200));
            }
            TransferStatus::Failed(e) => panic!("transfer failed: {e}"),
        }
    }
}

#[test]
fn d_reads_64_blocks_from_p_and_p_is_notified() {
    const NAME: &str = "d_reads_64_blocks_from_p_and_p_is_notified";
    if child_main() || !nixl_or_skip(NAME) {
        return;
    }
    let _serial = serial();
    let (mut child, mut out, pool, mut d, info) = reader_of_filled_p(NAME);
    // P's handshake listed its registrations: a range beyond them is refused before NIXL sees it.
    let beyond = info.handshake.regions[0].addr + info.handshake.regions[0].len;
    let mut stray = pairs(&pool, &info.handshake.regions[0]);
    stray[3].remote_addr = beyond;
    let request = TransferRequest { op: TransferOp::Read, peer: info.agent.clone(), pairs: stray, notification: None };
    let not_registered = TransportError::NotRegistered { side: "remote", addr: beyond, len: BLOCK_BYTES as u64 };
    assert_eq!(d.post(request), Err(not_registered.clone()));
    assert_eq!(d.prepare(Some(&info.agent), &[(beyond, BLOCK_BYTES as u64)]), Err(not_registered));
    let completion = Message::Completion { request: RequestId::new("r1"), expected_consumers: 1 }.encode().unwrap();
    let request = TransferRequest {
        op: TransferOp::Read,
        peer: info.agent.clone(),
        pairs: pairs(&pool, &info.handshake.regions[0]),
        notification: Some(completion),
    };
    let id = d.post(request).unwrap();
    wait_done(&mut d, id);
    assert_reversed_copy_of_p(&pool);
    let note = expect_line(&mut out, "NOTIFIED");
    assert!(note.starts_with("decode0/tp0 Completion"), "{note}");
    assert!(note.contains("\"r1\""), "{note}");
    child.kill().ok();
    child.wait().ok();
}

#[test]
fn d_reads_by_prepared_block_indices_and_p_is_notified() {
    const NAME: &str = "d_reads_by_prepared_block_indices_and_p_is_notified";
    if child_main() || !nixl_or_skip(NAME) {
        return;
    }
    let _serial = serial();
    let (mut child, mut out, pool, mut d, info) = reader_of_filled_p(NAME);
    // Each side's blocks prepared once; the transfer names block indices only.
    let blocks = |base: u64| -> Vec<(u64, u64)> {
        (0..BLOCKS as u64).map(|b| (base + b * BLOCK_BYTES as u64, BLOCK_BYTES as u64)).collect()
    };
    let local = d.prepare(None, &blocks(pool.base().addr)).unwrap();
    let remote = d.prepare(Some(&info.agent), &blocks(info.handshake.regions[0].addr)).unwrap();
    let completion = Message::Completion { request: RequestId::new("r3"), expected_consumers: 1 }.encode().unwrap();
    let request = PreparedTransfer {
        op: TransferOp::Read,
        peer: info.agent.clone(),
        local,
        local_indices: (0..BLOCKS as u32).collect(),
        remote,
        remote_indices: (0..BLOCKS as u32).rev().collect(),
        notification: Some(completion),
    };
    // A list prepared for the local side cannot stand for the peer's.
    let mut wrong = request.clone();
    wrong.remote = local;
    assert!(d.post_prepared(wrong).is_err());
    let id = d.post_prepared(request).unwrap();
    wait_done(&mut d, id);
    assert_reversed_copy_of_p(&pool);
    let note = expect_line(&mut out, "NOTIFIED");
    assert!(note.starts_with("decode0/tp0 Completion") && note.contains("\"r3\""), "{note}");
    child.kill().ok();
    child.wait().ok();
}

/// Host memory moves inside NIXL's post over UCX's shared memory, so a large transfer goes in
/// pieces, one more at each poll: a small read posted after a large one is not held behind the
/// large one's copy, and P hears of the large read once, after its last piece.
#[test]
fn a_large_read_goes_in_pieces_so_a_small_one_posted_after_it_ends_first() {
    const NAME: &str = "a_large_read_goes_in_pieces_so_a_small_one_posted_after_it_ends_first";
    if child_main() || !nixl_or_skip(NAME) {
        return;
    }
    let _serial = serial();
    let (mut child, mut out, port) = start_listener(NAME, Role::Prefill, &[("KVFLOW_TEST_FILL", "1".into())]);
    let pool = HostPool::new(BLOCKS);
    // Pieces of two and a half blocks (pairs are cut inside a block), one posted a call.
    let piece = Some(BLOCK_BYTES as u64 * 5 / 2);
    let config = NixlConfig { post_piece_bytes: piece, post_piece_budget: Duration::ZERO, ..test_config() };
    let mut d = transport_config(offer("decode0", Role::Decode, 1, 16, &pool, BLOCKS as u32), &pool, config);
    let info = connect(&mut d, port);
    let all = pairs(&pool, &info.handshake.regions[0]);
    let completion =
        |id: &str| Some(Message::Completion { request: RequestId::new(id), expected_consumers: 1 }.encode().unwrap());
    let read = |pairs: &[DescriptorPair], id: &str| TransferRequest {
        op: TransferOp::Read,
        peer: info.agent.clone(),
        pairs: pairs.to_vec(),
        notification: completion(id),
    };
    let large = d.post(read(&all[..60], "large")).unwrap();
    let small = d.post(read(&all[60..], "small")).unwrap();
    wait_done(&mut d, small);
    assert!(matches!(d.poll_transfer(large), TransferStatus::InProgress), "24 pieces cannot end in one poll");
    let first = expect_line(&mut out, "NOTIFIED");
    assert!(first.contains("\"small\""), "P heard of the large read before its last piece: {first}");
    wait_done(&mut d, large);
    let second = expect_line(&mut out, "NOTIFIED");
    assert!(second.contains("\"large\""), "{second}");
    assert_reversed_copy_of_p(&pool);
    child.kill().ok();
    child.wait().ok();
}

#[test]
fn p_writes_64_blocks_into_d_and_d_is_notified() {
    const NAME: &str = "p_writes_64_blocks_into_d_and_d_is_notified";
    if child_main() || !nixl_or_skip(NAME) {
        return;
    }
    let _serial = serial();
    let (mut child, mut out, port) = start_listener(NAME, Role::Decode, &[]);
    let mut pool = HostPool::new(BLOCKS);
    for b in 0..BLOCKS {
        pool.fill(b, 9);
    }
    let mut p = transport(offer("prefill0", Role::Prefill, 1, 16, &pool, BLOCKS as u32), &pool);
    let info = connect(&mut p, port);
    let completion = Message::Completion { request: RequestId::new("r2"), expected_consumers: 1 }.encode().unwrap();
    // Local block b goes to the peer's block BLOCKS-1-b: the child checks exactly that.
    let request = TransferRequest {
        op: TransferOp::Write,
        peer: info.agent.clone(),
        pairs: pairs(&pool, &info.handshake.regions[0]),
        notification: Some(completion),
    };
    let id = p.post(request).unwrap();
    wait_done(&mut p, id);
    let note = expect_line(&mut out, "NOTIFIED");
    assert!(note.starts_with("prefill0/tp0 Completion"), "{note}");
    assert!(note.ends_with("verified=true"), "D's blocks differ from what P wrote: {note}");
    child.kill().ok();
    child.wait().ok();
}

#[test]
fn mismatched_handshakes_fail_on_both_sides_and_the_listener_keeps_serving() {
    const NAME: &str = "mismatched_handshakes_fail_on_both_sides_and_the_listener_keeps_serving";
    if child_main() || !nixl_or_skip(NAME) {
        return;
    }
    let _serial = serial();
    let env = [("KVFLOW_TEST_BLOCK_TOKENS", "32".to_owned()), ("KVFLOW_TEST_TP", "2".to_owned())];
    let (mut child, mut out, port) = start_listener(NAME, Role::Prefill, &env);
    let pool = HostPool::new(4);
    // (what differs, the offer, text both sides' errors must hold)
    let mut cases: Vec<(&str, kv_core::Handshake, &str)> = Vec::new();
    cases.push((
        "block size",
        offer("decode-bs", Role::Decode, 1, 24, &pool, 4),
        "neither the prefill block of 32 tokens nor the decode block of 24 tokens is a multiple of the other",
    ));
    let mut layout = offer("decode-layout", Role::Decode, 1, 32, &pool, 4);
    layout.layout.head_dim = 128;
    layout.compat_hash = kv_core::wire::compatibility_hash(&layout.model, &layout.layout);
    cases.push(("layout", layout, "kv layout mismatch in head_dim: prefill 64, decode 128"));
    cases.push((
        "tp",
        offer("decode-tp", Role::Decode, 3, 32, &pool, 4),
        "tensor-parallel sizes do not divide: prefill 2, decode 3",
    ));
    // An offer whose own version is not its frame's (wire protocol 3 refuses it as malformed;
    // a frame of another version is refused by the codec, naming both: kv-core's wire tests).
    let mut version = offer("decode-version", Role::Decode, 1, 32, &pool, 4);
    version.protocol_version = 9;
    let frame = kv_core::wire::PROTOCOL_VERSION;
    let malformed = format!("malformed handshake: protocol_version 9 in a frame of version {frame}");
    cases.push(("version", version, &malformed));
    for (what, offer, text) in cases {
        let mut d = transport(offer, &pool);
        d.connect(&PeerAddress(format!("127.0.0.1:{port}"))).unwrap();
        match next_event(&mut d, Duration::from_secs(10)) {
            Some(PeerEvent::ConnectFailed { error, .. }) => {
                assert!(error.to_string().contains(text), "{what}: D's error {error} does not say {text:?}")
            }
            other => panic!("{what}: expected a refusal on D, got {other:?}"),
        }
        let refused = expect_line(&mut out, "REFUSED");
        assert!(refused.contains(text), "{what}: P's error {refused} does not say {text:?}");
    }
    // The listener still serves a compatible peer.
    let mut d = transport(offer("decode-ok", Role::Decode, 1, 32, &pool, 4), &pool);
    let info = connect(&mut d, port);
    assert_eq!(info.agent.engine.as_str(), "listener");
    child.kill().ok();
    child.wait().ok();
}

#[test]
fn malformed_and_oversized_handshakes_get_an_error_and_no_crash() {
    const NAME: &str = "malformed_and_oversized_handshakes_get_an_error_and_no_crash";
    if child_main() || !nixl_or_skip(NAME) {
        return;
    }
    let _serial = serial();
    let (mut child, mut out, port) = start_listener(NAME, Role::Prefill, &[]);
    // The listener answers bad bytes with an ERROR frame (kind 5) that says why, and closes.
    let refusal = |bytes: &[u8]| -> String {
        let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(bytes).unwrap();
        let mut len = [0u8; 4];
        s.read_exact(&mut len).unwrap();
        let mut body = vec![0; u32::from_be_bytes(len) as usize];
        s.read_exact(&mut body).unwrap();
        assert_eq!(body[0], 5, "not an ERROR frame: {body:?}");
        String::from_utf8_lossy(&body[1..]).into_owned()
    };
    let mut garbage = 13u32.to_be_bytes().to_vec();
    garbage.extend_from_slice(b"not a message");
    let answer = refusal(&garbage);
    assert!(answer.contains("unknown frame kind"), "{answer}");
    let answer = refusal(&u32::MAX.to_be_bytes());
    assert!(
        answer.contains("frame of 4294967295 bytes exceeds the 256-byte limit while waiting for HELLO"),
        "{answer}"
    );
    for _ in 0..2 {
        let refused = expect_line(&mut out, "REFUSED");
        assert!(refused.starts_with("?:"), "a refusal before HELLO names nobody: {refused}");
    }
    // Still serving.
    let pool = HostPool::new(4);
    let mut d = transport(offer("decode0", Role::Decode, 1, 16, &pool, 4), &pool);
    connect(&mut d, port);
    assert_eq!(expect_line(&mut out, "CONNECTED"), "decode0/tp0");
    child.kill().ok();
    child.wait().ok();
}

/// Unparks the test's thread and remembers that it did.
struct Flag(std::thread::Thread, AtomicBool);

impl Wake for Flag {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.1.store(true, Ordering::SeqCst);
        self.0.unpark();
    }
}

#[test]
fn a_killed_p_wakes_the_parked_engine_and_is_reported_lost_within_a_second() {
    const NAME: &str = "a_killed_p_wakes_the_parked_engine_and_is_reported_lost_within_a_second";
    if child_main() || !nixl_or_skip(NAME) {
        return;
    }
    let _serial = serial();
    let (mut child, _out, port) = start_listener(NAME, Role::Prefill, &[]);
    let pool = HostPool::new(4);
    let mut d = transport(offer("decode0", Role::Decode, 1, 16, &pool, 4), &pool);
    let info = connect(&mut d, port);
    while d.poll_event().is_some() {}
    let flag = Arc::new(Flag(std::thread::current(), false.into()));
    d.set_waker(Waker::from(flag.clone()));
    assert!(!flag.1.load(Ordering::SeqCst), "nothing was queued, so nothing woke");
    // SIGKILL: no goodbye; only the closed side channel tells.
    let killed = Instant::now();
    child.kill().unwrap();
    child.wait().unwrap();
    // The engine waits without polling: only the transport's waker can end this early.
    while !flag.1.load(Ordering::SeqCst) && killed.elapsed() < Duration::from_secs(2) {
        std::thread::park_timeout(Duration::from_secs(2).saturating_sub(killed.elapsed()));
    }
    let woken = killed.elapsed();
    assert!(flag.1.load(Ordering::SeqCst), "the waker was not woken in 2 s");
    assert!(woken < Duration::from_secs(1), "woken after {woken:?}");
    match d.poll_event() {
        Some(PeerEvent::Lost(agent)) => assert_eq!(agent, info.agent),
        other => panic!("woken, but the next event is {other:?}, not the peer lost"),
    }
}

#[test]
fn a_peer_that_sends_faster_than_the_engine_takes_in_is_dropped_beyond_the_bound_and_told() {
    const NAME: &str = "a_peer_that_sends_faster_than_the_engine_takes_in_is_dropped_beyond_the_bound_and_told";
    if child_main() || !nixl_or_skip(NAME) {
        return;
    }
    let _serial = serial();
    // P naps for 5 s after the handshake while D sends 200 notifications of 60 000 bytes
    // (12 MB): P's engine then takes in what fits its per-peer bound, and hears of the rest.
    let (mut child, mut out, port) = start_listener(NAME, Role::Prefill, &[("KVFLOW_TEST_NAP_MS", "5000".into())]);
    let pool = HostPool::new(4);
    let mut d = transport(offer("decode0", Role::Decode, 1, 16, &pool, 4), &pool);
    let info = connect(&mut d, port);
    assert_eq!(expect_line(&mut out, "CONNECTED"), "decode0/tp0");
    let (sent, len) = (200, 60_000);
    let start = Instant::now();
    for i in 0..sent {
        d.send_notification(&info.agent, &vec![i as u8; len]).unwrap();
    }
    assert!(start.elapsed() < Duration::from_secs(4), "sending took {:?}, not within P's nap", start.elapsed());
    let bound = kv_transport_nixl::MAX_QUEUED_NOTIFICATION_BYTES_PER_PEER / len;
    let mut delivered = 0;
    let refused = loop {
        let line = expect_line(&mut out, "");
        if line.starts_with("NOTIFIED") {
            delivered += 1;
            assert!(delivered <= bound, "{delivered} notifications of {len} bytes queued at once");
        } else if let Some(refused) = line.strip_prefix("REFUSED ") {
            break refused.to_owned();
        }
    };
    assert_eq!(delivered, bound, "the first {bound} fit the bound, and came first");
    let dropped = format!("decode0/tp0: Overloaded {} notifications from decode0/tp0 dropped unread", sent - bound);
    assert!(refused.starts_with(&dropped), "{refused}");
    // Taken in, they make room: the next one is delivered.
    let completion = Message::Completion { request: RequestId::new("r1"), expected_consumers: 1 }.encode().unwrap();
    d.send_notification(&info.agent, &completion).unwrap();
    let note = expect_line(&mut out, "NOTIFIED");
    assert!(note.starts_with("decode0/tp0 Completion"), "{note}");
    child.kill().ok();
    child.wait().ok();
}

#[test]
fn a_peer_whose_notifications_outrun_the_engine_is_cut_off_and_the_others_are_served() {
    const NAME: &str = "a_peer_whose_notifications_outrun_the_engine_is_cut_off_and_the_others_are_served";
    if child_main() || !nixl_or_skip(NAME) {
        return;
    }
    let _serial = serial();
    // P naps for 4 s once the flooder has connected, as an engine starved of CPU would, while
    // the flooder sends 36 MB: P's drainer keeps NIXL's list short meanwhile, admits the
    // flooder's share, drops the rest unread and cuts it off, and P's engine, once back,
    // closes its side channel and takes in what this D sent during the flood.
    let env = [("KVFLOW_TEST_NAP_MS", "4000".to_owned()), ("KVFLOW_TEST_NAP_AT", "2".to_owned())];
    let (mut p, mut out, port) = start_listener(NAME, Role::Prefill, &env);
    let pool = HostPool::new(4);
    let mut d = transport(offer("decode0", Role::Decode, 1, 16, &pool, 4), &pool);
    let info = connect(&mut d, port);
    assert_eq!(expect_line(&mut out, "CONNECTED"), "decode0/tp0");
    let (mut flooder, mut flood_out) = spawn_child(NAME, "flooder", &[("KVFLOW_TEST_P_PORT", port.to_string())]);
    assert_eq!(expect_line(&mut out, "CONNECTED"), "flooder/tp0");
    expect_line(&mut flood_out, "FLOODING");
    let completion = Message::Completion { request: RequestId::new("r1"), expected_consumers: 1 }.encode().unwrap();
    d.send_notification(&info.agent, &completion).unwrap();
    let sent = expect_line(&mut flood_out, "SENT");
    // What P's engine says once back: the cut-off, the loss, and this D's completion.
    let (mut cut, mut lost, mut served) = (None, false, false);
    while cut.is_none() || !lost || !served {
        let line = expect_line(&mut out, "");
        if let Some(rest) = line.strip_prefix("CUT OFF ") {
            cut = Some(rest.to_owned());
        } else if line == "LOST flooder/tp0" {
            assert!(cut.is_some(), "lost before it was cut off");
            lost = true;
        } else if line.starts_with("NOTIFIED decode0/tp0 Completion") {
            served = true;
        } else if line.starts_with("NOTIFIED flooder/tp0") {
            // Its share before the bound, unless the cut-off dropped it first.
            assert!(cut.is_none(), "a notification of the flooder after its cut-off: {line}");
        } else if line.starts_with("LOST") {
            panic!("P lost another peer: {line}");
        }
    }
    assert_eq!(cut.as_deref(), Some("flooder/tp0 notification_flood"));
    assert_eq!(expect_line(&mut flood_out, "P CLOSED"), "true", "the flooder sent {sent} and was not closed");
    // Back at once as a new incarnation: refused while its engine's penalty lasts, before P
    // loads anything of it; taken again once the penalty is over.
    let back = |instance| {
        let mut t = transport(Handshake { instance, ..offer("flooder", Role::Decode, 1, 16, &pool, 4) }, &pool);
        t.connect(&PeerAddress(format!("127.0.0.1:{port}"))).unwrap();
        t
    };
    let _refused = back(5);
    let refused = expect_line(&mut out, "REFUSED");
    assert!(refused.starts_with("flooder/tp0: Overloaded"), "{refused}");
    assert!(refused.contains("engine flooder was cut off 1 time(s) for a notification flood"), "{refused}");
    std::thread::sleep(kv_transport_nixl::PENALTY_FIRST);
    let _taken = back(6);
    assert_eq!(expect_line(&mut out, "CONNECTED"), "flooder/tp0", "the penalty is over");
    // This D's own connection was never touched.
    let start = Instant::now();
    while start.elapsed() < Duration::from_millis(500) {
        assert!(!matches!(d.poll_event(), Some(PeerEvent::Lost(_))), "P's side channel to this D closed");
    }
    let second = Message::Completion { request: RequestId::new("r2"), expected_consumers: 1 }.encode().unwrap();
    d.send_notification(&info.agent, &second).unwrap();
    assert!(expect_line(&mut out, "NOTIFIED").starts_with("decode0/tp0 Completion"));
    flooder.wait().ok();
    p.kill().ok();
    p.wait().ok();
}

/// A key file in a fresh temporary folder, readable by its owner only.
fn key_file(name: &str, hex: &str) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let dir = std::env::temp_dir().join(format!("kvflow-nixl-test-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("key");
    std::fs::write(&path, hex).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    path
}

#[test]
fn only_holders_of_the_cluster_key_handshake_and_their_notifications_open() {
    const NAME: &str = "only_holders_of_the_cluster_key_handshake_and_their_notifications_open";
    if child_main() || !nixl_or_skip(NAME) {
        return;
    }
    let _serial = serial();
    let key = "5a".repeat(32);
    let (mut child, mut out, port) = start_listener(NAME, Role::Prefill, &[(KEY_ENV, key.clone())]);
    let pool = HostPool::new(4);
    let wrong = KeySource::File(key_file("wrong", &"a5".repeat(32)));
    for (name, source) in [("decode-wrong", wrong), ("decode-nokey", KeySource::None)] {
        let mut d = transport_with(offer(name, Role::Decode, 1, 16, &pool, 4), &pool, source);
        d.connect(&PeerAddress(format!("127.0.0.1:{port}"))).unwrap();
        match next_event(&mut d, Duration::from_secs(10)) {
            Some(PeerEvent::ConnectFailed { error, .. }) => {
                assert!(error.to_string().contains("does not hold the cluster key"), "{name}: {error}")
            }
            other => panic!("{name}: expected the handshake to fail, got {other:?}"),
        }
        let refused = expect_line(&mut out, "REFUSED");
        assert!(refused.starts_with(&format!("{name}/tp0: Unauthenticated")), "{refused}");
    }
    // The key holder handshakes, and its notification opens on P.
    let good = KeySource::File(key_file("good", &key));
    let mut d = transport_with(offer("decode-ok", Role::Decode, 1, 16, &pool, 4), &pool, good);
    let info = connect(&mut d, port);
    assert_eq!(expect_line(&mut out, "CONNECTED"), "decode-ok/tp0");
    let completion = Message::Completion { request: RequestId::new("r7"), expected_consumers: 1 }.encode().unwrap();
    d.send_notification(&info.agent, &completion).unwrap();
    let note = expect_line(&mut out, "NOTIFIED");
    assert!(note.starts_with("decode-ok/tp0 Completion") && note.contains("\"r7\""), "{note}");
    child.kill().ok();
    child.wait().ok();
}

#[test]
fn without_a_key_the_side_channel_listens_on_loopback_only() {
    let pool = HostPool::new(1);
    let config = NixlConfig { bind: "0.0.0.0:0".parse().unwrap(), ..NixlConfig::default() };
    match NixlTransport::new(offer("open", Role::Prefill, 1, 16, &pool, 1), &config, clock()) {
        Err(NixlError::Config(reason)) => {
            assert!(reason.contains("0.0.0.0:0") && reason.contains("cluster key"), "{reason}")
        }
        other => panic!("expected a configuration error, got {other:?}"),
    }
}

#[test]
fn a_transport_is_made_used_and_dropped_inside_a_tokio_runtime_and_on_plain_threads() {
    const NAME: &str = "a_transport_is_made_used_and_dropped_inside_a_tokio_runtime_and_on_plain_threads";
    if child_main() || !nixl_or_skip(NAME) {
        return;
    }
    let _serial = serial();
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    // P lives in an async task of the engine's runtime: made, polled and dropped there.
    let (port_tx, port_rx) = std::sync::mpsc::channel();
    let p = runtime.spawn(async move {
        let pool = HostPool::new(4);
        let mut p = transport(offer("async-p", Role::Prefill, 1, 16, &pool, 4), &pool);
        port_tx.send(p.side_channel_addr().port()).unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut seen = Vec::new();
        while Instant::now() < deadline && !seen.iter().any(|e: &String| e.starts_with("note")) {
            while let Some(event) = p.poll_event() {
                seen.push(match event {
                    PeerEvent::Connected(info) => format!("connected {}", info.agent),
                    PeerEvent::Notification(n) => format!("note from {}", n.from),
                    other => format!("{other:?}"),
                });
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        drop(p);
        seen
    });
    let port = port_rx.recv_timeout(Duration::from_secs(20)).unwrap();
    // D lives on a plain thread.
    let d = std::thread::spawn(move || {
        let pool = HostPool::new(4);
        let mut d = transport(offer("thread-d", Role::Decode, 1, 16, &pool, 4), &pool);
        let info = connect(&mut d, port);
        let abort = Message::Abort { request: RequestId::new("r1") }.encode().unwrap();
        d.send_notification(&info.agent, &abort).unwrap();
        std::thread::sleep(Duration::from_millis(200));
        drop(d);
        info.agent
    });
    let agent = d.join().expect("D's thread");
    assert_eq!(agent.engine.as_str(), "async-p");
    let seen = runtime.block_on(p).expect("P's task");
    assert!(seen.contains(&"connected thread-d/tp0".to_owned()), "{seen:?}");
    assert!(seen.contains(&"note from thread-d/tp0".to_owned()), "{seen:?}");
    // And the runtime itself shuts down with nothing of the transports left in it.
    runtime.shutdown_timeout(Duration::from_secs(5));
}

#[test]
fn a_transport_made_before_the_runtime_is_prepared_says_so() {
    const NAME: &str = "a_transport_made_before_the_runtime_is_prepared_says_so";
    if child_main() || !nixl_or_skip(NAME) {
        return;
    }
    let (mut child, mut out) = spawn_child(NAME, "unprepared", &[]);
    let error = expect_line(&mut out, "ERROR");
    assert_eq!(error, "RuntimeNotPrepared");
    child.wait().ok();
}
