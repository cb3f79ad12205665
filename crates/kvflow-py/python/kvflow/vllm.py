"""kvflow's KV connectors for vLLM's v1 interface, loaded by module path
(``kv_connector="KvflowConnector"`` for pull, ``"KvflowPushConnector"`` for push, with
``kv_connector_module_path="kvflow.vllm"``).

So far: ``kv_role`` ``kv_producer``, ``kv_consumer`` or ``kv_both`` (requests with
``do_remote_decode`` exported, those with ``do_remote_prefill`` loaded), TP sizes whose heads
divide, the layouts ``kvflow.layout`` reads from vLLM's tensors (vLLM's CPU attention, whose
blocks move only whole, so P and D share a block size; FlashAttention's NHD and HND;
FlashInfer's; MLA), in host memory or a GPU's; a layout it cannot describe is refused, and
pipeline parallelism too. The scheduler side runs kvflow's P
or D scheduler (or both), the worker side one TP rank on a NIXL agent (kv_both: a P rank and a
D rank, each on an agent of its own) over vLLM's own KV tensors, registered in place; the
schedulers' commands reach the workers in the connector metadata and their reports come back
in the worker metadata, and each worker tells vLLM which requests it finished sending or
receiving.

D tracks a request from the moment vLLM queues it (``on_new_request``): its ranks claim P's
export and renew the lease while it waits, so a request may wait past the lease. D takes the
handoff in kvflow's form (P's answer passed on) or in NixlConnector's pull form (a router
that rebuilt ``remote_engine_id``, ``remote_host``, ``remote_port``, ``remote_request_id``,
``remote_block_ids`` and ``tp_size`` from it); kvflow's Rust side decides which, and checks it
against the request. Each claim names D's own prompt (its length and its tokens' digest) and
the P blocks it reads, and P lends its KV only to a claim that names what it computed. D
rejects (P frees the export at once) a request vLLM's serving layer refused before admission
and a handoff it cannot use (another prompt, blocks that do not fit it, another block size,
fields that do not parse beside kvflow's handoff), logs a WARNING naming the reason, counts it
(``kvflow_handoffs_refused_total``) and computes the prompt itself; a request aborted while it
waits or loads is aborted at P too, and the blocks of a load in flight go back to vLLM only
once every rank's reads have ended.

In push mode D may learn of a request before P has computed it: the proxy sends it to D and
P at once. D takes kvflow's form (``{"kvflow": {"prefill": {"engine", "addresses", "tp_size",
"pp_size"}, "request": <P's id>, "instance": null, "prompt_tokens", "export": null,
"consumer": null}, "do_remote_prefill": true}``) or NixlPushConnector's (P's
``remote_engine_id``, ``remote_host``, ``remote_port``, ``tp_size``, ``pp_size`` and the
``transfer_id`` vLLM's push proxy gives both legs). D's ranks register its blocks with P's,
naming P's request as the handoff does; P matches it to its export by the id, by the
``transfer_id`` P's leg carried (each leg may run under its own request id), or by the id
without vLLM's random suffix, and writes into them once it has computed the prompt and
checked that D's prompt is the one it computed.

In push mode P also writes while it computes (``kvflow.layerwise``): before each step of a
chunked prefill it reports the step's chunk of each such request to its scheduler, and its
ranks write each layer of that chunk into D's blocks as soon as vLLM's forward has stored it
(``save_kv_layer``), so that the export writes only what is left, with the completion. A
request vLLM aborts or preempts after such a report is given up: its ranks stop writing and
tell D that none will come, and an aborted one's blocks go back to vLLM once no rank reads
them; a preempted one is not exported (D computes it, as its ``kv_load_failure_policy`` says).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import time
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.logger import init_logger

from kvflow import _kvflow as native
from kvflow.config import settings as _settings
from kvflow.layerwise import LayerSender, Progress
from kvflow.layout import describe
from kvflow.nixl import runtime_dir


@dataclasses.dataclass
class KvflowHandshake(KVConnectorHandshakeMetadata):
    offer: bytes
    address: str


@dataclasses.dataclass
class KvflowMetadata(KVConnectorMetadata):
    # The commands of P's scheduler and of D's, for each TP rank.
    prefill: dict[int, list[str]] = dataclasses.field(default_factory=dict)
    decode: dict[int, list[str]] = dataclasses.field(default_factory=dict)
    # P, push: requests given up while vLLM still ran them (preempted, whose blocks vLLM
    # freed at once, or refused a report): their ranks' releases are no finished sends.
    unreported: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class KvflowWorkerMetadata(KVConnectorWorkerMetadata):
    # (role, TP rank, report): the reports of P's ranks ("prefill") and of D's ("decode").
    reports: list[tuple[str, int, str]] = dataclasses.field(default_factory=list)

    def aggregate(self, other: "KvflowWorkerMetadata") -> "KvflowWorkerMetadata":
        return KvflowWorkerMetadata(self.reports + other.reports)


logger = init_logger(__name__)

_PARTS = ("counters", "gauges", "histograms")


@dataclasses.dataclass
class KvflowStats(KVConnectorStats):
    """kvflow's metrics over an interval, from the processes of one engine (its scheduler and
    every worker): each counter's increase, each gauge's latest value and each histogram's
    samples, under a key that names the metric and its labels (``[name, [[label, value],
    ...]]`` as JSON). The metrics are kv-sched-adapter's (``kvflow._kvflow.metric_docs()``)."""

    def __post_init__(self):
        for part in _PARTS:
            self.data.setdefault(part, {})

    def reset(self):
        self.data = {part: {} for part in _PARTS}

    def aggregate(self, other: "KVConnectorStats") -> "KvflowStats":
        counters, gauges, histograms = (self.data[part] for part in _PARTS)
        for key, value in other.data.get("counters", {}).items():
            counters[key] = counters.get(key, 0) + value
        gauges.update(other.data.get("gauges", {}))
        for key, samples in other.data.get("histograms", {}).items():
            histograms.setdefault(key, []).extend(samples)
        return self

    def reduce(self) -> dict[str, int | float]:
        """For vLLM's log line: each counter's increase over its labels, and each histogram's
        count and mean."""
        totals: dict[str, int | float] = collections.Counter()
        for key, value in self.data["counters"].items():
            totals[json.loads(key)[0].removeprefix("kvflow_")] += value
        samples: dict[str, list[float]] = collections.defaultdict(list)
        for key, values in self.data["histograms"].items():
            samples[json.loads(key)[0].removeprefix("kvflow_")].extend(values)
        for name, values in samples.items():
            totals[f"{name}_count"] = len(values)
            totals[f"{name}_mean"] = round(sum(values) / len(values), 6)
        return dict(totals)

    def is_empty(self) -> bool:
        return not any(self.data[part] for part in _PARTS)


