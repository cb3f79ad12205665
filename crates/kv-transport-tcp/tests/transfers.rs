//! Two transports in one process over loopback: reads and writes with notifications, prepared
//! lists, the ranges refused before anything moves, and the waker that makes polling needless.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{agent, drain, duo, settle, until, Flag, Pool};
use kv_core::{
    DescriptorPair, MemoryKind, PeerEvent, PollIntervals, PreparedTransfer, Region, RegionId, TransferOp,
    TransferRequest, TransferStatus, Transport, TransportError,
};
use kv_transport_tcp::TcpTransport;

const BLOCK: usize = 32 * 1024;

fn pair(local: u64, remote: u64, len: usize) -> DescriptorPair {
    DescriptorPair { local_region: 0, local_addr: local, remote_region: 0, remote_addr: remote, len: len as u64 }
}

fn notification_from<'a>(events: &'a [PeerEvent], from: &str) -> Option<&'a [u8]> {
    events.iter().find_map(|e| match e {
        PeerEvent::Notification(n) if n.from == agent(from) => Some(n.payload.as_slice()),
        _ => None,
    })
}

#[test]
fn a_read_of_many_blocks_arrives_before_its_notification_and_wakes_the_reader() {
    let blocks = 128;
    let p_pool = Pool::patterned(1, blocks * BLOCK, 7);
    let d_pool = Pool::new(2, blocks * BLOCK);
    let mut duo = duo(&p_pool, &d_pool);
    assert_eq!(duo.d.poll_intervals(), PollIntervals { transfers: None, notifications: None });
    let flag = Arc::new(Flag::default());
    duo.d.set_waker(flag.waker());
    // D block i takes P block (blocks - 1 - i): one descriptor pair per block.
    let pairs =
        (0..blocks).map(|i| pair(d_pool.addr(i * BLOCK), p_pool.addr((blocks - 1 - i) * BLOCK), BLOCK)).collect();
    let request = TransferRequest {
        op: TransferOp::Read,
        peer: agent("prefill"),
        pairs,
        notification: Some(b"read it".to_vec()),
    };
    let id = duo.d.post(request).unwrap();

    // P learns of the read only once every byte is in D's memory.
    until(Duration::from_secs(20), "P's notification", || {
        drain(&mut duo.p, &mut duo.p_events);
        notification_from(&duo.p_events, "decode").is_some()
    });
    assert_eq!(notification_from(&duo.p_events, "decode"), Some(&b"read it"[..]));
    for i in 0..blocks {
        let (d, p) = (i * BLOCK, (blocks - 1 - i) * BLOCK);
        assert!(d_pool.bytes()[d..d + BLOCK] == p_pool.bytes()[p..p + BLOCK], "block {i} differs");
    }

    // D is woken for the completion: it waits on its waker alone, never polling on a timer.
    let mut status = TransferStatus::InProgress;
    while status == TransferStatus::InProgress {
        assert!(flag.wait(Duration::from_secs(10)), "the read's completion did not wake D");
        status = duo.d.poll_transfer(id);
    }
    assert_eq!(status, TransferStatus::Done);
    assert_eq!(duo.d.poll_transfer(id), TransferStatus::Failed(TransportError::UnknownTransfer(id)));
    let status = duo.d.data_status();
    assert_eq!(status.bytes_received, (blocks * BLOCK) as u64);
    assert_eq!(duo.p.data_status().bytes_sent, (blocks * BLOCK) as u64);
}

