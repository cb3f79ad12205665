//! Config's tests: vLLM's defaults, the read margin's bound, and the JSON engines already have.

use super::*;

#[test]
fn defaults_follow_vllm() {
    let c = Config::default();
    assert_eq!(c.heartbeat_interval, Duration::from_secs(5));
    assert_eq!(c.lease_extension, Duration::from_secs(20));
    assert_eq!(c.validate(), Ok(()));
    let slow = Config { heartbeat_interval: Duration::from_secs(25), ..c };
    assert_eq!(
        slow.validate().unwrap_err().to_string(),
        "heartbeat_interval 25s must be shorter than heartbeat_lease_extension 20s"
    );
    let zero = Config { kv_lease_duration: Duration::ZERO, ..c };
    assert_eq!(zero.validate().unwrap_err().to_string(), "kv_lease_duration must be positive, not 0");
}

#[test]
fn the_default_read_margin_follows_the_lease_and_heartbeat_cycle() {
    let ms = Duration::from_millis;
    // (lease, margin): half of extension - interval (lease / 4), at most vLLM's 5 s.
    for (lease, margin) in [(1, 250), (3, 750), (5, 1250), (9, 2250), (20, 5000), (30, 5000), (480, 5000)] {
        let c = Config::with_lease(Duration::from_secs(lease));
        assert_eq!(c.read_safety_margin, ms(margin), "lease {lease} s");
        assert_eq!(c.validate(), Ok(()), "lease {lease} s");
    }
    assert_eq!(Config::default_read_margin(ms(3000), ms(8000)), ms(2500));
    assert_eq!(Config::default_read_margin(ms(8000), ms(3000)), Duration::ZERO);
}

#[test]
fn a_margin_the_heartbeat_cycle_cannot_leave_is_refused_naming_the_values() {
    let nine = Config::with_lease(Duration::from_secs(9));
    // The fixed 5 s margin of old, with a 9 s lease (issue 30): reads late in a cycle were fenced.
    let old = Config { read_safety_margin: Duration::from_secs(5), ..nine };
    assert_eq!(
        old.validate().unwrap_err().to_string(),
        "read_safety_margin 5s must be shorter than heartbeat_lease_extension 6s minus heartbeat_interval 1.5s \
         (4.5s), what a renewed lease has left when the next heartbeat is acknowledged"
    );
    let at_the_bound = Config { read_safety_margin: Duration::from_millis(4500), ..nine };
    assert!(matches!(at_the_bound.validate(), Err(ConfigError::MarginTooLong { .. })));
    assert_eq!(Config { read_safety_margin: Duration::from_millis(4499), ..nine }.validate(), Ok(()));
    assert_eq!(Config { read_safety_margin: Duration::ZERO, ..nine }.validate(), Ok(()));
}

/// What `json` (a `kv_connector_extra_config`) reads as: the settings, or the error's text.
#[cfg(feature = "serde")]
fn read(json: &str) -> Result<Config, String> {
    serde_json::from_str::<Config>(json).map_err(|e| e.to_string())
}

