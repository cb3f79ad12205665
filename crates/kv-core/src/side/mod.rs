//! The side channel, sans-IO: an authenticated, encrypted handshake between two agents, and
//! the tags that let NIXL notifications between them be trusted.
//!
//! NIXL agent metadata is a capability: whoever loads it can read and write the sender's
//! registered KV pool. So the side channel proves, before anything else is said, that the peer
//! holds the cluster's pre-shared [`ClusterKey`] (a mutual HMAC-SHA256 challenge and response
//! over both nonces and both identities), derives a session from it (HKDF-SHA256), and only
//! then exchanges the [`Handshake`] offers, sealed with ChaCha20-Poly1305. A peer is its
//! authenticated connection, never a name it claims later; notifications carry a tag made with
//! a key of that connection's session ([`SideEndpoint::seal_notification`]).
//!
//! [`SideEndpoint`] is the whole protocol for all side-channel connections of one agent, once,
//! for every adapter: it opens no socket, reads no clock and draws no randomness. The adapter
//! (NIXL's TCP side channel, the simulator's fake network) moves bytes and reports connections
//! through `handle_*`, and carries out what `poll_*` hands back. After every `handle_*` call,
//! drain in this order:
//!
//! 1. [`SideEndpoint::poll_transmit`] until `None`: write each [`Transmit`] to its connection,
//!    in order;
//! 2. [`SideEndpoint::poll_close`] until `None`: close each connection once what was queued
//!    for it before is written (every connection the endpoint is done with is named once,
//!    whether or not the peer closed it first);
//! 3. [`SideEndpoint::poll_event`] until `None`;
//! 4. [`SideEndpoint::poll_timeout`]: call [`SideEndpoint::handle_timeout`] then (a spurious
//!    or late wake-up is harmless).
//!
//! The protocol, every frame field by field, with test vectors that
//! `crates/kv-core/tests/side_vectors.rs` replays against this code, is in
//! `docs/side-channel.md` at the workspace root.
//!
//! ```no_run
//! use kv_core::side::{ClusterKey, ConnId, SideConfig, SideEndpoint};
//! # fn offer() -> kv_core::Handshake { unimplemented!() }
//! # fn now() -> kv_core::Time { unimplemented!() }
//! # fn random_nonce() -> [u8; 32] { unimplemented!() }
//! # fn write(_: ConnId, _: &[u8]) {}
//! # fn close(_: ConnId) {}
//! # fn read_some() -> Option<(ConnId, Vec<u8>)> { None }
//! let key = ClusterKey::from_hex("000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f")?;
//! let mut side = SideEndpoint::new(SideConfig::new(key), offer())?;
//! // Our listener accepted a TCP connection from 10.0.0.7:
//! side.handle_accept(now(), ConnId(1), [10, 0, 0, 7].into(), random_nonce());
//! while let Some((conn, bytes)) = read_some() {
//!     side.handle_bytes(now(), conn, &bytes);
//!     while let Some(t) = side.poll_transmit() {
//!         write(t.conn, &t.bytes);
//!     }
//!     while let Some(conn) = side.poll_close() {
//!         close(conn);
//!     }
//!     while let Some(event) = side.poll_event() {
//!         // Connected: load the peer's agent metadata; Lost: release what it held; ...
//!         let _ = event;
//!     }
//!     // ... and wake up at side.poll_timeout() to call side.handle_timeout(now()).
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod admission;
mod conn;
mod crypto;
mod frame;
mod key;
pub mod link;
mod notify;
pub mod route;
mod steps;
#[cfg(test)]
mod tests;

use core::net::IpAddr;
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::fmt;
use std::time::Duration;

use crate::handshake::check_compatible;
use crate::id::AgentName;
use crate::ports::{PeerAddress, PeerInfo, TransportError};
use crate::time::Time;
use crate::wire::{Handshake, Role, WireError, MAX_HANDSHAKE_BYTES};

use admission::{Admission, AdmissionLimits, Evicted, Stage};
use conn::{feed, Conn, Failure, Feed, Session, Side, State};
use crypto::{derive, mac, verify, Direction, SessionKeys, AEAD_TAG_BYTES, INITIATOR_LABEL, LISTENER_LABEL, MAC_BYTES};
use frame::{
    frame, header, parse_greeting, peer_text, truncated, Identity, Kind, ParseError, HEADER_BYTES, RECORD_OFFER,
    RECORD_REFUSE,
};
use notify::Tags;

