//! Arbitrary bytes, cut anywhere, in every stage of a handshake: the endpoint never panics,
//! never buffers past its bounds, and reports each connection once.

use super::*;

/// An endpoint brought to one stage of a handshake on connection 1, with `rogue` as the peer.
fn at_stage(stage: u8) -> SideEndpoint {
    let rogue = Rogue::new([7; 32], &d_offer(5), 2);
    let mut p = prefill();
    match stage {
        // Listener waiting for HELLO, for PROOF, for the initiator's OFFER, and established.
        0..=3 => {
            p.handle_accept(T0, ConnId(1), SOURCE, nonce(1));
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
                p.handle_accept(T0, ConnId(9), SOURCE, nonce(9));
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
        p.handle_accept(T0, ConnId(1), SOURCE, nonce(1));
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
