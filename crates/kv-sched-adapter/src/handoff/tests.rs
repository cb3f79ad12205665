//! The handoff's forms, as routers send them, and what D refuses.

use super::*;
use kv_core::Digest;

const TOKENS: [u32; 40] = [7; 40];

fn prompt() -> Prompt {
    Prompt::of_tokens(&TOKENS)
}

fn arrival(mode: Mode) -> Arrival {
    Arrival { mode, prompt: prompt(), block_size: 16 }
}

fn remote() -> RemoteRef {
    RemoteRef {
        prefill: PrefillEngine {
            engine: EngineId::new("prefill0"),
            addresses: vec![PeerAddress::of_rank("10.0.0.1:5600", 0), PeerAddress::of_rank("10.0.0.1:5600", 1)],
            tp_size: 2,
            pp_size: 1,
        },
        request: RequestId::new("cmpl-1"),
        instance: Some(3),
        prompt_tokens: 40,
        prompt_digest: prompt().digest,
        export: Some(ExportInfo {
            blocks: vec![BlockId(4), BlockId(5), BlockId(6)],
            deadline: Time::from_millis(30_000),
            finished: Some(Time::from_millis(1)),
        }),
        consumer: Some(Consumer { engine: EngineId::new("decode0"), instance: 9 }),
    }
}

/// The cluster key P vouches with and D checks.
fn key() -> ClusterKey {
    ClusterKey::from_bytes(&[5; 32]).unwrap()
}

fn params(json: serde_json::Value) -> TransferParams {
    serde_json::from_value(json).expect("parses")
}

fn refusal(params: TransferParams, mode: Mode) -> HandoffError {
    params.resolve(&arrival(mode), &key()).expect_err("refused")
}

#[test]
fn p_answer_carries_both_forms_and_d_takes_it_back_unchanged() {
    let answer = TransferParams::answer(&remote(), 16, &key());
    let json = serde_json::to_value(&answer).unwrap();
    assert_eq!(json["remote_host"], "10.0.0.1");
    assert_eq!(json["remote_port"], 5600);
    assert_eq!(json["remote_engine_id"], "prefill0");
    assert_eq!(json["remote_request_id"], "cmpl-1");
    assert_eq!(json["remote_block_ids"], serde_json::json!([4, 5, 6]));
    assert_eq!(json["tp_size"], 2);
    assert_eq!(json["kvflow_version"], HANDOFF_VERSION);
    assert_eq!(json["do_remote_prefill"], true);
    assert_eq!(json["kvflow"]["prompt_digest"], serde_json::Value::String(prompt().digest.unwrap().to_hex()));
    assert_eq!(params(json.clone()).resolve(&arrival(Mode::Pull), &key()), Ok(Some(remote())));

    // A router that rebuilt NixlConnector's fields alone: the same P ranks, request and blocks,
    // and nothing the claim does not check again (incarnation, lease, digest).
    let mut newer = json.clone();
    newer["kvflow_version"] = serde_json::json!(HANDOFF_VERSION + 1);
    let err = refusal(params(newer), Mode::Pull);
    assert_eq!(err.reason, HandoffRefusal::UnsupportedForm);
    assert!(err.detail.contains(&format!("version {}", HANDOFF_VERSION + 1)), "{err}");
    assert!(err.remote.is_some(), "rejected at P");

    let mut rebuilt = json.as_object().unwrap().clone();
    rebuilt.remove("kvflow");
    rebuilt.remove("kvflow_layout");
    rebuilt.remove("kvflow_version");
    let taken = params(rebuilt.into()).resolve(&arrival(Mode::Pull), &key()).unwrap().expect("a handoff");
    assert_eq!(taken.prefill, remote().prefill);
    assert_eq!(taken.request, remote().request);
    assert_eq!(taken.export.as_ref().unwrap().blocks, remote().export.unwrap().blocks);
    assert_eq!((taken.instance, taken.prompt_digest, taken.consumer), (None, None, None));
    assert_eq!(taken.export.unwrap().deadline, Time::ZERO, "D waits for P's deadline");
}

#[test]
fn parameters_without_a_remote_prefill_are_no_handoff() {
    assert_eq!(params(serde_json::json!({})).resolve(&arrival(Mode::Pull), &key()), Ok(None));
    let json = serde_json::json!({"do_remote_decode": true, "unknown": [1, 2], "do_remote_prefill": null});
    assert_eq!(params(json).resolve(&arrival(Mode::Pull), &key()), Ok(None));
}

