//! Reading a scenario's text: serde mirrors of the `[cluster]` and `[policy]` tables, the
//! readers of durations and times, what serde cannot check, and where an error is: the
//! `Source` every error is placed in, and `find`, which finds the step and keys whose text
//! holds a span.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt;
use std::num::NonZeroU32;
use std::ops::Range;
use std::time::Duration;

use kv_core::id::MAX_REQUEST_ID_LEN;
use kv_core::{Role, Time};
use kv_sched_adapter::{Config, LoadFailurePolicy, Mode};
use serde::de::{DeserializeOwned, Error as _, IgnoredAny};
use serde::{Deserialize, Deserializer};
use toml::de::{DeTable, DeValue, ValueDeserializer};
use toml::Spanned;

use super::{role_name, ClusterSpec, Event, Expect, Location, Node, Scenario, ScenarioError, Step};

/// Parses and validates a scenario from its text.
pub(super) fn scenario(text: &str) -> Result<Scenario, ScenarioError> {
    Source { text }.scenario()
}

/// A name with where it was written.
type Name = Spanned<String>;

/// A number of seconds or milliseconds, integer or float, with where it was written.
type Number = Spanned<f64>;

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a table")]
pub(super) struct FileHead {
    name: String,
    #[serde(default)]
    cluster: ClusterFile,
    #[serde(default)]
    policy: PolicyFile,
    /// Taken out before and read step by step; declared so that an unknown key's message lists it.
    #[serde(default, rename = "step")]
    _steps: IgnoredAny,
}

/// `[cluster]`; a key left out takes [`ClusterSpec::default`]'s value.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, expecting = "a table")]
pub(super) struct ClusterFile {
    mode: Option<Mode>,
    prefillers: Option<NonZeroU32>,
    decoders: Option<NonZeroU32>,
    prefill_tp: Option<NonZeroU32>,
    decode_tp: Option<NonZeroU32>,
    prefill_pp: Option<NonZeroU32>,
    prefill_block_size: Option<NonZeroU32>,
    decode_block_size: Option<NonZeroU32>,
    num_kv_heads: Option<NonZeroU32>,
    mla: Option<bool>,
    prefill_num_blocks: Option<NonZeroU32>,
    decode_num_blocks: Option<NonZeroU32>,
    step_interval_ms: Option<Number>,
    network_latency_ms: Option<Number>,
    transfer_latency_ms: Option<Number>,
    worker_handoff_ms: Option<Number>,
    #[serde(default)]
    clock_skew_ms: BTreeMap<Name, Number>,
}

/// `[policy]`; a key left out takes [`Config::with_lease`]'s value.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, expecting = "a table")]
pub(super) struct PolicyFile {
    kv_lease_duration_s: Option<Number>,
    heartbeat_interval_s: Option<Number>,
    lease_extension_s: Option<Number>,
    decoder_kv_blocks_ttl_s: Option<Number>,
    push_registration_timeout_s: Option<Number>,
    push_quarantine_s: Option<Number>,
    kv_load_failure_policy: Option<LoadFailurePolicy>,
    early_notification_capacity: Option<usize>,
}

/// A step's `at_s`, read before its event.
const AT_S: &str = "at_s";
/// A step's `do`: the event's name.
const DO: &str = "do";
/// A step's `expect`, read after its event.
const EXPECT: &str = "expect";
/// The keys every step may hold beside its event's.
pub(super) const STEP_KEYS: [&str; 3] = [AT_S, DO, EXPECT];
/// The keys of a step that only waits (or has no `do`): the node its expectations read.
pub(super) const WAIT_KEYS: [&str; 1] = ["node"];

pub(super) fn one() -> u32 {
    1
}

pub(super) fn prefill0() -> Node {
    Node::PREFILL0
}

pub(super) fn decode0() -> Node {
    Node::DECODE0
}

const NANOS_PER_SEC: f64 = 1e9;
const NANOS_PER_MS: f64 = 1e6;

