//! Tests of the scenario format: every scenario of the crate parses, defaults follow the
//! keys they derive from, every event and expectation reads back, and folders expand to their
//! files; `errors.rs` checks that every bad input is refused with a message that says where
//! and what.

mod errors;

use kv_sched_adapter::LoadFailurePolicy;

use super::*;

/// The crate's scenario folder, or a folder in it.
fn scenarios(folder: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios").join(folder)
}

fn parse(text: &str) -> Scenario {
    match Scenario::from_toml_str(text) {
        Ok(scenario) => scenario,
        Err(e) => panic!("{e}\nin:\n{text}"),
    }
}

fn steps(body: &str) -> String {
    format!("name = \"t\"\n{body}")
}

/// The events of a file with a cluster of two prefill and two decode engines.
fn events(body: &str) -> Vec<Option<Event>> {
    let s = parse(&steps(&format!("cluster = {{ prefillers = 2, decoders = 2 }}\n{body}")));
    s.steps.into_iter().map(|s| s.event).collect()
}

#[test]
fn every_scenario_of_the_crate_parses() {
    for (dir, at_least) in [(scenarios("examples"), 15), (scenarios(""), 55)] {
        assert!(dir.is_dir(), "the scenarios are missing: {} is not a folder", dir.display());
        let files = scenario_files(&[&dir]).map_err(|e| e.to_string());
        let files = files.as_deref().unwrap_or_else(|e| panic!("{e}"));
        assert!(files.len() >= at_least, "expected scenarios under {}, found {files:?}", dir.display());
        for file in files {
            if let Err(e) = Scenario::load(file) {
                panic!("{e}");
            }
        }
    }

    let siblings = Scenario::load(scenarios("examples").join("siblings.toml")).map_err(|e| e.to_string());
    let siblings = siblings.as_ref().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        siblings.steps[0].event,
        Some(Event::Prefill { request: "r1".into(), prompt_tokens: 64, n: 4, node: Node::PREFILL0, consumer: None })
    );
    let last = siblings.steps[3].expect.as_ref().map(|e| e.p_released.clone()).unwrap_or_default();
    assert_eq!(last.get(&RequestId::new("0_r1")), Some(&ReleaseReason::Transferred));
    assert_eq!(last.get(&RequestId::new("3_r1")), Some(&ReleaseReason::Sibling));

    let early = Scenario::load(scenarios("examples").join("early-completion.toml")).map_err(|e| e.to_string());
    let early = early.as_ref().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(early.cluster.worker_handoff, Duration::from_millis(200));
    assert_eq!(early.steps[1].at, Time::from_millis(10));

    let intrude =
        Scenario::load(scenarios("examples").join("intrude-before-handshake.toml")).map_err(|e| e.to_string());
    let intrude = intrude.as_ref().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(intrude.steps[0].event, Some(Event::Intrude { to: Node::PREFILL0, claimed: Node::DECODE0 }));
}

#[test]
fn a_minimal_file_gets_every_default() {
    let s = parse("name = \"minimal\"");
    assert_eq!((s.name.as_str(), s.steps.len()), ("minimal", 0));
    assert_eq!(s.cluster, ClusterSpec::default());
    let c = &s.cluster;
    assert_eq!((c.mode, c.prefillers, c.decoders, c.prefill_tp, c.decode_tp), (Mode::Pull, 1, 1, 1, 1));
    assert_eq!((c.prefill_block_size, c.decode_block_size, c.num_kv_heads, c.mla), (16, 16, 8, false));
    assert_eq!((c.prefill_num_blocks, c.decode_num_blocks), (1000, 1000));
    assert_eq!(c.step_interval, Duration::from_millis(10));
    assert_eq!(c.network_latency, Duration::from_millis(1));
    assert_eq!(c.transfer_latency, Duration::from_millis(5));
    assert_eq!(c.worker_handoff, Duration::from_millis(10));
    assert!(c.clock_skew.is_empty());
    let p = &s.policy;
    assert_eq!(p.kv_lease_duration, Duration::from_secs(30));
    assert_eq!(p.heartbeat_interval, Duration::from_secs(5));
    assert_eq!(p.lease_extension, Duration::from_secs(20));
    assert_eq!(p.decoder_kv_blocks_ttl, Duration::from_secs(480));
    assert_eq!(p.push_registration_timeout, Duration::from_secs(480));
    assert_eq!(p.push_quarantine, Duration::from_secs(60));
    assert_eq!(p.kv_load_failure_policy, LoadFailurePolicy::Recompute);
    assert_eq!(p.early_notification_capacity, 8192);
}