#[test]
fn a_handoff_made_for_another_prompt_is_refused_naming_both() {
    let shorter = RemoteRef { prompt_tokens: 39, ..remote() };
    let err = refusal(TransferParams::answer(&shorter, 16, &key()), Mode::Pull);
    assert_eq!(err.reason, HandoffRefusal::OtherPrompt);
    assert!(err.detail.contains("40 prompt tokens, P computed 39"), "{err}");
    assert_eq!(err.remote.as_ref().map(|r| &r.request), Some(&RequestId::new("cmpl-1")), "rejected at P");

    let other = RemoteRef { prompt_digest: Some(Digest::of_tokens(&[8; 40])), ..remote() };
    let err = refusal(TransferParams::answer(&other, 16, &key()), Mode::Pull);
    assert_eq!(err.reason, HandoffRefusal::OtherPrompt);
    assert!(err.detail.contains("not the ones P computed"), "{err}");
}

#[test]
fn blocks_that_do_not_fit_the_prompt_are_refused() {
    let mut json = serde_json::to_value(TransferParams::answer(&remote(), 16, &key())).unwrap();
    json["kvflow"]["export"]["blocks"] = serde_json::json!([4, 5]);
    let err = refusal(params(json), Mode::Pull);
    assert_eq!(err.reason, HandoffRefusal::BlockCount);
    assert!(err.detail.contains("2 blocks, where 40 tokens fill 3 of 16"), "{err}");

    let err = refusal(TransferParams::answer(&remote(), 32, &key()), Mode::Pull);
    assert_eq!(err.reason, HandoffRefusal::BlockSize);
    assert!(err.detail.contains("32 tokens, this engine's 16"), "{err}");

    // NixlConnector's form: D's own prompt decides how many blocks it needs.
    let json = serde_json::json!({
        "do_remote_prefill": true, "remote_engine_id": "p", "remote_host": "h", "remote_port": 5600,
        "remote_request_id": "r", "remote_block_ids": [1, 2, 3, 4], "tp_size": 1,
    });
    assert_eq!(refusal(params(json), Mode::Pull).reason, HandoffRefusal::BlockCount);
}

#[test]
fn nixl_connector_pull_form_reaches_each_p_rank_at_the_port_after_the_first() {
    let json = serde_json::json!({
        "do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id": "prefill-a",
        "remote_host": "::1", "remote_port": 5600, "remote_request_id": "cmpl-7-0",
        "remote_block_ids": [[9, 8, 7]], "tp_size": 4,
    });
    let remote = params(json).resolve(&arrival(Mode::Pull), &key()).unwrap().unwrap();
    let addresses: Vec<&str> = remote.prefill.addresses.iter().map(|a| a.0.as_str()).collect();
    assert_eq!(addresses, ["[::1]:5600/tp0", "[::1]:5600/tp1", "[::1]:5600/tp2", "[::1]:5600/tp3"]);
    assert_eq!(remote.prefill.engine, EngineId::new("prefill-a"));
    assert_eq!(remote.export.unwrap().blocks, [BlockId(9), BlockId(8), BlockId(7)]);
    assert_eq!(remote.prompt_tokens, 40, "D's own prompt, which its claim names");
}

#[test]
fn incomplete_malformed_and_huge_handoffs_are_refused_by_name() {
    let base = serde_json::json!({
        "do_remote_prefill": true, "remote_engine_id": "p", "remote_host": "h", "remote_port": 5600,
        "remote_request_id": "r", "remote_block_ids": [1, 2, 3], "tp_size": 1,
    });
    let with = |key: &str, value: serde_json::Value| {
        let mut json = base.clone();
        json[key] = value;
        params(json)
    };
    let err = refusal(with("remote_host", serde_json::Value::Null), Mode::Pull);
    assert_eq!(
        (err.reason, err.detail.as_str()),
        (HandoffRefusal::Incomplete, "NixlConnector's pull form without remote_host")
    );
    let err = refusal(with("tp_size", serde_json::json!(1u64 << 40)), Mode::Pull);
    assert_eq!(err.reason, HandoffRefusal::Malformed);
    assert!(err.detail.contains("tp_size 1099511627776 x pp_size 1 is not in 1..=1024 ranks"), "{err}");
    let err = refusal(with("remote_port", serde_json::json!(70_000)), Mode::Pull);
    assert!(err.detail.contains("remote_port 70000 is not a port (1 to 65535)"), "{err}");
    let two = with("tp_size", serde_json::json!(2)).resolve(&arrival(Mode::Pull), &key()).unwrap().unwrap();
    assert_eq!(two.prefill.addresses.len(), 2, "the base form is fine at TP 2");
    let err = refusal(with("remote_block_ids", serde_json::json!([1, 2, 1u64 << 33])), Mode::Pull);
    assert!(err.detail.contains("block id 8589934592 is past u32"), "{err}");
    let err = refusal(with("remote_block_ids", serde_json::json!([[1], [2]])), Mode::Pull);
    assert_eq!(err.reason, HandoffRefusal::UnsupportedForm);
    let err = refusal(with("remote_host", serde_json::json!("a b")), Mode::Pull);
    assert_eq!(err.reason, HandoffRefusal::Malformed);
    let err = refusal(with("remote_request_id", serde_json::json!("x".repeat(300))), Mode::Pull);
    assert_eq!(err.reason, HandoffRefusal::Malformed);
    // Garbage where a field's type is fixed does not parse at all.
    assert!(serde_json::from_value::<TransferParams>(serde_json::json!({"remote_port": "five"})).is_err());
    assert!(serde_json::from_value::<TransferParams>(serde_json::json!({"kvflow": 12})).is_err());
}

