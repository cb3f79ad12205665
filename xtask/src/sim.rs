//! `cargo xtask sim`: runs scenario files, or seeded random workloads with faults, on the
//! simulated cluster (kv-testkit) that drives kvflow's real connectors.
//!
//! - `cargo xtask sim [PATH...]`: every scenario file given, or every `*.toml` under a folder
//!   (default: the repository's own, `crates/kv-testkit/scenarios`), one line each, then
//!   `N passed, M failed`. `docs/scenario-format.md` specifies the files.
//! - `cargo xtask sim --seed N PATH...`: the same with the network seeded by N.
//! - `cargo xtask sim --seed N`: replays random workload N, as a failure says to.
//! - `cargo xtask sim --random --seeds A..B`: random workloads, one per seed (`--trace` prints
//!   each run's event trace, `--verbose` a line per passing seed).

use std::ops::Range;
use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::Args;
use kv_testkit::scenario::{run as run_scenario, runner::report_line, scenario_files, Scenario};

use crate::workspace;

/// The repository's scenario files, which `cargo xtask sim` runs when given no path.
const OWN_SCENARIOS: &str = "crates/kv-testkit/scenarios";

/// The flags of `cargo xtask sim`.
#[derive(Args, Debug)]
pub struct SimArgs {
    /// Scenario files, or folders of `*.toml` files [default: crates/kv-testkit/scenarios].
    #[arg(value_name = "PATH")]
    paths: Vec<PathBuf>,
    /// Seeds the simulated network of the scenario files; without paths, replays random
    /// workload N.
    #[arg(long, value_name = "N")]
    seed: Option<u64>,
    /// Runs random workloads instead of scenario files (seeds 0..100 unless --seeds says).
    #[arg(long, conflicts_with = "paths")]
    random: bool,
    /// Runs random workloads for the seeds A..B (B exclusive).
    #[arg(long, value_name = "A..B", value_parser = parse_range, conflicts_with_all = ["paths", "seed"])]
    seeds: Option<Range<u64>>,
    /// Prints a line for every passing seed too.
    #[arg(long, short)]
    verbose: bool,
    /// Prints each random run's event trace.
    #[arg(long)]
    trace: bool,
}

/// Runs what the flags say: random workloads, or scenario files.
pub fn run(args: &SimArgs) -> Result<()> {
    if args.random || args.seeds.is_some() || (args.seed.is_some() && args.paths.is_empty()) {
        let (seeds, verbose) = match (&args.seeds, args.seed) {
            (Some(range), _) => (range.clone(), args.verbose),
            // One seed replays a failure: say what it did even when it passes.
            (None, Some(s)) => (s..s.saturating_add(1), true),
            (None, None) => (0..100, args.verbose),
        };
        return crate::sim_random::run(seeds, verbose, args.trace);
    }
    let paths = if args.paths.is_empty() { vec![workspace::root().join(OWN_SCENARIOS)] } else { args.paths.clone() };
    let files = scenario_files(&paths)?;
    let seed = args.seed.unwrap_or(0);
    let (mut passed, mut failed) = (0, 0);
    for file in &files {
        let label = file.display().to_string();
        let outcome = match Scenario::load(file) {
            Ok(scenario) => run_scenario(&scenario, seed),
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

/// `A..B` (B exclusive), for `--seeds`.
fn parse_range(text: &str) -> Result<Range<u64>, String> {
    let (a, b) = text.split_once("..").ok_or_else(|| format!("{text:?} is not a range A..B"))?;
    let number = |n: &str| n.parse::<u64>().map_err(|e| format!("{n:?} in {text:?} is not a seed: {e}"));
    let range = number(a)?..number(b)?;
    if range.is_empty() {
        return Err(format!("the range {text} is empty"));
    }
    Ok(range)
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    /// `cargo xtask sim` with `flags`, parsed.
    #[derive(Parser)]
    struct Sim {
        #[command(flatten)]
        args: SimArgs,
    }

    fn parse(flags: &[&str]) -> Result<SimArgs, String> {
        let parsed = Sim::try_parse_from(std::iter::once("sim").chain(flags.iter().copied()));
        parsed.map(|s| s.args).map_err(|e| e.to_string())
    }

    #[test]
    fn seeds_are_a_range() {
        let check = |text: &str, expected: Result<Range<u64>, &str>| {
            let got = parse_range(text);
            match expected {
                Ok(range) => assert_eq!(got, Ok(range), "{text}"),
                Err(part) => assert!(got.as_ref().is_err_and(|e| e.contains(part)), "{text}: {got:?}"),
            }
        };
        check("0..10000", Ok(0..10000));
        check("7..8", Ok(7..8));
        check("5", Err("not a range"));
        check("5..5", Err("empty"));
        check("a..5", Err("\"a\""));
        check("0..18446744073709551616", Err("18446744073709551616"));
    }

    #[test]
    fn flags_parse_and_conflicts_are_errors() {
        let args = parse(&["--random", "--seeds", "0..10", "--trace", "-v"]).unwrap();
        assert_eq!((args.random, args.seeds, args.trace, args.verbose), (true, Some(0..10), true, true));
        let args = parse(&["--seed", "3", "a.toml", "b"]).unwrap();
        assert_eq!((args.seed, args.paths.len()), (Some(3), 2));
        for (flags, part) in [
            (&["--random", "a.toml"][..], "--random"),
            (&["--seeds", "0..2", "a.toml"], "--seeds"),
            (&["--seeds", "0..2", "--seed", "1"], "--seed"),
            (&["--seed", "x"], "--seed"),
            (&["--seeds", "9..1"], "9..1"),
        ] {
            let err = parse(flags).expect_err("a bad command line");
            assert!(err.contains(part), "{flags:?}: {err}");
        }
    }
}
