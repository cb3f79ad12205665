//! Push with a chunked prefill: P writes the blocks it has finished into the blocks D
//! registered while it computes the rest, and the last write, at the export, carries the
//! completion. The load ends ready with the bytes P computed, whatever the TP and block-size
//! mapping; and nothing tells D "no write will come" while a write into its blocks is in
//! flight: not when P gives the prompt up, not when D cancels, not when a write ahead fails.

use std::time::Duration;

use kv_core::{AgentName, EngineId, RequestId, Time};
use kv_sched_adapter::ReleaseReason;
use kv_testkit::cluster::Cluster;
use kv_testkit::scenario::runner::{apply, cluster_config};
use kv_testkit::scenario::Scenario;

/// A push cluster of `cluster` keys (TOML) in which decode0 has scheduled r1, a prompt of
/// `tokens`, which P has started computing but not finished: D's registration waits at P.
fn computing_r1(cluster: &str, tokens: u64) -> Cluster {
    computing_r1_cached(cluster, tokens, 0)
}

/// As [`computing_r1`], with D's own prefix cache holding the prompt's first `cached` tokens:
/// D registers only the blocks after them.
fn computing_r1_cached(cluster: &str, tokens: u64, cached: u64) -> Cluster {
    let toml = format!(
        r#"
        name = "D registers r1 while P computes it"
        [cluster]
        mode = "push"
        {cluster}
        [[step]]
        at_s = 0.0
        do = "arrive"
        request = "r1"
        prompt_tokens = {tokens}
        [[step]]
        at_s = 0.1
        do = "schedule"
        request = "r1"
        cached_tokens = {cached}
        "#
    );
    let scenario = Scenario::from_toml_str(&toml).unwrap_or_else(|e| panic!("{e}"));
    let mut cluster = Cluster::new(cluster_config(&scenario, 0)).unwrap_or_else(|e| panic!("{e}"));
    let r1 = RequestId::new("r1");
    cluster.begin_prefill("prefill0", &r1, tokens, None).unwrap();
    for step in &scenario.steps {
        cluster.advance_to(step.at);
        apply(&mut cluster, step.event.as_ref().unwrap()).unwrap();
    }
    cluster.advance_to(Time::from_millis(200));
    cluster
}

fn r1() -> RequestId {
    RequestId::new("r1")
}

fn later(cluster: &mut Cluster, ms: u64) {
    let to = cluster.now() + Duration::from_millis(ms);
    cluster.advance_to(to);
}

fn writes_ahead(cluster: &Cluster) -> u64 {
    cluster.engine_counters("prefill0").writes_ahead
}

fn state(cluster: &Cluster, node: &str) -> Option<&'static str> {
    cluster.decode_state(node, &r1()).map(|s| s.as_str())
}

/// The whole run ended clean: every block back in its pool, no bad bytes, no late write.
fn assert_clean(cluster: &mut Cluster) {
    cluster.drain(Duration::from_secs(600));
    assert_eq!(cluster.corrupt_reads(), 0, "{}", cluster.trace().join("\n"));
    assert_eq!(cluster.written_after_free(), 0, "{}", cluster.trace().join("\n"));
    assert_eq!(cluster.held_everywhere(), Vec::<(String, u64)>::new(), "blocks still held");
    assert!(cluster.violations().is_empty(), "{:?}", cluster.violations());
}

/// P finishes r1: the load ends ready with P's bytes, P's export released as transferred, and
/// the run clean.
fn finish_ready(cluster: &mut Cluster, keys: &str) {
    cluster.finish_prefill("prefill0", &r1()).unwrap();
    later(cluster, 100);
    assert_eq!(state(cluster, "decode0"), Some("ready"), "{keys:?}: {}", cluster.trace().join("\n"));
    assert_eq!(cluster.release_reason("prefill0", &r1()), Some(ReleaseReason::Transferred));
    assert_clean(cluster);
}

/// P computes half of a 128-token prompt, then all of it, then finishes: two writes ahead
/// while it computes, the load ready with P's bytes, P's export released as transferred.
fn check_written_ahead(keys: &str, tokens: u64) {
    let mut cluster = computing_r1(keys, tokens);
    cluster.progress("prefill0", &r1(), tokens / 2).unwrap();
    later(&mut cluster, 50);
    let first = writes_ahead(&cluster);
    assert!(first > 0, "{keys:?}: half the prompt is written ahead");
    assert_eq!(state(&cluster, "decode0"), Some("loading"), "no completion before P finishes");
    cluster.progress("prefill0", &r1(), tokens).unwrap();
    later(&mut cluster, 50);
    assert!(writes_ahead(&cluster) > first, "the rest is written ahead as it is computed");
    finish_ready(&mut cluster, keys);
}

#[test]
fn finished_blocks_are_written_while_p_computes_and_the_load_ends_ready() {
    for cluster in [
        "",
        "prefill_tp = 2\ndecode_tp = 4",
        "prefill_tp = 4\ndecode_tp = 2",
        "decode_block_size = 32",
        "mla = true\nprefill_tp = 2\ndecode_tp = 1",
    ] {
        check_written_ahead(cluster, 128);
    }
}

