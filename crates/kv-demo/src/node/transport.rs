//! A rank's transport as the engine's configuration says (NIXL or TCP), wrapped to time each
//! transfer it posts from post to completion, and to name the request its notification
//! completes, for the router's report. A push write ahead of its export carries no
//! notification: it is named for the request whose computed blocks it writes from
//! ([`AheadOf`], which the rank's thread fills from the commands it hands its worker).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::Waker;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use kv_core::{
    AgentName, BlockId, DescriptorPair, Handshake, Message, PeerAddress, PeerEvent, PollIntervals, PreparedId,
    PreparedTransfer, Region, RegionId, TransferId, TransferOp, TransferRequest, TransferSizes, TransferStatus,
    Transport, TransportError,
};
use kv_sched_adapter::LocalPool;
use kv_transport_nixl::{KeySource, NixlConfig, NixlTransport};
use kv_transport_tcp::{TcpConfig, TcpTransport};

use super::metrics::Listeners;
use crate::e2e::ProcessClock;
use crate::proto::{NodeConfig, TransportKind, CLUSTER_KEY_ENV};

/// Set by [`Command::DieDuringWrite`](crate::proto::Command::DieDuringWrite): the process
/// kills itself right after posting its next write.
static DIE_DURING_WRITE: AtomicBool = AtomicBool::new(false);

/// From now on, the first rank to post a write kills the process right after.
pub(super) fn die_during_next_write() {
    DIE_DURING_WRITE.store(true, Ordering::SeqCst);
}

/// Dies by SIGKILL, as the attack suite's kill of P mid-write asks: no handler runs, nothing is
/// flushed, the write just posted is in flight.
#[allow(unsafe_code)] // One libc call: see the SAFETY note.
fn die_now() -> ! {
    // SAFETY: kill(2) with this process's own id and a signal number; it changes no memory.
    unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    // SIGKILL cannot be caught: the process is gone before this line.
    std::process::abort()
}

/// A transfer that ended.
pub(super) struct Ended {
    /// Bytes it moved.
    pub(super) bytes: u64,
    /// From post to end.
    pub(super) took: Duration,
    /// Whether it succeeded.
    pub(super) ok: bool,
    /// The request it is for: the one its notification completes (P's request id for D's
    /// reads), or the one a write ahead writes from.
    pub(super) request: Option<String>,
    /// It carries the request's completion: one of D's reads, or one of P's final writes (not
    /// a write ahead).
    pub(super) completes: bool,
}

/// Which request each of a P rank's computed blocks belongs to while it computes in chunks
/// (its blocks are written ahead): shared by the rank's thread, which fills it from the commands
/// it hands its worker, and its transport, which names a write without a notification for the
/// request that owns the first P block it writes from. Several prompts compute at once, and a
/// write ahead may follow any of them (a registration that arrives late), so it is the block,
/// not the latest command, that tells.
#[derive(Clone)]
pub(super) struct AheadOf {
    pool: LocalPool,
    owners: Arc<Mutex<HashMap<u32, String>>>,
}

impl AheadOf {
    /// For the rank that keeps `pool`.
    pub(super) fn new(pool: LocalPool) -> Self {
        AheadOf { pool, owners: Arc::default() }
    }

    fn owners(&self) -> std::sync::MutexGuard<'_, HashMap<u32, String>> {
        self.owners.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// `request` has computed `blocks`: writes from them are its own.
    pub(super) fn computed(&self, request: &str, blocks: &[BlockId]) {
        let mut owners = self.owners();
        for block in blocks {
            owners.insert(block.0, request.to_owned());
        }
    }

    /// `request` is exported or given up: none of its writes go ahead any more.
    pub(super) fn ended(&self, request: &str) {
        self.owners().retain(|_, owner| owner != request);
    }

    /// The request owning the P block that pair `pair` writes from.
    fn at_pair(&self, pair: &DescriptorPair) -> Option<String> {
        let region = self.pool.regions.get(pair.local_region as usize)?;
        let block = self.pool.shape.block_at(pair.local_region, pair.local_addr.checked_sub(region.addr)?)?;
        self.owners().get(&block).cloned()
    }

    /// The request owning the P block of entry `index` of the rank's prepared local list
    /// ([`PoolShape::block_descriptors`](kv_core::PoolShape::block_descriptors)).
    fn at_descriptor(&self, index: u32) -> Option<String> {
        let block = index % self.pool.shape.num_blocks.max(1);
        self.owners().get(&block).cloned()
    }
}