#[test]
fn a_write_with_a_notification_is_delivered_only_with_all_its_bytes() {
    let len = 24 << 20;
    let p_pool = Pool::patterned(1, len, 3);
    let d_pool = Pool::new(2, len);
    let mut duo = duo(&p_pool, &d_pool);
    let d_flag = Arc::new(Flag::default());
    duo.d.set_waker(d_flag.waker());
    // One large contiguous pair of many chunks, then small ones.
    let big = len - 4 * BLOCK;
    let mut pairs = vec![pair(p_pool.addr(0), d_pool.addr(0), big)];
    pairs.extend((0..4).map(|i| pair(p_pool.addr(big + i * BLOCK), d_pool.addr(big + (3 - i) * BLOCK), BLOCK)));
    let request =
        TransferRequest { op: TransferOp::Write, peer: agent("decode"), pairs, notification: Some(b"pushed".to_vec()) };
    let id = duo.p.post(request).unwrap();

    until(Duration::from_secs(20), "D's notification", || {
        if d_flag.wait(Duration::from_millis(50)) {
            drain(&mut duo.d, &mut duo.d_events);
        }
        notification_from(&duo.d_events, "prefill").is_some()
    });
    assert_eq!(notification_from(&duo.d_events, "prefill"), Some(&b"pushed"[..]));
    assert!(d_pool.bytes()[..big] == p_pool.bytes()[..big], "the large pair differs");
    for i in 0..4 {
        let (p, d) = (big + i * BLOCK, big + (3 - i) * BLOCK);
        assert!(d_pool.bytes()[d..d + BLOCK] == p_pool.bytes()[p..p + BLOCK], "block {i} differs");
    }
    assert_eq!(settle(&mut duo.p, id, &mut duo.d, &mut duo.d_events), TransferStatus::Done);
    assert_eq!(duo.d.data_status().bytes_received, len as u64);
}

#[test]
fn prepared_transfers_move_what_address_pairs_move() {
    let blocks = 16;
    let p_pool = Pool::patterned(1, blocks * BLOCK, 11);
    let d_pool = Pool::new(2, blocks * BLOCK);
    let d_second = Pool::new(3, blocks * BLOCK);
    let mut duo = duo(&p_pool, &d_pool);
    duo.d.register(&d_second.region()).unwrap();
    let p = agent("prefill");

    let remote: Vec<(u64, u64)> = (0..blocks).map(|i| (p_pool.addr(i * BLOCK), BLOCK as u64)).collect();
    let local: Vec<(u64, u64)> = (0..blocks).map(|i| (d_pool.addr(i * BLOCK), BLOCK as u64)).collect();
    let remote_list = duo.d.prepare(Some(&p), &remote).unwrap();
    let local_list = duo.d.prepare(None, &local).unwrap();
    let order: Vec<u32> = (0..blocks as u32).rev().collect();
    let indices: Vec<u32> = (0..blocks as u32).collect();
    let prepared = PreparedTransfer {
        op: TransferOp::Read,
        peer: p.clone(),
        local: local_list,
        local_indices: indices.clone(),
        remote: remote_list,
        remote_indices: order.clone(),
        notification: None,
    };
    let id = duo.d.post_prepared(prepared.clone()).unwrap();
    assert_eq!(settle(&mut duo.d, id, &mut duo.p, &mut duo.p_events), TransferStatus::Done);

    let pairs = indices
        .iter()
        .zip(&order)
        .map(|(&l, &r)| pair(d_second.addr(l as usize * BLOCK), p_pool.addr(r as usize * BLOCK), BLOCK))
        .collect();
    let id = duo.d.post(TransferRequest { op: TransferOp::Read, peer: p.clone(), pairs, notification: None }).unwrap();
    assert_eq!(settle(&mut duo.d, id, &mut duo.p, &mut duo.p_events), TransferStatus::Done);
    assert!(d_pool.bytes() == d_second.bytes(), "prepared and address-pair reads differ");
    assert!(d_pool.bytes()[..BLOCK] == p_pool.bytes()[(blocks - 1) * BLOCK..], "the bytes are P's");

    // Lists that do not pair are refused before anything moves.
    let invalid = |t: &mut TcpTransport, r: PreparedTransfer| {
        matches!(t.post_prepared(r), Err(TransportError::InvalidTransfer(_)))
    };
    let mut bad = prepared.clone();
    bad.remote_indices.pop();
    assert!(invalid(&mut duo.d, bad), "unequal index lists");
    let mut bad = prepared.clone();
    bad.remote_indices[0] = blocks as u32;
    assert!(invalid(&mut duo.d, bad), "an index past the list");
    let mut bad = prepared.clone();
    bad.remote = local_list;
    assert!(invalid(&mut duo.d, bad), "a local list named as the peer's");
    let short = duo.d.prepare(None, &[(d_pool.addr(0), 8)]).unwrap();
    let mut bad = prepared;
    bad.local = short;
    bad.local_indices = vec![0];
    bad.remote_indices = vec![0];
    assert!(invalid(&mut duo.d, bad), "entries of unequal lengths");
    assert_eq!(
        duo.d.prepare(Some(&p), &[(p_pool.addr(0), (blocks * BLOCK + 1) as u64)]),
        Err(TransportError::NotRegistered { side: "remote", addr: p_pool.addr(0), len: (blocks * BLOCK + 1) as u64 })
    );
    assert_eq!(
        duo.d.prepare(None, &[(p_pool.addr(0), 8)]),
        Err(TransportError::NotRegistered { side: "local", addr: p_pool.addr(0), len: 8 })
    );
    let stranger = agent("stranger");
    assert_eq!(duo.d.prepare(Some(&stranger), &remote), Err(TransportError::UnknownPeer(stranger)));
}

