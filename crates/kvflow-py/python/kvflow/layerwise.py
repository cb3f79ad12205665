"""Push mode's writes ahead, layer by layer, for ``kvflow.vllm``'s push connector on P.

While P computes a prompt in chunks (vLLM's chunked prefill), its ranks write each layer of
the chunk in flight into the blocks D registered as soon as vLLM's forward has stored it, so
that the export (``request_finished``) has only the rest to write, with the completion.

- The scheduler side (``Progress``): before each step's forward (``build_connector_meta``),
  each request with ``do_remote_decode`` scheduled in the step is reported to P's scheduler
  (``layer_progress``): its blocks computed in every layer (``whole``) and those whole once
  the step is done, with 0 of their layers computed (a step that fills no block reports
  nothing). From that first report until the export
  or the scheduler's ``free`` event the blocks are the connector's: a request vLLM aborts is
  given up (``abandoned``) and its blocks freed once every rank released it; one vLLM preempts
  (whose blocks vLLM frees at once) is given up too, and is not exported when it finishes
  (D computes it, as its ``kv_load_failure_policy`` says).
  A chunk that ends inside a block leaves that block to the next step: a block is written
  layer by layer only in the step that fills it (or, the prompt's last, ends the prompt).
- The worker side (``LayerSender``): each rank is sent those reports (``Progress`` commands
  of 0 layers) in the step's connector metadata; ``save_kv_layer`` of the model's layer ``i``
  (its place among ``register_kv_caches``' tensors, the rank's layer order) tells the rank
  that layers ``0..n`` of those chunks are computed, ``n`` the first layer not yet saved in
  the step (so a layer saved out of order waits for those before it), and ``wait_for_save``
  that every layer is. On a GPU the forward runs behind the host: each of these goes to the
  rank once a CUDA event recorded where vLLM's stream stood has completed, and
  ``wait_for_save`` waits for the step's last one.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Callable

from vllm.logger import init_logger

logger = init_logger(__name__)


@dataclasses.dataclass
class _Request:
    # The request's blocks (vLLM's, in prompt order), its prompt's tokens, and whether P's
    # scheduler holds it in progress (reported and not given up).
    blocks: list[int]
    prompt_tokens: int
    reported: bool = False


def chunk_blocks(start: int, tokens: int, prompt_tokens: int, block_size: int) -> tuple[int, int]:
    """``(whole, end)`` of a step that computes ``tokens`` prompt tokens from token ``start``:
    the blocks whole before it (every token in every layer) and those whole after it (the
    prompt's last, partial or not, once the step ends the prompt)."""
    end_token = min(start + tokens, prompt_tokens)
    end = math.ceil(prompt_tokens / block_size) if end_token >= prompt_tokens else end_token // block_size
    return start // block_size, end


class Progress:
    """P's scheduler side of the layer-by-layer writes (push mode): which requests to report,
    with which blocks, and which were given up."""

    def __init__(self, block_size: int):
        self._block_size = block_size
        self._requests: dict[str, _Request] = {}
        # Given up while vLLM still runs them (preempted): never exported.
        self._given_up: set[str] = set()

    def track(self, request) -> None:
        """vLLM allocated blocks for ``request`` (``update_state_after_alloc``): a request P
        exports (``do_remote_decode``) is followed from its first step."""
        rid = request.request_id
        params = request.kv_transfer_params or {}
        if params.get("do_remote_decode") and rid not in self._requests and rid not in self._given_up:
            self._requests[rid] = _Request(blocks=[], prompt_tokens=request.num_prompt_tokens)

    def step(self, prefill, scheduler_output) -> tuple[list[str], list[str]]:
        """Reports this step's chunks to P's scheduler ``prefill`` (before the step's forward);
        returns the requests given up (their blocks come back at the scheduler's ``free``), and
        of those the ones whose release vLLM does not wait for (it freed their blocks)."""
        abandoned, unreported = [], []
        for rid in getattr(scheduler_output, "preempted_req_ids", None) or ():
            # vLLM freed its blocks at once; P's ranks only read them (the writes go into D's
            # blocks), and D is told that no write will come once theirs have ended. One never
            # reported starts again with the blocks vLLM gives it when it resumes.
            if self._give_up_running(prefill, rid, abandoned, unreported):
                del self._requests[rid]
        starts: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._requests.get(new.req_id)
            if tracked is not None:
                tracked.blocks = list(new.block_ids[0]) if new.block_ids else []
                starts[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            tracked = self._requests.get(rid)
            if tracked is None:
                continue
            added = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                tracked.blocks = list(added[0]) if added else []
            elif added:
                tracked.blocks.extend(added[0])
            starts[rid] = cached.num_computed_tokens[i]
        for rid, start in starts.items():
            tracked = self._requests[rid]
            tokens = scheduler_output.num_scheduled_tokens.get(rid, 0)
            if start >= tracked.prompt_tokens or tokens <= 0:
                continue
            whole, end = chunk_blocks(start, tokens, tracked.prompt_tokens, self._block_size)
            if end <= whole or end > len(tracked.blocks):
                # The step fills no block (what it computes of one goes with the step that
                # fills it), or vLLM gave fewer blocks than the tokens fill (not its way).
                continue
            try:
                prefill.layer_progress(rid, tracked.blocks[:end], whole, 0)
                tracked.reported = True
            except ValueError as error:
                # Blocks that do not extend the last report's, an id that named an export
                # before (not vLLM's way): nothing more goes ahead. Never reported, the request
                # is exported as without writes ahead; reported, it is given up.
                logger.warning("kvflow: %s is written no further ahead: %s", rid, error)
                self._give_up_running(prefill, rid, abandoned, unreported)
                del self._requests[rid]
        return abandoned, unreported

    def _give_up_running(self, prefill, rid: str, abandoned: list[str], unreported: list[str]) -> bool:
        """Gives up ``rid`` while vLLM still runs it, if P's scheduler holds it in progress: it
        joins ``abandoned`` and ``unreported`` and is never exported. Whether it did."""
        if not self._give_up(prefill, rid):
            return False
        abandoned.append(rid)
        unreported.append(rid)
        self._given_up.add(rid)
        return True

    def _give_up(self, prefill, rid: str) -> bool:
        """Gives up ``rid`` at P's scheduler if it holds it in progress; whether it did."""
        tracked = self._requests.get(rid)
        if tracked is None or not tracked.reported:
            return False
        tracked.reported = False
        prefill.abandoned(rid)
        return True

    def finished(self, prefill, rid: str, exported: bool) -> str | None:
        """vLLM finished ``rid`` (``request_finished``), to be ``exported`` or not (aborted):
        forgets it, and gives it up if it is not exported while P's scheduler holds it in
        progress. Returns ``"abandoned"`` when so (its blocks are the connector's until the
        scheduler's ``free``), ``"computing"`` when it is to be exported and P's scheduler
        holds it in progress, ``"given_up"`` when it was given up while vLLM ran it (it is not
        exported), else None."""
        if rid in self._given_up:
            self._given_up.discard(rid)
            return "given_up"
        tracked = self._requests.pop(rid, None)
        if tracked is None or not tracked.reported:
            return None
        if exported:
            return "computing"
        prefill.abandoned(rid)
        return "abandoned"


class LayerSender:
    """A P rank's side of the layer-by-layer writes: each step's chunks (the ``Progress``
    commands of 0 layers among the rank's commands) and the layers of the step saved so far."""

    def __init__(self, rank, layer_names: list[str], cuda: bool):
        self._rank = rank
        self._index = {name: i for i, name in enumerate(layer_names)}
        self._saved = [False] * len(layer_names)
        # Layers 0..sent of the step's chunks told to the rank (or queued for it).
        self._sent = 0
        self._stepping = False
        self._cuda = cuda
        # On a GPU: what goes to the rank once its event has completed, in order.
        self._queue: list[tuple[Any, Callable[[], Any]]] = []

    def begin_step(self, commands: list[str]) -> None:
        """The step's commands for the rank (from the connector metadata), sent in order; the
        progress commands of 0 layers among them are the chunks the step computes."""
        self._drain(wait=True)
        steps = []
        for command in commands:
            part = (json.loads(command).get("progress") or {}).get("part")
            if part is not None and part.get("layers") == 0:
                steps.append(command)
        self._saved = [False] * len(self._saved)
        self._sent = 0
        self._stepping = bool(steps)

        def send():
            for command in commands:
                self._rank.command(command)
            self._rank.layer_steps(steps)

        # On a GPU the chunks' whole blocks may have been stored by the last step's forward,
        # which may still run: they go once vLLM's stream has passed it.
        self._after_stream(send)

    def saved(self, layer_name: str) -> None:
        """vLLM's forward stored layer ``layer_name`` (``save_kv_layer``)."""
        if not self._stepping:
            return
        index = self._index.get(layer_name)
        if index is None:
            # A layer whose KV lives in another's tensor (KV sharing): written with that one.
            return
        self._saved[index] = True
        layers = self._sent
        while layers < len(self._saved) and self._saved[layers]:
            layers += 1
        if layers > self._sent:
            self._sent = layers
            self._after_stream(lambda: self._rank.layers_computed(layers))
        self._drain(wait=False)

    def end_step(self) -> None:
        """vLLM's forward is done (``wait_for_save``): every layer of the step's chunks is
        computed; what no ``save_kv_layer`` said goes now, and on a GPU once the stream has
        done the forward."""
        if self._stepping and self._sent < len(self._saved):
            self._sent = len(self._saved)
            self._after_stream(lambda: self._rank.layers_computed(None))
        self._stepping = False
        self._drain(wait=True)

    def _after_stream(self, send: Callable[[], Any]) -> None:
        if not self._cuda:
            send()
            return
        import torch

        event = torch.cuda.Event()
        event.record()
        self._queue.append((event, send))

    def _drain(self, wait: bool) -> None:
        """Sends what is queued whose event has completed, in order (with ``wait``, all)."""
        while self._queue:
            event, send = self._queue[0]
            if wait:
                event.synchronize()
            elif not event.query():
                return
            self._queue.pop(0)
            send()