/// A transfer in flight: when it was posted, its bytes, the request it is for, and whether it
/// completes it.
struct Posted {
    start: Instant,
    bytes: u64,
    request: Option<String>,
    completes: bool,
}

/// The transport, timing each transfer it posts from post to completion.
pub(super) struct TimedTransport {
    inner: Box<dyn Transport>,
    posted: HashMap<TransferId, Posted>,
    sizes: TransferSizes,
    ended: Sender<Ended>,
    ahead_of: AheadOf,
}

impl TimedTransport {
    /// `inner`, reporting each transfer that ends to `ended`; writes without a notification
    /// are named for the request `ahead_of` holds when they are posted.
    pub(super) fn new(inner: Box<dyn Transport>, ended: Sender<Ended>, ahead_of: AheadOf) -> Self {
        TimedTransport { inner, posted: HashMap::new(), sizes: TransferSizes::default(), ended, ahead_of }
    }

    /// The request a transfer is for: the one its notification completes (and that it
    /// completes it), else, for a write ahead, the one that owns the P block it writes from
    /// (`owner`).
    fn request_of(
        &self,
        op: TransferOp,
        notification: Option<&[u8]>,
        owner: impl FnOnce(&AheadOf) -> Option<String>,
    ) -> (Option<String>, bool) {
        match notification {
            Some(_) => {
                let completed = completed_request(notification);
                let completes = completed.is_some();
                (completed, completes)
            }
            None if op == TransferOp::Write => (owner(&self.ahead_of), false),
            None => (None, false),
        }
    }

    /// Starts timing a transfer from `start`, taken before the post: UCX may move the bytes
    /// inside the post call itself.
    fn posted(&mut self, id: TransferId, start: Instant, bytes: u64, of: (Option<String>, bool)) -> TransferId {
        let (request, completes) = of;
        self.posted.insert(id, Posted { start, bytes, request, completes });
        id
    }
}

/// The request a transfer's notification completes, if it carries a completion.
fn completed_request(notification: Option<&[u8]>) -> Option<String> {
    Message::completed_request(notification?).map(|r| r.as_str().to_owned())
}

impl Transport for TimedTransport {
    fn agent(&self) -> &AgentName {
        self.inner.agent()
    }
    fn register(&mut self, region: &Region) -> Result<(), TransportError> {
        self.inner.register(region)
    }
    fn deregister(&mut self, region: RegionId) -> Result<(), TransportError> {
        self.inner.deregister(region)
    }
    fn connect(&mut self, address: &PeerAddress) -> Result<(), TransportError> {
        self.inner.connect(address)
    }
    fn post(&mut self, request: TransferRequest) -> Result<TransferId, TransportError> {
        let bytes = request.bytes();
        let completes =
            self.request_of(request.op, request.notification.as_deref(), |a| a.at_pair(request.pairs.first()?));
        let start = Instant::now();
        let write = request.op == TransferOp::Write;
        let id = self.inner.post(request)?;
        if write && DIE_DURING_WRITE.load(Ordering::SeqCst) {
            die_now();
        }
        Ok(self.posted(id, start, bytes, completes))
    }
    fn prepare(&mut self, peer: Option<&AgentName>, ranges: &[(u64, u64)]) -> Result<PreparedId, TransportError> {
        let id = self.inner.prepare(peer, ranges)?;
        self.sizes.prepared(peer, ranges, id);
        Ok(id)
    }
    fn post_prepared(&mut self, request: PreparedTransfer) -> Result<TransferId, TransportError> {
        let bytes = self.sizes.of_prepared(&request);
        let completes = self.request_of(request.op, request.notification.as_deref(), |a| {
            a.at_descriptor(*request.local_indices.first()?)
        });
        let start = Instant::now();
        let write = request.op == TransferOp::Write;
        let id = self.inner.post_prepared(request)?;
        if write && DIE_DURING_WRITE.load(Ordering::SeqCst) {
            die_now();
        }
        Ok(self.posted(id, start, bytes, completes))
    }
    fn poll_transfer(&mut self, id: TransferId) -> TransferStatus {
        let status = self.inner.poll_transfer(id);
        if !matches!(status, TransferStatus::InProgress) {
            if let Some(Posted { start, bytes, request, completes }) = self.posted.remove(&id) {
                let ok = matches!(status, TransferStatus::Done);
                let _ = self.ended.send(Ended { bytes, took: start.elapsed(), ok, request, completes });
            }
        }
        status
    }
    fn send_notification(&mut self, peer: &AgentName, payload: &[u8]) -> Result<(), TransportError> {
        self.inner.send_notification(peer, payload)
    }
    fn poll_event(&mut self) -> Option<PeerEvent> {
        self.inner.poll_event()
    }
    fn disconnect(&mut self, peer: &AgentName) {
        self.inner.disconnect(peer)
    }
    fn set_waker(&mut self, waker: Waker) {
        self.inner.set_waker(waker)
    }
    fn poll_intervals(&self) -> PollIntervals {
        self.inner.poll_intervals()
    }
}