#[test]
fn defaults_follow_the_values_they_derive_from() {
    let s = parse(&steps(
        "[cluster]\nstep_interval_ms = 20\n[policy]\nkv_lease_duration_s = 60\ndecoder_kv_blocks_ttl_s = 100",
    ));
    assert_eq!(s.cluster.worker_handoff, Duration::from_millis(20));
    assert_eq!(s.policy.heartbeat_interval, Duration::from_secs(10));
    assert_eq!(s.policy.lease_extension, Duration::from_secs(40));
    assert_eq!(s.policy.push_registration_timeout, Duration::from_secs(100));
    assert_eq!(s.policy.push_quarantine, Duration::from_secs(120));

    let s = parse(&steps(
        "[cluster]\nmode = \"push\"\nstep_interval_ms = 20\nworker_handoff_ms = 0.5\nmla = true\n\
         clock_skew_ms = { decode0 = -2500, prefill0 = 0.25 }\n\
         [policy]\nkv_lease_duration_s = 60\nheartbeat_interval_s = 1\nlease_extension_s = 7.5\n\
         push_registration_timeout_s = 3\npush_quarantine_s = 4.5\nkv_load_failure_policy = \"fail\"\n\
         early_notification_capacity = 0",
    ));
    assert_eq!((s.cluster.mode, s.cluster.mla), (Mode::Push, true));
    assert_eq!(s.cluster.worker_handoff, Duration::from_micros(500));
    assert_eq!(s.cluster.clock_skew, BTreeMap::from([(Node::PREFILL0, 250_000), (Node::DECODE0, -2_500_000_000)]));
    assert_eq!(s.policy.heartbeat_interval, Duration::from_secs(1));
    assert_eq!(s.policy.lease_extension, Duration::from_millis(7500));
    assert_eq!(s.policy.push_registration_timeout, Duration::from_secs(3));
    assert_eq!(s.policy.push_quarantine, Duration::from_millis(4500));
    assert_eq!(s.policy.kv_load_failure_policy, LoadFailurePolicy::Fail);
    assert_eq!(s.policy.early_notification_capacity, 0);
}