#[test]
fn ranges_outside_the_registrations_are_refused_on_both_sides() {
    let p_pool = Pool::patterned(1, 8 * BLOCK, 5);
    let p_gone = Pool::patterned(7, BLOCK, 9);
    let d_pool = Pool::new(2, 8 * BLOCK);
    let mut duo = duo(&p_pool, &d_pool);
    let p = agent("prefill");
    let read = |pairs| TransferRequest { op: TransferOp::Read, peer: p.clone(), pairs, notification: None };

    let outside_local = d_pool.addr(8 * BLOCK - 8);
    assert_eq!(
        duo.d.post(read(vec![pair(outside_local, p_pool.addr(0), 16)])),
        Err(TransportError::NotRegistered { side: "local", addr: outside_local, len: 16 })
    );
    let outside_remote = p_pool.addr(0) - 4096;
    assert_eq!(
        duo.d.post(read(vec![pair(d_pool.addr(0), p_pool.addr(0), 8), pair(d_pool.addr(8), outside_remote, 8)])),
        Err(TransportError::NotRegistered { side: "remote", addr: outside_remote, len: 8 })
    );
    assert!(matches!(duo.d.post(read(Vec::new())), Err(TransportError::InvalidTransfer(_))));
    assert!(matches!(
        duo.d.post(read(vec![pair(d_pool.addr(0), p_pool.addr(0), 0)])),
        Err(TransportError::InvalidTransfer(_))
    ));
    let stranger = agent("stranger");
    let mut to_stranger = read(vec![pair(d_pool.addr(0), p_pool.addr(0), 8)]);
    to_stranger.peer = stranger.clone();
    assert_eq!(duo.d.post(to_stranger), Err(TransportError::UnknownPeer(stranger.clone())));
    assert_eq!(duo.d.send_notification(&stranger, b"hi"), Err(TransportError::UnknownPeer(stranger)));
    let huge = vec![0u8; kv_core::wire::MAX_MESSAGE_BYTES + 1];
    assert!(matches!(duo.d.send_notification(&p, &huge), Err(TransportError::NotificationTooLarge { .. })));

    let gpu = Region { id: RegionId(9), kind: MemoryKind::Device(0), addr: 0x7000_0000, len: 4096 };
    let err = duo.d.register(&gpu).unwrap_err().to_string();
    assert!(err.contains("host memory only") && err.contains("GPU 0"), "{err}");

    // P registered a region after the handshake and withdrew another: D's view of P is the
    // table at handshake, and P's listener checks its own registrations of the moment.
    duo.p.register(&p_gone.region()).unwrap();
    let id = duo.d.post(read(vec![pair(d_pool.addr(0), p_pool.addr(0), BLOCK)])).unwrap();
    assert_eq!(settle(&mut duo.d, id, &mut duo.p, &mut duo.p_events), TransferStatus::Done);
    duo.p.deregister(RegionId(1)).unwrap();
    let before = d_pool.bytes()[BLOCK..2 * BLOCK].to_vec();
    let id = duo.d.post(read(vec![pair(d_pool.addr(BLOCK), p_pool.addr(BLOCK), BLOCK)])).unwrap();
    assert_eq!(
        settle(&mut duo.d, id, &mut duo.p, &mut duo.p_events),
        TransferStatus::Failed(TransportError::NotRegistered {
            side: "remote",
            addr: p_pool.addr(BLOCK),
            len: BLOCK as u64
        })
    );
    assert_eq!(d_pool.bytes()[BLOCK..2 * BLOCK], before[..], "no bytes of a refused range arrive");
    assert_eq!(duo.p.data_status().ranges_refused, 1);
    assert!(matches!(duo.p.deregister(RegionId(1)), Err(TransportError::Backend(_))));

    // A write into a withdrawn range leaves it untouched and fails; its notification never comes.
    let write = TransferRequest {
        op: TransferOp::Write,
        peer: agent("decode"),
        pairs: vec![pair(p_gone.addr(0), d_pool.addr(0), BLOCK)],
        notification: Some(b"never".to_vec()),
    };
    duo.d.deregister(RegionId(2)).unwrap();
    let before = d_pool.bytes().to_vec();
    let id = duo.p.post(write).unwrap();
    assert_eq!(
        settle(&mut duo.p, id, &mut duo.d, &mut duo.d_events),
        TransferStatus::Failed(TransportError::NotRegistered {
            side: "remote",
            addr: d_pool.addr(0),
            len: BLOCK as u64
        })
    );
    assert_eq!(d_pool.bytes(), &before[..], "a refused write touches nothing");
    drain(&mut duo.d, &mut duo.d_events);
    assert!(notification_from(&duo.d_events, "prefill").is_none(), "a failed write's notification was delivered");
}

