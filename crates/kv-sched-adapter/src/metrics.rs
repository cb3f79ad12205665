//! The connectors' metrics, through the [`metrics`](https://docs.rs/metrics) facade (feature
//! `metrics`): the engine installs whichever recorder it uses (kvflow-node renders them for
//! Prometheus), and without the feature they cost nothing and pull nothing in.
//!
//! Names follow Prometheus conventions and vLLM's NixlConnector where it has the same metric,
//! with a `kvflow_` prefix (vLLM's `vllm:nixl_xfer_time_seconds` is `kvflow_xfer_time_seconds`):
//! base units (seconds, bytes), counters end in `_total`. Every metric carries the label
//! `engine`; the workers' also `rank`, the TP rank. [`METRICS`] lists them all with their
//! meaning.
//!
//! The schedulers, the workers' [`WorkerDriver`](crate::driver::WorkerDriver) and the machines
//! register their metrics when they are built: install the recorder before building them.
//! Counts a machine keeps in its [`Counters`] reach the recorder when its driver steps.

use crate::common::Counters;
#[cfg(feature = "metrics")]
use kv_core::{CutOffReason, RefusalCause};
use kv_core::{EngineId, Time};
use std::time::Duration;

use crate::config::ReleaseReason;
use crate::decode::DecodeState;
use crate::driver::NotificationStats;

/// What one metric is.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct MetricDoc {
    /// Its name in the exposition.
    pub name: &'static str,
    /// `counter`, `gauge` or `histogram`.
    pub kind: &'static str,
    /// Its labels besides `engine` (and `rank`, on the workers').
    pub labels: &'static [&'static str],
    /// Its meaning (the exposition's HELP).
    pub help: &'static str,
}

const fn doc(name: &'static str, kind: &'static str, labels: &'static [&'static str], help: &'static str) -> MetricDoc {
    MetricDoc { name, kind, labels, help }
}

/// P's releases, by reason.
pub const RELEASES: &str = "kvflow_releases_total";
/// P's exports whose lease ran out (vLLM's `nixl_num_kv_expired_reqs`).
pub const EXPIRED: &str = "kvflow_num_kv_expired_reqs_total";
/// P's exports not yet freed.
pub const EXPORTS_LIVE: &str = "kvflow_exports_live";
/// Blocks an engine holds for the connector.
pub const BLOCKS_HELD: &str = "kvflow_blocks_held";
/// D's loads, by how they ended.
pub const LOADS: &str = "kvflow_loads_total";
/// From P finishing a prompt to D holding its KV.
pub const KV_READY_LATENCY: &str = "kvflow_kv_ready_latency_seconds";
/// Messages counted and dropped, by cause.
pub const IGNORED: &str = "kvflow_ignored_messages_total";
/// Handshakes (and notifications) the side channel refused, and notifications a transport
/// dropped unread past its queue's bounds, by cause.
pub const REFUSED: &str = "kvflow_handshakes_refused_total";
/// Lease renewals P granted.
pub const LEASES_RENEWED: &str = "kvflow_leases_renewed_total";
/// Completions for exports P no longer had.
pub const AFTER_EXPIRY: &str = "kvflow_num_notifications_after_expiry_total";
/// Messages staged before their export.
pub const EARLY_STAGED: &str = "kvflow_early_staged_total";
/// Staged messages evicted or never settled, and held push answers dropped past their bound.
pub const EARLY_EVICTED: &str = "kvflow_early_evicted_total";
/// Block-seconds held for a silent or gone owner.
pub const STRANDED: &str = "kvflow_stranded_block_seconds_total";
/// Loads D did not start because the lease could end first.
pub const READS_FENCED: &str = "kvflow_reads_fenced_total";
/// Reads that ended after the acknowledged deadline.
pub const LATE_READS: &str = "kvflow_late_reads_total";
/// Handoffs D refused, by reason.
pub const HANDOFFS_REFUSED: &str = "kvflow_handoffs_refused_total";
/// Claims that named another prompt or other blocks than P's export.
pub const CLAIMS_REFUSED: &str = "kvflow_claims_refused_total";
/// Push loads whose blocks went into quarantine.
pub const QUARANTINED: &str = "kvflow_quarantined_total";
/// Rejections D could not tell P about.
pub const REJECTIONS_UNSENT: &str = "kvflow_rejections_unsent_total";
/// Transfers posted.
pub const TRANSFERS_POSTED: &str = "kvflow_transfers_posted_total";
/// Transfers that failed (vLLM's `nixl_num_failed_transfers`).
pub const TRANSFERS_FAILED: &str = "kvflow_num_failed_transfers_total";
/// Transfers posted by prepared-list indices.
pub const PREPARED: &str = "kvflow_prepared_transfers_total";
/// Push writes posted ahead of their export.
pub const WRITES_AHEAD: &str = "kvflow_writes_ahead_total";
/// Push writes of some model layers only (a chunk computed layer by layer).
pub const LAYER_WRITES: &str = "kvflow_layer_writes_total";
/// Bytes per transfer (vLLM's `nixl_bytes_transferred`).
pub const BYTES: &str = "kvflow_bytes_transferred";
/// Post to completion, per transfer (vLLM's `nixl_xfer_time_seconds`).
pub const XFER_TIME: &str = "kvflow_xfer_time_seconds";
/// The transport's call to post a transfer, per transfer (vLLM's `nixl_post_time_seconds`).
pub const POST_TIME: &str = "kvflow_post_time_seconds";
/// Notification sends the transport refused (vLLM's `nixl_num_failed_notifications`).
pub const NOTIFICATIONS_FAILED: &str = "kvflow_num_failed_notifications_total";
/// Notifications given up unsent.
pub const NOTIFICATIONS_GIVEN_UP: &str = "kvflow_notifications_given_up_total";
/// Descriptors per transfer (vLLM's `nixl_num_descriptors`).
pub const DESCRIPTORS: &str = "kvflow_num_descriptors";
/// Peers connected now.
pub const PEERS_CONNECTED: &str = "kvflow_peers_connected";
/// Peers lost.
pub const PEERS_LOST: &str = "kvflow_peers_lost_total";
/// Peers the transport cut off.
pub const PEERS_CUT_OFF: &str = "kvflow_peers_cut_off_total";

