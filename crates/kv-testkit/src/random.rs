//! Random mode: seeded workloads with faults, run on the cluster with the invariants checked
//! all the time.
//!
//! A seed picks a cluster (pull or push; TP, block-size (P's blocks larger or smaller than
//! D's) and MLA combinations; one or two P and D engines; in four seeds of five, engines'
//! clocks that disagree, each skewed by up to 10 s either way, more than the lease included),
//! a policy (short leases, so that expiry happens),
//! network noise (drops, duplicates, reordering) and a workload: prompts of assorted lengths,
//! parallel-sampling siblings, chunked prefills (whose finished blocks push mode writes ahead,
//! half of them computed layer by layer, each layer written as it is reported, and which the
//! engine sometimes gives up), arrivals in push mode before P's prefill, prefix
//! hits (whole, and partial in both modes), rejections, aborts while waiting and while loading,
//! late schedules that the read fence must refuse, failed transfers, garbage, partitions,
//! delays, pauses (P's stall, overlapping pauses together, stays under the push quarantine, the
//! one hazard no one-sided transport fences), messages forged by a handshaked D engine about an
//! export that is not going to it, intruders, crashes with and without detection followed by
//! restarts, and discovery lapses of engines that are down (or, when an earlier crash's restart
//! came first, running again). Events that no longer apply (a schedule on an engine that
//! crashed) are skipped, as a router would. After every step the cluster's invariants are
//! checked: no block freed twice, no write into a freed block, no corrupt read; after the
//! drain, nothing is held on a live engine. A panic is a failure too. The same seed gives the
//! same run and digest.

use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Duration;

use kv_core::{RequestId, Role, Time};

use crate::cluster::{Cluster, ForgedMessage};
use kv_sched_adapter::{Config, LoadFailurePolicy, Mode};

use crate::scenario::format::{ClusterSpec, Event, Node, Scenario, Step};
use crate::scenario::runner::{apply, cluster_config};
use crate::Rng;

/// How one random run ended.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct RandomOutcome {
    /// The seed.
    pub seed: u64,
    /// The first invariant that broke, or the panic.
    pub failure: Option<String>,
    /// A digest of the run's event trace.
    pub digest: u64,
    /// Events the workload generated.
    pub events: usize,
    /// Events skipped because they no longer applied.
    pub skipped: usize,
    /// Requests whose KV reached D intact.
    pub loads_ok: u64,
    /// Transfers posted by prepared-list indices (D's reads and P's push writes).
    pub prepared: u64,
    /// Push writes posted while P still computed the prompt.
    pub writes_ahead: u64,
    /// Of those, and of the exports' last writes, writes of some model layers only.
    pub layer_writes: u64,
}

fn ms(v: u64) -> Duration {
    Duration::from_millis(v)
}