pub use frame::{FrameHeader, ANY_RANK, MAX_ENGINE_NAME_BYTES};
pub use key::{ClusterKey, KeyError, CLUSTER_KEY_BYTES, VOUCH_BYTES};
pub use link::{FrameTags, LinkRole, LinkSecret, LINK_MAC_BYTES, LINK_TAG_BYTES};
pub use notify::{NotifyError, NOTIFICATION_OVERHEAD, REPLAY_WINDOW};

/// The side protocol version this build speaks (HELLO and CHALLENGE carry it). Version 2 added
/// the rank a HELLO asks for, so that an engine's ranks can share one port.
pub const SIDE_PROTOCOL_VERSION: u16 = 2;

/// The largest length field (kind and body) of a frame before the peer has authenticated.
pub const MAX_CLEAR_FRAME: usize = 256;

/// The largest length field of a SEALED frame: kind, record type, a handshake of at most
/// [`MAX_HANDSHAKE_BYTES`], and the AEAD tag.
pub const MAX_SEALED_FRAME: usize = 1 + 1 + MAX_HANDSHAKE_BYTES + AEAD_TAG_BYTES;

/// The longest reason an ERROR frame carries, in bytes.
pub const MAX_ERROR_TEXT: usize = 200;

/// The longest reason a sealed REFUSE record carries, in bytes.
pub const MAX_REFUSE_TEXT: usize = 1024;

/// The bounds on what peers can make an endpoint hold (DESIGN.md rule 12).
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct SideLimits {
    /// Accepted connections waiting in each stage of the handshake ([`Stage`]: for HELLO, for
    /// PROOF, for the OFFER), from all sources; one more in a stage displaces the oldest of that
    /// stage, never a connection that got further (see [`admission`]).
    pub max_unauthenticated: usize,
    /// Accepted connections waiting in each stage from one source address; one more displaces
    /// that source's oldest of the stage.
    pub max_unauthenticated_per_source: usize,
    /// How long a connection, accepted or our own, may take to complete the handshake; once
    /// our own has sent its PROOF and OFFER, it waits [`OFFER_WAIT_FACTOR`] times this again for
    /// the listener's OFFER.
    pub auth_timeout: Duration,
    /// Established peers; a handshake beyond them is refused.
    pub max_peers: usize,
    /// Agents whose gone incarnation is remembered; the oldest is forgotten first.
    pub max_gone_remembered: usize,
    /// Events waiting for [`SideEndpoint::poll_event`]; refusals beyond it are only counted.
    pub max_queued_events: usize,
}

/// An initiator that sent its PROOF and OFFER waits this many `auth_timeout`s for the
/// listener's OFFER. The listener takes the peer as established when it sends that OFFER,
/// within `auth_timeout` of its accept, which came before our PROOF; had we given up first, on
/// the deadline of our connect, a listener slowed past it (a prefill engine starved of CPU)
/// would have seen an established peer close and remembered its incarnation as gone, refusing
/// every later handshake of ours as stale. The longer wait leaves its reply time to reach us.
pub const OFFER_WAIT_FACTOR: u32 = 2;

impl Default for SideLimits {
    fn default() -> Self {
        SideLimits {
            max_unauthenticated: 512,
            max_unauthenticated_per_source: 256,
            auth_timeout: Duration::from_secs(5),
            max_peers: 1024,
            max_gone_remembered: 4096,
            max_queued_events: 4096,
        }
    }
}

/// What an endpoint is set up with.
#[derive(Clone, Debug)]
pub struct SideConfig {
    /// The cluster's key, or [`ClusterKey::none`].
    pub key: ClusterKey,
    /// The bounds.
    pub limits: SideLimits,
}

impl SideConfig {
    /// `key` with the default limits.
    pub fn new(key: ClusterKey) -> Self {
        SideConfig { key, limits: SideLimits::default() }
    }
}

