//! What a demo run measured ([`Report`]): requests by outcome, releases on P by reason, bytes,
//! throughput and latencies, the D blocks partial prefix hits read against those they needed,
//! how long the killed engine's exports stayed held, the attacks, each engine incarnation's
//! scraped metrics and promtool's word on them, and the checks; [`Report::failures`] names
//! every check that failed, and the report prints as text or as one JSON object.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::prometheus::Exposition;
use serde_json::{json, Value};

use super::metrics::Promtool;
use super::model::ModelReport;
use super::soak::SoakReport;
use super::Demo;
use crate::proto::{AttackPlan, AttackResult, NodeRole};

mod availability;

use availability::Availability;

/// How many attacks `kvflow-attack` makes with each plan (see `kv_demo::attacker`).
fn attacks_in(plan: AttackPlan) -> usize {
    match plan {
        AttackPlan::Messages => 12,
        AttackPlan::ContendedFlood { .. } => 1,
        AttackPlan::MessagesShort => 11,
        AttackPlan::Storms => 5,
    }
}

/// The longest a dead D engine's export may stay held on P after the death: P hears of the
/// death when the engine's side channel closes, and releases what was bound to it at once.
/// After a silent death (`--kill-silently`) P hears of it when the engine's etcd lease lapses:
/// the bound is then the lease's TTL plus this.
const DEATH_RELEASE_BOUND_MS: u64 = 1000;

/// The `p`th percentile of `values`; zero for none.
fn percentile(values: &[u64], p: f64) -> u64 {
    crate::stats::quantile(values, p / 100.0).unwrap_or(0)
}

/// Every P incarnation killed (a soak kills one every few minutes).
fn killed_prefills(demo: &Demo) -> Vec<u64> {
    demo.past_p_kills.iter().chain(&demo.p_kill).map(|k| k.instance).collect()
}

/// The partial prefix hits of a run (see [`Report`]'s `partial`).
#[derive(Default)]
struct PartialHits {
    sent: usize,
    ready: usize,
    needed: u64,
    read: u64,
    cached: u64,
    first_wrong: Option<(String, u64, u64)>,
}

impl PartialHits {
    fn new(demo: &Demo) -> PartialHits {
        let mut hits = PartialHits::default();
        // In push mode P reports the bytes it wrote: a killed P's last reports die with it.
        let killed_p = if demo.config.push { killed_prefills(demo) } else { Vec::new() };
        for (id, track) in &demo.tracks {
            let Some(partial) = track.partial else { continue };
            hits.sent += 1;
            if track.outcome.as_deref() != Some("ok") || killed_p.contains(&track.exported_by) {
                continue;
            }
            let (needed, read) = (partial.needed() as u64, partial.read(track.bytes_read));
            hits.ready += 1;
            hits.needed += needed;
            hits.read += read;
            hits.cached += partial.cached as u64;
            if read != needed && hits.first_wrong.is_none() {
                hits.first_wrong = Some((id.clone(), read, needed));
            }
        }
        hits
    }
}

