//! A scheduler's commands and its ranks' reports serialize, so that an engine whose ranks are
//! processes of their own (vLLM's workers: one per TP rank, the scheduler in another) can carry
//! them between processes, and come back equal.

use std::time::Duration;

use kv_core::{BlockId, EngineId, PeerAddress, Prompt, RequestId, Time};
use kv_sched_adapter::{
    Consumer, DecodeCommand, DecodeReport, ExportInfo, LayerProgress, LoadOutcome, PrefillCommand, PrefillEngine,
    PrefillReport, ReleaseReason, RemoteRef,
};
use serde::de::DeserializeOwned;
use serde::Serialize;

fn round_trip<T: Serialize + DeserializeOwned + PartialEq + std::fmt::Debug>(value: &T) -> serde_json::Value {
    let json = serde_json::to_value(value).expect("serializes");
    let back: T = serde_json::from_value(json.clone()).expect("parses");
    assert_eq!(&back, value);
    json
}

fn prefill() -> PrefillEngine {
    PrefillEngine {
        engine: EngineId::new("prefill0"),
        addresses: vec![PeerAddress("10.0.0.1:5600".into())],
        tp_size: 1,
        pp_size: 1,
    }
}

fn remote() -> RemoteRef {
    RemoteRef {
        prefill: prefill(),
        request: RequestId::new("req-1"),
        instance: Some(7),
        prompt_tokens: 40,
        prompt_digest: Some(Prompt::of_tokens(&[3; 40]).digest.unwrap()),
        export: Some(ExportInfo {
            blocks: vec![BlockId(7), BlockId(8), BlockId(9)],
            deadline: Time::from_nanos(30_000_000_000),
            finished: Some(Time::from_nanos(12_345)),
        }),
        consumer: None,
    }
}

#[test]
fn prefill_commands_and_reports_round_trip() {
    let consumer = Some(Consumer { engine: EngineId::new("decode1"), instance: 3 });
    let export = PrefillCommand::Export {
        request: RequestId::new("req-1"),
        blocks: vec![BlockId(1), BlockId(2)],
        deadline: Time::from_nanos(5_000_000_000),
        consumer: consumer.clone(),
        prompt: Prompt::of_tokens(&[1, 2, 3]),
        transfer: Some(RequestId::new("t-1")),
    };
    let json = round_trip(&export);
    assert_eq!(json["export"]["prompt"]["tokens"], 3);
    assert_eq!(json["export"]["transfer"], "t-1");
    assert_eq!(json["export"]["prompt"]["digest"].as_str().map(str::len), Some(32), "hex: {json}");
    assert_eq!(json["export"]["blocks"], serde_json::json!([1, 2]));
    assert_eq!(json["export"]["consumer"]["engine"], "decode1");
    let progress = |part| PrefillCommand::Progress {
        request: RequestId::new("req-2"),
        blocks: vec![BlockId(4), BlockId(5)],
        consumer: consumer.clone(),
        part,
        transfer: None,
    };
    let json = round_trip(&progress(None));
    assert!(json["progress"].get("part").is_none(), "a chunk-wise report says nothing of layers: {json}");
    let json = round_trip(&progress(Some(LayerProgress { whole: 1, layers: 3 })));
    assert_eq!(json["progress"]["part"], serde_json::json!({ "whole": 1, "layers": 3 }));
    round_trip(&PrefillCommand::Abandon { request: RequestId::new("req-3") });
    for reason in [ReleaseReason::Transferred, ReleaseReason::Expired, ReleaseReason::PeerLost] {
        let json = round_trip(&PrefillReport::Released { request: RequestId::new("req-1"), reason });
        assert!(json["released"]["reason"].is_string(), "{json}");
    }
}

#[test]
fn decode_commands_and_reports_round_trip() {
    let prompt = Prompt::of_tokens(&[3; 40]);
    let json =
        round_trip(&DecodeCommand::Track { request: RequestId::new("req-1"), remote: Box::new(remote()), prompt });
    assert_eq!(json["track"]["remote"]["prompt_digest"], json["track"]["prompt"]["digest"]);
    let json = round_trip(&DecodeCommand::Load {
        request: RequestId::new("req-1"),
        blocks: vec![BlockId(4), BlockId(5)],
        cached_blocks: 1,
    });
    assert_eq!(json["load"]["cached_blocks"], 1);
    round_trip(&DecodeCommand::Reject { remote: remote() });
    round_trip(&DecodeCommand::Abort { request: RequestId::new("req-1") });
    round_trip(&DecodeCommand::Connect { prefill: prefill() });
    for outcome in [LoadOutcome::Loaded, LoadOutcome::Failed, LoadOutcome::Aborted] {
        round_trip(&DecodeReport::Finished {
            request: RequestId::new("req-1"),
            outcome,
            kv_latency: Some(Duration::from_micros(3_250)),
            kept_blocks: 2,
        });
    }
    let json = round_trip(&DecodeReport::Quarantined { request: RequestId::new("req-1") });
    assert_eq!(json, serde_json::json!({"quarantined": {"request": "req-1"}}));
}

#[test]
fn a_malformed_command_is_refused_naming_what_is_wrong() {
    let err = serde_json::from_str::<PrefillCommand>(r#"{"export": {"request": "req-1"}}"#).unwrap_err();
    assert!(err.to_string().contains("missing field `blocks`"), "{err}");
    let err = serde_json::from_str::<DecodeCommand>(r#"{"evict": {"request": "req-1"}}"#).unwrap_err();
    assert!(err.to_string().contains("unknown variant `evict`"), "{err}");
}
