//! Runs a [`Scenario`] on a [`Cluster`]: moves time to each step, carries out its event,
//! checks its expectations, then drains and checks that nothing is left held.
//!
//! The runner knows nothing of any scenario's name; it implements `docs/scenario-format.md`,
//! and drives kvflow's real connectors through the cluster.

use std::fmt::Write as _;

use kv_core::{EngineId, Time};
use kv_sched_adapter::Config;

use super::format::{Event, Expect, Node, Scenario, Step};
use crate::cluster::{Cluster, ClusterConfig};

/// How a scenario ended.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct Outcome {
    /// The scenario's name.
    pub name: String,
    /// The first expectation that did not hold, with the simulated time and what was seen.
    pub failure: Option<String>,
    /// A digest of the run's event trace: the same scenario and seed give the same digest.
    pub digest: u64,
    /// The simulated time when the run ended.
    pub ended_at: Time,
}

impl Outcome {
    /// Whether every expectation held.
    pub fn passed(&self) -> bool {
        self.failure.is_none()
    }
}

/// The cluster a scenario describes, with the network seeded by `seed`.
pub fn cluster_config(scenario: &Scenario, seed: u64) -> ClusterConfig {
    let spec = scenario.cluster.clone();
    ClusterConfig { connector: Config { mode: spec.mode, ..scenario.policy }, spec, seed, ..ClusterConfig::default() }
}

/// Runs `scenario` with the network seeded by `seed`.
pub fn run(scenario: &Scenario, seed: u64) -> Outcome {
    run_with_trace(scenario, seed).0
}

/// As [`run`], and the run's event trace (the same scenario and seed give the same trace).
pub fn run_with_trace(scenario: &Scenario, seed: u64) -> (Outcome, Vec<String>) {
    let built = Cluster::new(cluster_config(scenario, seed)).map_err(|e| e.to_string());
    let mut cluster = match built {
        Ok(cluster) => cluster,
        Err(e) => {
            let outcome = Outcome {
                name: scenario.name.clone(),
                failure: Some(format!("cannot build the cluster: {e}")),
                digest: 0,
                ended_at: Time::ZERO,
            };
            return (outcome, Vec::new());
        }
    };
    let failure = run_steps(scenario, &mut cluster).err();
    let outcome = Outcome { name: scenario.name.clone(), failure, digest: cluster.digest(), ended_at: cluster.now() };
    (outcome, cluster.trace().to_vec())
}

fn run_steps(scenario: &Scenario, cluster: &mut Cluster) -> Result<(), String> {
    let mut skipped = Vec::new();
    let result = run_checked_steps(scenario, cluster, &mut skipped);
    // An event that did not apply is no failure by itself (an engine ignores a schedule for a
    // request it already gave up); when the scenario fails, they are the first thing to read.
    result.map_err(|failure| {
        if skipped.is_empty() {
            failure
        } else {
            format!("{failure} (events that did not apply: {})", skipped.join("; "))
        }
    })
}

fn run_checked_steps(scenario: &Scenario, cluster: &mut Cluster, skipped: &mut Vec<String>) -> Result<(), String> {
    for (i, step) in scenario.steps.iter().enumerate() {
        let at = |cluster: &Cluster| format!("step {} at {:.3}s", i + 1, cluster.now().as_secs_f64());
        cluster.advance_to(step.at);
        if let Some(event) = &step.event {
            if let Err(e) = apply(cluster, event) {
                let line = format!("{}: {} did not apply: {e}", at(cluster), event.name());
                cluster.note(line.clone());
                skipped.push(line);
            }
        }
        check_violations(cluster).map_err(|e| format!("{}: {e}", at(cluster)))?;
        if let Some(expect) = &step.expect {
            check(cluster, expect).map_err(|e| format!("{}: {e}", at(cluster)))?;
        }
    }
    let last = scenario.steps.last().and_then(|s: &Step| s.expect.as_ref());
    let p = &scenario.policy;
    let limit = p.push_registration_timeout.max(p.decoder_kv_blocks_ttl) + p.push_quarantine + p.kv_lease_duration;
    cluster.drain(limit);
    let after = |cluster: &Cluster| format!("after the drain, at {:.3}s", cluster.now().as_secs_f64());
    check_violations(cluster).map_err(|e| format!("{}: {e}", after(cluster)))?;
    let held_expected = last.is_some_and(|e| {
        e.p_held_blocks.is_some()
            || e.d_held_blocks.is_some()
            || !e.p_held_blocks_on.is_empty()
            || !e.d_held_blocks_on.is_empty()
    });
    if !held_expected {
        let held = cluster.held_everywhere();
        if !held.is_empty() {
            let list: Vec<String> = held.iter().map(|(n, h)| format!("{n} holds {h}")).collect();
            return Err(format!("{}: blocks still held: {}", after(cluster), list.join(", ")));
        }
    }
    if last.is_none_or(|e| e.corrupt_reads.is_none()) && cluster.corrupt_reads() != 0 {
        return Err(format!("{}: {} corrupt reads", after(cluster), cluster.corrupt_reads()));
    }
    if last.is_none_or(|e| e.written_after_free.is_none()) && cluster.written_after_free() != 0 {
        return Err(format!("{}: {} blocks written after free", after(cluster), cluster.written_after_free()));
    }
    Ok(())
}