/// Why an endpoint cannot be set up with a configuration or an offer.
#[derive(Clone, PartialEq, Eq, Debug, thiserror::Error)]
pub enum ConfigError {
    /// The offer's engine name does not fit in HELLO.
    #[error("engine name of {len} bytes is outside the side channel's 1..={MAX_ENGINE_NAME_BYTES}")]
    EngineName {
        /// Its length in bytes.
        len: usize,
    },
    /// The offer does not encode within the handshake limit.
    #[error("offer does not encode: {0}")]
    Offer(#[from] WireError),
    /// A new offer names another agent or incarnation than the endpoint's.
    #[error("a new offer cannot change who the agent is: was {was}, now {now}")]
    Identity {
        /// The endpoint's agent, incarnation and role.
        was: String,
        /// The new offer's.
        now: String,
    },
    /// A limit that must be positive is zero.
    #[error("side-channel limit {name} is 0")]
    ZeroLimit {
        /// The limit's field name.
        name: &'static str,
    },
}

/// A connection, named by the adapter; unique within one endpoint, never reused.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct ConnId(pub u64);

/// Bytes to write to a connection.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct Transmit {
    /// Where.
    pub conn: ConnId,
    /// One whole frame.
    pub bytes: Vec<u8>,
}

/// Why an accepted connection was refused.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum RefusalCause {
    /// Bytes that are not the protocol, a frame over its limit, or a close before the peer
    /// said enough to be judged.
    Malformed,
    /// The peer did not prove it holds the cluster key.
    Unauthenticated,
    /// The peer speaks another side protocol or wire version.
    Version,
    /// The engines cannot exchange KV ([`check_compatible`] refused).
    Incompatible,
    /// The peer's offer contradicts its HELLO, or its name is live on another connection.
    Impersonation,
    /// The peer's incarnation is at or below one already seen gone.
    Stale,
    /// A bound was reached ([`SideLimits`]).
    Overloaded,
    /// The handshake did not complete within [`SideLimits::auth_timeout`].
    Timeout,
    /// A notification whose sequence number was already seen: a duplicate, or a replay.
    Replayed,
    /// The connection reached another rank than the one its HELLO asks for, or none: a port
    /// shared by an engine's ranks whose rank is gone, or an address naming the wrong rank.
    Misrouted,
}

impl RefusalCause {
    /// Every cause, in declaration order.
    pub const ALL: [RefusalCause; 10] = [
        RefusalCause::Malformed,
        RefusalCause::Unauthenticated,
        RefusalCause::Version,
        RefusalCause::Incompatible,
        RefusalCause::Impersonation,
        RefusalCause::Stale,
        RefusalCause::Overloaded,
        RefusalCause::Timeout,
        RefusalCause::Replayed,
        RefusalCause::Misrouted,
    ];

    /// The cause's name, in lower case (a metric's label value).
    pub fn as_str(self) -> &'static str {
        match self {
            RefusalCause::Malformed => "malformed",
            RefusalCause::Unauthenticated => "unauthenticated",
            RefusalCause::Version => "version",
            RefusalCause::Incompatible => "incompatible",
            RefusalCause::Impersonation => "impersonation",
            RefusalCause::Stale => "stale",
            RefusalCause::Overloaded => "overloaded",
            RefusalCause::Timeout => "timeout",
            RefusalCause::Replayed => "replayed",
            RefusalCause::Misrouted => "misrouted",
        }
    }

    /// Its place in [`RefusalCause::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }
}

/// What happened on the side channel.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum SideEvent {
    /// A handshake completed, in either direction: load the peer's metadata.
    Connected {
        /// The peer's connection.
        conn: ConnId,
        /// The peer's offer and the clock readings around it.
        info: Box<PeerInfo>,
    },
    /// A connection we opened did not become a peer.
    ConnectFailed {
        /// The connection.
        conn: ConnId,
        /// Where we connected.
        address: PeerAddress,
        /// Why, naming the values that disagree.
        error: TransportError,
    },
    /// A connection we accepted did not become a peer; each is reported exactly once.
    Refused {
        /// The connection.
        conn: ConnId,
        /// The agent its HELLO named, if it got that far (unauthenticated unless the cause
        /// comes after the proof).
        claimed: Option<AgentName>,
        /// Why, as a category to count.
        cause: RefusalCause,
        /// Why, naming the values.
        reason: String,
    },
    /// An established peer's connection closed, misbehaved, or was replaced by a newer
    /// incarnation of the same agent: that incarnation is gone.
    Lost {
        /// The connection.
        conn: ConnId,
        /// The peer.
        agent: AgentName,
        /// Its incarnation.
        instance: u64,
    },
}

