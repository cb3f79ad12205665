//! What P's and D's machines share: transfer parameters, actions, counters, peers.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use kv_core::{
    AgentName, BlockId, Compatible, EngineId, Handshake, Message, PeerAddress, PeerInfo, Placement, PoolShape,
    PreparedId, PreparedTransfer, RegionBase, RequestId, Time, TransferRequest, TransportError,
};
use kv_lease::ClockOffset;

/// What P hands the router when it exports a request (vLLM's `kv_transfer_params`), and what
/// the router hands D with the request.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct RemoteRef {
    /// P's engine.
    pub engine: EngineId,
    /// P's request id.
    pub request: RequestId,
    /// P's side-channel address of each TP rank, by rank.
    pub addresses: Vec<PeerAddress>,
    /// P's TP size.
    pub tp_size: u32,
    /// P's incarnation, as its handshake names it; 0 when D comes first in push mode.
    pub instance: u64,
    /// Prompt tokens P computed.
    pub prompt_tokens: u64,
    /// The export, once P has finished the prompt: absent in push mode when D comes first.
    pub export: Option<ExportInfo>,
}

/// P's exported blocks and their lease.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct ExportInfo {
    /// P's blocks, in prompt order (the same ids on every P rank).
    pub blocks: Vec<BlockId>,
    /// The lease's deadline on P's clock.
    pub deadline: Time,
}

/// A handle the machine gives a transfer it asks to post; the driver maps it to the
/// transport's own id and reports the outcome with it.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct XferToken(pub u64);

/// What a worker machine asks its driver to do.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum Action<R> {
    /// Start a handshake with the P or D rank at this address.
    Connect(PeerAddress),
    /// Send an encoded [`Message`] to a connected peer.
    Send {
        /// The peer.
        to: AgentName,
        /// The frame.
        payload: Vec<u8>,
    },
    /// Post a transfer; report its outcome with the token.
    Post {
        /// The machine's handle for it.
        token: XferToken,
        /// What to post.
        request: TransferRequest,
    },
    /// Prepare a descriptor list (local when `peer` is `None`); report the outcome with the
    /// token through the machine's `handle_prepared`.
    Prepare {
        /// The machine's handle for it.
        token: XferToken,
        /// Whose memory: none for local.
        peer: Option<AgentName>,
        /// `(address, length)` ranges.
        ranges: Vec<(u64, u64)>,
    },
    /// Post a transfer between prepared lists; report its outcome with the token.
    PostPrepared {
        /// The machine's handle for it.
        token: XferToken,
        /// What to post.
        request: PreparedTransfer,
    },
    /// Tell the engine's scheduler side something.
    Report(R),
}

/// What a machine counted and dropped, and other events worth a metric.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct Counters {
    /// Malformed, unknown or unauthorised messages dropped.
    pub ignored_messages: u64,
    /// A consumer's completion (or registration) seen again, ignored.
    pub duplicate_messages: u64,
    /// Completions for exports P no longer had.
    pub notifications_after_expiry: u64,
    /// Other messages about requests this side no longer had.
    pub late_messages: u64,
    /// Early messages staged until their export registered.
    pub early_staged: u64,
    /// Staged early messages evicted because the stage was full, or never settled.
    pub early_evicted: u64,
    /// Transfers that failed.
    pub transfers_failed: u64,
    /// Loads D did not start because P's lease could end before the read.
    pub reads_fenced: u64,
    /// Reads posted by prepared-list indices rather than address pairs.
    pub prepared_reads: u64,
    /// Push writes posted by prepared-list indices rather than address pairs.
    pub prepared_writes: u64,
}

impl Counters {
    /// Adds another machine's counts to these.
    pub fn add(&mut self, other: &Counters) {
        self.ignored_messages += other.ignored_messages;
        self.duplicate_messages += other.duplicate_messages;
        self.notifications_after_expiry += other.notifications_after_expiry;
        self.late_messages += other.late_messages;
        self.early_staged += other.early_staged;
        self.early_evicted += other.early_evicted;
        self.transfers_failed += other.transfers_failed;
        self.reads_fenced += other.reads_fenced;
        self.prepared_reads += other.prepared_reads;
        self.prepared_writes += other.prepared_writes;
    }
}