/// What a run measured.
pub struct Report {
    mode: &'static str,
    transport: &'static str,
    requests: u32,
    exports: usize,
    outcomes: BTreeMap<String, u64>,
    releases: BTreeMap<String, u64>,
    bytes: u64,
    transfers: usize,
    transfers_failed: usize,
    transfer_gbps: f64,
    run_gbps: f64,
    elapsed: Duration,
    transfer_p50_us: u64,
    transfer_p99_us: u64,
    kv_p50_us: u64,
    kv_p99_us: u64,
    kv_samples: usize,
    /// Each request's P done to D holds KV over its own completing transfer's time.
    kv_over_transfer_p50: f64,
    kv_over_transfer_p99: f64,
    /// From the router's submit to D holding the KV.
    submit_p50_us: u64,
    submit_p99_us: u64,
    /// Requests whose KV D came to hold, over the time from the first submit to the last of
    /// them.
    throughput_rps: f64,
    killed: Option<String>,
    /// `--kill-prefill`: the P incarnation killed, its releases as the router heard them, and
    /// as its metrics said just before its death (they need not agree: it freed more in
    /// between); the checks on releases are then the new incarnation's.
    killed_prefill: Option<String>,
    killed_prefill_releases: BTreeMap<String, u64>,
    killed_prefill_scraped: Option<BTreeMap<String, u64>>,
    pauses: Vec<(String, u64)>,
    attacks: Option<Vec<AttackResult>>,
    /// Which attacks the run made.
    attack_plan: Option<AttackPlan>,
    /// The demo's availability under each storm.
    availability: Vec<Availability>,
    /// Exports released as `peer_lost` while the D engine they went to was alive.
    released_for_live_engines: usize,
    held_after_death_ms: Option<u64>,
    /// The bound on `held_after_death_ms`: [`DEATH_RELEASE_BOUND_MS`], plus the etcd TTL
    /// after a silent death.
    death_bound_ms: u64,
    /// The killed engine died silently (its network cut, then killed).
    silent_death: bool,
    /// After a silent death: how long after the cut the router's own watch saw its
    /// registration go.
    lapse_seen_after_ms: Option<u64>,
    longest_held_after_death: Option<String>,
    /// The killed engine's exports still held at its death, by how P released them.
    dead_engine_releases: BTreeMap<String, u64>,
    lease_ms: u64,
    /// Partial prefix hits: sent to D, and those that ended `ok`, with the D blocks they
    /// needed (not cached), read (measured from the bytes of their completed transfers) and
    /// found cached, summed; and the first that read other than it needed (id, read, needed).
    partial: PartialHits,
    corrupt_reads: u64,
    written_after_free: u64,
    /// P's push writes posted while a prompt still computed (chunked prefill).
    writes_ahead: u64,
    held_after_drain: BTreeMap<String, u64>,
    unreleased_exports: usize,
    /// Exports the killed P held when it died.
    died_with_prefill: usize,
    /// Each incarnation's scraped metrics (`decode1#2`), by sample (`name{labels}`): counters,
    /// gauges, and histograms' `_sum` and `_count`.
    metrics: BTreeMap<String, BTreeMap<String, f64>>,
    /// Each incarnation's non-zero counts in short, for the text report.
    metrics_summary: BTreeMap<String, String>,
    /// Incarnations that could not be scraped when they were due, and why.
    unscraped: Vec<String>,
    /// P's `kvflow_releases_total` by reason (non-zero ones), if P was scraped.
    scraped_releases: Option<BTreeMap<String, u64>>,
    /// P's `kvflow_ignored_messages_total` by cause, over its ranks, if P was scraped.
    p_ignored: Option<BTreeMap<String, u64>>,
    /// Peers each scraped incarnation cut off (`kvflow_peers_cut_off_total`, over its ranks),
    /// where any, and whether it is P.
    peers_cut_off: BTreeMap<String, (u64, bool)>,
    /// `promtool check metrics` on every scrape.
    promtool: Promtool,
    /// With a model: its tokens against one engine's.
    model: Option<ModelReport>,
    /// A soak's faults and samples.
    soak: Option<SoakReport>,
    errors: Vec<String>,
}

