"""Push mode's layer-by-layer writes as the vLLM connector drives them (``kvflow.layerwise``),
over stand-ins for vLLM's scheduler output, P's scheduler and a rank: which chunks each step
reports, what a request given up becomes, and which layers go to the rank when. (Real engines
run them in test_pd_vllm.py.)"""

import json
import types

import pytest

from kvflow.layerwise import LayerSender, Progress, chunk_blocks


@pytest.mark.parametrize(
    "start, tokens, prompt, expected",
    [
        # A first chunk inside the first block: nothing whole yet.
        (0, 96, 520, (0, 0)),
        # The chunk that fills block 0 (its first 96 tokens came in the last step).
        (96, 96, 520, (0, 1)),
        (192, 96, 520, (1, 2)),
        # The prompt's last chunk: its last block, partial, ends the prompt.
        (480, 40, 520, (3, 5)),
        (0, 3, 3, (0, 1)),
        (128, 1, 129, (1, 2)),
        (0, 256, 256, (0, 2)),
    ],
)
def test_a_step_s_chunk_is_the_blocks_it_fills(start, tokens, prompt, expected):
    assert chunk_blocks(start, tokens, prompt, 128) == expected


class Prefill:
    """P's scheduler, as far as the connector calls it."""

    def __init__(self):
        self.calls = []

    def layer_progress(self, request, blocks, whole, layers):
        self.calls.append(("progress", request, list(blocks), whole, layers))

    def abandoned(self, request):
        self.calls.append(("abandoned", request))


def request(rid, prompt_tokens, remote_decode=True):
    params = {"do_remote_decode": True} if remote_decode else {}
    return types.SimpleNamespace(request_id=rid, num_prompt_tokens=prompt_tokens, kv_transfer_params=params)


def output(new=(), cached=(), resumed=(), preempted=()):
    """vLLM's scheduler output: ``new`` (id, blocks, computed, scheduled) and ``cached`` (id, new
    blocks or None, computed, scheduled)."""
    new_reqs = [types.SimpleNamespace(req_id=r, block_ids=(b,), num_computed_tokens=c) for r, b, c, _ in new]
    cached_reqs = types.SimpleNamespace(
        req_ids=[r for r, *_ in cached],
        resumed_req_ids=set(resumed),
        new_block_ids=[None if b is None else (b,) for _, b, _, _ in cached],
        num_computed_tokens=[c for _, _, c, _ in cached],
    )
    scheduled = {r: n for r, _, _, n in [*new, *cached]}
    return types.SimpleNamespace(
        scheduled_new_reqs=new_reqs,
        scheduled_cached_reqs=cached_reqs,
        num_scheduled_tokens=scheduled,
        preempted_req_ids=set(preempted),
    )


def test_each_step_reports_its_chunk_with_no_layer_and_the_export_follows():
    prefill, progress = Prefill(), Progress(128)
    progress.track(request("a", 300))
    progress.track(request("local", 300, remote_decode=False))
    steps = [
        output(new=[("a", [7], 0, 96), ("local", [9], 0, 96)]),
        output(cached=[("a", [8], 96, 96)]),
        output(cached=[("a", None, 192, 60)]),
        output(cached=[("a", [11], 252, 48)]),
    ]
    for step in steps:
        assert progress.step(prefill, step) == ([], [])
    # The first step fills no block, nor does the third: they report nothing.
    assert prefill.calls == [("progress", "a", [7], 0, 0), ("progress", "a", [7, 8, 11], 1, 0)]
    assert progress.finished(prefill, "a", exported=True) == "computing"
    assert progress.finished(prefill, "local", exported=True) is None


def test_a_request_aborted_after_a_report_is_given_up_and_one_before_is_not():
    prefill, progress = Prefill(), Progress(128)
    progress.track(request("a", 300))
    progress.track(request("b", 300))
    progress.step(prefill, output(new=[("a", [1, 2], 0, 200), ("b", [3], 0, 50)]))
    assert progress.finished(prefill, "a", exported=False) == "abandoned"
    assert progress.finished(prefill, "b", exported=False) is None
    assert prefill.calls == [("progress", "a", [1], 0, 0), ("abandoned", "a")]