/// This rank's own pool: what plans are built from.
#[derive(Clone, Debug)]
pub struct LocalPool {
    /// The rank's pool shape.
    pub shape: PoolShape,
    /// Its registered regions.
    pub regions: Vec<RegionBase>,
}

/// A prepared descriptor list: not asked for, asked for, ready, or refused (then pairs).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum ListState {
    Pending(XferToken),
    Ready(PreparedId),
    Failed,
}

/// A rank's pool prepared once, and each peer's pool prepared at its first transfer, so that
/// transfers of whole blocks name entries by index.
#[derive(Debug, Default)]
pub(crate) struct PreparedLists {
    local: Option<ListState>,
    remote: BTreeMap<AgentName, ListState>,
    preparing: BTreeMap<XferToken, Option<AgentName>>,
}

impl PreparedLists {
    /// The local and `peer`'s lists, if both are ready.
    pub fn ready(&self, peer: &AgentName) -> Option<(PreparedId, PreparedId)> {
        match (self.local, self.remote.get(peer)) {
            (Some(ListState::Ready(local)), Some(ListState::Ready(remote))) => Some((local, *remote)),
            _ => None,
        }
    }

    /// Asks for whichever of the local and `peer`'s lists was never asked for.
    pub fn want<R>(
        &mut self,
        out: &mut Outbox<R>,
        pool: &LocalPool,
        peer: &AgentName,
        peer_shape: &PoolShape,
        peer_regions: &[RegionBase],
    ) {
        if self.local.is_none() {
            let bases: Vec<u64> = pool.regions.iter().map(|r| r.addr).collect();
            let token = out.prepare(None, pool.shape.block_descriptors(&bases));
            self.local = Some(ListState::Pending(token));
            self.preparing.insert(token, None);
        }
        if !self.remote.contains_key(peer) {
            let bases: Vec<u64> = peer_regions.iter().map(|r| r.addr).collect();
            let token = out.prepare(Some(peer.clone()), peer_shape.block_descriptors(&bases));
            self.remote.insert(peer.clone(), ListState::Pending(token));
            self.preparing.insert(token, Some(peer.clone()));
        }
    }

    /// Records a prepared list, or that it could not be made (transfers then go as pairs).
    pub fn handle_prepared(&mut self, token: XferToken, result: Result<PreparedId, TransportError>) {
        let Some(owner) = self.preparing.remove(&token) else { return };
        let state = match result {
            Ok(id) => ListState::Ready(id),
            Err(err) => {
                tracing::debug!(%err, "descriptor list not prepared; transfers go as address pairs");
                ListState::Failed
            }
        };
        match owner {
            None => self.local = Some(state),
            // Only if it is still the list of the peer as connected now.
            Some(peer) => {
                if self.remote.get(&peer) == Some(&ListState::Pending(token)) {
                    self.remote.insert(peer, state);
                }
            }
        }
    }

    /// Forgets `peer`'s list: it is gone, or a new incarnation of it connected.
    pub fn forget(&mut self, peer: &AgentName) {
        self.remote.remove(peer);
    }
}

/// The prepared-list entries of a transfer of whole blocks, `local_blocks[i]` with
/// `remote_blocks[i]`, in memory order (by layer, then block, in a layer-major pool), so that
/// runs contiguous on both sides are adjacent entries the transport merges.
pub(crate) fn block_indices(
    local: &PoolShape,
    local_blocks: &[BlockId],
    remote: &PoolShape,
    remote_blocks: &[BlockId],
) -> (Vec<u32>, Vec<u32>) {
    let layers = match local.layout.placement {
        Placement::BlockMajor => 1,
        Placement::LayerMajor => local.layout.layers,
    };
    (0..layers)
        .flat_map(|layer| {
            local_blocks
                .iter()
                .zip(remote_blocks)
                .map(move |(l, r)| (local.descriptor_index(layer, l.0), remote.descriptor_index(layer, r.0)))
        })
        .unzip()
}

/// A peer that completed the handshake.
#[derive(Clone, Debug)]
pub(crate) struct Peer {
    pub handshake: Handshake,
    pub compat: Compatible,
    pub offset: ClockOffset,
}