/// `x` units of `nanos_per_unit` nanoseconds, when that is a non-negative, finite number of
/// nanoseconds that fits a `u64`.
fn nanos(x: f64, nanos_per_unit: f64) -> Option<u64> {
    let nanos = (x * nanos_per_unit).round();
    // 2^64 as f64 is exact; anything at or above it does not fit.
    (x.is_finite() && x >= 0.0 && nanos < 18_446_744_073_709_551_616.0).then_some(nanos as u64)
}

fn units<'de, D: Deserializer<'de>>(d: D, nanos_per_unit: f64) -> Result<Duration, D::Error> {
    let x = f64::deserialize(d)?;
    let nanos = nanos(x, nanos_per_unit).ok_or_else(|| D::Error::custom(format!("{x} is no duration")))?;
    Ok(Duration::from_nanos(nanos))
}

pub(super) fn secs<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    units(d, NANOS_PER_SEC)
}

pub(super) fn millis<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    units(d, NANOS_PER_MS)
}

pub(super) fn secs_time<'de, D: Deserializer<'de>>(d: D) -> Result<Time, D::Error> {
    units(d, NANOS_PER_SEC).map(|d| Time::from_nanos(d.as_nanos() as u64))
}

pub(super) fn utf8<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
    String::deserialize(d).map(String::into_bytes)
}

/// The role a node key of an event needs, and what a wrong-role message ends with.
fn role_of(event: &str, key: &str, mode: Mode) -> (Option<Role>, String) {
    let context = format!(" for do = {event:?}");
    match (event, key) {
        ("prefill" | "begin_prefill" | "progress" | "finish_prefill" | "abandon_prefill", "node")
        | ("arrive" | "reject", "from")
        | ("forge", "to") => (Some(Role::Prefill), context),
        ("prefill" | "begin_prefill", "consumer") | ("arrive" | "schedule" | "reject", "node") | ("forge", "from") => {
            (Some(Role::Decode), context)
        }
        // Only the side that posts transfers can have one fail: D's reads, or P's writes.
        ("fail_transfer", "node") => match mode {
            Mode::Pull => (Some(Role::Decode), format!("{context} in pull mode")),
            Mode::Push => (Some(Role::Prefill), format!("{context} in push mode")),
        },
        _ => (None, context),
    }
}

/// The scenario's text, which every error is placed in.
struct Source<'a> {
    text: &'a str,
}

/// Where a span of the text falls in the document.
struct Place {
    step: Option<usize>,
    /// The keys from the step (or the top of the file) down to the one the span is in.
    keys: Vec<String>,
    /// Whether the span is the last key itself rather than its value.
    on_key: bool,
    line_column: Option<(usize, usize)>,
}

impl<'a> Source<'a> {
    fn scenario(&self) -> Result<Scenario, ScenarioError> {
        let mut root = DeTable::parse(self.text).map_err(|e| self.syntax_error(&e))?;
        let steps = root.get_mut().remove("step");
        let head: FileHead = self.de(Spanned::new(root.span(), DeValue::Table(root.into_inner())), None)?;
        let cluster = self.cluster(head.cluster)?;
        let policy = self.policy(head.policy, cluster.mode)?;
        let items = match steps.map(|s| (s.span(), s.into_inner())) {
            None => Vec::new(),
            Some((_, DeValue::Array(items))) => items.into_iter().collect(),
            Some((span, _)) => {
                let text = self.text(&span);
                return Err(self.about(span, format!("must be an array of tables ([[step]]), not {text}")));
            }
        };
        let mut steps: Vec<Step> = Vec::with_capacity(items.len());
        let mut previous = None;
        for item in items {
            let (step, at) = self.step(item, &cluster, previous)?;
            steps.push(step);
            previous = Some(at);
        }
        Ok(Scenario { name: head.name, cluster, policy, steps })
    }

