//! `cargo xtask docs`: writes the parts of the docs pages that are generated from code.
//!
//! Today that is the metrics table of `docs/operating.md`, from kv-sched-adapter's
//! [`METRICS`], the list the connectors describe their metrics from.
//! Each generated part sits between two marker comments of its page, and nothing outside them
//! is touched. `xtask/tests/docs_fresh.rs` regenerates every part in memory and fails when a
//! page differs, so a metric added without running this task fails the tests.
//!
//! This module uses none of xtask's others, so that the test can include it whole.

use std::fs;
use std::path::Path;

use anyhow::{Context, Result};
use kv_sched_adapter::metrics::{MetricDoc, METRICS};

/// A part of a docs page generated from code.
pub struct Generated {
    /// The page, relative to the workspace root.
    pub page: &'static str,
    /// The part's name in its markers ([`begin_marker`], [`end_marker`]).
    pub name: &'static str,
    /// Writes the part, without the markers.
    pub render: fn() -> String,
}

/// Every generated part.
pub const GENERATED: &[Generated] = &[Generated { page: "docs/operating.md", name: "metrics", render: metrics_table }];

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
        // A `|` would end the cell.
        table.push_str(&format!("| `{name}{labels}` | {kind} | {} |\n", help.replace('|', "\\|")));
    }
    table
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
        page.2 = splice(&page.2, part.name, &(part.render)()).map_err(|e| format!("{}: {e}", part.page))?;
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