/// Every metric the connectors record.
pub const METRICS: &[MetricDoc] = &[
    doc(RELEASES, "counter", &["reason"], "P: exports released, by reason (transferred, expired, rejected, aborted, sibling, peer_lost), once per export when every rank has released it"),
    doc(EXPIRED, "counter", &[], "P: exports whose lease ran out before their consumer finished with them"),
    doc(EXPORTS_LIVE, "gauge", &[], "P: exports not yet freed"),
    doc(BLOCKS_HELD, "gauge", &[], "blocks the connector holds: on P for exports (each block once, however many siblings share it), on D for loads in progress, push registrations and quarantine"),
    doc(LOADS, "counter", &["outcome"], "D: requests with P's transfer parameters that reached their final state, by state (ready, failed, recompute, gone: aborted or rejected)"),
    doc(KV_READY_LATENCY, "histogram", &[], "D: seconds from P finishing the prompt to D holding its KV on every rank (P's clock mapped by the handshake's offset)"),
    doc(IGNORED, "counter", &["cause"], "messages counted and dropped, by cause: malformed, unknown (a kind or sender this side never takes), foreign (about an export bound to another engine), unauthenticated, refused (the side channel refused the peer), late (about a request already gone), duplicate"),
    doc(REFUSED, "counter", &["cause"], "handshakes and notifications the side channel refused, by cause (malformed, unauthenticated, version, incompatible, impersonation, stale, overloaded, timeout); overloaded also counts each batch of a peer's notifications that a transport dropped unread because its engine took them in slower than they came"),
    doc(LEASES_RENEWED, "counter", &[], "P: lease renewals granted (one per export a heartbeat renewed)"),
    doc(AFTER_EXPIRY, "counter", &[], "P: completions for exports P no longer had"),
    doc(EARLY_STAGED, "counter", &[], "P: messages that came before their export and were staged"),
    doc(EARLY_EVICTED, "counter", &[], "P: staged messages evicted because the stage was full, or never settled, and push answers dropped past the bound held while P writes"),
    doc(STRANDED, "counter", &[], "P: block-seconds held for an owner that is silent (nothing from it for two heartbeat intervals) or never claimed the export, each rank's blocks counted"),
    doc(READS_FENCED, "counter", &[], "D: loads not started because P's lease could end before the read"),
    doc(LATE_READS, "counter", &[], "D: reads that ended after P's acknowledged deadline, less the margin (failed loads)"),
    doc(
        HANDOFFS_REFUSED,
        "counter",
        &["reason"],
        "D: handoffs it could not use (malformed, incomplete, other_prompt, block_count, block_size, unsupported_form; refused: the engine turned the request away before admission); it computes the prompt as kv_load_failure_policy says, and rejects the export named",
    ),
    doc(
        CLAIMS_REFUSED,
        "counter",
        &[],
        "Claims of an export that named another prompt or other blocks than P computed: P refused them and released the export (P), or heard so (D)",
    ),
    doc(QUARANTINED, "counter", &[], "D: push loads given up whose blocks waited in quarantine"),
    doc(REJECTIONS_UNSENT, "counter", &[], "D: rejections that could not be sent to P (its parameters map onto no P rank)"),
    doc(TRANSFERS_POSTED, "counter", &[], "transfers posted (reads on D, push writes on P)"),
    doc(TRANSFERS_FAILED, "counter", &[], "transfers that failed or were refused"),
    doc(PREPARED, "counter", &[], "transfers posted by prepared-list indices rather than address pairs"),
    doc(WRITES_AHEAD, "counter", &[], "P, push: writes posted while the prompt still computed, from the blocks a chunked prefill had finished"),
    doc(LAYER_WRITES, "counter", &[], "P, push: writes of some model layers only, of a chunk computed layer by layer, and final writes that finish such a chunk"),
    doc(BYTES, "histogram", &[], "bytes per completed transfer"),
    doc(XFER_TIME, "histogram", &[], "seconds from posting a transfer to seeing it complete"),
    doc(POST_TIME, "histogram", &[], "seconds the transport took to accept a transfer (its post call, on the engine's clock)"),
    doc(NOTIFICATIONS_FAILED, "counter", &[], "notification sends the transport refused, each try counted (the driver sends a refused notification again, in order, a bounded number of times within a heartbeat interval)"),
    doc(NOTIFICATIONS_GIVEN_UP, "counter", &[], "notifications given up unsent: out of tries or time, to a peer gone, refused for good, or past the bound of those waiting to be sent again"),
    doc(DESCRIPTORS, "histogram", &[], "descriptors per transfer, before the transport merges contiguous ones"),
    doc(PEERS_CONNECTED, "gauge", &[], "peer ranks connected (handshake completed)"),
    doc(PEERS_LOST, "counter", &[], "peer ranks lost: side channel closed, a newer incarnation handshook, or discovery said the engine is gone"),
    doc(PEERS_CUT_OFF, "counter", &["reason"], "peer ranks the transport cut off, by reason (notification_flood: its notifications outran what the engine takes in, past the transport's bound); each is also lost"),
];