/// The workload of `seed`, as a scenario (without expectations: random mode checks invariants).
pub fn generate(seed: u64) -> Scenario {
    let mut rng = Rng::new(seed ^ 0x6b76_666c_6f77);
    // Chunked prefills draw from their own stream, so that the rest of a seed's workload is
    // what it was before they were added.
    let mut chunks = Rng::new(seed ^ 0x6368_756e_6b73);
    let mode = if rng.chance(0.4) { Mode::Push } else { Mode::Pull };
    let mla = rng.chance(0.15);
    // (P TP, D TP) pairs that map onto 8 heads (and MLA), both directions.
    let tps: &[(u32, u32)] = &[(1, 1), (1, 2), (2, 2), (2, 4), (2, 1), (4, 2), (4, 1), (1, 4)];
    let (prefill_tp, decode_tp) = tps[rng.below(tps.len() as u64) as usize];
    let p_block = [4u32, 8, 16][rng.below(3) as usize];
    let ratio = [1u32, 1, 2, 4][rng.below(4) as usize];
    // Half the seeds whose sizes differ give P the larger blocks, as vLLM maps them both ways;
    // drawn from a stream of their own, so that the rest of a seed's workload is unchanged.
    let (prefill_block, decode_block) = if ratio > 1 && Rng::new(seed ^ 0x626c_6f63_6b73).chance(0.5) {
        (p_block * ratio, p_block)
    } else {
        (p_block, p_block * ratio)
    };
    let prefillers = 1 + rng.below(2) as u32;
    let decoders = 1 + rng.below(2) as u32;
    let step_ms = [5u64, 10, 20][rng.below(3) as usize];
    // One P in five runs two pipeline stages, one layer each of the simulated model's two.
    let prefill_pp = if rng.chance(0.2) { 2 } else { 1 };
    let cluster = ClusterSpec {
        mode,
        prefillers,
        decoders,
        prefill_tp,
        decode_tp,
        prefill_pp,
        prefill_block_size: prefill_block,
        decode_block_size: decode_block,
        num_kv_heads: 8,
        mla,
        prefill_num_blocks: 400,
        decode_num_blocks: 400,
        step_interval: ms(step_ms),
        network_latency: ms(1 + rng.below(3)),
        transfer_latency: ms(2 + rng.below(20)),
        worker_handoff: ms(step_ms * (1 + rng.below(20))),
        clock_skew: BTreeMap::new(),
    };
    let cluster = ClusterSpec { clock_skew: draw_skews(seed, &cluster), ..cluster };
    let lease_s = 2 + rng.below(9);
    let mut policy = Config { mode, ..Config::with_lease(Duration::from_secs(lease_s)) };
    policy.decoder_kv_blocks_ttl = Duration::from_secs(5 + rng.below(20));
    policy.push_registration_timeout = policy.decoder_kv_blocks_ttl;
    policy.kv_load_failure_policy =
        if rng.chance(0.5) { LoadFailurePolicy::Recompute } else { LoadFailurePolicy::Fail };
    policy.early_notification_capacity = [4usize, 64, 8192][rng.below(3) as usize];

    let horizon_ms = 20_000 + rng.below(20_000);
    let requests = 5 + rng.below(40);
    let mut steps: Vec<Step> = Vec::new();
    let mut push =
        |at_ms: u64, event: Event| steps.push(Step { at: Time::from_millis(at_ms), event: Some(event), expect: None });
    let node = |rng: &mut Rng, prefill: bool| {
        if prefill {
            Node::prefill(rng.below(u64::from(prefillers)) as u32)
        } else {
            Node::decode(rng.below(u64::from(decoders)) as u32)
        }
    };
    let suffix = |rng: &mut Rng| format!("-{:08x}", rng.next_u64() as u32);
    // D may stall for any length: its read fence holds. P stalls less than the push quarantine
    // (2 x lease): a write stalled longer than that is the one hazard no one-sided transport
    // can fence (DESIGN.md rule 10), so it is documented, not simulated.
    let pause = |rng: &mut Rng, role: Role| match role {
        Role::Decode => ms(1 + rng.below(lease_s * 2500)),
        Role::Prefill => ms(1 + rng.below(lease_s * 1900)),
    };
    // The D engine each request goes to.
    let mut goes_to = Vec::with_capacity(requests as usize);
    for i in 0..requests {
        let t0 = rng.below(horizon_ms);
        let p = node(&mut rng, true);
        let d = node(&mut rng, false);
        goes_to.push(d);
        let prompt_tokens = 1 + rng.below(200);
        let n = if rng.chance(0.15) { 2 + rng.below(3) as u32 } else { 1 };
        let base = format!("r{i}");
        // Both legs carry the router's id; in push mode each engine may add its own suffix.
        let (p_id, d_remote) = if mode == Mode::Push && n == 1 && rng.chance(0.5) {
            (format!("{base}{}", suffix(&mut rng)), format!("{base}{}", suffix(&mut rng)))
        } else {
            (base.clone(), base.clone())
        };
        let sibling = |j: u32| if n > 1 { format!("{j}_{p_id}") } else { p_id.clone() };
        let picked = rng.below(u64::from(n)) as u32;
        let (d_request, remote_request) = if n > 1 {
            (RequestId::new(sibling(picked)), RequestId::new(sibling(picked)))
        } else {
            (RequestId::new(d_remote.clone()), RequestId::new(d_remote))
        };
        let arrive_early = mode == Mode::Push && rng.chance(0.3);
        let named = rng.chance(0.3);
        let t_prefill = if arrive_early { t0 + rng.below(3000) } else { t0 };
        // Sometimes the router has picked D already and names it to P.
        let consumer = named.then_some(d);
        let request = RequestId::new(p_id.clone());
        if n == 1 && chunks.chance(0.3) {
            // A chunked prefill that ends when the plain one would have: in push mode, the
            // blocks it finishes go ahead into D's registered blocks, if D came early.
            let compute = 1 + chunks.below(400);
            let begin = t_prefill.saturating_sub(compute);
            push(begin, Event::BeginPrefill { request: request.clone(), prompt_tokens, node: p, consumer });
            let parts = 1 + chunks.below(4);
            // Sometimes P computes each chunk layer by layer (up to 3 layer steps; the model
            // has 2, so the third says no more than the second) and reports each step.
            let layer_steps = if chunks.chance(0.5) { chunks.below(4) } else { 0 };
            for k in 1..=parts {
                let (whole_tokens, tokens) = (prompt_tokens * (k - 1) / parts, (prompt_tokens * k / parts).max(1));
                let (from, to) = (begin + compute * (k - 1) / (parts + 1), begin + compute * k / (parts + 1));
                for layers in 1..=layer_steps {
                    let at = from + (to - from) * layers / (layer_steps + 1);
                    let (layers, whole_tokens) = (Some(layers as u32), Some(whole_tokens));
                    push(at, Event::Progress { request: request.clone(), tokens, node: p, layers, whole_tokens });
                }
                let (layers, whole_tokens) = (None, None);
                push(to, Event::Progress { request: request.clone(), tokens, node: p, layers, whole_tokens });
            }
            if chunks.chance(0.1) {
                // The engine gives it up (preempted, aborted) at some point of its compute.
                push(begin + chunks.below(compute + 1), Event::AbandonPrefill { request, node: p });
            } else {
                push(t_prefill, Event::FinishPrefill { request, node: p });
            }
        } else {
            push(t_prefill, Event::Prefill { request, prompt_tokens, n, node: p, consumer });
        }
        let t_arrive = if arrive_early { t0 } else { t0 + rng.below(500) };
        let roll = rng.below(100);
        if roll < 8 {
            // D rejects before admission.
            push(t_arrive, Event::Reject { request: d_request, node: d, from: p, remote_request, prefill_tp: None });
            continue;
        }
        if roll < 12 {
            // Nobody ever comes for it: the lease frees it.
            continue;
        }
        let arrive_tokens = arrive_early.then_some(prompt_tokens);
        let arrive = Event::Arrive {
            request: d_request.clone(),
            node: d,
            from: p,
            remote_request: remote_request.clone(),
            prompt_tokens: arrive_tokens,
            prefill_pp: None,
        };
        push(t_arrive, arrive);
        // Usually soon; sometimes so late that the lease may have gone, which the fence must catch.
        let wait = if rng.chance(0.15) { rng.below(lease_s * 2000) } else { rng.below(300) };
        let t_schedule = t_arrive + wait;
        let roll = rng.below(100);
        if roll < 5 {
            push(t_arrive + rng.below(200), Event::Abort { request: d_request.clone(), node: d });
            continue;
        }
        // Sometimes D's own prefix cache holds the first blocks, and it reads (or is pushed)
        // the rest.
        let d_blocks = prompt_tokens.div_ceil(u64::from(decode_block));
        if roll < 8 {
            let failing = if mode == Mode::Push { p } else { d };
            // Half of them fail part-way, from some block of the prompt on.
            let from_block = rng.chance(0.5).then(|| rng.below(d_blocks + 1) as u32);
            push(t_schedule, Event::FailTransfer { request: remote_request.clone(), node: failing, from_block });
        }
        let cached_tokens = if rng.chance(0.1) { rng.below(d_blocks + 1) * u64::from(decode_block) } else { 0 };
        push(
            t_schedule,
            Event::Schedule { request: d_request.clone(), node: d, prefix_hit: rng.chance(0.05), cached_tokens },
        );
        if rng.chance(0.06) {
            // A stall with the transfer in flight: D's read, or P's push write, may outlast the lease.
            let stalled = if mode == Mode::Push && rng.chance(0.5) { p } else { d };
            let at = t_schedule + rng.below(20);
            push(at, Event::Pause { node: stalled, for_: pause(&mut rng, stalled.role) });
        }
        if (8..12).contains(&roll) {
            push(t_schedule + rng.below(20), Event::Abort { request: d_request.clone(), node: d });
        }
        if n > 1 && rng.chance(0.5) {
            // Another sibling, served from D's prefix cache.
            let other = RequestId::new(sibling((picked + 1) % n));
            let t = t_schedule + 1 + rng.below(200);
            push(
                t,
                Event::Arrive {
                    request: other.clone(),
                    node: d,
                    from: p,
                    remote_request: other.clone(),
                    prompt_tokens: None,
                    prefill_pp: None,
                },
            );
            push(t + rng.below(100), Event::Schedule { request: other, node: d, prefix_hit: true, cached_tokens: 0 });
        }
    }
    let faults = rng.below(8);
    for _ in 0..faults {
        let t = rng.below(horizon_ms);
        let (p, d) = (node(&mut rng, true), node(&mut rng, false));
        match rng.below(9) {
            0 => {
                let victim = if rng.chance(0.5) { d } else { p };
                let detect = rng.chance(0.5);
                let down_for = 100 + rng.below(5000);
                push(t, Event::Crash { node: victim, detect });
                if rng.chance(0.5) {
                    // Its discovery registration lapses while it is down: a host that died
                    // silently, or an engine that stopped at its own registration's fence. An
                    // earlier crash's restart may come first: the lapse then names the running
                    // incarnation, which P drops at its next handshake.
                    push(t + 1 + rng.below(down_for - 1), Event::Lapse { node: victim });
                }
                push(t + down_for, Event::Restart { node: victim });
            }
            1 => push(t, Event::Partition { a: p, b: d, until: Time::from_millis(t + rng.below(lease_s * 1500)) }),
            2 => push(
                t,
                Event::Delay { a: d, b: p, by: ms(rng.below(300)), until: Time::from_millis(t + rng.below(3000)) },
            ),
            3 => push(
                t,
                Event::Delay { a: p, b: d, by: ms(rng.below(300)), until: Time::from_millis(t + rng.below(3000)) },
            ),
            4 | 5 => {
                let bytes = (0..rng.below(64)).map(|_| rng.next_u64() as u8).collect();
                push(t, Event::Garbage { from: d, to: p, bytes });
            }
            6 => {
                let stalled = if rng.chance(0.5) { d } else { p };
                push(t, Event::Pause { node: stalled, for_: pause(&mut rng, stalled.role) });
            }
            7 => {
                // A handshaked D speaks for an export it may not own.
                let messages =
                    [ForgedMessage::Completion, ForgedMessage::Abort, ForgedMessage::Heartbeat, ForgedMessage::Reject];
                let message = messages[rng.below(4) as usize];
                let index = rng.below(requests);
                let request = RequestId::new(format!("r{index}"));
                let consumers = 1 + rng.below(4) as u32;
                // From a D the request does not go to: the request's own D saying it is done
                // with the export is its owner's word, not an attack, and a real D never says
                // so and then reads (or registers) for it all the same.
                let owner = goes_to[index as usize];
                let from = if owner == d { Node::decode((d.index + 1) % decoders) } else { d };
                if from != owner {
                    push(t, Event::Forge { from, to: p, message, request, consumers });
                }
            }
            _ => {
                let (to, claimed) = if rng.chance(0.5) { (p, d) } else { (d, p) };
                push(t, Event::Intrude { to, claimed });
            }
        }
    }
    steps.sort_by_key(|s| s.at);
    bound_prefill_stalls(&mut steps, ms(lease_s * 1900));
    Scenario { name: format!("random seed {seed}"), cluster, policy, steps }
}

