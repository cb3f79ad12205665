//! D connects to a P engine ahead of its first request (`DecodeScheduler::handle_connect`):
//! each D rank completes the handshake with exactly the P ranks it would read, and requests
//! that come after load as usual, without a handshake of their own.

use kv_core::{RequestId, Time};
use kv_testkit::cluster::Cluster;
use kv_testkit::scenario::runner::cluster_config;
use kv_testkit::scenario::Scenario;

fn cluster(mode: &str, prefill_tp: u32, decode_tp: u32) -> Cluster {
    let text = format!(
        r#"
        name = "D connects ahead"
        [cluster]
        mode = "{mode}"
        prefill_tp = {prefill_tp}
        decode_tp = {decode_tp}
        "#
    );
    let scenario = Scenario::from_toml_str(&text).unwrap_or_else(|e| panic!("{e}"));
    Cluster::new(cluster_config(&scenario, 0)).unwrap_or_else(|e| panic!("{e}"))
}

/// Connects decode0 ahead, then runs one request through; returns the P ranks each D rank had
/// connected to before the request, and how long after its arrival its KV was in place.
fn check(mode: &str, prefill_tp: u32, decode_tp: u32, expected: &[usize]) {
    let mut cluster = cluster(mode, prefill_tp, decode_tp);
    assert_eq!(cluster.connected_prefill_ranks("decode0"), vec![0; decode_tp as usize], "nothing before");
    cluster.connect_ahead("decode0", "prefill0").unwrap();
    cluster.advance_to(Time::from_millis(100));
    assert_eq!(
        cluster.connected_prefill_ranks("decode0"),
        expected,
        "{mode}, P at TP {prefill_tp}, D at TP {decode_tp}: each D rank connects to the P ranks it reads"
    );
    let r1 = RequestId::new("r1");
    if mode == "push" {
        cluster.arrive("decode0", &r1, "prefill0", &r1, Some(64), None).unwrap();
        cluster.schedule("decode0", &r1, false).unwrap();
        cluster.prefill("prefill0", &r1, 64, 1, None).unwrap();
    } else {
        cluster.prefill("prefill0", &r1, 64, 1, None).unwrap();
        cluster.arrive("decode0", &r1, "prefill0", &r1, None, None).unwrap();
        cluster.schedule("decode0", &r1, false).unwrap();
    }
    cluster.advance_to(Time::from_millis(1000));
    assert_eq!(cluster.decode_state("decode0", &r1).map(|s| s.as_str()), Some("ready"), "{mode}");
    assert_eq!(cluster.corrupt_reads(), 0);
    assert_eq!(cluster.connected_prefill_ranks("decode0"), expected, "{mode}: the request needed no other");
}

#[test]
fn each_decode_rank_connects_ahead_to_the_prefill_ranks_it_reads() {
    for mode in ["pull", "push"] {
        check(mode, 1, 1, &[1]);
        // D wider: each D rank reads one P rank's head slice.
        check(mode, 2, 4, &[1, 1, 1, 1]);
        // P wider: each D rank reads from two P ranks.
        check(mode, 4, 2, &[2, 2]);
    }
}
