//! A run with a real model (`--model tiny-llama`): the requests of the workload and the ids
//! each was sent as, the reference (every request in one engine at TP 1, `kvflow-node
//! --one-engine`, run once the engines have stopped), and what the report says of the tokens:
//! D's against one engine's, the prompt's KV against one engine's, the control decoded from
//! zeroed KV, and the time to the first token and per output token.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::{json, Value};

use super::Demo;
use crate::proto::{OneEngineJob, OneEngineRun};

/// A request of the workload: its prompt, and the ids it was sent as (again after a loss).
pub(super) struct ModelRequest {
    pub(super) prompt_ids: Vec<u32>,
    pub(super) sent_as: Vec<String>,
}

impl ModelRequest {
    pub(super) fn new(prompt_ids: Vec<u32>) -> Self {
        ModelRequest { prompt_ids, sent_as: Vec::new() }
    }
}

/// One request as the report shows it.
struct Row {
    request: String,
    prompt_ids: Vec<u32>,
    /// D's tokens (P's first, then D's), from the send that ended `ok`; and the control.
    generated: Option<Vec<u32>>,
    zeroed: Option<Vec<u32>>,
    one_engine: Option<Vec<u32>>,
    /// D's and one engine's fingerprints of the prompt's KV.
    kv: Option<u64>,
    one_engine_kv: Option<u64>,
    /// From the router's submit to D holding the KV and P's first token; D's decode per token.
    ttft_us: Option<u64>,
    tpot_us: Option<u64>,
    one_engine_ttft_us: Option<u64>,
    one_engine_tpot_us: Option<u64>,
    sends: usize,
}

/// What a run with a model showed.
pub(super) struct ModelReport {
    rows: Vec<Row>,
    /// The smallest lead of a greedy choice: P's first tokens, D's, and one engine's.
    min_logit_margin: f32,
    /// Why the reference could not run, if it could not.
    reference_failed: Option<String>,
}

impl Demo {
    /// Runs the reference of `model` (the one the engines ran) and compares: what the report
    /// says of the model's tokens.
    pub(super) fn model_report(&self, model: crate::proto::EngineModel) -> ModelReport {
        let job = OneEngineJob {
            model,
            chunk_tokens: self.config.prefill_chunk_tokens,
            block_tokens: self.config.model.block_tokens,
            save_model: self.config.engine_model.as_ref().and_then(|m| m.save_dir.clone()),
            requests: self.model_requests.iter().map(|(id, r)| (id.clone(), r.prompt_ids.clone())).collect(),
        };
        self.progress.set_message("one engine computes every request");
        let (reference, reference_failed) = match self.one_engine(&job) {
            Ok(runs) => (runs.into_iter().map(|r| (r.id.clone(), r)).collect(), None),
            Err(err) => (BTreeMap::new(), Some(format!("{err:#}"))),
        };
        ModelReport::new(self, &reference, model.generate, reference_failed)
    }
}

impl ModelReport {
    fn new(
        demo: &Demo,
        reference: &BTreeMap<String, OneEngineRun>,
        generate: u32,
        reference_failed: Option<String>,
    ) -> Self {
        let mut min_logit_margin = f32::INFINITY;
        let mut rows = Vec::new();
        for (request, sent) in &demo.model_requests {
            // The send whose KV D decoded from.
            let done = sent
                .sent_as
                .iter()
                .filter_map(|id| Some((id, demo.tracks.get(id)?)))
                .find(|(_, t)| t.outcome.as_deref() == Some("ok") && t.generated.is_some());
            let mut row = Row {
                request: request.clone(),
                prompt_ids: sent.prompt_ids.clone(),
                generated: None,
                zeroed: None,
                one_engine: None,
                kv: None,
                one_engine_kv: None,
                ttft_us: None,
                tpot_us: None,
                one_engine_ttft_us: None,
                one_engine_tpot_us: None,
                sends: sent.sent_as.len(),
            };
            if let Some((_, track)) = done {
                let generated = track.generated.as_ref().expect("found");
                min_logit_margin = min_logit_margin.min(generated.min_margin);
                if let Some(first) = track.first {
                    min_logit_margin = min_logit_margin.min(first.margin);
                }
                row.generated = Some(generated.ids.clone());
                row.zeroed = Some(generated.zeroed_ids.clone());
                row.kv = Some(generated.kv_fingerprint);
                row.ttft_us = track.submitted_at_ns.map(|at| generated.first_at_ns.saturating_sub(at) / 1000);
                row.tpot_us = Some(generated.decode_ns / u64::from(generate.max(1)) / 1000);
            }
            if let Some(run) = reference.get(request) {
                min_logit_margin = min_logit_margin.min(run.min_margin);
                row.one_engine = Some(run.ids.clone());
                row.one_engine_kv = Some(run.kv_fingerprint);
                row.one_engine_ttft_us = Some(run.prefill_ns / 1000);
                row.one_engine_tpot_us = Some(run.decode_ns / u64::from(generate.max(1)) / 1000);
            }
            rows.push(row);
        }
        ModelReport { rows, min_logit_margin, reference_failed }
    }

