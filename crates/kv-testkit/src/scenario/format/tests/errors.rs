//! Tests that every bad input is refused with a message that says where and what: the file,
//! the step, the key and the value, and the line and column.

use super::*;

/// A first step that prefills `r1`: a case adds the step's other keys.
const PREFILL: &str = "[[step]]\nat_s = 0\ndo = \"prefill\"\nrequest = \"r1\"\nprompt_tokens = 64\n";

#[test]
fn bad_files_and_tables_say_where_and_what() {
    let whole_files = [
        ("name = ", "invalid TOML: line 1, column 8: "),
        ("title = \"x\"", "unknown field `title`, expected one of `name`, `cluster`, `policy`, `step`"),
        ("", "missing field `name`"),
        ("name = 3", "name: invalid type: integer `3`, expected a string"),
    ];
    for (input, expected) in whole_files {
        check(input, expected);
    }
    check_each(
        "",
        &[
            ("cluster = 3", "cluster: invalid type: integer `3`, expected a table"),
            ("step = 3", "step must be an array of tables ([[step]]), not 3"),
            ("step = [1]", "step 1: must be a table ([[step]]), not 1"),
        ],
    );
    check_each(
        "[cluster]\n",
        &[
            ("prefillerz = 2", "cluster: unknown field `prefillerz`, expected one of `mode`, "),
            ("prefill_tp = 0", "cluster.prefill_tp: invalid value: integer `0`, expected a nonzero u32"),
            (
                "decode_block_size = -16",
                "cluster.decode_block_size: invalid value: integer `-16`, expected a nonzero u32",
            ),
            ("decoders = 5000000000", "cluster.decoders: invalid value: integer `5000000000`, expected a nonzero u32"),
            ("num_kv_heads = 8.0", "cluster.num_kv_heads: invalid type: floating point `8.0`, expected a nonzero u32"),
            ("mla = \"yes\"", "cluster.mla: invalid type: string \"yes\", expected a boolean"),
            ("mode = \"teleport\"", "cluster.mode: unknown variant `teleport`, expected `pull` or `push`"),
            ("step_interval_ms = 0", "cluster.step_interval_ms must be positive, not 0"),
            ("network_latency_ms = -1", "cluster.network_latency_ms must not be negative, not -1"),
            ("clock_skew_ms = { decode1 = 5 }", "cluster.clock_skew_ms key \"decode1\" does not exist (decoders = 1)"),
            ("clock_skew_ms = { decode0 = 1e300 }", "cluster.clock_skew_ms.decode0 1e300 is out of range"),
        ],
    );
    check_each(
        "[policy]\n",
        &[
            ("lease_s = 2", "policy: unknown field `lease_s`, expected one of `kv_lease_duration_s`, "),
            ("kv_lease_duration_s = -30", "policy.kv_lease_duration_s must not be negative, not -30"),
            ("kv_lease_duration_s = 0", "policy.kv_lease_duration_s must be positive, not 0"),
            ("heartbeat_interval_s = 0", "policy.heartbeat_interval_s must be positive, not 0"),
            ("decoder_kv_blocks_ttl_s = inf", "policy.decoder_kv_blocks_ttl_s must be finite, not inf"),
            ("push_quarantine_s = -1.5", "policy.push_quarantine_s must not be negative, not -1.5"),
            (
                "kv_load_failure_policy = \"retry\"",
                "policy.kv_load_failure_policy: unknown variant `retry`, expected `fail` or `recompute`",
            ),
            (
                "early_notification_capacity = -1",
                "policy.early_notification_capacity: invalid value: integer `-1`, expected usize",
            ),
        ],
    );
}

