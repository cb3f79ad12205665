//! Hostile peers: no key, a wrong proof, replays, huge length prefixes, slowloris, floods of
//! pending connections, impostors under a live name; each is refused once, and the live peers
//! stay connected.

use super::*;

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
    p.handle_accept(T0, ConnId(1), SOURCE, nonce(1));
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
    p.handle_accept(T0, ConnId(1), SOURCE, nonce(99));
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
    p.handle_accept(T0, ConnId(1), SOURCE, nonce(1));
    p.handle_bytes(T0, ConnId(1), &[0xff, 0xff, 0xff, 0xff]);
    let out = drain(&mut p);
    let (cause, reason) = refusal(&out.events);
    assert_eq!(cause, RefusalCause::Malformed);
    assert_eq!(reason, "frame of 4294967295 bytes exceeds the 256-byte limit while waiting for HELLO");
    assert_eq!(out.closes, vec![ConnId(1)]);
    assert_eq!(p.buffered_bytes(), 0);

    // After the proof: the limit is the handshake's, and 4 GiB is still refused at once.
    let mut p = prefill();
    p.handle_accept(T0, ConnId(1), SOURCE, nonce(1));
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
    p.handle_accept(T0, ConnId(1), SOURCE, nonce(1));
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
    p.handle_accept(T0, ConnId(1), SOURCE, nonce(1));
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
fn a_listener_slowed_past_our_connects_deadline_still_takes_us_in_and_nothing_is_left_stale() {
    let ms = Duration::from_millis;
    let (mut p, mut d) = (prefill(), decode(5));
    let (d_conn, p_conn) = (ConnId(1), ConnId(2));
    d.handle_connect(T0, d_conn, PeerAddress("ep0".into()), nonce(1));
    // P, starved of CPU, accepts and answers 4.9 s later.
    p.handle_accept(T0 + ms(4_900), p_conn, SOURCE, nonce(2));
    p.handle_bytes(T0 + ms(4_900), p_conn, &drain(&mut d).bytes());
    d.handle_bytes(T0 + ms(4_950), d_conn, &drain(&mut p).bytes());
    let proof_and_offer = drain(&mut d).bytes();
    // Past the 5 s of D's connect, D still waits for P's offer.
    d.handle_timeout(T0 + ms(6_000));
    let out = drain(&mut d);
    assert!(out.events.is_empty() && out.closes.is_empty(), "{out:#?}");
    // P takes D in within its own 5 s of the accept, and its offer reaches D later still.
    p.handle_bytes(T0 + ms(9_800), p_conn, &proof_and_offer);
    let answer = drain(&mut p);
    assert_eq!(connected(&answer.events), vec![(p_conn, d_agent(), 5)]);
    d.handle_bytes(T0 + ms(12_000), d_conn, &answer.bytes());
    assert_eq!(connected(&drain(&mut d).events), vec![(d_conn, p_agent(), 1)]);
    assert_eq!((d.peer_count(), p.peer_count()), (1, 1));

    // A listener that never sends its offer is given up 10 s after our proof, not before.
    let mut d = decode(6);
    d.handle_connect(T0, d_conn, PeerAddress("ep0".into()), nonce(3));
    let mut p = prefill();
    p.handle_accept(T0, p_conn, SOURCE, nonce(4));
    p.handle_bytes(T0, p_conn, &drain(&mut d).bytes());
    d.handle_bytes(T0 + ms(1_000), d_conn, &drain(&mut p).bytes());
    drain(&mut d);
    assert_eq!(d.poll_timeout(), Some(T0 + ms(11_000)));
    d.handle_timeout(T0 + ms(10_999));
    assert!(drain(&mut d).events.is_empty());
    d.handle_timeout(T0 + ms(11_000));
    assert_eq!(
        connect_failure(&drain(&mut d).events),
        "transport backend: side channel to ep0: no offer within 10s of our proof"
    );
}

/// A P whose pending connections are kept `per_stage` a stage, `per_source` a stage from one
/// address (an eighth of each for the proven).
fn prefill_keeping(per_stage: usize, per_source: usize) -> SideEndpoint {
    let limits = SideLimits {
        max_unauthenticated: per_stage,
        max_unauthenticated_per_source: per_source,
        ..SideLimits::default()
    };
    SideEndpoint::new(SideConfig { key: key(), limits }, p_offer()).unwrap()
}

