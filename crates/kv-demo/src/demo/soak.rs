//! `cargo xtask soak --minutes N`: the demo's engines under a steady open-loop workload for N
//! minutes while one process after another is stopped, every minute: a D killed with SIGKILL
//! and restarted, decode0 stopped with SIGSTOP past the lease and resumed, the other D
//! stopped, P killed with SIGKILL and restarted (so each incarnation of P and of the killed D
//! lives four minutes, and a 4-minute soak checks its first P, which lives three and a half). Every few seconds the router samples each engine process's resident
//! memory, open descriptors and `kvflow_blocks_held`.
//!
//! The run fails as the demo does (a corrupt read, a block written after free, a block held
//! after the drain, ...), when a fault due could not be made, and when an engine process that
//! lived at least three minutes grew in resident memory or descriptors by more than 5 %
//! between its minute-2 sample and its last.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Result};
use serde_json::{json, Value};

use super::config::SoakPlan;
use super::router::{Soak, SoakSample};
use super::{Demo, DemoConfig, NodeBinary};
use crate::proto::Model;

/// How long an engine process must live for its growth to count, and where its growth is
/// measured from.
const CHECKED_AFTER: f64 = 180.0;
const BASELINE_AT: f64 = 120.0;

/// The growth allowed between the minute-2 sample and the last, as a fraction.
const GROWTH_BOUND: f64 = 0.05;

/// `cargo xtask soak`'s flags.
#[derive(clap::Parser, Debug)]
#[command(name = "cargo xtask soak")]
pub struct SoakArgs {
    /// Minutes of traffic (a fault every minute from 30 s on).
    #[arg(long, value_name = "N")]
    pub minutes: u32,
    /// Push mode (P writes) instead of pull (D reads).
    #[arg(long)]
    pub push: bool,
    /// Requests a second, open loop.
    #[arg(long, value_name = "R", default_value_t = 20.0)]
    pub rate: f64,
    /// Seconds between samples of the engine processes.
    #[arg(long, value_name = "S", default_value_t = 5)]
    pub sample_s: u64,
    /// The workload's seed.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Also writes the report, every sample included, as JSON to this file.
    #[arg(long, value_name = "PATH")]
    pub json_out: Option<PathBuf>,
}

impl SoakArgs {
    /// The run's settings: the demo's workload in 4 layers (256 KiB blocks, so that a leak of
    /// a few MiB shows against each engine's pool), at a steady rate.
    pub fn config(&self) -> Result<DemoConfig> {
        if self.minutes == 0 || self.sample_s == 0 || self.sample_s > 30 {
            bail!("--minutes ({}) must be positive and --sample-s ({}) between 1 and 30", self.minutes, self.sample_s);
        }
        let config = DemoConfig {
            push: self.push,
            seed: self.seed,
            rate: Some(self.rate),
            requests: 1,
            model: Model { layers: 4, ..DemoConfig::default().model },
            lease_ms: 2000,
            kill: false,
            time_limit: Duration::from_secs(u64::from(self.minutes) * 60),
            soak: Some(SoakPlan { minutes: self.minutes, sample_every: Duration::from_secs(self.sample_s) }),
            ..DemoConfig::default()
        };
        config.validate()?;
        Ok(config)
    }
}

/// `cargo xtask soak`, with the engine binary `node`.
pub fn run(args: &SoakArgs, node: &NodeBinary) -> Result<()> {
    let report = Demo::start(args.config()?, node.clone())?.run()?;
    super::conclude(&report, false, args.json_out.as_deref(), "the soak")
}

/// One engine process over the soak: its first and last samples, and its minute-2 one.
#[derive(Clone, Debug, PartialEq)]
struct Process {
    incarnation: String,
    lived_s: f64,
    /// (minute 2, last), where it lived that long.
    rss_kib: Option<(u64, u64)>,
    fds: Option<(u64, u64)>,
    blocks_held_max: u64,
}

impl Process {
    /// Whether it lived long enough for its growth to count.
    fn checked(&self) -> bool {
        self.lived_s >= CHECKED_AFTER
    }

