//! Unit tests of the side-channel endpoint: what an attacker on the same machine, or an
//! engine that holds the key but claims another's name, can and cannot get out of it.

use std::collections::HashMap;
use std::time::Duration;

use proptest::prelude::*;

use super::crypto::{derive, mac, INITIATOR_LABEL};
use super::frame::{frame, Identity, Kind, RECORD_OFFER};
use super::*;
use crate::id::EngineId;
use crate::layout::{Attention, KvLayout, MemoryOrder, Placement};
use crate::plan::RegionBase;
use crate::wire::{compatibility_hash, Message, PROTOCOL_VERSION};

mod hostile;
mod links;
mod streams;

const P_META: &[u8] = b"P-AGENT-METADATA: a capability to prefill0's KV pool";
const D_META: &[u8] = b"D-AGENT-METADATA: a capability to decode0's KV pool";
const T0: Time = Time::from_millis(1_000);
/// Where the tests' connections come from.
const SOURCE: core::net::IpAddr = core::net::IpAddr::V4(core::net::Ipv4Addr::LOCALHOST);

fn layout(order: MemoryOrder) -> KvLayout {
    KvLayout {
        layers: 2,
        block_tokens: 16,
        kv_heads: 4,
        head_dim: 64,
        dtype: crate::Dtype::Bfloat16,
        attention: Attention::SplitKv,
        order,
        placement: Placement::BlockMajor,
    }
}

fn offer(role: Role, engine: &str, instance: u64, metadata: &[u8]) -> Handshake {
    let layout = layout(MemoryOrder::Hnd);
    Handshake {
        protocol_version: PROTOCOL_VERSION,
        engine: EngineId::new(engine),
        rank: 0,
        tp_size: 1,
        pp_size: 1,
        instance,
        role,
        model: "m".into(),
        layout,
        num_blocks: 8,
        regions: vec![RegionBase { addr: 0x1000, len: 1 << 20 }],
        compat_hash: compatibility_hash("m", &layout),
        clock: Time::ZERO,
        agent_metadata: metadata.to_vec(),
    }
}

fn p_offer() -> Handshake {
    offer(Role::Prefill, "prefill0", 1, P_META)
}

fn d_offer(instance: u64) -> Handshake {
    offer(Role::Decode, "decode0", instance, D_META)
}

fn key() -> ClusterKey {
    ClusterKey::from_bytes(&[7; 32]).unwrap()
}

fn endpoint(key: ClusterKey, offer: Handshake) -> SideEndpoint {
    SideEndpoint::new(SideConfig::new(key), offer).unwrap()
}

fn prefill() -> SideEndpoint {
    endpoint(key(), p_offer())
}

fn decode(instance: u64) -> SideEndpoint {
    endpoint(key(), d_offer(instance))
}

fn d_agent() -> AgentName {
    AgentName::new(EngineId::new("decode0"), 0)
}