/// Carries out one event on the cluster; one the cluster refuses is an error that says why.
pub fn apply(cluster: &mut Cluster, event: &Event) -> Result<(), String> {
    let name = |n: &Node| n.engine_id().as_str().to_owned();
    let result = match event {
        Event::Prefill { request, prompt_tokens, n, node, consumer } => {
            let consumer = consumer.as_ref().map(name);
            cluster.prefill(&name(node), request, *prompt_tokens, *n, consumer.as_deref())
        }
        Event::Pause { node, for_ } => cluster.pause(&name(node), *for_),
        Event::Forge { from, to, message, request, consumers } => {
            cluster.forge(&name(from), &name(to), *message, request, *consumers)
        }
        Event::Intrude { to, claimed } => cluster.intrude(&name(to), &name(claimed)),
        Event::Lapse { node } => cluster.lapse(&name(node)),
        Event::BeginPrefill { request, prompt_tokens, node, consumer } => {
            let consumer = consumer.as_ref().map(name);
            cluster.begin_prefill(&name(node), request, *prompt_tokens, consumer.as_deref())
        }
        Event::Progress { request, tokens, node, layers: None, .. } => cluster.progress(&name(node), request, *tokens),
        Event::Progress { request, tokens, node, layers: Some(layers), whole_tokens } => {
            cluster.progress_layers(&name(node), request, whole_tokens.unwrap_or(0), *tokens, *layers)
        }
        Event::FinishPrefill { request, node } => cluster.finish_prefill(&name(node), request),
        Event::AbandonPrefill { request, node } => cluster.abandon_prefill(&name(node), request),
        Event::Arrive { request, node, from, remote_request, prompt_tokens, prefill_pp } => {
            cluster.arrive(&name(node), request, &name(from), remote_request, *prompt_tokens, *prefill_pp)
        }
        Event::Schedule { request, node, prefix_hit: false, cached_tokens: cached @ 1.. } => {
            cluster.schedule_cached(&name(node), request, *cached)
        }
        Event::Schedule { request, node, prefix_hit, .. } => cluster.schedule(&name(node), request, *prefix_hit),
        Event::Reject { request, node, from, remote_request, prefill_tp } => {
            cluster.reject(&name(node), request, &name(from), remote_request, *prefill_tp)
        }
        Event::Abort { request, node } => cluster.abort(&name(node), request),
        Event::Crash { node, detect } => cluster.crash(&name(node), *detect),
        Event::Restart { node } => cluster.restart(&name(node)),
        Event::Partition { a, b, until } => {
            cluster.partition(&name(a), &name(b), *until);
            Ok(())
        }
        Event::Delay { a, b, by, until } => {
            cluster.delay(&name(a), &name(b), *by, *until);
            Ok(())
        }
        Event::FailTransfer { request, node, from_block: None } => {
            cluster.fail_transfer(&name(node), request);
            Ok(())
        }
        Event::FailTransfer { request, node, from_block: Some(from) } => {
            cluster.fail_transfer_from(&name(node), request, *from);
            Ok(())
        }
        Event::Garbage { from, to, bytes } => {
            cluster.garbage(&name(from), &name(to), bytes);
            Ok(())
        }
        Event::Wait => Ok(()),
    };
    result.map_err(|e| e.to_string())
}

fn check_violations(cluster: &Cluster) -> Result<(), String> {
    match cluster.violations().first() {
        Some(v) => Err(format!("invariant violated: {v}")),
        None => Ok(()),
    }
}

fn expect_eq<T: PartialEq + std::fmt::Display>(key: &str, want: T, got: T) -> Result<(), String> {
    if want == got {
        Ok(())
    } else {
        Err(format!("expected {key} = {want}, saw {got}"))
    }
}