#[test]
fn nixl_push_connector_form_names_the_export_by_its_transfer_id_in_push_mode_only() {
    let json = serde_json::json!({
        "do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id": "p", "remote_host": "h",
        "remote_port": 5600, "remote_request_id": null, "tp_size": 2, "pp_size": 1, "transfer_id": "t-1",
    });
    let taken = params(json.clone()).resolve(&arrival(Mode::Push), &key()).unwrap().unwrap();
    assert_eq!(taken.request, RequestId::new("t-1"));
    assert_eq!(taken.prefill.addresses, [PeerAddress::of_rank("h:5600", 0), PeerAddress::of_rank("h:5600", 1)]);
    assert_eq!((taken.export, taken.instance, taken.prompt_tokens), (None, None, 40));
    let err = refusal(params(json.clone()), Mode::Pull);
    assert_eq!(err.reason, HandoffRefusal::UnsupportedForm);
    assert!(err.detail.contains("sent to a pull engine"), "{err}");
    // Without a transfer id, P's request id pairs the legs (by base id at P).
    let mut by_id = json.clone();
    by_id["transfer_id"] = serde_json::Value::Null;
    by_id["remote_request_id"] = serde_json::json!("cmpl-9-0");
    let by_request = params(by_id.clone()).resolve(&arrival(Mode::Push), &key()).unwrap().unwrap();
    assert_eq!(by_request.request, RequestId::new("cmpl-9-0"));
    by_id["remote_request_id"] = serde_json::Value::Null;
    let err = refusal(params(by_id), Mode::Push);
    assert_eq!(
        (err.reason, err.detail.as_str()),
        (HandoffRefusal::Incomplete, "NixlPushConnector's push form without transfer_id")
    );
    let mut staged = json;
    staged["pp_size"] = serde_json::json!(2);
    let stages = params(staged).resolve(&arrival(Mode::Push), &key()).unwrap().unwrap();
    assert_eq!((stages.prefill.addresses.len(), stages.prefill.pp_size), (4, 2), "every stage's ranks");

    let err = refusal(params(serde_json::json!({"do_remote_prefill": true})), Mode::Push);
    assert_eq!(err.reason, HandoffRefusal::Incomplete);
    // kvflow's push form (D first, no export) is taken in push mode only.
    let early = RemoteRef { export: None, instance: None, consumer: None, ..remote() };
    let answer = TransferParams::answer(&early, 16, &key());
    assert_eq!(answer.clone().resolve(&arrival(Mode::Push), &key()), Ok(Some(early)));
    assert_eq!(refusal(answer, Mode::Pull).reason, HandoffRefusal::UnsupportedForm);
}

#[test]
fn a_request_refused_before_admission_rejects_what_it_names_whatever_its_prompt() {
    // vLLM submits it with a placeholder prompt of one token.
    let placeholder = Arrival { mode: Mode::Pull, prompt: Prompt::of_tokens(&[0]), block_size: 16 };
    let answer = TransferParams::answer(&remote(), 16, &key());
    let refused = answer.refused_before_admission(&placeholder, &key()).unwrap().expect("names an export");
    assert_eq!(refused.reason, HandoffRefusal::Refused);
    assert_eq!(refused.remote.as_deref(), Some(&remote()), "rejected at P");
    assert_eq!(params(serde_json::json!({})).refused_before_admission(&placeholder, &key()), Ok(None));
}