/// An established peer, as adapters need it.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct PeerState {
    /// Its connection.
    pub conn: ConnId,
    /// Its incarnation.
    pub incarnation: u64,
    /// Its role.
    pub role: Role,
}

/// The side-channel protocol for every connection of one agent (see the module docs).
pub struct SideEndpoint {
    config: SideConfig,
    offer: Handshake,
    conns: HashMap<ConnId, Conn>,
    peers: HashMap<AgentName, Peer>,
    /// The highest incarnation seen gone per agent, and the order they were recorded in.
    gone: HashMap<AgentName, u64>,
    gone_order: VecDeque<AgentName>,
    /// Handshake deadlines of connections not yet established.
    deadlines: BTreeSet<(Time, ConnId)>,
    /// Accepted connections not yet established, by stage and source.
    admission: Admission<ConnId>,
    /// Accepted connections refused (evictions included), by cause ([`RefusalCause::index`]),
    /// whether or not their event was queued.
    refused: [u64; RefusalCause::ALL.len()],
    transmits: VecDeque<Transmit>,
    closes: VecDeque<ConnId>,
    events: VecDeque<SideEvent>,
    refusals_dropped: u64,
}

struct Peer {
    conn: ConnId,
    incarnation: u64,
    role: Role,
    tags: Tags,
    export: [u8; 32],
}

fn check_offer(offer: &Handshake) -> Result<(), ConfigError> {
    let len = offer.engine.as_str().len();
    if len == 0 || len > MAX_ENGINE_NAME_BYTES {
        return Err(ConfigError::EngineName { len });
    }
    // The clock is stamped when the offer is sent; the largest clock encodes longest.
    let mut stamped = offer.clone();
    stamped.clock = Time::from_nanos(u64::MAX);
    stamped.encode()?;
    Ok(())
}

fn check_limits(limits: &SideLimits) -> Result<(), ConfigError> {
    for (name, value) in [
        ("max_unauthenticated", limits.max_unauthenticated),
        ("max_unauthenticated_per_source", limits.max_unauthenticated_per_source),
        ("max_peers", limits.max_peers),
        ("auth_timeout", usize::from(!limits.auth_timeout.is_zero())),
    ] {
        if value == 0 {
            return Err(ConfigError::ZeroLimit { name });
        }
    }
    Ok(())
}

/// What a connection in `stage` waits for, for a refusal's text.
fn stage_name(stage: Stage) -> &'static str {
    match stage {
        Stage::Accepted => "for HELLO",
        Stage::Greeted => "for PROOF",
        Stage::Proven => "for the OFFER",
    }
}

fn describe(identity: &Identity) -> String {
    format!("{} incarnation {} ({:?})", identity.agent(), identity.incarnation, identity.role)
}

impl SideEndpoint {
    /// An endpoint for the agent `offer` describes; fails when a limit is zero, or the offer's
    /// engine name or size does not fit the protocol.
    pub fn new(config: SideConfig, offer: Handshake) -> Result<Self, ConfigError> {
        check_limits(&config.limits)?;
        check_offer(&offer)?;
        let admission = Admission::new(AdmissionLimits {
            per_stage: config.limits.max_unauthenticated,
            per_source: config.limits.max_unauthenticated_per_source,
        });
        Ok(SideEndpoint {
            config,
            offer,
            conns: HashMap::new(),
            peers: HashMap::new(),
            gone: HashMap::new(),
            gone_order: VecDeque::new(),
            deadlines: BTreeSet::new(),
            admission,
            refused: [0; RefusalCause::ALL.len()],
            transmits: VecDeque::new(),
            closes: VecDeque::new(),
            events: VecDeque::new(),
            refusals_dropped: 0,
        })
    }

