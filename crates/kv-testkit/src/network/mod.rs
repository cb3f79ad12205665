//! A seeded, in-memory network of agents that really copies bytes, and injects faults.
//!
//! # Time
//!
//! Nothing happens by itself. Every message delivery, handshake step and transfer completion
//! is an event due at some [`Time`]; [`FakeNetwork::settle`] runs, in time order (ties in the
//! order they were scheduled), every event due at or before the clock's now, and every
//! [`FakeTransport`] method settles first, so that a caller who only sees the
//! [`kv_core::Transport`] trait sees a consistent world. An event runs at its own due time
//! (messages it sends leave then, timestamps are taken then), so jumping the clock far ahead
//! gives the same outcome as stepping it event by event; [`FakeNetwork::next_event_time`] is
//! where a simulator steps to when it wants to interleave its own work.
//!
//! # What takes how long
//!
//! - A message (handshake step or notification) arrives [`NetConfig::latency`] after it was
//!   sent, plus any active [`FakeNetwork::delay`], plus, for notifications only, a random
//!   jitter in `0..=`[`NetConfig::reorder_jitter`] drawn for each copy.
//! - Every agent runs kv-core's side-channel protocol ([`kv_core::side::SideEndpoint`]) with
//!   the network's cluster key, exactly as the NIXL adapter does over TCP: the network only
//!   moves its bytes, one latency per frame, in order and without loss, as a TCP stream does.
//!   `connect` opens a connection; HELLO reaches the listener after one latency, CHALLENGE
//!   comes back after two, PROOF and the initiator's sealed offer reach the listener after
//!   three (its `Connected`), and the listener's sealed offer reaches the initiator after four
//!   (its `Connected`). Each side's [`kv_core::PeerInfo`] spans its own round trip, so both
//!   clock offsets come out right. Nonces come from the seed.
//! - Every agent's side endpoint reads its engine's clock: the network's, shifted by the offset
//!   [`FakeNetwork::set_clock_offset`] gave the engine (none by default). Offers are stamped
//!   with it and wake-ups asked on it, so a peer's clock-offset sample measures it, as between
//!   hosts whose clocks disagree; the network itself (delays, the queue, `heard_gone`) keeps
//!   its own time.
//! - Notifications carry the side channel's tag ([`kv_core::side::SideEndpoint::seal_notification`]);
//!   one that does not open (a forged sender, garbage, a duplicate) is reported as
//!   [`kv_core::PeerEvent::Refused`], never delivered.
//! - A transfer completes [`NetConfig::transfer_latency`] after it is posted. Its bytes are
//!   copied at completion, not at post: a read sees what the remote blocks hold when the read
//!   completes, so a test can catch a read of blocks that were freed and rewritten in flight.
//!   Its notification then leaves for the peer as a message.
//!
//! # Faults
//!
//! All random choices come from the seed. Notifications (sent, riding on a completed transfer,
//! or injected) may be dropped ([`NetConfig::drop_rate`]), duplicated
//! ([`NetConfig::duplicate_rate`], each copy with its own jitter) and reordered (jitter);
//! side-channel bytes travel a reliable stream: a partition or a pause holds them until it
//! ends (TCP retransmits; neither closes a side channel), and only a crash loses them. Scheduled faults name a [`Scope`]: an engine, which takes
//! all of its TP-rank agents together as scenario files do, or one agent.
//!
//! - [`FakeNetwork::partition`]: a notification between the two sides is dropped if the
//!   partition was active when it was sent or when it arrives; side-channel bytes wait for its
//!   end; a connect across it fails as unreachable; a transfer across it that is in flight when
//!   it starts, or is posted during it, fails.
//! - [`FakeNetwork::delay`]: messages from one side to the other, sent while it is active,
//!   arrive later (active delays add up).
//! - [`FakeNetwork::crash`]: the agents stop; they send and receive nothing, their
//!   registrations are gone, every transfer they take part in fails at its completion time,
//!   and with `detect` their side channels close: every peer sees `Lost` one latency later,
//!   behind everything the agent sent before. Creating a transport under the same name again
//!   restarts the agent as a new registration: old connections are not revived, and messages
//!   addressed to the old one are dropped.
//! - [`kv_core::Transport::disconnect`]: an agent drops a peer as if its discovery
//!   registration lapsed. The agent reports it `Lost` at once, behind what arrived from it
//!   before; the close travels to the peer behind everything the agent sent it, and the peer
//!   sees the agent `Lost` when it arrives. Transfers between the two that complete from then
//!   on fail: the data path between them is cut, both ways.
//! - [`FakeNetwork::pause`]: the agents stop, as under SIGSTOP: their transfers complete when
//!   they resume, side-channel bytes to them wait, and their side channels stay open.
//! - [`FakeNetwork::intrude`]: a peer without the cluster key opens an agent's side channel
//!   claiming another name, tries the handshake, and hangs up.
//! - [`FakeNetwork::fail_next_transfer`] and [`FakeNetwork::fail_transfer_when`]: the next
//!   matching transfer is accepted and fails at its completion time, copying nothing.
//! - [`FakeNetwork::fail_next_send`] and [`FakeNetwork::fail_send_when`]: the next matching
//!   notification send is refused ([`TransportError::Backend`], as NIXL's when UCX cannot
//!   queue it), and nothing leaves. No send is refused unless a caller asks.
//! - [`FakeNetwork::inject`]: a forged notification, garbage included (it carries no valid tag).
//!
//! This file holds the network's state and its fault controls; `delivery.rs` carries out what
//! the clock reaches (messages, transfers, crashes), `side.rs` the side-channel handshake over
//! the fake links, `transport.rs` the `Transport` port each agent sees.

