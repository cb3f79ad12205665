//! Every scenario file passes: this crate's `scenarios` folder, which holds the format's short
//! examples (`scenarios/examples`, one rule each) and the files that check DESIGN.md's
//! lifecycle rules beyond them (push ordering and base-id matching, the push watchdog, aborts,
//! failed transfers, the read fence, partitions, heterogeneous TP, MLA, block-size ratios,
//! siblings, crashes and restarts, late messages, several decoders, engines whose clocks
//! disagree). A scenario also replays with the same digest.

use std::path::{Path, PathBuf};

use kv_testkit::scenario::{run, scenario_files, Scenario};

fn files_in(dir: &Path, at_least: usize) -> Vec<PathBuf> {
    assert!(dir.is_dir(), "the scenarios are missing: expected them at {}", dir.display());
    let files = scenario_files(&[dir]).expect("scenario folder");
    assert!(files.len() >= at_least, "found only {} scenarios under {}", files.len(), dir.display());
    files
}

fn scenarios() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scenarios")
}

fn example_scenarios() -> Vec<PathBuf> {
    files_in(&scenarios().join("examples"), 15)
}

/// Runs every file and fails with the list of those that did not pass.
fn all_pass(files: &[PathBuf]) {
    let mut failures = Vec::new();
    for file in files {
        let scenario = Scenario::load(file).unwrap_or_else(|e| panic!("{e}"));
        if let Some(failure) = run(&scenario, 0).failure {
            failures.push(format!("{}: {failure}", file.display()));
        }
    }
    assert!(failures.is_empty(), "{} of {} scenarios failed:\n{}", failures.len(), files.len(), failures.join("\n"));
}

/// The format's examples, among them its newest keys (`consumer`, `pause`, `forge`, `intrude`).
#[test]
fn every_example_scenario_passes() {
    all_pass(&example_scenarios());
}

/// Every file of the folder but the examples, which the test above runs.
#[test]
fn every_own_scenario_passes() {
    let examples = scenarios().join("examples");
    let files: Vec<PathBuf> = files_in(&scenarios(), 55).into_iter().filter(|f| !f.starts_with(&examples)).collect();
    assert!(files.len() >= 40, "found only {} scenarios beside the examples", files.len());
    all_pass(&files);
}

#[test]
fn the_digest_tells_tp_sizes_apart() {
    let file = example_scenarios().into_iter().find(|f| f.ends_with("siblings.toml")).expect("siblings.toml");
    let mut scenario = Scenario::load(&file).unwrap();
    let one = run(&scenario, 7);
    scenario.cluster.decode_tp = 2;
    let two = run(&scenario, 7);
    assert!(one.passed() && two.passed(), "{:?} {:?}", one.failure, two.failure);
    assert_ne!(one.digest, two.digest, "D at TP 1 and at TP 2 gave the same digest");
}

#[test]
fn a_scenario_replays_with_the_same_digest() {
    let file = example_scenarios().into_iter().find(|f| f.ends_with("siblings.toml")).expect("siblings.toml");
    let scenario = Scenario::load(&file).unwrap();
    let (a, b) = (run(&scenario, 7), run(&scenario, 7));
    assert!(a.passed(), "{:?}", a.failure);
    assert_eq!(a.digest, b.digest);
}
