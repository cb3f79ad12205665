"""kvflow's KV connector for vLLM's v1 interface, loaded by module path
(``kv_connector="KvflowConnector"``, ``kv_connector_module_path="kvflow.vllm"``).

So far: pull mode, ``kv_role`` ``kv_producer`` or ``kv_consumer``, vLLM's CPU attention backend
with P and D at the same TP size and block size (whole blocks move; a layout it cannot
describe is refused). The scheduler side runs kvflow's P or D scheduler, the worker side one
TP rank on a NIXL agent over vLLM's own KV tensors, registered in place; the scheduler's
commands reach the workers in the connector metadata and their reports come back in the
worker metadata, and each worker tells vLLM which requests it finished sending or receiving.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from vllm.logger import init_logger

from kvflow import _kvflow as native
from kvflow.config import settings as _settings
from kvflow.nixl import runtime_dir


@dataclasses.dataclass
class KvflowHandshake(KVConnectorHandshakeMetadata):
    offer: bytes
    address: str


@dataclasses.dataclass
class KvflowMetadata(KVConnectorMetadata):
    commands: dict[int, list[str]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class KvflowWorkerMetadata(KVConnectorWorkerMetadata):
    reports: list[tuple[int, str]] = dataclasses.field(default_factory=list)

    def aggregate(self, other: "KvflowWorkerMetadata") -> "KvflowWorkerMetadata":
        return KvflowWorkerMetadata(self.reports + other.reports)


logger = init_logger(__name__)


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


class KvflowConnector(KVConnectorBase_V1):
    """Pull: D reads P's blocks."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        self._config = json.dumps(dataclasses.asdict(transfer))
        self._settings = _settings(transfer)
        self._engine = transfer.engine_id
        self._tp = vllm_config.parallel_config.tensor_parallel_size
        self._producer = transfer.kv_role in ("kv_producer", "kv_both")
        self._consumer = transfer.kv_role in ("kv_consumer", "kv_both")
        self._block_size = vllm_config.cache_config.block_size
        self._model = str(vllm_config.model_config.model)
        self._vllm_config = vllm_config
        # Scheduler side.
        self._prefill = None
        self._decode = native.DecodeScheduler(self._engine, self._tp, self._config) if self._consumer else None
        self._arrived: set[str] = set()
        # Worker side.
        self._rank = None
        self._pending_reports: list[tuple[int, str]] = []
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
        self._prefill = native.PrefillScheduler(offer, addresses, self._config)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        params = request.kv_transfer_params or {}
        if not self._consumer or "kvflow" not in params or not params.get("do_remote_prefill"):
            return 0, False
        if request.request_id in self._arrived:
            return 0, False
        # Whole blocks move as they are: P's layout must be D's (vLLM's CPU blocks interleave
        # each head's K and V in an order kvflow's layout does not describe, so no head or
        # token range of a block can be split off).
        theirs = params.get("kvflow_layout", {})
        ours = {"block_size": self._block_size, "tp_size": self._tp}
        if theirs != ours:
            logger.warning("kvflow: %s's prefill engine has %s, this engine %s: computing it here", request.request_id, theirs, ours)
            return 0, False
        count = len(request.prompt_token_ids) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        if num_external_tokens == 0 or self._decode is None:
            return
        params = request.kv_transfer_params
        remote = params["kvflow"]
        block_ids = blocks.get_block_ids()[0]
        needed = math.ceil(remote["prompt_tokens"] / self._block_size)
        self._decode.arrive(request.request_id, json.dumps(remote))
        self._decode.schedule(request.request_id, list(block_ids[:needed]))
        self._arrived.add(request.request_id)

    def build_connector_meta(self, scheduler_output):
        meta = KvflowMetadata()
        for scheduler in (self._prefill, self._decode):
            if scheduler is None:
                continue
            for what, event in scheduler.poll():
                if what == "to_rank":
                    meta.commands.setdefault(event[0], []).append(event[1])
        return meta

    def update_connector_output(self, connector_output):
        worker = connector_output.kv_connector_worker_meta
        if not isinstance(worker, KvflowWorkerMetadata):
            return
        for rank, report in worker.reports:
            # P's ranks report releases; D's, loads finished or quarantined.
            to_prefill = "released" in json.loads(report)
            scheduler = self._prefill if to_prefill else self._decode
            if scheduler is not None:
                scheduler.report(rank, report)

    def request_finished(self, request, block_ids):
        # D: the request's load, if it had one, is over for good.
        self._arrived.discard(request.request_id)
        params = request.kv_transfer_params or {}
        if self._prefill is None or not params.get("do_remote_decode"):
            return False, None
        prompt = len(request.prompt_token_ids)
        blocks = list(block_ids[: math.ceil(prompt / self._block_size)])
        remote = json.loads(self._prefill.finished(native.now_ns(), request.request_id, blocks, prompt))
        return True, {
            "kvflow": remote,
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": blocks,
            "remote_engine_id": self._engine,
            "kvflow_layout": {"block_size": self._block_size, "tp_size": self._tp},
        }

    # ---- worker side ----

    def register_kv_caches(self, kv_caches):
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        layers = list(kv_caches.values())
        first = layers[0]
        if first.device.type != "cpu" or first.dim() != 4:
            raise ValueError(f"kvflow: a KV cache of shape {tuple(first.shape)} on {first.device} is not one it can describe yet")
        num_blocks, kv_heads, block_size, twice_head = first.shape
        dtype = {"torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16"}[str(first.dtype)]
        layout = {
            "layers": len(layers),
            "block_tokens": block_size,
            "kv_heads": kv_heads * self._tp,
            "head_dim": twice_head // 2,
            "dtype": dtype,
            "attention": "SplitKv",
            "order": "Hnd",
            "placement": "LayerMajor",
        }
        regions = [(t.data_ptr(), t.numel() * t.element_size()) for t in layers]
        # The rank reads and writes these tensors in place: they must outlive it.
        self._kv_caches = kv_caches
        native.prepare_nixl(str(runtime_dir()))
        self._tp_rank = get_tensor_model_parallel_rank()
        host = os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1")
        port = int(os.environ.get("VLLM_NIXL_SIDE_CHANNEL_PORT", "5600")) + self._tp_rank
        role = "prefill" if self._producer else "decode"
        self._rank = native.Rank(
            role, self._engine, _incarnation(self._vllm_config), self._tp_rank, self._tp,
            json.dumps(layout), num_blocks, regions, f"{host}:{port}", self._config, self._model,
        )

    def get_handshake_metadata(self):
        if self._rank is None:
            return None
        return KvflowHandshake(offer=bytes(self._rank.offer()), address=self._rank.address())

    def bind_connector_metadata(self, connector_metadata):
        super().bind_connector_metadata(connector_metadata)
        if self._rank is None:
            return
        for command in connector_metadata.commands.get(self._tp_rank, []):
            load = json.loads(command).get("load")
            if load is not None:
                self._load_blocks[load["request"]] = load["blocks"]
            self._rank.command(command)

    def start_load_kv(self, forward_context, **kwargs):
        pass

    def wait_for_layer_load(self, layer_name):
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        pass

    def wait_for_save(self):
        pass

    def get_finished(self, finished_req_ids):
        if self._rank is None:
            return None, None
        sending, recving = set(), set()
        for report in self._rank.reports():
            self._pending_reports.append((self._tp_rank, report))
            parsed = json.loads(report)
            if "released" in parsed:
                sending.add(parsed["released"]["request"])
            elif "finished" in parsed:
                finished = parsed["finished"]
                blocks = self._load_blocks.pop(finished["request"], [])
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
        if self._rank is not None:
            self._rank.close()
            self._rank = None