/// D's own prefix cache holds the prompt's first 2 blocks, so it registers the 6 after them:
/// P writes ahead the finished ones among those (D block `b` of the prompt from P's blocks
/// from `b`), never a cached one, and the load is ready with P's bytes.
#[test]
fn a_partial_prefix_hit_is_written_ahead_from_its_first_uncached_block() {
    for keys in ["", "decode_block_size = 32"] {
        let mut cluster = computing_r1_cached(keys, 128, 32);
        cluster.progress("prefill0", &r1(), 96).unwrap();
        later(&mut cluster, 50);
        assert!(writes_ahead(&cluster) > 0, "{keys:?}: the finished uncached blocks go ahead");
        cluster.progress("prefill0", &r1(), 128).unwrap();
        finish_ready(&mut cluster, keys);
    }
}

/// P finishes right after a write ahead was posted: the last write waits for it, so the
/// completion never overtakes those bytes, and the last write moves only what was left.
#[test]
fn the_last_write_waits_for_the_writes_ahead_in_flight() {
    let mut cluster = computing_r1("transfer_latency_ms = 40", 128);
    let done = |cluster: &Cluster| cluster.network().stats().transfers_done;
    let before = done(&cluster);
    cluster.progress("prefill0", &r1(), 64).unwrap();
    cluster.finish_prefill("prefill0", &r1()).unwrap();
    // Both reach P's worker one handoff (10 ms) later; the write ahead completes 40 ms after.
    later(&mut cluster, 20);
    assert_eq!(state(&cluster, "decode0"), Some("loading"), "the write ahead is still in flight");
    later(&mut cluster, 50);
    assert_eq!(done(&cluster) - before, 1, "the last write was posted only when the write ahead completed");
    assert_eq!(state(&cluster, "decode0"), Some("loading"), "the last write is still in flight");
    later(&mut cluster, 200);
    assert_eq!(state(&cluster, "decode0"), Some("ready"), "{}", cluster.trace().join("\n"));
    let last = cluster.network().moved(&AgentName::new(EngineId::new("prefill0"), 0), &r1());
    assert_eq!(last, 4 * 2048, "the last write moves the 4 blocks of 2 KiB not written ahead");
    assert_clean(&mut cluster);
}

/// P gives the prompt up while a write ahead is in flight: its blocks stay out of the pool
/// until the write ends, D hears that no write will come only then, and D's blocks go back
/// without a write landing in them after.
#[test]
fn a_prompt_given_up_mid_write_frees_only_once_the_write_ended() {
    let mut cluster = computing_r1("transfer_latency_ms = 40", 128);
    cluster.progress("prefill0", &r1(), 64).unwrap();
    later(&mut cluster, 5);
    cluster.abandon_prefill("prefill0", &r1()).unwrap();
    later(&mut cluster, 5);
    // The 4 blocks never reported computed were the engine's to free at once; the 4 written
    // ahead stay while the write reads them.
    assert_eq!(cluster.held_blocks("prefill0"), 4, "the write ahead still reads P's blocks");
    assert_eq!(state(&cluster, "decode0"), Some("loading"), "D hears nothing while the write is in flight");
    later(&mut cluster, 100);
    assert_eq!(cluster.held_blocks("prefill0"), 0);
    assert_eq!(cluster.release_reason("prefill0", &r1()), Some(ReleaseReason::Aborted));
    assert_eq!(state(&cluster, "decode0"), Some("recompute"), "D gives the load up at P's word, not its watchdog");
    assert_clean(&mut cluster);
}

/// D gives the request up while P writes ahead into its blocks: P writes no more, answers
/// the cancel once the write ended, and D keeps its blocks out of the pool until then.
#[test]
fn a_cancel_while_p_writes_ahead_is_answered_after_the_write() {
    let mut cluster = computing_r1("transfer_latency_ms = 40", 128);
    cluster.progress("prefill0", &r1(), 64).unwrap();
    later(&mut cluster, 5);
    cluster.abort("decode0", &r1()).unwrap();
    later(&mut cluster, 10);
    assert_eq!(cluster.held_blocks("decode0"), 8, "D's blocks wait for P's word");
    cluster.progress("prefill0", &r1(), 128).unwrap();
    later(&mut cluster, 100);
    assert_eq!(writes_ahead(&cluster), 1, "nothing more is written into a cancelled registration");
    assert_eq!(cluster.held_blocks("decode0"), 0, "P answered once its write ended");
    cluster.finish_prefill("prefill0", &r1()).unwrap();
    later(&mut cluster, 100);
    assert_eq!(cluster.release_reason("prefill0", &r1()), Some(ReleaseReason::Aborted));
    assert_clean(&mut cluster);
}

