//! What the two-process tests share: host pools, a clock, child processes, and the NIXL check.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_core::{
    AgentName, Clock, EngineId, Handshake, KvLayout, MemoryKind, PeerEvent, Region, RegionBase, RegionId, Role,
    Transport,
};
use kv_transport_nixl::{runtime, KeySource, NixlConfig, NixlTransport};

/// Held by each test's parent side: NIXL "might deadlock" with several agents in one process,
/// so the tests of one binary take turns (each child is its own process anyway).
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SERIAL.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The environment variable that makes a test binary act as a child process.
pub const ROLE: &str = "KVFLOW_TEST_ROLE";

/// Whether this test can run: the NIXL runtime is there. Under `CI=true` it must be.
pub fn nixl_or_skip(test: &str) -> bool {
    if runtime::runtime_present(None) {
        return true;
    }
    let dir = runtime::runtime_dir(None)
        .map_or_else(|| "nowhere (KVFLOW_NIXL_DIR is not set)".to_owned(), |d| d.display().to_string());
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("{test}: CI must run the NIXL tests, but no runtime is at {dir}; cargo xtask ci provisions it");
    }
    eprintln!("skipped {test}: no NIXL runtime at {dir} (run cargo xtask setup, then set KVFLOW_NIXL_DIR)");
    false
}

/// The process's monotonic clock.
pub fn clock() -> Arc<dyn Clock> {
    Arc::new(kv_side_tcp::MonotonicClock::start())
}

/// A small model: 4 layers, 8 heads of 64, bf16, 16-token blocks: 128 KiB a block.
pub fn layout(block_tokens: u32) -> KvLayout {
    KvLayout::split_kv(4, block_tokens, 8, 64, kv_core::Dtype::Bfloat16)
}

pub const BLOCK_BYTES: usize = 4 * 2 * 8 * 16 * 64 * 2;

/// Host memory at a stable address, registered with NIXL as DRAM.
pub struct HostPool {
    pub bytes: Vec<u8>,
}

impl HostPool {
    pub fn new(blocks: usize) -> Self {
        HostPool { bytes: vec![0; blocks * BLOCK_BYTES] }
    }

    pub fn region(&self) -> Region {
        Region {
            id: RegionId(1),
            kind: MemoryKind::Host,
            addr: self.bytes.as_ptr() as u64,
            len: self.bytes.len() as u64,
        }
    }

    pub fn base(&self) -> RegionBase {
        RegionBase { addr: self.bytes.as_ptr() as u64, len: self.bytes.len() as u64 }
    }

    /// Fills block `b` with the bytes P computes for it.
    pub fn fill(&mut self, block: usize, seed: u8) {
        for (i, byte) in self.bytes[block * BLOCK_BYTES..(block + 1) * BLOCK_BYTES].iter_mut().enumerate() {
            *byte = pattern(seed, block, i);
        }
    }

    /// Whether block `b` holds what `fill(src_block, seed)` wrote.
    pub fn holds(&self, block: usize, src_block: usize, seed: u8) -> bool {
        // NIXL wrote these bytes behind the compiler's back; read them afresh.
        let got: Vec<u8> = (0..BLOCK_BYTES).map(|i| fresh_read(&self.bytes, block * BLOCK_BYTES + i)).collect();
        got.iter().enumerate().all(|(i, b)| *b == pattern(seed, src_block, i))
    }
}

fn fresh_read(bytes: &[u8], i: usize) -> u8 {
    std::hint::black_box(bytes)[i]
}

pub fn pattern(seed: u8, block: usize, i: usize) -> u8 {
    (seed as usize ^ block.wrapping_mul(131) ^ i.wrapping_mul(7) ^ (i >> 9)) as u8
}

/// The handshake offer of rank 0 of `engine`.
pub fn offer(engine: &str, role: Role, tp: u32, block_tokens: u32, pool: &HostPool, blocks: u32) -> Handshake {
    let agent = AgentName::new(EngineId::new(engine), 0);
    let offer = Handshake::new(&agent, tp, 0, role, "kvflow-test-model", layout(block_tokens));
    Handshake { num_blocks: blocks, regions: vec![pool.base()], ..offer }
}

/// The variable a test's cluster key is passed in, to its children too.
pub const KEY_ENV: &str = "KVFLOW_TEST_CLUSTER_KEY";

/// A transport listening on an ephemeral loopback port, with `pool` registered; it holds the
/// key in [`KEY_ENV`] when that is set.
pub fn transport(offer: Handshake, pool: &HostPool) -> NixlTransport {
    let key = if std::env::var_os(KEY_ENV).is_some() { KeySource::Env(KEY_ENV.into()) } else { KeySource::None };
    transport_with(offer, pool, key)
}

/// As [`transport`], with the key from `key`.
pub fn transport_with(offer: Handshake, pool: &HostPool, key: KeySource) -> NixlTransport {
    transport_config(offer, pool, NixlConfig { key, ..test_config() })
}

/// The configuration the tests' transports start from: an ephemeral loopback port, no key.
pub fn test_config() -> NixlConfig {
    NixlConfig { bind: "127.0.0.1:0".parse().unwrap(), ..NixlConfig::default() }
}

/// A transport made with `config`, with `pool` registered.
pub fn transport_config(offer: Handshake, pool: &HostPool, config: NixlConfig) -> NixlTransport {
    runtime::prepare(None).expect("the NIXL runtime");
    let mut t = NixlTransport::new(offer, &config, clock()).expect("NIXL transport");
    t.register(&pool.region()).expect("register pool");
    t
}

/// Waits up to `limit` for a peer event.
pub fn next_event(t: &mut NixlTransport, limit: Duration) -> Option<PeerEvent> {
    let start = Instant::now();
    while start.elapsed() < limit {
        if let Some(e) = t.poll_event() {
            return Some(e);
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    None
}

/// This test binary again, as `role`, running `test` only.
pub fn spawn_child(test: &str, role: &str, extra_env: &[(&str, String)]) -> (Child, BufReader<ChildStdout>) {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(ROLE, role)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    for (k, v) in extra_env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("spawn child");
    let out = BufReader::new(child.stdout.take().unwrap());
    (child, out)
}

/// Reads the child's lines until one holds `prefix`; returns what follows it.
pub fn expect_line(out: &mut BufReader<ChildStdout>, prefix: &str) -> String {
    let mut line = String::new();
    loop {
        line.clear();
        let n = out.read_line(&mut line).expect("read child output");
        assert!(n > 0, "the child ended before printing {prefix:?}");
        // libtest prints "test NAME ... " before the test runs, so a marker may start mid-line.
        if let Some(at) = line.find(prefix) {
            return line[at + prefix.len()..].trim().to_owned();
        }
    }
}
