//! Every scenario in the shared `scenarios/public` folder passes, and replays identically.

use std::path::PathBuf;

use kv_testkit::scenario::{run, scenario_files, Scenario};

fn public_scenarios() -> Vec<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/scenarios/public");
    assert!(dir.is_dir(), "the shared scenarios are missing: expected them at {}", dir.display());
    scenario_files(&[dir]).expect("scenario folder")
}

#[test]
fn every_public_scenario_passes() {
    let files = public_scenarios();
    assert!(files.len() >= 11, "found only {} scenarios", files.len());
    let mut failures = Vec::new();
    for file in &files {
        let scenario = Scenario::load(file).unwrap_or_else(|e| panic!("{e}"));
        let outcome = run(&scenario, 0);
        if let Some(failure) = outcome.failure {
            failures.push(format!("{}: {failure}", file.display()));
        }
    }
    assert!(failures.is_empty(), "{} of {} scenarios failed:\n{}", failures.len(), files.len(), failures.join("\n"));
}

#[test]
fn a_scenario_replays_with_the_same_digest() {
    let file = public_scenarios().into_iter().find(|f| f.ends_with("siblings.toml")).expect("siblings.toml");
    let scenario = Scenario::load(&file).unwrap();
    let (a, b) = (run(&scenario, 7), run(&scenario, 7));
    assert!(a.passed(), "{:?}", a.failure);
    assert_eq!(a.digest, b.digest);
}