    /// Replaces the offer that handshakes from now on send (the adapter updates the agent
    /// metadata after registering memory); it may not change the agent, incarnation or role.
    pub fn set_offer(&mut self, offer: Handshake) -> Result<(), ConfigError> {
        check_offer(&offer)?;
        let (was, now) = (Identity::of(&self.offer), Identity::of(&offer));
        if was != now {
            return Err(ConfigError::Identity { was: describe(&was), now: describe(&now) });
        }
        self.offer = offer;
        Ok(())
    }

    /// The offer handshakes send (its clock is the last one stamped).
    pub fn offer(&self) -> &Handshake {
        &self.offer
    }

    /// We open a connection to `address`: HELLO is queued at once, for the adapter to write
    /// when the transport connects (to [`PeerAddress::side_target`]'s socket address). The HELLO
    /// asks for the rank the address names, if it names one. `nonce` must be fresh random bytes.
    pub fn handle_connect(&mut self, now: Time, conn: ConnId, address: PeerAddress, nonce: [u8; 32]) {
        self.expire(now);
        if self.conns.contains_key(&conn) {
            return;
        }
        let target = address.side_target().1.unwrap_or(ANY_RANK);
        let hello = frame(Kind::Hello, &Identity::of(&self.offer).body(SIDE_PROTOCOL_VERSION, target, &nonce));
        self.transmits.push_back(Transmit { conn, bytes: hello.clone() });
        let state = State::Helloed { nonce_i: nonce, target, hello };
        self.insert(now, conn, Side::Initiator { address }, state);
    }

    /// Our listener accepted a connection from `source`. Pending connections are kept by
    /// stage and source ([`SideLimits::max_unauthenticated`] and
    /// [`SideLimits::max_unauthenticated_per_source`]): one more displaces the oldest of its
    /// stage, never one that got further. `nonce` must be fresh random bytes.
    pub fn handle_accept(&mut self, now: Time, conn: ConnId, source: IpAddr, nonce: [u8; 32]) {
        self.expire(now);
        if self.conns.contains_key(&conn) {
            return;
        }
        self.insert(now, conn, Side::Listener, State::Accepted { nonce_l: nonce });
        let evicted = self.admission.accept(conn, source);
        self.evict(evicted);
    }

    /// Fails a connection the admission book displaced.
    pub(super) fn evict(&mut self, evicted: Option<Evicted<ConnId>>) {
        let Some(e) = evicted else { return };
        let reason = if e.per_source {
            format!(
                "too many connections from one address waiting {} ({}); the oldest is dropped",
                stage_name(e.stage),
                self.config.limits.max_unauthenticated_per_source
            )
        } else {
            format!(
                "too many connections waiting {} ({}); the oldest is dropped",
                stage_name(e.stage),
                self.config.limits.max_unauthenticated
            )
        };
        self.fail(e.conn, Failure::new(RefusalCause::Overloaded, reason).told());
    }

    /// Bytes arrived on a connection, in any chunking. Bytes for a connection the endpoint
    /// does not know (never opened, or already ended) are ignored.
    pub fn handle_bytes(&mut self, now: Time, conn: ConnId, mut bytes: &[u8]) {
        self.expire(now);
        while !bytes.is_empty() {
            let Some(c) = self.conns.get_mut(&conn) else { return };
            match feed(c, &mut bytes) {
                Feed::NeedMore => return,
                Feed::Frame(frame) => self.on_frame(now, conn, frame),
                Feed::Oversized { len, limit } => {
                    let reason = if len == 0 {
                        "frame of length 0 (a frame has at least its kind byte)".to_owned()
                    } else {
                        format!("frame of {len} bytes exceeds the {limit}-byte limit while {}", c.state.stage())
                    };
                    self.fail(conn, Failure::new(RefusalCause::Malformed, reason).told());
                    return;
                }
                Feed::AfterHandshake => {
                    self.lose(conn);
                    return;
                }
            }
        }
    }

