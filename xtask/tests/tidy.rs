//! Tidy checks: the architecture invariants that a test can check (see ARCHITECTURE.md).

use std::fs;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            if path.file_name().is_some_and(|n| n != "target") {
                rust_files(&path, out);
            }
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

fn workspace_sources() -> Vec<PathBuf> {
    let mut files = Vec::new();
    rust_files(&root().join("crates"), &mut files);
    rust_files(&root().join("xtask"), &mut files);
    assert!(files.len() > 10, "found only {} source files", files.len());
    files
}

/// The dependency names of every `[*dependencies]` table of a manifest.
fn dependencies(manifest: &Path) -> Vec<String> {
    dependencies_of(manifest, |table| table.ends_with("dependencies"))
}

/// The dependency names of the tables of a manifest that `table` picks, by name.
fn dependencies_of(manifest: &Path, table: impl Fn(&str) -> bool) -> Vec<String> {
    let text = fs::read_to_string(manifest).unwrap();
    let mut in_deps = false;
    let mut deps = Vec::new();
    for line in text.lines().map(str::trim) {
        if line.starts_with('[') {
            in_deps = table(line.trim_matches(|c| c == '[' || c == ']'));
        } else if in_deps && !line.is_empty() && !line.starts_with('#') {
            if let Some((name, _)) = line.split_once('=') {
                deps.push(name.trim().split('.').next().unwrap().to_owned());
            }
        }
    }
    deps
}

#[test]
fn every_source_file_starts_with_module_docs() {
    let missing: Vec<_> =
        workspace_sources().into_iter().filter(|f| !fs::read_to_string(f).unwrap().starts_with("//!")).collect();
    assert!(missing.is_empty(), "these files do not start with `//!`: {missing:#?}");
}

#[test]
fn pure_crates_depend_on_no_runtime() {
    for krate in ["kv-core", "kv-lease"] {
        let deps = dependencies(&root().join("crates").join(krate).join("Cargo.toml"));
        // The parser must see the dependencies that are there, or the check below proves nothing.
        assert!(deps.iter().any(|d| d == "kv-core" || d == "thiserror"), "{krate}: parsed {deps:?}");
        for forbidden in ["tokio", "nixl-sys", "cudarc", "async-std", "mio"] {
            assert!(!deps.iter().any(|d| d == forbidden), "{krate} depends on {forbidden}");
        }
    }
}

/// What sans-IO code never does: read a clock, start a thread, open a socket or a file, print.
const IO: [&str; 6] = [
    concat!("Instant", "::now"),
    concat!("SystemTime", "::now"),
    concat!("thread", "::spawn"),
    concat!("std::", "net"),
    concat!("std::", "fs"),
    concat!("println", "!"),
];

#[test]
fn the_connector_is_sans_io_outside_its_driver() {
    let deps = dependencies(&root().join("crates/kv-sched-adapter/Cargo.toml"));
    assert!(deps.iter().any(|d| d == "kv-lease"), "kv-sched-adapter: parsed {deps:?}");
    for forbidden in ["tokio", "nixl-sys", "cudarc", "async-std", "mio", "kv-transport-nixl", "kv-cuda"] {
        assert!(!deps.iter().any(|d| d == forbidden), "kv-sched-adapter depends on {forbidden}");
    }
    let mut files = Vec::new();
    rust_files(&root().join("crates/kv-sched-adapter/src"), &mut files);
    assert!(files.len() > 5, "kv-sched-adapter has only {} sources", files.len());
    // The driver is synchronous too and reads no clock; it is exempt only because it is where
    // a transport is called.
    for file in files.iter().filter(|f| !f.ends_with("driver.rs")) {
        let text = fs::read_to_string(file).unwrap();
        for needle in IO {
            assert!(!text.contains(needle), "{} uses {needle}: the connector is sans-IO", file.display());
        }
    }
}

#[test]
fn pure_crates_read_no_clock_and_start_no_threads() {
    let forbidden = IO;
    for krate in ["kv-core", "kv-lease"] {
        // The library sources only: benches time real operations and must read a clock.
        let mut files = Vec::new();
        rust_files(&root().join("crates").join(krate).join("src"), &mut files);
        assert!(!files.is_empty(), "{krate} has no sources");
        for file in files {
            let text = fs::read_to_string(&file).unwrap();
            for needle in forbidden {
                assert!(!text.contains(needle), "{} uses {needle}", file.display());
            }
        }
    }
}