/// The most an engine's clock is skewed in a random workload, either way: more than the
/// longest lease drawn (10 s), so that some engines disagree by more than a lease.
pub const MAX_SKEW: Duration = Duration::from_secs(10);

/// Each engine's clock skew, in four seeds of five, uniform in `-MAX_SKEW..=MAX_SKEW` to the
/// nanosecond; none in the fifth. Drawn from a stream of their own, so that the rest of a seed's
/// workload is what it was before skews were drawn.
fn draw_skews(seed: u64, cluster: &ClusterSpec) -> BTreeMap<Node, i64> {
    let mut clocks = Rng::new(seed ^ 0x636c_6f63_6b73);
    if !clocks.chance(0.8) {
        return BTreeMap::new();
    }
    let max = MAX_SKEW.as_nanos() as u64;
    cluster.nodes().map(|node| (node, clocks.below(2 * max + 1) as i64 - max as i64)).collect()
}

/// Clips P's pauses, in time order, so that pauses that overlap (a second one extends the
/// first) stall a P for at most `longest` in a row, as one pause alone may.
fn bound_prefill_stalls(steps: &mut [Step], longest: Duration) {
    let mut stalls: BTreeMap<u32, (Time, Time)> = BTreeMap::new();
    for step in steps {
        let Some(Event::Pause { node, for_ }) = &mut step.event else { continue };
        if node.role != Role::Prefill {
            continue;
        }
        let at = step.at;
        match stalls.get_mut(&node.index) {
            Some((since, until)) if at <= *until => {
                let end = (at + *for_).min(*since + longest).max(at);
                *for_ = end.saturating_since(at);
                *until = (*until).max(end);
            }
            _ => {
                stalls.insert(node.index, (at, at + *for_));
            }
        }
    }
}

