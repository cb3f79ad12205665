//! A listener whose answer is slow to reach us (its engine starved of CPU, or its host far
//! away) past the 5 s of our connect: we still wait for its OFFER after our PROOF, so it takes
//! us in and we it, and it never sees an established peer close and refuse that peer's next
//! handshake as stale.

mod common;

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use common::{outcome, outcome_within, start};
use kv_core::{PeerAddress, Role};
use kv_side_tcp::PortPlan;

/// A relay at the address returned: each connection is joined to `target`, what the client
/// sends passes at once, and what `target` answers after its first frame is held until `hold`
/// after the accept.
fn slow_relay(target: std::net::SocketAddr, hold: Duration) -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for client in listener.incoming() {
            let Ok(client) = client else { return };
            let accepted = Instant::now();
            let server = TcpStream::connect(target).unwrap();
            let (mut up_from, mut up_to) = (client.try_clone().unwrap(), server.try_clone().unwrap());
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut up_from, &mut up_to);
                let _ = up_to.shutdown(Shutdown::Write);
            });
            let (mut down_from, mut down_to) = (server, client);
            std::thread::spawn(move || {
                let mut buf = [0u8; 64 * 1024];
                let mut reads = 0;
                while let Ok(n) = down_from.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    reads += 1;
                    if reads > 1 {
                        std::thread::sleep((accepted + hold).saturating_duration_since(Instant::now()));
                    }
                    if down_to.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
                let _ = down_to.shutdown(Shutdown::Write);
            });
        }
    });
    addr
}

#[test]
fn a_listener_whose_offer_comes_after_our_connects_deadline_still_connects_both_ways() {
    let p = start("127.0.0.1:0".parse().unwrap(), PortPlan::Own, "prefill", Role::Prefill, 0, 1).unwrap();
    let d = start("127.0.0.1:0".parse().unwrap(), PortPlan::Own, "decode", Role::Decode, 0, 1).unwrap();
    // P's CHALLENGE passes at once; its OFFER, sent once it took D in, reaches D 6.5 s after
    // D connected: past the 5 s that D's connect has, within the 10 s after its PROOF.
    let relay = slow_relay(p.local_addr(), Duration::from_millis(6_500));
    let began = Instant::now();
    d.connect(&PeerAddress(relay.to_string())).unwrap();
    assert_eq!(outcome(&p), "connected decode/tp0");
    assert_eq!(outcome(&d), "connected prefill/tp0");
    assert!(began.elapsed() >= Duration::from_secs(6), "the relay held P's offer for {:?} only", began.elapsed());
    // Neither side loses the other afterwards.
    assert_eq!(outcome_within(&p, Duration::from_millis(500)), "nothing");
    assert_eq!(outcome_within(&d, Duration::from_millis(500)), "nothing");
}
