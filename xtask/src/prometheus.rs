//! Prometheus's text exposition format (version 0.0.4), as the demo's engines serve it and the
//! router reads it: [`Exposition::parse`] reads one scrape into samples, [`Exposition::sum`]
//! adds up a metric over the samples whose labels match; [`serve`] answers scrapes on a
//! listener of its own (up to [`MAX_CONNECTIONS`] at once, each on a worker thread, every
//! request and answer bounded in size and time, idle connections evicted past the bound), and
//! [`scrape`] fetches one over plain HTTP/1.1. [`idle_connections_then_scrape`] is the attack
//! that an endpoint serving one connection at a time fails: idle connections, then a scrape.

use std::collections::{BTreeMap, VecDeque};
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::Scope;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// The content type of the text format.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";
/// The most bytes of a request [`serve`] reads: a scrape's request line and headers.
pub const REQUEST_LIMIT: usize = 8 * 1024;
/// How long [`serve`] waits for a whole request before it drops the connection.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
/// The path [`serve`] answers on; any other gets 404.
pub const PATH: &str = "/metrics";
/// The most bytes [`scrape`] reads of an answer.
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
// HTTP: the engines' endpoint and the router's scrape
//
// The endpoint used to answer one connection at a time and wait up to REQUEST_TIMEOUT for each
// request, so 20 silent connections held a scrape for 40 s (issue 29, item 5). Now every held
// connection has a worker thread of its own, at most MAX_CONNECTIONS of them, and a connection
// past the bound evicts the oldest one that has not sent a whole request.

/// How many connections [`serve`] holds at once, each with a worker thread of its own; a
/// connection past it evicts the oldest held one that has not sent a whole request (else the
/// oldest still taking its answer), so that idle peers can delay no scrape.
pub const MAX_CONNECTIONS: usize = 8;

/// How long [`serve`] takes to write one answer before it drops the connection.
pub const ANSWER_TIMEOUT: Duration = Duration::from_secs(5);

/// What became of one connection to [`serve`]: the causes [`ConnectionCounts`] counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// It sent a whole request and took its whole answer (a scrape's, or an error's).
    Answered,
    /// It sent no whole request within [`REQUEST_TIMEOUT`].
    TimedOut,
    /// The peer closed or reset it before its whole request.
    Closed,
    /// Its answer could not be written whole within [`ANSWER_TIMEOUT`], or the peer went away.
    AnswerFailed,
    /// Dropped past [`MAX_CONNECTIONS`] as the oldest one that had not sent a whole request.
    EvictedIdle,
    /// Dropped past [`MAX_CONNECTIONS`] as the oldest one still taking its answer, when every
    /// held connection had sent its request.
    EvictedAnswering,
    /// Not served at all: the process could not duplicate its socket or start a worker for it
    /// (out of file descriptors or threads).
    Refused,
}

impl Outcome {
    /// Every outcome, in the order [`ConnectionCounts`] keeps them.
    pub const ALL: [Outcome; 7] = [
        Outcome::Answered,
        Outcome::TimedOut,
        Outcome::Closed,
        Outcome::AnswerFailed,
        Outcome::EvictedIdle,
        Outcome::EvictedAnswering,
        Outcome::Refused,
    ];
}

/// The connections of one [`serve_counting`] by [`Outcome`], and how many it holds: shared with
/// whoever wants to read them while it serves (a test, or an engine's own metrics).
#[derive(Debug, Default)]
pub struct ConnectionCounts {
    /// Connections by outcome, indexed as [`Outcome::ALL`].
    outcomes: [AtomicU64; Outcome::ALL.len()],
    /// Connections held now.
    held: AtomicUsize,
    /// The most connections held at once so far.
    most_held: AtomicUsize,
}

impl ConnectionCounts {
    /// How many connections ended with `outcome`.
    pub fn get(&self, outcome: Outcome) -> u64 {
        self.outcomes[outcome as usize].load(Ordering::Relaxed)
    }

    /// How many connections the endpoint holds now.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }

    /// The most connections the endpoint has held at once; never above [`MAX_CONNECTIONS`].
    pub fn most_held(&self) -> usize {
        self.most_held.load(Ordering::Relaxed)
    }

    fn count(&self, outcome: Outcome) {
        self.outcomes[outcome as usize].fetch_add(1, Ordering::Relaxed);
    }
}

/// Answers scrapes on `listener` until the listener fails for good: `GET /metrics` (or `HEAD`)
/// with `render()`'s text, 404 for another path, 405 for another method.
///
/// It holds at most [`MAX_CONNECTIONS`] connections, each served by a worker thread of its own
/// (started as connections come, kept for the next ones), and past that bound evicts the oldest
/// connection that has not sent a whole request, so a new scrape is never locked out by idle
/// peers. A request is read for at most [`REQUEST_TIMEOUT`] and [`REQUEST_LIMIT`] bytes, and an
/// answer written for at most [`ANSWER_TIMEOUT`], so that a peer can hold a worker for no longer
/// and grow nothing: the endpoint holds at most [`MAX_CONNECTIONS`] requests of
/// [`REQUEST_LIMIT`] bytes and answers. `render` runs on one worker at a time.
pub fn serve(listener: TcpListener, render: impl FnMut() -> String + Send) {
    serve_counting(listener, render, &ConnectionCounts::default());
}