    fn cluster(&self, file: ClusterFile) -> Result<ClusterSpec, ScenarioError> {
        let d = ClusterSpec::default();
        let count = |value: Option<NonZeroU32>, default: u32| value.map_or(default, NonZeroU32::get);
        let millis = |value: &Option<Number>, default: Duration| {
            value.as_ref().map_or(Ok(default), |v| self.duration(v, NANOS_PER_MS))
        };
        let step_interval = millis(&file.step_interval_ms, d.step_interval)?;
        if let (Some(value), true) = (&file.step_interval_ms, step_interval.is_zero()) {
            return Err(self.about(value.span(), format!("must be positive, not {}", self.text(&value.span()))));
        }
        let mut cluster = ClusterSpec {
            mode: file.mode.unwrap_or(d.mode),
            prefillers: count(file.prefillers, d.prefillers),
            decoders: count(file.decoders, d.decoders),
            prefill_tp: count(file.prefill_tp, d.prefill_tp),
            decode_tp: count(file.decode_tp, d.decode_tp),
            prefill_pp: count(file.prefill_pp, d.prefill_pp),
            prefill_block_size: count(file.prefill_block_size, d.prefill_block_size),
            decode_block_size: count(file.decode_block_size, d.decode_block_size),
            num_kv_heads: count(file.num_kv_heads, d.num_kv_heads),
            mla: file.mla.unwrap_or(d.mla),
            prefill_num_blocks: count(file.prefill_num_blocks, d.prefill_num_blocks),
            decode_num_blocks: count(file.decode_num_blocks, d.decode_num_blocks),
            step_interval,
            network_latency: millis(&file.network_latency_ms, d.network_latency)?,
            transfer_latency: millis(&file.transfer_latency_ms, d.transfer_latency)?,
            worker_handoff: millis(&file.worker_handoff_ms, step_interval)?,
            clock_skew: BTreeMap::new(),
        };
        for (name, skew) in &file.clock_skew_ms {
            let node = self.node(name.get_ref(), name.span(), &cluster, None, "")?;
            let nanos = (*skew.get_ref() * NANOS_PER_MS).round();
            // ±2^63 as f64 is exact; anything beyond does not fit an i64.
            if !(-9_223_372_036_854_775_808.0..9_223_372_036_854_775_808.0).contains(&nanos) {
                return Err(self.about(skew.span(), format!("{} is out of range", self.text(&skew.span()))));
            }
            cluster.clock_skew.insert(node, nanos as i64);
        }
        Ok(cluster)
    }

    fn policy(&self, file: PolicyFile, mode: Mode) -> Result<Config, ScenarioError> {
        let secs = |value: &Option<Number>| value.as_ref().map(|v| self.duration(v, NANOS_PER_SEC)).transpose();
        let positive = |value: &Option<Number>, got: Duration, note: &str| match value {
            Some(value) if got.is_zero() => {
                Err(self.about(value.span(), format!("must be positive, not {}{note}", self.text(&value.span()))))
            }
            _ => Ok(got),
        };
        let lease = secs(&file.kv_lease_duration_s)?.unwrap_or(Duration::from_secs(30));
        let d = Config { mode, ..Config::with_lease(positive(&file.kv_lease_duration_s, lease, "")?) };
        let heartbeat = secs(&file.heartbeat_interval_s)?.unwrap_or(d.heartbeat_interval);
        // Zero would have D renew forever without time moving.
        let note = format!(" (the default is kv_lease_duration_s / 6 = {:?})", d.heartbeat_interval);
        let heartbeat = positive(&file.heartbeat_interval_s, heartbeat, &note)?;
        let extension = secs(&file.lease_extension_s)?.unwrap_or(d.lease_extension);
        let ttl = secs(&file.decoder_kv_blocks_ttl_s)?.unwrap_or(d.decoder_kv_blocks_ttl);
        Ok(Config {
            heartbeat_interval: heartbeat,
            lease_extension: extension,
            // D's read margin is no key: it follows the heartbeat cycle these give.
            read_safety_margin: Config::default_read_margin(heartbeat, extension),
            decoder_kv_blocks_ttl: ttl,
            push_registration_timeout: secs(&file.push_registration_timeout_s)?.unwrap_or(ttl),
            push_quarantine: secs(&file.push_quarantine_s)?.unwrap_or(d.push_quarantine),
            kv_load_failure_policy: file.kv_load_failure_policy.unwrap_or(d.kv_load_failure_policy),
            early_notification_capacity: file.early_notification_capacity.unwrap_or(d.early_notification_capacity),
            ..d
        })
    }

