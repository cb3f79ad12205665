//! Scenario files: TOML scripts that drive a simulated cluster of P and D engines through time
//! and check what each engine holds. `docs/scenario-format.md` specifies the format, every key
//! that [`Keys::accepted`] lists (a tidy test checks that it documents each one).
//!
//! [`format`](mod@format) turns a file into a typed, validated [`Scenario`]: defaults applied, node names
//! resolved to engines that exist, times in order, every key known. [`runner`] runs one on a
//! [`crate::cluster::Cluster`] and checks its expectations.

pub mod format;
pub mod runner;

pub use format::{
    scenario_files, ClusterSpec, Event, Expect, ForgedMessage, Keys, Location, Node, Scenario, ScenarioError, Step,
};
pub use runner::{run, run_with_trace, Outcome};
