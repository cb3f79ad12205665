//! The lease table with one million and ten million live leases, against the full-scan table
//! (std's map and SipHash, as a connector keeps it naively; at a million also on the lease
//! table's own hasher) in the same run, and renewals of ids built to collide under an unkeyed hash against random
//! ids.
//!
//! `cargo xtask bench` runs this and prints each operation's time for both tables and their
//! ratio. Targets: grant, renew and release at most 100 ns and faster than the scan table,
//! a poll with nothing due under 10 ns, at both sizes; colliding ids renewed at most twice as
//! slowly as random ones. Where `KVFLOW_BENCH_OUT` names a folder, the memory each table took
//! (resident bytes added while filling it) is written there as `lease_table_memory.json`.

// criterion_group! and criterion_main! generate undocumented items.
#![allow(missing_docs)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use kv_core::Time;
use kv_lease::{LeaseTable, ScanLeaseTable};

const LEASE: Duration = Duration::from_secs(30);
const EXTENSION: Duration = Duration::from_secs(20);

/// `now` for the measurements: every lease is live, the earliest expires at 30 s.
fn now() -> Time {
    Time::from_millis(10_000)
}

/// Expiries spread over one second, as leases granted over a second of traffic.
fn expiry(i: u64, live: u64) -> Time {
    Time::ZERO + LEASE + Duration::from_nanos(i * 1_000_000_000 / live)
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

impl<S: std::hash::BuildHasher> Table for ScanLeaseTable<u64, S> {
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

/// The process's resident bytes (`/proc/self/statm`), 0 where there is none.
fn resident_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    statm.split_whitespace().nth(1).and_then(|pages| pages.parse::<u64>().ok()).unwrap_or(0) * 4096
}

/// `table` holding `live` leases, keys `key(0) .. key(live - 1)`, and the resident bytes that
/// took.
fn filled<T: Table>(mut table: T, live: u64, key: impl Fn(u64) -> u64) -> (T, u64) {
    let before = resident_bytes();
    for i in 0..live {
        table.grant(key(i), expiry(i, live));
    }
    let after = resident_bytes();
    (table, after.saturating_sub(before))
}

/// The key of lease `i`: lease indices as they are.
fn plain(i: u64) -> u64 {
    i
}

/// Measures `table`'s operations at `live` leases in `group`, as `name`; returns the memory
/// filling it took.
fn bench_table<T: Table>(c: &mut Criterion, group: &str, name: &str, table: T, live: u64) -> u64 {
    let (mut table, memory) = filled(table, live, plain);
    let mut group = c.benchmark_group(group);
    group.sample_size(20).warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(2));

    group.bench_function(BenchmarkId::new("poll_nothing_due", name), |b| {
        b.iter(|| assert_eq!(table.poll(black_box(now())), 0))
    });

    // Grant fresh keys (timed), then release them untimed, so the table stays at `live`.
    // Their expiries come after every live one, as `now + lease` does for new exports.
    let mut next = live;
    group.bench_function(BenchmarkId::new("grant", name), |b| {
        b.iter_custom(|iters| {
            let first = next;
            let start = Instant::now();
            for key in first..first + iters {
                table.grant(black_box(key), expiry(key, live));
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
            key = (key + 7_919) % live;
            heartbeat_at = heartbeat_at + Duration::from_nanos(1);
            black_box(table.renew(black_box(key), heartbeat_at))
        })
    });

    // Release live keys (timed), then grant them back untimed.
    let mut cursor = 0;
    group.bench_function(BenchmarkId::new("release", name), |b| {
        b.iter_custom(|iters| {
            let keys: Vec<u64> = (0..iters).map(|i| (cursor + i * 7_919) % live).collect();
            cursor = (cursor + iters * 7_919) % live;
            let start = Instant::now();
            for &key in &keys {
                black_box(table.release(black_box(key)));
            }
            let took = start.elapsed();
            for &key in &keys {
                // A key drawn twice in one large batch was released once; put each back once.
                table.release(key);
                table.grant(key, expiry(key, live));
            }
            took
        })
    });
    group.finish();
    memory
}

/// Lease `i`'s id built to collide under FxHash as rustc-hash 1 computes it, a multiply by an
/// odd constant: with the low 40 bits zero, every product's low 40 bits are zero too, and a
/// hash table that picks buckets by the low bits puts every one in bucket 0.
fn colliding(i: u64) -> u64 {
    i << 40
}

/// Lease `i`'s id drawn at random (splitmix64), as ids nobody chose.
fn random(i: u64) -> u64 {
    let mut z = i.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Renewals of a million leases whose ids collide under an unkeyed hash, against random ids.
fn bench_collisions(c: &mut Criterion) {
    const LIVE: u64 = 1_000_000;
    let mut group = c.benchmark_group("lease_table_collide");
    group.sample_size(20).warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(2));
    for (name, key) in [("colliding", colliding as fn(u64) -> u64), ("random", random)] {
        let (mut table, _) = filled(LeaseTable::<u64>::new(), LIVE, key);
        let (mut i, mut heartbeat_at) = (0, Time::from_millis(15_000));
        group.bench_function(BenchmarkId::new("renew", name), |b| {
            b.iter(|| {
                i = (i + 7_919) % LIVE;
                heartbeat_at = heartbeat_at + Duration::from_nanos(1);
                black_box(Table::renew(&mut table, black_box(key(i)), heartbeat_at))
            })
        });
    }
    group.finish();
}

fn lease_tables(c: &mut Criterion) {
    let mut memory = Vec::new();
    for (group, live) in [("lease_table", 1_000_000u64), ("lease_table_10m", 10_000_000)] {
        let indexed = bench_table(c, group, "indexed", LeaseTable::<u64>::new(), live);
        let scan = bench_table(c, group, "scan", ScanLeaseTable::<u64>::new(), live);
        if live == 1_000_000 {
            // The scan table on the indexed table's own hasher: the structures alone compared.
            let same = ScanLeaseTable::<u64, foldhash::fast::RandomState>::default();
            bench_table(c, group, "scan_foldhash", same, live);
        }
        memory.push(format!(r#""{group}": {{"live": {live}, "indexed_bytes": {indexed}, "scan_bytes": {scan}}}"#));
    }
    bench_collisions(c);
    if let Some(dir) = std::env::var_os("KVFLOW_BENCH_OUT") {
        let path = std::path::Path::new(&dir).join("lease_table_memory.json");
        std::fs::write(&path, format!("{{{}}}", memory.join(", "))).expect("the memory figures");
    }
}

criterion_group!(benches, lease_tables);
criterion_main!(benches);
