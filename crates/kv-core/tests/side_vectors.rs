//! Replays the test vectors of `docs/side-channel.md` against [`SideEndpoint`], so that the
//! document and the code cannot drift apart.
//!
//! The listener is fed the recorded initiator frames and must answer with the recorded
//! listener frames, byte for byte, and the same events; the initiator likewise. The
//! intermediate values the document gives (transcript hash, MACs, session keys, sealed
//! plaintexts, tags) are recomputed here from the document's description with the crates
//! directly, not through kv-core, as an implementation in another language would. On a mismatch
//! the test prints the vector block the code produces.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use chacha20poly1305::aead::{AeadInPlace, KeyInit};
use chacha20poly1305::ChaCha20Poly1305;
use hkdf::Hkdf;
use hmac::{Hmac, Mac};
use kv_core::side::{ClusterKey, ConnId, LinkRole, SideConfig, SideEndpoint, SideEvent, Transmit};
use kv_core::wire::compatibility_hash;
use kv_core::{
    AgentName, BlockId, Claim, Digest as KvDigest, EngineId, Handshake, KvLayout, LeaseState, Message, PeerAddress,
    Prompt, PushRegistration, RegionBase, Renewal, Role, Time,
};
use sha2::{Digest, Sha256};

/// Where the listener says the initiator connects from (the vectors do not depend on it).
const SOURCE: std::net::IpAddr = std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);

const FENCE: &str = "```vectors";

fn doc_path() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/side-channel.md")
}

/// The `name value` lines of the document's vector block; indented lines continue a value.
fn read_vectors() -> BTreeMap<String, String> {
    let text = std::fs::read_to_string(doc_path()).expect("docs/side-channel.md is readable");
    let start = text.find(FENCE).expect("docs/side-channel.md has a ```vectors block") + FENCE.len();
    let block = &text[start..start + text[start..].find("```").expect("the vectors block is closed")];
    let mut vectors: BTreeMap<String, String> = BTreeMap::new();
    let mut last: Option<String> = None;
    for line in block.lines() {
        if line.trim().is_empty() || line.trim_start().starts_with('#') {
            continue;
        }
        if line.starts_with(char::is_whitespace) {
            let name = last.as_ref().expect("a continuation line follows a named line");
            if let Some(value) = vectors.get_mut(name) {
                value.push_str(line.trim());
            }
        } else {
            let (name, value) = line.split_once(char::is_whitespace).unwrap_or((line, ""));
            vectors.insert(name.to_owned(), value.trim().to_owned());
            last = Some(name.to_owned());
        }
    }
    vectors
}