    /// What grew past the bound, in words.
    fn growth_failures(&self) -> Vec<String> {
        let mut f = Vec::new();
        for (what, pair) in [("resident memory (KiB)", self.rss_kib), ("open descriptors", self.fds)] {
            let Some((base, last)) = pair.filter(|_| self.checked()) else { continue };
            if last as f64 > base as f64 * (1.0 + GROWTH_BOUND) {
                f.push(format!(
                    "{}'s {what} grew from {base} at minute 2 to {last} at its last sample ({:+.1} %, bound {} %), living {:.0} s",
                    self.incarnation,
                    growth(base, last) * 100.0,
                    GROWTH_BOUND * 100.0,
                    self.lived_s
                ));
            }
        }
        f
    }
}

fn growth(base: u64, last: u64) -> f64 {
    (last as f64 - base as f64) / (base.max(1) as f64)
}

/// What a soak measured.
pub(super) struct SoakReport {
    minutes: u32,
    faults: Vec<(f64, String)>,
    processes: Vec<Process>,
    samples: Vec<SoakSample>,
}

impl SoakReport {
    pub(super) fn new(soak: &Soak) -> SoakReport {
        let mut by_incarnation: BTreeMap<&str, Vec<&SoakSample>> = BTreeMap::new();
        for sample in &soak.samples {
            by_incarnation.entry(&sample.incarnation).or_default().push(sample);
        }
        let processes = by_incarnation
            .into_iter()
            .map(|(incarnation, samples)| {
                let (first, last) = (samples[0], samples[samples.len() - 1]);
                let base = samples.iter().find(|s| s.at_s - first.at_s >= BASELINE_AT);
                Process {
                    incarnation: incarnation.to_owned(),
                    lived_s: last.at_s - first.at_s,
                    rss_kib: base.map(|b| (b.rss_kib, last.rss_kib)),
                    fds: base.map(|b| (b.fds, last.fds)),
                    blocks_held_max: samples.iter().filter_map(|s| s.blocks_held).max().unwrap_or(0),
                }
            })
            .collect();
        SoakReport { minutes: soak.plan.minutes, faults: soak.faults.clone(), processes, samples: soak.samples.clone() }
    }

    /// Faults due in the soak: one every minute from 30 s on.
    fn faults_due(&self) -> usize {
        self.minutes as usize
    }

    pub(super) fn failures(&self) -> Vec<String> {
        let mut f: Vec<String> = self.processes.iter().flat_map(Process::growth_failures).collect();
        if self.faults.len() < self.faults_due() {
            f.push(format!(
                "the soak made {} of its {} faults (each waits for the one before to settle): {:?}",
                self.faults.len(),
                self.faults_due(),
                self.faults
            ));
        }
        if self.samples.is_empty() {
            f.push("the soak took no sample of any engine process".into());
        }
        f
    }

    pub(super) fn print(&self) {
        println!(
            "  soak                 {} minutes, {} faults, {} samples",
            self.minutes,
            self.faults.len(),
            self.samples.len()
        );
        for (at, what) in &self.faults {
            println!("    {at:>7.1} s  {what}");
        }
        for p in &self.processes {
            let pair = |what: &str, v: Option<(u64, u64)>| {
                v.map_or(String::new(), |(b, l)| format!(", {what} {b} -> {l} ({:+.1} %)", growth(b, l) * 100.0))
            };
            println!(
                "    {:<12} lived {:>6.0} s{}{}{}, kvflow_blocks_held at most {}",
                p.incarnation,
                p.lived_s,
                if p.checked() { " (checked)" } else { "" },
                pair("RSS KiB from minute 2", p.rss_kib),
                pair("fds", p.fds),
                p.blocks_held_max
            );
        }
    }