impl Report {
    /// What `demo` saw in `elapsed`, with every engine's pool checks after the drain (`stats`),
    /// its scrapes, and promtool's word on them.
    pub(super) fn new(
        demo: &Demo,
        elapsed: Duration,
        stats: BTreeMap<String, Value>,
        promtool: Promtool,
        model: Option<ModelReport>,
    ) -> Report {
        let mut outcomes = BTreeMap::new();
        // Releases by the P incarnation running at the end, and by the one killed, if one was.
        let (mut releases, mut killed_prefill_releases) = (BTreeMap::new(), BTreeMap::new());
        let killed_p = killed_prefills(demo);
        for track in demo.tracks.values() {
            *outcomes.entry(track.outcome.clone().unwrap_or_else(|| "unfinished".into())).or_insert(0) += 1;
            if let Some((reason, _)) = &track.freed {
                let by_killed = killed_p.contains(&track.freed_by);
                let into = if by_killed { &mut killed_prefill_releases } else { &mut releases };
                *into.entry(reason.clone()).or_insert(0) += 1;
            }
        }
        let done: Vec<_> = demo.transfers.iter().filter(|t| t.2).collect();
        let bytes: u64 = done.iter().map(|t| t.0).sum();
        let busy_ns: u64 = done.iter().map(|t| t.1).sum();
        let took: Vec<u64> = done.iter().map(|t| t.1 / 1000).collect();
        let kv: Vec<u64> = demo.tracks.values().filter_map(|t| Some(t.kv_latency_ns()? / 1000)).collect();
        let kv_over_transfer: Vec<f64> = demo.tracks.values().filter_map(|t| t.kv_over_transfer()).collect();
        let ratio = |q| crate::stats::quantile(&kv_over_transfer, q).unwrap_or(0.0);
        let submit: Vec<u64> = demo.tracks.values().filter_map(|t| Some(t.submit_to_kv_ns()? / 1000)).collect();
        let first_submit = demo.tracks.values().filter_map(|t| t.submitted_at_ns).min();
        let last_ready =
            demo.tracks.values().filter(|t| t.submit_to_kv_ns().is_some()).filter_map(|t| t.ready_at_ns).max();
        let throughput_rps = match (first_submit, last_ready) {
            (Some(first), Some(last)) if last > first => submit.len() as f64 / ((last - first) as f64 / 1e9),
            _ => 0.0,
        };
        let mut longest_held_after_death = None;
        // Every D killed (a soak kills one every few minutes), the last one `demo.kill`.
        let kills: Vec<&super::router::Kill> = demo.past_kills.iter().chain(&demo.kill).collect();
        let killed_d: Vec<(String, u64)> = kills.iter().map(|k| (k.engine.clone(), k.instance)).collect();
        let held_after_death_ms = (!kills.is_empty()).then(|| {
            kills
                .iter()
                .flat_map(|k| demo.tracks.iter().map(move |(id, t)| (k, id, t)))
                .filter(|(k, _, t)| t.decode.as_ref().is_some_and(|(d, i)| *d == k.engine && *i == k.instance))
                // A block is held from its export (which may come after the death, in push
                // mode) until it is freed.
                .filter_map(|(k, id, t)| Some((id, t.freed.as_ref()?, t.finished_at_ns?.max(k.at_ns))))
                .map(|(id, (reason, freed), from)| (*freed, from, format!("{id}, released as {reason}")))
                // P cannot release anything while it is stopped: count from its resume.
                .map(|(freed, from, what)| {
                    let p_stops = demo.paused_done.iter().filter(|(p, _, _)| p.engine == "prefill0");
                    let from = p_stops
                        .filter(|&&(_, began, ended)| began < freed && ended > from)
                        .fold(from, |from, &(_, _, ended)| from.max(ended));
                    ((freed.saturating_sub(from)) / 1_000_000, what)
                })
                .max()
                .map_or(0, |(ms, what)| {
                    longest_held_after_death = Some(what);
                    ms
                })
        });
        let mut dead_engine_releases = BTreeMap::new();
        for k in &kills {
            let dead = demo
                .tracks
                .values()
                .filter(|t| t.decode.as_ref().is_some_and(|(d, i)| *d == k.engine && *i == k.instance));
            // What the promise is about: exports still held when the engine died.
            for (reason, _) in dead.filter_map(|t| t.freed.as_ref()).filter(|(_, at)| *at >= k.at_ns) {
                *dead_engine_releases.entry(reason.clone()).or_insert(0) += 1;
            }
        }
        let mut held_after_drain = BTreeMap::new();
        let (mut written_after_free, mut corrupt_reads, mut writes_ahead) = (0, 0, 0);
        for (name, s) in &stats {
            held_after_drain.insert(name.clone(), s["held_blocks"].as_u64().unwrap_or(0));
            written_after_free += s["written_after_free"].as_u64().unwrap_or(0);
            writes_ahead += s["writes_ahead"].as_u64().unwrap_or(0);
        }
        let metrics = demo.scrapes.iter().map(|s| (s.incarnation.clone(), s.exposition.flat())).collect();
        let metrics_summary = demo.scrapes.iter().map(|s| (s.incarnation.clone(), summary(&s.exposition))).collect();
        // The P incarnation running at the end (the killed one was scraped first, just before).
        let p = demo.scrapes.iter().rev().find(|s| s.role == NodeRole::Prefill).map(|s| &s.exposition);
        // Each killed P incarnation was scraped just before its death: their releases, summed.
        let killed_names: Vec<String> = killed_p.iter().map(|i| super::metrics::incarnation("prefill0", *i)).collect();
        let killed_scrapes: Vec<&Exposition> =
            demo.scrapes.iter().filter(|s| killed_names.contains(&s.incarnation)).map(|s| &s.exposition).collect();
        let killed_prefill_scraped = (!killed_scrapes.is_empty()).then(|| {
            let mut sums = BTreeMap::new();
            for scrape in killed_scrapes {
                for (reason, v) in
                    scrape.sum_by("kvflow_releases_total", "reason", &[]).into_iter().filter(|(_, v)| *v != 0.0)
                {
                    *sums.entry(reason).or_insert(0) += v as u64;
                }
            }
            sums
        });
        let counts = |sums: BTreeMap<String, f64>| -> BTreeMap<String, u64> {
            sums.into_iter().filter(|(_, v)| *v != 0.0).map(|(k, v)| (k, v as u64)).collect()
        };
        let scraped_releases = p.map(|p| counts(p.sum_by("kvflow_releases_total", "reason", &[])));
        let p_ignored = p.map(|p| counts(p.sum_by("kvflow_ignored_messages_total", "cause", &[])));
        let peers_cut_off = demo
            .scrapes
            .iter()
            .map(|s| {
                (
                    s.incarnation.clone(),
                    (s.exposition.sum("kvflow_peers_cut_off_total", &[]) as u64, s.role == NodeRole::Prefill),
                )
            })
            .filter(|(_, (n, _))| *n > 0)
            .collect();
        corrupt_reads += outcomes.get("corrupt").copied().unwrap_or(0);
        // With a model, D checks no pattern: a load is corrupt if the prompt's KV it decoded
        // from is not one engine's.
        corrupt_reads += model.as_ref().map_or(0, |m| m.kv_differs() as u64);
        Report {
            mode: if demo.config.push { "push" } else { "pull" },
            transport: demo.config.transport.name(),
            // A soak sends requests until its time is up.
            requests: if demo.soak.is_some() { demo.issued } else { demo.config.requests },
            exports: demo.tracks.len(),
            releases,
            bytes,
            transfers: done.len(),
            transfers_failed: demo.transfers.len() - done.len(),
            transfer_gbps: if busy_ns == 0 { 0.0 } else { bytes as f64 / busy_ns as f64 },
            run_gbps: bytes as f64 / elapsed.as_nanos().max(1) as f64,
            elapsed,
            transfer_p50_us: percentile(&took, 50.0),
            transfer_p99_us: percentile(&took, 99.0),
            kv_p50_us: percentile(&kv, 50.0),
            kv_p99_us: percentile(&kv, 99.0),
            kv_samples: kv.len(),
            kv_over_transfer_p50: ratio(0.5),
            kv_over_transfer_p99: ratio(0.99),
            submit_p50_us: percentile(&submit, 50.0),
            submit_p99_us: percentile(&submit, 99.0),
            throughput_rps,
            killed: demo.kill.as_ref().map(|k| k.engine.clone()),
            // Every P incarnation killed (a soak kills several), the last one's way of dying.
            killed_prefill: demo
                .p_kill
                .as_ref()
                .map(|k| format!("{}{}", killed_names.join(", "), if k.mid_write { " mid-write" } else { "" })),
            killed_prefill_releases,
            killed_prefill_scraped,
            pauses: demo.paused_done.iter().map(|(p, _, _)| (p.engine.clone(), p.length.as_millis() as u64)).collect(),
            attacks: demo.config.attack.map(|_| demo.attacks.clone()),
            attack_plan: demo.config.attack,
            availability: Availability::of(&demo.attacks, &demo.ready_at, &demo.transfer_at, demo.config.rate),
            released_for_live_engines: demo
                .tracks
                .values()
                .filter(|t| t.freed.as_ref().is_some_and(|(reason, _)| reason == "peer_lost"))
                .filter(|t| t.decode.as_ref().is_some_and(|d| !killed_d.contains(d)))
                .count(),
            held_after_death_ms,
            death_bound_ms: match &demo.kill {
                Some(k) if k.silent => demo.config.etcd_ttl_s * 1000 + DEATH_RELEASE_BOUND_MS,
                _ => DEATH_RELEASE_BOUND_MS,
            },
            silent_death: demo.kill.as_ref().is_some_and(|k| k.silent),
            lapse_seen_after_ms: demo.kill.as_ref().and_then(|k| {
                let seen = demo.lapses.iter().find(|(e, i, _)| *e == k.engine && *i == k.instance)?;
                Some(seen.2.saturating_sub(k.at_ns) / 1_000_000)
            }),
            longest_held_after_death,
            dead_engine_releases,
            lease_ms: demo.config.lease_ms,
            partial: PartialHits::new(demo),
            corrupt_reads,
            written_after_free,
            writes_ahead,
            // A killed P's exports died with it (its process and pool are gone).
            unreleased_exports: demo
                .tracks
                .values()
                .filter(|t| t.finished_at_ns.is_some() && t.freed.is_none() && !killed_p.contains(&t.exported_by))
                .count(),
            died_with_prefill: demo
                .tracks
                .values()
                .filter(|t| t.finished_at_ns.is_some() && t.freed.is_none() && killed_p.contains(&t.exported_by))
                .count(),
            held_after_drain,
            metrics,
            metrics_summary,
            unscraped: demo.unscraped.clone(),
            scraped_releases,
            p_ignored,
            peers_cut_off,
            promtool,
            model,
            soak: demo.soak.as_ref().map(SoakReport::new),
            outcomes,
            errors: demo.errors.clone(),
        }
    }