#[test]
fn every_event_parses_with_its_defaults() {
    let events = events(
        r#"
        [[step]]
        at_s = 0
        do = "prefill"
        request = "r1"
        prompt_tokens = 64
        [[step]]
        at_s = 0.01
        do = "arrive"
        request = "r1"
        [[step]]
        at_s = 0.01
        do = "arrive"
        request = "0_r2-0123abcd"
        node = "decode1"
        from = "prefill1"
        remote_request = "0_r2"
        prompt_tokens = 32
        [[step]]
        at_s = 0.02
        do = "schedule"
        request = "r1"
        prefix_hit = true
        [[step]]
        at_s = 0.03
        do = "reject"
        request = "r3"
        [[step]]
        at_s = 0.04
        do = "abort"
        request = "r1"
        node = "prefill1"
        [[step]]
        at_s = 1
        do = "crash"
        node = "decode1"
        [[step]]
        at_s = 2
        do = "restart"
        node = "decode1"
        [[step]]
        at_s = 3
        do = "partition"
        a = "prefill0"
        b = "decode0"
        until_s = 4.5
        [[step]]
        at_s = 3
        do = "delay"
        a = "decode0"
        b = "prefill0"
        by_ms = 250
        until_s = 3
        [[step]]
        at_s = 5
        do = "fail_transfer"
        request = "r1"
        node = "decode1"
        [[step]]
        at_s = 5
        do = "garbage"
        from = "decode1"
        to = "prefill0"
        bytes = "%%"
        [[step]]
        at_s = 6
        do = "wait"
        [[step]]
        at_s = 6
        do = "pause"
        node = "prefill1"
        for_s = 1.5
        [[step]]
        at_s = 6
        do = "forge"
        from = "decode1"
        to = "prefill0"
        message = "completion"
        request = "r1"
        [[step]]
        at_s = 6
        do = "intrude"
        to = "prefill1"
        as = "decode0"
        [[step]]
        at_s = 7
        "#,
    );
    let r = RequestId::new;
    let expected = vec![
        Some(Event::Prefill { request: r("r1"), prompt_tokens: 64, n: 1, node: Node::PREFILL0, consumer: None }),
        Some(Event::Arrive {
            request: r("r1"),
            node: Node::DECODE0,
            from: Node::PREFILL0,
            remote_request: r("r1"),
            prompt_tokens: None,
            prefill_pp: None,
        }),
        Some(Event::Arrive {
            request: r("0_r2-0123abcd"),
            node: Node::decode(1),
            from: Node::prefill(1),
            remote_request: r("0_r2"),
            prompt_tokens: Some(32),
            prefill_pp: None,
        }),
        Some(Event::Schedule { request: r("r1"), node: Node::DECODE0, prefix_hit: true, cached_tokens: 0 }),
        Some(Event::Reject {
            request: r("r3"),
            node: Node::DECODE0,
            from: Node::PREFILL0,
            remote_request: r("r3"),
            prefill_tp: None,
        }),
        Some(Event::Abort { request: r("r1"), node: Node::prefill(1) }),
        Some(Event::Crash { node: Node::decode(1), detect: false }),
        Some(Event::Restart { node: Node::decode(1) }),
        Some(Event::Partition { a: Node::PREFILL0, b: Node::DECODE0, until: Time::from_millis(4500) }),
        Some(Event::Delay {
            a: Node::DECODE0,
            b: Node::PREFILL0,
            by: Duration::from_millis(250),
            until: Time::from_millis(3000),
        }),
        Some(Event::FailTransfer { request: r("r1"), node: Node::decode(1), from_block: None }),
        Some(Event::Garbage { from: Node::decode(1), to: Node::PREFILL0, bytes: b"%%".to_vec() }),
        Some(Event::Wait),
        Some(Event::Pause { node: Node::prefill(1), for_: Duration::from_millis(1500) }),
        Some(Event::Forge {
            from: Node::decode(1),
            to: Node::PREFILL0,
            message: ForgedMessage::Completion,
            request: r("r1"),
            consumers: 1,
        }),
        Some(Event::Intrude { to: Node::prefill(1), claimed: Node::DECODE0 }),
        None,
    ];
    assert_eq!(events, expected);
    let mut names: Vec<&str> = events.iter().flatten().map(Event::name).collect();
    names.dedup();
    let format_names = [
        "prefill",
        "arrive",
        "schedule",
        "reject",
        "abort",
        "crash",
        "restart",
        "partition",
        "delay",
        "fail_transfer",
        "garbage",
        "wait",
        "pause",
        "forge",
        "intrude",
    ];
    assert_eq!(names, format_names);
}

#[test]
fn the_new_event_keys_parse() {
    // The steps as an array of inline tables, one a line: the same document as `[[step]]` tables.
    let events = events(
        r#"
        step = [
            { at_s = 0, do = "prefill", request = "r1", prompt_tokens = 64, consumer = "decode1" },
            { at_s = 0, do = "schedule", request = "r1", node = "decode1", cached_tokens = 32 },
            { at_s = 0, do = "fail_transfer", request = "r1", node = "decode0", from_block = 2 },
            { at_s = 0, do = "forge", from = "decode0", to = "prefill1", message = "abort", request = "r1", consumers = 3 },
            { at_s = 0, do = "forge", from = "decode0", to = "prefill1", message = "heartbeat", request = "r1" },
            { at_s = 0, do = "forge", from = "decode1", to = "prefill0", message = "reject", request = "r1", consumers = 0 },
            { at_s = 0, do = "intrude", to = "decode0", as = "decode1" },
        ]
        "#,
    );
    let r = RequestId::new;
    let forge = |from, to, message, consumers| Some(Event::Forge { from, to, message, request: r("r1"), consumers });
    assert_eq!(
        events,
        vec![
            Some(Event::Prefill {
                request: r("r1"),
                prompt_tokens: 64,
                n: 1,
                node: Node::PREFILL0,
                consumer: Some(Node::decode(1)),
            }),
            Some(Event::Schedule { request: r("r1"), node: Node::decode(1), prefix_hit: false, cached_tokens: 32 }),
            Some(Event::FailTransfer { request: r("r1"), node: Node::DECODE0, from_block: Some(2) }),
            forge(Node::DECODE0, Node::prefill(1), ForgedMessage::Abort, 3),
            forge(Node::DECODE0, Node::prefill(1), ForgedMessage::Heartbeat, 1),
            forge(Node::decode(1), Node::PREFILL0, ForgedMessage::Reject, 0),
            Some(Event::Intrude { to: Node::DECODE0, claimed: Node::decode(1) }),
        ]
    );
}

