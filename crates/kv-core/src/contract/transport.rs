//! What every [`Transport`] must do, checked on two connected agents of one adapter.

use crate::id::AgentName;
use crate::plan::DescriptorPair;
use crate::ports::{
    PeerEvent, PreparedTransfer, Region, TransferId, TransferOp, TransferRequest, TransferStatus, Transport,
    TransportError,
};

/// Bytes of the region each side of a [`TransportPair`] registers, at least.
pub const CONTRACT_REGION_BYTES: u64 = 64 * 1024;

/// How many times a check calls [`TransportPair::wait`] for an outcome before it fails: about
/// five seconds where a wait lets a millisecond pass.
pub const CONTRACT_WAITS: usize = 5000;

/// One of the two agents of a [`TransportPair`].
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Side {
    /// The agent that posts.
    A,
    /// Its peer.
    B,
}

/// Two agents of one adapter, connected to each other, for [`transport`]: an adapter's test
/// builds them its own way (sockets, a fake network) and the checks only call the port.
pub trait TransportPair {
    /// The transport of `side`. Both have completed their handshake with each other; events
    /// from before the checks (their `Connected`) may still be queued and are skipped.
    fn transport(&mut self, side: Side) -> &mut dyn Transport;
    /// The one region `side` registered: host memory of at least [`CONTRACT_REGION_BYTES`],
    /// with nothing else registered directly after it.
    fn region(&self, side: Side) -> Region;
    /// Writes `bytes` at `offset` of `side`'s region, as the engine computing KV would.
    fn write(&mut self, side: Side, offset: u64, bytes: &[u8]);
    /// Reads `out.len()` bytes at `offset` of `side`'s region.
    fn read(&mut self, side: Side, offset: u64, out: &mut [u8]);
    /// Lets the transports' own work go on for a moment: a real adapter sleeps about a
    /// millisecond, a fake one advances its clock and settles its network.
    fn wait(&mut self);
    /// B ends as a killed process would: its transport dropped or its sockets closed, with no
    /// goodbye. Called last.
    fn kill_b(&mut self);
}

/// Runs every [`Transport`] rule on `pair`, the lost peer last.
pub fn transport(pair: &mut dyn TransportPair) {
    transport_write_notification_after_bytes(pair);
    transport_read_notification_after_bytes(pair);
    transport_outcome_reported_once(pair);
    transport_unregistered_ranges_refused(pair);
    transport_prepared_equals_address_pairs(pair);
    transport_lost_peer_reported(pair);
}

fn agent(pair: &mut dyn TransportPair, side: Side) -> AgentName {
    pair.transport(side).agent().clone()
}

/// Bytes that differ at every offset and from one check to the next.
fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i % 251) as u8 ^ seed).collect()
}

fn read(pair: &mut dyn TransportPair, side: Side, offset: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0; len];
    pair.read(side, offset, &mut out);
    out
}

fn pairs(a: &Region, b: &Region, ranges: &[(u64, u64, u64)]) -> Vec<DescriptorPair> {
    ranges
        .iter()
        .map(|&(a_off, b_off, len)| DescriptorPair {
            local_region: 0,
            local_addr: a.addr + a_off,
            remote_region: 0,
            remote_addr: b.addr + b_off,
            len,
        })
        .collect()
}

/// Polls `id` on A until it is no longer in progress.
fn finish(pair: &mut dyn TransportPair, id: TransferId, what: &str) -> TransferStatus {
    for _ in 0..CONTRACT_WAITS {
        match pair.transport(Side::A).poll_transfer(id) {
            TransferStatus::InProgress => pair.wait(),
            status => return status,
        }
    }
    panic!("{what}: transfer {id:?} still in progress after {CONTRACT_WAITS} waits");
}

/// B's notifications from A, in order, drained now.
fn notifications_at_b(pair: &mut dyn TransportPair, from: &AgentName) -> Vec<Vec<u8>> {
    let mut got = Vec::new();
    while let Some(event) = pair.transport(Side::B).poll_event() {
        match event {
            PeerEvent::Notification(n) => {
                assert_eq!(&n.from, from, "a notification names the agent that sent it");
                got.push(n.payload);
            }
            PeerEvent::Lost(who) => panic!("B lost {who} during the contract checks"),
            _ => {}
        }
    }
    got
}

