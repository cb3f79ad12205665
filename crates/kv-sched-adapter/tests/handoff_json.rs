//! The handoff P gives the router and the router gives D ([`RemoteRef`]) travels as one JSON
//! object, as vLLM's `kv_transfer_params` carry it, and comes back equal.

use kv_core::{BlockId, EngineId, PeerAddress, RequestId, Time};
use kv_sched_adapter::{Consumer, ExportInfo, PrefillEngine, RemoteRef};

fn handoff() -> RemoteRef {
    RemoteRef {
        prefill: PrefillEngine {
            engine: EngineId::new("prefill0"),
            addresses: vec![PeerAddress("10.0.0.1:5600".into()), PeerAddress("10.0.0.1:5601".into())],
            tp_size: 2,
            pp_size: 1,
        },
        request: RequestId::new("req-1"),
        instance: Some(7),
        prompt_tokens: 40,
        prompt_digest: None,
        export: Some(ExportInfo {
            blocks: vec![BlockId(7), BlockId(8), BlockId(9)],
            deadline: Time::from_nanos(30_000_000_000),
            finished: Some(Time::from_nanos(12_345)),
        }),
        consumer: Some(Consumer { engine: EngineId::new("decode1"), instance: 3 }),
    }
}

#[test]
fn the_handoff_round_trips_as_one_json_object() {
    let remote = handoff();
    let json = serde_json::to_value(&remote).expect("serializes");
    let object = json.as_object().expect("one JSON object");
    let keys: Vec<&str> = object.keys().map(String::as_str).collect();
    assert_eq!(keys, ["consumer", "export", "instance", "prefill", "prompt_tokens", "request"]);
    assert_eq!(json["prefill"]["addresses"][1], "10.0.0.1:5601");
    assert_eq!(json["export"]["blocks"], serde_json::json!([7, 8, 9]));
    assert_eq!(json["export"]["deadline"], 30_000_000_000u64);
    let text = serde_json::to_string(&remote).expect("serializes");
    let back: RemoteRef = serde_json::from_str(&text).expect("parses");
    assert_eq!(back, remote);

    // D comes first in push mode: no export, no incarnation yet, no consumer.
    let early = RemoteRef { instance: None, export: None, consumer: None, ..handoff() };
    let back: RemoteRef = serde_json::from_str(&serde_json::to_string(&early).unwrap()).unwrap();
    assert_eq!(back, early);
}

#[test]
fn a_malformed_handoff_is_refused_naming_the_field() {
    let mut json = serde_json::to_value(handoff()).unwrap();
    json["prefill"]["tp_size"] = serde_json::json!("two");
    let err = serde_json::from_value::<RemoteRef>(json).expect_err("a string is no TP size");
    assert!(err.to_string().contains("invalid type: string \"two\""), "{err}");
    let mut json = serde_json::to_value(handoff()).unwrap();
    json.as_object_mut().unwrap().remove("request");
    let err = serde_json::from_value::<RemoteRef>(json).expect_err("no request id");
    assert!(err.to_string().contains("missing field `request`"), "{err}");
}
