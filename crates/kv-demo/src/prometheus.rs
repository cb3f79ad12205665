//! Prometheus's text exposition format (version 0.0.4), as the demo's engines serve it and the
//! router reads it: [`Exposition::parse`] reads one scrape into samples, [`Exposition::sum`]
//! adds up a metric over the samples whose labels match, and [`scrape`] fetches one over plain
//! HTTP/1.1 with ureq (the engines serve them with kv-engine's `MetricsEndpoint`).
//! [`idle_connections_then_scrape`] is the attack that an endpoint serving one connection at a
//! time fails: idle connections, then a scrape.

// The parser is written here because no maintained crate fits (each was tried on the text
// kv-engine's endpoint serves: labelled counters, gauges and histograms, `# HELP` and `# TYPE`):
// - prometheus-parse 0.2.5 (last release 2023) splits labels on `,` and `=`, so it dropped a
//   sample whose label value held `,`, `=` or `}`; it mangles escaped values, drops names with
//   `:` and lines that do not parse without an error, and types a histogram's `_sum` and
//   `_count` as untyped; it brings chrono, regex, itertools and once_cell.
// - prom_text_format_parser 0.1.0 (its only release, 2023) keeps escapes in label values, and
//   brings winnow 0.5 and derive_more 0.99 (syn 1) beside the tree's newer ones.
// - openmetrics-parser 0.5.1 is LGPL-3.0, which this Apache-2.0 workspace does not take in.
// `promtool check metrics` still checks every scrape the demo makes (demo/metrics.rs).

use std::collections::BTreeMap;
use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// The path engines serve their metrics on.
pub const PATH: &str = "/metrics";
/// The most bytes [`scrape`] reads of an answer; a longer one is an error.
const RESPONSE_LIMIT: u64 = 64 << 20;

/// One sample line: `name{label="value",...} value`.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    /// The sample's name (for a histogram's lines, with its `_bucket`, `_sum` or `_count`).
    pub name: String,
    /// Its labels, in the order of the line.
    pub labels: Vec<(String, String)>,
    /// Its value.
    pub value: f64,
}

impl Sample {
    /// The value of label `key`, if it has one.
    pub fn label(&self, key: &str) -> Option<&str> {
        self.labels.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }

    /// Whether the sample has every label of `labels` with that value (other labels may follow).
    pub fn matches(&self, labels: &[(&str, &str)]) -> bool {
        labels.iter().all(|(key, value)| self.label(key) == Some(*value))
    }

    /// The sample as the text format names it: `name{k="v",...}`, or `name` without labels.
    pub fn key(&self) -> String {
        if self.labels.is_empty() {
            return self.name.clone();
        }
        let labels: Vec<String> = self.labels.iter().map(|(k, v)| format!("{k}=\"{}\"", escape(v))).collect();
        format!("{}{{{}}}", self.name, labels.join(","))
    }
}

/// A label value as the text format writes it: `\`, `"` and line feeds escaped.
fn escape(value: &str) -> String {
    value.replace('\\', r"\\").replace('"', "\\\"").replace('\n', r"\n")
}

/// One scrape, parsed: its samples in order, and the metric types its `# TYPE` lines declare.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Exposition {
    /// Every sample line.
    pub samples: Vec<Sample>,
    /// Metric family name to its type (`counter`, `gauge`, `histogram`, `summary`, `untyped`).
    pub types: BTreeMap<String, String>,
}

impl Exposition {
    /// Parses a scrape in the text format; an error names the line and what is wrong with it.
    pub fn parse(text: &str) -> Result<Exposition, String> {
        let mut exposition = Exposition::default();
        for (number, line) in (1..).zip(text.lines()) {
            let line = line.trim();
            if line.is_empty() {
                continue;
            }
            if let Some(comment) = line.strip_prefix('#') {
                let mut words = comment.split_whitespace();
                if words.next() == Some("TYPE") {
                    if let (Some(name), Some(kind)) = (words.next(), words.next()) {
                        exposition.types.insert(name.to_owned(), kind.to_owned());
                    }
                }
                continue;
            }
            let sample = parse_sample(line).map_err(|e| format!("line {number}: {e}: {line:?}"))?;
            exposition.samples.push(sample);
        }
        Ok(exposition)
    }

