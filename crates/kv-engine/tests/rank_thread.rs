//! A rank's thread: the scheduler's commands reach the worker in order and are carried out at
//! once, each seen first by the observer; discovery's losses reach it; its reports come back
//! and unpark the engine; dropping it stops the thread.

use std::collections::VecDeque;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kv_core::{
    AgentName, Attention, Descriptors, EngineId, KvLayout, MemoryOrder, PeerAddress, PeerEvent, Placement, PreparedId,
    Role, Time, TransportError,
};
use kv_engine::{ProcessClock, RankOptions, RankThread};
use kv_sched_adapter::driver::{WorkerDriver, WorkerMachine};
use kv_sched_adapter::{Action, Counters, XferToken};
use kv_testkit::{offer, FakeHeap, FakeNetwork, ManualClock, NetConfig};

/// A worker that reports each command back, times ten, and each engine lost as 1000 plus its
/// incarnation.
#[derive(Default)]
struct Echo {
    out: VecDeque<Action<u64>>,
}

impl WorkerMachine for Echo {
    type Report = u64;
    type Command = u64;
    fn handle_command(&mut self, _: Time, command: u64) {
        self.out.push_back(Action::Report(command * 10));
    }
    fn handle_peer_event(&mut self, _: Time, _: PeerEvent) {}
    fn handle_transfer(&mut self, _: Time, _: XferToken, _: bool) {}
    fn handle_prepared(&mut self, _: Time, _: XferToken, _: Result<PreparedId, TransportError>) {}
    fn handle_timeout(&mut self, _: Time) {}
    fn handle_engine_lost(&mut self, _: Time, _: &EngineId, instance: u64) {
        self.out.push_back(Action::Report(1000 + instance));
    }
    fn poll_action(&mut self) -> Option<Action<u64>> {
        self.out.pop_front()
    }
    fn poll_timeout(&mut self) -> Option<Time> {
        None
    }
    fn awaits_peers(&self) -> bool {
        false
    }
    fn counters(&self) -> Counters {
        Counters::default()
    }
    fn connected_peers(&self) -> usize {
        0
    }
    fn heartbeat_interval(&self) -> Duration {
        Duration::from_secs(5)
    }
    fn use_descriptors(&mut self, _: Descriptors) {}
}

#[test]
fn commands_and_losses_reach_the_worker_in_order_and_reports_come_back() {
    let net = FakeNetwork::new(1, ManualClock::default(), NetConfig::default());
    let agent = AgentName::new(EngineId::new("prefill0"), 0);
    let layout = KvLayout {
        layers: 1,
        block_tokens: 16,
        kv_heads: 1,
        head_dim: 8,
        dtype: kv_core::Dtype::Bfloat16,
        attention: Attention::SplitKv,
        order: MemoryOrder::Hnd,
        placement: Placement::BlockMajor,
    };
    let transport = net
        .transport(
            agent.clone(),
            PeerAddress("prefill0".into()),
            FakeHeap::with_base(0x1000),
            offer(&agent, Role::Prefill, 1, layout),
        )
        .expect("a transport");
    let driver = WorkerDriver::new(Echo::default(), Box::new(transport));
    let seen = Arc::new(Mutex::new(Vec::new()));
    let observed = seen.clone();
    let options = RankOptions {
        observer: Some(Box::new(move |c: &u64| observed.lock().unwrap().push(*c))),
        ..RankOptions::default()
    };
    let (tx, reports) = mpsc::channel();
    let rank = RankThread::spawn(3, driver, Arc::new(ProcessClock::start()), tx, std::thread::current(), options)
        .expect("the rank's thread");
    rank.send(1);
    rank.send(2);
    rank.engine_lost(&EngineId::new("decode0"), 7);
    rank.send(4);
    let got: Vec<(u32, u64)> =
        (0..4).map(|_| reports.recv_timeout(Duration::from_secs(5)).expect("a report within 5 s")).collect();
    assert_eq!(got, [(3, 10), (3, 20), (3, 1007), (3, 40)]);
    assert_eq!(*seen.lock().unwrap(), [1, 2, 4], "the observer sees each command, not the losses");
    assert_eq!(rank.status().connected, 0);
    drop(rank);
    // The thread is gone with its end of the channel: nothing more comes, and the channel says so.
    assert!(matches!(reports.recv_timeout(Duration::from_secs(5)), Err(mpsc::RecvTimeoutError::Disconnected)));
}
