//! Dropping a transport stops and joins every thread it started (the only test of its binary,
//! so that the process's threads are this test's alone).

mod common;

use std::time::Duration;

use common::{agent, drain, duo, settle, until, Pool};
use kv_core::{DescriptorPair, TransferOp, TransferRequest, TransferStatus, Transport};

/// The names of this process's threads, where the operating system lists them.
fn threads() -> Option<Vec<String>> {
    let tasks = std::fs::read_dir("/proc/self/task").ok()?;
    let names = tasks.flatten().map(|t| std::fs::read_to_string(t.path().join("comm")).unwrap_or_default());
    Some(names.map(|n| n.trim().to_owned()).collect())
}

fn kvflow_threads() -> usize {
    threads().unwrap_or_default().iter().filter(|n| n.starts_with("kvflow-")).count()
}

#[test]
fn dropping_transports_ends_every_thread_they_started() {
    let Some(before) = threads() else {
        // Only Linux lists a process's threads in /proc; elsewhere there is nothing to count.
        return;
    };
    assert_eq!(kvflow_threads(), 0);
    let p_pool = Pool::patterned(1, 1 << 20, 2);
    let d_pool = Pool::new(2, 1 << 20);
    let mut duo = duo(&p_pool, &d_pool);
    let pairs = vec![DescriptorPair {
        local_region: 0,
        local_addr: d_pool.addr(0),
        remote_region: 0,
        remote_addr: p_pool.addr(0),
        len: 1 << 20,
    }];
    let request =
        TransferRequest { op: TransferOp::Read, peer: agent("prefill"), pairs, notification: Some(b"x".to_vec()) };
    let id = duo.d.post(request).unwrap();
    assert_eq!(settle(&mut duo.d, id, &mut duo.p, &mut duo.p_events), TransferStatus::Done);
    drain(&mut duo.p, &mut duo.p_events);
    // Per transport: side channel, accept, an outgoing connection's two, an incoming one's;
    // the last may start a moment after the transfer is done (seen on a loaded machine: 8).
    until(Duration::from_secs(10), "the transports' threads to run", || kvflow_threads() >= 10);
    drop(duo);
    // Drop joined them; the kernel takes a joined thread out of /proc a moment after.
    until(Duration::from_millis(500), "every thread the transports started to be gone", || {
        kvflow_threads() == 0 && threads().map(|t| t.len()) == Some(before.len())
    });
}
