//! The calls `WorkerDriver` makes on its transport, checked against a `mockall` mock of the
//! port, with a scripted machine in place of P's or D's worker.

use std::collections::VecDeque;
use std::task::Waker;
use std::time::Duration;

use kv_core::{
    AgentName, EngineId, Handshake, KvLayout, Notification, PeerAddress, PeerInfo, PollIntervals, PreparedTransfer,
    Region, RegionId, Role, TransferOp, TransferRequest,
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
    /// The heartbeat interval, if not the default 5 s.
    heartbeat: Option<Duration>,
}

impl WorkerMachine for Script {
    type Report = &'static str;
    /// The scheduler's command: an action for the machine to ask for.
    type Command = Action<&'static str>;
    fn handle_command(&mut self, _: Time, command: Action<&'static str>) {
        self.told.push("command".into());
        self.actions.push_back(command);
    }
    fn handle_peer_event(&mut self, _: Time, event: PeerEvent) {
        self.told.push(match event {
            PeerEvent::Lost(agent) => format!("lost {agent}"),
            PeerEvent::ConnectFailed { address, .. } => format!("connect to {address} failed"),
            other => format!("{other:?}"),
        });
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
    fn heartbeat_interval(&self) -> Duration {
        self.heartbeat.unwrap_or(Duration::from_secs(5))
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
fn a_command_is_carried_out_at_once_not_at_the_next_step() {
    let mut port = port();
    port.expect_post().times(1).returning(|_| Ok(TransferId(9)));
    // No step: the transport is never polled, yet the read is posted and the report is back.
    port.expect_poll_event().never();
    port.expect_poll_transfer().never();
    let mut driver = WorkerDriver::new(Script::default(), Box::new(port));
    assert_eq!(driver.command(Time::ZERO, read(4)), Vec::<&str>::new());
    assert_eq!(driver.in_flight(), 1, "the command's read is posted by the call itself");
    assert_eq!(driver.command(Time::ZERO, Action::Report("loaded")), ["loaded"]);
    assert_eq!(driver.machine_ref().told, ["command", "command"]);
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

fn p1() -> AgentName {
    AgentName::new(EngineId::new("prefill0"), 1)
}

fn send(to: AgentName, byte: u8) -> Action<&'static str> {
    Action::Send { to, payload: vec![byte] }
}

fn refused() -> TransportError {
    TransportError::Backend("UCX could not queue it".into())
}

/// A port that answers every poll with nothing, for the steps of a test about sends.
fn quiet_port() -> MockPort {
    let mut port = port();
    port.expect_poll_event().returning(|| None);
    port.expect_poll_intervals().return_const(NIXL_LIKE);
    port
}

#[test]
fn a_refused_notification_is_counted_and_sent_again_when_due_with_what_followed_behind_it() {
    let mut port = quiet_port();
    let mut order = Sequence::new();
    let first = |to: AgentName, byte: u8| move |peer: &AgentName, payload: &[u8]| *peer == to && payload == [byte];
    port.expect_send_notification()
        .withf(first(p0(), 1))
        .times(1)
        .in_sequence(&mut order)
        .returning(|_, _| Err(refused()));
    // Another peer's notification is not held up.
    port.expect_send_notification().withf(first(p1(), 3)).times(1).in_sequence(&mut order).returning(|_, _| Ok(()));
    // At the resend, the refused one goes first, then the one that waited behind it.
    port.expect_send_notification().withf(first(p0(), 1)).times(1).in_sequence(&mut order).returning(|_, _| Ok(()));
    port.expect_send_notification().withf(first(p0(), 2)).times(1).in_sequence(&mut order).returning(|_, _| Ok(()));
    let actions = [send(p0(), 1), send(p0(), 2), send(p1(), 3)].into();
    let mut driver = WorkerDriver::new(Script { actions, ..Script::default() }, Box::new(port));
    let t0 = Time::from_millis(1_000);
    driver.flush(t0);
    assert_eq!(driver.notifications(), NotificationStats { failed: 1, resent: 0, given_up: 0 });
    assert_eq!(driver.resends_waiting(), 2);
    // The engine is woken for the resend, and not before.
    assert_eq!(driver.poll_timeout(), Some(t0 + FIRST_RESEND_DELAY));
    assert_eq!(driver.wait_time(t0), Some(FIRST_RESEND_DELAY));
    driver.step(t0 + FIRST_RESEND_DELAY / 2);
    driver.step(t0 + FIRST_RESEND_DELAY);
    assert_eq!(driver.notifications(), NotificationStats { failed: 1, resent: 1, given_up: 0 });
    assert_eq!(driver.resends_waiting(), 0);
    assert_eq!(driver.wait_time(t0 + FIRST_RESEND_DELAY), None, "nothing left to send");
}

/// Refuses every send; steps the driver at each resend it asks for, for `window`; returns the
/// tries the transport saw and the driver's counts.
fn refused_throughout(window: Duration) -> (usize, NotificationStats) {
    let tries = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = tries.clone();
    let mut port = quiet_port();
    port.expect_send_notification().returning(move |_, _| {
        seen.lock().unwrap().push(());
        Err(refused())
    });
    let script = Script { actions: [send(p0(), 1)].into(), heartbeat: Some(window), ..Script::default() };
    let mut driver = WorkerDriver::new(script, Box::new(port));
    driver.flush(Time::ZERO);
    let mut steps = 0;
    while let Some(due) = driver.poll_timeout() {
        driver.step(due);
        steps += 1;
        assert!(steps < 100, "resends never end");
    }
    let tries = tries.lock().unwrap().len();
    (tries, driver.notifications())
}

#[test]
fn a_notification_refused_again_and_again_is_given_up_within_its_tries_and_its_heartbeat_interval() {
    let check = |window_ms: u64, expected_tries: usize| {
        let (tries, stats) = refused_throughout(Duration::from_millis(window_ms));
        assert_eq!(tries, expected_tries, "window {window_ms} ms");
        let failed = expected_tries as u64;
        assert_eq!(stats, NotificationStats { failed, resent: 0, given_up: 1 }, "window {window_ms} ms");
    };
    // A long heartbeat interval: every try, 10 ms apart and doubling, the last 2.55 s after the first.
    check(60_000, MAX_SEND_ATTEMPTS as usize);
    // A short one ends them first: tries at 0, 10, 30 and 70 ms; at 150 ms it has passed.
    check(100, 4);
    check(10, 1);
}

#[test]
fn nothing_is_sent_again_to_a_peer_gone_or_refused_for_good() {
    let check = |gone: &str, errors: Vec<TransportError>, next: Option<PeerEvent>, then: Vec<Action<&'static str>>| {
        let mut port = port();
        let tries = errors.len();
        let mut errors = errors.into_iter();
        port.expect_send_notification().times(tries).returning(move |_, _| Err(errors.next().unwrap()));
        port.expect_poll_event().return_once(move || next).times(1);
        port.expect_poll_event().returning(|| None);
        port.expect_disconnect().return_const(());
        let mut actions: VecDeque<_> = [send(p0(), 1), send(p0(), 2)].into();
        actions.extend(then);
        let mut driver = WorkerDriver::new(Script { actions, ..Script::default() }, Box::new(port));
        driver.flush(Time::ZERO);
        driver.step(Time::ZERO + FIRST_RESEND_DELAY);
        assert_eq!(driver.resends_waiting(), 0, "{gone}");
        assert_eq!(driver.poll_timeout(), None, "{gone}: no resend is due");
        assert_eq!(driver.notifications().given_up, 2, "{gone}");
    };
    // The transport reports the peer lost before the resend: neither notification is tried again.
    check("lost", vec![refused()], Some(PeerEvent::Lost(p0())), Vec::new());
    // A newer incarnation of the peer handshakes under its name: what waited was for the old one.
    let newer = PeerInfo {
        agent: p0(),
        handshake: Handshake::new(&p0(), 1, 2, Role::Prefill, "model", KvLayout::llama3_8b(16)),
        sent_at: Time::ZERO,
        received_at: Time::ZERO,
        dialed: None,
    };
    check("replaced", vec![refused()], Some(PeerEvent::Connected(Box::new(newer))), Vec::new());
    // The machine drops the peer (discovery says its engine is gone).
    check("disconnected", vec![refused()], None, vec![Action::Disconnect(p0())]);
    // The transport no longer knows the peer: it is not tried again, nor what waited behind it.
    check("unknown", vec![refused(), TransportError::UnknownPeer(p0())], None, Vec::new());
    // Each notification is refused at once, for good: neither waits.
    let too_large = || TransportError::NotificationTooLarge { len: 70_000, max: 65_536 };
    check("too large", vec![too_large(), too_large()], None, Vec::new());
}

#[test]
fn notifications_waiting_to_be_sent_again_are_bounded_and_a_peer_evicts_only_its_own() {
    // Each peer's first send is refused; every later one passes, and is recorded.
    let sent = Arc::new(std::sync::Mutex::new(Vec::new()));
    let record = sent.clone();
    let mut refused_once = std::collections::BTreeSet::new();
    let mut port = quiet_port();
    port.expect_send_notification().returning(move |peer, payload| {
        if refused_once.insert(peer.clone()) {
            return Err(refused());
        }
        record.lock().unwrap().push((peer.rank, u16::from_be_bytes([payload[0], payload[1]])));
        Ok(())
    });
    // p1's one refused notification, then a flood to p0, whose first is refused too.
    let flood = MAX_PENDING_RESENDS as u16 + 50;
    let mut actions: VecDeque<_> = [Action::Send { to: p1(), payload: vec![0, 0] }].into();
    actions.extend((0..flood).map(|i| Action::Send { to: p0(), payload: i.to_be_bytes().to_vec() }));
    let mut driver = WorkerDriver::new(Script { actions, ..Script::default() }, Box::new(port));
    driver.flush(Time::ZERO);
    assert_eq!(driver.resends_waiting(), MAX_PENDING_RESENDS);
    let given_up = usize::from(flood) + 1 - MAX_PENDING_RESENDS;
    assert_eq!(driver.notifications().given_up as usize, given_up);
    driver.step(Time::ZERO + FIRST_RESEND_DELAY);
    // p0 keeps its newest, in order; p1's was never evicted by p0's flood.
    let kept_from = flood - (MAX_PENDING_RESENDS as u16 - 1);
    let mut expected: Vec<(u32, u16)> = (kept_from..flood).map(|i| (0, i)).collect();
    expected.push((1, 0));
    assert_eq!(*sent.lock().unwrap(), expected);
    // p1's was refused and sent again; p0's kept ones were never tried before.
    assert_eq!(driver.notifications(), NotificationStats { failed: 2, resent: 1, given_up: given_up as u64 });
}

/// A clock that moves on 40 µs at each reading, as if every call between two readings took that long.
#[cfg(feature = "metrics")]
struct Ticking(std::sync::atomic::AtomicU64);

#[cfg(feature = "metrics")]
impl Clock for Ticking {
    fn now(&self) -> Time {
        Time::from_nanos(self.0.fetch_add(40_000, std::sync::atomic::Ordering::SeqCst))
    }
}

#[cfg(feature = "metrics")]
#[test]
fn posts_are_timed_on_the_engine_clock_and_refused_sends_counted_in_the_metrics() {
    use crate::metrics::{NOTIFICATIONS_FAILED, NOTIFICATIONS_GIVEN_UP, POST_TIME};
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};

    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || {
        let driver = |clock: Option<Arc<dyn Clock>>| {
            let mut port = quiet_port();
            port.expect_post().returning(|_| Ok(TransferId(1)));
            port.expect_poll_transfer().returning(|_| TransferStatus::InProgress);
            port.expect_send_notification().times(1).returning(|_, _| Err(refused()));
            port.expect_send_notification().returning(|_, _| Ok(()));
            let actions = [read(1), send(p0(), 1)].into();
            let mut driver = WorkerDriver::new(Script { actions, ..Script::default() }, Box::new(port));
            if let Some(clock) = clock {
                driver.set_clock(clock);
            }
            driver.flush(Time::ZERO);
            driver.step(Time::ZERO + FIRST_RESEND_DELAY);
        };
        driver(Some(Arc::new(Ticking(0.into()))));
        // Without a clock, a post is not timed.
        driver(None);
    });
    let values: Vec<(String, DebugValue)> = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .map(|(key, _, _, value)| (key.key().name().to_owned(), value))
        .collect();
    let value = |name: &str| values.iter().find(|(n, _)| n == name).map(|(_, v)| v);
    let posts = match value(POST_TIME) {
        Some(DebugValue::Histogram(samples)) => samples.iter().map(|s| s.into_inner()).collect::<Vec<f64>>(),
        other => panic!("{POST_TIME}: {other:?}"),
    };
    assert_eq!(posts, [0.00004], "one post timed, from the call to its return");
    assert_eq!(value(NOTIFICATIONS_FAILED), Some(&DebugValue::Counter(2)), "one refused send on each driver");
    assert_eq!(value(NOTIFICATIONS_GIVEN_UP), Some(&DebugValue::Counter(0)));
}