mod delivery;
mod side;
mod transport;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use kv_core::side::{ClusterKey, ConnId, SideConfig, SideEndpoint};
use kv_core::{
    AgentName, DescriptorPair, EngineId, Handshake, PeerAddress, PeerEvent, Region, RegionId, RequestId, Time,
    TransferId, TransferOp, TransferRequest, TransferStatus, TransportError,
};

pub use transport::FakeTransport;

use crate::{FakeHeap, ManualClock, Rng};

/// How the fake network behaves when nobody injects a fault by name.
#[derive(Clone, Debug, PartialEq)]
pub struct NetConfig {
    /// One-way delay of every message (a handshake step or a notification).
    pub latency: Duration,
    /// From posting a transfer to its completion.
    pub transfer_latency: Duration,
    /// Probability that a notification is lost.
    pub drop_rate: f64,
    /// Probability that a notification arrives twice.
    pub duplicate_rate: f64,
    /// Extra delay, uniform in `0..=reorder_jitter`, of every notification copy; notifications
    /// sent closer together than this may arrive out of order.
    pub reorder_jitter: Duration,
}

impl Default for NetConfig {
    fn default() -> Self {
        NetConfig {
            latency: Duration::from_millis(1),
            transfer_latency: Duration::from_millis(5),
            drop_rate: 0.0,
            duplicate_rate: 0.0,
            reorder_jitter: Duration::ZERO,
        }
    }
}

/// Which agents a fault applies to.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum Scope {
    /// Every TP-rank agent of an engine: engines crash and get cut off as a whole.
    Engine(EngineId),
    /// One agent.
    Agent(AgentName),
}

impl Scope {
    /// Whether `agent` is in scope.
    pub fn covers(&self, agent: &AgentName) -> bool {
        match self {
            Scope::Engine(engine) => agent.engine == *engine,
            Scope::Agent(name) => agent == name,
        }
    }
}

impl From<EngineId> for Scope {
    fn from(engine: EngineId) -> Self {
        Scope::Engine(engine)
    }
}

impl From<&EngineId> for Scope {
    fn from(engine: &EngineId) -> Self {
        Scope::Engine(engine.clone())
    }
}

impl From<AgentName> for Scope {
    fn from(agent: AgentName) -> Self {
        Scope::Agent(agent)
    }
}

