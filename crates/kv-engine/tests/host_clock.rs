//! The host clock is one clock for every process of the host: a child process's reading lies
//! between its parent's readings before and after it ran, so deadlines handed from a
//! scheduler's process to its ranks' processes keep their meaning. (A `ProcessClock` reads
//! from its own process's start, and a child's reading would lie before its parent's.)

use std::process::Command;

use kv_core::Clock;
use kv_engine::{HostClock, ProcessClock};

/// Set in the child: it prints its reading and stops there.
const CHILD: &str = "KVFLOW_HOST_CLOCK_CHILD";
const TEST: &str = "a_child_process_reads_the_same_clock";

/// The reading of `clock` that a child process of this test binary prints.
fn child_reading(clock: &str) -> u64 {
    let out = Command::new(std::env::current_exe().expect("the test binary"))
        .args(["--exact", TEST, "--nocapture", "--test-threads=1"])
        .env(CHILD, clock)
        .output()
        .expect("the child runs");
    assert!(out.status.success(), "the child failed: {}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    // The harness writes its own words on the same line.
    let after = stdout.split("reading ").nth(1).expect("the child printed its reading");
    let digits: String = after.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().expect("nanoseconds")
}

#[test]
fn a_child_process_reads_the_same_clock() {
    if let Ok(clock) = std::env::var(CHILD) {
        let now = if clock == "host" { HostClock.now() } else { ProcessClock::start().now() };
        println!("reading {}", now.as_nanos());
        return;
    }
    let before = HostClock.now().as_nanos();
    let child = child_reading("host");
    let after = HostClock.now().as_nanos();
    assert!(before <= child && child <= after, "the child read {child}, outside the parent's {before}..={after}");
    // A clock per process would not do: the child's reads from its own start.
    let parent = ProcessClock::start();
    std::thread::sleep(std::time::Duration::from_millis(20));
    let process_child = child_reading("process");
    assert!(process_child < parent.now().as_nanos(), "a child's process clock starts afresh");
}