    pub(super) fn json(&self) -> Value {
        let pair = |v: Option<(u64, u64)>| {
            v.map_or(Value::Null, |(b, l)| json!({ "minute_2": b, "last": l, "growth": growth(b, l) }))
        };
        json!({
            "minutes": self.minutes,
            "faults": self.faults.iter().map(|(at, what)| json!({ "at_s": at, "what": what })).collect::<Vec<_>>(),
            "processes": self.processes.iter().map(|p| json!({
                "incarnation": p.incarnation,
                "lived_s": p.lived_s,
                "checked": p.checked(),
                "rss_kib": pair(p.rss_kib),
                "fds": pair(p.fds),
                "blocks_held_max": p.blocks_held_max,
            })).collect::<Vec<_>>(),
            "samples": self.samples.iter().map(|s| json!([s.incarnation, s.at_s, s.rss_kib, s.fds, s.blocks_held])).collect::<Vec<_>>(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(incarnation: &str, at_s: f64, rss_kib: u64, fds: u64) -> SoakSample {
        SoakSample { incarnation: incarnation.into(), at_s, rss_kib, fds, blocks_held: Some(0) }
    }

    /// A soak of `minutes` with `faults` made and these samples.
    fn report(minutes: u32, faults: usize, samples: Vec<SoakSample>) -> SoakReport {
        let plan = SoakPlan { minutes, sample_every: Duration::from_secs(5) };
        let mut soak = Soak::new(plan, std::time::Instant::now());
        soak.faults = (0..faults).map(|i| (30.0 + 60.0 * i as f64, "killed decode1 with SIGKILL".into())).collect();
        soak.samples = samples;
        SoakReport::new(&soak)
    }

    /// An engine sampled every 5 s from `born` to `died`, its memory and descriptors at
    /// `rss` and `fds` until minute 2 and at `rss_end` and `fds_end` from its next sample on.
    fn life(
        name: &str,
        born: f64,
        died: f64,
        (rss, rss_end): (u64, u64),
        (fds, fds_end): (u64, u64),
    ) -> Vec<SoakSample> {
        let mut samples = Vec::new();
        let mut at = born;
        while at <= died {
            let late = at - born > BASELINE_AT;
            samples.push(sample(name, at, if late { rss_end } else { rss }, if late { fds_end } else { fds }));
            at += 5.0;
        }
        samples
    }

    #[test]
    fn growth_past_five_percent_fails_an_engine_that_lived_three_minutes() {
        let mut samples = life("prefill0#1", 0.0, 240.0, (100_000, 104_000), (40, 40));
        samples.extend(life("decode0#1", 0.0, 240.0, (100_000, 100_000), (40, 43)));
        let failures = report(4, 4, samples).failures();
        assert_eq!(failures.len(), 1, "{failures:?}");
        assert!(failures[0].starts_with("decode0#1's open descriptors grew from 40 at minute 2 to 43"), "{failures:?}");

        let samples = life("prefill0#1", 0.0, 240.0, (100_000, 106_000), (40, 40));
        let failures = report(4, 4, samples).failures();
        assert!(failures.len() == 1 && failures[0].contains("resident memory (KiB) grew from 100000"), "{failures:?}");
    }

    #[test]
    fn an_engine_that_lived_less_than_three_minutes_is_not_judged() {
        let samples = life("prefill0#2", 90.0, 240.0, (100_000, 200_000), (40, 80));
        let report = report(4, 4, samples);
        assert_eq!(report.failures(), Vec::<String>::new());
        assert!(!report.processes[0].checked() && report.processes[0].rss_kib == Some((100_000, 200_000)));
    }

    #[test]
    fn a_soak_fails_without_all_its_faults_or_without_samples() {
        let samples = life("decode0#1", 0.0, 240.0, (100_000, 100_000), (40, 40));
        let failures = report(4, 3, samples).failures();
        assert!(failures.len() == 1 && failures[0].starts_with("the soak made 3 of its 4 faults"), "{failures:?}");
        assert_eq!(report(1, 1, Vec::new()).failures(), ["the soak took no sample of any engine process"]);
    }

    #[test]
    fn the_flags_make_a_soak_and_refuse_what_cannot_run() {
        use clap::Parser;
        let args = SoakArgs::try_parse_from(["soak", "--minutes", "4"]).unwrap();
        let config = args.config().unwrap();
        assert_eq!(config.soak, Some(SoakPlan { minutes: 4, sample_every: Duration::from_secs(5) }));
        assert_eq!((config.rate, config.time_limit, config.kill), (Some(20.0), Duration::from_secs(240), false));
        let zero = SoakArgs::try_parse_from(["soak", "--minutes", "0"]).unwrap();
        assert!(zero.config().unwrap_err().to_string().contains("--minutes (0) must be positive"));
        let rate = SoakArgs::try_parse_from(["soak", "--minutes", "1", "--rate=-1"]).unwrap();
        assert!(rate.config().unwrap_err().to_string().contains("--rate -1"));
    }
}