def _process_stats() -> KvflowStats | None:
    """What kvflow's metrics in this process did since the last call (whichever connector of
    the process asks first gets it: nothing is counted twice), None if nothing."""
    parts = native.metrics_delta()
    data = {part: {json.dumps([name, sorted(labels)]): value for (name, labels), value in entries} for part, entries in zip(_PARTS, parts)}
    stats = KvflowStats(data=data)
    return None if stats.is_empty() else stats


class KvflowPromMetrics(KVConnectorPromMetrics):
    """kvflow's metrics on vLLM's Prometheus endpoint, as ``vllm:kvflow_...`` (counters end in
    ``_total``), with vLLM's labels (model, engine index), the metric's own (``reason``,
    ``cause``, ``outcome``) and ``rank``, the TP rank of a worker's metric (empty for the
    scheduler's)."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._docs = {name: (kind, labels, text, buckets) for name, kind, labels, text, buckets in native.metric_docs()}
        self._metrics: dict[str, Any] = {}

    def _child(self, key: str, kind: str, engine_idx: int):
        name, labels = json.loads(key)
        doc = self._docs.get(name)
        if doc is None or doc[0] != kind:
            return None
        _, own, text, buckets = doc
        extra = [*own, "rank"]
        metric = self._metrics.get(name)
        if metric is None:
            prom = "vllm:" + (name.removesuffix("_total") if kind == "counter" else name)
            options = {"name": prom, "documentation": f"kvflow: {text}", "labelnames": [*self._labelnames, *extra]}
            if kind == "counter":
                metric = self._counter_cls(**options)
            elif kind == "gauge":
                metric = self._gauge_cls(**options, multiprocess_mode="mostrecent")
            else:
                metric = self._histogram_cls(**options, buckets=buckets) if buckets else self._histogram_cls(**options)
            self._metrics[name] = metric
        values = dict(labels)
        return metric.labels(*self.per_engine_labelvalues[engine_idx], *(values.get(label, "") for label in extra))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        for key, value in transfer_stats_data.get("counters", {}).items():
            if (child := self._child(key, "counter", engine_idx)) is not None:
                child.inc(value)
        for key, value in transfer_stats_data.get("gauges", {}).items():
            if (child := self._child(key, "gauge", engine_idx)) is not None:
                child.set(value)
        for key, samples in transfer_stats_data.get("histograms", {}).items():
            if (child := self._child(key, "histogram", engine_idx)) is not None:
                for sample in samples:
                    child.observe(sample)


def _cluster_key():
    """Where the cluster key is: the file ``KVFLOW_CLUSTER_KEY_FILE`` names (readable by the
    engine's user alone), else the variable ``KVFLOW_CLUSTER_KEY`` itself, else nowhere (the
    side channels then listen on loopback only, and accept peers of the same host)."""
    path = os.environ.get("KVFLOW_CLUSTER_KEY_FILE")
    if path:
        return ("file", path)
    if os.environ.get("KVFLOW_CLUSTER_KEY"):
        return ("env", "KVFLOW_CLUSTER_KEY")
    return None


def _total_kv_heads(vllm_config) -> int | None:
    """The model's KV heads, where vLLM's config says."""
    try:
        return vllm_config.model_config.get_total_num_kv_heads()
    except Exception:  # noqa: BLE001 - a config without a model (tests) has none to say
        return None


def _backend_name(vllm_config) -> str | None:
    """The name of the attention backend vLLM chose, where it says."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backend

        return get_current_attn_backend(vllm_config).get_name()
    except Exception:  # noqa: BLE001 - older or newer vLLM without it: the shapes decide
        return None