    /// Reads one `[[step]]`; `previous` is the previous step's time and where it was written.
    fn step(
        &self,
        item: Spanned<DeValue<'a>>,
        cluster: &ClusterSpec,
        previous: Option<(Time, Range<usize>)>,
    ) -> Result<(Step, (Time, Range<usize>)), ScenarioError> {
        let span = item.span();
        let DeValue::Table(mut fields) = item.into_inner() else {
            let text = self.text(&span);
            return Err(self.about(span, format!("must be a table ([[step]]), not {text}")));
        };
        // `at_s`, `do` and `expect` are every step's; the other keys are its event's.
        let name: Option<Name> = fields.remove(DO).map(|v| self.de(v, None)).transpose()?;
        let expect = fields.remove(EXPECT);
        let at_s: Number = match fields.remove(AT_S) {
            Some(value) => self.de(value, None)?,
            None => return Err(self.about(span, format!("{AT_S} is missing"))),
        };
        let at = Time::from_nanos(self.duration(&at_s, NANOS_PER_SEC)?.as_nanos() as u64);
        if let Some((previous, previous_span)) = &previous {
            if at < *previous {
                let (text, before) = (self.text(&at_s.span()), self.text(previous_span));
                return Err(self.about(at_s.span(), format!("{text} is earlier than the previous step's {before}")));
            }
        }

        let kind = name.as_ref().map_or("wait", |n| n.get_ref().as_str());
        self.check_event(kind, &fields, cluster, (at, &at_s))?;
        // Already checked to name an engine of the cluster.
        let step_node = fields.get("node").and_then(|v| Some((Node::parse(v.get_ref().as_str()?)?, v.span())));
        if kind == "wait" {
            // A step that only waits (or has no `do`) may name the node its expectations read.
            for key in WAIT_KEYS {
                fields.remove(key);
            }
            if let Some((key, _)) = fields.iter().next() {
                let context = name.as_ref().map_or("a step without do".to_owned(), |_| "do = \"wait\"".to_owned());
                let expected = STEP_KEYS.iter().chain(&WAIT_KEYS).copied().collect::<Vec<_>>().join(", ");
                let message = format!("unknown key {:?} for {context} (expected one of: {expected})", key.get_ref());
                return Err(self.invalid(key.span(), |_, _| message));
            }
        } else if matches!(kind, "arrive" | "reject") && !fields.contains_key("remote_request") {
            if let Some(request) = fields.get("request").cloned() {
                fields.insert(Spanned::new(request.span(), Cow::Borrowed("remote_request")), request);
            }
        }
        let mut tagged = DeTable::new();
        let tag = name.as_ref().map_or(span.clone(), Spanned::span);
        tagged
            .insert(Spanned::new(tag, Cow::Owned(kind.to_owned())), Spanned::new(span.clone(), DeValue::Table(fields)));
        let event: Event = self.de(Spanned::new(span, DeValue::Table(tagged)), Some(&format!("do = {kind:?}")))?;
        let expect = expect.map(|e| self.expect(e, cluster, step_node)).transpose()?;
        let event = name.map(|_| event);
        Ok((Step { at, event, expect }, (at, at_s.span())))
    }

