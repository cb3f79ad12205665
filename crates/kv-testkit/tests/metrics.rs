//! The connectors' metrics move as a scenario says they should: each case runs a scenario
//! under a recorder of its own (kv-sched-adapter's `metrics` feature) and checks the values an
//! operator would scrape: releases by reason, expired leases, loads by outcome, transfers,
//! bytes, the KV-ready latency, ignored messages by cause, and stranded block-seconds.

use kv_testkit::scenario::{run, Scenario};
use metrics_util::debugging::{DebugValue, DebuggingRecorder};

/// What one metric summed to over the samples whose labels include `labels`: a counter's
/// value, a gauge's, or a histogram's sample count.
struct Scrape(Vec<Sample>);

/// A metric's name, its labels, and its value.
type Sample = (String, Vec<(String, String)>, DebugValue);

/// Labels a sample must carry.
type Labels<'a> = &'a [(&'a str, &'a str)];

impl Scrape {
    fn samples<'a>(&'a self, name: &'a str, labels: &'a [(&str, &str)]) -> impl Iterator<Item = &'a DebugValue> {
        self.0
            .iter()
            .filter(move |(n, l, _)| {
                n == name && labels.iter().all(|(k, v)| l.iter().any(|(lk, lv)| lk == k && lv == v))
            })
            .map(|(_, _, v)| v)
    }

    fn value(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let mut seen = false;
        let total = self
            .samples(name, labels)
            .map(|v| {
                seen = true;
                match v {
                    DebugValue::Counter(c) => *c as f64,
                    DebugValue::Gauge(g) => g.into_inner(),
                    DebugValue::Histogram(h) => h.len() as f64,
                }
            })
            .sum();
        assert!(seen, "no sample of {name} with {labels:?}");
        total
    }

    fn histogram_sum(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.samples(name, labels)
            .map(|v| match v {
                DebugValue::Histogram(h) => h.iter().map(|x| x.into_inner()).sum(),
                _ => 0.0,
            })
            .sum()
    }
}

/// Runs `toml` (steps only; a one-P, one-D cluster unless it says otherwise) and returns what
/// the recorder holds at the end.
fn scrape(toml: &str) -> Scrape {
    let scenario = Scenario::from_toml_str(toml).unwrap_or_else(|e| panic!("{e}"));
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let outcome = metrics::with_local_recorder(&recorder, || run(&scenario, 0));
    assert_eq!(outcome.failure, None, "the scenario itself failed");
    Scrape(
        snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .map(|(key, _, _, value)| {
                let key = key.key();
                let labels = key.labels().map(|l| (l.key().to_owned(), l.value().to_owned())).collect();
                (key.name().to_owned(), labels, value)
            })
            .collect(),
    )
}

/// Each `(metric, labels, expected)` holds within `tolerance` (stranded block-seconds are
/// counted in whole seconds as they accrue).
fn check(toml: &str, expected: &[(&str, Labels, f64)]) {
    let scrape = scrape(toml);
    for (name, labels, want) in expected {
        let got = scrape.value(name, labels);
        assert_eq!(got, *want, "{name}{labels:?}: scraped {got}, the scenario says {want}");
    }
}

const P: (&str, &str) = ("engine", "prefill0");
const D: (&str, &str) = ("engine", "decode0");

#[test]
fn a_transfer_counts_once_on_p_and_on_d() {
    let scenario = r#"
        name = "one request moves"
        [[step]]
        at_s = 0.0
        do = "prefill"
        request = "r1"
        prompt_tokens = 64
        [[step]]
        at_s = 0.1
        do = "arrive"
        request = "r1"
        [[step]]
        at_s = 0.2
        do = "schedule"
        request = "r1"
    "#;
    check(
        scenario,
        &[
            ("kvflow_releases_total", &[P, ("reason", "transferred")], 1.0),
            ("kvflow_releases_total", &[P, ("reason", "expired")], 0.0),
            ("kvflow_num_kv_expired_reqs_total", &[P], 0.0),
            ("kvflow_exports_live", &[P], 0.0),
            ("kvflow_blocks_held", &[P], 0.0),
            ("kvflow_blocks_held", &[D], 0.0),
            ("kvflow_loads_total", &[D, ("outcome", "ready")], 1.0),
            ("kvflow_kv_ready_latency_seconds", &[D], 1.0),
            ("kvflow_transfers_posted_total", &[D], 1.0),
            ("kvflow_num_failed_transfers_total", &[D], 0.0),
            ("kvflow_xfer_time_seconds", &[D], 1.0),
            ("kvflow_peers_connected", &[P], 1.0),
            ("kvflow_stranded_block_seconds_total", &[P], 0.0),
            ("kvflow_ignored_messages_total", &[], 0.0),
        ],
    );
    let scrape = scrape(scenario);
    // 4 blocks of the simulator's model: 2 layers, K and V, 16 tokens, 8 heads of 4 bytes.
    let bytes = scrape.histogram_sum("kvflow_bytes_transferred", &[D]);
    assert_eq!(bytes, 4.0 * 2.0 * 2.0 * 16.0 * 8.0 * 4.0, "bytes moved");
    // P finished at 0, D scheduled at 0.2 and the read takes 5 ms, seen at D's next step.
    let latency = scrape.histogram_sum("kvflow_kv_ready_latency_seconds", &[D]);
    assert!((0.2..0.25).contains(&latency), "P done to D holds KV: {latency} s");
    assert!(scrape.value("kvflow_leases_renewed_total", &[P]) >= 1.0, "D's first renewal claims the export");
}