    /// Every check the run failed, in words; empty when it passed.
    pub fn failures(&self) -> Vec<String> {
        let mut f = Vec::new();
        if self.corrupt_reads > 0 {
            f.push(format!("{} corrupt reads", self.corrupt_reads));
        }
        if self.written_after_free > 0 {
            f.push(format!("{} blocks written after they were freed", self.written_after_free));
        }
        if let Some((id, read, needed)) = &self.partial.first_wrong {
            f.push(format!(
                "partial prefix hit {id} read {read} D blocks from P, but needed {needed} (the rest were cached)"
            ));
        }
        let held: u64 = self.held_after_drain.values().sum();
        if held > 0 {
            f.push(format!("{held} blocks still held after the drain: {:?}", self.held_after_drain));
        }
        if self.unreleased_exports > 0 {
            f.push(format!("{} exports P never released", self.unreleased_exports));
        }
        if self.killed_prefill.as_ref().is_some_and(|k| !k.ends_with("mid-write")) && self.mode == "push" {
            f.push(
                "P was to die with a push write in flight, but posted none within 10 s and was killed outright".into(),
            );
        }
        if let Some(ms) = self.held_after_death_ms.filter(|&ms| ms > self.death_bound_ms) {
            f.push(format!(
                "a block stayed held {ms} ms after its D engine died, longer than {} ms (lease {} ms): {}",
                self.death_bound_ms,
                self.lease_ms,
                self.longest_held_after_death.as_deref().unwrap_or("?")
            ));
        }
        if self.silent_death {
            // Only the lapse can have told P that D is gone (what D said before the cut may
            // still release some, as transferred or rejected): none may wait for its lease.
            if let Some(expired) = self.dead_engine_releases.get("expired") {
                f.push(format!(
                    "{expired} of the silently dead D's exports waited for their lease, not its lapse: {:?}",
                    self.dead_engine_releases
                ));
            }
            if !self.dead_engine_releases.contains_key("peer_lost") {
                f.push(format!(
                    "P released none of the silently dead D's exports as peer_lost (those held at its death: {:?}): \
                     the run proved nothing",
                    self.dead_engine_releases
                ));
            }
            if self.lapse_seen_after_ms.is_none() {
                f.push("the router never saw the silently dead D's registration lapse".into());
            }
        }
        if let Some(n) = self.outcomes.get("unfinished") {
            f.push(format!("{n} exports never finished"));
        }
        if self.released_for_live_engines > 0 {
            f.push(format!(
                "{} exports released as peer_lost while their D engine was alive",
                self.released_for_live_engines
            ));
        }
        if let (Some(attacks), Some(plan)) = (&self.attacks, self.attack_plan) {
            let expected = attacks_in(plan);
            if attacks.len() < expected {
                f.push(format!("the attacker reported {} of {expected} attacks", attacks.len()));
            }
            f.extend(attacks.iter().flat_map(AttackResult::failures));
            f.extend(self.availability.iter().flat_map(Availability::failures));
        }
        if self.attacks.is_some() && matches!(self.attack_plan, Some(AttackPlan::Messages | AttackPlan::MessagesShort))
        {
            // The attacks that P must have noticed, by its own counts (summed over its ranks).
            for cause in ["foreign", "unauthenticated"] {
                let counted = self.p_ignored.as_ref().and_then(|m| m.get(cause)).copied().unwrap_or(0);
                if counted == 0 {
                    f.push(format!("P counted no kvflow_ignored_messages_total{{cause=\"{cause}\"}} under attack"));
                }
            }
        }
        // Only P under a key holder's flood cuts a peer off: never an engine's own peer.
        for (incarnation, (n, prefill)) in &self.peers_cut_off {
            let flooded = *prefill && self.attacks.is_some();
            if !flooded {
                f.push(format!(
                    "{incarnation} cut off {n} peers (kvflow_peers_cut_off_total) with no flood against it"
                ));
            }
        }
        // What the router saw P free, by reason, is what P's metrics say it released.
        match &self.scraped_releases {
            Some(scraped) if *scraped == self.releases => {}
            Some(scraped) => f.push(format!(
                "releases on P by reason (from its Freed events) {:?} differ from its scraped kvflow_releases_total {:?}",
                self.releases, scraped
            )),
            None => f.push("P's metrics were never scraped".into()),
        }
        if let Promtool::Failed(what) = &self.promtool {
            f.push(what.clone());
        }
        f.extend(self.model.iter().flat_map(ModelReport::failures));
        f.extend(self.soak.iter().flat_map(SoakReport::failures));
        f.extend(self.errors.iter().cloned());
        f
    }