    /// Every request D decoded, and each equal to one engine's tokens.
    fn tokens_equal_one_engine(&self) -> bool {
        !self.rows.is_empty() && self.rows.iter().all(|r| r.generated.is_some() && r.generated == r.one_engine)
    }

    /// Requests whose prompt KV D held differs from one engine's: corrupt reads.
    pub(super) fn kv_differs(&self) -> usize {
        self.rows.iter().filter(|r| r.kv.is_some() && r.one_engine_kv.is_some() && r.kv != r.one_engine_kv).count()
    }

    fn distinct_sequences(&self) -> usize {
        self.rows.iter().filter_map(|r| r.generated.as_ref()).collect::<BTreeSet<_>>().len()
    }

    /// Every request D decoded gives other tokens from zeroed KV.
    fn control_all_differ(&self) -> bool {
        self.rows.iter().all(|r| r.generated.is_some() && r.zeroed != r.generated)
    }

    /// The medians of the time to the first token and per output token, in µs: one engine's,
    /// then P's and D's.
    fn medians(&self) -> [u64; 4] {
        let median = |values: Vec<u64>| crate::stats::quantile(&values, 0.5).unwrap_or(0);
        [
            median(self.rows.iter().filter_map(|r| r.one_engine_ttft_us).collect()),
            median(self.rows.iter().filter_map(|r| r.one_engine_tpot_us).collect()),
            median(self.rows.iter().filter_map(|r| r.ttft_us).collect()),
            median(self.rows.iter().filter_map(|r| r.tpot_us).collect()),
        ]
    }

    /// The checks it failed, in words.
    pub(super) fn failures(&self) -> Vec<String> {
        let mut f = Vec::new();
        if let Some(why) = &self.reference_failed {
            f.push(format!("the one-engine reference failed: {why}"));
        }
        let undecoded: Vec<&str> =
            self.rows.iter().filter(|r| r.generated.is_none()).map(|r| r.request.as_str()).collect();
        if !undecoded.is_empty() {
            f.push(format!("{} requests were never decoded by D: {undecoded:?}", undecoded.len()));
        }
        let differ: Vec<&Row> =
            self.rows.iter().filter(|r| r.generated.is_some() && r.generated != r.one_engine).collect();
        if let Some(first) = differ.first() {
            f.push(format!(
                "{} requests' tokens differ from one engine's; {}: D {:?}, one engine {:?}",
                differ.len(),
                first.request,
                first.generated.as_deref().unwrap_or_default(),
                first.one_engine.as_deref().unwrap_or_default()
            ));
        }
        if self.kv_differs() > 0 {
            f.push(format!("{} requests' prompt KV on D differs from one engine's", self.kv_differs()));
        }
        let decoded = self.rows.iter().filter(|r| r.generated.is_some()).count();
        if self.distinct_sequences() * 10 < decoded * 9 {
            f.push(format!("{} distinct sequences of {decoded} requests: under 90 %", self.distinct_sequences()));
        }
        let same: Vec<&str> = self
            .rows
            .iter()
            .filter(|r| r.generated.is_some() && r.zeroed == r.generated)
            .map(|r| r.request.as_str())
            .collect();
        if !same.is_empty() {
            f.push(format!(
                "decoded from zeroed KV, {same:?} gave the same tokens: they do not depend on the KV moved"
            ));
        }
        f
    }

    /// The `model` object of the report's JSON.
    pub(super) fn json(&self) -> Value {
        let hex = |v: Option<u64>| v.map(|v| format!("{v:016x}"));
        let requests: Vec<Value> = self
            .rows
            .iter()
            .map(|r| {
                json!({
                    "request": r.request,
                    "prompt_ids": r.prompt_ids,
                    "generated_ids": r.generated,
                    "one_engine_ids": r.one_engine,
                    "zeroed_kv_ids": r.zeroed,
                    "kv_fingerprint": hex(r.kv),
                    "one_engine_kv_fingerprint": hex(r.one_engine_kv),
                    "ttft_us": r.ttft_us,
                    "tpot_us": r.tpot_us,
                    "one_engine_ttft_us": r.one_engine_ttft_us,
                    "one_engine_tpot_us": r.one_engine_tpot_us,
                    "sends": r.sends,
                })
            })
            .collect();
        let [one_ttft, one_tpot, ttft, tpot] = self.medians();
        json!({
            "requests": requests,
            "tokens_equal_one_engine": self.tokens_equal_one_engine(),
            "kv_equal_one_engine": self.kv_differs() == 0 && self.reference_failed.is_none(),
            "distinct_sequences": self.distinct_sequences(),
            "control_zeroed_kv_all_differ": self.control_all_differ(),
            "min_logit_margin": if self.min_logit_margin.is_finite() { json!(self.min_logit_margin) } else { Value::Null },
            "ttft_us_p50": ttft,
            "tpot_us_p50": tpot,
            "one_engine_ttft_us_p50": one_ttft,
            "one_engine_tpot_us_p50": one_tpot,
            "resent": self.rows.iter().filter(|r| r.sends > 1).count(),
        })
    }

