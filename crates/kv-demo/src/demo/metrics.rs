//! The engines' metrics, as the report counts them: every engine serves the connectors' metrics
//! in Prometheus's text format (`kvflow-node --metrics-addr`, port 0, on its host's address),
//! and the router scrapes each incarnation once, at the end of the run (after the drain), or
//! just before it kills it, since its counters die with it. Each scrape is also checked with
//! `promtool check metrics`, which Debian's `prometheus` package brings (`cargo xtask setup`
//! installs it): its problems fail the run; without promtool the check is skipped, except
//! under CI (`CI=true`), where that fails the run too.

use std::io::Write;
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::prometheus::{self, Exposition};
use crate::proto::NodeRole;

use super::Demo;

/// How long the router waits to connect to an engine's endpoint, and for each read.
const SCRAPE_TIMEOUT: Duration = Duration::from_secs(5);

/// One scrape of one engine incarnation.
pub(super) struct Scrape {
    /// `engine#instance`, as the report names incarnations (`decode1#2`).
    pub(super) incarnation: String,
    /// P or D.
    pub(super) role: NodeRole,
    /// What the endpoint served.
    pub(super) text: String,
    /// `text`, parsed.
    pub(super) exposition: Exposition,
}

/// The name the report gives incarnation `instance` of `engine`.
pub(super) fn incarnation(engine: &str, instance: u64) -> String {
    format!("{engine}#{instance}")
}

impl Demo {
    /// Prints where engine `name`'s metrics are, with `--metrics`.
    pub(super) fn announce_metrics(&self, name: &str, instance: u64, addr: SocketAddr) {
        if self.config.print_metrics {
            let line = format!("metrics of {}: http://{addr}{}", incarnation(name, instance), prometheus::PATH);
            self.progress.suspend(|| eprintln!("{line}"));
        }
    }

    /// Scrapes engine `name`'s current incarnation, if it serves metrics; a scrape that fails,
    /// or does not parse, is an error of the run.
    pub(super) fn scrape(&mut self, name: &str) {
        let Some(node) = self.nodes.get(name) else { return };
        let Some(addr) = node.metrics else { return };
        let (role, which) = (node.role, incarnation(name, node.instance));
        if self.paused.as_ref().is_some_and(|(p, ..)| p.engine == name) {
            // A stopped process answers nobody; what it counted is not seen.
            self.unscraped.push(format!("{which} (stopped when it was due)"));
            return;
        }
        let text = match prometheus::scrape(addr, SCRAPE_TIMEOUT) {
            Ok(text) => text,
            Err(err) => return self.errors.push(format!("{which}'s metrics: {err:#}")),
        };
        match Exposition::parse(&text) {
            Ok(exposition) => self.scrapes.push(Scrape { incarnation: which, role, text, exposition }),
            Err(err) => self.errors.push(format!("{which}'s metrics (http://{addr}/metrics) do not parse: {err}")),
        }
    }

    /// Scrapes every engine still running.
    pub(super) fn scrape_live(&mut self) {
        let live: Vec<String> = self.nodes.iter().filter(|(_, n)| n.port.is_some()).map(|(k, _)| k.clone()).collect();
        for name in live {
            self.scrape(&name);
        }
    }
}

/// What `promtool check metrics` said of the scrapes.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Promtool {
    /// No problem in any of these incarnations' scrapes.
    Passed(Vec<String>),
    /// Not run, and why.
    Skipped(String),
    /// Problems (or promtool missing under CI), in words.
    Failed(String),
}

impl Promtool {
    /// The result in words, for the report.
    pub(super) fn describe(&self) -> String {
        match self {
            Promtool::Passed(which) => format!("passed ({} scrapes: {})", which.len(), which.join(", ")),
            Promtool::Skipped(why) => format!("skipped: {why}"),
            Promtool::Failed(what) => format!("FAILED: {what}"),
        }
    }
}

/// Pipes each scrape into `promtool check metrics`.
pub(super) fn promtool_check(scrapes: &[Scrape]) -> Promtool {
    let ci = std::env::var("CI").is_ok_and(|v| v == "true");
    let Some(promtool) = crate::find_in_path("promtool") else {
        let why = "promtool is not on PATH (Debian's prometheus package; `cargo xtask setup` installs it)";
        return if ci { Promtool::Failed(format!("{why}, and CI=true")) } else { Promtool::Skipped(why.into()) };
    };
    if scrapes.is_empty() {
        return Promtool::Failed("no engine was scraped".into());
    }
    let mut problems = Vec::new();
    for scrape in scrapes {
        let run = || -> std::io::Result<std::process::Output> {
            let mut child = Command::new(&promtool)
                .args(["check", "metrics"])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()?;
            // Written from here while promtool reads: the text is small, and promtool reads it
            // all before it says anything.
            let written = child.stdin.take().expect("piped").write_all(scrape.text.as_bytes());
            let output = child.wait_with_output()?;
            written.map(|()| output)
        };
        match run() {
            Ok(output) if output.status.success() => {}
            Ok(output) => {
                let said =
                    format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
                problems.push(format!("{} ({}): {}", scrape.incarnation, output.status, said.trim()));
            }
            Err(err) => problems.push(format!("{}: cannot run {}: {err}", scrape.incarnation, promtool.display())),
        }
    }
    if problems.is_empty() {
        Promtool::Passed(scrapes.iter().map(|s| s.incarnation.clone()).collect())
    } else {
        Promtool::Failed(format!("promtool check metrics: {}", problems.join("; ")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scrape(incarnation: &str, text: &str) -> Scrape {
        let exposition = Exposition::parse(text).unwrap();
        Scrape { incarnation: incarnation.into(), role: NodeRole::Prefill, text: text.into(), exposition }
    }

    #[test]
    fn promtool_passes_a_clean_exposition_and_names_the_problems_of_another() {
        if crate::find_in_path("promtool").is_none() {
            eprintln!("skipped: promtool is not on PATH (`cargo xtask setup` installs it)");
            return;
        }
        let good = "# HELP kvflow_x_total Xs.\n# TYPE kvflow_x_total counter\nkvflow_x_total{engine=\"p\"} 3\n";
        assert_eq!(promtool_check(&[scrape("prefill0#1", good)]), Promtool::Passed(vec!["prefill0#1".into()]));
        let bad = "# HELP kvflow_x Xs.\n# TYPE kvflow_x counter\nkvflow_x 3\n";
        let Promtool::Failed(what) = promtool_check(&[scrape("prefill0#1", good), scrape("decode1#2", bad)]) else {
            panic!("promtool passed a counter without _total");
        };
        assert!(what.contains("decode1#2") && what.contains("_total") && !what.contains("prefill0#1"), "{what}");
    }
}
