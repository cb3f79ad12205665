//! `cargo xtask <task>`: the one entry point that wires kvflow's crates together.
//!
//! Tasks live one per module. `ci` is what `.ci/run` and the README's test command run.

mod bench;
mod ci;
mod demo;
mod provision;
mod sim;
mod sim_random;

use std::process::ExitCode;

const USAGE: &str = "usage: cargo xtask <task>

tasks:
  demo    one P and two D engines as processes over real NIXL/UCX, a workload with faults, a report
          [--mode pull|push] [--json] (--help for the rest)
  attack  the demo's engines under attack: bad bytes, floods, impersonation, foreign messages,
          engines stopped past their lease; each attack says what it tried and what held
  ci      fmt check, setup, clippy with -D warnings, every test of the workspace
  setup   fetch what nixl-sys needs: libclang (apt-get as root) and the NIXL runtime (.nixl/)
  sim     scenario files [PATH...] [--seed N], or random workloads --random --seeds A..B
  bench   the criterion benches, each against its baseline in the same run [--json]";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("ci") => ci::run(&args[1..]),
        Some("demo") => demo::run(&args[1..]),
        Some("attack") => demo::attack(&args[1..]),
        Some("setup") => provision::run(&args[1..]),
        Some("bench") => bench::run(&args[1..]),
        Some("sim") => sim::run_task(&args[1..]),
        Some("-h" | "--help" | "help") => {
            println!("{USAGE}");
            Ok(())
        }
        Some(other) => Err(anyhow::anyhow!("unknown task {other:?}\n\n{USAGE}")),
        None => Err(anyhow::anyhow!("no task given\n\n{USAGE}")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("xtask: {err:#}");
            ExitCode::FAILURE
        }
    }
}