#[test]
fn the_project_s_own_events_parse() {
    // `lapse`: any engine.
    let lapses = events(
        r#"
        step = [
            { at_s = 0, do = "lapse", node = "decode1" },
            { at_s = 0, do = "lapse", node = "prefill0" },
        ]
        "#,
    );
    assert_eq!(lapses, vec![Some(Event::Lapse { node: Node::decode(1) }), Some(Event::Lapse { node: Node::PREFILL0 })]);
    assert_eq!(lapses.iter().flatten().map(Event::name).collect::<Vec<_>>(), ["lapse", "lapse"]);

    // A chunked prefill: P's node defaults to prefill0, the consumer is a decode engine.
    let r1 = RequestId::new("r1");
    let chunked = events(
        r#"
        step = [
            { at_s = 0, do = "begin_prefill", request = "r1", prompt_tokens = 64, consumer = "decode0" },
            { at_s = 0, do = "progress", request = "r1", tokens = 32 },
            { at_s = 0, do = "finish_prefill", request = "r1" },
            { at_s = 0, do = "abandon_prefill", request = "r1", node = "prefill0" },
        ]
        "#,
    );
    let (node, consumer) = (Node::PREFILL0, Some(Node::DECODE0));
    assert_eq!(
        chunked,
        vec![
            Some(Event::BeginPrefill { request: r1.clone(), prompt_tokens: 64, node, consumer }),
            Some(Event::Progress { request: r1.clone(), tokens: 32, node, layers: None, whole_tokens: None }),
            Some(Event::FinishPrefill { request: r1.clone(), node }),
            Some(Event::AbandonPrefill { request: r1, node }),
        ]
    );
    check(
        &steps("[[step]]\nat_s = 0\ndo = \"progress\"\nrequest = \"r1\"\ntokens = 0"),
        "step 1: tokens must be at least 1, not 0",
    );
    let layered = events(
        r#"
        step = [{ at_s = 0, do = "progress", request = "r1", tokens = 64, layers = 1, whole_tokens = 32 }]
        "#,
    );
    let (layers, whole_tokens) = (Some(1), Some(32));
    let r1 = RequestId::new("r1");
    assert_eq!(layered, vec![Some(Event::Progress { request: r1, tokens: 64, node, layers, whole_tokens })]);
    let progress = "[[step]]\nat_s = 0\ndo = \"progress\"\nrequest = \"r1\"\ntokens = 32\n";
    check(&steps(&format!("{progress}layers = 0")), "step 1: layers must be at least 1, not 0");
    check(&steps(&format!("{progress}whole_tokens = 16")), "step 1: whole_tokens goes with layers");
    check(
        &steps(&format!("{progress}layers = 1\nwhole_tokens = 64")),
        "step 1: whole_tokens must be at most tokens (32), not 64",
    );
    check(
        &steps("[[step]]\nat_s = 0\ndo = \"finish_prefill\"\nrequest = \"r1\"\nnode = \"decode0\""),
        "step 1: node \"decode0\" must be a prefill engine for do = \"finish_prefill\"",
    );
}

