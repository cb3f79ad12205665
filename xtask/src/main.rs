//! `cargo xtask <task>`: the one entry point that wires kvflow's crates together.
//!
//! Tasks live one per module. `ci` is what `.ci/run` and the README's test command run.
//! The arguments are clap's: each task's flags are declared beside the task (`demo::DemoArgs`,
//! `sim::SimArgs`, `bench::BenchArgs`), and `--help` on any of them lists them.

mod bench;
mod bench_results;
mod ci;
mod demo;
mod docs;
mod provision;
mod sim;
mod sim_random;
mod vllm;
mod workspace;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// kvflow's task runner.
#[derive(Parser)]
#[command(name = "cargo xtask", bin_name = "cargo xtask")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// One P and two D engines as processes over real NIXL/UCX, a workload with faults, a
    /// report.
    Demo(demo::DemoArgs),
    /// The demo's engines under attack: bad bytes, floods, impersonation, foreign messages,
    /// engines stopped past their lease, storms and a sniffer on the TCP data path; each attack
    /// says what it tried and what held.
    Attack(demo::AttackArgs),
    /// The demo's engines for N minutes under a steady open-loop workload, one process killed
    /// or stopped every minute in turn, each engine's memory, descriptors and held blocks
    /// sampled; fails on growth past 5 %, a corrupt read or a block held after the drain.
    Soak(demo::SoakArgs),
    /// The fmt check, setup, clippy with -D warnings, every test of the workspace, packaging,
    /// a short demo in each mode, the attack suite and the Python package beside vLLM.
    Ci,
    /// Fetch what the builds and the demo need: libclang, protoc, etcd and promtool (apt-get as
    /// root) and the NIXL runtime (.nixl/).
    Setup,
    /// Scenario files, or seeded random workloads, on the simulated cluster.
    Sim(sim::SimArgs),
    /// The criterion benches, each against its baseline in the same run, then the transport
    /// and end-to-end benches.
    Bench(bench::BenchArgs),
    /// vLLM's CPU build in an ignored virtualenv (pinned, reused), kvflow's wheel built with
    /// maturin and installed there, and the Python tests run with pytest.
    Vllm,
    /// The docs pages' parts generated from code (the metrics table of docs/operating.md),
    /// written between their markers.
    Docs,
}

fn main() -> ExitCode {
    let result = match Cli::parse().task {
        Task::Ci => ci::run(),
        Task::Demo(args) => demo::run(&args),
        Task::Attack(args) => demo::attack(&args),
        Task::Soak(args) => demo::soak(&args),
        Task::Setup => provision::run(),
        Task::Bench(args) => bench::run(&args),
        Task::Sim(args) => sim::run(&args),
        Task::Vllm => vllm::run(),
        Task::Docs => docs::run(&workspace::root()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("xtask: {err:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_well_formed() {
        // clap's own checks: no two flags of one task share a name, every default parses, ...
        super::Cli::command().debug_assert();
    }
}