    /// The report as one JSON object.
    pub fn json(&self) -> Value {
        let metrics: serde_json::Map<String, Value> = self
            .metrics
            .iter()
            .map(|(which, samples)| {
                let samples = samples.iter().map(|(k, v)| (k.clone(), number(*v))).collect();
                (which.clone(), Value::Object(samples))
            })
            .collect();
        let mut report = json!({
            "mode": self.mode,
            "transport": self.transport,
            "requests": self.requests,
            "exports": self.exports,
            "outcomes": self.outcomes,
            "releases_on_p": self.releases,
            "killed_prefill": {
                "incarnation": self.killed_prefill,
                "releases": self.killed_prefill_releases,
                "releases_scraped": self.killed_prefill_scraped,
                "exports_held_at_death": self.died_with_prefill,
            },
            "bytes_moved": self.bytes,
            "transfers": self.transfers,
            "transfers_failed": self.transfers_failed,
            "transfer_gbps": self.transfer_gbps,
            "run_gbps": self.run_gbps,
            "elapsed_s": self.elapsed.as_secs_f64(),
            "transfer_latency_us": { "p50": self.transfer_p50_us, "p99": self.transfer_p99_us },
            "kv_latency_us": { "p50": self.kv_p50_us, "p99": self.kv_p99_us, "samples": self.kv_samples },
            "submit_to_kv_us": { "p50": self.submit_p50_us, "p99": self.submit_p99_us },
            "throughput_rps": self.throughput_rps,
            "killed": self.killed,
            "attacks": self.attacks,
            "availability": self.availability,
            "released_for_live_engines": self.released_for_live_engines,
            "pauses_ms": self.pauses.iter().map(|(e, ms)| json!({ "engine": e, "ms": ms })).collect::<Vec<_>>(),
            "longest_held_after_death_ms": self.held_after_death_ms,
            "death_release_bound_ms": self.death_bound_ms,
            "silent_death": self.silent_death,
            "lapse_seen_after_ms": self.lapse_seen_after_ms,
            "dead_engine_releases": self.dead_engine_releases,
            "lease_ms": self.lease_ms,
            "partial_prefix_hits": {
                "sent": self.partial.sent,
                "ready": self.partial.ready,
                "blocks_needed": self.partial.needed,
                "blocks_read": self.partial.read,
                "blocks_cached": self.partial.cached,
                "first_wrong": self.partial.first_wrong.as_ref().map(|(id, read, needed)| {
                    json!({ "request": id, "blocks_read": read, "blocks_needed": needed })
                }),
            },
            "corrupt_reads": self.corrupt_reads,
            "written_after_free": self.written_after_free,
            "writes_ahead": self.writes_ahead,
            "held_after_drain": self.held_after_drain,
            "unreleased_exports": self.unreleased_exports,
            "metrics": metrics,
            "releases_on_p_scraped": self.scraped_releases,
            "unscraped": self.unscraped,
            "promtool": self.promtool.describe(),
            "errors": self.errors,
            "passed": self.failures().is_empty(),
        });
        // Beside the rest: one `json!` of every key exceeds the macro's recursion limit.
        report["kv_over_transfer"] = self.kv_over_transfer();
        report["model"] = self.model.as_ref().map_or(Value::Null, ModelReport::json);
        report["soak"] = self.soak.as_ref().map_or(Value::Null, SoakReport::json);
        report
    }

