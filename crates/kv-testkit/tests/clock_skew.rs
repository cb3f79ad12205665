//! Engines whose clocks disagree (`clock_skew_ms`): each engine runs on its own clock and
//! learns how far a peer's disagrees only from the handshake's sample, and every deadline
//! crosses engines through that offset. So a run whose clocks disagree, by more than a lease
//! or less, does what it does with one clock, event for event: every scenario file and a range
//! of random workloads are run both ways and compared.

use std::path::{Path, PathBuf};

use kv_core::{RequestId, Role, Time};
use kv_testkit::cluster::Cluster;
use kv_testkit::random;
use kv_testkit::scenario::runner::cluster_config;
use kv_testkit::scenario::{run_with_trace, scenario_files, ClusterSpec, Node, Scenario};
use kv_testkit::Rng;

const SECOND: i64 = 1_000_000_000;

/// The trace less the lines that state the skews (`decode0 clock is 2.500000000s behind true
/// time`): a run with skewed clocks must agree with the run without on everything else.
fn without_clock_lines(trace: &[String]) -> Vec<&str> {
    trace.iter().map(String::as_str).filter(|line| !line.contains(" clock is ")).collect()
}

/// This crate's scenarios, the format's examples among them.
fn scenario_dirs() -> Vec<PathBuf> {
    vec![PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scenarios")]
}

/// How the engines' clocks disagree in one run of a scenario, given its lease.
struct Skews {
    name: &'static str,
    skew: fn(Node, i64, &mut Rng) -> i64,
}

const SKEWS: [Skews; 4] = [
    Skews {
        name: "every P engine ahead by a lease and 7.5 s",
        skew: |node, lease, _| if node.role == Role::Prefill { lease + 7_500_000_000 } else { 0 },
    },
    Skews {
        name: "every D engine ahead by a lease and 7.5 s",
        skew: |node, lease, _| if node.role == Role::Decode { lease + 7_500_000_000 } else { 0 },
    },
    Skews {
        name: "P engines behind and D engines ahead, each by 3.3 s more than the one before",
        skew: |node, _, _| {
            let step = (i64::from(node.index) + 1) * 3_333_333_333;
            if node.role == Role::Prefill {
                -step
            } else {
                step
            }
        },
    },
    Skews {
        name: "each engine anywhere within a lease and 10 s of true time",
        skew: |_, lease, rng| {
            let max = (lease + 10 * SECOND) as u64;
            rng.below(2 * max + 1) as i64 - max as i64
        },
    },
];

fn skewed(scenario: &Scenario, skews: &Skews, rng: &mut Rng) -> Scenario {
    let lease = scenario.policy.kv_lease_duration.as_nanos() as i64;
    let mut skewed = scenario.clone();
    skewed.cluster.clock_skew = scenario.cluster.nodes().map(|node| (node, (skews.skew)(node, lease, rng))).collect();
    skewed
}

#[test]
fn every_scenario_runs_as_with_one_clock_however_the_engines_clocks_disagree() {
    let dirs = scenario_dirs();
    let files = scenario_files(&dirs.iter().map(PathBuf::as_path).collect::<Vec<&Path>>()).expect("scenario folders");
    assert!(files.len() >= 100, "found only {} scenario files", files.len());
    let mut failures = Vec::new();
    for (i, file) in files.iter().enumerate() {
        let scenario = Scenario::load(file).unwrap_or_else(|e| panic!("{e}"));
        if !scenario.cluster.clock_skew.is_empty() {
            // Its own skews are what it is about; it runs as written in scenarios.rs.
            continue;
        }
        // A scenario that fails fails the same way with skewed clocks; scenarios.rs reports it.
        let (plain, plain_trace) = run_with_trace(&scenario, 0);
        let mut rng = Rng::new(i as u64);
        for skews in &SKEWS {
            let (outcome, trace) = run_with_trace(&skewed(&scenario, skews, &mut rng), 0);
            if outcome.failure != plain.failure {
                let failure = outcome.failure.as_deref().unwrap_or("passed");
                failures.push(format!("{} with {}: {failure}", file.display(), skews.name));
            } else if without_clock_lines(&trace) != without_clock_lines(&plain_trace) {
                let diverged = without_clock_lines(&trace)
                    .into_iter()
                    .zip(without_clock_lines(&plain_trace))
                    .find(|(a, b)| a != b)
                    .map_or_else(|| "one trace is longer".to_owned(), |(a, b)| format!("{a:?} instead of {b:?}"));
                failures.push(format!("{} with {}: ran differently: {diverged}", file.display(), skews.name));
            }
        }
    }
    assert!(failures.is_empty(), "{} runs failed:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn random_workloads_run_as_with_one_clock() {
    // All of 0..2000 agree too; 60 keep the test quick.
    let mut compared = 0;
    for seed in 0..60 {
        let scenario = random::generate(seed);
        if scenario.cluster.clock_skew.is_empty() {
            continue;
        }
        let mut plain = scenario.clone();
        plain.cluster.clock_skew.clear();
        let ((skewed, skewed_trace), (one_clock, one_clock_trace)) =
            (random::run_workload(&scenario, seed), random::run_workload(&plain, seed));
        assert_eq!(skewed.failure, None, "seed {seed} (reproduce with: cargo xtask sim --seed {seed})");
        assert_eq!(
            without_clock_lines(&skewed_trace),
            without_clock_lines(&one_clock_trace),
            "seed {seed} ran differently with its engines' clocks skewed"
        );
        assert_eq!((skewed.loads_ok, skewed.prepared), (one_clock.loads_ok, one_clock.prepared), "seed {seed}");
        compared += 1;
    }
    assert!(compared > 40, "only {compared} of 60 seeds skewed their engines' clocks");
}

#[test]
fn random_workloads_skew_clocks_up_to_ten_seconds_either_way_more_than_a_lease_included() {
    let (mut seeds, mut behind, mut ahead, mut beyond_lease) = (0, 0, 0, 0);
    for seed in 0..500 {
        let scenario = random::generate(seed);
        let lease = scenario.policy.kv_lease_duration.as_nanos() as i64;
        seeds += usize::from(!scenario.cluster.clock_skew.is_empty());
        for (node, &skew) in &scenario.cluster.clock_skew {
            assert!(scenario.cluster.contains(*node), "seed {seed} skews {node}, which its cluster lacks");
            assert!(skew.abs() <= random::MAX_SKEW.as_nanos() as i64, "seed {seed} skews {node} by {skew} ns");
            behind += usize::from(skew < 0);
            ahead += usize::from(skew > 0);
            // Leases are 2 to 10 s: clocks that disagree by more than one happen often.
            beyond_lease += usize::from(skew.abs() > lease);
        }
        // A seed replays exactly: its skews too.
        assert_eq!(random::generate(seed).cluster.clock_skew, scenario.cluster.clock_skew);
    }
    assert!((350..450).contains(&seeds), "{seeds} of 500 seeds skewed their clocks, not about 4 in 5");
    assert!(behind > 200 && ahead > 200, "{behind} clocks behind and {ahead} ahead");
    assert!(beyond_lease > 200, "only {beyond_lease} clocks skewed by more than their seed's lease");
}

#[test]
fn each_engine_runs_on_its_own_clock() {
    // prefill0 reads 7 s ahead of true time, decode0 3 s behind: every clock leads by 3 s, so
    // that decode0's reads zero at the start.
    let spec = ClusterSpec {
        clock_skew: [(Node::PREFILL0, 7 * SECOND), (Node::DECODE0, -3 * SECOND)].into_iter().collect(),
        ..ClusterSpec::default()
    };
    let scenario = Scenario { name: "skewed".to_owned(), cluster: spec, policy: Default::default(), steps: Vec::new() };
    let mut cluster = Cluster::new(cluster_config(&scenario, 0)).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        cluster.trace(),
        [
            "0.000000000s prefill0 clock is 7.000000000s ahead of true time",
            "0.000000000s decode0 clock is 3.000000000s behind true time",
        ]
    );
    cluster.advance_to(Time::from_millis(1_000));
    assert_eq!(cluster.engine_now("prefill0"), Time::from_millis(11_000));
    assert_eq!(cluster.engine_now("decode0"), Time::from_millis(1_000));
    let r1 = RequestId::new("r1");
    cluster.prefill("prefill0", &r1, 64, 1, None).unwrap();
    // P exported on its own clock: the deadline it handed the router is 30 s after 11 s.
    let export = cluster.transfer_params("prefill0", &r1).and_then(|p| p.export.clone()).expect("exported");
    assert_eq!((export.finished, export.deadline), (Some(Time::from_millis(11_000)), Time::from_millis(41_000)));
    // D carries the deadlines P acknowledges onto its own clock through the handshake's
    // offset, and loads across the 10 s the two clocks disagree.
    cluster.arrive("decode0", &r1, "prefill0", &r1, None, None).unwrap();
    cluster.advance_to(Time::from_millis(20_000));
    cluster.schedule("decode0", &r1, false).unwrap();
    cluster.advance_to(Time::from_millis(20_100));
    assert_eq!(cluster.decode_state("decode0", &r1).map(|s| s.as_str()), Some("ready"));
    assert_eq!(cluster.corrupt_reads(), 0);
}