    /// A connection closed or failed, or a connection we opened could not connect. Its
    /// outcome is reported unless it was reported already.
    pub fn handle_closed(&mut self, now: Time, conn: ConnId) {
        self.expire(now);
        let Some(c) = self.conns.get(&conn) else { return };
        let failure = match (&c.side, &c.state) {
            (_, State::Established { .. }) => return self.lose(conn),
            (Side::Initiator { address }, State::Helloed { .. }) if !c.received => {
                Failure::new(RefusalCause::Malformed, "unreachable").error(TransportError::Unreachable(address.clone()))
            }
            (Side::Initiator { .. }, state) => {
                Failure::new(RefusalCause::Malformed, format!("closed while {}", state.stage()))
            }
            (Side::Listener, state) => {
                let (cause, reason) = state.abandoned();
                Failure::new(cause, reason)
            }
        };
        self.fail(conn, failure);
    }

    /// Time passed: connections past their handshake deadline fail.
    pub fn handle_timeout(&mut self, now: Time) {
        self.expire(now);
    }

    /// The next frame to write.
    pub fn poll_transmit(&mut self) -> Option<Transmit> {
        self.transmits.pop_front()
    }

    /// The next connection to close, after writing what was queued for it.
    pub fn poll_close(&mut self) -> Option<ConnId> {
        self.closes.pop_front()
    }

    /// The next event.
    pub fn poll_event(&mut self) -> Option<SideEvent> {
        self.events.pop_front()
    }

    /// When to call [`SideEndpoint::handle_timeout`] next, if anything waits.
    pub fn poll_timeout(&self) -> Option<Time> {
        self.deadlines.first().map(|&(deadline, _)| deadline)
    }

    /// The established peer of this name, if any.
    pub fn peer(&self, agent: &AgentName) -> Option<PeerState> {
        self.peers.get(agent).map(|p| PeerState { conn: p.conn, incarnation: p.incarnation, role: p.role })
    }

    /// How many peers are established.
    pub fn peer_count(&self) -> usize {
        self.peers.len()
    }

    /// How many connections are open and not yet established, ours and accepted ones.
    pub fn pending_count(&self) -> usize {
        self.conns.len() - self.peers.len()
    }

    /// Accepted connections waiting in `stage` of the handshake.
    pub fn pending_in(&self, stage: Stage) -> usize {
        self.admission.count(stage)
    }

    /// Accepted connections refused so far, displaced ones included, by cause (indexed as
    /// [`RefusalCause::ALL`]); counted whether or not their event found room in the queue.
    pub fn refused_by_cause(&self) -> [u64; RefusalCause::ALL.len()] {
        self.refused
    }

    /// Refusals that were not queued because the event queue was full.
    pub fn refusals_dropped(&self) -> u64 {
        self.refusals_dropped
    }

    /// Bytes held for incomplete frames, over all connections (allocated, not claimed).
    pub fn buffered_bytes(&self) -> usize {
        self.conns.values().map(|c| c.buf.capacity()).sum()
    }

    /// Tags `payload` for the established peer `to`: `b"KT"`, a sequence number, the payload
    /// and a tag only this connection's session can make. Send the result as the NIXL
    /// notification.
    pub fn seal_notification(&mut self, to: &AgentName, payload: &[u8]) -> Result<Vec<u8>, NotifyError> {
        let peer = self.peers.get_mut(to).ok_or_else(|| NotifyError::UnknownPeer { agent: to.clone() })?;
        peer.tags.seal(payload)
    }

    /// The payload of a tagged notification that NIXL says came from `from`, if the
    /// established peer of that name made it, and it was not seen before.
    pub fn open_notification(&mut self, from: &AgentName, sealed: &[u8]) -> Result<Vec<u8>, NotifyError> {
        let peer = self.peers.get_mut(from).ok_or_else(|| NotifyError::UnknownPeer { agent: from.clone() })?;
        peer.tags.open(from, sealed)
    }

    fn insert(&mut self, now: Time, conn: ConnId, side: Side, state: State) {
        let deadline = now + self.config.limits.auth_timeout;
        self.deadlines.insert((deadline, conn));
        self.conns.insert(conn, Conn { side, claimed: None, buf: Vec::new(), received: false, deadline, state });
    }

    /// Fails every connection whose deadline has come.
    fn expire(&mut self, now: Time) {
        while let Some(&(deadline, conn)) = self.deadlines.first() {
            if deadline > now {
                break;
            }
            let timeout = self.config.limits.auth_timeout;
            let reason = match self.conns.get(&conn).map(|c| &c.state) {
                Some(State::Offered { .. }) => {
                    format!("no offer within {:?} of our proof", timeout * OFFER_WAIT_FACTOR)
                }
                _ => format!("no handshake within {timeout:?}"),
            };
            self.fail(conn, Failure::new(RefusalCause::Timeout, reason).told());
            // `fail` removes the deadline; make sure even of a connection it did not know.
            self.deadlines.remove(&(deadline, conn));
        }
    }

