//! The metrics endpoint answers scrapes, refuses what is not one, and cannot be held by idle
//! peers: past its bound it drops the oldest connection that sent no whole request.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use kv_engine::metrics::{MetricsEndpoint, HEAD_TIMEOUT, MAX_CONNECTIONS};

/// What the endpoint at `addr` answers to `request`, whole (it closes after one answer).
fn raw(addr: SocketAddr, request: &[u8]) -> String {
    let mut stream = TcpStream::connect(addr).expect("connects");
    stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    stream.write_all(request).unwrap();
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    answer
}

fn endpoint() -> MetricsEndpoint {
    let mut scrapes = 0;
    MetricsEndpoint::serve("127.0.0.1:0".parse().unwrap(), move || {
        scrapes += 1;
        format!("kvflow_test_scrapes_total {scrapes}\n")
    })
    .expect("serves")
}

#[test]
fn a_scrape_gets_the_rendered_text_and_anything_else_is_refused() {
    let e = endpoint();
    let answer = raw(e.addr(), b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains("text/plain; version=0.0.4"), "{answer}");
    assert!(answer.ends_with("kvflow_test_scrapes_total 1\n"), "{answer}");
    assert!(raw(e.addr(), b"GET /other HTTP/1.1\r\nHost: x\r\n\r\n").starts_with("HTTP/1.1 404"));
    assert!(
        raw(e.addr(), b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n").starts_with("HTTP/1.1 405")
    );
    assert!(raw(e.addr(), b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").ends_with("kvflow_test_scrapes_total 2\n"));
}

#[test]
fn idle_peers_past_the_bound_are_dropped_oldest_first_and_never_delay_a_scrape() {
    let e = endpoint();
    // Four times the bound of peers that send the start of a request and then nothing.
    let mut idle: Vec<TcpStream> = (0..4 * MAX_CONNECTIONS)
        .map(|_| {
            let mut s = TcpStream::connect(e.addr()).expect("connects");
            s.write_all(b"GET /metr").unwrap();
            s
        })
        .collect();
    let started = Instant::now();
    let answer = raw(e.addr(), b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(started.elapsed() < HEAD_TIMEOUT, "the scrape waited {:?} behind idle peers", started.elapsed());
    // The oldest were dropped to make room: reading them ends at once, with nothing.
    let mut dropped = 0;
    for s in idle.iter_mut().take(3 * MAX_CONNECTIONS) {
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut buf = [0u8; 64];
        if matches!(s.read(&mut buf), Ok(0) | Err(_)) {
            dropped += 1;
        }
    }
    assert_eq!(dropped, 3 * MAX_CONNECTIONS, "every connection past the bound's newest was dropped");
    // The newest idle ones are dropped by the head's deadline.
    let last = idle.last_mut().unwrap();
    last.set_read_timeout(Some(HEAD_TIMEOUT * 3)).unwrap();
    let mut buf = [0u8; 256];
    let waited = Instant::now();
    let n = last.read(&mut buf).unwrap_or(0);
    assert!(waited.elapsed() < HEAD_TIMEOUT * 3, "an idle peer was held past its head's deadline");
    let text = String::from_utf8_lossy(&buf[..n]);
    assert!(n == 0 || text.starts_with("HTTP/1.1 408"), "{text}");
}

#[test]
fn it_starts_from_inside_an_async_runtime_too() {
    // An engine whose own loop is async builds the endpoint from a task: no nested runtime.
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let e = runtime.block_on(async { endpoint() });
    assert!(raw(e.addr(), b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").starts_with("HTTP/1.1 200"));
    drop(e);
}