const SECONDS: &[f64] =
    &[0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0];

/// A post is a call that queues work: microseconds, unless the transport stalls.
const POST_SECONDS: &[f64] =
    &[0.000005, 0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.1, 1.0];

/// Bucket bounds for each histogram: seconds from 100 µs to 5 s (vLLM's start at 5 ms, too
/// coarse for transfers on one host), and from 5 µs to 1 s for the post call alone; bytes by
/// powers of four from 4 KiB to 16 GiB, descriptors by powers of four.
pub const HISTOGRAM_BUCKETS: &[(&str, &[f64])] = &[
    (XFER_TIME, SECONDS),
    (POST_TIME, POST_SECONDS),
    (KV_READY_LATENCY, SECONDS),
    (
        BYTES,
        &[
            4096.0,
            16384.0,
            65536.0,
            262144.0,
            1048576.0,
            4194304.0,
            16777216.0,
            67108864.0,
            268435456.0,
            1073741824.0,
            4294967296.0,
            17179869184.0,
        ],
    ),
    (DESCRIPTORS, &[1.0, 4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0]),
];

/// Registers every metric's meaning (and unit) with the installed recorder.
#[cfg(feature = "metrics")]
pub fn describe() {
    for m in METRICS {
        let unit = if m.name.ends_with("_seconds") || m.name.ends_with("_seconds_total") {
            Some(metrics::Unit::Seconds)
        } else if m.name == BYTES {
            Some(metrics::Unit::Bytes)
        } else {
            None
        };
        match (m.kind, unit) {
            ("counter", Some(unit)) => metrics::describe_counter!(m.name, unit, m.help),
            ("counter", None) => metrics::describe_counter!(m.name, m.help),
            ("gauge", _) => metrics::describe_gauge!(m.name, m.help),
            (_, Some(unit)) => metrics::describe_histogram!(m.name, unit, m.help),
            (_, None) => metrics::describe_histogram!(m.name, m.help),
        }
    }
}