    /// What serde cannot check of an event's keys: that nodes are engines of the cluster with
    /// the role the event needs, that request ids fit, and that times and counts make sense.
    fn check_event(
        &self,
        event: &str,
        fields: &DeTable<'_>,
        cluster: &ClusterSpec,
        (at, at_s): (Time, &Number),
    ) -> Result<(), ScenarioError> {
        for (key, value) in fields.iter() {
            let (key, span) = (key.get_ref().as_ref(), value.span());
            let text = self.text(&span);
            match (key, value.get_ref()) {
                ("node" | "from" | "to" | "a" | "b" | "consumer" | "as", DeValue::String(name)) => {
                    let (role, context) = role_of(event, key, cluster.mode);
                    self.node(name, span, cluster, role, &context)?;
                }
                ("request" | "remote_request", DeValue::String(id)) => self.request(id, span)?,
                (_, DeValue::Integer(_) | DeValue::Float(_)) => {
                    let x: Number = self.de(value.clone(), None)?;
                    match key {
                        "until_s" | "for_s" | "by_ms" => {
                            let per_unit = if key == "by_ms" { NANOS_PER_MS } else { NANOS_PER_SEC };
                            let d = self.duration(&x, per_unit)?;
                            if key == "until_s" && Time::from_nanos(d.as_nanos() as u64) < at {
                                let at_text = self.text(&at_s.span());
                                return Err(self.about(span, format!("{text} is earlier than at_s {at_text}")));
                            }
                            if key == "for_s" && d.is_zero() {
                                return Err(self.about(span, format!("must be positive, not {text}")));
                            }
                        }
                        "prompt_tokens" | "n" | "tokens" | "layers" if *x.get_ref() < 1.0 => {
                            return Err(self.about(span, format!("must be at least 1, not {text}")));
                        }
                        "cached_tokens"
                            if *x.get_ref() >= 0.0 && *x.get_ref() % f64::from(cluster.decode_block_size) != 0.0 =>
                        {
                            let block = cluster.decode_block_size;
                            let what =
                                format!("must be a whole number of D blocks (decode_block_size = {block}), not {text}");
                            return Err(self.about(span, what));
                        }
                        _ => {}
                    }
                }
                _ => {}
            }
        }
        if event == "progress" {
            let number = |key| {
                fields.get(key).and_then(|v| Some((v.get_ref().as_integer()?.as_str().parse::<u64>().ok()?, v.span())))
            };
            if let Some((whole, span)) = number("whole_tokens") {
                if !fields.contains_key("layers") {
                    return Err(self.about(span, "goes with layers (a chunk computed layer by layer)"));
                }
                if let Some((tokens, _)) = number("tokens").filter(|&(tokens, _)| whole > tokens) {
                    return Err(self.about(span, format!("must be at most tokens ({tokens}), not {whole}")));
                }
            }
        }
        for (a, b) in [("a", "b"), ("from", "to"), ("to", "as")] {
            let name = |key| fields.get(key).and_then(|v| Some((v.get_ref().as_str()?, v.span())));
            if let (Some((a_name, _)), Some((b_name, span))) = (name(a), name(b)) {
                if a_name == b_name {
                    let message = format!("{a} and {b} are both {a_name:?} for do = {event:?}; they must differ");
                    return Err(self.invalid(span, |_, _| message));
                }
            }
        }
        Ok(())
    }

