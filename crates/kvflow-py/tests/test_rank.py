"""kvflow's lifecycle driven from Python, as the vLLM connector will drive it: P's and D's
schedulers (vLLM's scheduler process) trade JSON commands and reports with one rank each
(vLLM's workers), whose NIXL agents move the KV between two pools of this process's memory,
registered in place."""

import ctypes
import json
import socket

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


def rank(role, engine, regions, host="127.0.0.1"):
    return native.Rank(role, engine, 1, 0, 1, LAYOUT, BLOCKS, regions, f"{host}:0", RANK_CONFIG, "tiny")


def test_d_reads_p_s_blocks_and_p_frees_them_as_transferred():
    p_memory, p_regions = pool()
    d_memory, d_regions = pool()
    for i in range(2 * BLOCK):
        p_memory[i] = i % 251
    # NixlConnector's users set VLLM_NIXL_SIDE_CHANNEL_HOST to a host name (vLLM's default is
    # localhost): it resolves.
    p, d = rank("prefill", "prefill0", p_regions, "localhost"), rank("decode", "decode0", d_regions)
    try:
        assert p.address().startswith("127.0.0.1:")
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


def test_d_takes_p_s_deadline_only_from_a_handoff_p_vouched_for_under_the_cluster_key(monkeypatch):
    monkeypatch.setenv("KVFLOW_TEST_CLUSTER_KEY", "5a" * 32)
    key = ("env", "KVFLOW_TEST_CLUSTER_KEY")
    p_memory, p_regions = pool()
    d_memory, d_regions = pool()
    for i in range(2 * BLOCK):
        p_memory[i] = (i * 3) % 251

    def keyed(role, engine, regions):
        return native.Rank(role, engine, 1, 0, 1, LAYOUT, BLOCKS, regions, "127.0.0.1:0", RANK_CONFIG, "tiny", key=key)

    p, d = keyed("prefill", "prefill0", p_regions), keyed("decode", "decode0", d_regions)
    try:
        p_scheduler = native.PrefillScheduler(p.offer(), [p.address()], RANK_CONFIG, key)
        d_scheduler = native.DecodeScheduler("decode0", 1, RANK_CONFIG, key)
        tokens = list(range(32))
        answer = json.loads(p_scheduler.handoff_answer(p_scheduler.finished(native.now_ns(), "req-1", [0, 1], 32, tokens), 16))
        assert len(answer["kvflow_vouch"]) == 64
        outcome, remote = d_scheduler.handoff("req-1", json.dumps(answer), 32, tokens, 16)
        assert outcome == "ok" and json.loads(remote)["export"]["deadline"] > 0, remote
        d_scheduler.arrive("req-1", remote, 32, tokens)
        d_scheduler.schedule("req-1", [4, 5])
        pairs = [(p_scheduler, [p]), (d_scheduler, [d])]
        events = carry(pairs, lambda ev: {w for w, _ in ev} >= {"free", "ended"})
        assert ("ended", ("req-1", "ready")) in events
        assert bytes(d_memory[4 * BLOCK : 6 * BLOCK]) == bytes(p_memory[: 2 * BLOCK])

        # A client's handoff: P's answer for another request, with the blocks of req-1 (freed
        # since) in place of its own. Its vouch no longer verifies, so D waits for P's answer to
        # its claim, which P refuses (other blocks than it holds): nothing is read, and the
        # export the handoff names is freed at once.
        answer = json.loads(p_scheduler.handoff_answer(p_scheduler.finished(native.now_ns(), "req-2", [2, 3], 32, tokens), 16))
        answer["kvflow"]["export"]["blocks"] = [0, 1]
        outcome, remote = d_scheduler.handoff("req-x", json.dumps(answer), 32, tokens, 16)
        assert outcome == "ok" and json.loads(remote)["export"]["deadline"] == 0, remote
        d_scheduler.arrive("req-x", remote, 32, tokens)
        d_scheduler.schedule("req-x", [6, 7])
        events = carry(pairs, lambda ev: {w for w, _ in ev} >= {"free", "ended"})
        assert ("free", ("req-2", [2, 3], "rejected")) in events
        assert ("ended", ("req-x", "failed")) in events, events
        assert bytes(d_memory[6 * BLOCK : 8 * BLOCK]) == bytes(2 * BLOCK), "D read blocks P did not lend"

        # D without the key takes no deadline from P's answer: it reads once P answered its claim.
        keyless = native.DecodeScheduler("decode1", 1, RANK_CONFIG)
        answer = p_scheduler.handoff_answer(p_scheduler.finished(native.now_ns(), "req-3", [4, 5], 32, tokens), 16)
        outcome, remote = keyless.handoff("req-3", answer, 32, tokens, 16)
        assert outcome == "ok" and json.loads(remote)["export"]["deadline"] == 0, remote
    finally:
        d.close()
        p.close()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_p_s_two_ranks_share_one_port_and_d_reads_both_through_it():
    # NixlConnector's port plan: one side-channel port per engine, rank 0's process accepting
    # for every rank; D (TP 1) reads each P rank's half of the heads through that one port.
    port, half = free_port(), BLOCK // 2
    p_pools = [(ctypes.c_uint8 * (BLOCKS * half))() for _ in range(2)]
    for r, memory in enumerate(p_pools):
        for i in range(len(memory)):
            memory[i] = (i * 7 + r * 101) % 251
    d_memory, d_regions = pool()

    def p_rank(engine, tp_rank, accept):
        regions = [(ctypes.addressof(p_pools[tp_rank]), len(p_pools[tp_rank]))]
        bind = f"localhost:{port}"
        return native.Rank("prefill", engine, 1, tp_rank, 2, LAYOUT, BLOCKS, regions, bind, RANK_CONFIG, "tiny", shared_port=accept)

    p0, p1 = p_rank("prefill0", 0, True), p_rank("prefill0", 1, False)
    d = rank("decode", "decode0", d_regions)
    try:
        assert (p0.address(), p1.address()) == (f"127.0.0.1:{port}/tp0", f"127.0.0.1:{port}/tp1")
        # Another engine configured with the same port on this host is refused by name.
        with pytest.raises(ValueError, match="rank 1 of the port .* is taken"):
            p_rank("prefill1", 1, False)
        p_scheduler = native.PrefillScheduler(p0.offer(), [p0.address(), p1.address()], RANK_CONFIG)
        d_scheduler = native.DecodeScheduler("decode0", 1, RANK_CONFIG)
        remote = p_scheduler.finished(native.now_ns(), "req-1", [0], 16)
        d_scheduler.arrive("req-1", remote)
        d_scheduler.schedule("req-1", [4])
        pairs = [(p_scheduler, [p0, p1]), (d_scheduler, [d])]
        events = carry(pairs, lambda ev: {w for w, _ in ev} >= {"free", "ended"})
        assert ("ended", ("req-1", "ready")) in events
        assert ("free", ("req-1", [0], "transferred")) in events
        # Block-major, HND: per layer and plane, D's four heads are P rank 0's two, then rank 1's.
        chunk = 16 * 8 * 2
        for plane in range(4):
            for head in range(4):
                at = 4 * BLOCK + (plane * 4 + head) * chunk
                theirs = (plane * 2 + head % 2) * chunk
                assert bytes(d_memory[at : at + chunk]) == bytes(p_pools[head // 2][theirs : theirs + chunk])
    finally:
        d.close()
        p1.close()
        p0.close()


def test_bad_input_is_a_value_error_that_names_it():
    with pytest.raises(ValueError, match='role: "both"'):
        native.Rank("both", "x", 1, 0, 1, LAYOUT, BLOCKS, [], "127.0.0.1:0", RANK_CONFIG, "tiny")
    with pytest.raises(ValueError, match='side_bind: "localhost:port" does not resolve'):
        native.Rank("prefill", "x", 1, 0, 1, LAYOUT, BLOCKS, [], "localhost:port", RANK_CONFIG, "tiny")
    with pytest.raises(ValueError, match="offer"):
        native.PrefillScheduler(b"not an offer", ["127.0.0.1:1"], RANK_CONFIG)
    scheduler = native.DecodeScheduler("decode0", 1, RANK_CONFIG)
    with pytest.raises(ValueError, match="remote"):
        scheduler.arrive("req-1", '{"request": "req-1"}')


PUSH_CONFIG = json.dumps(
    {"kv_connector": "KvflowPushConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"kv_lease_duration": 10}}
)
# vLLM's way: a tensor (a region) per layer.
BY_LAYER = json.dumps(dict(json.loads(LAYOUT), placement="LayerMajor"))
LAYER_BLOCK = 2 * 4 * 16 * 8 * 2  # (K, V) x heads x tokens x dims x bytes


def layer_pools():
    memory = [(ctypes.c_uint8 * (BLOCKS * LAYER_BLOCK))() for _ in range(2)]
    return memory, [(ctypes.addressof(m), len(m)) for m in memory]


def test_p_writes_each_layer_of_a_chunk_into_d_s_blocks_as_it_is_computed():
    """Push, as the vLLM connector drives it: P's scheduler is told of a chunk with none of its
    layers computed, the rank is given that command as the step's layer step, and each
    ``layers_computed`` writes one more layer of the chunk into the blocks D registered. At the
    export only the rest moves, with the completion: D's load is ready with P's bytes."""
    p_memory, p_regions = layer_pools()
    d_memory, d_regions = layer_pools()
    for layer in p_memory:
        for i in range(len(layer)):
            layer[i] = (i + 1) % 251 + 1
    p = native.Rank("prefill", "prefill0", 1, 0, 1, BY_LAYER, BLOCKS, p_regions, "127.0.0.1:0", PUSH_CONFIG, "tiny")
    d = native.Rank("decode", "decode0", 1, 0, 1, BY_LAYER, BLOCKS, d_regions, "127.0.0.1:0", PUSH_CONFIG, "tiny")
    try:
        p_scheduler = native.PrefillScheduler(p.offer(), [p.address()], PUSH_CONFIG)
        d_scheduler = native.DecodeScheduler("decode0", 1, PUSH_CONFIG)
        prefill = {"engine": "prefill0", "addresses": [p.address()], "tp_size": 1, "pp_size": 1}
        remote = {"prefill": prefill, "request": "r1", "instance": None, "prompt_tokens": 64, "export": None, "consumer": None}
        d_scheduler.arrive("r1", json.dumps(remote))
        d_scheduler.schedule("r1", [4, 5, 6, 7])
        # D's rank connects to P's and registers its blocks.
        pairs = [(p_scheduler, [p]), (d_scheduler, [d])]
        carry(pairs, lambda _: False, seconds=2)

        def landed(d_block, p_block, layer):
            d_bytes = d_memory[layer][d_block * LAYER_BLOCK : (d_block + 1) * LAYER_BLOCK]
            return bytes(d_bytes) == bytes(p_memory[layer][p_block * LAYER_BLOCK : (p_block + 1) * LAYER_BLOCK])

        def step(blocks, whole):
            p_scheduler.layer_progress("r1", blocks, whole, 0)
            commands = [event[1] for what, event in p_scheduler.poll() if what == "to_rank"]
            assert [json.loads(c)["progress"]["part"] for c in commands] == [{"whole": whole, "layers": 0}]
            for command in commands:
                p.command(command)
            p.layer_steps(commands)

        step([0, 1], 0)
        assert p.layers_computed(1) == 1
        carry(pairs, lambda _: landed(4, 0, 0) and landed(5, 1, 0))
        assert landed(4, 0, 0) and landed(5, 1, 0), "the chunk's first layer went ahead"
        assert not landed(4, 0, 1), "its second is not computed yet"
        p.layers_computed(2)
        carry(pairs, lambda _: landed(5, 1, 1))
        assert landed(5, 1, 1)
        # The next chunk: its first layer only, then the export moves its second, with the completion.
        step([0, 1, 2, 3], 2)
        p.layers_computed(1)
        carry(pairs, lambda _: landed(7, 3, 0))
        assert not landed(7, 3, 1)
        p_scheduler.finished(native.now_ns(), "r1", [0, 1, 2, 3], 64)
        events = carry(pairs, lambda ev: {w for w, _ in ev} >= {"free", "ended"})
        assert ("ended", ("r1", "ready")) in events
        assert ("free", ("r1", [0, 1, 2, 3], "transferred")) in events
        assert all(landed(4 + b, b, layer) for b in range(4) for layer in range(2))
        counters = {name: value for (name, labels), value in native.metrics_delta()[0] if ("engine", "prefill0") in labels}
        assert counters.get("kvflow_layer_writes_total", 0) >= 3, counters
    finally:
        d.close()
        p.close()


def test_layer_steps_are_p_s_progress_commands_of_no_layer():
    _, regions = layer_pools()
    d = native.Rank("decode", "decode0", 1, 0, 1, BY_LAYER, BLOCKS, regions, "127.0.0.1:0", PUSH_CONFIG, "tiny")
    try:
        with pytest.raises(ValueError, match="layer_steps: a decode rank writes no layers"):
            d.layer_steps([])
        with pytest.raises(ValueError, match="layers_computed: a decode rank writes no layers"):
            d.layers_computed(1)
    finally:
        d.close()
    _, regions = layer_pools()
    p = native.Rank("prefill", "prefill0", 1, 0, 1, BY_LAYER, BLOCKS, regions, "127.0.0.1:0", PUSH_CONFIG, "tiny")
    try:
        export = '{"abandon": {"request": "r1"}}'
        with pytest.raises(ValueError, match="not a progress command of 0 layers"):
            p.layer_steps([export])
        with pytest.raises(ValueError, match="layer step"):
            p.layer_steps(["{"])
        assert p.layers_computed(1) == 0, "no layer steps: nothing to send"
    finally:
        p.close()
