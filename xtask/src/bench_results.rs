//! `cargo xtask bench --json-out`: the bench's figures as data. One run writes one file under
//! `bench/results/`, its report stamped with what a reader needs to compare it with another:
//! the git revision (and whether the tree had changes), the host (cores, CPU model, memory,
//! GPU if any), the UTC date and the flags the bench ran with. The files are the history;
//! `docs/benchmarks.md` shows a table of the newest (`cargo xtask docs` writes it).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use serde_json::{json, Value};

use crate::docs::RESULTS_DIR;
/// Writes `report` with its stamp into a new file under [`RESULTS_DIR`], named by the date and
/// revision so that the newest sorts last, and returns its path.
pub fn write(root: &Path, report: Value, flags: Value) -> Result<PathBuf> {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).context("the clock is before 1970")?.as_secs();
    let (revision, dirty) = revision(root);
    let stamp = json!({
        "date": utc(now),
        "revision": revision,
        "dirty": dirty,
        "host": host(),
        "flags": flags,
    });
    let dir = root.join(RESULTS_DIR);
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let short = revision.get(..12).unwrap_or(&revision);
    // `:` is not a file-name character everywhere.
    let path = dir.join(format!("{}-{short}.json", utc(now).replace(':', "")));
    let text = serde_json::to_string_pretty(&json!({ "stamp": stamp, "report": report }))? + "\n";
    std::fs::write(&path, text).with_context(|| format!("cannot write {}", path.display()))?;
    Ok(path)
}

/// `git rev-parse HEAD` and whether `git status` lists a change; `unknown` outside a checkout.
fn revision(root: &Path) -> (String, bool) {
    let git = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .current_dir(root)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
    };
    let revision = git(&["rev-parse", "HEAD"]).unwrap_or_else(|| "unknown".to_owned());
    // Results files are not changes of the code measured.
    let dirty = git(&["status", "--porcelain", "--", ".", &format!(":!{RESULTS_DIR}")]).is_some_and(|s| !s.is_empty());
    (revision, dirty)
}

/// The host: cores the bench may use, the CPU's model and memory (from `/proc`), and the GPUs
/// `nvidia-smi` lists (none where it is absent).
fn host() -> Value {
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0);
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu = field(&cpuinfo, "model name").unwrap_or("unknown");
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let memory_gib = field(&meminfo, "MemTotal")
        .and_then(|kb| kb.trim_end_matches("kB").trim().parse::<f64>().ok())
        .map(|kb| (kb / (1024.0 * 1024.0) * 10.0).round() / 10.0);
    let gpus: Vec<String> = Command::new("nvidia-smi")
        .args(["--query-gpu=name", "--format=csv,noheader"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).lines().map(|l| l.trim().to_owned()).collect())
        .unwrap_or_default();
    json!({ "cores": cores, "cpu": cpu, "memory_gib": memory_gib, "gpus": gpus })
}

/// The value of the first `name: value` line of a `/proc` file.
fn field<'a>(text: &'a str, name: &str) -> Option<&'a str> {
    text.lines().find_map(|line| {
        let (key, value) = line.split_once(':')?;
        (key.trim() == name).then_some(value.trim())
    })
}

/// `seconds` since the Unix epoch as an RFC 3339 UTC time, `2026-12-07T22:40:05Z`.
fn utc(seconds: u64) -> String {
    let (days, rest) = (seconds / 86_400, seconds % 86_400);
    let (year, month, day) = civil(days);
    format!("{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z", rest / 3600, rest / 60 % 60, rest % 60)
}

/// The proleptic Gregorian date `days` after 1970-01-01 (Howard Hinnant's `civil_from_days`).
fn civil(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let day_of_era = z % 146_097;
    let year_of_era = (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let mp = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = year_of_era + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_are_utc_rfc_3339() {
        assert_eq!(utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(utc(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(utc(1_796_683_205), "2026-12-07T22:40:05Z");
        assert_eq!(utc(4_107_542_399), "2100-02-28T23:59:59Z");
    }

    #[test]
    fn proc_fields_are_read_by_name() {
        let cpuinfo = "processor\t: 0\nmodel name\t: AMD EPYC 9554\nflags\t: fpu\n";
        assert_eq!(field(cpuinfo, "model name"), Some("AMD EPYC 9554"));
        assert_eq!(field(cpuinfo, "cache size"), None);
    }
}