#[test]
fn an_expired_lease_counts_as_expired_and_strands_its_blocks_while_unclaimed() {
    // Nobody claims r1: its 4 blocks are stranded from two heartbeat intervals (10 s) after
    // P's worker registered it (10 ms in) until the lease ends at 30 s: 4 x 19.99 s.
    check(
        r#"
        name = "no one comes"
        [[step]]
        at_s = 0.0
        do = "prefill"
        request = "r1"
        prompt_tokens = 64
        [[step]]
        at_s = 31.0
        do = "wait"
        expect = { p_released = { r1 = "expired" } }
        "#,
        &[
            ("kvflow_releases_total", &[P, ("reason", "expired")], 1.0),
            ("kvflow_num_kv_expired_reqs_total", &[P], 1.0),
            ("kvflow_stranded_block_seconds_total", &[P], 79.0),
            ("kvflow_exports_live", &[P], 0.0),
        ],
    );
}

#[test]
fn a_waiting_consumer_that_renews_strands_nothing_and_a_paused_one_does() {
    let waiting = r#"
        name = "D waits 25 s, renewing, then reads"
        [[step]]
        at_s = 0.0
        do = "prefill"
        request = "r1"
        prompt_tokens = 64
        [[step]]
        at_s = 0.1
        do = "arrive"
        request = "r1"
        [[step]]
        at_s = 25.0
        do = "schedule"
        request = "r1"
        expect = { d_state = { r1 = "loading" } }
    "#;
    check(
        waiting,
        &[
            ("kvflow_releases_total", &[P, ("reason", "transferred")], 1.0),
            ("kvflow_stranded_block_seconds_total", &[P], 0.0),
            // One renewal at arrival (0.1 s), then one every 5 s until the read at 25 s.
            ("kvflow_leases_renewed_total", &[P], 5.0),
        ],
    );
    // The same, but D stops for 40 s a second after it claimed r1: silent from 10 s after its
    // last heartbeat (0.1 s and the network's 1 ms) until the lease it holds ends at 30 s.
    let paused = r#"
        name = "D claims, then stops"
        [[step]]
        at_s = 0.0
        do = "prefill"
        request = "r1"
        prompt_tokens = 64
        [[step]]
        at_s = 0.1
        do = "arrive"
        request = "r1"
        [[step]]
        at_s = 1.0
        do = "pause"
        node = "decode0"
        for_s = 40
        [[step]]
        at_s = 45.0
        do = "wait"
        expect = { p_released = { r1 = "expired" } }
    "#;
    check(paused, &[("kvflow_stranded_block_seconds_total", &[P], 79.0)]);
}

#[test]
fn ignored_messages_count_by_cause() {
    check(
        r#"
        name = "a foreign engine forges, garbage arrives, an intruder knocks"
        [cluster]
        decoders = 2
        [[step]]
        at_s = 0.0
        do = "prefill"
        request = "r1"
        prompt_tokens = 64
        [[step]]
        at_s = 0.1
        do = "arrive"
        request = "r1"
        [[step]]
        at_s = 0.1
        do = "arrive"
        request = "r9"
        node = "decode1"
        remote_request = "r1"
        [[step]]
        at_s = 0.5
        do = "forge"
        from = "decode1"
        to = "prefill0"
        message = "completion"
        request = "r1"
        [[step]]
        at_s = 0.5
        do = "garbage"
        from = "decode0"
        to = "prefill0"
        bytes = "not a message"
        [[step]]
        at_s = 0.5
        do = "intrude"
        to = "prefill0"
        as = "decode0"
        [[step]]
        at_s = 1.0
        do = "schedule"
        request = "r1"
        [[step]]
        at_s = 1.0
        do = "abort"
        request = "r9"
        node = "decode1"
        [[step]]
        at_s = 2.0
        do = "wait"
        expect = { p_released = { r1 = "transferred" }, ignored_messages = 5 }
        "#,
        &[
            // decode1's renewal on arrival (decode0's came first and bound r1), its forged
            // completion, and its abort of r9, which names r1.
            ("kvflow_ignored_messages_total", &[P, ("cause", "foreign")], 3.0),
            ("kvflow_ignored_messages_total", &[P, ("cause", "malformed")], 1.0),
            ("kvflow_handshakes_refused_total", &[P, ("cause", "unauthenticated")], 1.0),
            ("kvflow_ignored_messages_total", &[P, ("cause", "unauthenticated")], 1.0),
            ("kvflow_releases_total", &[P, ("reason", "transferred")], 1.0),
            // The scenario's `ignored_messages` (5, on every engine) is the sum of these causes.
            ("kvflow_ignored_messages_total", &[("cause", "unknown")], 0.0),
            ("kvflow_ignored_messages_total", &[("cause", "refused")], 0.0),
            ("kvflow_ignored_messages_total", &[("cause", "foreign")], 3.0),
            ("kvflow_ignored_messages_total", &[("cause", "malformed")], 1.0),
            ("kvflow_ignored_messages_total", &[("cause", "unauthenticated")], 1.0),
        ],
    );
}
