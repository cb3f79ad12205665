//! Unit tests of the decode worker; the scenarios and random seeds of kv-testkit drive the rest of it.

use kv_core::{EngineId, KvLayout, PeerAddress, PoolShape, Role, Time};

use super::*;

fn worker(tp: u32) -> DecodeWorker {
    let layout = KvLayout::split_kv(2, 16, 4, 8, 2);
    let shape = PoolShape::new(layout, layout.kv_heads / tp, 8).unwrap();
    let offer = Handshake {
        protocol_version: kv_core::wire::PROTOCOL_VERSION,
        engine: EngineId::new("decode0"),
        rank: 0,
        tp_size: tp,
        instance: 1,
        role: Role::Decode,
        model: "m".into(),
        layout,
        num_blocks: 8,
        regions: Vec::new(),
        compat_hash: kv_core::wire::compatibility_hash("m", &layout),
        clock: Time::ZERO,
        agent_metadata: Vec::new(),
    };
    DecodeWorker::new(offer, Config::default(), LocalPool { shape, regions: Vec::new() })
}

fn remote(tp_size: u32, addresses: usize) -> RemoteRef {
    RemoteRef {
        engine: EngineId::new("prefill0"),
        request: RequestId::new("r1"),
        addresses: (0..addresses).map(|i| PeerAddress(format!("127.0.0.1:{}", 5600 + i))).collect(),
        tp_size,
        instance: 1,
        prompt_tokens: 16,
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
