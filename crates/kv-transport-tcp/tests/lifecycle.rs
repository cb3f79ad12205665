//! Peers come and go: a dropped transport is seen lost within a second and its transfers
//! fail, a disconnected peer is lost at once and its data connections end, memory is never
//! touched once deregistered, and transports are made, used and dropped on plain threads.

mod common;

use std::time::{Duration, Instant};

use common::{agent, clock, config, drain, duo, offer, settle, until, Duo, Pool};
use kv_core::{
    DescriptorPair, Notification, PeerAddress, PeerEvent, RefusalCause, RegionId, Role, TransferOp, TransferRequest,
    TransferStatus, Transport, TransportError,
};
use kv_transport_tcp::TcpTransport;

fn read(local: u64, remote: u64, len: usize) -> TransferRequest {
    let pairs = vec![DescriptorPair {
        local_region: 0,
        local_addr: local,
        remote_region: 0,
        remote_addr: remote,
        len: len as u64,
    }];
    TransferRequest { op: TransferOp::Read, peer: agent("prefill"), pairs, notification: Some(b"done".to_vec()) }
}

#[test]
fn dropping_a_transport_makes_its_peer_report_lost_at_once_and_fail_its_transfers() {
    let len = 256 << 20;
    let p_pool = Pool::new(1, len);
    let d_pool = Pool::new(2, len);
    let Duo { p, mut d, .. } = duo(&p_pool, &d_pool);
    let id = d.post(read(d_pool.addr(0), p_pool.addr(0), len)).unwrap();
    let dropped = Instant::now();
    drop(p);
    let mut events = Vec::new();
    until(Duration::from_secs(1), "D to see P lost", || {
        drain(&mut d, &mut events);
        events.contains(&PeerEvent::Lost(agent("prefill")))
    });
    assert!(dropped.elapsed() < Duration::from_secs(1), "lost after {:?}", dropped.elapsed());
    let mut status = TransferStatus::InProgress;
    until(Duration::from_secs(1), "the read to fail", || {
        status = d.poll_transfer(id);
        status != TransferStatus::InProgress
    });
    let arrived = d.data_status().bytes_received;
    assert!(arrived < len as u64, "the read finished before P was dropped");
    // The data connection breaks first; its transfers fail as the peer's loss once the side
    // channel confirms it, which takes milliseconds, or as the broken connection if this
    // engine did not take the side channel's news in within CLOSE_GRACE (a loaded machine).
    // What arrived before the break is whole: only the rest is spoiled.
    let why = match &status {
        TransferStatus::Failed(TransportError::PartlyFailed { reason, spoiled }) => {
            assert_eq!(*spoiled, vec![(d_pool.addr(arrived as usize), len as u64 - arrived)]);
            reason.clone()
        }
        TransferStatus::Failed(whole @ (TransportError::PeerLost(_) | TransportError::TransferFailed(_))) => {
            assert_eq!(arrived, 0, "bytes arrived, but the read does not say they are whole");
            whole.to_string()
        }
        other => panic!("the read to a dropped peer ended {other:?}"),
    };
    assert!(why.contains("prefill"), "{why}");
    assert_eq!(d.post(read(d_pool.addr(0), 0, 8)), Err(TransportError::UnknownPeer(agent("prefill"))));
}