#[test]
fn every_expectation_parses() {
    let s = parse(&steps(
        r#"
        [cluster]
        prefillers = 2
        decoders = 2
        [[step]]
        at_s = 0.5
        expect = { p_held_blocks = 4, p_held_blocks_on = { prefill1 = 3 }, p_pending = 1, p_released = { r1 = "transferred", r2 = "expired", r3 = "rejected", r4 = "aborted", "0_r5" = "sibling", r6 = "peer_lost" }, d_held_blocks = 0, d_held_blocks_on = { decode1 = 2 }, d_state = { r1 = "waiting", r2 = "loading", r3 = "ready", r4 = "failed", r5 = "recompute", r6 = "gone" }, notifications_after_expiry = 0, ignored_messages = 2, corrupt_reads = 1, written_after_free = 0, d_blocks_read = { r1 = 4, r2 = 0 }, d_tokens_kept = { r3 = 32 } }
        [[step]]
        at_s = 0.5
        do = "schedule"
        request = "r1"
        node = "decode1"
        expect = { d_state = { r1 = "loading" } }
        [[step]]
        at_s = 0.6
        node = "decode1"
        [step.expect]
        d_blocks_read = { r1 = 2 }
        d_tokens_kept = { r1 = 16 }
        [[step]]
        at_s = 0.7
        do = "crash"
        node = "prefill1"
        expect = {}
        "#,
    ));
    let e = s.steps[0].expect.clone().unwrap_or_default();
    let r = RequestId::new;
    assert_eq!((e.p_held_blocks, e.p_pending, e.d_held_blocks), (Some(4), Some(1), Some(0)));
    assert_eq!(e.p_held_blocks_on, BTreeMap::from([(Node::prefill(1), 3)]));
    assert_eq!(e.d_held_blocks_on, BTreeMap::from([(Node::decode(1), 2)]));
    assert_eq!(
        e.p_released.into_iter().collect::<Vec<_>>(),
        vec![
            (r("0_r5"), ReleaseReason::Sibling),
            (r("r1"), ReleaseReason::Transferred),
            (r("r2"), ReleaseReason::Expired),
            (r("r3"), ReleaseReason::Rejected),
            (r("r4"), ReleaseReason::Aborted),
            (r("r6"), ReleaseReason::PeerLost),
        ]
    );
    use DecodeState::*;
    assert_eq!(e.d_state.into_values().collect::<Vec<_>>(), vec![Waiting, Loading, Ready, Failed, Recompute, Gone]);
    assert_eq!(e.d_node, Node::DECODE0);
    assert_eq!((e.notifications_after_expiry, e.ignored_messages, e.corrupt_reads), (Some(0), Some(2), Some(1)));
    assert_eq!(e.written_after_free, Some(0));
    assert_eq!(e.d_blocks_read, BTreeMap::from([(r("r1"), 4), (r("r2"), 0)]));
    assert_eq!(e.d_tokens_kept, BTreeMap::from([(r("r3"), 32)]));

    let on_decode1 = |i: usize| s.steps[i].expect.as_ref().map(|e| e.d_node);
    assert_eq!((on_decode1(1), on_decode1(2)), (Some(Node::decode(1)), Some(Node::decode(1))));
    let third = s.steps[2].expect.clone().unwrap_or_default();
    assert_eq!(
        (third.d_blocks_read, third.d_tokens_kept),
        (BTreeMap::from([(r("r1"), 2)]), BTreeMap::from([(r("r1"), 16)]))
    );
    let empty = s.steps[3].expect.as_ref();
    assert_eq!(empty.map(Expect::is_empty), Some(true));
    assert_eq!(empty.map(|e| e.d_node), Some(Node::DECODE0));
}

/// Parses `input` and checks that it fails with a message that starts with `expected`.
fn check(input: &str, expected: &str) {
    match Scenario::from_toml_str(input) {
        Ok(_) => panic!("accepted, but expected {expected:?}:\n{input}"),
        Err(e) => {
            let message = e.to_string();
            assert!(message.starts_with(expected), "got {message:?}\nexpected {expected:?}\nfor:\n{input}");
        }
    }
}

/// [`check`]s every `(body, expected)` of `cases` in a file that has `head`, then `body`.
fn check_each(head: &str, cases: &[(&str, &str)]) {
    for (body, expected) in cases {
        check(&steps(&format!("{head}{body}")), expected);
    }
}

#[test]
fn a_step_may_only_move_time() {
    let s = parse(&steps("[[step]]\nat_s = 0.25\n[[step]]\nat_s = 0.25"));
    let at: Vec<Time> = s.steps.iter().map(|s| s.at).collect();
    assert_eq!(at, vec![Time::from_millis(250); 2]);
    assert!(s.steps.iter().all(|s| s.event.is_none() && s.expect.is_none()));
}

/// A fresh, empty folder under the system's temporary folder.
fn scratch(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kv-testkit-scenario-{}-{tag}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    let made = fs::create_dir_all(&dir);
    assert!(made.is_ok(), "cannot create {}: {made:?}", dir.display());
    dir
}

fn write(path: &Path, text: &str) {
    if let Some(parent) = path.parent() {
        assert!(fs::create_dir_all(parent).is_ok(), "cannot create {}", parent.display());
    }
    assert!(fs::write(path, text).is_ok(), "cannot write {}", path.display());
}