    /// The sum of metric `name`'s samples that carry every label of `labels` (0 if none do).
    pub fn sum(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.samples.iter().filter(|s| s.name == name && s.matches(labels)).map(|s| s.value).sum()
    }

    /// Metric `name`'s samples that carry every label of `labels`, summed by the value of label
    /// `by` (`releases by reason`); samples without `by` are left out.
    pub fn sum_by(&self, name: &str, by: &str, labels: &[(&str, &str)]) -> BTreeMap<String, f64> {
        let mut sums = BTreeMap::new();
        for s in self.samples.iter().filter(|s| s.name == name && s.matches(labels)) {
            if let Some(value) = s.label(by) {
                *sums.entry(value.to_owned()).or_insert(0.0) += s.value;
            }
        }
        sums
    }

    /// The type of the family sample `name` belongs to: its own `# TYPE`, or, for a
    /// histogram's or summary's `_bucket`, `_sum` and `_count` lines, the family's.
    pub fn kind(&self, name: &str) -> Option<&str> {
        if let Some(kind) = self.types.get(name) {
            return Some(kind);
        }
        ["_bucket", "_sum", "_count"]
            .iter()
            .filter_map(|suffix| name.strip_suffix(suffix))
            .filter_map(|family| self.types.get(family))
            .find(|kind| *kind == "histogram" || *kind == "summary")
            .map(String::as_str)
    }

    /// Every sample by [`Sample::key`], but a histogram's buckets (and a summary's quantiles):
    /// counters, gauges, and the `_sum` and `_count` of histograms. Samples with the same key
    /// are added up.
    pub fn flat(&self) -> BTreeMap<String, f64> {
        let mut flat = BTreeMap::new();
        for s in &self.samples {
            let family = self.kind(&s.name);
            let bucket = family == Some("histogram") && s.name.ends_with("_bucket");
            let quantile = family == Some("summary") && s.label("quantile").is_some();
            if !bucket && !quantile {
                *flat.entry(s.key()).or_insert(0.0) += s.value;
            }
        }
        flat
    }
}

/// Parses one sample line: a name, labels in braces if any, a value, and a timestamp if any.
fn parse_sample(line: &str) -> Result<Sample, String> {
    let is_name_char = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    let end = line.find(|c: char| !is_name_char(c)).unwrap_or(line.len());
    let (name, mut rest) = line.split_at(end);
    if name.is_empty() || name.starts_with(|c: char| c.is_ascii_digit()) {
        return Err("no metric name".into());
    }
    let mut labels = Vec::new();
    if let Some(after) = rest.strip_prefix('{') {
        rest = parse_labels(after, &mut labels)?;
    }
    let mut fields = rest.split_whitespace();
    let value = fields.next().ok_or("no value")?;
    let value: f64 = value.parse().map_err(|_| format!("the value {value:?} is not a number"))?;
    if let Some(timestamp) = fields.next() {
        timestamp.parse::<i64>().map_err(|_| format!("the timestamp {timestamp:?} is not an integer"))?;
    }
    if fields.next().is_some() {
        return Err("more than a value and a timestamp after the name".into());
    }
    Ok(Sample { name: name.to_owned(), labels, value })
}