    /// Ends a connection that is not established, and reports it once.
    fn fail(&mut self, id: ConnId, failure: Failure) {
        let Some(mut c) = self.conns.remove(&id) else { return };
        self.deadlines.remove(&(c.deadline, id));
        self.admission.remove(id);
        if let Some(text) = &failure.tell {
            let bytes = c.state.tell(text);
            self.transmits.push_back(Transmit { conn: id, bytes });
        }
        self.closes.push_back(id);
        match c.side {
            Side::Initiator { address } => {
                let error = failure.error.unwrap_or_else(|| {
                    TransportError::Backend(format!("side channel to {address}: {}", failure.reason))
                });
                self.events.push_back(SideEvent::ConnectFailed { conn: id, address, error });
            }
            Side::Listener => {
                self.refused[failure.cause.index()] += 1;
                let event =
                    SideEvent::Refused { conn: id, claimed: c.claimed, cause: failure.cause, reason: failure.reason };
                if self.events.len() >= self.config.limits.max_queued_events {
                    self.refusals_dropped += 1;
                } else {
                    self.events.push_back(event);
                }
            }
        }
    }

    /// Ends an established connection: its peer, and that incarnation, are gone.
    fn lose(&mut self, id: ConnId) {
        let Some(c) = self.conns.remove(&id) else { return };
        let State::Established { agent, incarnation } = c.state else {
            // Not established: put it back and fail it instead, so it is reported once.
            self.conns.insert(id, c);
            let failure = Failure::new(RefusalCause::Malformed, "lost before the handshake completed");
            return self.fail(id, failure);
        };
        if self.peers.get(&agent).is_some_and(|p| p.conn == id) {
            self.peers.remove(&agent);
        }
        self.remember_gone(agent.clone(), incarnation);
        self.closes.push_back(id);
        self.events.push_back(SideEvent::Lost { conn: id, agent, instance: incarnation });
    }

    fn remember_gone(&mut self, agent: AgentName, incarnation: u64) {
        if self.config.limits.max_gone_remembered == 0 {
            return;
        }
        let highest = self.gone.get(&agent).map_or(incarnation, |&g| g.max(incarnation));
        if self.gone.insert(agent.clone(), highest).is_some() {
            self.gone_order.retain(|a| *a != agent);
        }
        self.gone_order.push_back(agent);
        while self.gone_order.len() > self.config.limits.max_gone_remembered {
            if let Some(oldest) = self.gone_order.pop_front() {
                self.gone.remove(&oldest);
            }
        }
    }

    /// Whether `agent` at `incarnation` may become a peer: it is not gone, and not live unless
    /// as an older incarnation, which it then replaces.
    fn admit(&self, agent: &AgentName, incarnation: u64) -> Result<(), Failure> {
        if let Some(&gone) = self.gone.get(agent) {
            if incarnation <= gone {
                let reason = format!("{agent} incarnation {incarnation} is stale: incarnation {gone} was seen gone");
                return Err(Failure::new(RefusalCause::Stale, reason).told());
            }
        }
        if let Some(peer) = self.peers.get(agent) {
            if incarnation > peer.incarnation {
                return Ok(());
            }
            let reason = format!("{agent} is already connected as incarnation {}", peer.incarnation);
            return Err(Failure::new(RefusalCause::Impersonation, reason).told());
        }
        if self.peers.len() >= self.config.limits.max_peers {
            let reason = format!("too many side-channel peers ({})", self.config.limits.max_peers);
            return Err(Failure::new(RefusalCause::Overloaded, reason).told());
        }
        Ok(())
    }
}

impl fmt::Debug for SideEndpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SideEndpoint")
            .field("agent", &AgentName::new(self.offer.engine.clone(), self.offer.rank))
            .field("key", &self.config.key)
            .field("peers", &self.peers.len())
            .field("pending", &self.pending_count())
            .finish()
    }
}