    /// Reads a step's `expect`; `step_node` is the step's `node` and where it was written.
    fn expect(
        &self,
        value: Spanned<DeValue<'a>>,
        cluster: &ClusterSpec,
        step_node: Option<(Node, Range<usize>)>,
    ) -> Result<Expect, ScenarioError> {
        // serde says what is wrong with an `expect` that is no table, or with a map that is not one.
        for (key, map) in value.get_ref().as_table().into_iter().flatten() {
            for (name, _) in map.get_ref().as_table().into_iter().flatten() {
                let (name, span) = (name.get_ref().as_ref(), name.span());
                let role = match key.get_ref().as_ref() {
                    "p_held_blocks_on" => Role::Prefill,
                    "d_held_blocks_on" => Role::Decode,
                    "p_released" | "d_state" | "d_blocks_read" | "d_tokens_kept" => {
                        self.request(name, span)?;
                        continue;
                    }
                    _ => continue,
                };
                self.node(name, span, cluster, Some(role), "")?;
            }
        }
        let mut expect: Expect = self.de(value, None)?;
        let on_d = [
            ("d_state", expect.d_state.is_empty()),
            ("d_blocks_read", expect.d_blocks_read.is_empty()),
            ("d_tokens_kept", expect.d_tokens_kept.is_empty()),
        ];
        match step_node {
            Some((node, _)) if node.role == Role::Decode => expect.d_node = node,
            Some((node, span)) => {
                if let Some((key, _)) = on_d.iter().find(|(_, empty)| !empty) {
                    let message = format!(
                        "expect.{key} is read on the step's node, and {node} is not a decode engine; \
                         check {key} in a step of its own"
                    );
                    return Err(self.invalid(span, |_, _| message));
                }
            }
            None => {}
        }
        Ok(expect)
    }

    /// Resolves an engine name written at `span` against `cluster`; `role` is the role its use
    /// needs, `context` ends a wrong-role message.
    fn node(
        &self,
        name: &str,
        span: Range<usize>,
        cluster: &ClusterSpec,
        role: Option<Role>,
        context: &str,
    ) -> Result<Node, ScenarioError> {
        let Some(node) = Node::parse(name) else {
            let what = format!("{name:?} is not an engine name (this cluster has {})", cluster.engine_list());
            return Err(self.about(span, what));
        };
        if !cluster.contains(node) {
            let count = match node.role {
                Role::Prefill => "prefillers",
                Role::Decode => "decoders",
            };
            return Err(self.about(span, format!("{name:?} does not exist ({count} = {})", cluster.engines(node.role))));
        }
        match role {
            Some(role) if role != node.role => {
                Err(self.about(span, format!("{name:?} must be a {} engine{context}", role_name(role))))
            }
            _ => Ok(node),
        }
    }

    fn request(&self, id: &str, span: Range<usize>) -> Result<(), ScenarioError> {
        if id.is_empty() {
            return Err(self.about(span, "must not be empty"));
        }
        if id.len() > MAX_REQUEST_ID_LEN {
            return Err(self.about(span, format!("is {} bytes long (at most {MAX_REQUEST_ID_LEN})", id.len())));
        }
        Ok(())
    }

    /// A non-negative, finite number of units of `nanos_per_unit` nanoseconds.
    fn duration(&self, value: &Number, nanos_per_unit: f64) -> Result<Duration, ScenarioError> {
        let (x, span) = (*value.get_ref(), value.span());
        match nanos(x, nanos_per_unit) {
            Some(nanos) => Ok(Duration::from_nanos(nanos)),
            None if !x.is_finite() => Err(self.about(span, format!("must be finite, not {x:?}"))),
            None if x < 0.0 => Err(self.about(span.clone(), format!("must not be negative, not {}", self.text(&span)))),
            None => Err(self.about(span.clone(), format!("{} is too large", self.text(&span)))),
        }
    }

    /// Deserializes `value`; `context` names what is read when the error's place has no key of
    /// its own (a missing field, or an unknown one at the top of a step).
    fn de<T: DeserializeOwned>(&self, value: Spanned<DeValue<'a>>, context: Option<&str>) -> Result<T, ScenarioError> {
        T::deserialize(ValueDeserializer::from(value)).map_err(|e| {
            let message = e.message().trim_end().to_owned();
            self.invalid(e.span().unwrap_or_default(), |keys, on_key| {
                let keys = if on_key { &keys[..keys.len() - 1] } else { keys };
                match (keys.join("."), context) {
                    (subject, _) if !subject.is_empty() => format!("{subject}: {message}"),
                    (_, Some(context)) => format!("{context}: {message}"),
                    (_, None) => message,
                }
            })
        })
    }