/// Generates the workload of `seed` and runs it, checking the invariants all the time.
pub fn run(seed: u64) -> RandomOutcome {
    run_with_trace(seed).0
}

/// As [`run`], and the run's event trace (the same seed gives the same trace).
pub fn run_with_trace(seed: u64) -> (RandomOutcome, Vec<String>) {
    run_workload(&generate(seed), seed)
}

/// Runs `scenario` (seed `seed`'s workload, or one changed from it) as random mode runs a
/// seed's, with the network's noise drawn from `seed`, checking the invariants all the time;
/// returns how it ended and its event trace.
pub fn run_workload(scenario: &Scenario, seed: u64) -> (RandomOutcome, Vec<String>) {
    let mut trace = Vec::new();
    let events = scenario.steps.len();
    let mut outcome = RandomOutcome {
        seed,
        failure: None,
        digest: 0,
        events,
        skipped: 0,
        loads_ok: 0,
        prepared: 0,
        writes_ahead: 0,
        layer_writes: 0,
    };
    let result = catch_unwind(AssertUnwindSafe(|| run_checked(scenario, seed, &mut outcome, &mut trace)));
    match result {
        Ok(Ok(())) => {}
        Ok(Err(failure)) => outcome.failure = Some(failure),
        Err(panic) => {
            let message = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_else(|| "a panic".to_owned());
            outcome.failure = Some(format!("panicked: {message}"));
        }
    }
    (outcome, trace)
}