    /// Each request's P done to D holds KV over its own completing transfer's time, p50 and p99.
    fn kv_over_transfer(&self) -> Value {
        json!({ "p50": self.kv_over_transfer_p50, "p99": self.kv_over_transfer_p99 })
    }

    /// The latencies alone, for the bench.
    pub fn latency_json(&self) -> Value {
        json!({
            "kv_latency_us": { "p50": self.kv_p50_us, "p99": self.kv_p99_us, "samples": self.kv_samples },
            "kv_over_transfer": self.kv_over_transfer(),
            "submit_to_kv_us": { "p50": self.submit_p50_us, "p99": self.submit_p99_us },
            "throughput_rps": self.throughput_rps,
            "transfer_latency_us": { "p50": self.transfer_p50_us, "p99": self.transfer_p99_us },
            "transfer_gbps": self.transfer_gbps,
        })
    }

    /// The report as text.
    pub fn print(&self) {
        let list = |m: &BTreeMap<String, u64>| m.iter().map(|(k, v)| format!("{k} {v}")).collect::<Vec<_>>().join(", ");
        println!(
            "kvflow demo, {} mode over {}: {} requests ({} exports) in {:.1} s",
            self.mode,
            self.transport,
            self.requests,
            self.exports,
            self.elapsed.as_secs_f64()
        );
        println!("  outcomes on D        {}", list(&self.outcomes));
        let scraped = match &self.scraped_releases {
            Some(scraped) if *scraped == self.releases => "= scraped kvflow_releases_total".to_owned(),
            Some(scraped) => format!("!= scraped kvflow_releases_total: {}", list(scraped)),
            None => "(P not scraped)".to_owned(),
        };
        println!("  releases on P        {} {scraped}", list(&self.releases));
        if let Some(killed) = &self.killed_prefill {
            let scraped = self.killed_prefill_scraped.as_ref().map_or_else(|| "not scraped".to_owned(), &list);
            println!(
                "  P killed (SIGKILL)   {killed}: it released {} before its death (scraped just before: {scraped}) and held {} exports at it; a new incarnation served the rest",
                list(&self.killed_prefill_releases),
                self.died_with_prefill
            );
        }
        println!(
            "  bytes moved          {:.2} GiB in {} transfers ({} failed): {:.2} GB/s per transfer (bytes over time in flight), {:.2} GB/s over the run",
            self.bytes as f64 / f64::from(1u32 << 30),
            self.transfers,
            self.transfers_failed,
            self.transfer_gbps,
            self.run_gbps
        );
        println!(
            "  transfer latency     p50 {:.2} ms, p99 {:.2} ms (post to completion)",
            self.transfer_p50_us as f64 / 1e3,
            self.transfer_p99_us as f64 / 1e3
        );
        println!(
            "  P done -> D holds KV p50 {:.2} ms, p99 {:.2} ms ({} requests; D's scrub checks and prefix-cache fills left out)",
            self.kv_p50_us as f64 / 1e3,
            self.kv_p99_us as f64 / 1e3,
            self.kv_samples
        );
        println!(
            "  KV over its transfer p50 {:.2}, p99 {:.2} (each request's P done -> D holds KV over its own completing \
             transfer's time)",
            self.kv_over_transfer_p50, self.kv_over_transfer_p99
        );
        println!(
            "  submit -> D holds KV p50 {:.2} ms, p99 {:.2} ms; {:.1} requests/s",
            self.submit_p50_us as f64 / 1e3,
            self.submit_p99_us as f64 / 1e3,
            self.throughput_rps
        );
        match (&self.killed, self.held_after_death_ms) {
            (Some(engine), Some(ms)) => {
                let list = self.dead_engine_releases.iter().map(|(k, v)| format!("{k} {v}")).collect::<Vec<_>>();
                let how = match (self.silent_death, self.lapse_seen_after_ms) {
                    (false, _) => "killed        ".to_owned(),
                    (true, Some(lapse)) => format!("died silently (veth cut, then killed; its etcd lease lapsed {lapse} ms after the cut):\n                      "),
                    (true, None) => "died silently (its lapse never seen):\n                      ".to_owned(),
                };
                println!(
                    "  {engine} {how} its exports on P were all released within {ms} ms of its death \
                     (bound {} ms, lease {} ms); those held at its death: {}",
                    self.death_bound_ms,
                    self.lease_ms,
                    if list.is_empty() { "none were held".to_owned() } else { list.join(", ") }
                )
            }
            _ => println!("  no engine killed"),
        }
        if !self.pauses.is_empty() {
            let list: Vec<String> = self.pauses.iter().map(|(e, ms)| format!("{e} {ms} ms")).collect();
            println!("  stopped (SIGSTOP)    {} (lease {} ms)", list.join(", "), self.lease_ms);
        }
        for a in self.attacks.iter().flatten() {
            let probe = a.probe_ms.map_or_else(|| "none".to_owned(), |ms| format!("{ms:.1} ms"));
            println!(
                "  attack {:<28} {}: {} (legit handshake {probe}, P +{:.1} MiB, P {}): {}",
                a.attack,
                if a.failures().is_empty() { "held" } else { "GOT THROUGH" },
                a.tried,
                a.rss_growth_mib,
                if a.p_alive { "alive" } else { "DEAD" },
                a.detail
            );
        }
        for a in &self.availability {
            println!(
                "  availability {:<22} {:.1} requests/s under the storm, {:.1} in the quiet window before ({:.2}), {} transfers failed",
                a.attack,
                a.storm_rps,
                a.quiet_rps,
                if a.quiet_rps > 0.0 { a.storm_rps / a.quiet_rps } else { 0.0 },
                a.failed_transfers
            );
        }
        let p = &self.partial;
        println!(
            "  partial prefix hits  {} ready of {} sent: {} blocks loaded of {} needed ({} cached)",
            p.ready, p.sent, p.read, p.needed, p.cached
        );
        println!("  released, D alive    {}", self.released_for_live_engines);
        println!("  corrupt reads        {}", self.corrupt_reads);
        println!("  written after free   {}", self.written_after_free);
        if self.writes_ahead > 0 {
            println!(
                "  writes ahead         {} (push writes from chunks P had computed, before the export)",
                self.writes_ahead
            );
        }
        println!("  held after drain     {}", list(&self.held_after_drain));
        if let Some(model) = &self.model {
            model.print();
        }
        if let Some(soak) = &self.soak {
            soak.print();
        }
        for (which, summary) in &self.metrics_summary {
            println!("  metrics {which:<12} {summary}");
        }
        for which in &self.unscraped {
            println!("  not scraped          {which}");
        }
        println!("  promtool check       {}", self.promtool.describe());
        for e in &self.errors {
            println!("  error: {e}");
        }
        println!("  {}", if self.failures().is_empty() { "PASSED" } else { "FAILED" });
    }
}

