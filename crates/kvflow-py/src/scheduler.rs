//! An engine's scheduler side, for the process that runs vLLM's scheduler: P's or D's
//! scheduler from kv-sched-adapter. Its commands for the ranks and the ranks' reports cross
//! as JSON (the serde forms of `PrefillCommand`, `DecodeReport`, ...), since vLLM's workers
//! are processes of their own; the handoff (`RemoteRef`) is one JSON object, as it travels in
//! `kv_transfer_params`.

use kv_core::side::ClusterKey;
use kv_core::{BlockId, EngineId, Handshake, PeerAddress, Prompt, RequestId, Time};
use kv_sched_adapter::{
    Arrival, Config, Consumer, DecodeEvent, DecodeScheduler as Decode, LayerProgress, PrefillEngine, PrefillEvent,
    PrefillScheduler as Prefill, RemoteRef, TransferParams,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::IntoPyObjectExt;
use serde::de::DeserializeOwned;
use serde::Serialize;

/// A `ValueError` that says `what` failed and why.
pub(crate) fn refuse(what: &str, why: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(format!("{what}: {why}"))
}

/// `T` from JSON text; the error names `what`.
pub(crate) fn from_json<T: DeserializeOwned>(what: &str, text: &str) -> PyResult<T> {
    serde_json::from_str(text).map_err(|e| refuse(what, e))
}

/// `value` as JSON text.
pub(crate) fn to_json(value: &impl Serialize) -> PyResult<String> {
    serde_json::to_string(value).map_err(|e| refuse("serializing", e))
}

/// The connector's settings from vLLM's whole `kv_transfer_config` (JSON text).
pub(crate) fn config(kv_transfer_config: &str) -> PyResult<Config> {
    crate::config::parse(kv_transfer_config).map(|(_, config, _)| config)
}

/// The prompt of `prompt_tokens` tokens whose ids are `token_ids`, where the engine has them
/// (a prompt of embeddings has none); ids that are not the prompt's count are not trusted as
/// its digest.
fn prompt(prompt_tokens: u64, token_ids: Option<Vec<u32>>) -> Prompt {
    match token_ids {
        Some(ids) if ids.len() as u64 == prompt_tokens => Prompt::of_tokens(&ids),
        _ => Prompt::len_only(prompt_tokens),
    }
}

fn blocks(ids: Vec<u32>) -> Vec<BlockId> {
    ids.into_iter().map(BlockId).collect()
}

/// An event of a scheduler, as Python takes it: `("to_rank", (rank, command_json))`,
/// `("free", (request, blocks[, reason]))` or `("ended", (request, state))`.
type Event = (&'static str, Py<PyAny>);

/// The event `name` with its `fields`.
fn event<'py, T: IntoPyObject<'py>>(py: Python<'py>, name: &'static str, fields: T) -> PyResult<Event> {
    let fields = fields.into_bound_py_any(py)?;
    Ok((name, fields.unbind()))
}

/// Block ids as Python takes them.
fn ids(blocks: &[BlockId]) -> Vec<u32> {
    blocks.iter().map(|b| b.0).collect()
}

/// P's scheduler: exports a finished prompt's blocks to every rank, and says when every rank
/// released them; in push mode it also passes a chunked prefill's progress to the ranks, which
/// write what is computed ahead of the export.
#[pyclass(module = "kvflow._kvflow")]
pub struct PrefillScheduler {
    inner: Prefill,
    /// The cluster key P vouches for its handoffs with (the null key: none).
    key: ClusterKey,
}

#[pymethods]
impl PrefillScheduler {
    /// The scheduler of the engine whose rank 0 offers `offer` (its wire bytes: `Rank.offer()`)
    /// and whose ranks' side channels listen at `addresses`, in rank order, vouching for its
    /// handoffs under the cluster key `key` names (`("file", path)` or `("env", name)`; none:
    /// no vouch, and D reads only once P answered its claim).
    #[new]
    #[pyo3(signature = (offer, addresses, kv_transfer_config, key=None))]
    fn new(
        offer: &[u8],
        addresses: Vec<String>,
        kv_transfer_config: &str,
        key: Option<(String, String)>,
    ) -> PyResult<Self> {
        let offer = Handshake::decode(offer).map_err(|e| refuse("offer", e))?;
        let addresses = addresses.into_iter().map(PeerAddress).collect();
        let inner = Prefill::new(&offer, addresses, config(kv_transfer_config)?).map_err(|e| refuse("scheduler", e))?;
        Ok(PrefillScheduler { inner, key: crate::config::cluster_key(key)? })
    }

    /// P's `kv_transfer_params` for a handoff (`remote`, JSON, as `finished` gives it) of
    /// blocks of `block_size` tokens: kvflow's form, vouched for under the cluster key, and
    /// NixlConnector's fields beside it (JSON).
    fn handoff_answer(&self, remote: &str, block_size: u32) -> PyResult<String> {
        let remote: RemoteRef = from_json("remote", remote)?;
        to_json(&TransferParams::answer(&remote, block_size, &self.key))
    }

    /// Request `request` finished its prompt of `prompt_tokens` tokens (whose ids are
    /// `token_ids`, where the engine has them) at `now_ns` (`now_ns()`, the host clock) in
    /// `blocks`: export them, bound to `consumer` (engine, incarnation) if the router named
    /// one; returns the handoff for D, one JSON object. P's ranks lend the blocks only to a
    /// claim that names this prompt.
    #[pyo3(signature = (now_ns, request, blocks, prompt_tokens, token_ids=None, consumer=None))]
    fn finished(
        &mut self,
        now_ns: u64,
        request: &str,
        blocks: Vec<u32>,
        prompt_tokens: u64,
        token_ids: Option<Vec<u32>>,
        consumer: Option<(String, u64)>,
    ) -> PyResult<String> {
        let consumer = consumer.map(|(engine, instance)| Consumer { engine: EngineId::new(engine), instance });
        let remote = self
            .inner
            .handle_finished(
                Time::from_nanos(now_ns),
                RequestId::new(request),
                self::blocks(blocks),
                prompt(prompt_tokens, token_ids),
                consumer,
            )
            .map_err(|e| refuse("finished", e))?;
        to_json(&remote)
    }

    /// Push, a chunked prefill computed layer by layer: request `request` has `blocks` (all
    /// of them so far, in prompt order, each call extending the last), of which the first
    /// `whole` are computed in every model layer and the rest in layers `0..layers` (0: the
    /// chunk is about to be computed). From the first call until the request's `free` event
    /// or its export, the blocks are the connector's: a request given up calls `abandoned`.
    #[pyo3(signature = (request, blocks, whole, layers, consumer=None))]
    fn layer_progress(
        &mut self,
        request: &str,
        blocks: Vec<u32>,
        whole: usize,
        layers: u32,
        consumer: Option<(String, u64)>,
    ) -> PyResult<()> {
        let consumer = consumer.map(|(engine, instance)| Consumer { engine: EngineId::new(engine), instance });
        let part = LayerProgress { whole, layers };
        self.inner
            .handle_layer_progress(RequestId::new(request), self::blocks(blocks), part, consumer)
            .map_err(|e| refuse("layer_progress", e))
    }

    /// The engine gave up `request` (aborted, preempted) after `layer_progress` reported it:
    /// its blocks come back as a `free` event (reason `aborted`) once no rank writes from them.
    fn abandoned(&mut self, request: &str) -> PyResult<()> {
        self.inner.handle_abandoned(RequestId::new(request)).map_err(|e| refuse("abandoned", e))
    }

    /// Push: `request` is paired with D's leg by `transfer` (NixlPushConnector's
    /// `transfer_id`): D's ranks may name its export by that id. Call before its first
    /// progress report or its export; `unpaired` ends a pairing of a request not exported.
    fn pair(&mut self, request: &str, transfer: &str) -> PyResult<()> {
        self.inner.handle_pairing(RequestId::new(request), RequestId::new(transfer)).map_err(|e| refuse("pair", e))
    }

    /// The engine is done with `request` without exporting it: its pairing, if any, ends.
    fn unpaired(&mut self, request: &str) {
        self.inner.handle_unpaired(&RequestId::new(request));
    }

    /// A report of rank `rank` (JSON, as `Rank.reports()` gives it).
    fn report(&mut self, rank: u32, report: &str) -> PyResult<()> {
        let report = from_json("report", report)?;
        self.inner.handle_report(rank, report).map_err(|e| refuse("report", e))
    }

    /// Every event since the last call, in order.
    fn poll(&mut self, py: Python<'_>) -> PyResult<Vec<Event>> {
        let mut events = Vec::new();
        while let Some(next) = self.inner.poll_event() {
            events.push(match next {
                PrefillEvent::ToWorker { rank, command } => event(py, "to_rank", (rank, to_json(&command)?))?,
                PrefillEvent::Free { request, blocks, reason } => {
                    event(py, "free", (request.as_str(), ids(&blocks), reason.as_str()))?
                }
            });
        }
        Ok(events)
    }
}

/// D's scheduler: tracks requests carrying P's handoff, loads them into the blocks the engine
/// gives, and says how each ended.
#[pyclass(module = "kvflow._kvflow")]
pub struct DecodeScheduler {
    inner: Decode,
    /// The cluster key P's vouches are checked with (the null key: none is taken).
    key: ClusterKey,
}

#[pymethods]
impl DecodeScheduler {
    /// The scheduler of D engine `engine`, of `tp` ranks, checking P's vouches under the
    /// cluster key `key` names (as `PrefillScheduler` takes it; none: no handoff is taken as
    /// vouched for).
    #[new]
    #[pyo3(signature = (engine, tp, kv_transfer_config, key=None))]
    fn new(engine: &str, tp: u32, kv_transfer_config: &str, key: Option<(String, String)>) -> PyResult<Self> {
        let inner =
            Decode::new(EngineId::new(engine), tp, config(kv_transfer_config)?).map_err(|e| refuse("scheduler", e))?;
        Ok(DecodeScheduler { inner, key: crate::config::cluster_key(key)? })
    }

    /// Connect the ranks to P engine `prefill` (JSON: the handoff's `prefill`) ahead of its
    /// first request.
    fn connect(&mut self, prefill: &str) -> PyResult<()> {
        let prefill: PrefillEngine = from_json("prefill", prefill)?;
        self.inner.handle_connect(prefill);
        Ok(())
    }

    /// Request `request`'s `kv_transfer_params` (JSON), in whichever form the router sent
    /// them, for its prompt of `prompt_tokens` tokens (ids `token_ids`, where the engine has
    /// them) in blocks of `block_size` tokens: `("none", None)` when they ask for no remote
    /// prefill, `("ok", remote)` with P's handoff (JSON) to `arrive` with, or `("refused",
    /// (reason, detail))` when this engine cannot use them: counted
    /// (`kvflow_handoffs_refused_total`), and the export they name rejected, so P frees it at
    /// once. The engine then computes the prompt.
    #[pyo3(signature = (request, params, prompt_tokens, token_ids, block_size))]
    fn handoff(
        &mut self,
        py: Python<'_>,
        request: &str,
        params: &str,
        prompt_tokens: u64,
        token_ids: Option<Vec<u32>>,
        block_size: u32,
    ) -> PyResult<(&'static str, Py<PyAny>)> {
        let arrival = Arrival { mode: self.inner.mode(), prompt: prompt(prompt_tokens, token_ids), block_size };
        let resolved = serde_json::from_str::<TransferParams>(params)
            .map_err(|e| kv_sched_adapter::HandoffError {
                reason: kv_sched_adapter::HandoffRefusal::Malformed,
                detail: e.to_string(),
                // A field beside it that does not parse still leaves kvflow's own handoff to
                // reject, so that P frees the export it names at once.
                remote: serde_json::from_str::<serde_json::Value>(params)
                    .ok()
                    .and_then(|mut v| v.get_mut("kvflow").map(serde_json::Value::take))
                    .and_then(|v| serde_json::from_value::<RemoteRef>(v).ok())
                    .map(Box::new),
            })
            .and_then(|params| params.resolve(&arrival, &self.key));
        match resolved {
            Ok(None) => Ok(("none", py.None())),
            Ok(Some(remote)) => Ok(("ok", to_json(&remote)?.into_bound_py_any(py)?.unbind())),
            Err(refused) => {
                self.inner.handle_refused(RequestId::new(request), &refused);
                let fields = (refused.reason.as_str(), refused.detail).into_bound_py_any(py)?;
                Ok(("refused", fields.unbind()))
            }
        }
    }

    /// Request `request`, which vLLM's serving layer refused before admission (submitted aborted,
    /// with a placeholder prompt, so that P's blocks are freed), came with `params` (JSON): the
    /// export they name, if any, is rejected (reason `refused`), whatever the prompt. Returns
    /// whether one was.
    fn reject_unadmitted(&mut self, request: &str, params: &str) -> bool {
        // The placeholder prompt is not checked: only the form matters.
        let arrival = Arrival { mode: self.inner.mode(), prompt: Prompt::len_only(0), block_size: 1 };
        let refused = serde_json::from_str::<TransferParams>(params)
            .ok()
            .and_then(|params| params.refused_before_admission(&arrival, &self.key).ok().flatten());
        if let Some(refused) = &refused {
            self.inner.handle_refused(RequestId::new(request), refused);
        }
        refused.is_some()
    }

    /// Request `request` arrived with P's handoff (`remote`, JSON) and waits for blocks; its
    /// prompt has `prompt_tokens` tokens (the handoff's count if not given) with ids
    /// `token_ids`, which the ranks' claims name.
    #[pyo3(signature = (request, remote, prompt_tokens=None, token_ids=None))]
    fn arrive(
        &mut self,
        request: &str,
        remote: &str,
        prompt_tokens: Option<u64>,
        token_ids: Option<Vec<u32>>,
    ) -> PyResult<()> {
        let remote: RemoteRef = from_json("remote", remote)?;
        let prompt = prompt(prompt_tokens.unwrap_or(remote.prompt_tokens), token_ids);
        self.inner.handle_arrive(RequestId::new(request), remote, prompt).map_err(|e| refuse("arrive", e))
    }

    /// The engine gave `request` its `blocks`, of which the first `cached_blocks` its own prefix
    /// cache holds: load the rest.
    #[pyo3(signature = (request, blocks, cached_blocks=0))]
    fn schedule(&mut self, request: &str, blocks: Vec<u32>, cached_blocks: usize) -> PyResult<()> {
        let request = RequestId::new(request);
        self.inner
            .handle_schedule_cached(request, self::blocks(blocks), cached_blocks)
            .map_err(|e| refuse("schedule", e))
    }

    /// D rejects `request` (P's handoff `remote`) before admission: P is told and frees it.
    fn reject(&mut self, request: &str, remote: &str) -> PyResult<()> {
        let remote: RemoteRef = from_json("remote", remote)?;
        self.inner.handle_reject(RequestId::new(request), remote).map_err(|e| refuse("reject", e))
    }

    /// The engine aborted `request`.
    fn abort(&mut self, request: &str) {
        self.inner.handle_abort(&RequestId::new(request));
    }

    /// Where `request` stands (`waiting`, `loading`, `ready`, ...), if D knows it.
    fn state(&self, request: &str) -> Option<&'static str> {
        self.inner.state(&RequestId::new(request)).map(|state| state.as_str())
    }

    /// A report of rank `rank` (JSON, as `Rank.reports()` gives it).
    fn report(&mut self, rank: u32, report: &str) -> PyResult<()> {
        let report = from_json("report", report)?;
        self.inner.handle_report(rank, report).map_err(|e| refuse("report", e))
    }

    /// Every event since the last call, in order.
    fn poll(&mut self, py: Python<'_>) -> PyResult<Vec<Event>> {
        let mut events = Vec::new();
        while let Some(next) = self.inner.poll_event() {
            events.push(match next {
                DecodeEvent::ToWorker { rank, command } => event(py, "to_rank", (rank, to_json(&command)?))?,
                DecodeEvent::Ended { request, state, .. } => event(py, "ended", (request.as_str(), state.as_str()))?,
                DecodeEvent::Free { request, blocks } => event(py, "free", (request.as_str(), ids(&blocks)))?,
            });
        }
        Ok(events)
    }
}