def test_a_request_preempted_after_a_report_is_given_up_for_good():
    prefill, progress = Prefill(), Progress(128)
    for rid in ("a", "b"):
        progress.track(request(rid, 300))
    progress.step(prefill, output(new=[("a", [1, 2], 0, 200), ("b", [3], 0, 50)]))
    # vLLM preempts both and frees their blocks: "a" was reported, "b" was not.
    assert progress.step(prefill, output(preempted=["a", "b"])) == (["a"], ["a"])
    # Both resume with other blocks: only "b" goes on being reported.
    for rid in ("a", "b"):
        progress.track(request(rid, 300))
    resumed = output(cached=[("a", [5, 6], 0, 200), ("b", [7, 8], 0, 200)], resumed=["a", "b"])
    progress.step(prefill, resumed)
    assert prefill.calls[1:] == [("abandoned", "a"), ("progress", "b", [7], 0, 0)]
    assert progress.finished(prefill, "a", exported=True) == "given_up"
    assert progress.finished(prefill, "b", exported=True) == "computing"


def test_a_report_p_s_scheduler_refuses_writes_nothing_more_ahead():
    class Refusing(Prefill):
        def layer_progress(self, request, blocks, whole, layers):
            if self.calls:
                raise ValueError("layer_progress: request a: 1 blocks do not extend the 1 reported computed before")
            super().layer_progress(request, blocks, whole, layers)

    prefill, progress = Refusing(), Progress(128)
    progress.track(request("a", 300))
    progress.step(prefill, output(new=[("a", [1, 2], 0, 200)]))
    assert progress.step(prefill, output(cached=[("a", [3], 200, 100)])) == (["a"], ["a"])
    assert progress.finished(prefill, "a", exported=True) == "given_up"


class Rank:
    def __init__(self):
        self.sent = []

    def command(self, command):
        self.sent.append(("command", json.loads(command)))

    def layer_steps(self, commands):
        self.sent.append(("steps", [json.loads(c)["progress"]["request"] for c in commands]))

    def layers_computed(self, layers=None):
        self.sent.append(("layers", layers))


def progress_command(rid, layers):
    return json.dumps({"progress": {"request": rid, "blocks": [1], "consumer": None, "part": {"whole": 0, "layers": layers}}})


def test_the_rank_hears_of_each_layer_once_every_layer_before_it_is_stored():
    rank = Rank()
    sender = LayerSender(rank, ["model.layers.0.attn", "model.layers.1.attn", "model.layers.2.attn"], cuda=False)
    export = json.dumps({"export": {"request": "x", "blocks": [2], "deadline": 5, "consumer": None}})
    sender.begin_step([export, progress_command("a", 0), progress_command("b", 2)])
    assert [what for what, _ in rank.sent] == ["command", "command", "command", "steps"]
    assert rank.sent[-1] == ("steps", ["a"]), "only chunks of 0 layers are this step's"
    rank.sent.clear()
    sender.saved("model.layers.1.attn")
    assert rank.sent == [], "layer 0 is not stored yet"
    sender.saved("model.layers.0.attn")
    sender.saved("model.layers.0.attn")
    sender.saved("model.shared.attn")
    assert rank.sent == [("layers", 2)]
    sender.end_step()
    assert rank.sent == [("layers", 2), ("layers", None)], "the forward is done: every layer is"
    # A step with no chunk: the layers it stores tell the rank nothing.
    rank.sent.clear()
    sender.begin_step([])
    sender.saved("model.layers.0.attn")
    sender.end_step()
    assert rank.sent == [("steps", [])]


def test_a_step_whose_every_layer_was_saved_ends_with_nothing_more():
    rank = Rank()
    sender = LayerSender(rank, ["l0", "l1"], cuda=False)
    sender.begin_step([progress_command("a", 0)])
    for name in ("l0", "l1"):
        sender.saved(name)
    sender.end_step()
    assert rank.sent[-2:] == [("layers", 1), ("layers", 2)]
