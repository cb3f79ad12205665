//! Push registrations P must handle with care. One that reaches P twice (a D that sends it
//! again, a network that repeats it) is counted as a duplicate and staged once: P writes D's
//! blocks once, and the load ends ready with the bytes P computed. One that counts other
//! pipeline stages than P has is refused, and so is one that names another prompt than P
//! computed (P writes nothing into it and frees the export at once).

use kv_core::{BlockId, EngineId, Message, Prompt, PushRegistration, RequestId, Time};
use kv_sched_adapter::ReleaseReason;
use kv_testkit::cluster::Cluster;
use kv_testkit::scenario::runner::{apply, cluster_config};
use kv_testkit::scenario::Scenario;

/// A push cluster in which decode0 has scheduled r1, which P has not run yet: its
/// registration waits at P, and its blocks are allocated.
fn registered_r1() -> Cluster {
    let scenario = Scenario::from_toml_str(
        r#"
        name = "D registers r1 before P has run the prompt"
        [cluster]
        mode = "push"
        [[step]]
        at_s = 0.0
        do = "arrive"
        request = "r1"
        prompt_tokens = 64
        [[step]]
        at_s = 0.1
        do = "schedule"
        request = "r1"
        "#,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let mut cluster = Cluster::new(cluster_config(&scenario, 0)).unwrap_or_else(|e| panic!("{e}"));
    for step in &scenario.steps {
        cluster.advance_to(step.at);
        apply(&mut cluster, step.event.as_ref().unwrap()).unwrap();
    }
    cluster.advance_to(Time::from_millis(200));
    cluster
}

/// decode0's rank 0 (of 1) registering `blocks` for `request` (its own id and the export's), for
/// a P of `prefill_pp` stages and a prompt of `tokens` tokens.
fn registration(request: &RequestId, blocks: Vec<BlockId>, prefill_pp: u32, tokens: u64) -> Message {
    Message::PushRegistration(PushRegistration {
        request: request.clone(),
        export: request.clone(),
        decode_engine: EngineId::new("decode0"),
        decode_rank: 0,
        decode_tp: 1,
        blocks,
        first_block: 0,
        prefill_pp,
        prompt: Prompt::len_only(tokens),
    })
}

#[test]
fn a_registration_sent_twice_is_a_duplicate_and_p_writes_once() {
    let mut cluster = registered_r1();
    let r1 = RequestId::new("r1");
    let blocks = cluster.decode_blocks("decode0", &r1).expect("decode0 is loading r1");
    let again = registration(&r1, blocks, 1, 64);
    cluster.send_as("decode0", "prefill0", &again).unwrap();
    cluster.advance_to(Time::from_millis(300));
    let duplicates_before = cluster.engine_counters("prefill0").duplicate_messages;
    cluster.prefill("prefill0", &r1, 64, 1, None).unwrap();
    cluster.advance_to(Time::from_millis(800));

    assert_eq!(cluster.decode_state("decode0", &r1).map(|s| s.as_str()), Some("ready"));
    assert_eq!(cluster.corrupt_reads(), 0);
    assert_eq!(cluster.written_after_free(), 0);
    assert_eq!(
        cluster.engine_counters("prefill0").duplicate_messages,
        duplicates_before + 1,
        "the second registration is counted as a duplicate when P settles what it staged"
    );
    // One write of the prompt's 4 blocks (the simulator's 2 KiB blocks), not two.
    let written = cluster.network().moved(&kv_core::AgentName::new(EngineId::new("prefill0"), 0), &r1);
    assert_eq!(written, 4 * 2048, "P wrote D's blocks once");
}

/// D counts the writes it awaits from P's pipeline stages; a registration that counts other
/// stages than P has would end too early or never, so P refuses it (answering that no write
/// will come) and writes nothing, while a registration that counts right goes on as usual.
#[test]
fn a_registration_counting_other_pipeline_stages_is_refused_and_nothing_is_written() {
    let mut cluster = registered_r1();
    let (r1, r2) = (RequestId::new("r1"), RequestId::new("r2"));
    let blocks = cluster.decode_blocks("decode0", &r1).expect("decode0 is loading r1");
    let miscounted = registration(&r2, blocks, 2, 64);
    let malformed_before = cluster.engine_counters("prefill0").malformed;
    cluster.send_as("decode0", "prefill0", &miscounted).unwrap();
    cluster.advance_to(Time::from_millis(300));
    cluster.prefill("prefill0", &r1, 64, 1, None).unwrap();
    cluster.prefill("prefill0", &r2, 64, 1, None).unwrap();
    cluster.advance_to(Time::from_millis(800));

    assert_eq!(cluster.engine_counters("prefill0").malformed, malformed_before + 1, "the miscounted one is refused");
    let p0 = kv_core::AgentName::new(EngineId::new("prefill0"), 0);
    assert_eq!(cluster.network().moved(&p0, &r2), 0, "nothing is written for it");
    assert_eq!(cluster.held_blocks("prefill0"), 4, "r2's export waits for a registration that counts right");
    assert_eq!(cluster.decode_state("decode0", &r1).map(|s| s.as_str()), Some("ready"));
    assert_eq!(cluster.network().moved(&p0, &r1), 4 * 2048);
    assert_eq!(cluster.corrupt_reads(), 0);
}

/// A registration whose prompt is not the one P computed (a handoff rebuilt wrong, edited or
/// replayed) gets no write: P answers that none will come and frees the export (`rejected`) at
/// once, without waiting for its lease; D's load fails, and its blocks never hold another
/// prompt's KV.
#[test]
fn a_registration_for_another_prompt_is_refused_and_the_export_freed_at_once() {
    let mut cluster = registered_r1();
    let r2 = RequestId::new("r2");
    let blocks = cluster.decode_blocks("decode0", &RequestId::new("r1")).expect("decode0 is loading r1");
    let other = registration(&r2, blocks, 1, 48);
    cluster.send_as("decode0", "prefill0", &other).unwrap();
    cluster.advance_to(Time::from_millis(300));
    let refused_before = cluster.engine_counters("prefill0").claims_refused;
    cluster.prefill("prefill0", &r2, 64, 1, None).unwrap();
    cluster.advance_to(Time::from_millis(400));

    assert_eq!(cluster.engine_counters("prefill0").claims_refused, refused_before + 1);
    assert_eq!(cluster.release_reason("prefill0", &r2), Some(ReleaseReason::Rejected), "freed at once");
    let p0 = kv_core::AgentName::new(EngineId::new("prefill0"), 0);
    assert_eq!(cluster.network().moved(&p0, &r2), 0, "nothing is written for it");
    assert_eq!(cluster.corrupt_reads(), 0);
}

/// NixlPushConnector's proxy pairs P's and D's legs by a `transfer_id`, each leg under its own
/// request id (a router that does not forward `X-Request-Id`): D's claim and registration name
/// the transfer id, P pairs it with its own request, writes into D's blocks, and frees the
/// export as transferred. A registration naming no export (a transfer id P never paired) gets
/// no write and holds nothing at P.
#[test]
fn legs_under_their_own_ids_pair_by_transfer_id() {
    let scenario = Scenario::from_toml_str(
        r#"
        name = "D's leg names P's by a transfer id"
        [cluster]
        mode = "push"
        "#,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let mut cluster = Cluster::new(cluster_config(&scenario, 0)).unwrap_or_else(|e| panic!("{e}"));
    let (p1, d1, t1) = (RequestId::new("cmpl-aaaa-0"), RequestId::new("cmpl-bbbb-0"), RequestId::new("xfer-1"));
    let (d2, t2) = (RequestId::new("cmpl-cccc-0"), RequestId::new("xfer-unknown"));
    cluster.pair("prefill0", &p1, &t1).unwrap();
    cluster.arrive("decode0", &d1, "prefill0", &t1, Some(64), None).unwrap();
    cluster.arrive("decode0", &d2, "prefill0", &t2, Some(64), None).unwrap();
    cluster.advance_to(Time::from_millis(50));
    cluster.schedule("decode0", &d1, false).unwrap();
    cluster.schedule("decode0", &d2, false).unwrap();
    cluster.advance_to(Time::from_millis(100));
    cluster.prefill("prefill0", &p1, 64, 1, None).unwrap();
    cluster.advance_to(Time::from_millis(600));

    assert_eq!(cluster.decode_state("decode0", &d1).map(|s| s.as_str()), Some("ready"));
    assert_eq!(cluster.release_reason("prefill0", &p1), Some(ReleaseReason::Transferred));
    assert_eq!(cluster.corrupt_reads(), 0);
    let p0 = kv_core::AgentName::new(EngineId::new("prefill0"), 0);
    assert_eq!(cluster.network().moved(&p0, &d1), 4 * 2048, "P wrote D's blocks once, its completion naming D's id");
    assert_eq!(cluster.held_blocks("prefill0"), 0);
    assert_ne!(cluster.decode_state("decode0", &d2).map(|s| s.as_str()), Some("ready"), "nothing came for it");
}

/// The same pairing when P is already computing the prompt as D registers (vLLM's push proxy
/// sends both legs at once): the registration naming the transfer id waits for the export P
/// registers under its own id, and P writes into it.
#[test]
fn a_registration_naming_a_transfer_id_while_p_computes_is_written() {
    let scenario = Scenario::from_toml_str("name = \"pairing while P computes\"\n[cluster]\nmode = \"push\"\n")
        .unwrap_or_else(|e| panic!("{e}"));
    let mut cluster = Cluster::new(cluster_config(&scenario, 0)).unwrap_or_else(|e| panic!("{e}"));
    let (p1, d1, t1) = (RequestId::new("cmpl-aaaa-0"), RequestId::new("cmpl-bbbb-0"), RequestId::new("xfer-1"));
    cluster.pair("prefill0", &p1, &t1).unwrap();
    cluster.begin_prefill("prefill0", &p1, 64, None).unwrap();
    cluster.progress("prefill0", &p1, 32).unwrap();
    cluster.advance_to(Time::from_millis(20));
    cluster.arrive("decode0", &d1, "prefill0", &t1, Some(64), None).unwrap();
    cluster.advance_to(Time::from_millis(50));
    cluster.schedule("decode0", &d1, false).unwrap();
    cluster.advance_to(Time::from_millis(100));
    cluster.progress("prefill0", &p1, 64).unwrap();
    cluster.finish_prefill("prefill0", &p1).unwrap();
    cluster.advance_to(Time::from_millis(600));

    assert_eq!(cluster.decode_state("decode0", &d1).map(|s| s.as_str()), Some("ready"));
    assert_eq!(cluster.release_reason("prefill0", &p1), Some(ReleaseReason::Transferred));
    assert_eq!(cluster.corrupt_reads(), 0);
    assert_eq!(cluster.held_blocks("prefill0"), 0);
}