/// [`serve`], counting its connections by [`Outcome`] into `counts`.
pub fn serve_counting(listener: TcpListener, render: impl FnMut() -> String + Send, counts: &ConnectionCounts) {
    let endpoint =
        Endpoint { table: Mutex::new(Table::default()), wake: Condvar::new(), render: Mutex::new(render), counts };
    std::thread::scope(|scope| {
        let mut failures = 0u32;
        for stream in listener.incoming() {
            match stream {
                Ok(stream) => {
                    failures = 0;
                    endpoint.admit(scope, stream);
                }
                Err(_) => {
                    // Out of file descriptors, say: give it a moment instead of spinning.
                    failures += 1;
                    if failures > 1000 {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        }
        endpoint.stop();
    });
}

/// What the acceptor and the workers of one [`serve_counting`] share.
struct Endpoint<'c, F> {
    table: Mutex<Table>,
    /// Wakes an idle worker when a connection is queued, or every worker to stop.
    wake: Condvar,
    render: Mutex<F>,
    counts: &'c ConnectionCounts,
}

/// The connections held and the workers that serve them.
#[derive(Default)]
struct Table {
    /// Every held connection by number; numbers grow with each accepted one, so the first
    /// entries are the oldest. An evicted connection leaves at once.
    held: BTreeMap<u64, Held>,
    /// Queued connections (in `held` as [`Phase::Queued`]) for the next idle worker, oldest first.
    queue: VecDeque<u64>,
    /// The next connection's number.
    next: u64,
    /// Worker threads started, and how many of them wait for a connection.
    workers: usize,
    idle_workers: usize,
    /// Set when the listener failed for good: workers finish what they hold and end.
    stopping: bool,
}

/// One held connection.
struct Held {
    /// A duplicate of its socket, to shut it down on eviction while a worker blocks on it.
    socket: TcpStream,
    phase: Phase,
}

/// Where a held connection is.
enum Phase {
    /// Accepted and waiting for a worker, which takes this end of it.
    Queued(TcpStream),
    /// A worker is reading its request.
    Reading,
    /// Its request is read; a worker renders and writes its answer.
    Answering,
}

impl Table {
    /// Drops the oldest held connection that has not sent a whole request, else the oldest one
    /// being answered; shutting its socket down wakes the worker that blocks on it.
    fn evict_one(&mut self, counts: &ConnectionCounts) {
        let idle = self.held.iter().find(|(_, h)| !matches!(h.phase, Phase::Answering)).map(|(&n, _)| n);
        let Some(number) = idle.or_else(|| self.held.keys().next().copied()) else { return };
        let Some(held) = self.held.remove(&number) else { return };
        self.queue.retain(|&q| q != number);
        let _ = held.socket.shutdown(Shutdown::Both);
        counts.count(match held.phase {
            Phase::Queued(_) | Phase::Reading => Outcome::EvictedIdle,
            Phase::Answering => Outcome::EvictedAnswering,
        });
    }

    fn note_held(&self, counts: &ConnectionCounts) {
        counts.held.store(self.held.len(), Ordering::Relaxed);
        counts.most_held.fetch_max(self.held.len(), Ordering::Relaxed);
    }
}

impl<F: FnMut() -> String + Send> Endpoint<'_, F> {
    fn table(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Queues an accepted connection for a worker, evicting one past [`MAX_CONNECTIONS`] and
    /// starting a worker if none is idle and fewer than the bound run.
    fn admit<'s>(&'s self, scope: &'s Scope<'s, '_>, stream: TcpStream) {
        let Ok(socket) = stream.try_clone() else {
            self.counts.count(Outcome::Refused);
            return;
        };
        let mut table = self.table();
        let number = table.next;
        table.next += 1;
        table.held.insert(number, Held { socket, phase: Phase::Queued(stream) });
        table.queue.push_back(number);
        if table.held.len() > MAX_CONNECTIONS {
            table.evict_one(self.counts);
        }
        table.note_held(self.counts);
        if table.queue.len() > table.idle_workers && table.workers < MAX_CONNECTIONS {
            let name = format!("kvflow-scrape-{}", table.workers);
            match std::thread::Builder::new().name(name).spawn_scoped(scope, || self.work()) {
                Ok(_) => table.workers += 1,
                // The workers that run take it in turn; if none does, a later connection evicts it.
                Err(_) if table.workers > 0 => {}
                Err(_) => {
                    if table.held.remove(&number).is_some() {
                        table.queue.retain(|&q| q != number);
                        self.counts.count(Outcome::Refused);
                        table.note_held(self.counts);
                    }
                }
            }
        }
        drop(table);
        self.wake.notify_one();
    }

    /// A worker: takes queued connections one after another until the endpoint stops.
    fn work(&self) {
        loop {
            let (number, stream) = {
                let mut table = self.table();
                table.idle_workers += 1;
                while table.queue.is_empty() && !table.stopping {
                    table = self.wake.wait(table).unwrap_or_else(PoisonError::into_inner);
                }
                table.idle_workers -= 1;
                let Some(number) = table.queue.pop_front() else { return };
                // Eviction takes a connection off the queue too, so a queued one is held.
                let held = table.held.get_mut(&number).map(|held| std::mem::replace(&mut held.phase, Phase::Reading));
                let Some(Phase::Queued(stream)) = held else { continue };
                (number, stream)
            };
            let outcome = self.answer(number, stream);
            let mut table = self.table();
            // An evicted connection was counted when it was evicted.
            if table.held.remove(&number).is_some() {
                self.counts.count(outcome);
                table.note_held(self.counts);
            }
        }
    }

    /// Answers connection `number`.
    fn answer(&self, number: u64, mut stream: TcpStream) -> Outcome {
        let head = match read_head(&mut stream) {
            Ok(head) => head,
            Err(e) if matches!(e.kind(), io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock) => {
                return Outcome::TimedOut
            }
            Err(_) => return Outcome::Closed,
        };
        match self.table().held.get_mut(&number) {
            Some(held) => held.phase = Phase::Answering,
            None => return Outcome::Closed, // Evicted as it finished its request: counted then.
        }
        let response = respond(head, || {
            let mut render = self.render.lock().unwrap_or_else(PoisonError::into_inner);
            // A render that panics answers 500 and leaves the worker serving.
            std::panic::catch_unwind(AssertUnwindSafe(|| (*render)())).ok()
        });
        match write_within(&mut stream, &response, Instant::now() + ANSWER_TIMEOUT) {
            Ok(()) => Outcome::Answered,
            Err(_) => Outcome::AnswerFailed,
        }
    }

    /// Ends the workers once they finish what they hold, and drops what is queued.
    fn stop(&self) {
        let mut table = self.table();
        table.stopping = true;
        while let Some(number) = table.queue.pop_front() {
            table.held.remove(&number);
        }
        table.note_held(self.counts);
        drop(table);
        self.wake.notify_all();
    }
}

/// The request head as read from a connection.
enum Head {
    /// The request line.
    Request(String),
    /// More than [`REQUEST_LIMIT`] bytes without the end of the headers.
    TooLarge,
}

/// Reads one request's head (up to its blank line), within the time and size bounds.
fn read_head(stream: &mut TcpStream) -> io::Result<Head> {
    let deadline = Instant::now() + REQUEST_TIMEOUT;
    let mut head = Vec::with_capacity(512);
    let mut buf = [0u8; 1024];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        stream.set_read_timeout(Some(left))?;
        let n = match stream.read(&mut buf) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            n => n?,
        };
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        head.extend_from_slice(&buf[..n]);
        let end = head.windows(4).position(|w| w == b"\r\n\r\n").or_else(|| head.windows(2).position(|w| w == b"\n\n"));
        if let Some(end) = end.filter(|&end| end <= REQUEST_LIMIT) {
            let text = String::from_utf8_lossy(&head[..end]);
            return Ok(Head::Request(text.lines().next().unwrap_or("").trim().to_owned()));
        }
        if head.len() > REQUEST_LIMIT {
            return Ok(Head::TooLarge);
        }
    }
}