#[test]
fn only_a_handoff_p_vouched_for_lets_d_read_before_p_answered_its_claim() {
    let answer = serde_json::to_value(TransferParams::answer(&remote(), 16, &key())).unwrap();
    assert_eq!(answer["kvflow_vouch"].as_str().map(str::len), Some(64), "{answer}");
    // P's own answer, as it made it: deadline and named consumer kept.
    assert_eq!(params(answer.clone()).resolve(&arrival(Mode::Pull), &key()), Ok(Some(remote())));

    // What D takes from a handoff P did not vouch for: neither P's deadline nor its named
    // consumer, so it reads once P has answered its claim (which names D's own prompt and the
    // blocks it reads, and which P refuses for anything but what it computed).
    let unvouched = |remote: RemoteRef| RemoteRef {
        export: remote.export.map(|e| ExportInfo { deadline: Time::ZERO, ..e }),
        consumer: None,
        ..remote
    };
    // A client's handoff: P's answer with a field of kvflow's changed, its vouch kept.
    let changes: [(&str, serde_json::Value); 5] = [
        ("/kvflow/request", "cmpl-2".into()),
        ("/kvflow/export/blocks", serde_json::json!([7, 8, 9])),
        ("/kvflow/export/deadline", serde_json::json!(u64::MAX / 2)),
        ("/kvflow/consumer/instance", serde_json::json!(10)),
        ("/kvflow/instance", serde_json::json!(4)),
    ];
    for (field, value) in changes {
        let mut forged = answer.clone();
        *forged.pointer_mut(field).unwrap() = value;
        let taken = params(forged.clone()).resolve(&arrival(Mode::Pull), &key()).unwrap().unwrap();
        let as_sent: RemoteRef = serde_json::from_value(forged["kvflow"].clone()).unwrap();
        assert_eq!(taken, unvouched(as_sent), "{field}");
    }
    for vouch in [serde_json::json!("00"), serde_json::json!("zz".repeat(32)), serde_json::json!("ab".repeat(32))] {
        let mut forged = answer.clone();
        forged["kvflow_vouch"] = vouch.clone();
        assert_eq!(params(forged).resolve(&arrival(Mode::Pull), &key()), Ok(Some(unvouched(remote()))), "{vouch}");
    }
    // Another cluster's key, no key, or no vouch: the same.
    let other = ClusterKey::from_bytes(&[6; 32]).unwrap();
    assert_eq!(params(answer.clone()).resolve(&arrival(Mode::Pull), &other), Ok(Some(unvouched(remote()))));
    assert_eq!(
        params(answer.clone()).resolve(&arrival(Mode::Pull), &ClusterKey::none()),
        Ok(Some(unvouched(remote())))
    );
    let mut bare = answer;
    bare.as_object_mut().unwrap().remove("kvflow_vouch");
    assert_eq!(params(bare).resolve(&arrival(Mode::Pull), &key()), Ok(Some(unvouched(remote()))));
    let keyless = serde_json::to_value(TransferParams::answer(&remote(), 16, &ClusterKey::none())).unwrap();
    assert!(keyless.get("kvflow_vouch").is_none(), "the null key vouches for nothing: {keyless}");
}

#[test]
fn the_vouched_bytes_change_with_every_field() {
    let base = vouched_bytes(&remote(), 16);
    let mut changed = vec![
        RemoteRef { request: RequestId::new("cmpl-2"), ..remote() },
        RemoteRef { instance: None, ..remote() },
        RemoteRef { prompt_tokens: 41, ..remote() },
        RemoteRef { prompt_digest: None, ..remote() },
        RemoteRef { export: None, ..remote() },
        RemoteRef { consumer: None, ..remote() },
    ];
    let mut engine = remote();
    engine.prefill.engine = EngineId::new("prefill1");
    let mut address = remote();
    address.prefill.addresses[1] = PeerAddress::of_rank("10.0.0.1:5601", 1);
    let (mut tp, mut pp) = (remote(), remote());
    tp.prefill.tp_size = 1;
    pp.prefill.pp_size = 2;
    let (mut blocks, mut deadline, mut finished) = (remote(), remote(), remote());
    blocks.export.as_mut().unwrap().blocks.push(BlockId(7));
    deadline.export.as_mut().unwrap().deadline = Time::from_millis(30_001);
    finished.export.as_mut().unwrap().finished = None;
    let mut consumer = remote();
    consumer.consumer.as_mut().unwrap().engine = EngineId::new("decode1");
    changed.extend([engine, address, tp, pp, blocks, deadline, finished, consumer]);
    for other in &changed {
        assert_ne!(vouched_bytes(other, 16), base, "{other:?}");
    }
    assert_ne!(vouched_bytes(&remote(), 32), base, "the block size");
}
