//! `cargo xtask sim --random --seeds A..B`: seeded random workloads with faults.

use std::ops::Range;

use anyhow::{bail, Result};
use kv_testkit::random;

/// Runs the seeds of `seeds`; prints each failure with the command that replays it. With
/// `trace`, prints every seed's event trace.
pub fn run(seeds: Range<u64>, verbose: bool, trace: bool) -> Result<()> {
    let (from, to) = (seeds.start, seeds.end);
    let (mut passed, mut failed) = (0u64, 0u64);
    let (mut loads, mut events, mut skipped, mut prepared, mut ahead, mut layers) =
        (0u64, 0usize, 0usize, 0u64, 0u64, 0u64);
    let mut digest = kv_core::Fnv1a::new();
    for seed in seeds {
        let outcome = if trace {
            let (outcome, lines) = random::run_with_trace(seed);
            for line in lines {
                println!("  {line}");
            }
            outcome
        } else {
            random::run(seed)
        };
        loads += outcome.loads_ok;
        prepared += outcome.prepared;
        ahead += outcome.writes_ahead;
        layers += outcome.layer_writes;
        events += outcome.events;
        skipped += outcome.skipped;
        digest.write_word(outcome.digest);
        match &outcome.failure {
            None => {
                passed += 1;
                if verbose {
                    println!("ok   seed {seed} (digest {:016x}, {} loads verified)", outcome.digest, outcome.loads_ok);
                }
            }
            Some(failure) => {
                failed += 1;
                println!("FAIL seed {seed}: {failure}");
                println!("     reproduce with: cargo xtask sim --seed {seed}");
            }
        }
    }
    println!(
        "seeds {from}..{to}: {loads} loads verified byte for byte ({prepared} transfers by prepared indices, {ahead} push writes ahead of the export, {layers} writes of some layers), {events} events ({skipped} skipped as no longer applicable), digest {:016x}",
        digest.finish()
    );
    println!("{passed} passed, {failed} failed");
    if failed > 0 {
        bail!("{failed} seed(s) failed");
    }
    Ok(())
}