impl Peer {
    pub fn new(info: &PeerInfo, compat: Compatible) -> Self {
        Peer {
            handshake: info.handshake.clone(),
            compat,
            offset: ClockOffset::from_sample(info.clock_offset_nanos(), info.round_trip()),
        }
    }

    /// The peer's pool shape, from its handshake.
    pub fn shape(&self, heads: u32) -> Option<PoolShape> {
        PoolShape::new(self.handshake.layout, heads, self.handshake.num_blocks).ok()
    }
}

/// The action queue and the helpers every machine uses to fill it.
#[derive(Debug)]
pub(crate) struct Outbox<R> {
    actions: VecDeque<Action<R>>,
    next_token: u64,
}

impl<R> Default for Outbox<R> {
    fn default() -> Self {
        Outbox { actions: VecDeque::new(), next_token: 0 }
    }
}

impl<R> Outbox<R> {
    pub fn send(&mut self, to: &AgentName, message: &Message) {
        match message.encode() {
            Ok(payload) => self.actions.push_back(Action::Send { to: to.clone(), payload }),
            Err(err) => tracing::warn!(peer = %to, %err, "message not sent"),
        }
    }

    /// Sends a heartbeat (or its acknowledgement) in as many frames as the size limit needs.
    pub fn send_split<T: Clone>(&mut self, to: &AgentName, items: &[T], make: impl Fn(Vec<T>) -> Message) {
        // Request ids are at most 256 bytes, so 200 per frame stays well under 64 KiB.
        for chunk in items.chunks(200) {
            self.send(to, &make(chunk.to_vec()));
        }
    }

    pub fn post(&mut self, request: TransferRequest) -> XferToken {
        let token = self.token();
        self.actions.push_back(Action::Post { token, request });
        token
    }

    fn token(&mut self) -> XferToken {
        let token = XferToken(self.next_token);
        self.next_token += 1;
        token
    }

    pub fn prepare(&mut self, peer: Option<AgentName>, ranges: Vec<(u64, u64)>) -> XferToken {
        let token = self.token();
        self.actions.push_back(Action::Prepare { token, peer, ranges });
        token
    }

    pub fn post_prepared(&mut self, request: PreparedTransfer) -> XferToken {
        let token = self.token();
        self.actions.push_back(Action::PostPrepared { token, request });
        token
    }

    pub fn connect(&mut self, address: PeerAddress) {
        self.actions.push_back(Action::Connect(address));
    }

    pub fn report(&mut self, report: R) {
        self.actions.push_back(Action::Report(report));
    }

    pub fn pop(&mut self) -> Option<Action<R>> {
        self.actions.pop_front()
    }
}

/// Ids released recently, kept for a while so that late messages about them are told apart
/// from early ones.
#[derive(Debug, Default)]
pub(crate) struct RecentlyReleased {
    ids: BTreeSet<RequestId>,
    order: VecDeque<(Time, RequestId)>,
}

impl RecentlyReleased {
    pub fn insert(&mut self, id: RequestId, now: Time) {
        if self.ids.insert(id.clone()) {
            self.order.push_back((now, id));
        }
    }

    pub fn contains(&self, id: &RequestId) -> bool {
        self.ids.contains(id)
    }

    /// Forgets ids released before `horizon`.
    pub fn expire(&mut self, horizon: Time) {
        while self.order.front().is_some_and(|(t, _)| *t < horizon) {
            let (_, id) = self.order.pop_front().expect("front exists");
            self.ids.remove(&id);
        }
    }
}

/// Early messages, staged in arrival order, at most `capacity`, oldest evicted first.
#[derive(Debug)]
pub(crate) struct EarlyStage {
    capacity: usize,
    queue: VecDeque<(Time, AgentName, Message)>,
    by_request: BTreeMap<RequestId, usize>,
}

impl EarlyStage {
    pub fn new(capacity: usize) -> Self {
        EarlyStage { capacity, queue: VecDeque::new(), by_request: BTreeMap::new() }
    }

