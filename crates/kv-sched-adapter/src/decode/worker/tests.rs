//! Unit tests of the decode worker; the scenarios and random seeds of kv-testkit drive the rest of it.

use crate::PrefillEngine;
use kv_core::{EngineId, KvLayout, PeerAddress, PoolShape, RegionBase, Renewal, Role, Time};

use crate::DecodeScheduler;

use super::*;

fn pool(tp: u32) -> LocalPool {
    let layout = KvLayout::split_kv(2, 16, 4, 8, kv_core::Dtype::Bfloat16);
    let shape = PoolShape::new(layout, layout.kv_heads / tp, 8).unwrap();
    LocalPool { shape, regions: vec![RegionBase { addr: 0x10_0000, len: shape.pool_bytes() }] }
}

fn worker(tp: u32) -> DecodeWorker {
    let pool = pool(tp);
    let offer = pool.offer(&AgentName::new(EngineId::new("decode0"), 0), tp, 1, Role::Decode, "m");
    DecodeWorker::new(offer, Config::default(), pool).unwrap()
}

#[test]
fn a_worker_is_refused_when_its_offer_or_settings_disagree_naming_the_values() {
    let check = |tp: u32, change: &dyn Fn(&mut Handshake, &mut Config), expected: &str| {
        let pool = pool(tp);
        let mut offer = pool.offer(&AgentName::new(EngineId::new("decode0"), 0), tp, 1, Role::Decode, "m");
        let mut config = Config::default();
        change(&mut offer, &mut config);
        let err = DecodeWorker::new(offer, config, pool).unwrap_err().to_string();
        assert_eq!(err, expected);
    };
    check(2, &|o, _| o.num_blocks = 0, "the handshake offer's num_blocks is 0, but the pool's is 8");
    check(
        2,
        &|o, _| o.role = Role::Prefill,
        "the handshake offer's role is Prefill, but the pool's is Decode (the worker's)",
    );
    check(
        2,
        &|o, _| o.tp_size = 4,
        "the handshake offer's tp_size is 4, but the pool's is 2 heads a rank, 1 at tp_size 4",
    );
    check(2, &|o, _| o.rank = 2, "the handshake offer's rank is 2, but the pool's is below tp_size 2 x pp_size 1");
    check(2, &|o, _| o.pp_size = 2, "the handshake offer's pp_size is stage 0 of 2, but the pool's is layers 0..2");
    check(
        2,
        &|o, _| o.regions.clear(),
        "the handshake offer's regions is [], but the pool's is [RegionBase { addr: 1048576, len: 16384 }]",
    );
    check(1, &|_, c| c.kv_lease_duration = std::time::Duration::ZERO, "kv_lease_duration must be positive, not 0");
    assert!(DecodeScheduler::new(EngineId::new("decode0"), 0, Config::default())
        .is_err_and(|e| e.to_string().contains("got 0")));
}

fn remote(tp_size: u32, addresses: usize) -> RemoteRef {
    RemoteRef {
        prefill: PrefillEngine {
            engine: EngineId::new("prefill0"),
            addresses: (0..addresses).map(|i| PeerAddress(format!("127.0.0.1:{}", 5600 + i))).collect(),
            tp_size,
            pp_size: 1,
        },
        request: RequestId::new("r1"),
        instance: Some(1),
        prompt_tokens: 16,
        prompt_digest: None,
        export: None,
        consumer: None,
    }
}

#[test]
fn a_rejection_that_maps_onto_no_p_rank_is_counted_not_dropped_silently() {
    let mut w = worker(2);
    // P at TP 3 does not divide D's TP 2; and P at TP 2 with one address lacks rank 1's.
    w.handle_command(Time::ZERO, DecodeCommand::Reject { remote: remote(3, 3) });
    assert_eq!(w.counters().rejections_unsent, 1);
    w.handle_command(Time::ZERO, DecodeCommand::Reject { remote: remote(2, 1) });
    assert_eq!(w.counters().rejections_unsent, 1, "rank 0 of D maps onto P's rank 0, which has an address");
    // A rejection that maps goes out: D connects to P's rank to send it.
    assert!(std::iter::from_fn(|| w.poll_action()).any(|a| matches!(a, Action::Connect(_))));
}

#[test]
fn a_partial_prefix_hit_loads_in_either_mode_and_too_many_cached_is_refused() {
    let blocks = || vec![BlockId(0), BlockId(1), BlockId(2)];
    let scheduled = |mode: Mode, cached: usize| {
        let mut d = DecodeScheduler::new(EngineId::new("decode0"), 1, Config { mode, ..Config::default() }).unwrap();
        let export = crate::ExportInfo { blocks: blocks(), deadline: Time::from_millis(30_000), finished: None };
        let remote = RemoteRef { export: Some(export), ..remote(1, 1) };
        d.handle_arrive(RequestId::new("r1"), remote, Prompt::len_only(16)).unwrap();
        d.handle_schedule_cached(RequestId::new("r1"), blocks(), cached).map_err(|e| e.to_string())
    };
    assert_eq!(scheduled(Mode::Pull, 2), Ok(()));
    assert_eq!(scheduled(Mode::Pull, 4), Err("request r1: 4 blocks cached, but only 3 allocated".to_owned()));
    // Push registers the blocks after the cached ones, and P writes those.
    assert_eq!(scheduled(Mode::Push, 1), Ok(()));
    assert_eq!(scheduled(Mode::Push, 3), Ok(()));
    assert_eq!(scheduled(Mode::Push, 0), Ok(()));
}

