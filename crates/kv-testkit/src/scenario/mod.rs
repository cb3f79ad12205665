//! Scenario files: TOML scripts that drive a simulated cluster of P and D engines through time
//! and check what each engine holds (the format is specified in `scenarios/FORMAT.md`).
//!
//! The project reads a few keys beyond that shared format, which
//! `crates/kv-testkit/scenarios/FORMAT-EXTENSIONS.md` lists (the `lapse` event: an engine's
//! discovery registration lapses); every key of the shared format keeps its meaning.
//!
//! [`format`](mod@format) turns a file into a typed, validated [`Scenario`]: defaults applied, node names
//! resolved to engines that exist, times in order, every key known. [`runner`] runs one on a
//! [`crate::cluster::Cluster`] and checks its expectations.

pub mod format;
pub mod runner;

pub use format::{
    scenario_files, ClusterSpec, Event, Expect, ForgedMessage, Location, Node, Scenario, ScenarioError, Step,
};
pub use runner::{run, run_with_trace, Outcome};
