//! The calls `WorkerDriver` makes on its transport, checked against a `mockall` mock of the
//! port, with a scripted machine in place of P's or D's worker.

use std::collections::VecDeque;
use std::task::Waker;
use std::time::Duration;

use kv_core::{
    AgentName, EngineId, PeerAddress, PollIntervals, PreparedTransfer, Region, RegionId, TransferOp, TransferRequest,
};
use mockall::{predicate::eq, Sequence};

use super::*;

mockall::mock! {
    Port {}
    impl Transport for Port {
        fn agent(&self) -> &AgentName;
        fn register(&mut self, region: &Region) -> Result<(), TransportError>;
        fn deregister(&mut self, region: RegionId) -> Result<(), TransportError>;
        fn connect(&mut self, address: &PeerAddress) -> Result<(), TransportError>;
        fn post(&mut self, request: TransferRequest) -> Result<TransferId, TransportError>;
        fn prepare<'a>(&mut self, peer: Option<&'a AgentName>, ranges: &[(u64, u64)]) -> Result<PreparedId, TransportError>;
        fn post_prepared(&mut self, request: PreparedTransfer) -> Result<TransferId, TransportError>;
        fn poll_transfer(&mut self, id: TransferId) -> TransferStatus;
        fn send_notification(&mut self, peer: &AgentName, payload: &[u8]) -> Result<(), TransportError>;
        fn poll_event(&mut self) -> Option<PeerEvent>;
        fn disconnect(&mut self, peer: &AgentName);
        fn set_waker(&mut self, waker: Waker);
        fn poll_intervals(&self) -> PollIntervals;
    }
}

/// A machine that asks for what the test scripts, and records what it is told.
#[derive(Default)]
struct Script {
    actions: VecDeque<Action<&'static str>>,
    deadline: Option<Time>,
    awaits_peers: bool,
    told: Vec<String>,
}

impl WorkerMachine for Script {
    type Report = &'static str;
    fn handle_peer_event(&mut self, _: Time, event: PeerEvent) {
        self.told.push(match event {
            PeerEvent::Lost(agent) => format!("lost {agent}"),
            PeerEvent::ConnectFailed { address, .. } => format!("connect to {address} failed"),
            other => format!("{other:?}"),
        });
    }
    fn handle_notification(&mut self, _: Time, notification: Notification) {
        self.told.push(format!("{notification:?}"));
    }
    fn handle_transfer(&mut self, _: Time, token: XferToken, ok: bool) {
        self.told.push(format!("transfer {} ok={ok}", token.0));
    }
    fn handle_prepared(&mut self, _: Time, token: XferToken, result: Result<PreparedId, TransportError>) {
        self.told.push(format!("prepared {} {result:?}", token.0));
    }
    fn handle_timeout(&mut self, _: Time) {}
    fn handle_engine_lost(&mut self, _: Time, engine: &EngineId, instance: u64) {
        self.told.push(format!("engine {engine}#{instance} lost"));
        // As P's and D's workers do: drop the lost engine's agents still connected.
        self.actions.push_back(Action::Disconnect(AgentName::new(engine.clone(), 0)));
    }
    fn poll_action(&mut self) -> Option<Action<&'static str>> {
        self.actions.pop_front()
    }
    fn poll_timeout(&mut self) -> Option<Time> {
        self.deadline
    }
    fn awaits_peers(&self) -> bool {
        self.awaits_peers
    }
    fn counters(&self) -> Counters {
        Counters::default()
    }
    fn connected_peers(&self) -> usize {
        0
    }
    fn use_descriptors(&mut self, _: kv_core::Descriptors) {}
}

fn p0() -> AgentName {
    AgentName::new(EngineId::new("prefill0"), 0)
}

fn read(token: u64) -> Action<&'static str> {
    let request = TransferRequest { op: TransferOp::Read, peer: p0(), pairs: Vec::new(), notification: None };
    Action::Post { token: XferToken(token), request }
}

/// The port with an agent name for the driver's spans.
fn port() -> MockPort {
    let mut port = MockPort::new();
    port.expect_agent().return_const(p0());
    port
}

const NIXL_LIKE: PollIntervals =
    PollIntervals { transfers: Some(Duration::from_micros(50)), notifications: Some(Duration::from_millis(2)) };