/// A rank's transport as the configuration says, the port its side channel listens on, and
/// the probe of its listeners for the metrics endpoint.
pub(super) fn transport(
    config: &NodeConfig,
    offer: &Handshake,
    clock: Arc<ProcessClock>,
) -> Result<(Box<dyn Transport>, u16, Listeners)> {
    // The router's key, when it gave one; without it the side channel is loopback-only anyway.
    let key = match std::env::var_os(CLUSTER_KEY_ENV) {
        Some(_) => KeySource::Env(CLUSTER_KEY_ENV.to_owned()),
        None => KeySource::None,
    };
    let ip = config.host.unwrap_or(std::net::Ipv4Addr::LOCALHOST);
    let bind = std::net::SocketAddr::from((ip, 0));
    Ok(match config.transport {
        TransportKind::Nixl => {
            // The connectors' `num_threads` sizes NIXL's UCX thread pool.
            let mut nixl =
                NixlConfig { bind, key, ucx_params: config.connector().ucx_params(), ..NixlConfig::default() };
            if let Some(ms) = config.nixl_progress_ms {
                nixl.progress_thread = Some(std::time::Duration::from_millis(ms));
            }
            let t = NixlTransport::new(offer.clone(), &nixl, clock).context("the NIXL transport")?;
            let (port, probe) = (t.side_channel_addr().port(), Listeners::Side(t.side_probe()));
            (Box::new(t), port, probe)
        }
        TransportKind::Tcp => {
            let tcp = TcpConfig { bind, data_bind: ip.into(), key, ..TcpConfig::default() };
            let t = TcpTransport::new(offer.clone(), &tcp, clock).context("the TCP transport")?;
            let (port, probe) = (t.side_channel_addr().port(), Listeners::Tcp(t.status_probe()));
            (Box::new(t), port, probe)
        }
    })
}

#[cfg(test)]
mod tests {
    use kv_core::{Dtype, KvLayout, Placement, PoolShape, RegionBase};

    use super::*;

    /// A write ahead is named for the request owning the P block it writes from, in either
    /// placement, by address or by prepared index, whichever request progressed last.
    #[test]
    fn a_write_ahead_is_named_for_the_owner_of_its_first_block() {
        for placement in [Placement::BlockMajor, Placement::LayerMajor, Placement::LayerPlaneMajor] {
            let layout = KvLayout { placement, ..KvLayout::split_kv(3, 16, 2, 8, Dtype::Float16) };
            let shape = PoolShape::new(layout, 2, 10).expect("shape");
            let regions: Vec<RegionBase> = (0..u64::from(shape.region_count()))
                .map(|i| RegionBase { addr: 0x1000 + i * shape.region_len(), len: shape.region_len() })
                .collect();
            let ahead = AheadOf::new(LocalPool { shape, regions: regions.clone() });
            ahead.computed("a", &[BlockId(3), BlockId(4)]);
            ahead.computed("b", &[BlockId(7)]);
            let last = regions.len() - 1;
            for (block, owner) in [(3, Some("a")), (4, Some("a")), (7, Some("b")), (5, None)] {
                // The block's last range lies in the last region.
                let ranges = shape.block_ranges(&regions.iter().map(|r| r.addr).collect::<Vec<_>>(), block);
                let (addr, _) = *ranges.last().expect("a block has a range");
                let pair = DescriptorPair {
                    local_region: last as u32,
                    local_addr: addr + 16,
                    remote_region: 0,
                    remote_addr: 0,
                    len: 16,
                };
                assert_eq!(ahead.at_pair(&pair).as_deref(), owner, "{placement:?} block {block} by address");
                let index = shape.descriptor_index(shape.descriptor_groups() - 1, block);
                assert_eq!(ahead.at_descriptor(index).as_deref(), owner, "{placement:?} block {block} by index");
            }
            ahead.ended("a");
            let index = shape.descriptor_index(0, 3);
            assert_eq!(ahead.at_descriptor(index), None, "{placement:?}: a is exported");
            assert_eq!(ahead.at_descriptor(shape.descriptor_index(0, 7)).as_deref(), Some("b"));
        }
    }
}