fn check(cluster: &Cluster, expect: &Expect) -> Result<(), String> {
    let p0 = Node::PREFILL0.engine_id();
    let d0 = Node::DECODE0.engine_id();
    if let Some(want) = expect.p_held_blocks {
        expect_eq("p_held_blocks", want, cluster.held_blocks(p0.as_str()))?;
    }
    for (node, want) in &expect.p_held_blocks_on {
        expect_eq(&format!("p_held_blocks_on.{node}"), *want, cluster.held_blocks(node.engine_id().as_str()))?;
    }
    if let Some(want) = expect.p_pending {
        expect_eq("p_pending", want, cluster.pending_exports(p0.as_str()))?;
    }
    for (request, want) in &expect.p_released {
        // prefill0 first; a request another P engine exported is looked up there.
        let got = cluster.release_reason(p0.as_str(), request).or_else(|| cluster.release_reason_anywhere(request));
        let got = got.map_or("not released", |r| r.as_str());
        expect_eq(&format!("p_released.{request}"), want.as_str(), got)?;
    }
    if let Some(want) = expect.d_held_blocks {
        expect_eq("d_held_blocks", want, cluster.held_blocks(d0.as_str()))?;
    }
    for (node, want) in &expect.d_held_blocks_on {
        expect_eq(&format!("d_held_blocks_on.{node}"), *want, cluster.held_blocks(node.engine_id().as_str()))?;
    }
    let d_node: EngineId = expect.d_node.engine_id();
    for (request, want) in &expect.d_state {
        let got = cluster.decode_state(d_node.as_str(), request).map_or("unknown", |s| s.as_str());
        expect_eq(&format!("d_state.{request} on {d_node}"), want.as_str(), got)?;
    }
    for (request, want) in &expect.d_blocks_read {
        let got = cluster.loaded(d_node.as_str(), request).map(|(read, _)| read);
        let got = got.ok_or_else(|| format!("d_blocks_read.{request} on {d_node}: its load has not ended"))?;
        expect_eq(&format!("d_blocks_read.{request} on {d_node}"), *want, got)?;
    }
    for (request, want) in &expect.d_tokens_kept {
        let got = cluster.loaded(d_node.as_str(), request).map(|(_, kept)| kept);
        let got = got.ok_or_else(|| format!("d_tokens_kept.{request} on {d_node}: its load has not ended"))?;
        expect_eq(&format!("d_tokens_kept.{request} on {d_node}"), *want, got)?;
    }
    let counters = cluster.counters();
    if let Some(want) = expect.notifications_after_expiry {
        expect_eq("notifications_after_expiry", want, counters.notifications_after_expiry)?;
    }
    if let Some(want) = expect.ignored_messages {
        expect_eq("ignored_messages", want, counters.ignored_messages)?;
    }
    if let Some(want) = expect.rejections_unsent {
        expect_eq("rejections_unsent", want, counters.rejections_unsent)?;
    }
    if let Some(want) = expect.corrupt_reads {
        expect_eq("corrupt_reads", want, cluster.corrupt_reads())?;
    }
    if let Some(want) = expect.written_after_free {
        expect_eq("written_after_free", want, cluster.written_after_free())?;
    }
    Ok(())
}

