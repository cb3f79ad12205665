//! What every [`Transport`] must do, checked on two connected agents of one adapter.

use crate::id::{AgentName, EngineId};
use crate::plan::DescriptorPair;
use crate::ports::{
    Notification, PeerEvent, PreparedTransfer, Region, TransferId, TransferOp, TransferRequest, TransferStatus,
    Transport, TransportError,
};

/// Bytes of the region each side of a [`TransportPair`] registers, at least.
pub const CONTRACT_REGION_BYTES: u64 = 64 * 1024;

/// How many times a check calls [`TransportPair::wait`] for an outcome before it fails: about
/// five seconds where a wait lets a millisecond pass.
pub const CONTRACT_WAITS: usize = 5000;

/// How many times a check calls [`TransportPair::wait`] to let what is in flight land, or to
/// see that something does not happen: about 200 ms where a wait lets a millisecond pass.
pub const CONTRACT_QUIET_WAITS: usize = 200;

/// One of the two agents of a [`TransportPair`].
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Side {
    /// The agent that posts.
    A,
    /// Its peer.
    B,
}

/// Two agents of one adapter, connected to each other, for [`transport`]: an adapter's test
/// builds them its own way (sockets, a fake network) and the checks only call the port. The
/// last check on a pair ends it (B killed, or disconnected), so [`transport`] asks for a
/// fresh pair for each check that does.
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

/// Runs every [`Transport`] rule on pairs that `new_pair` makes, one pair at a time (each is
/// dropped before the next is made): the rules that keep a pair connected, then a killed peer,
/// on the first; a peer disconnected by A on the second.
pub fn transport(new_pair: &mut dyn FnMut() -> Box<dyn TransportPair>) {
    let mut pair = new_pair();
    transport_write_notification_after_bytes(&mut *pair);
    transport_read_notification_after_bytes(&mut *pair);
    transport_outcome_reported_once(&mut *pair);
    transport_unregistered_ranges_refused(&mut *pair);
    transport_prepared_equals_address_pairs(&mut *pair);
    transport_lost_peer_reported(&mut *pair);
    drop(pair);
    transport_disconnected_peer_reported(&mut *new_pair());
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
    lost_once(pair, Side::A, &peer, "a killed peer");
    refused_to_lost(pair, Side::A, &peer, "a killed peer");
}

/// A peer that A disconnects (something other than its side channel says it is gone): what
/// it sent before comes first, then its loss, once; nothing goes to it any more, its prepared
/// lists included; disconnecting it again, or an agent never connected, does nothing; and B
/// sees A lost in turn, as when a side channel closes.
pub fn transport_disconnected_peer_reported(pair: &mut dyn TransportPair) {
    let what = "a disconnected peer";
    let (a_name, b_name) = (agent(pair, Side::A), agent(pair, Side::B));
    let (a, b) = (pair.region(Side::A), pair.region(Side::B));
    let local = pair.transport(Side::A).prepare(None, &[(a.addr, 4096)]).expect("preparing a local block");
    let remote = pair.transport(Side::A).prepare(Some(&b_name), &[(b.addr, 4096)]).expect("preparing B's");
    pair.transport(Side::B).send_notification(&a_name, b"said before").expect("a notification to a connected peer");
    // It reaches A, which does not poll: the transport itself must order it before the loss.
    for _ in 0..CONTRACT_QUIET_WAITS {
        pair.wait();
    }
    pair.transport(Side::A).disconnect(&b_name);
    let told: Vec<PeerEvent> = lost_once(pair, Side::A, &b_name, what)
        .into_iter()
        .filter(|event| matches!(event, PeerEvent::Notification(_) | PeerEvent::Lost(_)))
        .collect();
    let said = PeerEvent::Notification(Notification { from: b_name.clone(), payload: b"said before".to_vec() });
    assert_eq!(told, [said, PeerEvent::Lost(b_name.clone())], "{what}: what it said before comes before its loss");
    refused_to_lost(pair, Side::A, &b_name, what);
    let prepared = PreparedTransfer {
        op: TransferOp::Read,
        peer: b_name.clone(),
        local,
        local_indices: vec![0],
        remote,
        remote_indices: vec![0],
        notification: None,
    };
    let after = pair.transport(Side::A).post_prepared(prepared);
    assert!(refused_as_lost(&after), "{what}: a prepared transfer to a disconnected peer is refused: {after:?}");
    // Neither is connected now: nothing happens, and no second loss is reported.
    pair.transport(Side::A).disconnect(&b_name);
    pair.transport(Side::A).disconnect(&AgentName::new(EngineId::new("never-connected"), 0));
    quiet(pair, Side::A, &b_name, what);
    lost_once(pair, Side::B, &a_name, "the peer that A disconnected");
    refused_to_lost(pair, Side::B, &a_name, "the peer that A disconnected");
}

/// Polls `side` until it reports `peer` lost, then a while longer to see no second loss;
/// returns the events up to the loss, in order.
fn lost_once(pair: &mut dyn TransportPair, side: Side, peer: &AgentName, what: &str) -> Vec<PeerEvent> {
    let lost = PeerEvent::Lost(peer.clone());
    let mut events = Vec::new();
    'waiting: for _ in 0..CONTRACT_WAITS {
        while let Some(event) = pair.transport(side).poll_event() {
            events.push(event);
            if events.last() == Some(&lost) {
                break 'waiting;
            }
        }
        pair.wait();
    }
    assert_eq!(events.last(), Some(&lost), "{what}: {side:?} reports {peer} lost");
    quiet(pair, side, peer, what);
    events
}

/// Waits a while, polling `side`, which must not report `peer` lost (again).
fn quiet(pair: &mut dyn TransportPair, side: Side, peer: &AgentName, what: &str) {
    for _ in 0..CONTRACT_QUIET_WAITS {
        pair.wait();
        while let Some(event) = pair.transport(side).poll_event() {
            assert_ne!(event, PeerEvent::Lost(peer.clone()), "{what}: {side:?} reports a peer lost once");
        }
    }
}

/// Neither a transfer nor a notification from `side` to its lost `peer` is taken.
fn refused_to_lost(pair: &mut dyn TransportPair, side: Side, peer: &AgentName, what: &str) {
    let (a, b) = (pair.region(Side::A), pair.region(Side::B));
    let (local, remote) = if side == Side::A { (a, b) } else { (b, a) };
    let request = TransferRequest {
        op: TransferOp::Read,
        peer: peer.clone(),
        pairs: pairs(&local, &remote, &[(0, 0, 4096)]),
        notification: None,
    };
    let after = pair.transport(side).post(request);
    assert!(refused_as_lost(&after), "{what}: {side:?}'s transfer to a lost peer is refused: {after:?}");
    let after = pair.transport(side).send_notification(peer, b"too late");
    assert!(refused_as_lost(&after), "{what}: {side:?}'s notification to a lost peer is refused: {after:?}");
}

/// Whether `result` is the refusal of a call naming a peer that is not connected.
fn refused_as_lost<T>(result: &Result<T, TransportError>) -> bool {
    matches!(result, Err(TransportError::UnknownPeer(_) | TransportError::PeerLost(_)))
}