/// In pull mode D asks for its own list and a P rank's as soon as that rank connects, so the
/// first load from it names blocks by index like every other; push mode reads nothing.
#[test]
fn pull_prepares_the_descriptor_lists_when_a_p_rank_connects_not_at_its_first_read() {
    let prepares = |mode: Mode| {
        let pool = pool(1);
        let offer = pool.offer(&AgentName::new(EngineId::new("decode0"), 0), 1, 1, Role::Decode, "m");
        let mut d = DecodeWorker::new(offer, Config { mode, ..Config::default() }, pool.clone()).unwrap();
        let p = AgentName::new(EngineId::new("prefill0"), 0);
        let p_pool = LocalPool { regions: vec![RegionBase { addr: 0x90_0000, len: pool.shape.pool_bytes() }], ..pool };
        let handshake = p_pool.offer(&p, 1, 1, Role::Prefill, "m");
        let info = kv_core::PeerInfo {
            agent: p.clone(),
            handshake,
            sent_at: Time::ZERO,
            received_at: Time::ZERO,
            dialed: Some(PeerAddress("127.0.0.1:5600".into())),
        };
        d.handle_peer_event(Time::ZERO, PeerEvent::Connected(Box::new(info)));
        std::iter::from_fn(|| d.poll_action())
            .filter_map(|a| match a {
                Action::Prepare { peer, ranges, .. } => Some((peer, ranges.len())),
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    // 8 blocks of 2 layers' K and V: one entry per block and descriptor group on each side.
    let entries = pool(1).shape.block_descriptors(&[0x10_0000]).len();
    assert_eq!(
        prepares(Mode::Pull),
        vec![(None, entries), (Some(AgentName::new(EngineId::new("prefill0"), 0)), entries)]
    );
    assert_eq!(prepares(Mode::Push), Vec::new());
}

/// D's first message about an export is a claim naming its own prompt and the P blocks the
/// handoff says it reads; it claims again at each beat until P answers `Held`, and only renews
/// after. P's refusal (another prompt, other blocks) fails the load, counted.
#[test]
fn d_claims_until_p_holds_the_export_and_a_refusal_fails_the_load() {
    let pool = pool(1);
    let offer = pool.offer(&AgentName::new(EngineId::new("decode0"), 0), 1, 1, Role::Decode, "m");
    let config = Config::default();
    let mut d = DecodeWorker::new(offer, config, pool.clone()).unwrap();
    let p = AgentName::new(EngineId::new("prefill0"), 0);
    let p_pool = LocalPool { regions: vec![RegionBase { addr: 0x90_0000, len: pool.shape.pool_bytes() }], ..pool };
    let info = kv_core::PeerInfo {
        agent: p.clone(),
        handshake: p_pool.offer(&p, 1, 1, Role::Prefill, "m"),
        sent_at: Time::ZERO,
        received_at: Time::ZERO,
        dialed: Some(PeerAddress("127.0.0.1:5600".into())),
    };
    d.handle_peer_event(Time::ZERO, PeerEvent::Connected(Box::new(info)));
    let sent = |d: &mut DecodeWorker| {
        std::iter::from_fn(|| d.poll_action())
            .filter_map(|a| match a {
                Action::Send { payload, .. } => Message::decode(&payload).ok(),
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    sent(&mut d);
    let p_blocks = vec![BlockId(4), BlockId(5)];
    let export = crate::ExportInfo { blocks: p_blocks.clone(), deadline: Time::from_millis(30_000), finished: None };
    let prompt = Prompt::of_tokens(&[9; 16]);
    let track = |id: &str| DecodeCommand::Track {
        request: RequestId::new(id),
        remote: Box::new(RemoteRef {
            request: RequestId::new(id),
            export: Some(export.clone()),
            prompt_tokens: 16,
            ..remote(1, 1)
        }),
        prompt,
    };
    d.handle_command(Time::ZERO, track("r1"));
    d.handle_command(Time::ZERO, track("r2"));
    let expected = |id: &str| {
        Message::Claim(Claim { request: RequestId::new(id), prompt, blocks: Some(Digest::of_blocks(&p_blocks)) })
    };
    assert_eq!(sent(&mut d), [expected("r1"), expected("r2")]);

    // P holds r1 for this engine; r2's answer is lost: the next beat renews r1, claims r2 again.
    let held = Renewal { request: RequestId::new("r1"), lease: LeaseState::Held(Time::from_millis(40_000)) };
    let ack = Message::HeartbeatAck { renewals: vec![held] }.encode().unwrap();
    d.handle_notification(Time::from_millis(10), Notification { from: p.clone(), payload: ack });
    let beat = Time::ZERO + config.heartbeat_interval;
    d.handle_timeout(beat);
    let messages = sent(&mut d);
    assert!(messages.contains(&expected("r2")), "{messages:?}");
    assert!(messages.contains(&Message::Heartbeat { requests: vec![RequestId::new("r1")] }), "{messages:?}");

    // P refuses r2's claim: the load fails at once, and the refusal is counted.
    let refused = Renewal { request: RequestId::new("r2"), lease: LeaseState::Refused };
    let ack = Message::HeartbeatAck { renewals: vec![refused] }.encode().unwrap();
    d.handle_notification(beat, Notification { from: p, payload: ack });
    let reports: Vec<_> = std::iter::from_fn(|| d.poll_action())
        .filter_map(|a| match a {
            Action::Report(DecodeReport::Finished { request, outcome, .. }) => Some((request, outcome)),
            _ => None,
        })
        .collect();
    assert_eq!(reports, [(RequestId::new("r2"), LoadOutcome::Failed)]);
    assert_eq!(d.counters().claims_refused, 1);
}