#[test]
fn adapters_know_no_other_adapter() {
    let adapters = ["kv-transport-nixl", "kv-transport-tcp", "kv-cuda", "kv-discovery-etcd"];
    for krate in adapters {
        let deps = dependencies(&root().join("crates").join(krate).join("Cargo.toml"));
        for other in adapters.iter().filter(|o| **o != krate) {
            assert!(!deps.iter().any(|d| d == other), "{krate} depends on {other}");
        }
        for inner in ["kv-sched-adapter", "kv-testkit", "kv-lease"] {
            assert!(!deps.iter().any(|d| d == inner), "{krate} depends on {inner}");
        }
    }
    // The engine glue runs over ports: the binary that embeds it picks the adapters (its
    // example, a dev-dependency's user, picks one).
    let deps = dependencies_of(&root().join("crates/kv-engine/Cargo.toml"), |t| t == "dependencies");
    assert!(deps.iter().any(|d| d == "kv-sched-adapter"), "kv-engine: parsed {deps:?}");
    for adapter in adapters.iter().chain(&["kv-side-tcp"]) {
        assert!(!deps.iter().any(|d| d == adapter), "kv-engine depends on the adapter {adapter}");
    }
    // The side channel's sockets are shared by adapters, so they may know none of them.
    let deps = dependencies(&root().join("crates/kv-side-tcp/Cargo.toml"));
    assert!(deps.iter().any(|d| d == "kv-core"), "kv-side-tcp: parsed {deps:?}");
    for krate in adapters.iter().chain(&["kv-sched-adapter", "kv-testkit", "kv-lease"]) {
        assert!(!deps.iter().any(|d| d == krate), "kv-side-tcp depends on {krate}");
    }
}

#[test]
fn libraries_do_not_print() {
    let mut files = Vec::new();
    rust_files(&root().join("crates"), &mut files);
    // kv-demo is the harness behind `cargo xtask`'s tasks: its processes speak JSON lines on
    // stdout and print reports, as xtask does.
    let harness = root().join("crates/kv-demo");
    for file in files.iter().filter(|f| f.components().any(|c| c.as_os_str() == "src") && !f.starts_with(&harness)) {
        let text = fs::read_to_string(file).unwrap();
        for needle in [concat!("println", "!("), concat!("eprintln", "!("), concat!("dbg", "!(")] {
            assert!(!text.contains(needle), "{} uses {needle}; libraries log through tracing", file.display());
        }
    }
}

#[test]
fn no_ignored_or_should_panic_tests() {
    // The one reason a test may be ignored: it needs a GPU, which CI does not have; the GPU
    // check script (`crates/kv-demo/gpu/run.sh`) runs such tests with `--include-ignored`.
    let needs_a_gpu = concat!("#[", "ignore = \"needs a CUDA device\"]");
    for file in workspace_sources() {
        let text = fs::read_to_string(&file).unwrap().replace(needs_a_gpu, "");
        for needle in [concat!("#[", "ignore"), concat!("#[", "should_panic")] {
            assert!(!text.contains(needle), "{} has {needle}] (a test may only be {needs_a_gpu})", file.display());
        }
    }
}

/// Lines of a file, as `wc -l` counts them.
fn lines(file: &Path) -> usize {
    fs::read_to_string(file).unwrap().lines().count()
}

#[test]
fn no_source_file_is_over_800_lines_and_xtask_stays_automation() {
    // Files under `tests/` and files named `tests.rs` are exempt: a test reads best whole.
    for file in workspace_sources() {
        let exempt = file.components().any(|c| c.as_os_str() == "tests") || file.ends_with("tests.rs");
        let n = lines(&file);
        assert!(exempt || n <= 800, "{} has {n} lines; split it into rooms of their own (at most 800)", file.display());
    }
    // xtask holds automation only (ci, setup, sim, bench orchestration, thin demo commands).
    let mut files = Vec::new();
    for dir in ["src", "benches", "examples"] {
        rust_files(&root().join("xtask").join(dir), &mut files);
    }
    let total: usize = files.iter().map(|f| lines(f)).sum();
    assert!(total < 4000, "xtask's src, benches and examples hold {total} lines (under 4000: automation only)");
}