/// Runs `id` to its end while watching B: when B sees `expected`, `check` must already hold
/// (the transfer's bytes are where they go). Returns A's final status.
fn notified_after(
    pair: &mut dyn TransportPair,
    id: TransferId,
    expected: &[u8],
    what: &str,
    check: &dyn Fn(&mut dyn TransportPair) -> bool,
) {
    let from = agent(pair, Side::A);
    let (mut status, mut notified) = (None, 0);
    for _ in 0..CONTRACT_WAITS {
        if status.is_none() {
            match pair.transport(Side::A).poll_transfer(id) {
                TransferStatus::InProgress => {}
                done => status = Some(done),
            }
        }
        for payload in notifications_at_b(pair, &from) {
            assert_eq!(payload, expected, "{what}: B got a notification nobody sent");
            assert!(check(pair), "{what}: B was notified before the transfer's bytes were in place");
            notified += 1;
        }
        if status.is_some() && notified > 0 {
            break;
        }
        pair.wait();
    }
    assert_eq!(status, Some(TransferStatus::Done), "{what}: A's transfer ends done");
    assert_eq!(notified, 1, "{what}: B is notified exactly once");
}

/// A write with a notification: B is notified once, and only once its memory holds the bytes.
pub fn transport_write_notification_after_bytes(pair: &mut dyn TransportPair) {
    let (a, b) = (pair.region(Side::A), pair.region(Side::B));
    let sent = pattern(16 * 1024, 0x11);
    pair.write(Side::A, 0, &sent);
    let peer = agent(pair, Side::B);
    let request = TransferRequest {
        op: TransferOp::Write,
        peer,
        pairs: pairs(&a, &b, &[(0, 32 * 1024, 8 * 1024), (8 * 1024, 40 * 1024, 8 * 1024)]),
        notification: Some(b"written".to_vec()),
    };
    let id = pair.transport(Side::A).post(request).expect("posting a write between registered ranges");
    notified_after(pair, id, b"written", "write", &|pair| read(pair, Side::B, 32 * 1024, sent.len()) == sent);
    // A notification alone arrives too, after what came before it.
    let peer = agent(pair, Side::B);
    pair.transport(Side::A).send_notification(&peer, b"alone").expect("a notification to a connected peer");
    let from = agent(pair, Side::A);
    for _ in 0..CONTRACT_WAITS {
        match notifications_at_b(pair, &from).as_slice() {
            [] => pair.wait(),
            [only] => return assert_eq!(only, b"alone", "a notification arrives as sent"),
            more => panic!("one notification sent, {} arrived", more.len()),
        }
    }
    panic!("a notification sent alone never arrived");
}

/// A read with a notification: B (the source) is notified once, and only once A's memory
/// holds the bytes.
pub fn transport_read_notification_after_bytes(pair: &mut dyn TransportPair) {
    let (a, b) = (pair.region(Side::A), pair.region(Side::B));
    let sent = pattern(12 * 1024, 0x22);
    pair.write(Side::B, 4 * 1024, &sent);
    let peer = agent(pair, Side::B);
    let request = TransferRequest {
        op: TransferOp::Read,
        peer,
        pairs: pairs(&a, &b, &[(16 * 1024, 4 * 1024, 12 * 1024)]),
        notification: Some(b"read".to_vec()),
    };
    let id = pair.transport(Side::A).post(request).expect("posting a read between registered ranges");
    notified_after(pair, id, b"read", "read", &|pair| read(pair, Side::A, 16 * 1024, sent.len()) == sent);
}

/// `Done` is reported once; then, as for an id never posted, the transfer is unknown.
pub fn transport_outcome_reported_once(pair: &mut dyn TransportPair) {
    let (a, b) = (pair.region(Side::A), pair.region(Side::B));
    let peer = agent(pair, Side::B);
    let request =
        TransferRequest { op: TransferOp::Read, peer, pairs: pairs(&a, &b, &[(0, 0, 4096)]), notification: None };
    let id = pair.transport(Side::A).post(request).expect("posting a read");
    assert_eq!(finish(pair, id, "read"), TransferStatus::Done, "a read between registered ranges ends done");
    let unknown = |id| TransferStatus::Failed(TransportError::UnknownTransfer(id));
    assert_eq!(pair.transport(Side::A).poll_transfer(id), unknown(id), "done is reported once");
    let never = TransferId(u64::MAX);
    assert_eq!(pair.transport(Side::A).poll_transfer(never), unknown(never), "an id never posted is unknown");
}