impl From<&AgentName> for Scope {
    fn from(agent: &AgentName) -> Self {
        Scope::Agent(agent.clone())
    }
}

/// What the network did so far; notifications are counted per copy.
#[derive(Clone, Copy, PartialEq, Eq, Default, Debug)]
pub struct NetStats {
    /// Notifications handed to their receiver.
    pub delivered: u64,
    /// Notifications lost: to `drop_rate`, a partition, or a receiver that is down.
    pub dropped: u64,
    /// Extra copies made by `duplicate_rate`.
    pub duplicated: u64,
    /// Transfers that completed and copied their bytes.
    pub transfers_done: u64,
    /// Transfers that failed in flight.
    pub transfers_failed: u64,
}

/// A predicate over `(poster, request)` that fails the first transfer it matches.
type TransferFault = Box<dyn FnMut(&AgentName, &TransferRequest) -> bool + Send>;

/// A predicate over `(sender, receiver, payload)` that refuses the first send it matches.
type SendFault = Box<dyn FnMut(&AgentName, &AgentName, &[u8]) -> bool + Send>;

/// A function of `(poster, request)` that picks the local ranges a read it matches spoils.
type SpoilFault = Box<dyn FnMut(&AgentName, &TransferRequest) -> Option<Vec<(u64, u64)>> + Send>;

/// The shared, seeded network; clones are handles to the same one.
#[derive(Clone)]
pub struct FakeNetwork {
    net: Arc<Mutex<Net>>,
}

impl fmt::Debug for FakeNetwork {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let net = self.lock();
        f.debug_struct("FakeNetwork").field("agents", &net.agents.len()).field("stats", &net.stats).finish()
    }
}

impl FakeNetwork {
    /// An empty network whose every random choice follows from `seed`, timed by `clock`.
    pub fn new(seed: u64, clock: ManualClock, config: NetConfig) -> Self {
        let mut rng = Rng::new(seed);
        let key = side::random_key(&mut rng);
        let net = Net {
            clock,
            config,
            key,
            next_conn: 0,
            next_intruder: 0,
            rng,
            next_seq: 0,
            queue: BTreeMap::new(),
            agents: BTreeMap::new(),
            listeners: HashMap::new(),
            next_generation: 1,
            partitions: Vec::new(),
            pauses: Vec::new(),
            delays: Vec::new(),
            transfer_faults: Vec::new(),
            send_faults: Vec::new(),
            stats: NetStats::default(),
            spoil_faults: Vec::new(),
            moved: BTreeMap::new(),
            clock_offsets: BTreeMap::new(),
        };
        FakeNetwork { net: Arc::new(Mutex::new(net)) }
    }

    /// The clock the network runs on.
    pub fn clock(&self) -> ManualClock {
        self.lock().clock.clone()
    }

    /// Sets the clock of `engine`'s agents, those up and those started later: their side
    /// endpoints read the network's clock shifted by `offset_nanos` (handshakes stamp offers
    /// with it, so a peer's clock-offset sample measures it). A reading stops at the origin, so
    /// an offset below zero only suits a network whose clock is already past its size.
    pub fn set_clock_offset(&self, engine: EngineId, offset_nanos: i64) {
        self.lock().clock_offsets.insert(engine, offset_nanos);
    }

    /// Starts `agent`, listening at `address`, with its pool in `heap` and `offer` as its handshake.
    ///
    /// A name that is already taken restarts the agent: the old one is crashed without
    /// detection if it was up, and its handle and connections are dead. The last agent to
    /// listen at an address gets the connections made to it. The agent holds the network's
    /// cluster key; an offer the side channel cannot carry (an engine name longer than 64
    /// bytes, say) is an error.
    pub fn transport(
        &self,
        agent: AgentName,
        address: PeerAddress,
        heap: FakeHeap,
        offer: Handshake,
    ) -> Result<FakeTransport, TransportError> {
        let mut net = self.settled();
        let now = net.clock.now();
        let side = SideEndpoint::new(SideConfig::new(net.key.clone()), offer)
            .map_err(|e| TransportError::Backend(format!("{agent}: {e}")))?;
        if let Some(old) = net.agents.get(&agent).filter(|old| old.up) {
            let old = Endpoint { name: agent.clone(), generation: old.generation };
            net.crash_one(&old, false, now);
        }
        let generation = net.next_generation;
        net.next_generation += 1;
        net.listeners.retain(|_, listener| *listener != agent);
        net.listeners.insert(address, agent.clone());
        net.agents.insert(agent.clone(), Agent::new(generation, heap, side));
        Ok(FakeTransport::new(Endpoint { name: agent, generation }, self.clone()))
    }