fn unhex(text: &str) -> Vec<u8> {
    assert!(text.len() % 2 == 0, "odd hex length {}", text.len());
    (0..text.len()).step_by(2).map(|i| u8::from_str_radix(&text[i..i + 2], 16).expect("hex")).collect()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The vector block as the code produces it, in the document's layout.
struct Block(Vec<(String, String)>);

impl Block {
    fn bytes(&mut self, name: &str, bytes: &[u8]) {
        self.0.push((name.to_owned(), hex(bytes)));
    }

    fn text(&mut self, name: &str, value: impl ToString) {
        self.0.push((name.to_owned(), value.to_string()));
    }

    fn render(&self) -> String {
        let mut out = String::new();
        for (name, value) in &self.0 {
            let is_hex = !value.is_empty() && value.len() > 64 && value.bytes().all(|b| b.is_ascii_hexdigit());
            if is_hex {
                for (i, chunk) in value.as_bytes().chunks(64).enumerate() {
                    let chunk = std::str::from_utf8(chunk).unwrap();
                    if i == 0 {
                        writeln!(out, "{name:<22}{chunk}").unwrap();
                    } else {
                        writeln!(out, "{:<22}{chunk}", "").unwrap();
                    }
                }
            } else {
                writeln!(out, "{name:<22}{value}").unwrap();
            }
        }
        out
    }
}

fn layout(block_tokens: u32) -> KvLayout {
    KvLayout::llama3_8b(block_tokens)
}

/// A LEB128 varint, as postcard writes unsigned integers.
fn varint(mut v: u64, out: &mut Vec<u8>) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// kvflow's agent metadata (the registration table) for one host region of the NIXL transport,
/// with a stand-in for NIXL's own bytes.
fn metadata(addr: u64, len: u64, nixl: &str) -> Vec<u8> {
    let mut md = b"KV".to_vec();
    md.extend_from_slice(&kv_core::wire::PROTOCOL_VERSION.to_be_bytes());
    md.push(4);
    md.extend_from_slice(b"nixl"); // transport
    md.push(0); // no data address
    md.push(1); // one registration:
    varint(addr, &mut md);
    varint(len, &mut md);
    md.push(0); // host memory
    md.extend_from_slice(nixl.as_bytes());
    md
}

/// The two offers the document describes field by field.
fn documented_offer(role: Role) -> Handshake {
    let (engine, instance, block_tokens, num_blocks, addr) = match role {
        Role::Prefill => ("prefill-a", 3, 16, 1000, 0x7f3a_0000_0000),
        Role::Decode => ("decode-b", 7, 32, 400, 0x7f5b_0000_0000),
    };
    let layout = layout(block_tokens);
    // 32 layers x K and V x 4 heads per rank x tokens x 128 dims x 2 bytes, per block.
    let len = u64::from(num_blocks) * 32 * 2 * 4 * u64::from(block_tokens) * 128 * 2;
    Handshake {
        protocol_version: kv_core::wire::PROTOCOL_VERSION,
        engine: EngineId::new(engine),
        rank: 1,
        tp_size: 2,
        pp_size: 1,
        instance,
        role,
        model: "llama-3.1-8b".into(),
        layout,
        num_blocks,
        regions: vec![RegionBase { addr, len }],
        compat_hash: compatibility_hash("llama-3.1-8b", &layout),
        clock: Time::ZERO,
        agent_metadata: metadata(addr, len, &format!("nixl:{engine}/tp1#{instance}")),
    }
}

fn hmac(key: &[u8], parts: &[&[u8]]) -> [u8; 32] {
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(key).unwrap();
    for part in parts {
        mac.update(part);
    }
    mac.finalize().into_bytes().into()
}

fn open(key: &[u8], counter: u64, frame: &[u8]) -> Vec<u8> {
    if frame.len() < 5 + 16 {
        return b"<too short>".to_vec();
    }
    let cipher = ChaCha20Poly1305::new_from_slice(key).unwrap();
    let mut nonce = [0u8; 12];
    nonce[4..].copy_from_slice(&counter.to_be_bytes());
    let (aad, rest) = frame.split_at(5);
    let (ciphertext, tag) = rest.split_at(rest.len() - 16);
    let mut plaintext = ciphertext.to_vec();
    match cipher.decrypt_in_place_detached(&nonce.into(), aad, &mut plaintext, tag.into()) {
        Ok(()) => plaintext,
        Err(_) => b"<does not open>".to_vec(),
    }
}

/// The frames and events an endpoint handed back; missing frames read as empty, so that a
/// drifted vector still leads to the comparison that prints what the code produces.
fn drain(e: &mut SideEndpoint) -> (Frames, Vec<SideEvent>) {
    let mut frames = Vec::new();
    while let Some(Transmit { bytes, .. }) = e.poll_transmit() {
        frames.push(bytes);
    }
    while e.poll_close().is_some() {}
    let mut events = Vec::new();
    while let Some(event) = e.poll_event() {
        events.push(event);
    }
    (Frames(frames), events)
}

struct Frames(Vec<Vec<u8>>);

impl std::ops::Index<usize> for Frames {
    type Output = Vec<u8>;
    fn index(&self, i: usize) -> &Vec<u8> {
        static EMPTY: Vec<u8> = Vec::new();
        self.0.get(i).unwrap_or(&EMPTY)
    }
}

fn describe(events: &[SideEvent]) -> String {
    match events {
        [SideEvent::Connected { info, .. }] => format!(
            "Connected {} incarnation {} sent_at {} received_at {} clock {}",
            info.agent,
            info.handshake.instance,
            info.sent_at.as_nanos(),
            info.received_at.as_nanos(),
            info.handshake.clock.as_nanos()
        ),
        other => format!("{other:?}"),
    }
}

#[test]
fn the_documented_handshake_replays_byte_for_byte() {
    let doc = read_vectors();
    let mut block = Block(Vec::new());
    let get = |name: &str| doc.get(name).cloned();
    let bytes_or = |name: &str, fallback: &[u8]| get(name).map(|v| unhex(&v)).unwrap_or_else(|| fallback.to_vec());
    let time = |name: &str| Time::from_nanos(get(name).and_then(|v| v.parse().ok()).unwrap_or(0));

    // Inputs.
    let key_bytes = bytes_or("key", &(0u8..32).collect::<Vec<_>>());
    let nonce_i: [u8; 32] = bytes_or("nonce_i", &(0x20u8..0x40).collect::<Vec<_>>()).try_into().unwrap();
    let nonce_l: [u8; 32] = bytes_or("nonce_l", &(0x40u8..0x60).collect::<Vec<_>>()).try_into().unwrap();
    let offer_i = Handshake::decode(&bytes_or("offer_i", &documented_offer(Role::Decode).encode().unwrap())).unwrap();
    let offer_l = Handshake::decode(&bytes_or("offer_l", &documented_offer(Role::Prefill).encode().unwrap())).unwrap();
    assert_eq!(offer_i, documented_offer(Role::Decode), "offer_i is the documented decode offer");
    assert_eq!(offer_l, documented_offer(Role::Prefill), "offer_l is the documented prefill offer");
    let address = get("address").unwrap_or_else(|| "127.0.0.1:5600".into());
    let (t_i_connect, t_i_challenge, t_i_offer) = (time("t_i_connect"), time("t_i_challenge"), time("t_i_offer"));
    let (t_l_accept, t_l_hello, t_l_offer) = (time("t_l_accept"), time("t_l_hello"), time("t_l_offer"));
    block.bytes("key", &key_bytes);
    block.bytes("nonce_i", &nonce_i);
    block.bytes("nonce_l", &nonce_l);
    block.bytes("offer_i", &offer_i.encode().unwrap());
    block.bytes("offer_l", &offer_l.encode().unwrap());
    block.text("address", &address);
    for (name, t) in [
        ("t_i_connect", t_i_connect),
        ("t_i_challenge", t_i_challenge),
        ("t_i_offer", t_i_offer),
        ("t_l_accept", t_l_accept),
        ("t_l_hello", t_l_hello),
        ("t_l_offer", t_l_offer),
    ] {
        block.text(name, t.as_nanos());
    }
    let key = || ClusterKey::from_bytes(&key_bytes).unwrap();

    // The initiator opens the connection; its HELLO.
    let mut initiator = SideEndpoint::new(SideConfig::new(key()), offer_i.clone()).unwrap();
    initiator.handle_connect(t_i_connect, ConnId(1), PeerAddress(address.clone()), nonce_i);
    let (frames, _) = drain(&mut initiator);
    let hello = frames[0].clone();
    block.bytes("hello", &hello);

    // The listener answers the recorded HELLO with its CHALLENGE.
    let mut listener = SideEndpoint::new(SideConfig::new(key()), offer_l.clone()).unwrap();
    listener.handle_accept(t_l_accept, ConnId(1), SOURCE, nonce_l);
    listener.handle_bytes(t_l_hello, ConnId(1), &bytes_or("hello", &hello));
    let (frames, _) = drain(&mut listener);
    let challenge = frames[0].clone();
    block.bytes("challenge", &challenge);

    // The initiator answers the recorded CHALLENGE with PROOF and its sealed OFFER.
    initiator.handle_bytes(t_i_challenge, ConnId(1), &bytes_or("challenge", &challenge));
    let (frames, _) = drain(&mut initiator);
    let (proof, offer_i_sealed) = (frames[0].clone(), frames[1].clone());
    block.bytes("proof", &proof);
    block.bytes("offer_i_sealed", &offer_i_sealed);

    // The listener takes the recorded PROOF and OFFER, and answers with its sealed OFFER.
    let mut stream = bytes_or("proof", &proof);
    stream.extend(bytes_or("offer_i_sealed", &offer_i_sealed));
    listener.handle_bytes(t_l_offer, ConnId(1), &stream);
    let (frames, listener_events) = drain(&mut listener);
    let offer_l_sealed = frames[0].clone();
    block.bytes("offer_l_sealed", &offer_l_sealed);

    // The initiator takes the recorded OFFER.
    initiator.handle_bytes(t_i_offer, ConnId(1), &bytes_or("offer_l_sealed", &offer_l_sealed));
    let (_, initiator_events) = drain(&mut initiator);
    block.text("listener_event", describe(&listener_events));
    block.text("initiator_event", describe(&initiator_events));

    // The intermediate values, recomputed from the document's description.
    let mut transcript = hello.clone();
    transcript.extend_from_slice(&challenge[..challenge.len() - 32]);
    let transcript_hash: [u8; 32] = Sha256::digest(&transcript).into();
    let mac_l = hmac(&key_bytes, &[b"kvflow-side-v1 listener", &transcript]);
    let mac_i = hmac(&key_bytes, &[b"kvflow-side-v1 initiator", &transcript, &mac_l]);
    let mut problems = Vec::new();
    let mut check = |ok: bool, what: &str| {
        if !ok {
            problems.push(what.to_owned());
        }
    };
    check(challenge.ends_with(&mac_l), "CHALLENGE ends with mac_l");
    check(proof.get(5..) == Some(&mac_i[..]), "PROOF carries mac_i");
    let mut salt = nonce_i.to_vec();
    salt.extend_from_slice(&nonce_l);
    let mut info = b"kvflow-side-v1 session".to_vec();
    info.extend_from_slice(&transcript_hash);
    let mut okm = [0u8; 160];
    Hkdf::<Sha256>::new(Some(&salt), &key_bytes).expand(&info, &mut okm).unwrap();
    block.bytes("transcript_sha256", &transcript_hash);
    block.bytes("mac_l", &mac_l);
    block.bytes("mac_i", &mac_i);
    for (i, name) in ["k_seal_i2l", "k_seal_l2i", "k_tag_i2l", "k_tag_l2i", "k_export"].iter().enumerate() {
        block.bytes(name, &okm[32 * i..32 * (i + 1)]);
    }
    // The TCP transport's data links: both ends derive one secret from k_export.
    let link = hmac(&okm[128..], &[b"kvflow-export-v1", b"kvflow-tcp-data-v2"]);
    block.bytes("link_tcp_data", &link);
    let link_mac = hmac(&link, &[b"kvflow-link-v1 listener", b"example transcript"]);
    for (end, peer) in [
        (&listener, AgentName::new(offer_i.engine.clone(), 1)),
        (&initiator, AgentName::new(offer_l.engine.clone(), 1)),
    ] {
        let secret = end.link_secret(&peer, "kvflow-tcp-data-v2");
        check(
            secret.is_some_and(|s| s.listener_mac(b"example transcript") == link_mac),
            "both ends derive link_tcp_data",
        );
    }

    // One data link of the TCP transport on this session, framed from the document's tables:
    // D connects to P's data listener asking for tagged DATA payloads, reads 16 bytes at the
    // start of P's region, and P answers with one DATA frame.
    let nonce_c: [u8; 32] = bytes_or("link_nonce_c", &(0x60u8..0x80).collect::<Vec<_>>()).try_into().unwrap();
    let nonce_link_l: [u8; 32] = bytes_or("link_nonce_l", &(0x80u8..0xa0).collect::<Vec<_>>()).try_into().unwrap();
    let head = |kind: u8, body_len: usize| [&(1 + body_len as u32).to_be_bytes()[..], &[kind]].concat();
    let link_hello = [
        &head(0x01, 50 + offer_i.engine.as_str().len())[..],
        b"KVTD",
        &[3, 1], // data protocol version 3; flags: tag the DATA payloads you send me
        &nonce_c,
        &offer_i.instance.to_le_bytes(),
        &offer_i.rank.to_le_bytes(),
        offer_i.engine.as_str().as_bytes(),
    ]
    .concat();
    // CHALLENGE's header counts its MAC; P asks for no WRITE payload tags.
    let link_transcript = [&link_hello[..], &head(0x84, 65), &nonce_link_l, &[0]].concat();
    let link_mac_l = hmac(&link, &[b"kvflow-link-v1 listener", &link_transcript]);
    let link_mac_c = hmac(&link, &[b"kvflow-link-v1 connector", &link_transcript, &link_mac_l]);
    let link_challenge = [&link_transcript[link_hello.len()..], &link_mac_l].concat();
    let link_proof = [&head(0x06, 32)[..], &link_mac_c].concat();
    let mut link_salt = nonce_c.to_vec();
    link_salt.extend_from_slice(&nonce_link_l);
    let mut link_info = b"kvflow-link-v1 keys".to_vec();
    link_info.extend_from_slice(&Sha256::digest(&link_transcript));
    let mut link_okm = [0u8; 64];
    Hkdf::<Sha256>::new(Some(&link_salt), &link).expand(&link_info, &mut link_okm).unwrap();
    let (k_c2l, k_l2c) = link_okm.split_at(32);
    let tag = |key: &[u8], counter: u64, covered: &[u8]| -> Vec<u8> {
        let mut nonce = [0u8; 12];
        nonce[4..].copy_from_slice(&counter.to_be_bytes());
        let cipher = ChaCha20Poly1305::new_from_slice(key).unwrap();
        cipher.encrypt_in_place_detached(&nonce.into(), covered, &mut []).unwrap().to_vec()
    };
    // READ: transfer 0, pairs from 0, one range; its tag is the connector's first.
    let range = (offer_l.regions[0].addr, 16u64);
    let read_frame = [
        &head(0x02, 32)[..],
        &0u64.to_le_bytes(),
        &0u32.to_le_bytes(),
        &1u32.to_le_bytes(),
        &range.0.to_le_bytes(),
        &range.1.to_le_bytes(),
    ]
    .concat();
    let link_read = [read_frame.clone(), tag(k_c2l, 0, &read_frame)].concat();
    // DATA: transfer 0, pair 0, offset 0, its tag, the 16 bytes, and their tag (the next).
    let data: Vec<u8> = (0u8..16).collect();
    let data_head =
        [&head(0x81, 20 + data.len())[..], &0u64.to_le_bytes(), &0u32.to_le_bytes(), &0u64.to_le_bytes()].concat();
    let link_data = [data_head.clone(), tag(k_l2c, 0, &data_head), data.clone(), tag(k_l2c, 1, &data)].concat();
    block.bytes("link_nonce_c", &nonce_c);
    block.bytes("link_nonce_l", &nonce_link_l);
    block.bytes("link_hello", &link_hello);
    block.bytes("link_challenge", &link_challenge);
    block.bytes("link_proof", &link_proof);
    block.bytes("link_k_c2l", k_c2l);
    block.bytes("link_k_l2c", k_l2c);
    block.bytes("link_read", &link_read);
    block.bytes("link_data", &link_data);
    // kv-core's links agree: P's secret for D (the listener's end), D's for P (the connector's).
    let p_end = listener.link_secret(&AgentName::new(offer_i.engine.clone(), offer_i.rank), "kvflow-tcp-data-v2");
    let d_end = initiator.link_secret(&AgentName::new(offer_l.engine.clone(), offer_l.rank), "kvflow-tcp-data-v2");
    match (p_end, d_end) {
        (Some(p_end), Some(d_end)) => {
            check(p_end.listener_mac(&link_transcript) == link_mac_l, "kv-core's listener makes link_challenge's MAC");
            check(
                d_end.verify_listener_mac(&link_transcript, &link_mac_l)
                    && p_end.verify_connector_mac(&link_transcript, &link_mac_l, &link_mac_c),
                "kv-core's ends verify the link MACs",
            );
            let (mut d_out, mut d_in) =
                d_end.frame_tags(LinkRole::Connector, &nonce_c, &nonce_link_l, &link_transcript);
            let (mut p_out, mut p_in) = p_end.frame_tags(LinkRole::Listener, &nonce_c, &nonce_link_l, &link_transcript);
            check(d_out.tag(&read_frame)[..] == link_read[read_frame.len()..], "kv-core tags link_read");
            check(p_in.verify(&read_frame, &link_read[read_frame.len()..]), "kv-core's listener takes link_read");
            check(
                p_out.tag(&data_head)[..] == tag(k_l2c, 0, &data_head)[..]
                    && p_out.tag(&data)[..] == tag(k_l2c, 1, &data)[..],
                "kv-core tags link_data and its payload",
            );
            check(
                d_in.verify(&data_head, &tag(k_l2c, 0, &data_head)) && d_in.verify(&data, &tag(k_l2c, 1, &data)),
                "kv-core's connector takes link_data",
            );
        }
        _ => check(false, "both ends hold a link secret"),
    }
    let plain_i = open(&okm[..32], 0, &offer_i_sealed);
    let plain_l = open(&okm[32..64], 0, &offer_l_sealed);
    block.bytes("offer_i_plaintext", &plain_i);
    block.bytes("offer_l_plaintext", &plain_l);
    let stamped = |mut offer: Handshake, at: Time| {
        offer.clock = at;
        let mut record = vec![1u8];
        record.extend(offer.encode().unwrap());
        record
    };
    check(plain_i == stamped(offer_i.clone(), t_i_challenge), "the initiator's OFFER record is its stamped offer");
    check(plain_l == stamped(offer_l.clone(), t_l_offer), "the listener's OFFER record is its stamped offer");

    // Notifications, one each way.
    let completion = Message::Completion { request: "cmpl-42-0".into(), expected_consumers: 2 }.encode().unwrap();
    let lease = LeaseState::Held(Time::from_nanos(5_030_003_000_000));
    let ack = Message::HeartbeatAck { renewals: vec![Renewal { request: "cmpl-42-0".into(), lease }] };
    let ack = ack.encode().unwrap();
    let (agent_i, agent_l) = (AgentName::new(offer_i.engine.clone(), 1), AgentName::new(offer_l.engine.clone(), 1));
    let notify_i2l = initiator.seal_notification(&agent_l, &completion).unwrap_or_default();
    let notify_l2i = listener.seal_notification(&agent_i, &ack).unwrap_or_default();
    block.bytes("notify_i2l_payload", &completion);
    block.bytes("notify_i2l", &notify_i2l);
    block.bytes("notify_l2i_payload", &ack);
    block.bytes("notify_l2i", &notify_l2i);
    check(
        listener.open_notification(&agent_i, &bytes_or("notify_i2l", &notify_i2l)) == Ok(completion.clone()),
        "the listener opens notify_i2l",
    );
    check(
        initiator.open_notification(&agent_l, &bytes_or("notify_l2i", &notify_l2i)) == Ok(ack.clone()),
        "the initiator opens notify_l2i",
    );
    for (sealed, key, payload) in [(&notify_i2l, &okm[64..96], &completion), (&notify_l2i, &okm[96..128], &ack)] {
        let mut expected = b"KT".to_vec();
        expected.extend_from_slice(&0u64.to_be_bytes());
        expected.extend_from_slice(payload);
        expected.extend_from_slice(&hmac(key, &[b"kvflow-notify-v1", &0u64.to_be_bytes(), payload])[..16]);
        check(*sealed == expected, "a notification is KT, seq, payload and the truncated tag");
    }

    // A push registration: D rank 1 of 2 registers the blocks after the two its prefix cache
    // holds, with a P of two pipeline stages.
    let registration = Message::PushRegistration(PushRegistration {
        request: "cmpl-42-0".into(),
        export: "cmpl-42-0-2f1c9e0a".into(),
        decode_engine: offer_i.engine.clone(),
        decode_rank: 1,
        decode_tp: 2,
        blocks: vec![BlockId(7), BlockId(8), BlockId(300)],
        first_block: 2,
        prefill_pp: 2,
        prompt: Prompt::of_tokens(&[1, 2, 3]),
    });
    let registration_frame = registration.encode().unwrap();
    block.bytes("push_registration", &registration_frame);
    check(
        Message::decode(&bytes_or("push_registration", &registration_frame)) == Ok(registration),
        "push_registration decodes to the documented registration",
    );

    // A claim: D names P's request, its own prompt (tokens 1, 2, 3) and the P blocks 7, 8 and
    // 300 it will read.
    let claim = Message::Claim(Claim {
        request: "cmpl-42-0".into(),
        prompt: Prompt::of_tokens(&[1, 2, 3]),
        blocks: Some(KvDigest::of_blocks(&[BlockId(7), BlockId(8), BlockId(300)])),
    });
    let claim_frame = claim.encode().unwrap();
    block.bytes("prompt_digest", &KvDigest::of_tokens(&[1, 2, 3]).0);
    block.bytes("blocks_digest", &KvDigest::of_blocks(&[BlockId(7), BlockId(8), BlockId(300)]).0);
    block.bytes("claim", &claim_frame);
    check(Message::decode(&bytes_or("claim", &claim_frame)) == Ok(claim), "claim decodes to the documented claim");
    let mut prompt_input = b"kvflow prompt v1".to_vec();
    for token in [1u32, 2, 3] {
        prompt_input.extend_from_slice(&token.to_le_bytes());
    }
    check(
        Sha256::digest(&prompt_input)[..16] == KvDigest::of_tokens(&[1, 2, 3]).0,
        "the prompt digest is SHA-256 of the domain and the tokens as u32 LE, cut to 16 bytes",
    );

    // A listener refuses a HELLO of side protocol version 3 with an ERROR naming both.
    let mut hello_v3 = hello.clone();
    hello_v3[9..11].copy_from_slice(&3u16.to_be_bytes());
    let mut refusing = SideEndpoint::new(SideConfig::new(key()), offer_l.clone()).unwrap();
    refusing.handle_accept(t_l_accept, ConnId(2), SOURCE, nonce_l);
    refusing.handle_bytes(t_l_hello, ConnId(2), &bytes_or("hello_v3", &hello_v3));
    let (frames, _) = drain(&mut refusing);
    block.bytes("hello_v3", &hello_v3);
    block.bytes("error_v3", &frames[0]);

    let rendered = block.render();
    let produced: BTreeMap<String, String> = block.0.iter().cloned().collect();
    let mismatched: Vec<&String> = produced.keys().filter(|name| doc.get(*name) != produced.get(*name)).collect();
    let unknown: Vec<&String> = doc.keys().filter(|name| !produced.contains_key(*name)).collect();
    assert!(
        mismatched.is_empty() && unknown.is_empty() && problems.is_empty(),
        "docs/side-channel.md's vectors disagree with the code at {mismatched:?} (unknown names {unknown:?}), \
         and these checks failed: {problems:?}; the code produces:\n{rendered}"
    );
}
