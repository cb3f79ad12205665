//! Two processes, each with a 256 MiB KV pool from kv-cuda, move it through NIXL/UCX and check
//! every byte: D reads P's pool block by block in reverse, then by prepared block indices, reads a
//! slice of it into a staging region, and writes its own pool into P's, which P checks when the
//! completion arrives.
//!
//! On a GPU both pools are device memory on one GPU (VRAM to VRAM) and the staging region is
//! pinned host memory. That test is `#[ignore = "needs a CUDA device"]`: `cargo test` reports it
//! as ignored, and `--include-ignored` runs it where a CUDA device and the NIXL runtime are (as
//! `gpu/run.sh` does), failing without them. The same flow over host pools runs wherever the
//! NIXL runtime is (under `CI=true` it must be). P is this test binary again, selected by
//! `KVFLOW_TEST_ROLE`, so that each NIXL agent has its own process.

use std::io::Write;
use std::time::{Duration, Instant};

use kv_core::{
    DescriptorPair, Memory, MemoryKind, Message, PeerEvent, PreparedTransfer, Role, TransferOp, TransferRequest,
    Transport,
};
use kv_cuda::CudaMemory;
use kv_demo::e2e::{
    connect, expect_line, gbps, nixl_skip_reason, offer, pair, pattern, post_and_wait, post_prepared_and_wait,
    ran_as_child, shape, spawn_self, transport, BLOCKS, BLOCK_BYTES, POOL_BYTES,
};

const ROLE: &str = "KVFLOW_TEST_ROLE";
/// The kind of P's pool, for the child: `host` or `device`.
const KIND: &str = "KVFLOW_TEST_KIND";
/// P fills its pool with this seed's pattern; D writes its own with the other.
const P_SEED: u8 = 7;
const D_SEED: u8 = 9;
/// The slice of P's pool that D reads into its staging region.
const STAGING_OFFSET: u64 = 64 << 20;
const STAGING_BYTES: u64 = 16 << 20;

/// The pools' kind, by its name in [`KIND`].
fn pool_kind(name: &str) -> MemoryKind {
    match name {
        "device" => MemoryKind::Device(0),
        _ => MemoryKind::Host,
    }
}