#[test]
fn a_read_refused_in_part_names_the_local_ranges_it_spoiled_and_the_rest_arrives_whole() {
    let p_kept = Pool::patterned(1, 2 * BLOCK, 5);
    let p_withdrawn = Pool::patterned(3, 2 * BLOCK, 9);
    let d_pool = Pool::new(2, 4 * BLOCK);
    let mut duo = common::duo_of(&[&p_kept, &p_withdrawn], &d_pool, common::config(), common::config());
    // P withdraws one region after the handshake: D's view of P still holds it.
    duo.p.deregister(RegionId(3)).unwrap();
    let pairs = vec![
        pair(d_pool.addr(0), p_kept.addr(0), BLOCK),
        pair(d_pool.addr(BLOCK), p_withdrawn.addr(0), 2 * BLOCK),
        pair(d_pool.addr(3 * BLOCK), p_kept.addr(BLOCK), BLOCK),
    ];
    let read = TransferRequest { op: TransferOp::Read, peer: agent("prefill"), pairs, notification: None };
    let id = duo.d.post(read).unwrap();
    let status = settle(&mut duo.d, id, &mut duo.p, &mut duo.p_events);
    let TransferStatus::Failed(TransportError::PartlyFailed { reason, spoiled }) = status else {
        panic!("a read refused in part ended {status:?}");
    };
    assert_eq!(spoiled, vec![(d_pool.addr(BLOCK), 2 * BLOCK as u64)], "only the refused pair's range");
    assert!(reason.contains("not registered") || reason.contains("remote"), "{reason}");
    assert_eq!(d_pool.bytes()[..BLOCK], p_kept.bytes()[..BLOCK]);
    assert_eq!(d_pool.bytes()[3 * BLOCK..], p_kept.bytes()[BLOCK..]);
    assert!(d_pool.bytes()[BLOCK..3 * BLOCK].iter().all(|&b| b == 0), "no bytes of the refused range arrive");
}

#[test]
fn plain_notifications_arrive_in_order_and_a_waiting_engine_is_woken_at_once() {
    let p_pool = Pool::new(1, BLOCK);
    let d_pool = Pool::new(2, BLOCK);
    let mut duo = duo(&p_pool, &d_pool);
    let first = Arc::new(Flag::default());
    duo.p.set_waker(first.waker());
    first.wait(Duration::ZERO);
    for i in 0..50u32 {
        duo.d.send_notification(&agent("prefill"), &i.to_le_bytes()).unwrap();
    }
    let received = |events: &[PeerEvent]| {
        events
            .iter()
            .filter_map(|e| match e {
                PeerEvent::Notification(n) => Some(u32::from_le_bytes(n.payload[..4].try_into().unwrap())),
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    // The first notification to arrive wakes P, which has not polled since.
    assert!(first.wait(Duration::from_secs(10)), "a received notification did not wake P");
    std::thread::sleep(Duration::from_millis(200));
    // With notifications waiting, a new waker is woken at once.
    let second = Arc::new(Flag::default());
    duo.p.set_waker(second.waker());
    assert!(second.wait(Duration::ZERO), "set_waker did not wake at once with notifications waiting");
    until(Duration::from_secs(10), "50 notifications", || {
        drain(&mut duo.p, &mut duo.p_events);
        received(&duo.p_events).len() == 50
    });
    assert_eq!(received(&duo.p_events), (0..50).collect::<Vec<_>>());
}