/// A range outside the registered regions, local or the peer's, is refused when posted,
/// naming its side and range, and B hears nothing of it.
pub fn transport_unregistered_ranges_refused(pair: &mut dyn TransportPair) {
    let (a, b) = (pair.region(Side::A), pair.region(Side::B));
    let peer = agent(pair, Side::B);
    let past = |r: &Region| r.len - 2048; // straddles the region's end
    for (op, side, a_off, b_off) in [
        (TransferOp::Read, "local", past(&a), 0),
        (TransferOp::Read, "remote", 0, past(&b)),
        (TransferOp::Write, "local", past(&a), 0),
        (TransferOp::Write, "remote", 0, past(&b)),
    ] {
        let request = TransferRequest {
            op,
            peer: peer.clone(),
            pairs: pairs(&a, &b, &[(a_off, b_off, 4096)]),
            notification: Some(b"never".to_vec()),
        };
        let addr = if side == "local" { a.addr + a_off } else { b.addr + b_off };
        let refused = pair.transport(Side::A).post(request);
        assert_eq!(
            refused,
            Err(TransportError::NotRegistered { side, addr, len: 4096 }),
            "a {op:?} of a {side} range past its region's end"
        );
    }
    let empty = TransferRequest { op: TransferOp::Read, peer, pairs: Vec::new(), notification: None };
    assert!(
        matches!(pair.transport(Side::A).post(empty), Err(TransportError::InvalidTransfer(_))),
        "a transfer of no ranges"
    );
    for _ in 0..10 {
        pair.wait();
    }
    let from = agent(pair, Side::A);
    assert_eq!(notifications_at_b(pair, &from), Vec::<Vec<u8>>::new(), "a refused transfer notifies nobody");
}

/// Reading blocks by prepared indices moves the same bytes as naming their addresses.
pub fn transport_prepared_equals_address_pairs(pair: &mut dyn TransportPair) {
    let (a, b) = (pair.region(Side::A), pair.region(Side::B));
    const BLOCK: u64 = 2048;
    let sent = pattern(4 * BLOCK as usize, 0x33);
    pair.write(Side::B, 48 * 1024, &sent);
    let peer = agent(pair, Side::B);
    // A's blocks 0..4 at 32 KiB (prepared) and at 40 KiB (addresses); B's at 48 KiB, reversed.
    let blocks = |base: u64, at: u64| (0..4).map(|i| (base + at + i * BLOCK, BLOCK)).collect::<Vec<_>>();
    let local = pair.transport(Side::A).prepare(None, &blocks(a.addr, 32 * 1024)).expect("preparing local blocks");
    let remote = pair.transport(Side::A).prepare(Some(&peer), &blocks(b.addr, 48 * 1024)).expect("preparing B's");
    let prepared = PreparedTransfer {
        op: TransferOp::Read,
        peer: peer.clone(),
        local,
        local_indices: vec![0, 1, 2, 3],
        remote,
        remote_indices: vec![3, 2, 1, 0],
        notification: None,
    };
    let id = pair.transport(Side::A).post_prepared(prepared).expect("posting a prepared read");
    assert_eq!(finish(pair, id, "prepared read"), TransferStatus::Done, "a prepared read ends done");
    let ranges: Vec<_> = (0..4).map(|i| (40 * 1024 + i * BLOCK, 48 * 1024 + (3 - i) * BLOCK, BLOCK)).collect();
    let request = TransferRequest { op: TransferOp::Read, peer, pairs: pairs(&a, &b, &ranges), notification: None };
    let id = pair.transport(Side::A).post(request).expect("posting the same read by addresses");
    assert_eq!(finish(pair, id, "address read"), TransferStatus::Done, "the read by addresses ends done");
    let by_index = read(pair, Side::A, 32 * 1024, sent.len());
    let by_address = read(pair, Side::A, 40 * 1024, sent.len());
    assert_eq!(by_index, by_address, "prepared and address-pair reads of the same blocks move the same bytes");
    let reversed: Vec<u8> = sent.chunks(BLOCK as usize).rev().flatten().copied().collect();
    assert_eq!(by_index, reversed, "each entry lands where its index pairs it");
}

/// A killed peer is reported lost, once, and transfers to it are refused from then on.
pub fn transport_lost_peer_reported(pair: &mut dyn TransportPair) {
    let peer = agent(pair, Side::B);
    pair.kill_b();
    let mut lost = 0;
    for _ in 0..CONTRACT_WAITS {
        while let Some(event) = pair.transport(Side::A).poll_event() {
            if event == PeerEvent::Lost(peer.clone()) {
                lost += 1;
            }
        }
        if lost > 0 {
            break;
        }
        pair.wait();
    }
    for _ in 0..10 {
        pair.wait();
        while let Some(event) = pair.transport(Side::A).poll_event() {
            assert_ne!(event, PeerEvent::Lost(peer.clone()), "a peer is lost once");
        }
    }
    assert_eq!(lost, 1, "A reports its killed peer {peer} lost");
    let (a, b) = (pair.region(Side::A), pair.region(Side::B));
    let request =
        TransferRequest { op: TransferOp::Read, peer, pairs: pairs(&a, &b, &[(0, 0, 4096)]), notification: None };
    let after = pair.transport(Side::A).post(request);
    assert!(
        matches!(after, Err(TransportError::UnknownPeer(_) | TransportError::PeerLost(_))),
        "a transfer to a lost peer is refused: {after:?}"
    );
}
