//! `cargo xtask sim`: runs scenario files, or seeded random workloads with faults, on the
//! simulated cluster (kv-testkit) that drives kvflow's real connectors.
//!
//! - `cargo xtask sim [PATH...]`: every scenario file given, or every `*.toml` under a folder
//!   (default: the shared `scenarios/public`), one line each, then `N passed, M failed`.
//! - `cargo xtask sim --seed N PATH...`: the same with the network seeded by N.
//! - `cargo xtask sim --seed N`: replays random workload N, as a failure says to.
//! - `cargo xtask sim --random --seeds A..B`: random workloads, one per seed (`--trace` prints
//!   each run's event trace, `--verbose` a line per passing seed).

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use kv_testkit::scenario::{run, runner::report_line, scenario_files, Scenario};

use crate::ci::workspace_root;

/// Parses the arguments and runs.
pub fn run_task(args: &[String]) -> Result<()> {
    let mut paths = Vec::new();
    let mut seed: Option<u64> = None;
    let mut random = false;
    let mut seeds: Option<(u64, u64)> = None;
    let mut verbose = false;
    let mut trace = false;
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--seed" => {
                let v = it.next().context("--seed needs a number")?;
                seed = Some(v.parse().with_context(|| format!("--seed {v:?} is not a number"))?);
            }
            "--seeds" => {
                let v = it.next().context("--seeds needs a range A..B")?;
                seeds = Some(parse_range(v)?);
            }
            "--random" => random = true,
            "--verbose" | "-v" => verbose = true,
            "--trace" => trace = true,
            flag if flag.starts_with('-') => bail!("unknown flag {flag:?}"),
            path => paths.push(PathBuf::from(path)),
        }
    }
    if random || seeds.is_some() || (seed.is_some() && paths.is_empty()) {
        if !paths.is_empty() {
            bail!("--random runs generated workloads and takes no paths");
        }
        let (from, to) = match (seeds, seed) {
            (Some(range), _) => range,
            (None, Some(s)) => {
                verbose = true;
                (s, s + 1)
            }
            (None, None) => (0, 100),
        };
        return crate::sim_random::run(from, to, verbose, trace);
    }
    if paths.is_empty() {
        paths.push(workspace_root().join("../shared/scenarios/public"));
    }
    let files = scenario_files(&paths)?;
    let seed = seed.unwrap_or(0);
    let (mut passed, mut failed) = (0, 0);
    for file in &files {
        let label = file.display().to_string();
        let outcome = match Scenario::load(file) {
            Ok(scenario) => run(&scenario, seed),
            Err(e) => {
                println!("FAIL {label}: {e}");
                failed += 1;
                continue;
            }
        };
        println!("{}", report_line(&outcome, &label));
        if outcome.passed() {
            passed += 1;
        } else {
            failed += 1;
            println!("     reproduce with: cargo xtask sim --seed {seed} {label}");
        }
    }
    println!("{passed} passed, {failed} failed");
    if failed > 0 {
        bail!("{failed} scenario(s) failed");
    }
    Ok(())
}

/// `A..B` (B exclusive).
pub fn parse_range(text: &str) -> Result<(u64, u64)> {
    let (a, b) = text.split_once("..").with_context(|| format!("{text:?} is not a range A..B"))?;
    let a: u64 = a.parse().with_context(|| format!("{a:?} is not a number"))?;
    let b: u64 = b.parse().with_context(|| format!("{b:?} is not a number"))?;
    if b <= a {
        bail!("the range {text} is empty");
    }
    Ok((a, b))
}
