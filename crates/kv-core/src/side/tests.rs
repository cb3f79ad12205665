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

const P_META: &[u8] = b"P-AGENT-METADATA: a capability to prefill0's KV pool";
const D_META: &[u8] = b"D-AGENT-METADATA: a capability to decode0's KV pool";
const T0: Time = Time::from_millis(1_000);

fn layout(order: MemoryOrder) -> KvLayout {
    KvLayout {
        layers: 2,
        block_tokens: 16,
        kv_heads: 4,
        head_dim: 64,
        dtype_bytes: 2,
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
        self.eps[to].handle_accept(self.now, b, nonce(b.0));
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
        let hello = frame(Kind::Hello, &Identity::of(hello_as).body(SIDE_PROTOCOL_VERSION, &nonce));
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
fn a_peer_without_the_key_learns_no_metadata_and_is_refused_once() {
    let other_key = ClusterKey::from_bytes(&[8; 32]).unwrap();
    let mut net = Net::new(vec![prefill(), endpoint(other_key.clone(), d_offer(5))]);
    let (_, p_conn) = net.connect(1, 0);
    net.run();
    let (cause, reason) = refusal(&net.take(0));
    assert_eq!(cause, RefusalCause::Unauthenticated);
    assert_eq!(reason, "the peer gave up: authentication failed");
    assert_eq!(connect_failure(&net.take(1)), "transport backend: the peer at ep0 does not hold the cluster key");
    assert_eq!(net.eps[0].peer_count(), 0);
    assert!(!contains(&net.sent_by(0), P_META) && !contains(&net.sent_by(1), D_META));
    let _ = p_conn;

    // The keyless side as listener: the initiator with the key never sends its offer either.
    let mut net = Net::new(vec![endpoint(other_key, p_offer()), decode(5)]);
    net.connect(1, 0);
    net.run();
    assert_eq!(refusal(&net.take(0)).0, RefusalCause::Unauthenticated);
    assert!(connect_failure(&net.take(1)).contains("does not hold the cluster key"));
    assert!(!contains(&net.sent_by(1), D_META) && !contains(&net.sent_by(0), P_META));
}

#[test]
fn a_wrong_proof_is_refused_with_an_error_frame_and_nothing_else() {
    let mut p = prefill();
    p.handle_accept(T0, ConnId(1), nonce(1));
    let rogue = Rogue::new([9; 32], &d_offer(5), 2);
    p.handle_bytes(T0, ConnId(1), &rogue.hello);
    let challenge = drain(&mut p).transmits.remove(0).bytes;
    let (proof, sealed) = rogue.answer(&challenge, &d_offer(5));
    let mut stream = proof;
    stream.extend_from_slice(&sealed);
    p.handle_bytes(T0, ConnId(1), &stream);
    let out = drain(&mut p);
    assert_eq!(out.transmits, vec![Transmit { conn: ConnId(1), bytes: frame(Kind::Error, b"authentication failed") }]);
    assert_eq!(out.closes, vec![ConnId(1)]);
    assert_eq!(refusal(&out.events), (RefusalCause::Unauthenticated, "authentication failed: wrong proof".into()));
    assert!(!contains(&out.bytes(), P_META));
    // Whatever follows on the closed connection is ignored, and reported no second time.
    p.handle_closed(T0, ConnId(1));
    p.handle_bytes(T0, ConnId(1), &stream);
    let out = drain(&mut p);
    assert!(out.events.is_empty() && out.transmits.is_empty() && out.closes.is_empty());
}

#[test]
fn a_replayed_hello_and_proof_from_an_earlier_session_fail() {
    let mut net = Net::new(vec![prefill(), decode(5)]);
    let (d_conn, p_conn) = net.connect(1, 0);
    net.run();
    let recorded_d: Vec<u8> =
        net.wire.iter().filter(|(s, c, _)| *s == 1 && *c == d_conn).flat_map(|(_, _, b)| b.iter().copied()).collect();
    let recorded_p: Vec<u8> =
        net.wire.iter().filter(|(s, c, _)| *s == 0 && *c == p_conn).flat_map(|(_, _, b)| b.iter().copied()).collect();

    // The attacker replays D's whole stream to a fresh P connection: P's new nonce makes the
    // old PROOF wrong.
    let mut p = prefill();
    p.handle_accept(T0, ConnId(1), nonce(99));
    p.handle_bytes(T0, ConnId(1), &recorded_d);
    let out = drain(&mut p);
    assert_eq!(refusal(&out.events).0, RefusalCause::Unauthenticated);
    assert!(!contains(&out.bytes(), P_META));
    assert_eq!(p.peer_count(), 0);

    // The attacker plays P to a fresh D with P's recorded CHALLENGE: D's new nonce makes it
    // wrong, and D sends no PROOF and no offer.
    let mut d = decode(5);
    d.handle_connect(T0, ConnId(1), PeerAddress("p".into()), nonce(98));
    let hello = drain(&mut d);
    d.handle_bytes(T0, ConnId(1), &recorded_p);
    let out = drain(&mut d);
    assert!(connect_failure(&out.events).contains("does not hold the cluster key"));
    assert_eq!(out.transmits, vec![Transmit { conn: ConnId(1), bytes: frame(Kind::Error, b"authentication failed") }]);
    assert!(!contains(&hello.bytes(), D_META) && !contains(&out.bytes(), D_META));
}

#[test]
fn a_4_gib_length_prefix_is_refused_at_once_in_every_stage() {
    // Before authentication.
    let mut p = prefill();
    p.handle_accept(T0, ConnId(1), nonce(1));
    p.handle_bytes(T0, ConnId(1), &[0xff, 0xff, 0xff, 0xff]);
    let out = drain(&mut p);
    let (cause, reason) = refusal(&out.events);
    assert_eq!(cause, RefusalCause::Malformed);
    assert_eq!(reason, "frame of 4294967295 bytes exceeds the 256-byte limit while waiting for HELLO");
    assert_eq!(out.closes, vec![ConnId(1)]);
    assert_eq!(p.buffered_bytes(), 0);

    // After the proof: the limit is the handshake's, and 4 GiB is still refused at once.
    let mut p = prefill();
    p.handle_accept(T0, ConnId(1), nonce(1));
    let rogue = Rogue::new([7; 32], &d_offer(5), 2);
    p.handle_bytes(T0, ConnId(1), &rogue.hello);
    let challenge = drain(&mut p).transmits.remove(0).bytes;
    let (proof, _) = rogue.answer(&challenge, &d_offer(5));
    p.handle_bytes(T0, ConnId(1), &proof);
    p.handle_bytes(T0, ConnId(1), &[0xff, 0xff, 0xff, 0xff, 4]);
    let (cause, reason) = refusal(&drain(&mut p).events);
    assert_eq!(cause, RefusalCause::Malformed);
    assert_eq!(
        reason,
        format!("frame of 4294967295 bytes exceeds the {MAX_SEALED_FRAME}-byte limit while waiting for the initiator's OFFER")
    );

    // A claimed length within the limit buffers only what arrived.
    let mut p = prefill();
    p.handle_accept(T0, ConnId(1), nonce(1));
    p.handle_bytes(T0, ConnId(1), &rogue.hello);
    let challenge = drain(&mut p).transmits.remove(0).bytes;
    let (proof, _) = rogue.answer(&challenge, &d_offer(5));
    p.handle_bytes(T0, ConnId(1), &proof);
    let mut claim = (MAX_SEALED_FRAME as u32).to_be_bytes().to_vec();
    claim.extend_from_slice(&[4; 100]);
    p.handle_bytes(T0, ConnId(1), &claim);
    assert!(p.buffered_bytes() <= 4 + 100 + 8, "buffered {}", p.buffered_bytes());
}

#[test]
fn a_slowloris_times_out_and_is_reported_once() {
    let mut p = prefill();
    p.handle_accept(T0, ConnId(1), nonce(1));
    assert_eq!(p.poll_timeout(), Some(T0 + Duration::from_secs(5)));
    let hello = Rogue::new([7; 32], &d_offer(5), 2).hello;
    for (i, byte) in hello.iter().take(20).enumerate() {
        p.handle_bytes(T0 + Duration::from_millis(200 * i as u64), ConnId(1), &[*byte]);
    }
    assert!(drain(&mut p).events.is_empty(), "still within the deadline");
    p.handle_timeout(T0 + Duration::from_millis(4_999));
    assert!(drain(&mut p).events.is_empty());
    p.handle_timeout(T0 + Duration::from_secs(5));
    let out = drain(&mut p);
    assert_eq!(refusal(&out.events), (RefusalCause::Timeout, "no handshake within 5s".into()));
    assert_eq!(out.transmits, vec![Transmit { conn: ConnId(1), bytes: frame(Kind::Error, b"no handshake within 5s") }]);
    assert_eq!(out.closes, vec![ConnId(1)]);
    assert_eq!((p.poll_timeout(), p.pending_count(), p.buffered_bytes()), (None, 0, 0));
    p.handle_closed(T0 + Duration::from_secs(6), ConnId(1));
    assert!(drain(&mut p).events.is_empty());

    // Our own handshake times out the same way.
    let mut d = decode(5);
    d.handle_connect(T0, ConnId(2), PeerAddress("10.0.0.1:5600".into()), nonce(3));
    drain(&mut d);
    d.handle_timeout(T0 + Duration::from_secs(5));
    assert_eq!(
        connect_failure(&drain(&mut d).events),
        "transport backend: side channel to 10.0.0.1:5600: no handshake within 5s"
    );
}

#[test]
fn the_65th_pending_connection_evicts_the_oldest_and_real_engines_still_get_in() {
    let mut net = Net::new(vec![prefill(), decode(5)]);
    for i in 0..64 {
        net.eps[0].handle_accept(T0, ConnId(1000 + i), nonce(1000 + i));
    }
    assert_eq!(net.eps[0].pending_count(), 64);
    assert!(drain(&mut net.eps[0]).events.is_empty());
    net.eps[0].handle_accept(T0, ConnId(2000), nonce(2000));
    let out = drain(&mut net.eps[0]);
    assert_eq!(
        refusal(&out.events),
        (RefusalCause::Overloaded, "too many unauthenticated connections (64); the oldest is dropped".into())
    );
    assert!(matches!(out.events[0], SideEvent::Refused { conn: ConnId(1000), .. }), "the oldest goes first");
    assert_eq!(out.closes, vec![ConnId(1000)]);
    assert_eq!(net.eps[0].pending_count(), 64);

    // With the flood holding every slot, a real engine's connection evicts one and completes.
    let (_, p_conn) = net.connect(1, 0);
    net.run();
    let p_events = net.take(0);
    assert_eq!(connected(&p_events), vec![(p_conn, d_agent(), 5)]);
    assert_eq!(p_events.len(), 2, "one eviction, one connection: {p_events:#?}");
    assert!(matches!(p_events[0], SideEvent::Refused { conn: ConnId(1001), cause: RefusalCause::Overloaded, .. }));
    assert_eq!(net.eps[0].pending_count(), 63);
}

#[test]
fn a_second_handshake_under_a_live_name_is_refused_unless_newer() {
    let mut net = Net::new(vec![prefill(), decode(5), decode(5), decode(4), decode(6)]);
    let (d5_conn, p_d5) = net.connect(1, 0);
    net.run();
    assert_eq!(connected(&net.take(0)), vec![(p_d5, d_agent(), 5)]);
    net.take(1);

    // The same incarnation again: refused, and the live connection stays.
    net.connect(2, 0);
    net.run();
    let (cause, reason) = refusal(&net.take(0));
    assert_eq!(
        (cause, reason.as_str()),
        (RefusalCause::Impersonation, "decode0/tp0 is already connected as incarnation 5")
    );
    assert_eq!(
        connect_failure(&net.take(2)),
        "transport backend: ep0 refused the handshake: decode0/tp0 is already connected as incarnation 5"
    );
    // An older one: refused too.
    net.connect(3, 0);
    net.run();
    assert_eq!(refusal(&net.take(0)).1, "decode0/tp0 is already connected as incarnation 5");
    net.take(3);
    assert_eq!(net.eps[0].peer(&d_agent()).unwrap().conn, p_d5);
    assert!(net.take(1).is_empty(), "the live peer saw nothing");

    // A newer one replaces it: Lost for the old connection, then Connected for the new.
    let (_, p_d6) = net.connect(4, 0);
    net.run();
    assert_eq!(
        net.take(0)
            .iter()
            .map(|e| match e {
                SideEvent::Lost { conn, agent, instance } => format!("lost {conn:?} {agent} {instance}"),
                SideEvent::Connected { conn, info } =>
                    format!("connected {conn:?} {} {}", info.agent, info.handshake.instance),
                other => format!("{other:?}"),
            })
            .collect::<Vec<_>>(),
        vec![format!("lost {p_d5:?} decode0/tp0 5"), format!("connected {p_d6:?} decode0/tp0 6")]
    );
    assert_eq!(net.eps[0].peer(&d_agent()).unwrap().incarnation, 6);
    // The replaced engine sees its side channel close: P is lost to it.
    assert_eq!(net.take(1), vec![SideEvent::Lost { conn: d5_conn, agent: p_agent(), instance: 1 }]);

    // The replaced incarnation is gone for good: it cannot come back.
    let mut net2 = Net::new(vec![]);
    std::mem::swap(&mut net2.eps, &mut net.eps);
    net2.eps.push(decode(5));
    net2.events = net2.eps.iter().map(|_| Vec::new()).collect();
    net2.connect(5, 0);
    net2.run();
    assert_eq!(
        refusal(&net2.take(0)),
        (RefusalCause::Stale, "decode0/tp0 incarnation 5 is stale: incarnation 5 was seen gone".into())
    );
}

#[test]
fn closing_a_refused_or_pending_impostor_leaves_the_live_peer_alone() {
    let mut net = Net::new(vec![prefill(), decode(5)]);
    let (_, p_conn) = net.connect(1, 0);
    net.run();
    net.take(0);
    let live = net.eps[0].peer(&d_agent()).unwrap();

    // An attacker claims the live name in HELLO, then closes without proof.
    let p = &mut net.eps[0];
    p.handle_accept(T0, ConnId(500), nonce(500));
    p.handle_bytes(T0, ConnId(500), &Rogue::new([0; 32], &d_offer(5), 501).hello);
    p.handle_closed(T0, ConnId(500));
    let out = drain(p);
    let [SideEvent::Refused { claimed, cause, reason, .. }] = out.events.as_slice() else { panic!("{out:?}") };
    assert_eq!(
        (claimed.clone(), *cause, reason.as_str()),
        (Some(d_agent()), RefusalCause::Unauthenticated, "closed before proving the cluster key")
    );

    // An engine with the key claims the live name in full, is refused, and its connection closes.
    let rogue = Rogue::new([7; 32], &d_offer(5), 502);
    p.handle_accept(T0, ConnId(501), nonce(503));
    p.handle_bytes(T0, ConnId(501), &rogue.hello);
    let challenge = drain(p).transmits.remove(0).bytes;
    let (proof, sealed) = rogue.answer(&challenge, &d_offer(5));
    p.handle_bytes(T0, ConnId(501), &[proof, sealed].concat());
    assert_eq!(refusal(&drain(p).events).0, RefusalCause::Impersonation);
    p.handle_closed(T0, ConnId(501));
    assert!(drain(p).events.is_empty());

    assert_eq!(p.peer(&d_agent()), Some(live));
    assert_eq!(live.conn, p_conn);
    let sealed = net.eps[1].seal_notification(&p_agent(), b"still here").unwrap();
    assert_eq!(net.eps[0].open_notification(&d_agent(), &sealed).unwrap(), b"still here");
}

#[test]
fn an_offer_that_contradicts_its_hello_is_impersonation() {
    let mut p = prefill();
    p.handle_accept(T0, ConnId(1), nonce(1));
    // HELLO as decode0 rank 0; the sealed offer says rank 1.
    let rogue = Rogue::new([7; 32], &d_offer(5), 2);
    p.handle_bytes(T0, ConnId(1), &rogue.hello);
    let challenge = drain(&mut p).transmits.remove(0).bytes;
    let mut other = d_offer(5);
    other.rank = 1;
    other.tp_size = 2;
    let (proof, sealed) = rogue.answer(&challenge, &other);
    p.handle_bytes(T0, ConnId(1), &[proof, sealed].concat());
    let out = drain(&mut p);
    assert_eq!(
        refusal(&out.events),
        (
            RefusalCause::Impersonation,
            "the offer names decode0/tp1 incarnation 5 (Decode) but the HELLO named decode0/tp0 incarnation 5 (Decode)"
                .into()
        )
    );
    assert!(!contains(&out.bytes(), P_META));
    assert_eq!(p.peer_count(), 0);
}

#[test]
fn every_connection_that_ends_unestablished_is_reported_exactly_once() {
    let mut p = prefill();
    // Closed before sending anything.
    p.handle_accept(T0, ConnId(1), nonce(1));
    p.handle_closed(T0, ConnId(1));
    // Closed halfway through HELLO.
    p.handle_accept(T0, ConnId(2), nonce(2));
    p.handle_bytes(T0, ConnId(2), &Rogue::new([7; 32], &d_offer(5), 3).hello[..10]);
    p.handle_closed(T0, ConnId(2));
    // Closed after HELLO.
    p.handle_accept(T0, ConnId(3), nonce(3));
    p.handle_bytes(T0, ConnId(3), &Rogue::new([7; 32], &d_offer(5), 3).hello);
    p.handle_closed(T0, ConnId(3));
    // Garbage, then closed.
    p.handle_accept(T0, ConnId(4), nonce(4));
    p.handle_bytes(T0, ConnId(4), b"GET / HTTP/1.1\r\n\r\n");
    p.handle_closed(T0, ConnId(4));
    // Closed twice, and a close of a connection never seen.
    p.handle_closed(T0, ConnId(4));
    p.handle_closed(T0, ConnId(77));
    let out = drain(&mut p);
    let got: Vec<_> = out
        .events
        .iter()
        .map(|e| match e {
            SideEvent::Refused { conn, cause, reason, .. } => (conn.0, *cause, reason.clone()),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(
        got,
        vec![
            (1, RefusalCause::Malformed, "closed before the handshake".to_owned()),
            (2, RefusalCause::Malformed, "closed before the handshake".to_owned()),
            (3, RefusalCause::Unauthenticated, "closed before proving the cluster key".to_owned()),
            (
                4,
                RefusalCause::Malformed,
                "frame of 1195725856 bytes exceeds the 256-byte limit while waiting for HELLO".to_owned()
            ),
        ]
    );
    assert_eq!(out.closes, vec![ConnId(1), ConnId(2), ConnId(3), ConnId(4)]);
    assert_eq!((p.pending_count(), p.poll_timeout()), (0, None));

    // Our own: a connect that fails is unreachable; a close after the listener spoke is not.
    let mut d = decode(5);
    d.handle_connect(T0, ConnId(1), PeerAddress("p:1".into()), nonce(1));
    d.handle_closed(T0, ConnId(1));
    d.handle_closed(T0, ConnId(1));
    assert_eq!(connect_failure(&drain(&mut d).events), "no peer at p:1");
}

#[test]
fn the_event_queue_is_bounded_and_counts_the_refusals_it_drops() {
    let limits = SideLimits { max_queued_events: 3, ..SideLimits::default() };
    let mut p = SideEndpoint::new(SideConfig { key: key(), limits }, p_offer()).unwrap();
    for i in 0..10 {
        p.handle_accept(T0, ConnId(i), nonce(i));
        p.handle_closed(T0, ConnId(i));
    }
    assert_eq!(p.refusals_dropped(), 7);
    assert_eq!(drain(&mut p).events.len(), 3);
}

#[test]
fn an_established_peer_that_sends_anything_more_is_lost() {
    let mut net = Net::new(vec![prefill(), decode(5)]);
    let (_, p_conn) = net.connect(1, 0);
    net.run();
    net.take(0);
    net.eps[0].handle_bytes(T0, p_conn, &[0]);
    let out = drain(&mut net.eps[0]);
    assert_eq!(out.events, vec![SideEvent::Lost { conn: p_conn, agent: d_agent(), instance: 5 }]);
    assert_eq!(out.closes, vec![p_conn]);
    assert_eq!(net.eps[0].peer(&d_agent()), None);
    net.eps[0].handle_closed(T0, p_conn);
    assert!(drain(&mut net.eps[0]).events.is_empty(), "lost once");
}

#[test]
fn a_version_mismatch_names_both_versions() {
    let mut p = prefill();
    p.handle_accept(T0, ConnId(1), nonce(1));
    let body = Identity::of(&d_offer(5)).body(3, &nonce(2));
    p.handle_bytes(T0, ConnId(1), &frame(Kind::Hello, &body));
    let out = drain(&mut p);
    let text = "side protocol version mismatch: peer 3, local 1";
    assert_eq!(refusal(&out.events), (RefusalCause::Version, text.into()));
    assert_eq!(out.transmits, vec![Transmit { conn: ConnId(1), bytes: frame(Kind::Error, text.as_bytes()) }]);

    // The initiator reports the listener's ERROR with its text.
    let mut d = decode(5);
    d.handle_connect(T0, ConnId(1), PeerAddress("p:1".into()), nonce(1));
    drain(&mut d);
    d.handle_bytes(T0, ConnId(1), &frame(Kind::Error, text.as_bytes()));
    assert_eq!(
        connect_failure(&drain(&mut d).events),
        "transport backend: p:1 refused the side channel: side protocol version mismatch: peer 3, local 1"
    );

    // And a CHALLENGE of another version, the other way round.
    let mut d = decode(5);
    d.handle_connect(T0, ConnId(1), PeerAddress("p:1".into()), nonce(1));
    drain(&mut d);
    let mut body = Identity::of(&p_offer()).body(2, &nonce(2));
    body.extend_from_slice(&[0; 32]);
    d.handle_bytes(T0, ConnId(1), &frame(Kind::Challenge, &body));
    assert_eq!(
        connect_failure(&drain(&mut d).events),
        "transport backend: side channel to p:1: side protocol version mismatch: peer 2, local 1"
    );
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
    p.handle_accept(T0, ConnId(2), nonce(2));
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

/// An endpoint brought to one stage of a handshake on connection 1, with `rogue` as the peer.
fn at_stage(stage: u8) -> SideEndpoint {
    let rogue = Rogue::new([7; 32], &d_offer(5), 2);
    let mut p = prefill();
    match stage {
        // Listener waiting for HELLO, for PROOF, for the initiator's OFFER, and established.
        0..=3 => {
            p.handle_accept(T0, ConnId(1), nonce(1));
            if stage >= 1 {
                p.handle_bytes(T0, ConnId(1), &rogue.hello);
                let challenge = drain(&mut p).transmits.remove(0).bytes;
                let (proof, sealed) = rogue.answer(&challenge, &d_offer(5));
                if stage >= 2 {
                    p.handle_bytes(T0, ConnId(1), &proof);
                }
                if stage >= 3 {
                    p.handle_bytes(T0, ConnId(1), &sealed);
                }
            }
        }
        // Initiator waiting for CHALLENGE, then for the listener's OFFER.
        _ => {
            let mut d = decode(5);
            d.handle_connect(T0, ConnId(1), PeerAddress("p".into()), nonce(1));
            let hello = drain(&mut d).transmits.remove(0).bytes;
            if stage >= 5 {
                p.handle_accept(T0, ConnId(9), nonce(9));
                p.handle_bytes(T0, ConnId(9), &hello);
                let challenge = drain(&mut p).transmits.remove(0).bytes;
                d.handle_bytes(T0, ConnId(1), &challenge);
            }
            p = d;
        }
    }
    drain(&mut p);
    p
}

fn chunked(bytes: Vec<u8>, cuts: Vec<usize>) -> Vec<Vec<u8>> {
    let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % (bytes.len() + 1)).collect();
    cuts.sort_unstable();
    let mut chunks = Vec::new();
    let mut from = 0;
    for cut in cuts.into_iter().chain([bytes.len()]) {
        chunks.push(bytes[from..cut.max(from)].to_vec());
        from = cut.max(from);
    }
    chunks
}

fn arbitrary_stream() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        // Noise.
        prop::collection::vec(any::<u8>(), 0..600),
        // A plausible length prefix of any size up to twice the largest limit, then noise.
        (1u32..(2 * MAX_SEALED_FRAME as u32), any::<u8>(), prop::collection::vec(any::<u8>(), 0..600)).prop_map(
            |(len, kind, body)| {
                let mut bytes = len.to_be_bytes().to_vec();
                bytes.push(kind % 7);
                bytes.extend(body);
                bytes
            }
        ),
        // A real HELLO, PROOF-sized and SEALED-sized frames with noise inside.
        (prop::collection::vec(any::<u8>(), 32), prop::collection::vec(any::<u8>(), 0..300)).prop_map(
            |(mac, sealed)| {
                let mut bytes = Rogue::new([7; 32], &d_offer(5), 2).hello;
                bytes.extend(frame(Kind::Proof, &mac));
                bytes.extend(frame(Kind::Sealed, &sealed));
                bytes
            }
        ),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Whatever arrives, in whatever chunks and stage: no panic, no more buffered than the
    /// stage's frame limit, and the connection ends at most once.
    #[test]
    fn arbitrary_bytes_in_any_stage_never_panic_or_overbuffer(
        stage in 0u8..6,
        stream in arbitrary_stream(),
        cuts in prop::collection::vec(any::<usize>(), 0..8),
    ) {
        let mut e = at_stage(stage);
        let limit = if matches!(stage, 2 | 5) { MAX_SEALED_FRAME } else { MAX_CLEAR_FRAME };
        let mut events = Vec::new();
        for chunk in chunked(stream, cuts) {
            e.handle_bytes(T0, ConnId(1), &chunk);
            prop_assert!(e.buffered_bytes() <= 4 + limit, "buffered {} in stage {}", e.buffered_bytes(), stage);
            events.extend(drain(&mut e).events);
        }
        e.handle_closed(T0, ConnId(1));
        events.extend(drain(&mut e).events);
        let ends = events.iter().filter(|ev| match ev {
            SideEvent::Refused { conn, .. } | SideEvent::ConnectFailed { conn, .. } | SideEvent::Lost { conn, .. } => *conn == ConnId(1),
            SideEvent::Connected { .. } => false,
        }).count();
        prop_assert_eq!(ends, 1, "events {:?}", events);
        prop_assert_eq!(e.buffered_bytes(), 0);
    }

    /// A genuine handshake stream with bytes altered: the listener never sends its offer unless
    /// the stream still proves the key, and every outcome is reported once.
    #[test]
    fn altered_handshakes_leak_nothing(flips in prop::collection::vec((any::<prop::sample::Index>(), 1u8..), 1..4)) {
        let rogue = Rogue::new([7; 32], &d_offer(5), 2);
        let mut p = prefill();
        p.handle_accept(T0, ConnId(1), nonce(1));
        p.handle_bytes(T0, ConnId(1), &rogue.hello);
        let challenge = drain(&mut p).transmits.remove(0).bytes;
        let (proof, sealed) = rogue.answer(&challenge, &d_offer(5));
        let mut stream = [proof, sealed].concat();
        for (at, x) in flips {
            let i = at.index(stream.len());
            stream[i] ^= x;
        }
        p.handle_bytes(T0, ConnId(1), &stream);
        let out = drain(&mut p);
        prop_assert!(!contains(&out.bytes(), P_META));
        prop_assert!(connected(&out.events).is_empty(), "{:?}", out.events);
        prop_assert_eq!(out.events.len() + p.pending_count(), 1);
    }
}
