//! End-to-end checks where kvflow's real adapters meet: KV pools that kv-cuda allocates (GPU
//! memory included), moved between processes by kv-transport-nixl's `NixlTransport`.
//!
//! The adapters may not know each other (see ARCHITECTURE.md), so what proves that they work
//! together lives in kv-demo, the harness that wires them: `tests/pools.rs` moves a 256 MiB pool between two processes and checks
//! every byte, VRAM to VRAM in a test that is `#[ignore = "needs a CUDA device"]` (run with
//! `--include-ignored` on a GPU machine), and host to host on every machine with the NIXL
//! runtime; `benches/vram.rs` measures the VRAM move against a plain device-to-device copy of
//! the same bytes in the same run; `benches/transport.rs` (in `cargo xtask bench`) measures
//! kvflow's transfer plans between host pools against raw nixl-sys, per-block descriptors and
//! memcpy.
//!
//! This library holds what the test and the benches share: the pool's layout, the handshake offer,
//! a transport over a pool, the child process and its serving loop, the byte pattern, posting a
//! transfer and timing it, and the benches' round-robin rounds, arithmetic and common flags.
//!
//! For a GPU machine that reaches no registry, `crates/kv-demo/gpu/pack.sh` packs the release binaries and the
//! NIXL runtime of the `nixl-cu13` wheel into one small folder, and `crates/kv-demo/gpu/run.sh` runs the checks
//! there: the tests with `--include-ignored`, the VRAM bench with `KVFLOW_GPU=1`.

use std::io::{BufRead, BufReader};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_core::{
    AgentName, Clock, DescriptorPair, EngineId, Handshake, KvLayout, Message, PeerAddress, PeerEvent, PeerInfo,
    PoolShape, PreparedTransfer, Region, RegionBase, RequestId, Role, TransferId, TransferRequest, TransferStatus,
    Transport, TransportError,
};
use kv_transport_nixl::{runtime, NixlConfig, NixlError, NixlTransport};

/// Blocks in a pool.
pub const BLOCKS: u32 = 128;
/// Bytes of one block: 32 layers, K and V, 8 heads of 128, 16 tokens, bf16.
pub const BLOCK_BYTES: u64 = 32 * 2 * 8 * 128 * 16 * 2;
/// Bytes of a pool: 256 MiB.
pub const POOL_BYTES: u64 = BLOCK_BYTES * BLOCKS as u64;

/// The model's KV layout: Llama-3-8B-like, 2 MiB blocks of 16 tokens, block-major, so that a
/// pool is one region.
pub fn layout() -> KvLayout {
    KvLayout::llama3_8b(16)
}

/// The pool's shape: every head, [`BLOCKS`] blocks.
pub fn shape() -> PoolShape {
    PoolShape::new(layout(), 8, BLOCKS).expect("the e2e layout is valid")
}

/// Why a check over NIXL cannot run here, if it cannot: there is no NIXL runtime.
pub fn nixl_skip_reason() -> Option<String> {
    if runtime::runtime_present(None) {
        return None;
    }
    let dir = runtime::runtime_dir(None)
        .map_or_else(|| "nowhere (KVFLOW_NIXL_DIR is not set)".to_owned(), |d| d.display().to_string());
    Some(format!("no NIXL runtime at {dir} (run cargo xtask setup, then set KVFLOW_NIXL_DIR)"))
}

/// Why the VRAM bench cannot run here, if it cannot: `KVFLOW_GPU` is not `1`, there is no CUDA
/// device, or there is no NIXL runtime.
pub fn gpu_skip_reason() -> Option<String> {
    kv_cuda::gpu_for_tests().err().or_else(nixl_skip_reason)
}

pub use kv_engine::ProcessClock;

/// The handshake offer of rank 0 of `engine`, whose pool is `pool`.
pub fn offer(engine: &str, role: Role, pool: &Region) -> Handshake {
    offer_with(engine, role, layout(), BLOCKS, vec![RegionBase { addr: pool.addr, len: pool.len }])
}