/// 4 a stage, 3 from one address.
fn small_prefill() -> SideEndpoint {
    prefill_keeping(4, 3)
}

/// A flood connection `id` from `source` that sent a HELLO (anyone can: it proves nothing).
fn greet(p: &mut SideEndpoint, id: u64, source: core::net::IpAddr) {
    p.handle_accept(T0, ConnId(id), source, nonce(id));
    let hello = Rogue::new([0; 32], &d_offer(id), id).hello;
    p.handle_bytes(T0, ConnId(id), &hello);
}

fn refused_conns(events: &[SideEvent]) -> Vec<u64> {
    events
        .iter()
        .filter_map(|e| match e {
            SideEvent::Refused { conn, cause: RefusalCause::Overloaded, .. } => Some(conn.0),
            _ => None,
        })
        .collect()
}

#[test]
fn a_flood_displaces_only_connections_that_proved_no_more_than_it() {
    let mut net = Net::new(vec![small_prefill(), decode(5)]);
    let mut refused = Vec::new();
    let mut take = |p: &mut SideEndpoint| -> Out {
        let out = drain(p);
        refused.extend(refused_conns(&out.events));
        out
    };
    let flood = core::net::IpAddr::from([10, 9, 9, 9]);
    for id in 1000..1004 {
        net.eps[0].handle_accept(T0, ConnId(id), flood, nonce(id));
    }
    assert_eq!(net.eps[0].pending_in(Stage::Accepted), 3, "3 a stage from one address");
    let out = take(&mut net.eps[0]);
    assert_eq!(refused_conns(&out.events), vec![1000], "the address's oldest goes first");
    assert_eq!(
        refusal(&out.events).1,
        "too many connections from one address waiting for HELLO (3); the oldest is dropped"
    );

    // A real engine's connection is accepted and sends its HELLO: it is greeted now, and a
    // flood of connections that send nothing never displaces it.
    let d_conn = ConnId(1);
    net.eps[1].handle_connect(T0, d_conn, PeerAddress("ep0".into()), nonce(1));
    let hello = drain(&mut net.eps[1]).bytes();
    net.eps[0].handle_accept(T0, ConnId(2), SOURCE, nonce(2));
    net.eps[0].handle_bytes(T0, ConnId(2), &hello);
    let challenge = take(&mut net.eps[0]).bytes();
    for id in 2000..2100 {
        net.eps[0].handle_accept(T0, ConnId(id), SOURCE, nonce(id));
    }
    let flood_out = refused_conns(&take(&mut net.eps[0]).events);
    assert_eq!(flood_out.len(), 99, "each newcomer past the budget displaces one: {flood_out:?}");
    assert!(!flood_out.contains(&2), "the greeted connection stays");

    // Greeted flood connections displace greeted ones, from the crowded address first.
    for id in 3000..3002 {
        greet(&mut net.eps[0], id, SOURCE);
    }
    greet(&mut net.eps[0], 3100, flood);
    assert_eq!(net.eps[0].pending_in(Stage::Greeted), 4);
    assert!(!refused_conns(&take(&mut net.eps[0]).events).contains(&2));
    // The real engine answers its CHALLENGE within its round trip, and gets in.
    net.eps[1].handle_bytes(T0, d_conn, &challenge);
    let answer = drain(&mut net.eps[1]).bytes();
    net.eps[0].handle_bytes(T0, ConnId(2), &answer);
    let p_out = take(&mut net.eps[0]);
    assert_eq!(connected(&p_out.events), vec![(ConnId(2), d_agent(), 5)]);
    for t in p_out.transmits.iter().filter(|t| t.conn == ConnId(2)) {
        net.eps[1].handle_bytes(T0, d_conn, &t.bytes);
    }
    assert_eq!(connected(&drain(&mut net.eps[1]).events), vec![(d_conn, p_agent(), 1)]);

    // Had it waited: more greetings from SOURCE displace SOURCE's oldest greeted, never the
    // other address's.
    for id in 3200..3203 {
        greet(&mut net.eps[0], id, SOURCE);
    }
    let greeted_out: Vec<u64> =
        refused_conns(&take(&mut net.eps[0]).events).into_iter().filter(|&c| c >= 3000).collect();
    assert_eq!(greeted_out, vec![3000, 3001]);
    assert_eq!(net.eps[0].refused_by_cause()[RefusalCause::Overloaded.index()], refused.len() as u64);
}

