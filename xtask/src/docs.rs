//! `cargo xtask docs`: writes the parts of the docs pages that are generated from code.
//!
//! Today those are the metrics table of `docs/operating.md`, from kv-sched-adapter's
//! [`METRICS`], the list the connectors describe their metrics from, and the settings tables
//! of `docs/vllm.md`, from [`TRANSFER_SETTINGS`] and [`EXTRA_SETTINGS`], the lists a test holds
//! to the fields of the connector's settings types, and the results table of
//! `docs/benchmarks.md`, from the newest file `cargo xtask bench --json-out` wrote under
//! `bench/results/`.
//! Each generated part sits between two marker comments of its page, and nothing outside them
//! is touched. `xtask/tests/docs_fresh.rs` regenerates every part in memory and fails when a
//! page differs, so a metric added without running this task fails the tests.
//!
//! This module uses none of xtask's others, so that the test can include it whole.

use std::fs;
use std::path::Path;

use anyhow::{Context, Result};
use kv_sched_adapter::metrics::{MetricDoc, METRICS};
use kv_sched_adapter::{SettingDoc, EXTRA_SETTINGS, TRANSFER_SETTINGS};

/// A part of a docs page generated from code.
pub struct Generated {
    /// The page, relative to the workspace root.
    pub page: &'static str,
    /// The part's name in its markers ([`begin_marker`], [`end_marker`]).
    pub name: &'static str,
    /// Writes the part, without the markers, from the workspace at the path given.
    pub render: fn(&Path) -> Result<String, String>,
}

/// Every generated part.
pub const GENERATED: &[Generated] = &[
    Generated { page: "docs/operating.md", name: "metrics", render: |_| Ok(metrics_table()) },
    Generated { page: "docs/vllm.md", name: "transfer-settings", render: |_| Ok(settings_table(TRANSFER_SETTINGS)) },
    Generated { page: "docs/vllm.md", name: "extra-settings", render: |_| Ok(settings_table(EXTRA_SETTINGS)) },
    Generated { page: "docs/benchmarks.md", name: "results", render: results_table },
];

/// The line that opens the part `name`.
pub fn begin_marker(name: &str) -> String {
    format!("<!-- BEGIN GENERATED {name}: `cargo xtask docs` writes this part; edit the code it is generated from -->")
}

/// The line that closes the part `name`.
pub fn end_marker(name: &str) -> String {
    format!("<!-- END GENERATED {name} -->")
}

/// The metrics table: one row per metric of [`METRICS`], in its order.
pub fn metrics_table() -> String {
    let mut table = String::from("| metric | type | meaning |\n|---|---|---|\n");
    for MetricDoc { name, kind, labels, help } in METRICS {
        let labels = if labels.is_empty() { String::new() } else { format!("{{{}}}", labels.join(",")) };
        table.push_str(&format!("| `{name}{labels}` | {kind} | {} |\n", cell(help)));
    }
    table
}

/// A settings table: one row per key, in the list's order.
pub fn settings_table(settings: &[SettingDoc]) -> String {
    let mut table = String::from("| key | default | kvflow |\n|---|---|---|\n");
    for SettingDoc { key, default, meaning } in settings {
        table.push_str(&format!("| `{key}` | {} | {} |\n", cell(default), cell(meaning)));
    }
    table
}

/// Where `cargo xtask bench --json-out` writes its results files.
pub const RESULTS_DIR: &str = "bench/results";

/// The newest results file under [`RESULTS_DIR`] (their names start with the UTC date), as a
/// line that says which run it was and a table of its headline figures: every ratio (a key
/// `ratio...` or `X_over_Y`), transfer speed (`gbps`), throughput and idle CPU, by its path in
/// the report.
pub fn results_table(root: &Path) -> Result<String, String> {
    let dir = root.join(RESULTS_DIR);
    let mut files: Vec<String> = fs::read_dir(&dir)
        .map_err(|e| format!("cannot read {}: {e}", dir.display()))?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".json"))
        .collect();
    files.sort();
    let newest =
        files.last().ok_or_else(|| format!("no results in {RESULTS_DIR}: run `cargo xtask bench --json-out`"))?;
    let path = dir.join(newest);
    let text = fs::read_to_string(&path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let results: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("cannot parse {}: {e}", path.display()))?;
    let stamp = &results["stamp"];
    let host = &stamp["host"];
    let gpus = host["gpus"]
        .as_array()
        .filter(|g| !g.is_empty())
        .map_or("no GPU".to_owned(), |g| g.iter().filter_map(|n| n.as_str()).collect::<Vec<_>>().join(", "));
    let revision = stamp["revision"].as_str().unwrap_or("unknown");
    let mut out = format!(
        "From `{RESULTS_DIR}/{newest}`: revision `{}`{}, {}, {} cores ({}), {} GiB, {gpus}{}.\n\n",
        revision.get(..12).unwrap_or(revision),
        if stamp["dirty"].as_bool() == Some(true) { " with changes" } else { "" },
        stamp["date"].as_str().unwrap_or("undated"),
        host["cores"],
        host["cpu"].as_str().unwrap_or("unknown CPU"),
        host["memory_gib"],
        if stamp["flags"]["quick"].as_bool() == Some(true) { ", `--quick`" } else { "" },
    );
    out.push_str("| figure | value |\n|---|---|\n");
    let mut rows = Vec::new();
    headline(&results["report"], &mut String::new(), false, &mut rows);
    if rows.is_empty() {
        return Err(format!("{} has no figures", path.display()));
    }
    for (figure, value) in rows {
        out.push_str(&format!("| `{figure}` | {} |\n", significant(value)));
    }
    Ok(out)
}