    /// A peer that does not hold the cluster key opens the side channel at `address`, offering
    /// `claim` (another engine's name, say), tries the handshake, and hangs up when it fails.
    pub fn intrude(&self, address: &PeerAddress, claim: Handshake) -> Result<(), TransportError> {
        let mut net = self.settled();
        let wrong = side::random_key(&mut net.rng);
        let side =
            SideEndpoint::new(SideConfig::new(wrong), claim).map_err(|e| TransportError::Backend(e.to_string()))?;
        let name = AgentName::new(EngineId::new(format!("intruder{}", net.next_intruder)), 0);
        net.next_intruder += 1;
        let generation = net.next_generation;
        net.next_generation += 1;
        net.agents.insert(name.clone(), Agent::new(generation, FakeHeap::with_base(0), side));
        net.open(&Endpoint { name, generation }, address);
        Ok(())
    }

    /// Runs every event due at or before the clock's now.
    pub fn settle(&self) {
        self.lock().settle();
    }

    /// When the next pending event is due, after settling; `None` when nothing is pending.
    pub fn next_event_time(&self) -> Option<Time> {
        self.settled().queue.keys().next().map(|&(at, _)| at)
    }

    /// The first time `agent` (its current incarnation) heard, through its side channel, that
    /// incarnation `instance` of `engine` is gone: its connection closed, or a newer one
    /// handshook. `None` if it has not.
    pub fn heard_gone(&self, agent: &AgentName, engine: &EngineId, instance: u64) -> Option<Time> {
        let net = self.settled();
        let agent = net.agents.get(agent).filter(|a| a.up)?;
        agent.heard_gone.iter().find(|(_, e, mark)| e == engine && instance <= *mark).map(|(t, _, _)| *t)
    }

    /// Bytes that transfers posted by `agent` whose notification completes `request` landed
    /// whole (those that completed, and the unspoiled part of those that failed part-way).
    pub fn moved(&self, agent: &AgentName, request: &RequestId) -> u64 {
        self.settled().moved.get(&(agent.clone(), request.clone())).copied().unwrap_or(0)
    }

    /// The counters so far.
    pub fn stats(&self) -> NetStats {
        self.settled().stats
    }

    /// Stops the agents in `who`; with `detect`, their connected peers see them `Lost`.
    pub fn crash(&self, who: impl Into<Scope>, detect: bool) {
        let who = who.into();
        let mut net = self.settled();
        let now = net.clock.now();
        let victims: Vec<Endpoint> = net
            .agents
            .iter()
            .filter(|(name, agent)| agent.up && who.covers(name))
            .map(|(name, agent)| Endpoint { name: name.clone(), generation: agent.generation })
            .collect();
        for victim in &victims {
            net.crash_one(victim, detect, now);
        }
    }

    /// Cuts `a` off from `b`, both ways, from now until `until`.
    pub fn partition(&self, a: impl Into<Scope>, b: impl Into<Scope>, until: Time) {
        let mut net = self.settled();
        let window = Window { a: a.into(), b: b.into(), from: net.clock.now(), until, by: Duration::ZERO };
        if window.until <= window.from {
            return;
        }
        for (name, agent) in &mut net.agents {
            for transfer in agent.transfers.values_mut() {
                if let Transfer::InFlight { peer, doom: doom @ None, .. } = transfer {
                    if window.separates(name, &peer.name) {
                        *doom = Some(format!("partitioned from {}", peer.name));
                    }
                }
            }
        }
        net.partitions.push(window);
    }

