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

#[test]
fn the_results_table_shows_the_newest_results_file_and_only_its_figures() {
    let root = std::env::temp_dir().join(format!("kvflow-docs-results-{}", std::process::id()));
    let dir = root.join(docs::RESULTS_DIR);
    fs::create_dir_all(&dir).unwrap();
    assert!(docs::results_table(&root).unwrap_err().contains("no results"));
    let stamp = r#"{"date": "DATE", "revision": "0123456789abcdef", "dirty": false,
        "host": {"cores": 2, "cpu": "CPU", "memory_gib": 23.5, "gpus": []}, "flags": {"quick": true}}"#;
    let report = r#"{"transport": {"memcpy": {"gbps": 12.34, "descriptors": 1},
        "merged_over_raw": {"median": 0.96789, "p10": 0.9, "p90": 1.0}},
        "lease_table": {"grant": {"indexed": 50.0, "scan": 70.0, "ratio": 1.4}}, "end_to_end_topology": "x"}"#;
    for (name, date) in [("2026-01-02T000000Z-aaaa.json", "old"), ("2026-03-04T000000Z-bbbb.json", "new")] {
        let text = format!(r#"{{"stamp": {}, "report": {report}}}"#, stamp.replace("DATE", date));
        fs::write(dir.join(name), text).unwrap();
    }
    let table = docs::results_table(&root).unwrap();
    let _ = fs::remove_dir_all(&root);
    assert!(
        table.starts_with("From `bench/results/2026-03-04T000000Z-bbbb.json`: revision `0123456789ab`, new, 2 cores")
    );
    for row in [
        "| `transport.memcpy.gbps` | 12.3 |",
        "| `transport.merged_over_raw.median` | 0.968 |",
        "| `transport.merged_over_raw.p90` | 1.00 |",
        "| `lease_table.grant.ratio` | 1.40 |",
    ] {
        assert!(table.contains(row), "no {row} in\n{table}");
    }
    for figure in ["descriptors", "indexed", "scan`", "topology"] {
        assert!(!table.contains(figure), "{figure} is not a headline figure:\n{table}");
    }
}