/// The handshake offer of rank 0 of `engine`, a TP of one, for a pool of `layout`.
pub fn offer_with(engine: &str, role: Role, layout: KvLayout, num_blocks: u32, regions: Vec<RegionBase>) -> Handshake {
    let agent = AgentName::new(EngineId::new(engine), 0);
    Handshake { num_blocks, regions, ..Handshake::new(&agent, 1, 0, role, "kvflow-e2e", layout) }
}

/// The transport configuration of these checks: NIXL's defaults, the side channel on an
/// ephemeral loopback port.
pub fn loopback() -> NixlConfig {
    NixlConfig { bind: "127.0.0.1:0".parse().expect("loopback"), ..NixlConfig::default() }
}

/// A transport for `offer` with [`loopback`]'s configuration, with `regions` registered.
pub fn transport(offer: Handshake, regions: &[Region]) -> Result<NixlTransport, NixlError> {
    transport_with(offer, regions, &loopback())
}

/// A transport for `offer` with `config`, with `regions` registered.
pub fn transport_with(offer: Handshake, regions: &[Region], config: &NixlConfig) -> Result<NixlTransport, NixlError> {
    let clock: Arc<dyn Clock> = Arc::new(ProcessClock::start());
    runtime::prepare(None)?;
    let mut t = NixlTransport::new(offer, config, clock)?;
    for region in regions {
        t.register(region)?;
    }
    Ok(t)
}

/// Connects `t` to the listener on loopback `port` and waits for the handshake.
pub fn connect(t: &mut NixlTransport, port: u16) -> Result<PeerInfo, String> {
    t.connect(&PeerAddress(format!("127.0.0.1:{port}"))).map_err(|e| e.to_string())?;
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(30) {
        match t.poll_event() {
            Some(PeerEvent::Connected(info)) => return Ok(*info),
            Some(other) => return Err(format!("expected a connection, got {other:?}")),
            None => std::thread::sleep(Duration::from_millis(1)),
        }
    }
    Err(format!("no handshake with 127.0.0.1:{port} within 30 s"))
}

/// One descriptor pair between the first region of each side: `len` bytes at `local_addr` and
/// at `remote_addr`.
pub fn pair(local_addr: u64, remote_addr: u64, len: u64) -> DescriptorPair {
    DescriptorPair { local_region: 0, local_addr, remote_region: 0, remote_addr, len }
}

/// The notification D sends with a read of `request`: its completion, for one consumer.
pub fn completion(request: &str) -> Vec<u8> {
    Message::Completion { request: RequestId::new(request), expected_consumers: 1 }
        .encode()
        .expect("a completion encodes")
}

/// Posts `request` and waits until it is done; returns how long it took from just before the
/// post (UCX may move the bytes inside the post call).
pub fn post_and_wait(t: &mut NixlTransport, request: TransferRequest) -> Result<Duration, TransportError> {
    let start = Instant::now();
    let id = t.post(request)?;
    wait_done(t, id, start)
}

/// As [`post_and_wait`], for a transfer between prepared descriptor lists.
pub fn post_prepared_and_wait(t: &mut NixlTransport, request: PreparedTransfer) -> Result<Duration, TransportError> {
    let start = Instant::now();
    let id = t.post_prepared(request)?;
    wait_done(t, id, start)
}

/// Polls a transfer until it is done, spinning, and returns how long it took since `start`.
pub fn wait_done(t: &mut NixlTransport, id: TransferId, start: Instant) -> Result<Duration, TransportError> {
    loop {
        match t.poll_transfer(id) {
            TransferStatus::Done => return Ok(start.elapsed()),
            TransferStatus::InProgress if start.elapsed() > Duration::from_secs(60) => {
                return Err(TransportError::TransferFailed(format!("{id:?} did not finish in 60 s")));
            }
            TransferStatus::InProgress => std::hint::spin_loop(),
            TransferStatus::Failed(e) => return Err(e),
        }
    }
}

/// Whether this process is the other process of a check, started by [`spawn_self`] with the
/// environment variable `role` set; if it is, it has run `child`.
pub fn ran_as_child(role: &str, child: impl FnOnce()) -> bool {
    let is_child = std::env::var_os(role).is_some();
    if is_child {
        child();
    }
    is_child
}