fn run_checked(
    scenario: &Scenario,
    seed: u64,
    outcome: &mut RandomOutcome,
    trace: &mut Vec<String>,
) -> Result<(), String> {
    let mut config = cluster_config(scenario, seed);
    let mut rng = Rng::new(seed);
    config.drop_rate = if rng.chance(0.5) { rng.below(30) as f64 / 1000.0 } else { 0.0 };
    config.duplicate_rate = if rng.chance(0.5) { rng.below(50) as f64 / 1000.0 } else { 0.0 };
    config.reorder_jitter = ms(rng.below(3));
    let mut cluster = Cluster::new(config).map_err(|e| format!("cannot build the cluster: {e}"))?;
    let check = |cluster: &Cluster| -> Result<(), String> {
        if let Some(v) = cluster.violations().first() {
            return Err(format!("invariant violated: {v}"));
        }
        if cluster.corrupt_reads() > 0 {
            return Err(format!("{} corrupt reads by {:.3}s", cluster.corrupt_reads(), cluster.now().as_secs_f64()));
        }
        if cluster.written_after_free_found() > 0 {
            let found = cluster.written_after_free_found();
            return Err(format!("{found} blocks written after free by {:.3}s", cluster.now().as_secs_f64()));
        }
        Ok(())
    };
    for step in &scenario.steps {
        cluster.advance_to(step.at);
        if let Some(event) = &step.event {
            if let Err(e) = apply(&mut cluster, event) {
                cluster.note(format!("skipped {}: {e}", event.name()));
                outcome.skipped += 1;
            }
        }
        if let Err(e) = check(&cluster) {
            trace.extend_from_slice(cluster.trace());
            return Err(e);
        }
    }
    let p = &scenario.policy;
    let quarantine = cluster_config(scenario, seed).connector.push_quarantine;
    let limit = p.push_registration_timeout.max(p.decoder_kv_blocks_ttl)
        + quarantine
        + p.kv_lease_duration
        + Duration::from_secs(5);
    // A pause that ends after the last step delays everything it held back.
    let resumed = scenario
        .steps
        .iter()
        .filter_map(|s| match &s.event {
            Some(Event::Pause { for_, .. }) => Some(s.at + *for_),
            _ => None,
        })
        .max()
        .unwrap_or(Time::ZERO);
    cluster.advance_to(resumed.max(cluster.now()));
    cluster.drain(limit);
    trace.extend_from_slice(cluster.trace());
    check(&cluster)?;
    if cluster.written_after_free() > 0 {
        return Err(format!("after the drain, {} blocks written after free", cluster.written_after_free()));
    }
    outcome.digest = cluster.digest();
    outcome.loads_ok = cluster.loads_verified();
    let counters = cluster.counters();
    outcome.prepared = counters.prepared_reads + counters.prepared_writes;
    outcome.writes_ahead = counters.writes_ahead;
    outcome.layer_writes = counters.layer_writes;
    let held = cluster.held_everywhere();
    if !held.is_empty() {
        let list: Vec<String> = held.iter().map(|(n, h)| format!("{n} holds {h}")).collect();
        // The state of D's workers is what a held-block failure is debugged from.
        trace.push(cluster.describe_decode_workers());
        return Err(format!(
            "after the drain, at {:.3}s, blocks still held: {}",
            cluster.now().as_secs_f64(),
            list.join(", ")
        ));
    }
    Ok(())
}