#[test]
fn a_key_holder_that_proved_the_key_is_displaced_only_by_another() {
    // The proven stage holds an eighth: 4 in all, 3 from one address.
    let mut p = prefill_keeping(32, 24);
    // Four key holders prove the key and stall before their offers.
    let mut rogues = Vec::new();
    for id in 1..=4u64 {
        p.handle_accept(T0, ConnId(id), SOURCE, nonce(id));
        let rogue = Rogue::new(*key().bytes(), &d_offer(id), id);
        p.handle_bytes(T0, ConnId(id), &rogue.hello);
        let challenge = drain(&mut p).bytes();
        let (proof, _) = rogue.answer(&challenge, &d_offer(id));
        p.handle_bytes(T0, ConnId(id), &proof);
        rogues.push(rogue);
    }
    assert_eq!(p.pending_in(Stage::Proven), 3, "3 a stage from one address");
    assert_eq!(refused_conns(&drain(&mut p).events), vec![1]);
    // No number of keyless connections, greeted or not, displaces them.
    for id in 100..200 {
        greet(&mut p, id, SOURCE);
    }
    assert_eq!(p.pending_in(Stage::Proven), 3);
    assert!(refused_conns(&drain(&mut p).events).iter().all(|&c| c >= 100));
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
    p.handle_accept(T0, ConnId(500), SOURCE, nonce(500));
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
    p.handle_accept(T0, ConnId(501), SOURCE, nonce(503));
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
    p.handle_accept(T0, ConnId(1), SOURCE, nonce(1));
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
    p.handle_accept(T0, ConnId(1), SOURCE, nonce(1));
    p.handle_closed(T0, ConnId(1));
    // Closed halfway through HELLO.
    p.handle_accept(T0, ConnId(2), SOURCE, nonce(2));
    p.handle_bytes(T0, ConnId(2), &Rogue::new([7; 32], &d_offer(5), 3).hello[..10]);
    p.handle_closed(T0, ConnId(2));
    // Closed after HELLO.
    p.handle_accept(T0, ConnId(3), SOURCE, nonce(3));
    p.handle_bytes(T0, ConnId(3), &Rogue::new([7; 32], &d_offer(5), 3).hello);
    p.handle_closed(T0, ConnId(3));
    // Garbage, then closed.
    p.handle_accept(T0, ConnId(4), SOURCE, nonce(4));
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
        p.handle_accept(T0, ConnId(i), SOURCE, nonce(i));
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
    p.handle_accept(T0, ConnId(1), SOURCE, nonce(1));
    let body = Identity::of(&d_offer(5)).body(3, ANY_RANK, &nonce(2));
    p.handle_bytes(T0, ConnId(1), &frame(Kind::Hello, &body));
    let out = drain(&mut p);
    let text = "side protocol version mismatch: peer 3, local 2";
    assert_eq!(refusal(&out.events), (RefusalCause::Version, text.into()));
    assert_eq!(out.transmits, vec![Transmit { conn: ConnId(1), bytes: frame(Kind::Error, text.as_bytes()) }]);

    // The initiator reports the listener's ERROR with its text.
    let mut d = decode(5);
    d.handle_connect(T0, ConnId(1), PeerAddress("p:1".into()), nonce(1));
    drain(&mut d);
    d.handle_bytes(T0, ConnId(1), &frame(Kind::Error, text.as_bytes()));
    assert_eq!(
        connect_failure(&drain(&mut d).events),
        "transport backend: p:1 refused the side channel: side protocol version mismatch: peer 3, local 2"
    );

    // And a CHALLENGE of another version, the other way round.
    let mut d = decode(5);
    d.handle_connect(T0, ConnId(1), PeerAddress("p:1".into()), nonce(1));
    drain(&mut d);
    let mut body = Identity::of(&p_offer()).body(1, ANY_RANK, &nonce(2));
    body.extend_from_slice(&[0; 32]);
    d.handle_bytes(T0, ConnId(1), &frame(Kind::Challenge, &body));
    assert_eq!(
        connect_failure(&drain(&mut d).events),
        "transport backend: side channel to p:1: side protocol version mismatch: peer 1, local 2"
    );
}
