//! An engine refuses workers that do not match its scheduler's ranks, naming both counts.

use std::sync::Arc;

use kv_core::{AgentName, EngineId, KvLayout, PeerAddress, PoolShape, RegionBase, Role};
use kv_engine::{Engine, EngineError, ProcessClock};
use kv_sched_adapter::{Config, LocalPool, PrefillScheduler, PrefillWorker};
use kv_testkit::{FakeHeap, FakeNetwork, ManualClock, NetConfig};

#[test]
fn an_engine_given_fewer_workers_than_its_scheduler_drives_is_refused() {
    let layout = KvLayout::split_kv(2, 16, 4, 8, kv_core::Dtype::Bfloat16);
    let shape = PoolShape::new(layout, layout.kv_heads, 8).unwrap();
    let pool = LocalPool { shape, regions: vec![RegionBase { addr: 0x10_0000, len: shape.pool_bytes() }] };
    let agent = AgentName::new(EngineId::new("prefill0"), 0);
    let offer = pool.offer(&agent, 1, 1, Role::Prefill, "m");
    let net = FakeNetwork::new(1, ManualClock::default(), NetConfig::default());
    let transport =
        net.transport(agent, PeerAddress("p0".into()), FakeHeap::with_base(0x10_0000), offer.clone()).unwrap();
    let worker = PrefillWorker::new(offer.clone(), Config::default(), pool).unwrap();
    let addresses = vec![PeerAddress("p0".into()), PeerAddress("p1".into())];
    let scheduler = PrefillScheduler::new(&offer, addresses, Config::default()).unwrap();
    let started = Engine::start(
        scheduler,
        vec![(worker, Box::new(transport) as Box<dyn kv_core::Transport>)],
        Arc::new(ProcessClock::start()),
    );
    let err = started.err().expect("two ranks driven, one given");
    assert!(matches!(err, EngineError::Ranks { scheduler: 2, given: 1 }), "{err}");
    assert_eq!(err.to_string(), "the scheduler drives 2 ranks, but the engine was given 1");
}