#[cfg(feature = "serde")]
#[test]
fn extra_config_reads_vllm_keys_in_seconds_with_defaults_from_the_lease() {
    let secs = Duration::from_secs;
    assert_eq!(read("{}"), Ok(Config::default()));
    let c = read(r#"{"kv_lease_duration": 12}"#).unwrap();
    assert_eq!((c.heartbeat_interval, c.lease_extension, c.push_quarantine), (secs(2), secs(8), secs(24)));
    let c = read(r#"{"mode": "push", "decoder_kv_blocks_ttl": 60, "kv_load_failure_policy": "fail"}"#).unwrap();
    assert_eq!((c.mode, c.kv_load_failure_policy), (Mode::Push, LoadFailurePolicy::Fail));
    assert_eq!((c.decoder_kv_blocks_ttl, c.push_registration_timeout), (secs(60), secs(60)));
    let c = read(r#"{"heartbeat_interval": 0.5, "heartbeat_lease_extension": 2.5, "read_safety_margin": 1}"#);
    let c = c.unwrap();
    assert_eq!((c.heartbeat_interval, c.lease_extension), (Duration::from_millis(500), Duration::from_millis(2500)));
    assert_eq!(c.read_safety_margin, secs(1));
    assert_eq!(read(r#"{"kv_descriptors": "auto"}"#).unwrap().descriptors, None);
    assert_eq!(read(r#"{"kv_descriptors": "pairs"}"#).unwrap().descriptors, Some(kv_core::Descriptors::Pairs));
    let prepared = read(r#"{"kv_descriptors": "prepared"}"#).unwrap().descriptors;
    assert_eq!(prepared, Some(kv_core::Descriptors::Prepared));
}

#[cfg(feature = "serde")]
#[test]
fn extra_config_derives_the_margin_from_the_interval_and_extension_it_gives() {
    let c = read(r#"{"heartbeat_interval": 5, "heartbeat_lease_extension": 8}"#).unwrap();
    assert_eq!(c.read_safety_margin, Duration::from_millis(1500));
    let c = read(r#"{"kv_lease_duration": 1}"#).unwrap();
    assert_eq!(c.read_safety_margin, Duration::from_millis(250));
    let c = read(r#"{"num_threads": 8, "backends": ["UCX"]}"#).unwrap();
    assert_eq!((c.num_threads, c.ucx_params()), (Some(8), vec![("num_threads".to_owned(), "8".to_owned())]));
    assert_eq!(read("{}").unwrap().ucx_params(), vec![]);
}

/// What `json` (a whole `kv_transfer_config`) reads as: the settings, or the error's text.
#[cfg(feature = "serde")]
fn transfer(json: &str) -> Result<Config, String> {
    let transfer = serde_json::from_str::<KvTransferConfig>(json).map_err(|e| e.to_string())?;
    Config::from_kv_transfer_config(&transfer).map_err(|e| e.to_string())
}

#[cfg(feature = "serde")]
#[test]
fn kv_transfer_config_reads_as_vllm_users_write_it() {
    let json = r#"{"kv_connector": "NixlPushConnector", "kv_role": "kv_both", "kv_load_failure_policy": "fail",
        "kv_connector_extra_config": {"kv_lease_duration": 20, "heartbeat_interval": 3, "backends": ["UCX"],
        "num_threads": 4}}"#;
    let parsed: KvTransferConfig = serde_json::from_str(json).unwrap();
    assert_eq!(parsed.kv_role, Some(KvRole::Both));
    let c = Config::from_kv_transfer_config(&parsed).unwrap();
    assert_eq!((c.mode, c.kv_load_failure_policy), (Mode::Push, LoadFailurePolicy::Fail));
    let secs = Duration::from_secs;
    assert_eq!((c.kv_lease_duration, c.heartbeat_interval), (secs(20), secs(3)));
    assert_eq!((c.lease_extension, c.push_quarantine), (secs(40) / 3, secs(40)));
    assert_eq!(c.read_safety_margin, secs(5), "(13.3 s - 3 s) / 2 is over 5 s");
    assert_eq!(c.num_threads, Some(4));
    assert_eq!(c.ucx_params(), vec![("num_threads".to_owned(), "4".to_owned())]);
    assert_eq!((c.decoder_kv_blocks_ttl, c.push_registration_timeout), (secs(480), secs(480)));

    // The connector's name gives the mode; the top level's policy is vLLM's default, fail.
    let c = transfer(r#"{"kv_connector": "NixlConnector"}"#).unwrap();
    assert_eq!(c, Config { kv_load_failure_policy: LoadFailurePolicy::Fail, ..Config::default() });
    for (name, mode) in [
        ("NixlConnector", Mode::Pull),
        ("NixlPullConnector", Mode::Pull),
        ("KvflowConnector", Mode::Pull),
        ("NixlPushConnector", Mode::Push),
        ("KvflowPushConnector", Mode::Push),
    ] {
        let c = transfer(&format!(
            r#"{{"kv_connector": "{name}", "kv_connector_extra_config": {{"mode": "{}"}}}}"#,
            mode.as_str()
        ));
        assert_eq!(c.map(|c| c.mode), Ok(mode), "{name}");
    }
    // kvflow's own key in the extra config, agreeing with the top level.
    let json = r#"{"kv_connector": "KvflowConnector", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"kv_load_failure_policy": "recompute"}}"#;
    assert_eq!(transfer(json).unwrap().kv_load_failure_policy, LoadFailurePolicy::Recompute);
    let json =
        r#"{"kv_connector": "KvflowConnector", "kv_connector_extra_config": {"kv_load_failure_policy": "fail"}}"#;
    assert_eq!(transfer(json).unwrap().kv_load_failure_policy, LoadFailurePolicy::Fail);
    // vLLM's own keys are accepted and not read.
    let json = r#"{"kv_connector": "NixlConnector", "kv_role": "kv_consumer", "engine_id": "decode0",
        "kv_connector_module_path": "kvflow.vllm", "kv_buffer_device": "cpu", "kv_buffer_size": 1e9, "kv_rank": null,
        "kv_parallel_size": 1, "kv_ip": "127.0.0.1", "kv_port": 14579, "enable_permute_local_kv": false}"#;
    let parsed: KvTransferConfig = serde_json::from_str(json).unwrap();
    assert_eq!((parsed.kv_role, parsed.engine_id.as_deref()), (Some(KvRole::Consumer), Some("decode0")));
    assert_eq!(parsed.kv_connector_module_path.as_deref(), Some("kvflow.vllm"));
    assert_eq!(Config::from_kv_transfer_config(&parsed).unwrap().mode, Mode::Pull);
}

#[cfg(feature = "serde")]
#[test]
fn kv_transfer_config_refuses_what_disagrees_naming_the_values() {
    let check = |json: &str, expected: &str| {
        let err = transfer(json).unwrap_err();
        assert!(err.contains(expected), "{json}: {err:?} does not say {expected:?}");
    };
    check(
        r#"{"kv_connector": "NixlConnector", "kv_connector_extra_config": {"mode": "push"}}"#,
        r#"kv_connector_extra_config has mode "push", but kv_connector "NixlConnector" is pull"#,
    );
    check(
        r#"{"kv_connector": "KvflowPushConnector", "kv_connector_extra_config": {"mode": "pull"}}"#,
        r#"kv_connector_extra_config has mode "pull", but kv_connector "KvflowPushConnector" is push"#,
    );
    check(
        r#"{"kv_connector": "NixlConnector", "kv_connector_extra_config": {"kv_load_failure_policy": "recompute"}}"#,
        r#"kv_connector_extra_config has kv_load_failure_policy "recompute", but kv_transfer_config has "fail" (vLLM's default, left out); vLLM reads the top level's"#,
    );
    check(
        r#"{"kv_connector": "NixlConnector", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"kv_load_failure_policy": "fail"}}"#,
        r#"kv_connector_extra_config has kv_load_failure_policy "fail", but kv_transfer_config has "recompute"; vLLM"#,
    );
    check(
        r#"{"kv_connector": "NixlConnector", "kv_connector_extra_config": {"backends": ["UCX", "GDS"]}}"#,
        r#"backends ["UCX", "GDS"] is not supported: kvflow runs NIXL's UCX backend only, ["UCX"]"#,
    );
    check(
        r#"{"kv_connector": "NixlConnector", "kv_connector_extra_config": {"backends": []}}"#,
        "backends [] is not supported",
    );
    check(
        r#"{"kv_connector": "LMCacheConnectorV1"}"#,
        r#"kv_connector "LMCacheConnectorV1" is not kvflow's: NixlConnector, NixlPullConnector and KvflowConnector pull, NixlPushConnector and KvflowPushConnector push"#,
    );
    check(r#"{"kv_role": "kv_both"}"#, "missing field `kv_connector`");
    check(r#"{"kv_connector": "NixlConnector", "kv_role": "both"}"#, "unknown variant `both`");
    check(
        r#"{"kv_connector": "NixlConnector", "kv_connector_extra_config": {"num_threads": -1}}"#,
        "invalid value: integer `-1`",
    );
    check(
        r#"{"kv_connector": "NixlConnector", "kv_connector_extra_config": {"kv_lease_duration": 9, "read_safety_margin": 5}}"#,
        "read_safety_margin 5s must be shorter than heartbeat_lease_extension 6s minus heartbeat_interval 1.5s (4.5s)",
    );
}

#[cfg(feature = "serde")]
#[test]
fn extra_config_refuses_bad_values_naming_key_and_value() {
    let check = |json: &str, expected: &str| {
        let err = read(json).unwrap_err();
        assert!(err.contains(expected), "{json}: {err:?} does not say {expected:?}");
    };
    check(r#"{"kv_lease_duration": -3}"#, "kv_lease_duration = -3.0 is not a duration in seconds");
    check(r#"{"push_quarantine": 1e300}"#, "push_quarantine = 1e300 is not a duration in seconds");
    check(r#"{"kv_lease_duration": 0}"#, "kv_lease_duration must be positive, not 0");
    check(r#"{"heartbeat_interval": 30}"#, "heartbeat_interval 30s must be shorter than heartbeat_lease_extension 20s");
    check(r#"{"kv_lease_durations": 30}"#, "unknown field `kv_lease_durations`");
    check(r#"{"kv_load_failure_policy": "retry"}"#, "unknown variant `retry`");
    check(r#"{"kv_lease_duration": "30"}"#, "invalid type: string \"30\"");
    check(
        r#"{"kv_descriptors": "indices"}"#,
        r#"kv_descriptors is "indices"; it must be "auto", "pairs" or "prepared""#,
    );
}

#[cfg(feature = "serde")]
#[test]
fn a_newer_vllm_s_fields_and_nixl_connector_s_keys_start_the_engine_and_are_named() {
    // A top-level field vLLM may add, and NixlConnector's extra keys kvflow does not act on.
    let json = r#"{"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_cache_offload": {"a": [1, 2]},
        "kv_roles": "kv_both", "kv_connector_extra_config": {"enforce_handshake_compat": false,
        "engine_ttl": 60, "kv_lease_duration": 12, "kv_recompute_threshold": 64, "bidirectional_kv_xfer": true}}"#;
    let parsed: KvTransferConfig = serde_json::from_str(json).unwrap();
    assert_eq!(parsed.kv_role, Some(KvRole::Producer), "the known keys still read");
    let config = Config::from_kv_transfer_config(&parsed).unwrap();
    assert_eq!(config.kv_lease_duration, Duration::from_secs(12));
    assert_eq!(
        parsed.ignored(),
        Ignored {
            top_level: vec!["kv_cache_offload".to_owned(), "kv_roles".to_owned()],
            nixl_keys: vec![
                "enforce_handshake_compat",
                "engine_ttl",
                "bidirectional_kv_xfer",
                "kv_recompute_threshold"
            ],
        }
    );
    let plain: KvTransferConfig = serde_json::from_str(r#"{"kv_connector": "NixlConnector"}"#).unwrap();
    assert_eq!(plain.ignored(), Ignored::default());
    // kvflow's own keys stay strict, and a NixlConnector key of the wrong type is named.
    let err = transfer(r#"{"kv_connector": "NixlConnector", "kv_connector_extra_config": {"engine_tll": 5}}"#);
    assert!(err.unwrap_err().contains("unknown field `engine_tll`"));
    let err = transfer(r#"{"kv_connector": "NixlConnector", "kv_connector_extra_config": {"engine_ttl": "x"}}"#);
    assert!(err.unwrap_err().contains("invalid type: string \"x\""));
}

#[cfg(feature = "serde")]
#[test]
fn the_old_abort_timeout_sets_the_lease_only_where_the_config_leaves_it_out() {
    let read = |json: &str| serde_json::from_str::<KvTransferConfig>(json).unwrap();
    let plain = read(r#"{"kv_connector": "NixlConnector"}"#);
    let (taken, note) = plain.clone().with_abort_timeout(Some("120")).unwrap();
    assert_eq!(Config::from_kv_transfer_config(&taken).unwrap().kv_lease_duration, Duration::from_secs(120));
    let note = note.unwrap();
    assert!(note.contains("VLLM_NIXL_ABORT_REQUEST_TIMEOUT=120 sets the lease") && note.contains("old name"), "{note}");
    let (same, note) = plain.clone().with_abort_timeout(None).unwrap();
    assert_eq!((same, note), (plain.clone(), None));
    let given = read(r#"{"kv_connector": "NixlConnector", "kv_connector_extra_config": {"kv_lease_duration": 9}}"#);
    let (kept, note) = given.clone().with_abort_timeout(Some("120")).unwrap();
    assert_eq!(kept, given, "the config's own lease wins");
    assert!(note.unwrap().contains("is not read: kv_connector_extra_config sets kv_lease_duration 9 s"));
    let err = plain.clone().with_abort_timeout(Some("soon")).unwrap_err();
    assert_eq!(err.to_string(), r#"VLLM_NIXL_ABORT_REQUEST_TIMEOUT="soon" is not a number of seconds"#);
    let (negative, _) = plain.with_abort_timeout(Some("-1")).unwrap();
    let err = Config::from_kv_transfer_config(&negative).unwrap_err();
    assert_eq!(err.to_string(), "kv_lease_duration = -1.0 is not a duration in seconds");
}

/// The names of a struct's fields, in order, from a pattern that lists them all: it compiles
/// only while the list is whole, so a field added to the type fails the build of this test.
macro_rules! field_names {
    ($ty:ident { $($field:ident),* $(,)? } $(, $rest:ident)?) => {{
        #[allow(unused_variables)]
        let $ty { $($field,)* $($rest: _,)? } = $ty::default();
        vec![$(stringify!($field)),*]
    }};
}

#[test]
fn the_settings_tables_list_every_key_in_the_types_order() {
    let keys = |settings: &[SettingDoc]| settings.iter().map(|s| s.key).collect::<Vec<_>>();
    let transfer = field_names!(
        KvTransferConfig {
            kv_connector,
            kv_role,
            kv_load_failure_policy,
            kv_connector_extra_config,
            kv_connector_module_path,
            engine_id,
            kv_buffer_device,
            kv_buffer_size,
            kv_rank,
            kv_parallel_size,
            kv_ip,
            kv_port,
            enable_permute_local_kv,
        },
        unknown
    );
    assert_eq!(keys(TRANSFER_SETTINGS), transfer);
    let extra = field_names!(ExtraConfig {
        mode,
        kv_lease_duration,
        heartbeat_interval,
        heartbeat_lease_extension,
        decoder_kv_blocks_ttl,
        push_registration_timeout,
        push_quarantine,
        kv_load_failure_policy,
        early_notification_capacity,
        read_safety_margin,
        kv_descriptors,
        backends,
        num_threads,
        enforce_handshake_compat,
        engine_ttl,
        bidirectional_kv_xfer,
        kv_recompute_threshold,
    });
    assert_eq!(keys(EXTRA_SETTINGS), extra);
}

#[cfg(feature = "serde")]
#[test]
fn every_key_of_the_settings_tables_is_one_the_parser_reads() {
    // Each top-level key, given alone (beside the connector), is read, not named unknown.
    for SettingDoc { key, .. } in TRANSFER_SETTINGS.iter().filter(|s| s.key != "kv_connector") {
        let value = if *key == "kv_connector_extra_config" { "{}" } else { "null" };
        let json = format!(r#"{{"kv_connector": "KvflowConnector", "{key}": {value}}}"#);
        let transfer: KvTransferConfig = serde_json::from_str(&json).unwrap_or_else(|e| panic!("{json}: {e}"));
        assert_eq!(transfer.unknown, UnknownKeys::default(), "{key}");
    }
    // The extra config refuses keys it does not know, and names every key it knows.
    let refused = serde_json::from_str::<ExtraConfig>(r#"{"no_such_key": 1}"#).unwrap_err().to_string();
    for SettingDoc { key, .. } in EXTRA_SETTINGS {
        assert!(refused.contains(&format!("`{key}`")), "{key} is not in {refused}");
    }
}

#[test]
fn the_settings_tables_give_the_defaults_the_code_takes() {
    let default = |key: &str| EXTRA_SETTINGS.iter().find(|s| s.key == key).unwrap().default;
    let c = Config::default();
    assert_eq!(default("kv_lease_duration"), format!("{} s", c.kv_lease_duration.as_secs()));
    assert_eq!(default("decoder_kv_blocks_ttl"), format!("{} s", c.decoder_kv_blocks_ttl.as_secs()));
    assert_eq!(default("early_notification_capacity"), c.early_notification_capacity.to_string());
    assert_eq!((c.heartbeat_interval, c.lease_extension), (c.kv_lease_duration / 6, c.kv_lease_duration * 2 / 3));
    assert_eq!(c.push_registration_timeout, c.decoder_kv_blocks_ttl);
    assert_eq!(c.push_quarantine, c.kv_lease_duration * 2);
    assert_eq!(Config::MAX_DEFAULT_READ_MARGIN.as_secs(), 5);
}