/// One line per outcome, as `cargo xtask sim` prints it.
pub fn report_line(outcome: &Outcome, label: &str) -> String {
    let mut line = String::new();
    match &outcome.failure {
        None => {
            let _ = write!(line, "ok   {label}: {} (digest {:016x})", outcome.name, outcome.digest);
        }
        Some(failure) => {
            let _ = write!(line, "FAIL {label}: {}: {failure}", outcome.name);
        }
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scenario(body: &str) -> Scenario {
        let text = format!("name = \"t\"\ncluster = {{ decoders = 2 }}\n{body}");
        Scenario::from_toml_str(&text).unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn events_the_cluster_refuses_say_why() {
        let s = scenario(
            r#"
            step = [
                { at_s = 0, do = "prefill", request = "r1", prompt_tokens = 64, consumer = "decode1" },
                { at_s = 0, do = "prefill", request = "r2", prompt_tokens = 64 },
                { at_s = 0, do = "arrive", request = "r2" },
                { at_s = 0, do = "fail_transfer", request = "r2", node = "decode0", from_block = 1 },
                { at_s = 0, do = "schedule", request = "r2", cached_tokens = 16 },
                { at_s = 0, do = "pause", node = "decode0", for_s = 1 },
                { at_s = 0, do = "forge", from = "decode1", to = "prefill0", message = "completion", request = "r2" },
                { at_s = 0, do = "intrude", to = "prefill0", as = "decode1" },
                { at_s = 0, do = "schedule", request = "r2", cached_tokens = 0 },
            ]
            "#,
        );
        let mut cluster = Cluster::new(cluster_config(&s, 0)).unwrap_or_else(|e| panic!("{e}"));
        let results: Vec<Result<(), String>> =
            s.steps.iter().filter_map(|s| s.event.as_ref()).map(|e| apply(&mut cluster, e)).collect();
        assert_eq!(
            results,
            vec![
                Ok(()),
                Ok(()),
                Ok(()),
                Ok(()),
                // r2's first 16 tokens are in decode0's prefix cache: it reads the other 3 blocks.
                Ok(()),
                Ok(()),
                // decode1 never handshook with prefill0: it has no session to forge under.
                Err("decode1 cannot speak to prefill0/tp0: unknown peer prefill0/tp0".to_owned()),
                Ok(()),
                // decode0 is paused: the schedule waits for its resume.
                Ok(()),
            ]
        );

        // The run records them as events that did not apply, and says so when it fails.
        let s = scenario("[[step]]\nat_s = 0\ndo = \"schedule\"\nrequest = \"r1\"\nexpect = { p_pending = 1 }");
        let failure = run(&s, 0).failure.unwrap_or_default();
        assert!(failure.ends_with("schedule did not apply: r1 is not waiting on decode0)"), "{failure}");
    }

    #[test]
    fn what_this_runner_cannot_check_fails_the_scenario_naming_it() {
        let cases = [
            (
                "expect = { d_blocks_read = { r1 = 0 } }",
                "step 1 at 0.000s: d_blocks_read.r1 on decode0: its load has not ended",
            ),
            (
                "expect = { d_tokens_kept = { r1 = 0 } }",
                "step 1 at 0.000s: d_tokens_kept.r1 on decode0: its load has not ended",
            ),
        ];
        for (expect, wanted) in cases {
            let failure = run(&scenario(&format!("[[step]]\nat_s = 0\n{expect}")), 0).failure;
            assert_eq!(failure.as_deref(), Some(wanted));
        }
        // The reader refuses a skew for an engine the cluster lacks; one built by hand names it.
        let mut skewed = scenario("");
        skewed.cluster.clock_skew.insert(Node::decode(7), -2_500_000_000);
        let failure = run(&skewed, 0).failure;
        assert_eq!(
            failure.as_deref(),
            Some("cannot build the cluster: clock_skew_ms names decode7, which the cluster does not have")
        );
    }

    #[test]
    fn a_lapse_reaches_every_other_engine_and_a_paused_one_when_it_resumes() {
        // decode1 owns r1 and dies silently; prefill0 is paused when decode1's registration
        // lapses, so it hears of it only at its resume, and releases r1 then.
        let s = scenario(
            r#"
            step = [
                { at_s = 0, do = "prefill", request = "r1", prompt_tokens = 64 },
                { at_s = 0.1, do = "arrive", request = "r1", node = "decode1" },
                { at_s = 1, do = "crash", node = "decode1" },
                { at_s = 1, do = "pause", node = "prefill0", for_s = 2 },
                { at_s = 1.5, do = "lapse", node = "decode1", expect = { p_pending = 1, p_held_blocks = 4 } },
                { at_s = 2.99, expect = { p_pending = 1, p_held_blocks = 4 } },
                { at_s = 3, expect = { p_pending = 0, p_held_blocks = 0, p_released = { r1 = "peer_lost" } } },
            ]
            "#,
        );
        let mut cluster = Cluster::new(cluster_config(&s, 0)).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(run_steps(&s, &mut cluster), Ok(()));
        let lines = [
            "1.500000000s decode1 registration lapsed: incarnation 1 is gone",
            "1.500000000s prefill0 is paused; it hears of the lapse when it resumes",
            "1.500000000s decode0 heard that decode1 incarnation 1 is gone",
            "3.000000000s prefill0 resumed",
            "3.000000000s prefill0 released r1 peer_lost",
            "3.000000000s prefill0 heard that decode1 incarnation 1 is gone",
        ];
        let trace: Vec<&str> = cluster.trace().iter().map(String::as_str).filter(|l| lines.contains(l)).collect();
        assert_eq!(trace, lines);
    }

    #[test]
    fn a_lapse_of_an_engine_the_cluster_lacks_names_it() {
        let s = scenario("");
        let mut cluster = Cluster::new(cluster_config(&s, 0)).unwrap_or_else(|e| panic!("{e}"));
        let lapse = |node| Event::Lapse { node };
        assert_eq!(
            apply(&mut cluster, &lapse(Node::decode(7))),
            Err("no engine decode7 whose registration could lapse".to_owned())
        );
        assert_eq!(
            apply(&mut cluster, &lapse(Node::prefill(3))),
            Err("no engine prefill3 whose registration could lapse".to_owned())
        );
        // An engine that is down may still lapse: its registration outlives it until its lease.
        assert_eq!(apply(&mut cluster, &Event::Crash { node: Node::decode(1), detect: false }), Ok(()));
        assert_eq!(apply(&mut cluster, &lapse(Node::decode(1))), Ok(()));
    }
}
