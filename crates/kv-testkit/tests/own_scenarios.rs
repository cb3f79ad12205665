//! Every scenario in this crate's own `scenarios` folder passes: checks of DESIGN.md's lifecycle
//! rules that the shared public scenarios do not cover (push ordering and base-id matching,
//! the push watchdog, aborts, failed transfers, the read fence, partitions, heterogeneous TP,
//! MLA, block-size ratios, siblings, crashes and restarts, late messages, several decoders).

use std::path::PathBuf;

use kv_testkit::scenario::{run, scenario_files, Scenario};

fn own_scenarios() -> Vec<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scenarios");
    assert!(dir.is_dir(), "the crate's scenarios are missing: expected them at {}", dir.display());
    scenario_files(&[dir]).expect("scenario folder")
}

#[test]
fn every_own_scenario_passes() {
    let files = own_scenarios();
    assert!(!files.is_empty(), "found no scenarios");
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