/// P: a filled pool, served until D goes away; on each notification it checks whether its pool
/// now holds what D writes.
fn prefill_child() {
    let kind = pool_kind(&std::env::var(KIND).unwrap_or_default());
    let mut memory = CudaMemory::new();
    let pool = memory.allocate(kind, POOL_BYTES).expect("P's pool");
    memory.write(pool.id, 0, &pattern(P_SEED, POOL_BYTES as usize)).expect("fill P's pool");
    let mut t = transport(offer("prefill", Role::Prefill, &pool), &[pool]).expect("P's transport");
    println!("READY {}", t.side_channel_addr().port());
    let written = pattern(D_SEED, POOL_BYTES as usize);
    let mut back = vec![0u8; POOL_BYTES as usize];
    let deadline = Instant::now() + Duration::from_secs(120);
    while Instant::now() < deadline {
        while let Some(event) = t.poll_event() {
            match event {
                PeerEvent::Lost(_) => return,
                PeerEvent::Notification(note) => {
                    let message =
                        Message::decode(&note.payload).map(|m| format!("{m:?}")).unwrap_or_else(|e| e.to_string());
                    // A write's notification arrives after its bytes.
                    memory.read(pool.id, 0, &mut back).expect("read P's pool back");
                    println!("NOTIFIED {} {message} holds_d_bytes={}", note.from, back == written);
                }
                _ => {}
            }
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn completion(request: &str) -> Option<Vec<u8>> {
    Some(kv_demo::e2e::completion(request))
}

/// NIXL "might deadlock" with several agents in one process: the tests of this binary take turns.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SERIAL.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[test]
#[ignore = "needs a CUDA device"]
fn gpu_two_processes_move_a_256_mib_pool_vram_to_vram_over_nixl() {
    const NAME: &str = "gpu_two_processes_move_a_256_mib_pool_vram_to_vram_over_nixl";
    if ran_as_child(ROLE, prefill_child) {
        return;
    }
    match kv_cuda::cuda_device_count() {
        Ok(0) => panic!("{NAME} needs a CUDA device, and the driver sees none"),
        Ok(_) => {}
        Err(reason) => panic!("{NAME} needs a CUDA device: {reason}"),
    }
    if let Some(reason) = nixl_skip_reason() {
        panic!("{NAME} needs the NIXL runtime: {reason}");
    }
    move_a_pool_both_ways(NAME, "device", MemoryKind::PinnedHost);
}

/// Over host pools, wherever the NIXL runtime is; without it the test says why it did not
/// run, except under `CI=true`, which provides the runtime and fails.
#[test]
fn two_processes_move_a_256_mib_host_pool_over_nixl() {
    const NAME: &str = "two_processes_move_a_256_mib_host_pool_over_nixl";
    if ran_as_child(ROLE, prefill_child) {
        return;
    }
    match nixl_skip_reason() {
        None => move_a_pool_both_ways(NAME, "host", MemoryKind::Host),
        Some(reason) => {
            let in_ci = std::env::var("CI").as_deref() == Ok("true");
            assert!(!in_ci, "{NAME}: CI must run the NIXL tests, but {reason}");
            // Straight to stderr, past libtest's capture, so that a CPU run shows what it skipped.
            let _ = writeln!(std::io::stderr(), "skipped {NAME}: {reason}");
        }
    }
}

/// The whole exchange, with pools of `kind_name` on both sides and D's staging region of
/// `staging_kind`.
fn move_a_pool_both_ways(name: &str, kind_name: &str, staging_kind: MemoryKind) {
    let _serial = serial();
    let kind = pool_kind(kind_name);
    // P's process runs the same test, ignored or not.
    let args = [name, "--exact", "--include-ignored", "--nocapture", "--test-threads=1"];
    let (mut child, mut out) = spawn_self(&args, &[(ROLE, "prefill"), (KIND, kind_name)]).expect("spawn P");
    let port: u16 = expect_line(&mut out, "READY").unwrap().parse().unwrap();

    let mut memory = CudaMemory::new();
    let pool = memory.allocate(kind, POOL_BYTES).expect("D's pool");
    let staging = memory.allocate(staging_kind, STAGING_BYTES).expect("D's staging region");
    let mut d = transport(offer("decode", Role::Decode, &pool), &[pool, staging]).expect("D's transport");
    let info = connect(&mut d, port).unwrap();
    let remote = info.handshake.regions[0];
    assert_eq!(remote.len, POOL_BYTES);
    let expected = pattern(P_SEED, POOL_BYTES as usize);
    let mut back = vec![0u8; POOL_BYTES as usize];
    let block = BLOCK_BYTES as usize;

    // 1. Block b of D's pool from block BLOCKS-1-b of P's: one descriptor pair per block.
    let pairs: Vec<DescriptorPair> = (0..u64::from(BLOCKS))
        .map(|b| {
            pair(pool.addr + b * BLOCK_BYTES, remote.addr + (u64::from(BLOCKS) - 1 - b) * BLOCK_BYTES, BLOCK_BYTES)
        })
        .collect();
    let request =
        TransferRequest { op: TransferOp::Read, peer: info.agent.clone(), pairs, notification: completion("r1") };
    let took = post_and_wait(&mut d, request).unwrap();
    eprintln!("{name}: reversed read of 256 MiB in 128 descriptors: {took:?} ({:.1} GB/s)", gbps(POOL_BYTES, took));
    memory.read(pool.id, 0, &mut back).unwrap();
    for b in 0..BLOCKS as usize {
        let from = BLOCKS as usize - 1 - b;
        assert!(back[b * block..(b + 1) * block] == expected[from * block..(from + 1) * block], "block {b}");
    }
    let note = expect_line(&mut out, "NOTIFIED").unwrap();
    assert!(note.starts_with("decode/tp0 Completion") && note.contains("\"r1\""), "{note}");

    // 2. The same blocks prepared once on each side, named by index, in order.
    let s = shape();
    let local = d.prepare(None, &s.block_descriptors(&[pool.addr])).unwrap();
    let remote_list = d.prepare(Some(&info.agent), &s.block_descriptors(&[remote.addr])).unwrap();
    let request = PreparedTransfer {
        op: TransferOp::Read,
        peer: info.agent.clone(),
        local,
        local_indices: (0..BLOCKS).collect(),
        remote: remote_list,
        remote_indices: (0..BLOCKS).collect(),
        notification: completion("r2"),
    };
    post_prepared_and_wait(&mut d, request).unwrap();
    memory.read(pool.id, 0, &mut back).unwrap();
    assert!(back == expected, "D's pool differs from P's after the prepared read");
    assert!(expect_line(&mut out, "NOTIFIED").unwrap().contains("\"r2\""));

    // 3. P's pool into D's staging region (VRAM into pinned host memory, on a GPU).
    let pairs = vec![DescriptorPair {
        local_region: 1,
        local_addr: staging.addr,
        remote_region: 0,
        remote_addr: remote.addr + STAGING_OFFSET,
        len: STAGING_BYTES,
    }];
    let request = TransferRequest { op: TransferOp::Read, peer: info.agent.clone(), pairs, notification: None };
    post_and_wait(&mut d, request).unwrap();
    let mut staged = vec![0u8; STAGING_BYTES as usize];
    memory.read(staging.id, 0, &mut staged).unwrap();
    let at = STAGING_OFFSET as usize;
    assert!(staged == expected[at..at + STAGING_BYTES as usize], "D's staging region differs from P's pool");

    // 4. D writes its own pool into P's, whole; P checks its pool when the completion arrives.
    memory.write(pool.id, 0, &pattern(D_SEED, POOL_BYTES as usize)).unwrap();
    let pairs = vec![pair(pool.addr, remote.addr, POOL_BYTES)];
    let request =
        TransferRequest { op: TransferOp::Write, peer: info.agent.clone(), pairs, notification: completion("w1") };
    let took = post_and_wait(&mut d, request).unwrap();
    eprintln!("{name}: write of 256 MiB in 1 descriptor: {took:?} ({:.1} GB/s)", gbps(POOL_BYTES, took));
    let note = expect_line(&mut out, "NOTIFIED").unwrap();
    assert!(note.contains("\"w1\""), "{note}");
    assert!(note.ends_with("holds_d_bytes=true"), "P's pool differs from what D wrote: {note}");

    drop(d);
    let _ = child.wait();
}