#[test]
fn errors_from_a_file_name_it() {
    let dir = scratch("load");
    let file = dir.join("bad.toml");
    write(&file, "name = \"x\"\n[[step]]\nat_s = 1\n[[step]]\nat_s = 2\ndo = \"explode\"\n");
    let e = Scenario::load(&file).err().map(|e| e.to_string());
    assert_eq!(
        e.as_deref().and_then(|e| e.split(", expected").next()),
        Some(format!("{}: step 2: do: unknown variant `explode`", file.display()).as_str())
    );
    assert!(e.as_deref().is_some_and(|e| e.ends_with("(line 6, column 6)")), "{e:?}");
    let location = Scenario::load(&file).err().and_then(|e| e.location().cloned());
    let expected =
        Location { file: Some(file.clone()), step: Some(2), key: Some("do".into()), line_column: Some((6, 6)) };
    assert_eq!(location, Some(expected));

    write(&file, "name = \"x\"\n\n[cluster\n");
    let e = Scenario::load(&file).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.starts_with(&format!("{}: invalid TOML: line 3, column", file.display())), "{e}");

    let missing = dir.join("missing.toml");
    let e = Scenario::load(&missing).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.starts_with(&format!("cannot read {}: ", missing.display())), "{e}");
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn folders_expand_to_their_toml_files_sorted() {
    let dir = scratch("files");
    for name in ["b.toml", "a.toml", "sub/z.toml", "sub/deeper/c.toml", "notes.md", "a.toml.bak"] {
        write(&dir.join(name), "name = \"x\"\n");
    }
    let single = dir.join("notes.md");
    let files = scenario_files(&[dir.clone(), single.clone()]).map_err(|e| e.to_string());
    let expected: Vec<PathBuf> =
        ["a.toml", "b.toml", "sub/deeper/c.toml", "sub/z.toml", "notes.md"].iter().map(|name| dir.join(name)).collect();
    assert_eq!(files, Ok(expected));

    let empty = dir.join("empty");
    assert!(fs::create_dir_all(&empty).is_ok());
    let e = scenario_files(&[&empty]).err().map(|e| e.to_string());
    assert_eq!(e, Some(format!("no *.toml scenario file under {}", empty.display())));
    let gone = dir.join("gone");
    let e = scenario_files(&[&gone]).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.starts_with(&format!("cannot read {}: ", gone.display())), "{e}");
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn the_library_names_read_back_as_the_format_writes_them() {
    use ReleaseReason::*;
    for reason in [Transferred, Expired, Rejected, Aborted, Sibling, PeerLost] {
        let text = steps(&format!("[[step]]\nat_s = 0\nexpect = {{ p_released = {{ r1 = \"{reason}\" }} }}"));
        let got = parse(&text).steps[0].expect.as_ref().and_then(|e| e.p_released.values().next().copied());
        assert_eq!(got, Some(reason));
    }
    use DecodeState::*;
    for state in [Waiting, Loading, Ready, Failed, Recompute, Gone] {
        let text = steps(&format!("[[step]]\nat_s = 0\nexpect = {{ d_state = {{ r1 = \"{}\" }} }}", state.as_str()));
        let got = parse(&text).steps[0].expect.as_ref().and_then(|e| e.d_state.values().next().copied());
        assert_eq!(got, Some(state));
    }
    for (name, mode) in [("pull", Mode::Pull), ("push", Mode::Push)] {
        assert_eq!(parse(&steps(&format!("[cluster]\nmode = \"{name}\""))).cluster.mode, mode);
    }
    for (name, policy) in [("fail", LoadFailurePolicy::Fail), ("recompute", LoadFailurePolicy::Recompute)] {
        let text = steps(&format!("[policy]\nkv_load_failure_policy = \"{name}\""));
        assert_eq!(parse(&text).policy.kv_load_failure_policy, policy);
    }
    check(
        &steps("[[step]]\nat_s = 0\nexpect = { p_released = { r1 = \"PeerLost\" } }"),
        "step 1: expect.p_released.r1: unknown variant `PeerLost`",
    );

    assert_eq!(Node::parse("decode12"), Some(Node::decode(12)));
    assert_eq!(Node::decode(12).to_string(), "decode12");
    assert_eq!(Node::PREFILL0.engine_id(), EngineId::new("prefill0"));
    for bad in ["decode", "decode01", "Decode1", "decode-1", "prefill 0", "prefill99999999999"] {
        assert_eq!(Node::parse(bad), None, "{bad}");
    }
    assert!(Node::prefill(7) < Node::DECODE0);
    let cluster = ClusterSpec { prefillers: 2, decoders: 1, ..ClusterSpec::default() };
    assert_eq!(cluster.nodes().collect::<Vec<_>>(), vec![Node::prefill(0), Node::prefill(1), Node::decode(0)]);
    assert!(!cluster.contains(Node::decode(1)));
}
