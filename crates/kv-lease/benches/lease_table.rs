//! The lease table with one million live leases, against the full-scan table in the same run.
//!
//! `cargo xtask bench` runs this and prints each operation's time for both tables and their
//! ratio. Targets: a poll with nothing due under 1 µs, grant, renew and release under 200 ns.

// criterion_group! and criterion_main! generate undocumented items.
#![allow(missing_docs)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use kv_core::Time;
use kv_lease::{LeaseTable, ScanLeaseTable};

const LIVE: u64 = 1_000_000;
const LEASE: Duration = Duration::from_secs(30);
const EXTENSION: Duration = Duration::from_secs(20);

/// `now` for the measurements: every lease is live, the earliest expires at 30 s.
fn now() -> Time {
    Time::from_millis(10_000)
}

/// Expiries spread over one second, as leases granted over a second of traffic.
fn expiry(key: u64) -> Time {
    Time::ZERO + LEASE + Duration::from_nanos(key * 1_000)
}

/// What both tables offer, so each measurement runs the same code over either.
trait Table {
    fn grant(&mut self, key: u64, expiry: Time);
    fn renew(&mut self, key: u64, now: Time) -> Option<Time>;
    fn release(&mut self, key: u64) -> Option<Time>;
    fn poll(&mut self, now: Time) -> usize;
}

impl Table for LeaseTable<u64> {
    fn grant(&mut self, key: u64, expiry: Time) {
        LeaseTable::grant(self, key, expiry).unwrap();
    }
    fn renew(&mut self, key: u64, now: Time) -> Option<Time> {
        LeaseTable::renew(self, &key, now, EXTENSION)
    }
    fn release(&mut self, key: u64) -> Option<Time> {
        LeaseTable::release(self, &key)
    }
    fn poll(&mut self, now: Time) -> usize {
        std::iter::from_fn(|| self.poll_expired(now)).count()
    }
}

impl Table for ScanLeaseTable<u64> {
    fn grant(&mut self, key: u64, expiry: Time) {
        ScanLeaseTable::grant(self, key, expiry).unwrap();
    }
    fn renew(&mut self, key: u64, now: Time) -> Option<Time> {
        ScanLeaseTable::renew(self, &key, now, EXTENSION)
    }
    fn release(&mut self, key: u64) -> Option<Time> {
        ScanLeaseTable::release(self, &key)
    }
    fn poll(&mut self, now: Time) -> usize {
        self.poll_expired(now).len()
    }
}

fn filled<T: Table>(mut table: T) -> T {
    for key in 0..LIVE {
        table.grant(key, expiry(key));
    }
    table
}

fn bench_table<T: Table>(c: &mut Criterion, name: &str, table: T) {
    let mut table = filled(table);
    let mut group = c.benchmark_group("lease_table");
    group.sample_size(20).warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(2));

    group.bench_function(BenchmarkId::new("poll_nothing_due", name), |b| {
        b.iter(|| assert_eq!(table.poll(black_box(now())), 0))
    });

    // Grant fresh keys (timed), then release them untimed, so the table stays at a million.
    // Their expiries come after every live one, as `now + lease` does for new exports.
    let mut next = LIVE;
    group.bench_function(BenchmarkId::new("grant", name), |b| {
        b.iter_custom(|iters| {
            let first = next;
            let start = Instant::now();
            for key in first..first + iters {
                table.grant(black_box(key), expiry(key));
            }
            let took = start.elapsed();
            for key in first..first + iters {
                table.release(key);
            }
            next += iters;
            took
        })
    });

    // Heartbeats arrive as time moves on, so every renewal really extends its lease.
    let (mut key, mut heartbeat_at) = (0, Time::from_millis(15_000));
    group.bench_function(BenchmarkId::new("renew", name), |b| {
        b.iter(|| {
            key = (key + 7_919) % LIVE;
            heartbeat_at = heartbeat_at + Duration::from_nanos(1);
            black_box(table.renew(black_box(key), heartbeat_at))
        })
    });

    // Release live keys (timed), then grant them back untimed.
    let mut cursor = 0;
    group.bench_function(BenchmarkId::new("release", name), |b| {
        b.iter_custom(|iters| {
            let keys: Vec<u64> = (0..iters).map(|i| (cursor + i * 7_919) % LIVE).collect();
            cursor = (cursor + iters * 7_919) % LIVE;
            let start = Instant::now();
            for &key in &keys {
                black_box(table.release(black_box(key)));
            }
            let took = start.elapsed();
            for &key in &keys {
                // A key drawn twice in one large batch was released once; put each back once.
                table.release(key);
                table.grant(key, expiry(key));
            }
            took
        })
    });
    group.finish();
}

fn lease_tables(c: &mut Criterion) {
    bench_table(c, "indexed", LeaseTable::<u64>::new());
    bench_table(c, "scan", ScanLeaseTable::<u64>::new());
}

criterion_group!(benches, lease_tables);
criterion_main!(benches);