#[test]
fn bad_steps_say_where_and_what() {
    check_each(
        "[[step]]\n",
        &[
            ("at_s = 1\ndo = \"explode\"", "step 1: do: unknown variant `explode`, expected one of `prefill`, "),
            ("at_s = 1\ndo = 3", "step 1: do: invalid type: integer `3`, expected a string"),
            (
                "at_s = 0\nrequest = \"r1\"",
                "step 1: unknown key \"request\" for a step without do (expected one of: at_s, do, expect, node)",
            ),
            ("do = \"wait\"", "step 1: at_s is missing"),
            ("at_s = -1.0", "step 1: at_s must not be negative, not -1.0"),
            ("at_s = nan", "step 1: at_s must be finite, not NaN"),
            ("at_s = 1e30", "step 1: at_s 1e30 is too large"),
            ("at_s = \"1\"", "step 1: at_s: invalid type: string \"1\", expected f64"),
            (
                "at_s = 0.0\n[[step]]\nat_s = 2.0\n[[step]]\nat_s = 1.0",
                "step 3: at_s 1.0 is earlier than the previous step's 2.0",
            ),
            (
                "at_s = 2.0\ndo = \"partition\"\na = \"decode0\"\nb = \"prefill0\"\nuntil_s = 1.5",
                "step 1: until_s 1.5 is earlier than at_s 2.0",
            ),
            ("at_s = 0\nnode = \"decode1\"", "step 1: node \"decode1\" does not exist (decoders = 1)"),
        ],
    );
    check_each(
        "[cluster]\n",
        &[
            (
                "decoders = 2\n[[step]]\nat_s = 0\ndo = \"arrive\"\nrequest = \"r1\"\nnode = \"decode5\"",
                "step 1: node \"decode5\" does not exist (decoders = 2)",
            ),
            (
                "decoders = 3\n[[step]]\nat_s = 0\ndo = \"crash\"\nnode = \"gpu0\"",
                "step 1: node \"gpu0\" is not an engine name (this cluster has prefill0 and decode0..decode2)",
            ),
            (
                "mode = \"push\"\n[[step]]\nat_s = 0\ndo = \"fail_transfer\"\nrequest = \"r1\"\nnode = \"decode0\"",
                "step 1: node \"decode0\" must be a prefill engine for do = \"fail_transfer\" in push mode",
            ),
        ],
    );
    let long_request = format!("do = \"abort\"\nnode = \"decode0\"\nrequest = \"{}\"", "r".repeat(257));
    check_each(
        "[[step]]\nat_s = 0\n",
        &[
            (
                "do = \"prefill\"\nrequest = \"r1\"\nprompt = 64",
                "step 1: do = \"prefill\": unexpected keys in table: prompt, available keys: request, prompt_tokens, ",
            ),
            ("do = \"crash\"\nnode = \"prefill1\"", "step 1: node \"prefill1\" does not exist (prefillers = 1)"),
            ("do = \"restart\"\nnode = \"decode01\"", "step 1: node \"decode01\" is not an engine name"),
            (
                "do = \"schedule\"\nrequest = \"r1\"\nnode = \"prefill0\"",
                "step 1: node \"prefill0\" must be a decode engine for do = \"schedule\"",
            ),
            (
                "do = \"prefill\"\nrequest = \"r1\"\nprompt_tokens = 64\nnode = \"decode0\"",
                "step 1: node \"decode0\" must be a prefill engine for do = \"prefill\"",
            ),
            (
                "do = \"reject\"\nrequest = \"r1\"\nfrom = \"decode0\"",
                "step 1: from \"decode0\" must be a prefill engine for do = \"reject\"",
            ),
            (
                "do = \"fail_transfer\"\nrequest = \"r1\"\nnode = \"prefill0\"",
                "step 1: node \"prefill0\" must be a decode engine for do = \"fail_transfer\" in pull mode",
            ),
            ("do = \"prefill\"\nrequest = \"r1\"", "step 1: do = \"prefill\": missing field `prompt_tokens`"),
            ("do = \"schedule\"", "step 1: do = \"schedule\": missing field `request`"),
            ("do = \"abort\"\nrequest = \"r1\"", "step 1: do = \"abort\": missing field `node`"),
            ("do = \"crash\"", "step 1: do = \"crash\": missing field `node`"),
            (
                "do = \"garbage\"\nfrom = \"decode0\"\nto = \"prefill0\"",
                "step 1: do = \"garbage\": missing field `bytes`",
            ),
            (
                "do = \"partition\"\na = \"decode0\"\nb = \"prefill0\"",
                "step 1: do = \"partition\": missing field `until_s`",
            ),
            (
                "do = \"delay\"\na = \"decode0\"\nb = \"prefill0\"\nuntil_s = 1",
                "step 1: do = \"delay\": missing field `by_ms`",
            ),
            (
                "do = \"delay\"\na = \"decode0\"\nb = \"prefill0\"\nby_ms = -5\nuntil_s = 1",
                "step 1: by_ms must not be negative, not -5",
            ),
            (
                "do = \"partition\"\na = \"decode0\"\nb = \"decode0\"\nuntil_s = 1",
                "step 1: a and b are both \"decode0\" for do = \"partition\"; they must differ",
            ),
            ("do = \"prefill\"\nrequest = \"r1\"\nprompt_tokens = 64\nn = 0", "step 1: n must be at least 1, not 0"),
            (
                "do = \"prefill\"\nrequest = \"r1\"\nprompt_tokens = 0",
                "step 1: prompt_tokens must be at least 1, not 0",
            ),
            (
                "do = \"prefill\"\nrequest = \"r1\"\nprompt_tokens = \"64\"",
                "step 1: prompt_tokens: invalid type: string \"64\", expected u64",
            ),
            ("do = \"prefill\"\nrequest = \"\"\nprompt_tokens = 64", "step 1: request must not be empty"),
            (&long_request, "step 1: request is 257 bytes long (at most 256)"),
            (
                "do = \"schedule\"\nrequest = \"r1\"\nprefix_hit = 1",
                "step 1: prefix_hit: invalid type: integer `1`, expected a boolean",
            ),
        ],
    );
    check_each(
        PREFILL,
        &[
            ("expect = { p_held = 4 }", "step 1: expect: unknown field `p_held`, expected one of `p_held_blocks`, "),
            ("expect = 4", "step 1: expect: invalid type: integer `4`, expected a table"),
            (
                "expect = { p_held_blocks = -1 }",
                "step 1: expect.p_held_blocks: invalid value: integer `-1`, expected u64",
            ),
            (
                "expect = { p_released = { r1 = \"gone\" } }",
                "step 1: expect.p_released.r1: unknown variant `gone`, expected one of `transferred`, `expired`, \
                 `rejected`, `aborted`, `sibling`, `peer_lost`",
            ),
            (
                "expect = { d_state = { r1 = \"done\" } }",
                "step 1: expect.d_state.r1: unknown variant `done`, expected one of `waiting`, `loading`, `ready`, \
                 `failed`, `recompute`, `gone`",
            ),
            (
                "expect = { p_released = \"r1\" }",
                "step 1: expect.p_released: invalid type: string \"r1\", expected a map",
            ),
            (
                "expect = { d_held_blocks_on = { prefill0 = 1 } }",
                "step 1: expect.d_held_blocks_on key \"prefill0\" must be a decode engine",
            ),
            (
                "expect = { p_held_blocks_on = { prefill3 = 1 } }",
                "step 1: expect.p_held_blocks_on key \"prefill3\" does not exist (prefillers = 1)",
            ),
            ("expect = { p_released = { \"\" = \"expired\" } }", "step 1: expect.p_released key must not be empty"),
            (
                "node = \"prefill0\"\nexpect = { d_state = { r1 = \"ready\" } }",
                "step 1: expect.d_state is read on the step's node, and prefill0 is not a decode engine",
            ),
        ],
    );
}

