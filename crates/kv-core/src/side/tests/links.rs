//! Links bound to a session: both ends derive one secret, nobody else does, and a link's
//! challenge, response and frame tags hold against replay, reordering and other sessions.

use super::*;

/// P and D (incarnation 5) handshaked; and a second D (incarnation 6) that replaced the first.
fn established() -> Net {
    let mut net = Net::new(vec![prefill(), decode(5)]);
    net.connect(1, 0);
    net.run();
    net
}

#[test]
fn both_ends_of_a_session_get_one_secret_and_no_one_else_does() {
    let mut net = established();
    let at_p = net.eps[0].link_secret(&d_agent(), "kvflow-tcp-data-v2").expect("D is P's peer");
    let at_d = net.eps[1].link_secret(&p_agent(), "kvflow-tcp-data-v2").expect("P is D's peer");
    assert_eq!(at_p.incarnation(), 5);
    assert_eq!(at_d.incarnation(), 1);
    let transcript = b"a greeting and a challenge";
    assert_eq!(at_p.listener_mac(transcript), at_d.listener_mac(transcript), "one secret at both ends");
    let other_label = net.eps[0].link_secret(&d_agent(), "another protocol").unwrap();
    assert_ne!(other_label.listener_mac(transcript), at_p.listener_mac(transcript), "labels separate protocols");
    assert!(net.eps[0].link_secret(&p_agent(), "kvflow-tcp-data-v2").is_none(), "no session with itself");
    assert!(!format!("{at_p:?}").contains("key"), "Debug shows no key: {at_p:?}");

    // A newer incarnation of D handshakes: its session, and so its links, are new.
    net.eps.push(decode(6));
    net.events.push(Vec::new());
    net.connect(2, 0);
    net.run();
    let newer = net.eps[0].link_secret(&d_agent(), "kvflow-tcp-data-v2").unwrap();
    assert_eq!(newer.incarnation(), 6);
    assert_ne!(newer.listener_mac(transcript), at_d.listener_mac(transcript), "the old session's secret is gone");
}

#[test]
fn a_link_authenticates_both_ends_and_tags_frames_in_order() {
    let net = established();
    let at_p = net.eps[0].link_secret(&d_agent(), "x").unwrap();
    let at_d = net.eps[1].link_secret(&p_agent(), "x").unwrap();
    let transcript = b"greeting with nonce_c, challenge with nonce_l";
    let mac_l = at_p.listener_mac(transcript);
    assert!(at_d.verify_listener_mac(transcript, &mac_l));
    assert!(!at_d.verify_listener_mac(b"another transcript", &mac_l));
    let mac_c = at_d.connector_mac(transcript, &mac_l);
    assert!(at_p.verify_connector_mac(transcript, &mac_l, &mac_c));
    assert!(!at_p.verify_connector_mac(transcript, &mac_l, &mac_l), "the listener's MAC is not the connector's");

    let (nc, nl) = ([1u8; 32], [2u8; 32]);
    let (mut d_out, mut d_in) = at_d.frame_tags(LinkRole::Connector, &nc, &nl, transcript);
    let (mut p_out, mut p_in) = at_p.frame_tags(LinkRole::Listener, &nc, &nl, transcript);
    let (t0, t1) = (d_out.tag(b"READ 1"), d_out.tag(b"READ 2"));
    assert!(!p_in.verify(b"READ 2", &t1), "out of order");
    assert!(!p_in.verify(b"READ 1", &t1), "another frame's tag");
    assert!(!p_in.verify(b"READ 9", &t0), "altered bytes");
    assert!(p_in.verify(b"READ 1", &t0) && p_in.verify(b"READ 2", &t1));
    assert!(!p_in.verify(b"READ 2", &t1), "a replay");
    assert_eq!((d_out.count(), p_in.count()), (2, 2));
    let back = p_out.tag(b"DATA");
    assert!(!d_out.verify(b"DATA", &back), "directions have their own keys");
    assert!(d_in.verify(b"DATA", &back));

    // Other nonces give other keys, so a recorded link replays into nothing.
    let (mut other_out, _) = at_d.frame_tags(LinkRole::Connector, &nc, &[3u8; 32], transcript);
    let (_, mut fresh_in) = at_p.frame_tags(LinkRole::Listener, &nc, &nl, transcript);
    assert!(!fresh_in.verify(b"READ 1", &other_out.tag(b"READ 1")));
    // A secret of another session (another cluster key) makes other tags.
    let mut stranger = Net::new(vec![
        endpoint(ClusterKey::from_bytes(&[9; 32]).unwrap(), p_offer()),
        endpoint(ClusterKey::from_bytes(&[9; 32]).unwrap(), d_offer(5)),
    ]);
    stranger.connect(1, 0);
    stranger.run();
    let foreign = stranger.eps[1].link_secret(&p_agent(), "x").unwrap();
    assert!(!at_p.verify_connector_mac(transcript, &mac_l, &foreign.connector_mac(transcript, &mac_l)));
}