/// This executable again, with `args`, and `env` set: the other process of a check. Its stdout is
/// piped back; read it with [`expect_line`].
pub fn spawn_self(args: &[&str], env: &[(&str, &str)]) -> std::io::Result<(Child, BufReader<ChildStdout>)> {
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.args(args).envs(env.iter().copied()).stdout(Stdio::piped()).stderr(Stdio::inherit());
    let mut child = cmd.spawn()?;
    let out = child.stdout.take().map(BufReader::new).ok_or_else(|| std::io::Error::other("no child stdout"))?;
    Ok((child, out))
}

/// Reads the child's lines until one holds `marker`; returns what follows it, trimmed.
pub fn expect_line(out: &mut BufReader<ChildStdout>, marker: &str) -> Result<String, String> {
    let mut line = String::new();
    loop {
        line.clear();
        let n = out.read_line(&mut line).map_err(|e| format!("cannot read the child's output: {e}"))?;
        if n == 0 {
            return Err(format!("the child ended before printing {marker:?}"));
        }
        // libtest prints "test NAME ... " before the test runs, so a marker may start mid-line.
        if let Some(at) = line.find(marker) {
            return Ok(line[at + marker.len()..].trim().to_owned());
        }
    }
}

/// Serves peers until one goes away (its side channel closes): the P side of a bench, whose
/// peer does the reads and writes.
pub fn serve_until_peer_leaves(t: &mut NixlTransport) {
    loop {
        while let Some(event) = t.poll_event() {
            if let PeerEvent::Lost(_) = event {
                return;
            }
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The flags both two-process benches take, beside their own (`--iters N`, and `--host` for the
/// VRAM bench). `cargo bench` passes `--bench` to a `harness = false` bench: it is accepted
/// and means nothing here.
#[derive(clap::Args, Debug)]
pub struct BenchFlags {
    /// Prints one JSON object as the last line.
    #[arg(long)]
    pub json: bool,
    #[arg(long, hide = true)]
    bench: bool,
}

/// Times `ways` ways of doing one thing round-robin, so that each sees the same stretch of a
/// noisy machine: one round to warm up, then `iters` rounds. `run(i)` does way `i` once and
/// returns how long it took; the result is each way's samples, in order.
pub fn round_robin(ways: usize, iters: u32, mut run: impl FnMut(usize) -> Duration) -> Vec<Vec<Duration>> {
    let mut samples = vec![Vec::new(); ways];
    for round in 0..=iters {
        for (way, samples) in samples.iter_mut().enumerate() {
            let took = run(way);
            // Round 0 warms up.
            if round > 0 {
                samples.push(took);
            }
        }
    }
    samples
}

/// How long `f` took.
pub fn timed(f: impl FnOnce()) -> Duration {
    let start = Instant::now();
    f();
    start.elapsed()
}

/// The middle sample (the upper one of an even count); zero for no samples.
pub fn median(samples: Vec<Duration>) -> Duration {
    crate::stats::quantile(&samples, 0.5).unwrap_or_default()
}

/// `bytes` moved in `d`, in GB/s (10^9 bytes per second, each byte counted once).
pub fn gbps(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

/// `len` bytes in which no two 8-byte words are equal, different for each seed, so
/// that a block moved to the wrong place, or not at all, shows.
pub fn pattern(seed: u8, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len + 8);
    let mix = u64::from(seed).wrapping_mul(0xD6E8_FEB8_6659_FD93);
    for word in 0..len.div_ceil(8) as u64 {
        out.extend_from_slice(&((word ^ mix).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ mix).to_le_bytes());
    }
    out.truncate(len);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pool_is_256_mib_of_2_mib_blocks_in_one_region() {
        let shape = shape();
        assert_eq!(shape.block_bytes(), BLOCK_BYTES);
        assert_eq!(BLOCK_BYTES, 2 << 20);
        assert_eq!(shape.pool_bytes(), POOL_BYTES);
        assert_eq!(POOL_BYTES, 256 << 20);
        assert_eq!(shape.region_count(), 1);
    }

    #[test]
    fn patterns_differ_by_seed_and_along_a_block() {
        let (a, b) = (pattern(1, 1 << 16), pattern(2, 1 << 16));
        assert_ne!(a, b);
        assert_ne!(a[..4096], a[4096..8192]);
        assert_eq!(pattern(1, 13), a[..13]);
    }
}