    /// The report's lines about the model.
    pub(super) fn print(&self) {
        let decoded = self.rows.iter().filter(|r| r.generated.is_some()).count();
        let equal = self.rows.iter().filter(|r| r.generated.is_some() && r.generated == r.one_engine).count();
        let [one_ttft, one_tpot, ttft, tpot] = self.medians();
        println!(
            "  model tiny-llama     {decoded} of {} requests decoded by D, {equal} equal to one engine's tokens, KV equal \
             to one engine's for {} ({} resent after a loss)",
            self.rows.len(),
            decoded - self.kv_differs(),
            self.rows.iter().filter(|r| r.sends > 1).count()
        );
        println!(
            "  model checks         {} distinct sequences, control from zeroed KV {}, smallest top-1 margin {:.4}",
            self.distinct_sequences(),
            if self.control_all_differ() { "differs for every request" } else { "GAVE THE SAME TOKENS" },
            self.min_logit_margin
        );
        println!(
            "  model latency        time to first token p50 {:.2} ms, per output token {:.2} ms; one engine alone {:.2} ms, \
             {:.2} ms",
            ttft as f64 / 1e3,
            tpot as f64 / 1e3,
            one_ttft as f64 / 1e3,
            one_tpot as f64 / 1e3
        );
        if let Some(why) = &self.reference_failed {
            println!("  one engine FAILED    {why}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A request D decoded as one engine did (`differs` changes D's third token), whose
    /// control from zeroed KV gave other tokens (unless `same_control`).
    fn row(request: &str, seed: u32, differs: bool, same_control: bool) -> Row {
        let ids: Vec<u32> = (0..17).map(|i| seed * 100 + i).collect();
        let mut generated = ids.clone();
        if differs {
            generated[2] += 1;
        }
        let zeroed = if same_control { generated.clone() } else { vec![7; 17] };
        Row {
            request: request.into(),
            prompt_ids: vec![1, 2, 3],
            generated: Some(generated),
            zeroed: Some(zeroed),
            one_engine: Some(ids),
            kv: Some(u64::from(seed)),
            one_engine_kv: Some(u64::from(seed)),
            ttft_us: Some(1000),
            tpot_us: Some(100),
            one_engine_ttft_us: Some(900),
            one_engine_tpot_us: Some(90),
            sends: 1,
        }
    }

    fn report(rows: Vec<Row>) -> ModelReport {
        ModelReport { rows, min_logit_margin: 0.01, reference_failed: None }
    }

    #[test]
    fn a_run_whose_tokens_and_kv_are_one_engine_s_passes() {
        let r = report((0..20).map(|i| row(&format!("req-{i}"), i, false, false)).collect());
        assert_eq!(r.failures(), Vec::<String>::new());
        let json = r.json();
        assert_eq!(json["tokens_equal_one_engine"], true);
        assert_eq!(json["distinct_sequences"], 20);
        assert_eq!(json["control_zeroed_kv_all_differ"], true);
        assert_eq!(json["requests"][3]["kv_fingerprint"], "0000000000000003");
    }

    #[test]
    fn each_way_a_model_run_can_go_wrong_fails_it_naming_the_request() {
        let failing = |rows: Vec<Row>, expected: &str| {
            let r = report(rows);
            let failures = r.failures().join("; ");
            assert!(failures.contains(expected), "{failures:?} does not say {expected:?}");
        };
        let fine = |n: u32| (0..n).map(|i| row(&format!("req-{i}"), i, false, false));
        // A token D decoded differs from one engine's.
        failing(fine(19).chain([row("req-19", 19, true, false)]).collect(), "1 requests' tokens differ");
        // The prompt's KV on D is not one engine's.
        let mut kv = row("req-19", 19, false, false);
        kv.kv = Some(99);
        let r = report(fine(19).chain([kv]).collect());
        assert_eq!(r.kv_differs(), 1);
        assert!(r.failures().join("; ").contains("prompt KV on D differs"));
        // Decoded from zeroed KV, the same tokens: they did not depend on what moved.
        failing(fine(19).chain([row("req-19", 19, false, true)]).collect(), "[\"req-19\"] gave the same tokens");
        // A request never decoded (lost three times).
        let mut lost = row("req-19", 19, false, false);
        (lost.generated, lost.zeroed, lost.sends) = (None, None, 3);
        failing(fine(19).chain([lost]).collect(), "never decoded by D: [\"req-19\"]");
        // Too few distinct sequences: 10 requests, 2 sequences.
        failing((0..10).map(|i| row(&format!("req-{i}"), i % 2, false, false)).collect(), "2 distinct sequences of 10");
        // The reference did not run.
        let mut r = report(fine(20).collect());
        r.reference_failed = Some("kvflow-node --one-engine exited with 1".into());
        assert!(r.failures().join("; ").contains("one-engine reference failed"));
    }
}
