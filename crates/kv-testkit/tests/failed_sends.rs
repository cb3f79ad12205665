//! A notification the transport refuses to send is counted and sent again
//! (`WorkerDriver`'s resends): D's rejection or abort that the fake network refuses still
//! frees P's blocks at once, not when the lease runs out; one refused at every try is given up,
//! counted, and P's lease reclaims the export, while D still holds P as connected: a failed send
//! alone never makes a peer lost.

use std::time::Duration;

use kv_core::{Message, RequestId, Time};
use kv_sched_adapter::ReleaseReason;
use kv_testkit::cluster::Cluster;
use kv_testkit::scenario::runner::cluster_config;
use kv_testkit::scenario::Scenario;
use metrics_util::debugging::{DebugValue, DebuggingRecorder};

/// What D tells P about r1, which D refuses before admission or aborts after it arrived.
#[derive(Clone, Copy, Debug)]
enum Tell {
    Rejection,
    Abort,
}

impl Tell {
    fn is(self, payload: &[u8]) -> bool {
        matches!(
            (self, Message::decode(payload)),
            (Tell::Rejection, Ok(Message::Rejection { .. })) | (Tell::Abort, Ok(Message::Abort { .. }))
        )
    }
}

/// What came of it: P's release of r1 and when, D's connected P ranks, and D's metrics
/// (refused sends, notifications given up).
#[derive(Debug, PartialEq)]
struct Outcome {
    released: Option<(ReleaseReason, bool)>,
    connected: Vec<usize>,
    peers_lost: u64,
    failed: u64,
    given_up: u64,
}

/// One P and one D, connected; P exports r1; the network refuses the first `refusals` sends of
/// D's `tell`; D tells P. Returns the outcome 40 s later (P's lease is 30 s), and whether P
/// released r1 within a second.
fn run(tell: Tell, refusals: usize) -> Outcome {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let (released, connected, peers_lost) = metrics::with_local_recorder(&recorder, || {
        let scenario = Scenario::from_toml_str("name = \"refused sends\"").unwrap_or_else(|e| panic!("{e}"));
        let mut cluster = Cluster::new(cluster_config(&scenario, 0)).unwrap_or_else(|e| panic!("{e}"));
        let r1 = RequestId::new("r1");
        cluster.connect_ahead("decode0", "prefill0").unwrap();
        cluster.prefill("prefill0", &r1, 64, 1, None).unwrap();
        cluster.advance_to(Time::from_millis(100));
        for _ in 0..refusals {
            cluster
                .network()
                .fail_send_when(move |from, _, payload| from.engine.as_str() == "decode0" && tell.is(payload));
        }
        match tell {
            Tell::Rejection => cluster.reject("decode0", &r1, "prefill0", &r1, None).unwrap(),
            Tell::Abort => {
                cluster.arrive("decode0", &r1, "prefill0", &r1, None, None).unwrap();
                cluster.advance_to(Time::from_millis(200));
                cluster.abort("decode0", &r1).unwrap();
            }
        }
        let told = cluster.now();
        cluster.advance_to(told + Duration::from_secs(1));
        let within_a_second = cluster.release_reason("prefill0", &r1).is_some();
        cluster.advance_to(told + Duration::from_secs(40));
        assert!(cluster.violations().is_empty(), "{:?}", cluster.violations());
        let released = cluster.release_reason("prefill0", &r1).map(|reason| (reason, within_a_second));
        (released, cluster.connected_prefill_ranks("decode0"), cluster.engine_counters("decode0").peers_lost)
    });
    let snapshot = snapshotter.snapshot().into_vec();
    let counter = |name: &str| {
        let decode0 = |key: &metrics::Key| key.labels().any(|l| l.key() == "engine" && l.value() == "decode0");
        snapshot
            .iter()
            .filter(|(key, _, _, _)| key.key().name() == name && decode0(key.key()))
            .map(|(_, _, _, value)| match value {
                DebugValue::Counter(n) => *n,
                other => panic!("{name} is not a counter: {other:?}"),
            })
            .sum::<u64>()
    };
    Outcome {
        released,
        connected,
        peers_lost,
        failed: counter("kvflow_num_failed_notifications_total"),
        given_up: counter("kvflow_notifications_given_up_total"),
    }
}

#[test]
fn a_refused_rejection_or_abort_is_sent_again_and_frees_p_at_once() {
    let check = |tell: Tell, refusals: usize, reason: ReleaseReason| {
        let outcome = run(tell, refusals);
        let expected = Outcome {
            released: Some((reason, true)),
            connected: vec![1],
            peers_lost: 0,
            failed: refusals as u64,
            given_up: 0,
        };
        assert_eq!(outcome, expected, "{tell:?} refused {refusals} times");
    };
    check(Tell::Rejection, 0, ReleaseReason::Rejected);
    check(Tell::Rejection, 1, ReleaseReason::Rejected);
    check(Tell::Rejection, 3, ReleaseReason::Rejected);
    check(Tell::Abort, 2, ReleaseReason::Aborted);
}

#[test]
fn a_notification_refused_at_every_try_is_given_up_and_the_lease_reclaims_the_export() {
    let tries = kv_sched_adapter::driver::MAX_SEND_ATTEMPTS as usize;
    let outcome = run(Tell::Rejection, tries + 5);
    // P is neither told nor lost: its export waits for the lease, and D keeps its connection.
    let expected = Outcome {
        released: Some((ReleaseReason::Expired, false)),
        connected: vec![1],
        peers_lost: 0,
        failed: tries as u64,
        given_up: 1,
    };
    assert_eq!(outcome, expected);
}