    /// Stops the agents in `who` until `until`, as SIGSTOP would: the transfers they posted
    /// complete (and copy their bytes) no earlier than then. Their side channels stay open.
    pub fn pause(&self, who: impl Into<Scope>, until: Time) {
        let mut net = self.settled();
        let now = net.clock.now();
        net.pauses.retain(|(_, t)| *t > now);
        net.pauses.push((who.into(), until));
    }

    /// Delays by `by` every message from `from` to `to` sent from now until `until`.
    pub fn delay(&self, from: impl Into<Scope>, to: impl Into<Scope>, by: Duration, until: Time) {
        let mut net = self.settled();
        let now = net.clock.now();
        net.delays.push(Window { a: from.into(), b: to.into(), from: now, until, by });
    }

    /// Sends `payload` to `to` as a notification forged to come from `from` (who need not
    /// exist, nor be connected); it meets the same faults as any notification, and no size limit.
    pub fn inject(&self, from: &AgentName, to: &AgentName, payload: Vec<u8>) {
        let mut net = self.settled();
        let now = net.clock.now();
        let to = net.agents.get(to).map(|agent| Endpoint { name: to.clone(), generation: agent.generation });
        let Some(to) = to else {
            net.stats.dropped += 1;
            return;
        };
        let from = Endpoint { name: from.clone(), generation: 0 };
        net.send(Message { from, to, sent_at: now, body: Body::Notification(payload) });
    }

    /// Fails the next transfer that an agent in `who` posts.
    pub fn fail_next_transfer(&self, who: impl Into<Scope>) {
        let who = who.into();
        self.fail_transfer_when(move |poster, _| who.covers(poster));
    }

    /// Fails the first transfer posted from now on for which `predicate(poster, request)` holds.
    ///
    /// The predicate runs inside the network's lock, so it must not call the network.
    pub fn fail_transfer_when(&self, predicate: impl FnMut(&AgentName, &TransferRequest) -> bool + Send + 'static) {
        self.settled().transfer_faults.push(Box::new(predicate));
    }

    /// Refuses the next notification that an agent in `who` sends.
    pub fn fail_next_send(&self, who: impl Into<Scope>) {
        let who = who.into();
        self.fail_send_when(move |sender, _, _| who.covers(sender));
    }

    /// Refuses the first notification sent from now on for which `predicate(sender, receiver,
    /// payload)` holds (the payload as the sender gave it, before its tag): `send_notification`
    /// returns [`TransportError::Backend`] and nothing leaves. A send to a peer that is not
    /// connected fails as it would anyway, and leaves the fault for the next. Each fault
    /// refuses one send; ask again to refuse its resend too.
    ///
    /// The predicate runs inside the network's lock, so it must not call the network.
    pub fn fail_send_when(&self, predicate: impl FnMut(&AgentName, &AgentName, &[u8]) -> bool + Send + 'static) {
        self.settled().send_faults.push(Box::new(predicate));
    }

    /// The first read posted from now on for which `spoil(poster, request)` names local ranges
    /// fails part-way: it copies every byte except those in the ranges, which get garbage, and
    /// reports them ([`TransportError::PartlyFailed`]); a read that touches none of them is not
    /// affected, and the fault waits for the next.
    ///
    /// The function runs inside the network's lock, so it must not call the network.
    pub fn spoil_transfer_when(
        &self,
        spoil: impl FnMut(&AgentName, &TransferRequest) -> Option<Vec<(u64, u64)>> + Send + 'static,
    ) {
        self.settled().spoil_faults.push(Box::new(spoil));
    }

    fn lock(&self) -> MutexGuard<'_, Net> {
        // A test that panicked mid-call leaves a usable world; keep it readable for the report.
        self.net.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn settled(&self) -> MutexGuard<'_, Net> {
        let mut net = self.lock();
        net.settle();
        net
    }
}