/// A P scheduler's metrics.
#[derive(Debug)]
pub(crate) struct PrefillMetrics {
    #[cfg(feature = "metrics")]
    on: imp::Prefill,
}

impl PrefillMetrics {
    pub fn new(engine: &EngineId) -> Self {
        #[cfg(not(feature = "metrics"))]
        let _ = engine;
        PrefillMetrics {
            #[cfg(feature = "metrics")]
            on: imp::Prefill::new(engine),
        }
    }

    /// An export of `blocks` began.
    pub fn exported(&mut self, blocks: &[kv_core::BlockId]) {
        #[cfg(feature = "metrics")]
        self.on.exported(blocks);
        #[cfg(not(feature = "metrics"))]
        let _ = blocks;
    }

    /// An export of `blocks` was freed on every rank, for `reason`.
    pub fn freed(&mut self, blocks: &[kv_core::BlockId], reason: ReleaseReason) {
        #[cfg(feature = "metrics")]
        self.on.freed(blocks, reason);
        #[cfg(not(feature = "metrics"))]
        let _ = (blocks, reason);
    }
}

/// A D scheduler's metrics.
#[derive(Debug)]
pub(crate) struct DecodeMetrics {
    #[cfg(feature = "metrics")]
    on: imp::Decode,
}

impl DecodeMetrics {
    pub fn new(engine: &EngineId) -> Self {
        #[cfg(not(feature = "metrics"))]
        let _ = engine;
        DecodeMetrics {
            #[cfg(feature = "metrics")]
            on: imp::Decode::new(engine),
        }
    }

    /// The blocks D holds for the connector now.
    pub fn held(&self, blocks: usize) {
        #[cfg(feature = "metrics")]
        self.on.held.set(blocks as f64);
        #[cfg(not(feature = "metrics"))]
        let _ = blocks;
    }

    /// D refused a handoff, for `reason`.
    pub fn handoff_refused(&self, reason: &'static str) {
        #[cfg(feature = "metrics")]
        metrics::counter!(HANDOFFS_REFUSED, "engine" => self.on.engine.clone(), "reason" => reason).increment(1);
        #[cfg(not(feature = "metrics"))]
        let _ = reason;
    }

    /// A request reached its final state.
    pub fn ended(&self, state: DecodeState) {
        #[cfg(feature = "metrics")]
        if let Some((_, c)) = self.on.loads.iter().find(|(s, _)| *s == state) {
            c.increment(1);
        }
        #[cfg(not(feature = "metrics"))]
        let _ = state;
    }

    /// A request's KV is in place on every rank, `latency` after P finished its prompt.
    pub fn kv_ready(&self, latency: Duration) {
        #[cfg(feature = "metrics")]
        self.on.latency.record(latency.as_secs_f64());
        #[cfg(not(feature = "metrics"))]
        let _ = latency;
    }
}

/// A worker rank's metrics, kept by its driver: the machine's [`Counters`] as they move, its
/// connected peers, and each transfer.
#[derive(Debug)]
pub(crate) struct WorkerMetrics {
    #[cfg(feature = "metrics")]
    on: imp::Worker,
}

impl WorkerMetrics {
    pub fn new(engine: &EngineId, rank: u32) -> Self {
        #[cfg(not(feature = "metrics"))]
        let _ = (engine, rank);
        WorkerMetrics {
            #[cfg(feature = "metrics")]
            on: imp::Worker::new(engine, rank),
        }
    }

    /// The machine's counters and connected peers now.
    pub fn update(&mut self, counters: &Counters, peers: usize) {
        #[cfg(feature = "metrics")]
        self.on.update(counters, peers);
        #[cfg(not(feature = "metrics"))]
        let _ = (counters, peers);
    }

    /// A transfer was posted (or refused: then `failed` follows).
    pub fn posted(&self) {
        #[cfg(feature = "metrics")]
        self.on.posted.increment(1);
    }

    /// A transfer posted at `posted` ended at `now`: moved `bytes` in `descriptors`, or failed.
    pub fn ended(&self, transfer: &InFlight, now: Time, ok: bool) {
        #[cfg(feature = "metrics")]
        self.on.ended(transfer, now, ok);
        #[cfg(not(feature = "metrics"))]
        let _ = (transfer, now, ok);
    }

    /// The transport took `took` to accept a transfer.
    pub fn post_time(&self, took: Duration) {
        #[cfg(feature = "metrics")]
        self.on.post_time.record(took.as_secs_f64());
        #[cfg(not(feature = "metrics"))]
        let _ = took;
    }