#[test]
fn a_disconnected_peer_is_lost_at_once_and_its_data_connections_end_both_ways() {
    let len = 256 << 20;
    let p_pool = Pool::new(1, len);
    let d_pool = Pool::new(2, len);
    let Duo { mut p, mut d, .. } = duo(&p_pool, &d_pool);
    // A read each way first: then both data connections are authenticated and serving.
    let mut events = Vec::new();
    let id = d.post(read(d_pool.addr(0), p_pool.addr(0), 8)).unwrap();
    assert_eq!(settle(&mut d, id, &mut p, &mut events), TransferStatus::Done);
    let id = p.post(TransferRequest { peer: agent("decode"), ..read(p_pool.addr(0), d_pool.addr(0), 8) }).unwrap();
    assert_eq!(settle(&mut p, id, &mut d, &mut events), TransferStatus::Done);
    // P's read is done when its bytes are in P's memory; its notification to D follows. Take
    // it in first, or it may come out of D's queue ahead of the loss (it was sent before).
    let done = PeerEvent::Notification(Notification { from: agent("prefill"), payload: b"done".to_vec() });
    until(Duration::from_secs(2), "the notification of P's read at D", || {
        drain(&mut d, &mut events);
        events.contains(&done)
    });
    let status = |t: &TcpTransport| t.data_status();
    assert_eq!((status(&d).incoming, status(&d).outgoing), (1, 1), "a data connection each way");
    let id = d.post(read(d_pool.addr(0), p_pool.addr(0), len)).unwrap();
    d.disconnect(&agent("prefill"));
    // The notification P's read sent may still be on its way and meet no session any more: it
    // is refused, and the loss is reported at once all the same.
    let late = |e: &PeerEvent| matches!(e, PeerEvent::Refused { peer: Some(p), cause: RefusalCause::Unauthenticated, .. } if *p == agent("prefill"));
    let first = std::iter::from_fn(|| d.poll_event()).find(|e| !late(e));
    assert_eq!(first, Some(PeerEvent::Lost(agent("prefill"))), "no grace: it is gone now");
    // The read in flight fails as the loss, whole, or saying that only its tail is spoiled.
    let lost = TransportError::PeerLost(agent("prefill"));
    match d.poll_transfer(id) {
        TransferStatus::Failed(TransportError::PartlyFailed { reason, spoiled }) => {
            assert_eq!(reason, lost.to_string());
            let &[(at, n)] = &spoiled[..] else { panic!("spoiled {spoiled:?}") };
            assert!(at > d_pool.addr(0) && at + n == d_pool.addr(len), "spoiled {spoiled:?}");
        }
        ended => assert_eq!(ended, TransferStatus::Failed(lost), "the read in flight"),
    }
    until(Duration::from_secs(1), "D's data connections to end", || {
        (status(&d).incoming, status(&d).outgoing) == (0, 0)
    });
    until(Duration::from_secs(2), "P to see D lost", || {
        drain(&mut p, &mut events);
        events.contains(&PeerEvent::Lost(agent("decode")))
    });
    // P's side gets the grace of a closed side channel: a read it was serving may take that long.
    until(Duration::from_secs(2), "P's data connections to end", || {
        (status(&p).incoming, status(&p).outgoing) == (0, 0)
    });
}

#[test]
fn memory_is_never_touched_after_deregister_returns() {
    let len = 64 << 20;
    let p_pool = Pool::patterned(1, len, 5);
    let d_pool = Pool::new(2, len);
    let mut duo = duo(&p_pool, &d_pool);
    for round in 0..3 {
        let id = duo.d.post(read(d_pool.addr(0), p_pool.addr(0), len)).unwrap();
        std::thread::sleep(Duration::from_millis(round * 10));
        duo.d.deregister(RegionId(2)).unwrap();
        let snapshot = d_pool.bytes().to_vec();
        let status = settle(&mut duo.d, id, &mut duo.p, &mut duo.p_events);
        assert!(
            matches!(
                status,
                TransferStatus::Done | TransferStatus::Failed(TransportError::NotRegistered { side: "local", .. })
            ),
            "round {round}: {status:?}"
        );
        assert!(d_pool.bytes() == &snapshot[..], "round {round}: bytes landed after deregister returned");
        duo.d.register(&d_pool.region()).unwrap();
    }
}

#[test]
fn transports_are_made_used_and_dropped_on_plain_threads() {
    let p_pool = Pool::patterned(1, 1 << 20, 8);
    let d_pool = Pool::new(2, 1 << 20);
    let (p_region, d_region) = (p_pool.region(), d_pool.region());
    let made = |engine: &'static str, role, instance| {
        std::thread::spawn(move || TcpTransport::new(offer(engine, role, instance), &config(), clock()).unwrap())
    };
    let (p, d) = (made("prefill", Role::Prefill, 1), made("decode", Role::Decode, 2));
    let (mut p, mut d) = (p.join().unwrap(), d.join().unwrap());
    let used = std::thread::spawn(move || {
        p.register(&p_region).unwrap();
        d.register(&d_region).unwrap();
        d.connect(&PeerAddress(p.side_channel_addr().to_string())).unwrap();
        let (mut p_events, mut d_events) = (Vec::new(), Vec::new());
        until(Duration::from_secs(10), "both sides to connect", || {
            drain(&mut p, &mut p_events);
            drain(&mut d, &mut d_events);
            [&p_events, &d_events].iter().all(|e| e.iter().any(|e| matches!(e, PeerEvent::Connected(_))))
        });
        let id = d.post(read(d_region.addr, p_region.addr, 1 << 20)).unwrap();
        assert_eq!(settle(&mut d, id, &mut p, &mut p_events), TransferStatus::Done);
        (p, d)
    });
    let (p, d) = used.join().unwrap();
    assert!(d_pool.bytes() == p_pool.bytes());
    let started = Instant::now();
    std::thread::spawn(move || drop(p)).join().unwrap();
    std::thread::spawn(move || drop(d)).join().unwrap();
    assert!(started.elapsed() < Duration::from_secs(3), "dropping took {:?}", started.elapsed());
}