/// One incarnation of an agent: a restart under the same name is a new generation.
#[derive(Clone, PartialEq, Eq, Debug)]
struct Endpoint {
    name: AgentName,
    generation: u64,
}

struct Agent {
    generation: u64,
    up: bool,
    heap: FakeHeap,
    /// The side-channel protocol, and this agent's ends of its connections.
    side: SideEndpoint,
    conns: BTreeMap<ConnId, side::Conn>,
    /// The queue entry of the side endpoint's next wake-up.
    side_timer: Option<(Time, u64)>,
    /// When its side endpoint told it that incarnations of an engine were gone: every one at
    /// or below the number. The oracle of the release-timing check.
    heard_gone: Vec<(Time, EngineId, u64)>,
    regions: BTreeMap<RegionId, Region>,
    peers: BTreeMap<AgentName, Link>,
    transfers: BTreeMap<TransferId, Transfer>,
    next_transfer: u64,
    events: VecDeque<PeerEvent>,
}

/// A completed handshake with one generation of a peer.
struct Link {
    generation: u64,
    lost: bool,
}

enum Transfer {
    /// `doom` is why it will fail at completion, when that is already decided.
    InFlight {
        request: TransferRequest,
        peer: Endpoint,
        doom: Option<String>,
        /// Local ranges whose bytes it spoils, failing part-way.
        spoil: Vec<(u64, u64)>,
        /// The request its notification completes (read before it was sealed).
        completes: Option<RequestId>,
    },
    Finished(TransferStatus),
}

#[derive(Clone)]
struct Message {
    from: Endpoint,
    to: Endpoint,
    sent_at: Time,
    body: Body,
}

#[derive(Clone)]
enum Body {
    /// A side-channel connection opens: the listener knows it as `listener_conn`, the
    /// initiator as `initiator_conn`.
    Open { initiator_conn: ConnId, listener_conn: ConnId },
    /// Side-channel bytes for the receiver's connection `conn`.
    Side { conn: ConnId, bytes: Vec<u8> },
    /// The sender closed the receiver's connection `conn`.
    Close { conn: ConnId },
    /// A notification, sealed by the sender's side endpoint (or forged).
    Notification(Vec<u8>),
}

enum Event {
    Arrive(Message),
    Complete {
        poster: Endpoint,
        id: TransferId,
    },
    /// A connection the agent opened did not reach a listener.
    Unreachable {
        to: Endpoint,
        conn: ConnId,
    },
    /// The agent's side endpoint asked to be woken.
    SideTimer {
        to: Endpoint,
    },
}

/// A partition (`by` unused) or a delay, active in `from..until`.
struct Window {
    a: Scope,
    b: Scope,
    from: Time,
    until: Time,
    by: Duration,
}

impl Window {
    fn active(&self, at: Time) -> bool {
        self.from <= at && at < self.until
    }

    fn directed(&self, from: &AgentName, to: &AgentName) -> bool {
        self.a.covers(from) && self.b.covers(to)
    }

    fn separates(&self, x: &AgentName, y: &AgentName) -> bool {
        self.directed(x, y) || self.directed(y, x)
    }
}

struct Net {
    clock: ManualClock,
    config: NetConfig,
    /// The cluster's key: every agent made by [`FakeNetwork::transport`] holds it.
    key: ClusterKey,
    next_conn: u64,
    next_intruder: u64,
    rng: Rng,
    next_seq: u64,
    queue: BTreeMap<(Time, u64), Event>,
    agents: BTreeMap<AgentName, Agent>,
    listeners: HashMap<PeerAddress, AgentName>,
    next_generation: u64,
    partitions: Vec<Window>,
    /// Agents stopped until a time: their transfers complete no earlier than that.
    pauses: Vec<(Scope, Time)>,
    delays: Vec<Window>,
    transfer_faults: Vec<TransferFault>,
    send_faults: Vec<SendFault>,
    spoil_faults: Vec<SpoilFault>,
    stats: NetStats,
    /// Bytes transfers landed whole, by the posting agent and the request their notification
    /// completes: what a load really read.
    moved: BTreeMap<(AgentName, RequestId), u64>,
    /// Per engine, how far its agents' clocks read ahead of the network's.
    clock_offsets: BTreeMap<EngineId, i64>,
}