/// The whole answer to `head`; `render` gives the metrics' text, or `None` if it failed.
fn respond(head: Head, render: impl FnOnce() -> Option<String>) -> Vec<u8> {
    let (status, content_type, body, send_body) = match head {
        Head::TooLarge => ("431 Request Header Fields Too Large", "text/plain", "request too large\n".into(), true),
        Head::Request(line) => {
            let mut words = line.split_whitespace();
            let (method, target, version) = (words.next(), words.next(), words.next());
            let path = target.map(|t| t.split('?').next().unwrap_or(t));
            match (method, path, version) {
                (Some(method), Some(path), Some(version)) if version.starts_with("HTTP/") => {
                    let head_only = method == "HEAD";
                    if method != "GET" && !head_only {
                        ("405 Method Not Allowed", "text/plain", "only GET\n".into(), true)
                    } else if path != PATH {
                        ("404 Not Found", "text/plain", format!("not found; the metrics are at {PATH}\n"), !head_only)
                    } else {
                        match render() {
                            Some(text) => ("200 OK", CONTENT_TYPE, text, !head_only),
                            None => ("500 Internal Server Error", "text/plain", "cannot render\n".into(), !head_only),
                        }
                    }
                }
                _ => ("400 Bad Request", "text/plain", "bad request\n".into(), true),
            }
        }
    };
    let mut response = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    if send_body {
        response.extend_from_slice(body.as_bytes());
    }
    response
}

