//! The docs stay true to the code: every part generated from code (the metrics table of
//! `docs/operating.md`) equals what `cargo xtask docs` would write now, and the README, the
//! front page, links every docs page.

use std::fs;
use std::path::{Path, PathBuf};

// The task itself (`cargo xtask docs`); its `run` is the binary's, unused here.
#[allow(dead_code)]
#[path = "../src/docs.rs"]
mod docs;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

#[test]
fn every_generated_part_of_the_docs_is_fresh() {
    let pages = docs::regenerate(&root()).unwrap_or_else(|e| panic!("{e}"));
    assert!(!pages.is_empty(), "no generated part found");
    for (page, now, fresh) in pages {
        assert!(now == fresh, "{page} is stale: run `cargo xtask docs` and commit what it writes");
    }
}

#[test]
fn the_metrics_table_lists_every_metric_the_connectors_record() {
    let table = docs::metrics_table();
    for metric in kv_sched_adapter::metrics::METRICS {
        assert!(table.contains(&format!("| `{}", metric.name)), "the table lacks {}", metric.name);
    }
}

#[test]
fn a_part_is_replaced_between_its_markers_and_nothing_else_changes() {
    let (begin, end) = (docs::begin_marker("t"), docs::end_marker("t"));
    let page = format!("# Page\n\n{begin}\nold\n{end}\n\nAfter.\n");
    let fresh = format!("# Page\n\n{begin}\n\nnew\n\n{end}\n\nAfter.\n");
    assert_eq!(docs::splice(&page, "t", "new\n").unwrap(), fresh);
    // Writing it again changes nothing.
    assert_eq!(docs::splice(&fresh, "t", "new\n").unwrap(), fresh);
    assert!(docs::splice("no markers", "t", "new\n").unwrap_err().contains("BEGIN GENERATED t"));
    assert!(docs::splice(&format!("{begin}\n"), "t", "new\n").unwrap_err().contains("END GENERATED t"));
}

#[test]
fn the_readme_links_every_docs_page() {
    let readme = fs::read_to_string(root().join("README.md")).unwrap();
    let mut pages: Vec<String> = fs::read_dir(root().join("docs"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".md"))
        .collect();
    pages.sort();
    assert!(pages.len() > 1, "found only {pages:?} under docs/");
    let unlinked: Vec<_> = pages.iter().filter(|page| !readme.contains(&format!("](docs/{page})"))).collect();
    assert!(unlinked.is_empty(), "README.md links none of {unlinked:?}");
}