/// A sample's value in JSON: an integer when it is one (counters, gauges of counts).
fn number(value: f64) -> Value {
    if value.fract() == 0.0 && value.abs() < 9.0e15 {
        json!(value as i64)
    } else {
        json!(value)
    }
}

/// An incarnation's non-zero counts in short: each metric without its `kvflow_` prefix and
/// with its `engine` and `rank` labels summed away (`releases_total{reason=transferred} 40`),
/// histograms by their `_count`.
fn summary(exposition: &Exposition) -> String {
    let mut sums: BTreeMap<String, f64> = BTreeMap::new();
    for s in &exposition.samples {
        let histogram = exposition.kind(&s.name) == Some("histogram");
        if histogram && !s.name.ends_with("_count") {
            continue;
        }
        let labels: Vec<String> =
            s.labels.iter().filter(|(k, _)| k != "engine" && k != "rank").map(|(k, v)| format!("{k}={v}")).collect();
        let name = s.name.strip_prefix("kvflow_").unwrap_or(&s.name);
        let key = if labels.is_empty() { name.to_owned() } else { format!("{name}{{{}}}", labels.join(",")) };
        *sums.entry(key).or_insert(0.0) += s.value;
    }
    let parts: Vec<String> = sums
        .into_iter()
        .filter(|(_, v)| *v != 0.0)
        .map(|(k, v)| if v.fract() == 0.0 { format!("{k} {v}") } else { format!("{k} {v:.3}") })
        .collect();
    if parts.is_empty() {
        "all zero".to_owned()
    } else {
        parts.join(", ")
    }
}