def _incarnation(vllm_config) -> int:
    """The start time (ns since the epoch) of the process that runs vLLM's engine core: the
    same for its scheduler and every worker, and later for a restarted engine."""
    backend = vllm_config.parallel_config.distributed_executor_backend
    pid = os.getppid() if backend == "mp" else os.getpid()
    with open(f"/proc/{pid}/stat") as stat:
        ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/stat") as stat:
        boot = next(int(line.split()[1]) for line in stat if line.startswith("btime"))
    hz = os.sysconf("SC_CLK_TCK")
    return boot * 1_000_000_000 + ticks * (1_000_000_000 // hz)


_warned: set[str] = set()


def _warn_once(lines: list[str]) -> None:
    """Logs each of the settings' warnings at WARNING, once per process (the scheduler's and
    the worker's connectors read the same settings)."""
    for line in lines:
        if line not in _warned:
            _warned.add(line)
            logger.warning("kvflow: %s", line)


class _Limited:
    """WARNING lines a client can cause (a handoff refused, say), at most ``per_window`` of a
    kind in ``window`` seconds, as the native side limits its own; the first line after a
    window that left some out says how many."""

    def __init__(self, per_window: int = 5, window: float = 10.0) -> None:
        self.per_window, self.window = per_window, window
        self.books: dict[str, list[float | int]] = {}

    def warning(self, kind: str, message: str, *args: Any) -> None:
        now = time.monotonic()
        start, logged, left_out = self.books.get(kind, (now, 0, 0))
        if now - start >= self.window:
            start, logged = now, 0
        if logged >= self.per_window:
            self.books[kind] = [start, logged, left_out + 1]
            return
        self.books[kind] = [start, logged + 1, 0]
        suffix = f" ({left_out} like it left out before)" if left_out else ""
        logger.warning("kvflow: " + message + suffix, *args)


_limited = _Limited()


def side_channel_port(base: int, dp_index: int) -> int:
    """Where a data-parallel engine's side channel listens: the base port
    (``VLLM_NIXL_SIDE_CHANNEL_PORT``) plus the engine's data-parallel index, as NixlConnector's.
    The engine's TP ranks (and both roles of a kv_both engine) share it: rank 0's worker
    accepts, and hands each connection to the rank its HELLO names; peers dial
    ``host:port/tpRANK``."""
    return base + dp_index


class KvflowConnector(KVConnectorBase_V1):
    """Pull: D reads P's blocks."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        self._config = json.dumps(dataclasses.asdict(transfer))
        self._settings = _settings(transfer)
        _warn_once(self._settings["warnings"])
        self._engine = transfer.engine_id
        self._tp = vllm_config.parallel_config.tensor_parallel_size
        pp = vllm_config.parallel_config.pipeline_parallel_size
        if pp != 1:
            raise ValueError(f"kvflow: the vLLM connector runs at pipeline parallel size 1, not {pp}")
        self._producer = transfer.kv_role in ("kv_producer", "kv_both")
        self._consumer = transfer.kv_role in ("kv_consumer", "kv_both")
        push = self._settings["mode"] == "push"
        self._block_size = vllm_config.cache_config.block_size
        self._model = str(vllm_config.model_config.model)
        self._vllm_config = vllm_config
        # Scheduler side (kv_both: P's scheduler and D's).
        scheduler = role == KVConnectorRole.SCHEDULER
        self._prefill = None
        # D takes P's deadline and named consumer from a handoff only where P vouched for it
        # under the cluster key (without one, D reads once P has answered its claim).
        self._decode = (
            native.DecodeScheduler(self._engine, self._tp, self._config, _cluster_key())
            if self._consumer and scheduler
            else None
        )
        # D: requests tracked since vLLM queued them, each with the export it loads (P's
        # engine, P's request); the tracked request of each export; siblings waiting for
        # another's load of their export (their leader's id); and the tokens of each request
        # that D's own prefix cache holds, from vLLM's last match.
        self._tracked: dict[str, tuple[str, str]] = {}
        self._loading_export: dict[tuple[str, str], str] = {}
        self._followers: dict[str, str] = {}
        self._local_tokens: dict[str, int] = {}
        # P: exports held, and how many were freed, by reason (transferred,
        # expired, rejected, aborted, sibling, peer_lost).
        self._exports: set[str] = set()
        # P, push: the chunks its ranks write layer by layer, and the requests given up whose
        # blocks the connector holds until the scheduler frees them.
        self._progress = Progress(self._block_size) if push and self._producer and scheduler else None
        self._abandoned: set[str] = set()
        # Commands for each rank, until the next metadata carries them.
        self._commands = KvflowMetadata()
        self.freed_by_reason: collections.Counter[str] = collections.Counter()
        # Worker side: this TP rank's P rank and D rank (kv_both: both, on agents of their own).
        self._ranks: dict[str, Any] = {}
        self._pending_reports: list[tuple[str, int, str]] = []
        # P, push: the rank's layer-by-layer writes, and the releases vLLM does not wait for.
        self._push = push
        self._layers: LayerSender | None = None
        self._unreported: set[str] = set()
        # D: each load's blocks, and the blocks of failed loads not yet told to vLLM.
        self._load_blocks: dict[str, list[int]] = {}
        self._invalid: set[int] = set()

    # ---- scheduler side ----

    def set_xfer_handshake_metadata(self, metadata):
        if not self._producer:
            return
        ranks = sorted(metadata.items())
        offer = ranks[0][1].offer
        addresses = [m.address for _, m in ranks]
        self._prefill = native.PrefillScheduler(offer, addresses, self._config, _cluster_key())

    def on_new_request(self, request):
        params = request.kv_transfer_params or {}
        if self._decode is None or not params.get("do_remote_prefill"):
            return
        rid = request.request_id
        # The parameters come from the client, in whichever form its router wrote them
        # (kvflow's own, NixlConnector's pull form or NixlPushConnector's push form): kvflow's
        # Rust side decides what they
        # name and whether they fit this request (its prompt's length and tokens, P's blocks and
        # block size). One that does not is logged, counted and rejected (P frees what it
        # names at once), and the prompt computed here; never an exception in vLLM's scheduler.
        # P lends its KV only to a claim that names the prompt it computed, whatever the
        # handoff said.
        try:
            text = json.dumps(params)
        except (TypeError, ValueError) as error:
            _limited.warning("unserializable", "%s's kv_transfer_params do not serialize (%r): computing it here", rid, error)
            return
        if getattr(request, "abort_immediately", False):
            # vLLM's serving layer refused the request before admission (a render error, a
            # validation) and submits it aborted, with a placeholder prompt, only so that the
            # connector can free P's blocks: D rejects it, and P frees them at once.
            self._decode.reject_unadmitted(rid, text)
            return
        tokens = request.prompt_token_ids
        outcome, value = self._decode.handoff(rid, text, request.num_prompt_tokens, tokens, self._block_size)
        if outcome == "refused":
            reason, detail = value
            _limited.warning("refused", "%s's handoff is refused (%s: %s): computing it here", rid, reason, detail)
            return
        if outcome != "ok":
            return
        remote = value
        parsed = json.loads(remote)
        export = (parsed["prefill"]["engine"], parsed["request"])
        leader = self._loading_export.get(export)
        if leader is not None:
            # Parallel sampling at D (n > 1): vLLM's siblings share one handoff, and one
            # export is read once. The others wait for that load and then take its blocks
            # from vLLM's prefix cache.
            self._followers[rid] = leader
            return
        # D's ranks claim the export, naming this prompt, and renew its lease while it waits.
        try:
            self._decode.arrive(rid, remote, request.num_prompt_tokens, tokens)
        except ValueError as error:
            # (A request id D tracks already, say.) Computed here, never an exception in vLLM.
            _limited.warning("not loaded", "%s is not loaded (%s): computing it here", rid, error)
            return
        self._tracked[rid] = export
        self._loading_export[export] = rid

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        rid = request.request_id
        leader = self._followers.get(rid)
        if leader is not None:
            if leader in self._tracked and self._decode.state(leader) in ("waiting", "loading"):
                return None, False  # Asked again at a later step.
            del self._followers[rid]
            return 0, False
        if rid not in self._tracked or self._decode.state(rid) != "waiting":
            return 0, False
        count = request.num_prompt_tokens - num_computed_tokens
        if count <= 0:
            return 0, False
        self._local_tokens[rid] = num_computed_tokens
        return count, True

    def _pair(self, request) -> None:
        """P, push: a request vLLM's push proxy paired with D's leg by a ``transfer_id`` (each
        leg under its own id, when the proxy forwards no request id): D's ranks name the export
        by it."""
        params = request.kv_transfer_params or {}
        transfer = params.get("transfer_id")
        if self._prefill is None or not self._push or not params.get("do_remote_decode") or transfer is None:
            return
        try:
            self._prefill.pair(request.request_id, str(transfer))
        except ValueError as error:
            _limited.warning("unpaired", "%s is not paired by transfer_id %r: %s", request.request_id, transfer, error)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        rid = request.request_id
        self._pair(request)
        if self._progress is not None:
            self._progress.track(request)
        if num_external_tokens == 0 or rid not in self._tracked:
            return
        block_ids = blocks.get_block_ids()[0]
        needed = math.ceil(request.num_prompt_tokens / self._block_size)
        # The blocks vLLM's prefix cache filled stay as they are; the rest are read.
        cached = self._local_tokens.pop(rid, 0) // self._block_size
        self._decode.schedule(rid, list(block_ids[:needed]), cached)

    def _take_events(self):
        """The schedulers' events since the last call: commands wait for the next metadata,
        P's frees are counted at once."""
        for scheduler in (self._prefill, self._decode):
            if scheduler is None:
                continue
            commands = self._commands.prefill if scheduler is self._prefill else self._commands.decode
            for what, event in scheduler.poll():
                if what == "to_rank":
                    commands.setdefault(event[0], []).append(event[1])
                elif what == "free" and scheduler is self._prefill:
                    self._exports.discard(event[0])
                    self._abandoned.discard(event[0])
                    self.freed_by_reason[event[2]] += 1

    def build_connector_meta(self, scheduler_output):
        if self._progress is not None and self._prefill is not None:
            # This step's chunks, before its forward: the ranks write their layers as vLLM
            # stores them (save_kv_layer).
            abandoned, unreported = self._progress.step(self._prefill, scheduler_output)
            self._abandoned.update(abandoned)
            self._commands.unreported.extend(unreported)
        self._take_events()
        meta, self._commands = self._commands, KvflowMetadata()
        return meta

    def update_connector_output(self, connector_output):
        worker = connector_output.kv_connector_worker_meta
        if not isinstance(worker, KvflowWorkerMetadata):
            return
        for role, rank, report in worker.reports:
            # P's ranks report releases; D's, loads finished or quarantined.
            scheduler = self._prefill if role == "prefill" else self._decode
            if scheduler is not None:
                scheduler.report(rank, report)
        # What the reports made of the schedulers' state shows now, not at the next step.
        self._take_events()

    def request_finished(self, request, block_ids):
        from vllm.v1.request import RequestStatus

        rid = request.request_id
        self._local_tokens.pop(rid, None)
        self._followers.pop(rid, None)
        export = self._tracked.pop(rid, None)
        if export is not None:
            # D: a request that ends while it waits or loads (aborted) is aborted at P too. A
            # load's reads may still land in its blocks: vLLM keeps them until every rank has
            # reported the load over (finished receiving).
            self._loading_export.pop(export, None)
            state = self._decode.state(rid)
            if state in ("waiting", "loading"):
                self._decode.abort(rid)
                return state == "loading", None
            return False, None
        params = request.kv_transfer_params or {}
        if self._prefill is None or not params.get("do_remote_decode"):
            return False, None
        exported = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        if exported:
            self._pair(request)
        else:
            self._prefill.unpaired(rid)
        progress = self._progress.finished(self._prefill, rid, exported) if self._progress is not None else None
        if progress == "abandoned":
            # Aborted while P wrote its chunks ahead: the blocks go back to vLLM once every rank
            # has released it (no write reads them any more).
            self._abandoned.add(rid)
            return True, None
        if progress == "given_up":
            logger.warning("kvflow: %s was preempted while P wrote its KV ahead: not exported (D computes it)", rid)
            self._prefill.unpaired(rid)
            return False, None
        if not exported:
            # An aborted prefill has no KV for D: nothing to export.
            return False, None
        prompt = request.num_prompt_tokens
        blocks = list(block_ids[: math.ceil(prompt / self._block_size)])
        try:
            remote = self._prefill.finished(native.now_ns(), rid, blocks, prompt, request.prompt_token_ids)
        except ValueError as error:
            # (An id that named an export before, say.) No handoff: D computes the prompt.
            logger.error("kvflow: %s is not exported: %s", rid, error)
            if progress == "computing":
                # Its blocks are the connector's since its first chunk went ahead.
                self._prefill.abandoned(rid)
                self._abandoned.add(rid)
                return True, None
            self._prefill.unpaired(rid)
            return False, None
        self._exports.add(rid)
        # kvflow's handoff with NixlConnector's fields beside it, for routers that read or
        # rebuild them (where P's first rank's side channel listens, its request, blocks and
        # TP size), and the prompt's digest, which D checks against its own; vouched for
        # under the cluster key, so that D may read before P answers its claim.
        return True, json.loads(self._prefill.handoff_answer(remote, self._block_size))

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config):
        """HND (vLLM's ``LBHNC``): each head's part of a block contiguous, so a TP slice is
        one range per block and vLLM never picks a layout that interleaves the layers, which
        kvflow does not describe. MLA's single plane needs none."""
        model = vllm_config.model_config
        if model is None or getattr(model, "use_mla", False):
            return None
        return "LBHNC"

    # ---- metrics (both sides) ----

    def get_kv_connector_stats(self):
        return _process_stats()

    @classmethod
    def build_kv_connector_stats(cls, data=None):
        return KvflowStats(data=data) if data is not None else KvflowStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return KvflowPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def has_pending_push_work(self):
        # P keeps stepping while it holds exports (or blocks of requests given up), so that its
        # ranks' reports (releases) come back and vLLM frees the blocks at once, not at the
        # next request.
        return bool(self._exports or self._abandoned)

    # ---- worker side ----

    def register_kv_caches(self, kv_caches):
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        # The layout from the tensors' shapes and strides (the backend's name only where they
        # cannot tell): vLLM's CPU attention, FlashAttention's NHD and HND, FlashInfer's, vLLM
        # 0.33's packed K and V, MLA.
        mla = bool(getattr(self._vllm_config.model_config, "use_mla", False))
        described = describe(
            kv_caches, self._tp, _total_kv_heads(self._vllm_config), _backend_name(self._vllm_config), mla=mla
        )
        layout, num_blocks, regions = described.layout, described.num_blocks, described.regions
        # The ranks read and write these tensors in place: they must outlive them.
        self._kv_caches = kv_caches
        native.prepare_nixl(str(runtime_dir()))
        self._tp_rank = get_tensor_model_parallel_rank()
        host = os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "localhost")
        base = int(os.environ.get("VLLM_NIXL_SIDE_CHANNEL_PORT", "5600"))
        roles = [role for role, on in (("prefill", self._producer), ("decode", self._consumer)) if on]
        incarnation = _incarnation(self._vllm_config)
        dp_index = self._vllm_config.parallel_config.data_parallel_index
        port = side_channel_port(base, dp_index)
        for i, role in enumerate(roles):
            # Rank 0's first role accepts on the engine's port for every rank and role.
            accept = self._tp_rank == 0 and i == 0
            self._ranks[role] = native.Rank(
                role, self._engine, incarnation, self._tp_rank, self._tp,
                json.dumps(layout), num_blocks, regions, f"{host}:{port}", self._config, self._model,
                _cluster_key(), described.device, shared_port=accept,
            )
        if self._push and "prefill" in self._ranks:
            # Layer i is the rank's i-th tensor (the layout's layer order).
            self._layers = LayerSender(self._ranks["prefill"], list(kv_caches), described.device is not None)

    def get_handshake_metadata(self):
        # P's scheduler is built from its ranks' offers and addresses.
        rank = self._ranks.get("prefill")
        if rank is None:
            return None
        return KvflowHandshake(offer=bytes(rank.offer()), address=rank.address())

    def bind_connector_metadata(self, connector_metadata):
        super().bind_connector_metadata(connector_metadata)
        if "prefill" in self._ranks:
            commands = connector_metadata.prefill.get(self._tp_rank, [])
            self._unreported.update(connector_metadata.unreported)
            if self._layers is not None:
                self._layers.begin_step(commands)
            else:
                for command in commands:
                    self._ranks["prefill"].command(command)
        if "decode" in self._ranks:
            for command in connector_metadata.decode.get(self._tp_rank, []):
                load = json.loads(command).get("load")
                if load is not None:
                    self._load_blocks[load["request"]] = load["blocks"]
                self._ranks["decode"].command(command)

    def start_load_kv(self, forward_context, **kwargs):
        pass

    def wait_for_layer_load(self, layer_name):
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        if self._layers is not None:
            self._layers.saved(layer_name)

    def wait_for_save(self):
        if self._layers is not None:
            self._layers.end_step()

    def get_finished(self, finished_req_ids):
        sending, recving = set(), set()
        for role, rank in self._ranks.items():
            for report in rank.reports():
                self._pending_reports.append((role, self._tp_rank, report))
                parsed = json.loads(report)
                if "released" in parsed:
                    released = parsed["released"]["request"]
                    if released in self._unreported:
                        # Given up while vLLM ran it: vLLM freed its blocks itself.
                        self._unreported.discard(released)
                    else:
                        sending.add(released)
                elif "finished" in parsed and parsed["finished"]["request"] in self._load_blocks:
                    # A load this rank was given (a request tracked and aborted before it
                    # had blocks holds none of vLLM's: nothing to tell it).
                    finished = parsed["finished"]
                    blocks = self._load_blocks.pop(finished["request"])
                    if finished["outcome"] == "failed":
                        # vLLM must not decode from these: they hold no valid KV (those before
                        # `kept_blocks` do). It recomputes or fails the request, as its
                        # kv_load_failure_policy says.
                        self._invalid.update(blocks[finished["kept_blocks"] :])
                    recving.add(finished["request"])
        return (sending or None), (recving or None)

    def get_block_ids_with_load_errors(self):
        invalid, self._invalid = self._invalid, set()
        return invalid

    def build_connector_worker_meta(self):
        if not self._pending_reports:
            return None
        meta, self._pending_reports = KvflowWorkerMetadata(self._pending_reports), []
        return meta

    def shutdown(self):
        for rank in self._ranks.values():
            rank.close()
        self._ranks = {}


class KvflowPushConnector(KvflowConnector):
    """Push: P writes into the blocks D registered (``kv_connector="KvflowPushConnector"``
    selects push in the connectors' settings; the rest is KvflowConnector's)."""