/// The headline figures under `value`, whose path is `path`, into `rows`: every number under a
/// figure's key (a ratio's median and spread, say), and no other.
fn headline(value: &serde_json::Value, path: &mut String, figure: bool, rows: &mut Vec<(String, f64)>) {
    let mut visit = |key: &str, field: &serde_json::Value, figure: bool, rows: &mut Vec<(String, f64)>| {
        let len = path.len();
        if !path.is_empty() && !key.starts_with('[') {
            path.push('.');
        }
        path.push_str(key);
        headline(field, path, figure, rows);
        path.truncate(len);
    };
    match value {
        serde_json::Value::Object(fields) => {
            for (key, field) in fields {
                let named = key.starts_with("ratio")
                    || key.contains("_over_")
                    || key == "gbps"
                    || key.ends_with("throughput_rps")
                    || key.starts_with("idle_cpu_percent");
                visit(key, field, figure || named, rows);
            }
        }
        serde_json::Value::Array(items) => {
            for (index, item) in items.iter().enumerate() {
                visit(&format!("[{index}]"), item, figure, rows);
            }
        }
        serde_json::Value::Number(number) if figure => rows.extend(number.as_f64().map(|n| (path.clone(), n))),
        _ => {}
    }
}

/// `value` to three significant digits, as a table shows a measurement.
fn significant(value: f64) -> String {
    if value == 0.0 || !value.is_finite() {
        return value.to_string();
    }
    let decimals = (2 - value.abs().log10().floor() as i32).max(0) as usize;
    format!("{value:.decimals$}")
}

/// `text` for a table cell, where a `|` would end the cell.
fn cell(text: &str) -> String {
    text.replace('|', "\\|")
}

/// `text` with the part `name` between its markers replaced by `content`, a blank line on
/// either side (so that Markdown ends a table before the closing marker); an error says which
/// marker is missing or out of order.
pub fn splice(text: &str, name: &str, content: &str) -> Result<String, String> {
    let (begin, end) = (begin_marker(name), end_marker(name));
    let start = text.find(&begin).ok_or_else(|| format!("no `{begin}` line"))? + begin.len();
    let stop = text[start..].find(&end).ok_or_else(|| format!("no `{end}` line after `{begin}`"))? + start;
    Ok(format!("{}\n\n{}\n\n{}", &text[..start], content.trim_end_matches('\n'), &text[stop..]))
}

/// Each page with a generated part: its path, its text now, and its text with every part
/// regenerated.
pub fn regenerate(root: &Path) -> Result<Vec<(&'static str, String, String)>, String> {
    let mut pages: Vec<(&'static str, String, String)> = Vec::new();
    for part in GENERATED {
        let index = match pages.iter().position(|(page, ..)| *page == part.page) {
            Some(index) => index,
            None => {
                let path = root.join(part.page);
                let text = fs::read_to_string(&path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
                pages.push((part.page, text.clone(), text));
                pages.len() - 1
            }
        };
        let page = &mut pages[index];
        let content = (part.render)(root).map_err(|e| format!("{} ({}): {e}", part.page, part.name))?;
        page.2 = splice(&page.2, part.name, &content).map_err(|e| format!("{}: {e}", part.page))?;
    }
    Ok(pages)
}

/// Writes every page whose generated parts are stale, and says which it wrote.
pub fn run(root: &Path) -> Result<()> {
    let pages = regenerate(root).map_err(anyhow::Error::msg)?;
    for (page, now, fresh) in pages {
        if now == fresh {
            eprintln!("xtask: {page} is up to date");
        } else {
            fs::write(root.join(page), fresh).with_context(|| format!("cannot write {page}"))?;
            eprintln!("xtask: wrote {page}");
        }
    }
    Ok(())
}
