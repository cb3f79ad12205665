//! The repository stands on its own: nothing in it but CI's entry point reads the team's folder
//! beside it, and `docs/scenario-format.md` documents the scenario format the reader accepts,
//! every key, event and named value of kv-testkit's `Keys::accepted` (read off the reader's own
//! serde types), with no key the reader does not accept.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use kv_testkit::scenario::Keys;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// How a file would name the team's folder beside the repository (written in two pieces, so
/// that this file does not name it).
const OUTSIDE: [&str; 2] = [concat!("..", "/shared"), concat!("shared", "/scenarios")];

/// The one file that may: CI's entry point, which also runs the team's scenarios when they are
/// there.
const CI_ENTRY: &str = ".ci/run";

/// The repository's files as a commit would hold them: those git tracks and those it would
/// (untracked, not ignored), less those deleted from the work tree.
fn repository_files() -> Vec<String> {
    let out = Command::new("git")
        .args(["ls-files", "-z", "--cached", "--others", "--exclude-standard"])
        .current_dir(root())
        .output()
        .expect("git runs");
    assert!(out.status.success(), "git ls-files: {}", String::from_utf8_lossy(&out.stderr));
    let list = String::from_utf8(out.stdout).expect("git lists paths in UTF-8");
    let files: Vec<String> =
        list.split('\0').filter(|p| !p.is_empty() && root().join(p).is_file()).map(str::to_owned).collect();
    assert!(files.len() > 100, "git listed only {} files", files.len());
    files
}

#[test]
fn nothing_but_ci_names_the_folder_beside_the_repository() {
    let mut named = Vec::new();
    for file in repository_files().iter().filter(|f| *f != CI_ENTRY) {
        let bytes = fs::read(root().join(file)).unwrap();
        for needle in OUTSIDE {
            if bytes.windows(needle.len()).any(|w| w == needle.as_bytes()) {
                named.push(format!("{file} names {needle}"));
            }
        }
    }
    assert!(
        named.is_empty(),
        "the repository must carry what it reads (only {CI_ENTRY} may look beside it): {named:#?}"
    );
}

/// The text under the heading line `heading`, up to the next heading of its level or higher;
/// `None` when there is no such heading.
fn section<'a>(doc: &'a str, heading: &str) -> Option<&'a str> {
    let level = heading.bytes().take_while(|&b| b == b'#').count();
    let start = doc.lines().position(|line| line == heading)?;
    let mut lines = doc.split_inclusive('\n');
    let offset: usize = lines.by_ref().take(start + 1).map(str::len).sum();
    let mut end = offset;
    for line in lines {
        let hashes = line.bytes().take_while(|&b| b == b'#').count();
        if hashes > 0 && hashes <= level && line.as_bytes().get(hashes) == Some(&b' ') {
            break;
        }
        end += line.len();
    }
    Some(&doc[offset..end])
}

/// The keys that the rows of the tables in `text` document: each row's first cell, when it is
/// a name in backticks (`key`), as the format's tables write keys.
fn documented(text: &str) -> Vec<&str> {
    text.lines()
        .filter_map(|line| line.strip_prefix("| `")?.split_once("` |").map(|(key, _)| key))
        .filter(|key| key.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'.'))
        .collect()
}

/// Checks that the section `heading` of `doc` has a table row for each of `keys` and none for
/// another key, writing what is wrong into `problems`.
fn check(doc: &str, heading: &str, keys: &[&str], problems: &mut Vec<String>) {
    let Some(text) = section(doc, heading) else {
        problems.push(format!("no section {heading:?}"));
        return;
    };
    let rows = documented(text);
    for key in keys.iter().filter(|k| !rows.contains(k)) {
        problems.push(format!("{heading:?} has no row for `{key}`, which the reader accepts"));
    }
    for row in rows.iter().filter(|r| !keys.contains(r)) {
        problems.push(format!("{heading:?} documents `{row}`, which the reader does not accept"));
    }
}

/// What is missing from, or stale in, the page `doc` for the keys `keys`.
fn review(doc: &str, keys: &Keys) -> Vec<String> {
    let mut problems = Vec::new();
    check(doc, "## The file", &keys.file, &mut problems);
    check(doc, "## `[cluster]`", &keys.cluster, &mut problems);
    check(doc, "## `[policy]`", &keys.policy, &mut problems);
    check(doc, "## Steps", &keys.step, &mut problems);
    for (event, fields) in &keys.events {
        check(doc, &format!("### `{event}`"), fields, &mut problems);
    }
    check(doc, "## Expectations", &keys.expect, &mut problems);
    for (key, words) in &keys.words {
        for word in words.iter().filter(|w| !doc.contains(&format!("`\"{w}\"`"))) {
            problems.push(format!("`\"{word}\"`, a value of `{key}`, is not named"));
        }
    }
    problems
}

#[test]
fn the_scenario_format_page_documents_every_key_the_reader_accepts() {
    let page = root().join("docs/scenario-format.md");
    let doc = fs::read_to_string(&page).unwrap_or_else(|e| panic!("{}: {e}", page.display()));
    let keys = Keys::accepted();
    let problems = review(&doc, &keys);
    assert!(problems.is_empty(), "docs/scenario-format.md is not the reader's format: {problems:#?}");
}

#[test]
fn a_key_left_out_of_the_page_or_one_it_makes_up_is_named() {
    let doc = fs::read_to_string(root().join("docs/scenario-format.md")).unwrap();
    let keys = Keys::accepted();
    let row = "| `whole_tokens` |";
    assert!(doc.contains(row));
    let without = doc.replace(row, "| whole tokens |");
    let problems = review(&without, &keys);
    assert_eq!(problems.len(), 1, "{problems:#?}");
    assert!(problems[0].contains("### `progress`") && problems[0].contains("`whole_tokens`"), "{problems:#?}");

    let stale = doc.replace(
        "| `until_s` | number | required | When the partition",
        "| `until_ms` | number | required | When the partition",
    );
    let problems = review(&stale, &keys);
    assert_eq!(problems.len(), 2, "{problems:#?}");
    assert!(problems.iter().any(|p| p.contains("documents `until_ms`")), "{problems:#?}");

    let no_event = doc.replace("### `lapse`", "### Lapses");
    assert!(review(&no_event, &keys).iter().any(|p| p.contains("no section \"### `lapse`\"")));
}