    /// An error about the key at `span` (or its value), which `what` completes: "<key> <what>".
    fn about(&self, span: Range<usize>, what: impl fmt::Display) -> ScenarioError {
        self.invalid(span, |keys, on_key| match keys.split_last() {
            Some((_, [])) if on_key => format!("key {what}"),
            Some((_, parent)) if on_key => format!("{} key {what}", parent.join(".")),
            Some(_) => format!("{} {what}", keys.join(".")),
            None => what.to_string(),
        })
    }

    /// An error at `span`, whose message `message` writes from the keys down to it.
    fn invalid(&self, span: Range<usize>, message: impl FnOnce(&[String], bool) -> String) -> ScenarioError {
        let place = self.place(span);
        let message = message(&place.keys, place.on_key);
        let key = (!place.keys.is_empty()).then(|| place.keys.join("."));
        ScenarioError::Invalid {
            location: Location { file: None, step: place.step, key, line_column: place.line_column },
            message,
        }
    }

    fn syntax_error(&self, error: &toml::de::Error) -> ScenarioError {
        let line_column = error.span().map(|span| self.line_column(span.start));
        ScenarioError::Syntax {
            location: Location { line_column, ..Location::default() },
            message: error.message().trim_end().to_owned(),
        }
    }

    /// Finds the step and keys whose text holds `span`, in a fresh parse of the text (the
    /// first one was taken apart to deserialize it).
    fn place(&self, span: Range<usize>) -> Place {
        let mut place = Place { step: None, keys: Vec::new(), on_key: false, line_column: None };
        // An empty span is the document's own (a key missing at the top): no key holds it.
        if span.is_empty() {
            return place;
        }
        place.line_column = Some(self.line_column(span.start));
        let Ok(root) = DeTable::parse(self.text) else { return place };
        let root = Spanned::new(root.span(), DeValue::Table(root.into_inner()));
        place.on_key = find(&root, span.start, &mut place.keys).unwrap_or(false);
        // `step` is the array of steps (anything else is refused before a step is read).
        if let [step, index, ..] = place.keys.as_slice() {
            if let (true, Ok(index)) = (step == "step", index.parse::<usize>()) {
                place.step = Some(index + 1);
                place.keys.drain(..2);
            }
        }
        place
    }

    fn text(&self, span: &Range<usize>) -> &'a str {
        self.text.get(span.clone()).unwrap_or_default().trim()
    }

    fn line_column(&self, offset: usize) -> (usize, usize) {
        let before = self.text.get(..offset).unwrap_or(self.text);
        let line = before.matches('\n').count() + 1;
        let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
        (line, column)
    }
}

/// Pushes onto `path` the way to the deepest key or value whose text holds `at` (keys, and
/// indices of arrays), and says whether that is a key itself; `None` (and `path` as it was)
/// when nothing in `value` holds it.
///
/// Children are searched whether or not the parent's span holds `at`: a `[table]` or
/// `[[array]]` element spans only its header.
fn find(value: &Spanned<DeValue<'_>>, at: usize, path: &mut Vec<String>) -> Option<bool> {
    match value.get_ref() {
        DeValue::Table(table) => {
            for (key, child) in table.iter() {
                path.push(key.get_ref().to_string());
                if key.span().contains(&at) {
                    return Some(true);
                }
                if let Some(on_key) = find(child, at, path) {
                    return Some(on_key);
                }
                path.pop();
            }
        }
        DeValue::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                path.push(i.to_string());
                if let Some(on_key) = find(item, at, path) {
                    return Some(on_key);
                }
                path.pop();
            }
        }
        _ => {}
    }
    value.span().contains(&at).then_some(false)
}
