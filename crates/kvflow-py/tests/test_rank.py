"""kvflow's lifecycle driven from Python, as the vLLM connector will drive it: P's and D's
schedulers (vLLM's scheduler process) trade JSON commands and reports with one rank each
(vLLM's workers), whose NIXL agents move the KV between two pools of this process's memory,
registered in place."""

import ctypes
import json

import pytest

from conftest import RANK_CONFIG, carry
from kvflow import _kvflow as native

LAYOUT = json.dumps(
    {
        "layers": 2,
        "block_tokens": 16,
        "kv_heads": 4,
        "head_dim": 8,
        "dtype": "bfloat16",
        "attention": "SplitKv",
        "order": "Hnd",
        "placement": "BlockMajor",
    }
)
BLOCK = 2 * 2 * 4 * 16 * 8 * 2  # layers x (K, V) x heads x tokens x dims x bytes
BLOCKS = 8


pytestmark = pytest.mark.usefixtures("nixl")


def pool():
    memory = (ctypes.c_uint8 * (BLOCKS * BLOCK))()
    return memory, [(ctypes.addressof(memory), len(memory))]


def rank(role, engine, regions):
    return native.Rank(role, engine, 1, 0, 1, LAYOUT, BLOCKS, regions, "127.0.0.1:0", RANK_CONFIG, "tiny")


def test_d_reads_p_s_blocks_and_p_frees_them_as_transferred():
    p_memory, p_regions = pool()
    d_memory, d_regions = pool()
    for i in range(2 * BLOCK):
        p_memory[i] = i % 251
    p, d = rank("prefill", "prefill0", p_regions), rank("decode", "decode0", d_regions)
    try:
        p_scheduler = native.PrefillScheduler(p.offer(), [p.address()], RANK_CONFIG)
        d_scheduler = native.DecodeScheduler("decode0", 1, RANK_CONFIG)
        remote = p_scheduler.finished(native.now_ns(), "req-1", [0, 1], 32)
        assert json.loads(remote)["export"]["blocks"] == [0, 1]
        d_scheduler.arrive("req-1", remote)
        d_scheduler.schedule("req-1", [4, 5])
        pairs = [(p_scheduler, [p]), (d_scheduler, [d])]
        events = carry(pairs, lambda ev: {w for w, _ in ev} >= {"free", "ended"})
        assert ("ended", ("req-1", "ready")) in events
        assert ("free", ("req-1", [0, 1], "transferred")) in events
        assert bytes(d_memory[4 * BLOCK : 6 * BLOCK]) == bytes(p_memory[: 2 * BLOCK])
        assert d_scheduler.state("req-1") is None or d_scheduler.state("req-1") == "ready"

        # D rejects the next request before admission: P frees its blocks at once.
        remote = p_scheduler.finished(native.now_ns(), "req-2", [2, 3], 32)
        d_scheduler.reject("req-2", remote)
        events = carry(pairs, lambda ev: any(w == "free" for w, _ in ev))
        assert ("free", ("req-2", [2, 3], "rejected")) in events
    finally:
        d.close()
        p.close()


def test_bad_input_is_a_value_error_that_names_it():
    with pytest.raises(ValueError, match='role: "both"'):
        native.Rank("both", "x", 1, 0, 1, LAYOUT, BLOCKS, [], "127.0.0.1:0", RANK_CONFIG, "tiny")
    with pytest.raises(ValueError, match="offer"):
        native.PrefillScheduler(b"not an offer", ["127.0.0.1:1"], RANK_CONFIG)
    scheduler = native.DecodeScheduler("decode0", 1, RANK_CONFIG)
    with pytest.raises(ValueError, match="remote"):
        scheduler.arrive("req-1", '{"request": "req-1"}')