impl Agent {
    fn new(generation: u64, heap: FakeHeap, side: SideEndpoint) -> Self {
        Agent {
            generation,
            up: true,
            heap,
            side,
            conns: BTreeMap::new(),
            side_timer: None,
            heard_gone: Vec::new(),
            regions: BTreeMap::new(),
            peers: BTreeMap::new(),
            transfers: BTreeMap::new(),
            next_transfer: 1,
            events: VecDeque::new(),
        }
    }

    /// The peer generation a completed handshake reached, if the peer may be used.
    fn link(&self, peer: &AgentName) -> Result<Endpoint, TransportError> {
        match self.peers.get(peer) {
            None => Err(TransportError::UnknownPeer(peer.clone())),
            Some(link) if link.lost => Err(TransportError::PeerLost(peer.clone())),
            Some(link) => Ok(Endpoint { name: peer.clone(), generation: link.generation }),
        }
    }
}

impl Net {
    fn schedule(&mut self, at: Time, event: Event) {
        self.schedule_keyed(at, event);
    }

    /// Schedules `event`, returning its key in the queue (to take it out again).
    fn schedule_keyed(&mut self, at: Time, event: Event) -> (Time, u64) {
        let key = (at, self.next_seq);
        self.queue.insert(key, event);
        self.next_seq += 1;
        key
    }

    /// The agent if this generation of it is up.
    fn agent(&self, endpoint: &Endpoint) -> Option<&Agent> {
        self.agents.get(&endpoint.name).filter(|agent| agent.up && agent.generation == endpoint.generation)
    }

    fn agent_mut(&mut self, endpoint: &Endpoint) -> Option<&mut Agent> {
        self.agents.get_mut(&endpoint.name).filter(|agent| agent.up && agent.generation == endpoint.generation)
    }

    /// How far `agent`'s clock reads ahead of the network's.
    fn clock_offset(&self, agent: &AgentName) -> i64 {
        self.clock_offsets.get(&agent.engine).copied().unwrap_or(0)
    }

    /// What `agent`'s clock reads at the network's time `at`.
    fn local_time(&self, agent: &AgentName, at: Time) -> Time {
        at.shifted(self.clock_offset(agent))
    }

    fn partitioned(&self, x: &AgentName, y: &AgentName, at: Time) -> bool {
        self.partitions.iter().any(|window| window.active(at) && window.separates(x, y))
    }
}

/// Checks that every pair is non-empty, does not overflow, and lies in a registered region on
/// each side (`remote: None` skips the peer's side, whose failure shows at completion).
fn validate(
    pairs: &[DescriptorPair],
    local: &BTreeMap<RegionId, Region>,
    remote: Option<&BTreeMap<RegionId, Region>>,
) -> Result<(), TransportError> {
    if pairs.is_empty() {
        return Err(TransportError::InvalidTransfer("no descriptor pairs".into()));
    }
    for pair in pairs {
        if pair.len == 0 {
            let reason = format!("empty descriptor at local {:#x}, remote {:#x}", pair.local_addr, pair.remote_addr);
            return Err(TransportError::InvalidTransfer(reason));
        }
        registered("local", local, pair.local_addr, pair.len)?;
        if let Some(remote) = remote {
            registered("remote", remote, pair.remote_addr, pair.len)?;
        }
    }
    Ok(())
}

fn registered(
    side: &'static str,
    regions: &BTreeMap<RegionId, Region>,
    addr: u64,
    len: u64,
) -> Result<(), TransportError> {
    let end = addr
        .checked_add(len)
        .ok_or_else(|| TransportError::InvalidTransfer(format!("{side} range {addr:#x}+{len} overflows")))?;
    if regions.values().any(|region| region.addr <= addr && end <= region.addr.saturating_add(region.len)) {
        Ok(())
    } else {
        Err(TransportError::NotRegistered { side, addr, len })
    }
}