    /// What became of the driver's notifications so far.
    pub fn notifications(&mut self, stats: &NotificationStats) {
        #[cfg(feature = "metrics")]
        self.on.notifications(stats);
        #[cfg(not(feature = "metrics"))]
        let _ = stats;
    }
}

/// A transfer the driver posted, for its metrics when it ends.
#[derive(Clone, Copy, Debug)]
#[cfg_attr(not(feature = "metrics"), allow(dead_code))]
pub(crate) struct InFlight {
    pub posted: Time,
    pub bytes: u64,
    pub descriptors: usize,
}

#[cfg(feature = "metrics")]
mod imp {
    use std::collections::BTreeMap;

    use metrics::{counter, gauge, histogram, Counter, Gauge, Histogram};

    use super::*;

    #[derive(Debug)]
    pub struct Prefill {
        releases: Vec<(ReleaseReason, Counter)>,
        expired: Counter,
        live: Gauge,
        held: Gauge,
        /// How many live exports hold each block (siblings share their prompt's).
        blocks: BTreeMap<kv_core::BlockId, u32>,
        exports: usize,
    }

    impl Prefill {
        pub fn new(engine: &EngineId) -> Self {
            let engine = engine.to_string();
            Prefill {
                releases: ReleaseReason::ALL
                    .iter()
                    .map(|&r| (r, counter!(RELEASES, "engine" => engine.clone(), "reason" => r.as_str())))
                    .collect(),
                expired: counter!(EXPIRED, "engine" => engine.clone()),
                live: gauge!(EXPORTS_LIVE, "engine" => engine.clone()),
                held: gauge!(BLOCKS_HELD, "engine" => engine),
                blocks: BTreeMap::new(),
                exports: 0,
            }
        }

        pub fn exported(&mut self, blocks: &[kv_core::BlockId]) {
            self.exports += 1;
            for &b in blocks {
                *self.blocks.entry(b).or_insert(0) += 1;
            }
            self.set();
        }

        pub fn freed(&mut self, blocks: &[kv_core::BlockId], reason: ReleaseReason) {
            self.exports = self.exports.saturating_sub(1);
            for b in blocks {
                if let Some(n) = self.blocks.get_mut(b) {
                    *n -= 1;
                    if *n == 0 {
                        self.blocks.remove(b);
                    }
                }
            }
            self.set();
            if let Some((_, c)) = self.releases.iter().find(|(r, _)| *r == reason) {
                c.increment(1);
            }
            if reason == ReleaseReason::Expired {
                self.expired.increment(1);
            }
        }

        fn set(&self) {
            self.live.set(self.exports as f64);
            self.held.set(self.blocks.len() as f64);
        }
    }

    #[derive(Debug)]
    pub struct Decode {
        pub engine: String,
        pub held: Gauge,
        pub loads: Vec<(DecodeState, Counter)>,
        pub latency: Histogram,
    }

    impl Decode {
        pub fn new(engine: &EngineId) -> Self {
            let engine = engine.to_string();
            let states = [DecodeState::Ready, DecodeState::Failed, DecodeState::Recompute, DecodeState::Gone];
            Decode {
                engine: engine.clone(),
                held: gauge!(BLOCKS_HELD, "engine" => engine.clone()),
                loads: states
                    .iter()
                    .map(|&s| (s, counter!(LOADS, "engine" => engine.clone(), "outcome" => s.as_str())))
                    .collect(),
                latency: histogram!(KV_READY_LATENCY, "engine" => engine),
            }
        }
    }

    /// How a plain counter reads its value off [`Counters`].
    type Field = fn(&Counters) -> u64;

    /// The worker's handles, and the counters as last recorded.
    #[derive(Debug)]
    pub struct Worker {
        last: Counters,
        ignored: Vec<(&'static str, Counter)>,
        refused: Vec<(RefusalCause, Counter)>,
        cut_off: Vec<(CutOffReason, Counter)>,
        /// Each plain counter, with the field it follows.
        plain: Vec<(Field, Counter)>,
        stranded: Counter,
        pub posted: Counter,
        failed: Counter,
        peers: Gauge,
        bytes: Histogram,
        time: Histogram,
        pub post_time: Histogram,
        descriptors: Histogram,
        notifications_failed: Counter,
        notifications_given_up: Counter,
        /// The driver's notification counts as last recorded.
        last_notifications: NotificationStats,
    }