#[test]
fn bad_new_keys_say_where_and_what() {
    let two = "[cluster]\nprefillers = 2\ndecoders = 2\n[[step]]\nat_s = 1\n";
    let cases: &[(&str, &str)] = &[
        (
            "do = \"prefill\"\nrequest = \"r1\"\nprompt_tokens = 64\nconsumer = \"prefill1\"",
            "step 1: consumer \"prefill1\" must be a decode engine for do = \"prefill\"",
        ),
        (
            "do = \"prefill\"\nrequest = \"r1\"\nprompt_tokens = 64\nconsumer = \"decode2\"",
            "step 1: consumer \"decode2\" does not exist (decoders = 2)",
        ),
        ("do = \"pause\"\nnode = \"decode0\"", "step 1: do = \"pause\": missing field `for_s`"),
        ("do = \"pause\"\nfor_s = 1", "step 1: do = \"pause\": missing field `node`"),
        ("do = \"pause\"\nnode = \"decode0\"\nfor_s = 0", "step 1: for_s must be positive, not 0"),
        ("do = \"pause\"\nnode = \"decode0\"\nfor_s = -2.5", "step 1: for_s must not be negative, not -2.5"),
        ("do = \"pause\"\nnode = \"decode0\"\nfor_s = \"1\"", "step 1: for_s: invalid type: string \"1\", expected f64"),
        (
            "do = \"forge\"\nfrom = \"prefill1\"\nto = \"prefill0\"\nmessage = \"abort\"\nrequest = \"r1\"",
            "step 1: from \"prefill1\" must be a decode engine for do = \"forge\"",
        ),
        (
            "do = \"forge\"\nfrom = \"decode1\"\nto = \"decode0\"\nmessage = \"abort\"\nrequest = \"r1\"",
            "step 1: to \"decode0\" must be a prefill engine for do = \"forge\"",
        ),
        (
            "do = \"forge\"\nfrom = \"decode1\"\nto = \"prefill0\"\nmessage = \"hello\"\nrequest = \"r1\"",
            "step 1: message: unknown variant `hello`, expected one of `completion`, `abort`, `heartbeat`, `reject`",
        ),
        (
            "do = \"forge\"\nfrom = \"decode1\"\nto = \"prefill0\"\nmessage = \"abort\"",
            "step 1: do = \"forge\": missing field `request`",
        ),
        (
            "do = \"forge\"\nfrom = \"decode1\"\nto = \"prefill0\"\nrequest = \"r1\"",
            "step 1: do = \"forge\": missing field `message`",
        ),
        (
            "do = \"forge\"\nfrom = \"decode1\"\nto = \"prefill0\"\nmessage = \"completion\"\nrequest = \"r1\"\nconsumers = -1",
            "step 1: consumers: invalid value: integer `-1`, expected u32",
        ),
        ("do = \"lapse\"", "step 1: do = \"lapse\": missing field `node`"),
        ("do = \"lapse\"\nnode = \"decode7\"", "step 1: node \"decode7\" does not exist (decoders = 2)"),
        (
            "do = \"lapse\"\nnode = \"etcd\"",
            "step 1: node \"etcd\" is not an engine name (this cluster has prefill0..prefill1 and decode0..decode1)",
        ),
        (
            "do = \"lapse\"\nnode = \"decode0\"\nuntil_s = 3",
            "step 1: do = \"lapse\": unexpected keys in table: until_s, available keys: node",
        ),
        ("do = \"intrude\"\nto = \"prefill0\"", "step 1: do = \"intrude\": missing field `as`"),
        (
            "do = \"intrude\"\nto = \"prefill0\"\nas = \"prefill0\"",
            "step 1: to and as are both \"prefill0\" for do = \"intrude\"; they must differ",
        ),
        ("do = \"intrude\"\nto = \"prefill0\"\nas = \"decode7\"", "step 1: as \"decode7\" does not exist (decoders = 2)"),
        (
            "do = \"intrude\"\nto = \"prefill0\"\nas = \"eve\"",
            "step 1: as \"eve\" is not an engine name (this cluster has prefill0..prefill1 and decode0..decode1)",
        ),
        (
            "do = \"schedule\"\nrequest = \"r1\"\ncached_tokens = 20",
            "step 1: cached_tokens must be a whole number of D blocks (decode_block_size = 16), not 20",
        ),
        (
            "do = \"schedule\"\nrequest = \"r1\"\ncached_tokens = -16",
            "step 1: cached_tokens: invalid value: integer `-16`, expected u64",
        ),
        (
            "do = \"fail_transfer\"\nrequest = \"r1\"\nnode = \"decode0\"\nfrom_block = -1",
            "step 1: from_block: invalid value: integer `-1`, expected u32",
        ),
        (
            "do = \"crash\"\nnode = \"decode0\"\ncached_tokens = 16",
            "step 1: do = \"crash\": unexpected keys in table: cached_tokens, available keys: node, detect",
        ),
        ("do = \"crash\"\nnode = 3", "step 1: node: invalid type: integer `3`, expected a string"),
        ("do = \"arrive\"\nrequest = \"r1\"\nprompt_tokens = 0", "step 1: prompt_tokens must be at least 1, not 0"),
        ("do = \"arrive\"\nrequest = 7", "step 1: request: invalid type: integer `7`, expected a string"),
        (
            "do = \"wait\"\nnode = \"decode1\"\nfor_s = 1",
            "step 1: unknown key \"for_s\" for do = \"wait\" (expected one of: at_s, do, expect, node)",
        ),
        ("expect = { written_after_free = -1 }", "step 1: expect.written_after_free: invalid value: integer `-1`"),
        (
            "expect = { d_blocks_read = { r1 = \"all\" } }",
            "step 1: expect.d_blocks_read.r1: invalid type: string \"all\", expected u64",
        ),
        ("expect = { d_tokens_kept = { \"\" = 1 } }", "step 1: expect.d_tokens_kept key must not be empty"),
        (
            "do = \"abort\"\nrequest = \"r1\"\nnode = \"prefill1\"\nexpect = { d_blocks_read = { r1 = 1 } }",
            "step 1: expect.d_blocks_read is read on the step's node, and prefill1 is not a decode engine; check \
             d_blocks_read in a step of its own",
        ),
        (
            "node = \"prefill0\"\nexpect = { d_tokens_kept = { r1 = 1 } }",
            "step 1: expect.d_tokens_kept is read on the step's node, and prefill0 is not a decode engine",
        ),
    ];
    check_each(two, cases);
}