#[test]
fn a_step_polls_events_then_in_flight_transfers_and_reports_each_ending_once() {
    let mut port = port();
    let mut order = Sequence::new();
    port.expect_post().times(1).in_sequence(&mut order).returning(|_| Ok(TransferId(7)));
    let lost = PeerEvent::Lost(p0());
    port.expect_poll_event().times(1).in_sequence(&mut order).return_once(move || Some(lost));
    port.expect_poll_event().times(1).in_sequence(&mut order).returning(|| None);
    port.expect_poll_transfer()
        .with(eq(TransferId(7)))
        .times(1)
        .in_sequence(&mut order)
        .returning(|_| TransferStatus::Done);
    port.expect_poll_event().times(1).in_sequence(&mut order).returning(|| None);
    let mut driver = WorkerDriver::new(Script { actions: [read(1)].into(), ..Script::default() }, Box::new(port));
    driver.flush(Time::ZERO);
    assert_eq!(driver.in_flight(), 1);
    driver.step(Time::ZERO);
    // Done is reported once: the next step does not ask about the transfer again.
    driver.step(Time::ZERO);
    assert_eq!(driver.in_flight(), 0);
    assert_eq!(driver.machine_ref().told, ["lost prefill0/tp0", "transfer 1 ok=true"]);
}

#[test]
fn an_engine_lost_by_discovery_comes_after_what_the_transport_queued_and_its_agents_are_disconnected() {
    let mut port = port();
    let mut order = Sequence::new();
    let note = PeerEvent::Notification(Notification { from: p0(), payload: vec![7] });
    port.expect_poll_event().times(1).in_sequence(&mut order).return_once(move || Some(note));
    port.expect_poll_event().times(1).in_sequence(&mut order).returning(|| None);
    port.expect_disconnect().with(eq(p0())).times(1).in_sequence(&mut order).return_const(());
    let mut driver = WorkerDriver::new(Script::default(), Box::new(port));
    let reports = driver.engine_lost(Time::ZERO, &EngineId::new("prefill0"), 3);
    assert!(reports.is_empty());
    let told = &driver.machine_ref().told;
    assert_eq!(told.len(), 2, "{told:?}");
    assert!(told[0].contains("Notification"), "what was queued comes first: {told:?}");
    assert_eq!(told[1], "engine prefill0#3 lost");
}

#[test]
fn a_refused_post_or_connect_is_told_to_the_machine_at_once() {
    let mut port = port();
    port.expect_post().times(1).returning(|r| Err(TransportError::UnknownPeer(r.peer)));
    port.expect_connect().times(1).returning(|_| Err(TransportError::Backend("no route".into())));
    let actions = [read(3), Action::Connect(PeerAddress("10.0.0.9:5600".into()))].into();
    let mut driver = WorkerDriver::new(Script { actions, ..Script::default() }, Box::new(port));
    driver.flush(Time::ZERO);
    assert_eq!(driver.in_flight(), 0);
    assert_eq!(driver.machine_ref().told, ["transfer 3 ok=false", "connect to 10.0.0.9:5600 failed"]);
}

#[test]
fn the_wait_time_is_the_deadline_bounded_by_what_the_transport_cannot_signal() {
    let now = Time::from_millis(1_000);
    let check = |in_flight: bool, awaits_peers: bool, deadline_ms: Option<u64>, expected: Option<Duration>| {
        let mut port = port();
        port.expect_poll_intervals().return_const(NIXL_LIKE);
        port.expect_post().returning(|_| Ok(TransferId(1)));
        let actions = if in_flight { [read(1)].into() } else { VecDeque::new() };
        let deadline = deadline_ms.map(|ms| now + Duration::from_millis(ms));
        let mut driver =
            WorkerDriver::new(Script { actions, deadline, awaits_peers, ..Script::default() }, Box::new(port));
        driver.flush(now);
        let got = driver.wait_time(now);
        assert_eq!(got, expected, "in flight {in_flight}, awaits peers {awaits_peers}, deadline {deadline_ms:?}");
    };
    check(false, false, None, None);
    check(false, false, Some(30), Some(Duration::from_millis(30)));
    check(false, true, Some(30), Some(Duration::from_millis(2)));
    check(false, true, Some(1), Some(Duration::from_millis(1)));
    check(true, false, None, Some(Duration::from_micros(50)));
    check(true, true, Some(30), Some(Duration::from_micros(50)));
    // A deadline already passed: no wait at all.
    check(false, false, Some(0), Some(Duration::ZERO));
}

#[test]
fn the_waker_goes_to_the_transport() {
    let mut port = MockPort::new();
    port.expect_set_waker().times(1).return_const(());
    port.expect_agent().return_const(p0());
    let mut driver = WorkerDriver::new(Script::default(), Box::new(port));
    driver.set_waker(thread_waker());
}
