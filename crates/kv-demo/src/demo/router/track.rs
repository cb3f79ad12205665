//! What the router keeps of each export: where it went, how it ended, and its timings.

use crate::proto::{Choice, Generated};

/// One export (P's request id, which D's request shares): where it went and how it ended.
#[derive(Default, Debug)]
pub(in crate::demo) struct Track {
    pub(in crate::demo) parent: String,
    pub(in crate::demo) decode: Option<(String, u64)>,
    /// When the router sent the request (to P, and in push mode to D first).
    pub(in crate::demo) submitted_at_ns: Option<u64>,
    pub(in crate::demo) finished_at_ns: Option<u64>,
    pub(in crate::demo) outcome: Option<String>,
    pub(in crate::demo) ready_at_ns: Option<u64>,
    /// What D spent on the demo's own scrub checks and prefix-cache fills before the load,
    /// and when that ended.
    pub(in crate::demo) scrub_check_ns: u64,
    pub(in crate::demo) prepared_at_ns: u64,
    pub(in crate::demo) freed: Option<(String, u64)>,
    /// The P incarnation that freed it, and the one that exported it.
    pub(in crate::demo) freed_by: u64,
    pub(in crate::demo) exported_by: u64,
    /// A partial prefix hit: what D's own cache held of it, and what it had to read.
    pub(in crate::demo) partial: Option<Partial>,
    /// Bytes of the completed transfers whose notification named this request.
    pub(in crate::demo) bytes_read: u64,
    /// The longest of its transfers that carried its completion (D's reads, or P's final
    /// writes; not the writes ahead), post to end, in ns: the transfer D's KV waited for.
    pub(in crate::demo) completing_ns: u64,
    /// With a model: P's first token, and what D generated.
    pub(in crate::demo) first: Option<Choice>,
    pub(in crate::demo) generated: Option<Generated>,
}

impl Track {
    /// From P finishing the prompt to D holding its KV, less the part of D's own scrub checks
    /// and prefix-cache fills that fell after P finished (in push mode D does them on arrival,
    /// usually while P still computes).
    pub(in crate::demo) fn kv_latency_ns(&self) -> Option<u64> {
        let (finished, ready) = (self.finished_at_ns?, self.ready_at_ns?);
        let demo_work = self.scrub_check_ns.min(self.prepared_at_ns.saturating_sub(finished));
        Some(ready.saturating_sub(finished).saturating_sub(demo_work))
    }

    /// [`Track::kv_latency_ns`] over its own completing transfer's time ([`Track::completing_ns`]):
    /// how much longer D waited than the bytes took, whatever the request's size.
    pub(in crate::demo) fn kv_over_transfer(&self) -> Option<f64> {
        let transfer = self.completing_ns;
        (transfer > 0).then_some(self.kv_latency_ns()? as f64 / transfer as f64)
    }

    /// From the router submitting the request to D holding its KV (what time to first token
    /// feels), less the same demo work as [`Track::kv_latency_ns`].
    pub(in crate::demo) fn submit_to_kv_ns(&self) -> Option<u64> {
        let (submitted, finished) = (self.submitted_at_ns?, self.finished_at_ns?);
        Some(finished.saturating_sub(submitted) + self.kv_latency_ns()?)
    }
}

/// A request D's own prefix cache partly held when it arrived.
#[derive(Clone, Copy, Debug)]
pub(in crate::demo) struct Partial {
    /// D blocks the prompt spans.
    pub(in crate::demo) blocks: usize,
    /// Of those, the first ones D's cache held.
    pub(in crate::demo) cached: usize,
    /// Tokens per D block.
    pub(in crate::demo) block_tokens: u32,
    /// Bytes of one D block over all of that engine's ranks.
    pub(in crate::demo) block_bytes: u64,
}

impl Partial {
    /// D blocks it had to read: those its cache did not hold.
    pub(in crate::demo) fn needed(&self) -> usize {
        self.blocks - self.cached
    }

    /// D blocks the bytes read cover (the last one may be clipped to the prompt).
    pub(in crate::demo) fn read(&self, bytes: u64) -> u64 {
        bytes.div_ceil(self.block_bytes.max(1))
    }
}