#[test]
fn errors_carry_the_step_the_key_and_the_line_and_column() {
    let text = "name = \"x\"\n[[step]]\nat_s = 1\n\n[[step]]\nat_s = 2\ndo = \"crash\"\nnode = \"decode3\"\n";
    let e = Scenario::from_toml_str(text).err();
    let location = e.as_ref().and_then(|e| e.location().cloned());
    let expected = Location { file: None, step: Some(2), key: Some("node".into()), line_column: Some((8, 8)) };
    assert_eq!(location, Some(expected));
    let message = e.map(|e| e.to_string());
    assert_eq!(message.as_deref(), Some("step 2: node \"decode3\" does not exist (decoders = 1) (line 8, column 8)"));

    // serde's own errors are placed the same way: on the value, on an unknown key, or on the
    // step's table for a key that is missing.
    let at = |step, key: Option<&str>, line, column| Location {
        file: None,
        step,
        key: key.map(str::to_owned),
        line_column: Some((line, column)),
    };
    let cases = [
        ("[cluster]\nmode = \"teleport\"\n", at(None, Some("cluster.mode"), 3, 8)),
        ("[[step]]\nat_s = 0\ndo = \"explode\"\n", at(Some(1), Some("do"), 4, 6)),
        ("[[step]]\nat_s = 0\ndo = \"prefill\"\nrequest = \"r\"\n", at(Some(1), None, 2, 1)),
        ("step = [{ at_s = 0 }, { at_s = 1, do = \"wait\", bogus = 1 }]", at(Some(2), Some("bogus"), 2, 48)),
        ("[[step]]\nat_s = 0\nexpect = { d_state = { r1 = \"x\" } }\n", at(Some(1), Some("expect.d_state.r1"), 4, 29)),
        ("[[step]]\nat_s = 0\n[step.expect]\np_pending = -1\n", at(Some(1), Some("expect.p_pending"), 5, 13)),
    ];
    for (body, expected) in cases {
        let e = Scenario::from_toml_str(&steps(body)).err();
        let location = e.as_ref().and_then(|e| e.location().cloned());
        assert_eq!(location, Some(expected), "{e:?} for {body:?}");
    }
}