    /// Stages a message; returns how many were evicted to make room.
    pub fn push(&mut self, now: Time, from: AgentName, request: RequestId, message: Message) -> u64 {
        let mut evicted = 0;
        while self.queue.len() >= self.capacity.max(1) {
            self.pop_front();
            evicted += 1;
        }
        *self.by_request.entry(request).or_default() += 1;
        self.queue.push_back((now, from, message));
        evicted
    }

    fn pop_front(&mut self) -> Option<(Time, AgentName, Message)> {
        let entry = self.queue.pop_front()?;
        if let Some(request) = staged_request(&entry.2) {
            if let Some(n) = self.by_request.get_mut(request) {
                *n -= 1;
                if *n == 0 {
                    self.by_request.remove(request);
                }
            }
        }
        Some(entry)
    }

    /// Takes every staged message about a request that `request` accepts and that `entry`
    /// accepts, in arrival order; the rest stay staged in their order.
    pub fn take(
        &mut self,
        request: impl Fn(&RequestId) -> bool,
        entry: impl Fn(&AgentName, &Message) -> bool,
    ) -> Vec<(AgentName, Message)> {
        // The index answers the common case, nothing staged for this request, without a scan.
        if !self.by_request.keys().any(&request) {
            return Vec::new();
        }
        let mut taken = Vec::new();
        let mut kept = VecDeque::with_capacity(self.queue.len());
        for (t, from, message) in self.queue.drain(..) {
            match staged_request(&message) {
                Some(r) if request(r) && entry(&from, &message) => taken.push((from, message)),
                _ => kept.push_back((t, from, message)),
            }
        }
        self.queue = kept;
        self.by_request.clear();
        for (_, _, message) in &self.queue {
            if let Some(r) = staged_request(message) {
                *self.by_request.entry(r.clone()).or_default() += 1;
            }
        }
        taken
    }

    /// Drops messages staged before `horizon`; returns how many.
    pub fn expire(&mut self, horizon: Time) -> u64 {
        let mut dropped = 0;
        while self.queue.front().is_some_and(|(t, _, _)| *t < horizon) {
            self.pop_front();
            dropped += 1;
        }
        dropped
    }

    /// The earliest staging time, for the expiry wake-up.
    pub fn oldest(&self) -> Option<Time> {
        self.queue.front().map(|(t, _, _)| *t)
    }
}

/// The request a stageable message is about.
pub(crate) fn staged_request(message: &Message) -> Option<&RequestId> {
    match message {
        Message::Completion { request, .. } | Message::Rejection { request } | Message::Abort { request } => {
            Some(request)
        }
        Message::PushRegistration(reg) => Some(&reg.request),
        Message::Heartbeat { .. } | Message::HeartbeatAck { .. } => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn agent() -> AgentName {
        AgentName::new(EngineId::new("d"), 0)
    }

    #[test]
    fn the_early_stage_is_bounded_and_evicts_the_oldest() {
        let mut stage = EarlyStage::new(2);
        let msg = |r: &str| Message::Rejection { request: r.into() };
        assert_eq!(stage.push(Time::ZERO, agent(), "a".into(), msg("a")), 0);
        assert_eq!(stage.push(Time::ZERO, agent(), "b".into(), msg("b")), 0);
        assert_eq!(stage.push(Time::ZERO, agent(), "c".into(), msg("c")), 1);
        assert!(stage.take(|r| r.as_str() == "a", |_, _| true).is_empty(), "a was evicted");
        assert!(stage.take(|r| r.as_str() == "c", |_, m| matches!(m, Message::Abort { .. })).is_empty());
        assert_eq!(stage.take(|r| r.as_str() == "c", |_, _| true), vec![(agent(), msg("c"))]);
        assert_eq!(stage.expire(Time::from_millis(1)), 1);
        assert_eq!(stage.oldest(), None);
    }

    #[test]
    fn recently_released_ids_are_forgotten_after_the_horizon() {
        let mut recent = RecentlyReleased::default();
        recent.insert("r1".into(), Time::from_millis(5));
        assert!(recent.contains(&"r1".into()));
        recent.expire(Time::from_millis(5));
        assert!(recent.contains(&"r1".into()));
        recent.expire(Time::from_millis(6));
        assert!(!recent.contains(&"r1".into()));
    }
}