    impl Worker {
        pub fn new(engine: &EngineId, rank: u32) -> Self {
            let (engine, rank) = (engine.to_string(), rank.to_string());
            let labels = [("engine", engine), ("rank", rank)];
            let with = |key: &'static str, value: &'static str| {
                let mut l: Vec<(&'static str, String)> = labels.to_vec();
                l.push((key, value.to_owned()));
                l
            };
            let plain: [(&'static str, Field); 13] = [
                (LEASES_RENEWED, |c| c.leases_renewed),
                (AFTER_EXPIRY, |c| c.notifications_after_expiry),
                (EARLY_STAGED, |c| c.early_staged),
                (EARLY_EVICTED, |c| c.early_evicted),
                (READS_FENCED, |c| c.reads_fenced),
                (LATE_READS, |c| c.late_reads),
                (CLAIMS_REFUSED, |c| c.claims_refused),
                (QUARANTINED, |c| c.quarantined),
                (REJECTIONS_UNSENT, |c| c.rejections_unsent),
                (PREPARED, |c| c.prepared_reads + c.prepared_writes),
                (WRITES_AHEAD, |c| c.writes_ahead),
                (LAYER_WRITES, |c| c.layer_writes),
                (PEERS_LOST, |c| c.peers_lost),
            ];
            Worker {
                last: Counters::default(),
                ignored: Counters::default()
                    .ignored_by_cause()
                    .iter()
                    .map(|&(cause, _)| (cause, counter!(IGNORED, &with("cause", cause))))
                    .collect(),
                refused: RefusalCause::ALL
                    .iter()
                    .filter(|&&c| c != RefusalCause::Replayed)
                    .map(|&c| (c, counter!(REFUSED, &with("cause", c.as_str()))))
                    .collect(),
                cut_off: CutOffReason::ALL
                    .iter()
                    .map(|&r| (r, counter!(PEERS_CUT_OFF, &with("reason", r.as_str()))))
                    .collect(),
                plain: plain.iter().map(|&(name, field)| (field, counter!(name, &labels))).collect(),
                stranded: counter!(STRANDED, &labels),
                posted: counter!(TRANSFERS_POSTED, &labels),
                failed: counter!(TRANSFERS_FAILED, &labels),
                peers: gauge!(PEERS_CONNECTED, &labels),
                bytes: histogram!(BYTES, &labels),
                time: histogram!(XFER_TIME, &labels),
                post_time: histogram!(POST_TIME, &labels),
                descriptors: histogram!(DESCRIPTORS, &labels),
                notifications_failed: counter!(NOTIFICATIONS_FAILED, &labels),
                notifications_given_up: counter!(NOTIFICATIONS_GIVEN_UP, &labels),
                last_notifications: NotificationStats::default(),
            }
        }

        pub fn notifications(&mut self, now: &NotificationStats) {
            let last = self.last_notifications;
            self.notifications_failed.increment(now.failed.saturating_sub(last.failed));
            self.notifications_given_up.increment(now.given_up.saturating_sub(last.given_up));
            self.last_notifications = *now;
        }

        pub fn update(&mut self, now: &Counters, peers: usize) {
            self.peers.set(peers as f64);
            if *now == self.last {
                return;
            }
            let last = self.last;
            for ((_, c), ((_, new), (_, old))) in
                self.ignored.iter().zip(now.ignored_by_cause().iter().zip(last.ignored_by_cause().iter()))
            {
                c.increment(new.saturating_sub(*old));
            }
            for (cause, c) in &self.refused {
                let i = cause.index();
                c.increment(now.refused_by_cause[i].saturating_sub(last.refused_by_cause[i]));
            }
            for (reason, c) in &self.cut_off {
                let i = reason.index();
                c.increment(now.peers_cut_off[i].saturating_sub(last.peers_cut_off[i]));
            }
            for (field, c) in &self.plain {
                c.increment(field(now).saturating_sub(field(&last)));
            }
            // Whole block-seconds, as the block-milliseconds reach them.
            self.stranded.increment((now.stranded_block_ms / 1000).saturating_sub(last.stranded_block_ms / 1000));
            self.last = *now;
        }

        pub fn ended(&self, transfer: &InFlight, now: Time, ok: bool) {
            if !ok {
                self.failed.increment(1);
                return;
            }
            self.bytes.record(transfer.bytes as f64);
            self.descriptors.record(transfer.descriptors as f64);
            self.time.record(now.saturating_since(transfer.posted).as_secs_f64());
        }
    }
}