/// D sends cancel after cancel, each naming the request by another suffixed id, while a
/// write ahead into its blocks is in flight: P holds at most 8 answers for that write, and
/// answers them when it ends.
#[test]
fn the_answers_held_for_a_write_in_flight_are_bounded() {
    let mut cluster = computing_r1("transfer_latency_ms = 40", 128);
    cluster.progress("prefill0", &r1(), 64).unwrap();
    later(&mut cluster, 15);
    for i in 0..100 {
        let abort = kv_core::Message::Abort { request: RequestId::new(format!("r1-{i:08x}")) };
        cluster.send_as("decode0", "prefill0", &abort).unwrap();
    }
    later(&mut cluster, 5);
    let book = cluster.prefill_book("prefill0", 0).expect("prefill0 is up");
    assert_eq!(book.held_answers, 8, "{book:?}");
    later(&mut cluster, 100);
    assert_eq!(cluster.prefill_book("prefill0", 0).expect("up").held_answers, 0, "answered once the write ended");
    cluster.abandon_prefill("prefill0", &r1()).unwrap();
    assert_clean(&mut cluster);
}

/// A write ahead fails: D cannot tell what landed, so it never gets the completion; at the
/// export P tells it no write will come, and D applies its load-failure policy.
#[test]
fn a_failed_write_ahead_fails_the_load_not_the_bytes() {
    let mut cluster = computing_r1("", 128);
    cluster.network().fail_next_transfer(EngineId::new("prefill0"));
    cluster.progress("prefill0", &r1(), 64).unwrap();
    later(&mut cluster, 50);
    cluster.progress("prefill0", &r1(), 128).unwrap();
    cluster.finish_prefill("prefill0", &r1()).unwrap();
    later(&mut cluster, 100);
    assert_eq!(writes_ahead(&cluster), 1, "no more writes into a rank whose write ahead failed");
    assert_eq!(state(&cluster, "decode0"), Some("recompute"), "{}", cluster.trace().join("\n"));
    assert_clean(&mut cluster);
}

/// The router named decode1 at prefill: decode0's registration gets none of P's bytes ahead
/// of the export, which binds to decode1 and tells decode0 that no write will come.
#[test]
fn only_the_named_consumer_is_written_ahead() {
    let mut cluster = computing_r1("decoders = 2", 128);
    cluster.abandon_prefill("prefill0", &r1()).unwrap();
    later(&mut cluster, 10);
    let r2 = RequestId::new("r2");
    cluster.begin_prefill("prefill0", &r2, 128, Some("decode1")).unwrap();
    cluster.arrive("decode0", &r2, "prefill0", &r2, Some(128), None).unwrap();
    cluster.schedule("decode0", &r2, false).unwrap();
    later(&mut cluster, 50);
    cluster.progress("prefill0", &r2, 128).unwrap();
    later(&mut cluster, 50);
    assert_eq!(writes_ahead(&cluster), 0, "decode0 is not the consumer the router named");
    cluster.finish_prefill("prefill0", &r2).unwrap();
    later(&mut cluster, 50);
    assert_eq!(cluster.decode_state("decode0", &r2).map(|s| s.as_str()), Some("recompute"));
    assert_clean(&mut cluster);
}

/// P computes each 64-token chunk of a 128-token prompt layer by layer (the model has 2):
/// the chunk's first layer goes as soon as it is computed, the second when the chunk is
/// whole, and at the export only the last chunk's last layer is left, with the completion.
/// The load is ready with P's bytes (every layer of every block landed), whatever the TP and
/// block-size mapping, and with pipeline stages each stage writes the layers it holds.
#[test]
fn a_chunk_computed_layer_by_layer_is_written_a_layer_at_a_time() {
    for keys in [
        "",
        "prefill_tp = 2\ndecode_tp = 4",
        "decode_block_size = 32",
        "prefill_block_size = 32",
        "mla = true\nprefill_tp = 2\ndecode_tp = 1",
        "prefill_pp = 2",
    ] {
        let mut cluster = computing_r1(keys, 128);
        let layer_writes = |cluster: &Cluster| cluster.engine_counters("prefill0").layer_writes;
        cluster.progress_layers("prefill0", &r1(), 0, 64, 1).unwrap();
        later(&mut cluster, 50);
        assert!(layer_writes(&cluster) > 0, "{keys:?}: the first chunk's first layer goes ahead");
        cluster.progress("prefill0", &r1(), 64).unwrap();
        cluster.progress_layers("prefill0", &r1(), 64, 128, 1).unwrap();
        later(&mut cluster, 50);
        assert_eq!(state(&cluster, "decode0"), Some("loading"), "{keys:?}: no completion before P finishes");
        finish_ready(&mut cluster, keys);
    }
}

/// The first chunk's first layer goes ahead, and P gives the prompt up while that write is in
/// flight: the blocks come back once it has ended.
#[test]
fn a_prompt_given_up_after_a_layer_went_ahead_frees_its_blocks() {
    let mut cluster = computing_r1("transfer_latency_ms = 40", 128);
    cluster.progress_layers("prefill0", &r1(), 0, 64, 1).unwrap();
    later(&mut cluster, 20);
    cluster.abandon_prefill("prefill0", &r1()).unwrap();
    later(&mut cluster, 200);
    assert_eq!(cluster.release_reason("prefill0", &r1()), Some(ReleaseReason::Aborted));
    assert_clean(&mut cluster);
}