/// Parses `k="v",...}` (the text after `{`) into `labels`; returns what follows the `}`.
fn parse_labels<'a>(mut rest: &'a str, labels: &mut Vec<(String, String)>) -> Result<&'a str, String> {
    loop {
        rest = rest.trim_start();
        if let Some(after) = rest.strip_prefix('}') {
            return Ok(after);
        }
        let end = rest.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).ok_or("the labels are not closed")?;
        let (key, after) = rest.split_at(end);
        if key.is_empty() {
            return Err(format!("a label without a name at {rest:?}"));
        }
        rest = after.trim_start().strip_prefix('=').ok_or_else(|| format!("no `=` after label {key}"))?;
        rest = rest.trim_start().strip_prefix('"').ok_or_else(|| format!("label {key}'s value is not quoted"))?;
        let mut value = String::new();
        let mut chars = rest.char_indices();
        let close = loop {
            match chars.next() {
                None => return Err(format!("label {key}'s value is not closed")),
                Some((i, '"')) => break i,
                Some((_, '\\')) => match chars.next() {
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, c @ ('\\' | '"'))) => value.push(c),
                    Some((_, c)) => {
                        value.push('\\');
                        value.push(c);
                    }
                    None => return Err(format!("label {key}'s value is not closed")),
                },
                Some((_, c)) => value.push(c),
            }
        };
        labels.push((key.to_owned(), value));
        rest = rest[close + 1..].trim_start();
        if let Some(after) = rest.strip_prefix(',') {
            rest = after;
        } else if rest.is_empty() {
            return Err("the labels are not closed".into());
        } else if !rest.starts_with('}') {
            return Err(format!("no `,` or `}}` after label {key}"));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// HTTP: the router's scrape (the engines serve with kv-engine's `MetricsEndpoint`)

/// Opens `idle` connections to the metrics endpoint at `addr` that each send the start of a
/// request line and then nothing (a slow peer, as a silent one would be), keeps them open while
/// it scrapes `addr` with `timeout`, and returns how long the scrape took.
///
/// An attack on the endpoint: one that serves a connection at a time behind a per-request
/// timeout takes `idle` times that timeout to answer; [`serve`] answers at once, evicting idle
/// connections past [`MAX_CONNECTIONS`]. An error names the connection or the scrape that failed;
/// an idle connection the endpoint drops early is not one.
pub fn idle_connections_then_scrape(addr: SocketAddr, idle: usize, timeout: Duration) -> Result<Duration> {
    let mut held = Vec::with_capacity(idle);
    for i in 0..idle {
        let mut stream = TcpStream::connect_timeout(&addr, timeout)
            .with_context(|| format!("idle connection {i} of {idle} to {addr}"))?;
        // The endpoint may already have dropped it (evicted for a newer one): that is its defence.
        let _ = stream.write_all(b"GET /metr");
        held.push(stream);
    }
    let started = Instant::now();
    scrape(addr, timeout).with_context(|| format!("with {idle} idle connections open"))?;
    let took = started.elapsed();
    drop(held);
    Ok(took)
}

/// `GET /metrics` from `addr` over plain HTTP/1.1 with ureq, with `timeout` to connect and for
/// each read and write; the body of a 200 answer, or an error that names the URL (and the status
/// the endpoint answered with, if it answered).
pub fn scrape(addr: SocketAddr, timeout: Duration) -> Result<String> {
    let url = format!("http://{addr}{PATH}");
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_connect(Some(timeout))
        .timeout_per_read(Some(timeout))
        .timeout_per_write(Some(timeout))
        // The engines are scraped where they listen: a proxy from the environment (ureq's
        // default) would be asked instead.
        .proxy(None)
        // A status other than 200 is said below, in words, with the URL.
        .http_status_as_error(false)
        .build()
        .into();
    let fetch = || -> Result<String> {
        let mut answer = agent.get(&url).header("Accept", "text/plain").call()?;
        let status = answer.status();
        if status != ureq::http::StatusCode::OK {
            bail!("answered {status}");
        }
        Ok(answer.body_mut().with_config().limit(RESPONSE_LIMIT).read_to_string()?)
    };
    fetch().with_context(|| format!("scraping {url}"))
}

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::net::TcpListener;

    use super::*;

    fn sample(name: &str, labels: &[(&str, &str)], value: f64) -> Sample {
        let labels = labels.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
        Sample { name: name.to_owned(), labels, value }
    }

    /// Parses `input` and compares its samples with `expected`.
    fn check(input: &str, expected: &[Sample]) {
        let parsed = Exposition::parse(input).unwrap_or_else(|e| panic!("{input:?}: {e}"));
        assert_eq!(parsed.samples, expected, "{input:?}");
    }

    /// Parses `input`, which must fail with an error containing `expected`.
    fn check_error(input: &str, expected: &str) {
        let err = Exposition::parse(input).expect_err(input);
        assert!(err.contains(expected), "{input:?}: {err:?} does not say {expected:?}");
    }

    #[test]
    fn sample_lines() {
        check("up 1", &[sample("up", &[], 1.0)]);
        check("up 1 1712345678000", &[sample("up", &[], 1.0)]);
        check("  a_b:c  2.5  ", &[sample("a_b:c", &[], 2.5)]);
        check("x{} 3", &[sample("x", &[], 3.0)]);
        check(
            r#"kvflow_releases_total{engine="prefill0",reason="expired"} 7"#,
            &[sample("kvflow_releases_total", &[("engine", "prefill0"), ("reason", "expired")], 7.0)],
        );
        check(r#"x{a = "1" , b="2",} 4"#, &[sample("x", &[("a", "1"), ("b", "2")], 4.0)]);
        check(
            "x +Inf\ny -Inf\nz 1e-3",
            &[sample("x", &[], f64::INFINITY), sample("y", &[], f64::NEG_INFINITY), sample("z", &[], 0.001)],
        );
        let nan = Exposition::parse("x NaN").unwrap();
        assert!(nan.samples[0].value.is_nan());
    }

    #[test]
    fn escaped_label_values() {
        check(r#"x{a="say \"hi\""} 1"#, &[sample("x", &[("a", "say \"hi\"")], 1.0)]);
        check(
            r#"x{a="back\\slash",b="line\nfeed"} 1"#,
            &[sample("x", &[("a", "back\\slash"), ("b", "line\nfeed")], 1.0)],
        );
        check(r#"x{a="}{,=",b=""} 1"#, &[sample("x", &[("a", "}{,="), ("b", "")], 1.0)]);
        check(r#"x{a="\\"} 1"#, &[sample("x", &[("a", "\\")], 1.0)]);
        // Written back as the format escapes it.
        let parsed = Exposition::parse(r#"x{a="say \"hi\"\\\n"} 1"#).unwrap();
        assert_eq!(parsed.samples[0].key(), r#"x{a="say \"hi\"\\\n"}"#);
    }

    #[test]
    fn comments_and_blank_lines() {
        let text = "# HELP x What it counts.\n# TYPE x counter\n\nx 1\n# a comment\n#\ny 2\n";
        check(text, &[sample("x", &[], 1.0), sample("y", &[], 2.0)]);
        let parsed = Exposition::parse(text).unwrap();
        assert_eq!(parsed.types.get("x").map(String::as_str), Some("counter"));
    }

    #[test]
    fn bad_lines_are_errors_that_name_the_line() {
        check_error("x 1\ny", "line 2: no value");
        check_error("x one", "\"one\" is not a number");
        check_error("{a=\"1\"} 1", "no metric name");
        check_error("9x 1", "no metric name");
        check_error(r#"x{a="1} 1"#, "not closed");
        check_error(r#"x{a=1} 1"#, "not quoted");
        check_error(r#"x{a} 1"#, "no `=`");
        check_error(r#"x{a="1" b="2"} 1"#, "no `,` or `}`");
        check_error(r#"x{a="1""#, "not closed");
        check_error("x 1 2 3", "more than a value");
        check_error("x 1 soon", "timestamp");
    }

    #[test]
    fn sums_over_the_samples_whose_labels_match() {
        let text = r#"
# TYPE kvflow_releases_total counter
kvflow_releases_total{engine="prefill0",reason="expired"} 2
kvflow_releases_total{engine="prefill0",reason="transferred"} 30
kvflow_releases_total{engine="prefill1",reason="expired"} 5
kvflow_ignored_messages_total{engine="prefill0",rank="0",cause="foreign"} 3
kvflow_ignored_messages_total{engine="prefill0",rank="1",cause="foreign"} 4
kvflow_ignored_messages_total{engine="prefill0",rank="1",cause="late"} 9
"#;
        let e = Exposition::parse(text).unwrap();
        assert_eq!(e.sum("kvflow_releases_total", &[]), 37.0);
        assert_eq!(e.sum("kvflow_releases_total", &[("reason", "expired")]), 7.0);
        assert_eq!(e.sum("kvflow_releases_total", &[("engine", "prefill0"), ("reason", "expired")]), 2.0);
        assert_eq!(e.sum("kvflow_ignored_messages_total", &[("cause", "foreign")]), 7.0);
        assert_eq!(e.sum("kvflow_ignored_messages_total", &[("cause", "unauthenticated")]), 0.0);
        assert_eq!(e.sum("kvflow_nothing_total", &[]), 0.0);
        let by_reason = e.sum_by("kvflow_releases_total", "reason", &[("engine", "prefill0")]);
        assert_eq!(by_reason, BTreeMap::from([("expired".to_owned(), 2.0), ("transferred".to_owned(), 30.0)]));
    }

    #[test]
    fn flat_leaves_out_buckets_and_quantiles() {
        let text = r#"
# TYPE kvflow_xfer_time_seconds histogram
kvflow_xfer_time_seconds_bucket{engine="d",le="0.001"} 1
kvflow_xfer_time_seconds_bucket{engine="d",le="+Inf"} 2
kvflow_xfer_time_seconds_sum{engine="d"} 0.5
kvflow_xfer_time_seconds_count{engine="d"} 2
# TYPE lat summary
lat{quantile="0.5"} 1
lat_sum 3
lat_count 2
# TYPE kvflow_peers_connected gauge
kvflow_peers_connected{engine="d",rank="0"} 1
# TYPE odd_bucket counter
odd_bucket 4
"#;
        let e = Exposition::parse(text).unwrap();
        assert_eq!(e.kind("kvflow_xfer_time_seconds_bucket"), Some("histogram"));
        assert_eq!(e.kind("kvflow_peers_connected"), Some("gauge"));
        assert_eq!(e.kind("odd_bucket"), Some("counter"));
        assert_eq!(e.kind("unknown"), None);
        let flat: Vec<(String, f64)> = e.flat().into_iter().collect();
        let expected = [
            (r#"kvflow_peers_connected{engine="d",rank="0"}"#, 1.0),
            (r#"kvflow_xfer_time_seconds_count{engine="d"}"#, 2.0),
            (r#"kvflow_xfer_time_seconds_sum{engine="d"}"#, 0.5),
            ("lat_count", 2.0),
            ("lat_sum", 3.0),
            ("odd_bucket", 4.0),
        ];
        assert_eq!(flat, expected.map(|(k, v)| (k.to_owned(), v)));
    }

    #[test]
    fn a_failed_scrape_names_the_address() {
        // A port nothing listens on: bind one, then let it go.
        let addr = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        let err = format!("{:#}", scrape(addr, Duration::from_secs(5)).unwrap_err());
        assert!(err.contains(&format!("http://{addr}/metrics")), "{err}");
        // Something that answers, but not with the metrics.
        let addr = endpoint(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n", Duration::ZERO);
        let err = format!("{:#}", scrape(addr, Duration::from_secs(5)).unwrap_err());
        assert!(err.contains(&format!("http://{addr}/metrics")) && err.contains("503"), "{err}");
    }

    /// An endpoint that reads one request, says nothing for `hold`, writes `answer` and hangs up.
    fn endpoint(answer: &'static [u8], hold: Duration) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            let mut buf = [0u8; 1024];
            let _ = stream.read(&mut buf);
            std::thread::sleep(hold);
            let _ = stream.write_all(answer);
        });
        addr
    }

    #[test]
    fn a_scrape_returns_the_body_however_it_is_framed() {
        let cases: [(&[u8], &str); 3] = [
            (b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nup 1", "up 1"),
            (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nup\r\n2\r\n 1\r\n0\r\n\r\n", "up 1"),
            (b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nup 1\n", "up 1\n"),
        ];
        for (answer, body) in cases {
            let addr = endpoint(answer, Duration::ZERO);
            let text = scrape(addr, Duration::from_secs(5)).unwrap_or_else(|e| panic!("{e:#}"));
            assert_eq!(text, body, "{}", String::from_utf8_lossy(answer));
        }
    }

    #[test]
    fn scrapes_kv_engines_endpoint() {
        let text = "# HELP kvflow_releases_total Released.\n# TYPE kvflow_releases_total counter\n\
                    kvflow_releases_total{engine=\"p\",reason=\"expired\"} 2\n";
        let endpoint =
            kv_engine::metrics::MetricsEndpoint::serve(([127, 0, 0, 1], 0).into(), || text.to_owned()).unwrap();
        let scraped = scrape(endpoint.addr(), Duration::from_secs(5)).unwrap_or_else(|e| panic!("{e:#}"));
        assert_eq!(scraped, text);
        assert_eq!(Exposition::parse(&scraped).unwrap().sum("kvflow_releases_total", &[("reason", "expired")]), 2.0);
    }

    #[test]
    fn a_silent_endpoint_times_out() {
        let addr = endpoint(b"", Duration::from_secs(30));
        let started = Instant::now();
        let err = format!("{:#}", scrape(addr, Duration::from_millis(200)).unwrap_err());
        assert!(started.elapsed() < Duration::from_secs(10), "took {:?}: {err}", started.elapsed());
        assert!(err.contains(&format!("http://{addr}/metrics")), "{err}");
    }
}