fn p_agent() -> AgentName {
    AgentName::new(EngineId::new("prefill0"), 0)
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// What one endpoint handed back after some input.
#[derive(Default, Debug)]
struct Out {
    transmits: Vec<Transmit>,
    closes: Vec<ConnId>,
    events: Vec<SideEvent>,
}

impl Out {
    fn bytes(&self) -> Vec<u8> {
        self.transmits.iter().flat_map(|t| t.bytes.iter().copied()).collect()
    }
}

fn drain(e: &mut SideEndpoint) -> Out {
    let mut out = Out::default();
    while let Some(t) = e.poll_transmit() {
        out.transmits.push(t);
    }
    while let Some(c) = e.poll_close() {
        out.closes.push(c);
    }
    while let Some(ev) = e.poll_event() {
        out.events.push(ev);
    }
    out
}

fn nonce(n: u64) -> [u8; 32] {
    let mut nonce = [0u8; 32];
    nonce[..8].copy_from_slice(&n.to_be_bytes());
    nonce[8] = 0xa5;
    nonce
}

/// Endpoints joined by in-memory connections, stepped until quiet, with every byte recorded.
struct Net {
    eps: Vec<SideEndpoint>,
    now: Time,
    links: HashMap<(usize, ConnId), (usize, ConnId)>,
    /// Every frame sent: sender, its connection, the bytes.
    wire: Vec<(usize, ConnId, Vec<u8>)>,
    events: Vec<Vec<SideEvent>>,
    next: u64,
}

impl Net {
    fn new(eps: Vec<SideEndpoint>) -> Self {
        let events = eps.iter().map(|_| Vec::new()).collect();
        Net { eps, now: T0, links: HashMap::new(), wire: Vec::new(), events, next: 1 }
    }

    /// `from` connects to `to`'s listener: `(from's conn, to's conn)`.
    fn connect(&mut self, from: usize, to: usize) -> (ConnId, ConnId) {
        let (a, b) = (ConnId(self.next), ConnId(self.next + 1));
        self.next += 2;
        let address = PeerAddress(format!("ep{to}"));
        self.eps[from].handle_connect(self.now, a, address, nonce(a.0));
        self.eps[to].handle_accept(self.now, b, SOURCE, nonce(b.0));
        self.links.insert((from, a), (to, b));
        self.links.insert((to, b), (from, a));
        a_b(a, b)
    }

    fn run(&mut self) {
        for _ in 0..100 {
            let mut moved = false;
            for i in 0..self.eps.len() {
                while let Some(t) = self.eps[i].poll_transmit() {
                    moved = true;
                    if let Some(&(j, cj)) = self.links.get(&(i, t.conn)) {
                        self.eps[j].handle_bytes(self.now, cj, &t.bytes);
                    }
                    self.wire.push((i, t.conn, t.bytes));
                }
                while let Some(c) = self.eps[i].poll_close() {
                    moved = true;
                    if let Some((j, cj)) = self.links.remove(&(i, c)) {
                        self.links.remove(&(j, cj));
                        self.eps[j].handle_closed(self.now, cj);
                    }
                }
                while let Some(e) = self.eps[i].poll_event() {
                    moved = true;
                    self.events[i].push(e);
                }
            }
            if !moved {
                return;
            }
        }
        panic!("the endpoints never went quiet");
    }

    fn take(&mut self, i: usize) -> Vec<SideEvent> {
        std::mem::take(&mut self.events[i])
    }

    fn sent_by(&self, i: usize) -> Vec<u8> {
        self.wire.iter().filter(|(s, _, _)| *s == i).flat_map(|(_, _, b)| b.iter().copied()).collect()
    }
}

fn a_b(a: ConnId, b: ConnId) -> (ConnId, ConnId) {
    (a, b)
}

fn connected(events: &[SideEvent]) -> Vec<(ConnId, AgentName, u64)> {
    events
        .iter()
        .filter_map(|e| match e {
            SideEvent::Connected { conn, info } => Some((*conn, info.agent.clone(), info.handshake.instance)),
            _ => None,
        })
        .collect()
}

fn refusal(events: &[SideEvent]) -> (RefusalCause, String) {
    match events {
        [SideEvent::Refused { cause, reason, .. }] => (*cause, reason.clone()),
        other => panic!("expected exactly one refusal, got {other:#?}"),
    }
}

fn connect_failure(events: &[SideEvent]) -> String {
    match events {
        [SideEvent::ConnectFailed { error, .. }] => error.to_string(),
        other => panic!("expected exactly one failed connect, got {other:#?}"),
    }
}

/// A hand-driven initiator that may lie: HELLO under one identity, an OFFER of its choice.
struct Rogue {
    key: [u8; 32],
    nonce: [u8; 32],
    hello: Vec<u8>,
}

impl Rogue {
    fn new(key: [u8; 32], hello_as: &Handshake, n: u64) -> Self {
        let nonce = nonce(n);
        let hello = frame(Kind::Hello, &Identity::of(hello_as).body(SIDE_PROTOCOL_VERSION, ANY_RANK, &nonce));
        Rogue { key, nonce, hello }
    }

    /// PROOF and the sealed OFFER that answer `challenge`.
    fn answer(&self, challenge: &[u8], offer: &Handshake) -> (Vec<u8>, Vec<u8>) {
        let split = challenge.len() - 32;
        let mut transcript = self.hello.clone();
        transcript.extend_from_slice(&challenge[..split]);
        let proof = frame(Kind::Proof, &mac(&self.key, &[INITIATOR_LABEL, &transcript, &challenge[split..]]));
        let nonce_l: [u8; 32] = challenge[split - 32..split].try_into().unwrap();
        let keys = derive(&self.key, &self.nonce, &nonce_l, &transcript);
        let sealed = crypto::Direction::new(&keys.seal_i2l).seal(RECORD_OFFER, &offer.encode().unwrap());
        (proof, sealed)
    }
}

#[test]
fn a_handshake_connects_both_sides_and_tags_notifications_both_ways() {
    let mut net = Net::new(vec![prefill(), decode(5)]);
    let (d_conn, p_conn) = net.connect(1, 0);
    net.run();
    let p_events = net.take(0);
    let d_events = net.take(1);
    assert_eq!(connected(&p_events), vec![(p_conn, d_agent(), 5)]);
    assert_eq!(connected(&d_events), vec![(d_conn, p_agent(), 1)]);
    let SideEvent::Connected { info, .. } = &p_events[0] else { unreachable!() };
    assert_eq!((info.sent_at, info.received_at, info.handshake.clock), (T0, T0, T0));
    assert_eq!(info.handshake.agent_metadata, D_META);
    assert_eq!(net.eps[0].peer(&d_agent()), Some(PeerState { conn: p_conn, incarnation: 5, role: Role::Decode }));
    assert_eq!(net.eps[0].poll_timeout(), None, "nothing waits once established");

    // Neither offer's metadata ever crosses the wire in clear text.
    for i in 0..2 {
        assert!(!contains(&net.sent_by(i), P_META) && !contains(&net.sent_by(i), D_META));
    }

    let completion = Message::Completion { request: "req-1".into(), expected_consumers: 1 }.encode().unwrap();
    let sealed = net.eps[1].seal_notification(&p_agent(), &completion).unwrap();
    assert_eq!(sealed.len(), completion.len() + NOTIFICATION_OVERHEAD);
    assert_eq!(net.eps[0].open_notification(&d_agent(), &sealed).unwrap(), completion);
    let back = net.eps[0].seal_notification(&d_agent(), b"ack").unwrap();
    assert_eq!(net.eps[1].open_notification(&p_agent(), &back).unwrap(), b"ack");
    // A direction's tag does not open in the other direction.
    assert!(matches!(net.eps[1].open_notification(&p_agent(), &sealed), Err(NotifyError::BadTag { .. })));
}

#[test]
fn an_incompatible_layout_is_refused_naming_both_values_on_both_sides() {
    let mut nhd = d_offer(5);
    nhd.layout = layout(MemoryOrder::Nhd);
    nhd.compat_hash = compatibility_hash("m", &nhd.layout);
    let mut net = Net::new(vec![prefill(), endpoint(key(), nhd)]);
    net.connect(1, 0);
    net.run();
    let text = "kv layout mismatch in order: prefill Hnd, decode Nhd";
    assert_eq!(refusal(&net.take(0)), (RefusalCause::Incompatible, text.into()));
    assert_eq!(connect_failure(&net.take(1)), format!("transport backend: ep0 refused the handshake: {text}"));
    assert!(!contains(&net.sent_by(0), P_META), "P refused before sending its offer");
}

#[test]
fn notification_tags_refuse_forgery_replay_and_another_peers_key() {
    let mut net = Net::new(vec![prefill(), decode(5), endpoint(key(), offer(Role::Decode, "decode1", 1, b"x"))]);
    net.connect(1, 0);
    net.connect(2, 0);
    net.run();
    assert_eq!(net.eps[0].peer_count(), 2);
    let d1 = AgentName::new(EngineId::new("decode1"), 0);

    let payload = Message::Abort { request: "req-1".into() }.encode().unwrap();
    let sealed = net.eps[1].seal_notification(&p_agent(), &payload).unwrap();

    // A flipped bit anywhere breaks the tag.
    for i in [2, 9, 12, sealed.len() - 1] {
        let mut forged = sealed.clone();
        forged[i] ^= 1;
        let err = net.eps[0].open_notification(&d_agent(), &forged).unwrap_err();
        assert!(matches!(err, NotifyError::BadTag { .. }), "byte {i}: {err}");
    }
    // decode1 holds the key and its own session, but cannot speak for decode0, nor the
    // other way round.
    let by_d1 = net.eps[2].seal_notification(&p_agent(), &payload).unwrap();
    assert_eq!(
        net.eps[0].open_notification(&d_agent(), &by_d1).unwrap_err().to_string(),
        "notification 0 claiming to be from decode0/tp0 has a bad tag"
    );
    assert!(net.eps[0].open_notification(&d1, &sealed).is_err());
    // The genuine one opens once.
    assert_eq!(net.eps[0].open_notification(&d_agent(), &sealed).unwrap(), payload);
    assert_eq!(
        net.eps[0].open_notification(&d_agent(), &sealed).unwrap_err(),
        NotifyError::Replayed { from: d_agent(), seq: 0, highest: 0 }
    );
    // Reordered within the window is fine; far behind is not.
    let later: Vec<_> = (1..=1100).map(|_| net.eps[1].seal_notification(&p_agent(), b"x").unwrap()).collect();
    assert!(net.eps[0].open_notification(&d_agent(), &later[1099]).is_ok());
    assert!(net.eps[0].open_notification(&d_agent(), &later[500]).is_ok());
    assert!(matches!(
        net.eps[0].open_notification(&d_agent(), &later[10]),
        Err(NotifyError::Replayed { seq: 11, highest: 1100, .. })
    ));
    // Unknown senders, truncated bytes and oversized payloads.
    let stranger = AgentName::new(EngineId::new("nobody"), 0);
    assert_eq!(
        net.eps[0].open_notification(&stranger, &sealed).unwrap_err(),
        NotifyError::UnknownPeer { agent: stranger.clone() }
    );
    assert!(matches!(net.eps[1].seal_notification(&stranger, b""), Err(NotifyError::UnknownPeer { .. })));
    assert_eq!(
        net.eps[0].open_notification(&d_agent(), b"KT").unwrap_err(),
        NotifyError::Malformed { from: d_agent(), len: 2 }
    );
    let huge = vec![0; crate::wire::MAX_MESSAGE_BYTES + 1];
    assert_eq!(
        net.eps[1].seal_notification(&p_agent(), &huge).unwrap_err().to_string(),
        format!("notification payload of {} bytes exceeds the 65536-byte limit", huge.len())
    );
    let mut oversized = b"KT".to_vec();
    oversized.extend_from_slice(&[0; 8]);
    oversized.extend_from_slice(&huge);
    oversized.extend_from_slice(&[0; 16]);
    assert!(matches!(net.eps[0].open_notification(&d_agent(), &oversized), Err(NotifyError::TooLarge { .. })));

    // After the peer is lost, its tags open nothing.
    let (conn, _) = (net.eps[0].peer(&d_agent()).unwrap().conn, ());
    net.eps[0].handle_closed(T0, conn);
    assert!(matches!(net.eps[0].open_notification(&d_agent(), &later[0]), Err(NotifyError::UnknownPeer { .. })));
}

#[test]
fn chunking_does_not_change_the_outcome() {
    let mut net = Net::new(vec![prefill(), decode(5)]);
    let (d_conn, _) = net.connect(1, 0);
    net.run();
    let d_stream: Vec<u8> =
        net.wire.iter().filter(|(s, c, _)| *s == 1 && *c == d_conn).flat_map(|(_, _, b)| b.clone()).collect();
    let expected = net.take(0);

    // The same nonces and stream, one byte at a time, give the same frames and events.
    let mut p = prefill();
    p.handle_accept(T0, ConnId(2), SOURCE, nonce(2));
    for byte in &d_stream {
        p.handle_bytes(T0, ConnId(2), std::slice::from_ref(byte));
    }
    let out = drain(&mut p);
    assert_eq!(out.events, expected);
    let p_sent: Vec<u8> = net.wire.iter().filter(|(s, _, _)| *s == 0).flat_map(|(_, _, b)| b.clone()).collect();
    assert_eq!(out.bytes(), p_sent);
}

#[test]
fn bad_configuration_and_offers_are_refused_at_construction() {
    let zero = SideLimits { max_unauthenticated: 0, ..SideLimits::default() };
    assert_eq!(
        SideEndpoint::new(SideConfig { key: key(), limits: zero }, p_offer()).unwrap_err().to_string(),
        "side-channel limit max_unauthenticated is 0"
    );
    let long = offer(Role::Prefill, &"p".repeat(65), 1, b"");
    assert_eq!(
        SideEndpoint::new(SideConfig::new(key()), long).unwrap_err().to_string(),
        "engine name of 65 bytes is outside the side channel's 1..=64"
    );
    let huge = offer(Role::Prefill, "p", 1, &vec![0; crate::wire::MAX_HANDSHAKE_BYTES]);
    assert!(matches!(SideEndpoint::new(SideConfig::new(key()), huge), Err(ConfigError::Offer(_))));

    let mut p = prefill();
    let mut more = p_offer();
    more.agent_metadata = b"after registering memory".to_vec();
    p.set_offer(more).unwrap();
    assert_eq!(
        p.set_offer(offer(Role::Prefill, "prefill0", 2, b"")).unwrap_err().to_string(),
        "a new offer cannot change who the agent is: was prefill0/tp0 incarnation 1 (Prefill), \
         now prefill0/tp0 incarnation 2 (Prefill)"
    );
}