/// Writes all of `bytes` before `deadline` and shuts the writing side down, so that a peer that
/// reads slowly holds the worker no longer.
fn write_within(stream: &mut TcpStream, mut bytes: &[u8], deadline: Instant) -> io::Result<()> {
    while !bytes.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        stream.set_write_timeout(Some(left))?;
        match stream.write(bytes) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => bytes = &bytes[n..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    stream.shutdown(Shutdown::Write)
}

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

/// `GET /metrics` from `addr` over plain HTTP/1.1, with `timeout` to connect and for each read
/// and write; the body of a 200 answer, or an error that names the address.
pub fn scrape(addr: SocketAddr, timeout: Duration) -> Result<String> {
    let url = format!("http://{addr}{PATH}");
    let fetch = || -> Result<String> {
        let mut stream = TcpStream::connect_timeout(&addr, timeout).context("cannot connect")?;
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))?;
        let request = format!("GET {PATH} HTTP/1.1\r\nHost: {addr}\r\nAccept: text/plain\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).context("cannot send the request")?;
        let mut response = Vec::new();
        stream.take(RESPONSE_LIMIT).read_to_end(&mut response).context("cannot read the answer")?;
        let end = response.windows(4).position(|w| w == b"\r\n\r\n").context("an answer without a header end")?;
        let head = String::from_utf8_lossy(&response[..end]).into_owned();
        let mut body = &response[end + 4..];
        let status = head.lines().next().unwrap_or("");
        if status.split_whitespace().nth(1) != Some("200") {
            bail!("answered {status:?}");
        }
        let length = head.lines().skip(1).find_map(|line| {
            let (name, value) = line.split_once(':')?;
            name.trim().eq_ignore_ascii_case("content-length").then(|| value.trim().parse::<usize>().ok())?
        });
        if let Some(length) = length {
            if body.len() < length {
                bail!("the answer ended after {} of its {length} bytes", body.len());
            }
            body = &body[..length];
        }
        String::from_utf8(body.to_vec()).context("the answer is not UTF-8")
    };
    fetch().with_context(|| format!("scraping {url}"))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

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

    /// A listener on loopback serving `body`, on a thread of its own.
    fn endpoint(body: &'static str) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || serve(listener, || body.to_owned()));
        addr
    }

    /// Sends `request` raw and returns the whole answer.
    fn raw(addr: SocketAddr, request: &[u8]) -> String {
        let mut stream = TcpStream::connect(addr).unwrap();
        stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let _ = stream.write_all(request);
        let mut answer = String::new();
        let _ = stream.read_to_string(&mut answer);
        answer
    }

    #[test]
    fn a_scrape_gets_the_rendered_text() {
        let addr = endpoint("# TYPE up gauge\nup 1\n");
        let body = scrape(addr, Duration::from_secs(5)).unwrap();
        assert_eq!(body, "# TYPE up gauge\nup 1\n");
        assert_eq!(Exposition::parse(&body).unwrap().sum("up", &[]), 1.0);
        let answer = raw(addr, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer}");
        assert!(answer.contains("\r\nContent-Type: text/plain; version=0.0.4"), "{answer}");
        assert!(answer.contains("\r\nContent-Length: 21\r\n"), "{answer}");
        assert!(answer.contains("\r\nConnection: close\r\n"), "{answer}");
        let head = raw(addr, b"HEAD /metrics?x=1 HTTP/1.0\r\n\r\n");
        assert!(head.starts_with("HTTP/1.1 200 OK\r\n") && head.ends_with("\r\n\r\n"), "{head}");
    }

    #[test]
    fn the_endpoint_refuses_what_is_not_a_scrape() {
        let addr = endpoint("up 1\n");
        assert!(raw(addr, b"GET / HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 404 "));
        assert!(raw(addr, b"POST /metrics HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 405 "));
        assert!(raw(addr, b"hello\r\n\r\n").starts_with("HTTP/1.1 400 "));
        let huge = format!("GET /metrics HTTP/1.1\r\nX: {}\r\n\r\n", "a".repeat(3 * REQUEST_LIMIT));
        assert!(raw(addr, huge.as_bytes()).starts_with("HTTP/1.1 431 "));
        // A peer that never finishes its request is dropped after REQUEST_TIMEOUT ...
        let started = Instant::now();
        let mut slow = TcpStream::connect(addr).unwrap();
        slow.write_all(b"GET /metr").unwrap();
        slow.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut rest = Vec::new();
        let _ = slow.read_to_end(&mut rest);
        assert!(rest.is_empty());
        assert!(started.elapsed() < REQUEST_TIMEOUT + Duration::from_secs(3), "{:?}", started.elapsed());
        // ... and the endpoint goes on answering.
        assert_eq!(scrape(addr, Duration::from_secs(5)).unwrap(), "up 1\n");
    }

    /// A listener on loopback serving `body` and counting its connections, on a thread of its own.
    fn counted_endpoint(body: &'static str) -> (SocketAddr, Arc<ConnectionCounts>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let counts = Arc::new(ConnectionCounts::default());
        let served = Arc::clone(&counts);
        std::thread::spawn(move || serve_counting(listener, || body.to_owned(), &served));
        (addr, counts)
    }

    /// Whether `done` comes true within 5 s.
    fn within_5s(done: impl Fn() -> bool) -> bool {
        let deadline = Instant::now() + Duration::from_secs(5);
        while !done() {
            if Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        true
    }

    #[test]
    fn idle_connections_do_not_delay_a_scrape() {
        // Issue 29, item 5: with 20 idle connections queued, a scrape took 40.3 s.
        let (addr, counts) = counted_endpoint("up 1\n");
        let took = idle_connections_then_scrape(addr, 20, Duration::from_secs(5)).unwrap();
        eprintln!("a scrape with 20 idle connections open took {took:?}");
        assert!(took < Duration::from_secs(1), "a scrape with 20 idle connections open took {took:?}");
        // The scrape evicted the oldest idle connection, as each one past the bound had.
        assert_eq!(counts.get(Outcome::EvictedIdle), (20 + 1 - MAX_CONNECTIONS) as u64, "{counts:?}");
        assert!(within_5s(|| counts.get(Outcome::Answered) == 1), "{counts:?}");
        assert!(counts.most_held() <= MAX_CONNECTIONS, "{counts:?}");
    }

    #[test]
    fn past_the_bound_the_oldest_idle_connection_is_dropped() {
        let (addr, counts) = counted_endpoint("up 1\n");
        let mut silent: Vec<TcpStream> = (0..2 * MAX_CONNECTIONS).map(|_| TcpStream::connect(addr).unwrap()).collect();
        assert!(within_5s(|| counts.get(Outcome::EvictedIdle) == MAX_CONNECTIONS as u64), "{counts:?}");
        assert_eq!(counts.held(), MAX_CONNECTIONS, "{counts:?}");
        // The oldest were closed by the endpoint; the newest are still held.
        let (oldest, newest) = silent.split_at_mut(MAX_CONNECTIONS);
        for (i, stream) in oldest.iter_mut().enumerate() {
            stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let read = stream.read(&mut [0u8; 1]);
            assert!(
                matches!(read, Ok(0)) || read.as_ref().is_err_and(|e| e.kind() == io::ErrorKind::ConnectionReset),
                "connection {i}: {read:?}"
            );
        }
        for (i, stream) in newest.iter_mut().enumerate() {
            stream.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
            let read = stream.read(&mut [0u8; 1]);
            let open =
                read.as_ref().is_err_and(|e| matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut));
            assert!(open, "connection {}: {read:?}", MAX_CONNECTIONS + i);
        }
        // A scrape still answers, and the connections never exceeded the bound.
        assert_eq!(scrape(addr, Duration::from_secs(5)).unwrap(), "up 1\n");
        assert_eq!(counts.get(Outcome::EvictedIdle), MAX_CONNECTIONS as u64 + 1, "{counts:?}");
        assert!(within_5s(|| counts.get(Outcome::Answered) == 1), "{counts:?}");
        assert_eq!(counts.most_held(), MAX_CONNECTIONS, "{counts:?}");
        // The idle ones that are left go when their peers do.
        drop(silent);
        assert!(within_5s(|| counts.held() == 0), "{counts:?}");
        assert_eq!(counts.get(Outcome::Closed), MAX_CONNECTIONS as u64 - 1, "{counts:?}");
    }

    #[test]
    fn a_failed_scrape_names_the_address() {
        // A port nothing listens on: bind one, then let it go.
        let addr = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        let err = format!("{:#}", scrape(addr, Duration::from_secs(5)).unwrap_err());
        assert!(err.contains(&format!("http://{addr}/metrics")), "{err}");
        // Something that answers, but not with the metrics.
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            let mut buf = [0u8; 1024];
            let _ = stream.read(&mut buf);
            let _ = stream.write_all(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n");
        });
        let err = format!("{:#}", scrape(addr, Duration::from_secs(5)).unwrap_err());
        assert!(err.contains(&format!("http://{addr}/metrics")) && err.contains("503"), "{err}");
    }
}
