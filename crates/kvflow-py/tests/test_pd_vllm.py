"""Two real vLLM engines, each in its own process, with kvflow's connector (pull) moving the KV
over NIXL: a prefill engine (kv_producer, max_tokens 1) and a decode engine (kv_consumer) that
decodes 16 greedy tokens from the KV it loaded. Its tokens equal a no-transfer engine's on
every prompt, P frees every request's blocks once D has read them, and with P's KV overwritten
by noise before D reads, every output changes: the tokens come from what moved. Through vLLM's
own scheduler: requests waiting in D's queue past the lease while D renews it, aborted while
they wait, a D that cannot use P's KV, and a D killed while they wait. Push too
(KvflowPushConnector): P writes into the blocks D registered, with vLLM's chunked prefill
layer by layer as its forward stores each layer, and gives up prompts aborted or preempted
after their layers went ahead."""

import json
import os
import secrets
import subprocess
import sys
import time

import pytest

from conftest import ENGINES, run

# Prompts of 3 to 520 tokens: within one of vLLM's 128-token CPU blocks, exactly one, just
# over, and spanning several.
LENGTHS = [3, 17, 64, 127, 128, 129, 300, 520]


def result(out):
    """What an engine script printed on its RESULT line."""
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert lines, f"no RESULT line in:\n{out[-4000:]}"
    return json.loads(lines[-1][len("RESULT ") :])


def disaggregated(model, prompts, tmp_path, port, *flags, decode=(), lease=60, d_exit=0, policy="fail", env=None, d_env=None):
    """D's output (tokens and finish reasons per prompt), and P's (how many requests it freed,
    by reason, and when the last; None if P left)."""
    handoffs, tokens, done = tmp_path / "handoffs.json", tmp_path / "tokens.json", tmp_path / "done"
    env = dict(os.environ, **(env or {}), PD_PORT=str(port), PD_LEASE=str(lease), PD_POLICY=policy, PD_READY=str(tmp_path / "ready"))
    # A queued D starts with P: P computes once D is up, and D takes the handoffs at once.
    queued = "queued" in decode
    args = ["prefill", model, prompts, str(handoffs), str(done), *flags, *(["after-ready"] if queued else [])]
    prefill = subprocess.Popen(
        [sys.executable, str(ENGINES / "pd.py"), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        deadline = time.monotonic() + 300
        while not queued and not handoffs.exists() and prefill.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert queued or handoffs.exists(), f"P wrote no handoffs:\n{prefill.stderr.read()[-4000:] if prefill.poll() is not None else ''}"
        run("pd.py", "decode", model, prompts, str(tokens), str(handoffs), str(done), *decode, env=dict(env, **(d_env or {})), returncode=d_exit)
        out, err = prefill.communicate(timeout=120)
    finally:
        if prefill.poll() is None:
            prefill.kill()
    assert prefill.returncode == 0, f"P failed:\n{err[-4000:]}"
    freed = None if "leave" in flags else result(out)
    return json.loads(tokens.read_text()), freed


@pytest.fixture(scope="module")
def prompts(model, tmp_path_factory):
    """The prompts (a file of token ids) and one engine's 16 greedy tokens for each."""
    path = tmp_path_factory.mktemp("prompts")
    prompts = path / "prompts.json"
    prompts.write_text(json.dumps([[(11 * i + 5 * j) % 1000 + 1 for j in range(n)] for i, n in enumerate(LENGTHS)]))
    run("pd.py", "plain", model, str(prompts), str(path / "plain.json"))
    alone = json.loads((path / "plain.json").read_text())
    assert [len(t) for t in alone] == [16] * len(LENGTHS)
    return str(prompts), alone


def total(samples, name, **labels):
    """The sum of the samples of ``name`` whose labels include ``labels``."""
    return sum(value for n, have, value in samples if n == name and labels.items() <= have.items())


def test_decode_from_kv_moved_by_kvflow_equals_one_engine(model, prompts, tmp_path):
    """... D's external cache hit covers every prompt, and kvflow's metrics reach vLLM's
    Prometheus registry from the scheduler and the workers: P's releases, D's loads and the
    bytes its reads moved (every prompt block of every layer: 15 blocks of 256 KiB)."""
    prompts, alone = prompts
    (tmp_path / "moved").mkdir()
    output, freed = disaggregated(model, prompts, tmp_path / "moved", 5610, env={"PD_STATS": "1"})
    assert output["tokens"] == alone
    assert freed["freed"] == len(LENGTHS), "P frees every request's blocks once D read them"
    assert freed["reasons"] == {"transferred": len(LENGTHS)}
    p, d = freed["metrics"], output["metrics"]
    assert total(p, "vllm:kvflow_releases_total", reason="transferred") == len(LENGTHS), p
    assert total(p, "vllm:kvflow_exports_live") == 0, p
    assert total(d, "vllm:kvflow_loads_total", outcome="ready") == len(LENGTHS), d
    blocks = sum(-(-n // 128) for n in LENGTHS)
    assert total(d, "vllm:kvflow_bytes_transferred_sum") == blocks * 4 * 2 * 128 * 64 * 4, d
    assert total(d, "vllm:kvflow_transfers_posted_total", rank="0") >= len(LENGTHS), d
    # vLLM counted every prompt token as held by the connector (an external prefix cache hit).
    assert total(d, "vllm:external_prefix_cache_hits_total") == sum(LENGTHS), d
    # P's answers carry NixlConnector's fields too, for routers that read them.
    for handoff in json.loads((tmp_path / "moved" / "handoffs.json").read_text()):
        assert (handoff["remote_host"], handoff["remote_port"], handoff["tp_size"]) == ("127.0.0.1", 5610, 1), handoff
        assert handoff["remote_request_id"] == handoff["kvflow"]["request"], handoff
        assert handoff["remote_engine_id"] == handoff["kvflow"]["prefill"]["engine"], handoff

    (tmp_path / "noise").mkdir()
    output, freed = disaggregated(model, prompts, tmp_path / "noise", 5630, "noise")
    changed = [t != a for t, a in zip(output["tokens"], alone)]
    assert all(changed), f"with P's KV replaced by noise, outputs {[i for i, c in enumerate(changed) if not c]} did not change"
    assert freed["freed"] == len(LENGTHS)


def pushed(model, prompts, tmp_path, port, *flags, env=None):
    """A push run (KvflowPushConnector), the requests at D first, as a proxy sends them: D's
    output (tokens and finish reasons per prompt) and P's (what it freed, by reason; with
    ``PD_STATS`` its metrics). ``flags`` are P's (``chunked``, ``abort``)."""
    tokens, done, go = tmp_path / "tokens.json", tmp_path / "done", tmp_path / "go"
    env = dict(os.environ, **(env or {}), PD_PORT=str(port), PD_LEASE="60")
    prefill = subprocess.Popen(
        [sys.executable, str(ENGINES / "pd.py"), "push-prefill", model, prompts, "-", str(done), str(go), *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 300
        ready = tmp_path / "go.ready"
        while not ready.exists() and prefill.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert ready.exists(), f"P did not start:\n{prefill.stderr.read()[-4000:] if prefill.poll() is not None else ''}"
        run("pd.py", "push-decode", model, prompts, str(tokens), str(done), str(go), env=env)
        out, err = prefill.communicate(timeout=120)
    finally:
        if prefill.poll() is None:
            prefill.kill()
    assert prefill.returncode == 0, f"P failed:\n{err[-4000:]}"
    return json.loads(tokens.read_text()), result(out)


def test_push_from_p_into_blocks_d_registered_first_equals_one_engine(model, prompts, tmp_path):
    """KvflowPushConnector, the requests at D first: D's ranks register its blocks with P's
    before P has computed anything, P writes each prompt's KV into them once computed, and D's
    tokens equal one engine's; P frees every export once its writes are done."""
    prompts, alone = prompts
    output, freed = pushed(model, prompts, tmp_path, 5780)
    assert output["reasons"] == ["length"] * len(LENGTHS), output
    assert output["tokens"] == alone
    assert (freed["freed"], freed["reasons"]) == (len(LENGTHS), {"transferred": len(LENGTHS)}), freed


def test_push_with_nixl_push_connector_params_pairs_each_leg_by_its_transfer_id(model, prompts, tmp_path):
    """The requests at D first with NixlPushConnector's parameters (P's engine id and side
    channel, a transfer id, no request id) and each leg under its own id (a proxy that forwards
    no X-Request-Id): P pairs each with its own request by the transfer id, writes into D's
    blocks, D's tokens equal one engine's, and P frees every export as transferred."""
    prompts, alone = prompts
    output, freed = pushed(model, prompts, tmp_path, 6420, env={"PD_FORM": "nixl"})
    assert output["reasons"] == ["length"] * len(LENGTHS), output
    assert output["tokens"] == alone
    assert (freed["freed"], freed["reasons"]) == (len(LENGTHS), {"transferred": len(LENGTHS)}), freed


def test_push_writes_each_layer_of_a_chunked_prefill_as_vllm_stores_it(model, prompts, tmp_path):
    """Push with vLLM's chunked prefill at P (at most 96 tokens a step, so the longer prompts
    take up to 6 steps, in chunks that end inside blocks): before each step P reports the
    step's chunk of every prompt, and its rank writes each of the model's 4 layers of it into
    D's blocks as soon as vLLM's forward has stored it (save_kv_layer), so the export writes
    only what is left, with the completion. Every prompt's last chunk at least goes layer by
    layer: at least 4 writes of one layer per prompt. D's tokens equal one engine's, and P
    frees every export, as transferred."""
    prompts, alone = prompts
    output, freed = pushed(model, prompts, tmp_path, 6300, "chunked", env={"PD_STATS": "1"})
    assert output["reasons"] == ["length"] * len(LENGTHS), output
    assert output["tokens"] == alone
    assert (freed["freed"], freed["reasons"]) == (len(LENGTHS), {"transferred": len(LENGTHS)}), freed
    p = freed["metrics"]
    layer_writes = total(p, "vllm:kvflow_layer_writes_total", rank="0")
    assert layer_writes >= 4 * len(LENGTHS), f"{layer_writes} writes of some layers: {p}"
    assert total(p, "vllm:kvflow_releases_total", reason="transferred") == len(LENGTHS), p


def test_a_push_prompt_aborted_after_its_layers_went_ahead_frees_its_blocks_and_d_computes_it(model, prompts, tmp_path):
    """As above, and P aborts its longest prompt (520 tokens) once 192 of its tokens are
    scheduled, after one of its chunks went ahead layer by layer: P gives it up, its rank tells
    D that no write will come, and vLLM gets its blocks back once the rank released it (reason
    aborted); D, whose kv_load_failure_policy is "recompute", computes that prompt itself. Every
    one of D's outputs is one engine's."""
    prompts, alone = prompts
    output, freed = pushed(model, prompts, tmp_path, 6340, "chunked", "abort", env={"PD_POLICY": "recompute"})
    assert 192 <= freed["aborted_at"] < 520, freed
    assert output["reasons"] == ["length"] * len(LENGTHS), output
    assert output["tokens"] == alone
    kept = len(LENGTHS) - 1
    assert (freed["freed"], freed["reasons"]) == (len(LENGTHS), {"transferred": kept, "aborted": 1}), freed


def test_push_prompts_preempted_after_their_layers_went_ahead_are_given_up_and_d_computes_them(model, prompts, tmp_path):
    """As above, and P preempts every request running once 192 tokens of its longest prompt
    are scheduled (vLLM frees their blocks at once): those whose chunks went ahead are given up
    (their ranks tell D that no write will come), and vLLM computes them again and finishes
    them without an export, while the others are exported as before. D computes the given-up
    prompts itself ("recompute"): every output is one engine's. P frees every request, each
    once (the releases of those given up are no finished sends: vLLM freed those blocks)."""
    prompts, alone = prompts
    output, freed = pushed(model, prompts, tmp_path, 6380, "chunked", "preempt", env={"PD_POLICY": "recompute"})
    assert f"p{len(LENGTHS) - 1}" in freed["preempted"], freed
    assert output["reasons"] == ["length"] * len(LENGTHS), output
    assert output["tokens"] == alone
    reasons = freed["reasons"]
    assert freed["freed"] == len(LENGTHS), freed
    assert set(reasons) == {"transferred", "aborted"} and sum(reasons.values()) == len(LENGTHS), freed


def test_p_at_two_workers_into_d_at_one_equals_one_engine(model, prompts, tmp_path):
    """P at TP 2 (two worker processes, each a rank with half the KV heads) and D at TP 1:
    D's rank reads each P rank's heads of every block into its own, and its tokens equal one
    engine's; P frees every request once D read both ranks' blocks, and each worker process's
    kvflow metrics reach vLLM's registry."""
    prompts, alone = prompts
    output, freed = disaggregated(model, prompts, tmp_path, 5800, "tp2", env={"PD_STATS": "1"})
    assert output["tokens"] == alone
    assert freed["reasons"] == {"transferred": len(LENGTHS)}, freed
    # Both worker processes' kvflow metrics reach vLLM's registry, each under its rank.
    ranks = {labels["rank"] for name, labels, _ in freed["metrics"] if name == "vllm:kvflow_peers_connected"}
    assert ranks == {"0", "1"}, freed["metrics"]


def test_engines_in_both_roles_move_kv_as_producer_and_consumer_do(model, prompts, tmp_path):
    """Both engines kv_both (each worker a P rank and a D rank on agents of their own): the
    requests P was sent with do_remote_decode are exported, those D was sent with
    do_remote_prefill loaded, and D's tokens equal one engine's."""
    prompts, alone = prompts
    output, freed = disaggregated(model, prompts, tmp_path, 5820, "both", decode=["both"])
    assert output["tokens"] == alone
    assert freed["reasons"] == {"transferred": len(LENGTHS)}, freed


def test_requests_wait_in_d_queue_past_the_lease_while_d_renews_it_and_aborts_reach_p(model, prompts, tmp_path):
    """A 2 s lease; D's KV cache is full with a request of its own, so the others wait in vLLM's
    queue for blocks, tracked from on_new_request: D's ranks renew their leases, and each waits
    more than twice the lease, yet every one loads and decodes as one engine does (none expired
    at P). The last two are aborted while they wait: P frees them as aborted at once."""
    prompts, alone = prompts
    lease = 2
    output, freed = disaggregated(model, prompts, tmp_path, 5650, decode=["queued", "abort"], lease=lease)
    kept = len(LENGTHS) - 2
    assert output["tokens"][:kept] == alone[:kept]
    assert output["reasons"][kept:] == ["abort", "abort"]
    assert min(output["waited"][:kept]) > 2 * lease, output["waited"]
    assert freed["reasons"] == {"transferred": kept, "aborted": 2}, freed
    assert freed["freed"] == len(LENGTHS)


def test_parallel_sampling_siblings_at_p_are_all_freed_when_d_reads_one(model, prompts, tmp_path):
    """P runs each prompt with n = 2: two sibling requests, each exported, of which vLLM hands
    the proxy one handoff (NixlConnector strands the other until its lease ends). D reads that
    one; its completion releases both siblings at P at once."""
    prompts, alone = prompts
    output, freed = disaggregated(model, prompts, tmp_path, 5760, "n2")
    assert output["tokens"] == alone
    assert freed["freed"] == 2 * len(LENGTHS), freed
    assert freed["reasons"] == {"transferred": len(LENGTHS), "sibling": len(LENGTHS)}, freed


def test_parallel_sampling_siblings_at_d_share_one_read(model, prompts, tmp_path):
    """D runs each request with n = 2 (sampled, seeded): vLLM's two siblings share the handoff,
    the first reads P's export and the second waits for that load and takes its blocks from D's
    prefix cache. Both sample what one engine's siblings sample; P frees each export once, as
    transferred."""
    prompts, _ = prompts
    run("pd.py", "plain", model, prompts, str(tmp_path / "plain.json"), "n2")
    alone = json.loads((tmp_path / "plain.json").read_text())
    output, freed = disaggregated(model, prompts, tmp_path, 5840, decode=["n2"])
    assert output["tokens"] == alone
    assert freed["reasons"] == {"transferred": len(LENGTHS)}, freed


def test_a_decode_engine_killed_while_requests_wait_has_p_release_them_at_once(model, prompts, tmp_path):
    """D queues every request behind one of its own (its ranks claim them: D owns their
    exports), then is killed with SIGKILL: P sees its side channel close and frees every export
    at once (peer lost), long before their 60 s leases end."""
    prompts, _ = prompts
    output, freed = disaggregated(model, prompts, tmp_path, 5670, decode=["queued", "die"], d_exit=-9)
    reasons = freed["reasons"]
    assert freed["freed"] == len(LENGTHS), freed
    assert reasons == {"peer_lost": len(LENGTHS)}, reasons
    released_after = freed["freed_at"] - output["died_at"]
    assert released_after < 10, f"P freed the last export {released_after:.1f} s after D died"


def test_a_decode_engine_whose_blocks_differ_from_p_computes_the_prompt_itself(model, prompts, tmp_path):
    """D's blocks are 64 tokens, P's 128: vLLM's CPU blocks keep each head's K transposed, so
    they move only whole and these engines cannot exchange KV. D computes each prompt itself,
    with one engine's tokens; P frees every export when its (3 s) lease ends."""
    prompts, alone = prompts
    output, freed = disaggregated(model, prompts, tmp_path, 5690, decode=["block64"], lease=3)
    assert output["reasons"] == ["length"] * len(LENGTHS)
    assert output["tokens"] == alone
    assert freed["reasons"] == {"expired": len(LENGTHS)}, freed


def test_handoffs_a_client_made_up_are_computed_by_d_and_never_break_it(model, prompts, tmp_path):
    """Five requests reach D with kv_transfer_params D cannot use (a string for the handoff, a
    handoff of the wrong types, a layout that is a number beside P's real handoff, a block size
    of 0 beside another, P's export cut to one of its blocks), and one with only NixlConnector's
    fields of P's answer (a router that rebuilt them): D computes the first five itself, loads
    the rebuilt one and the others as before, and every token is one engine's. P frees the 3 D
    read and, at once, the 3 real exports the unusable handoffs named (D rejected them); the 2
    exported for the others wait for their lease."""
    prompts, alone = prompts
    output, freed = disaggregated(model, prompts, tmp_path, 6100, decode=["garbage"], env={"PD_DRAIN": "5"})
    assert output["tokens"] == alone
    assert freed["reasons"] == {"transferred": len(LENGTHS) - 5, "rejected": 3}, freed


def test_requests_d_rejects_before_admission_are_freed_at_p_at_once(model, prompts, tmp_path):
    """Two requests vLLM's serving layer refuses before admission (submitted aborted with their
    handoffs, as vLLM's OpenAI server does) and two whose prompt is not the one P computed (its
    first token dropped; its first token changed): D rejects all four and P frees them at once, as
    rejected, long before their 60 s leases end; D decodes each edited prompt from its own
    compute, as it does with no handoff, and loads the other four as one engine decodes."""
    prompts, alone = prompts
    output, freed = disaggregated(model, prompts, tmp_path, 6140, decode=["reject"], env={"PD_DRAIN": "5"})
    loaded = [1, 3, 5, 7]
    assert [output["tokens"][i] for i in loaded] == [alone[i] for i in loaded]
    assert [output["tokens"][i] for i in (0, 4)] == [alone[0], alone[4]]
    for with_handoff, computed in output["edited"]:
        assert with_handoff == computed
    assert freed["reasons"] == {"transferred": 4, "rejected": 4}, freed
    assert freed["freed"] == len(LENGTHS), freed


def test_a_load_from_a_prefill_engine_that_left_fails_and_nothing_decodes_from_it(model, tmp_path):
    """P exits right after its prefill: D's reads fail, and with vLLM's default
    kv_load_failure_policy ("fail") every request ends in error rather than decoding from
    blocks that hold no KV."""
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([[(13 * i + 7 * j) % 1000 + 1 for j in range(n)] for i, n in enumerate([40, 300])]))
    output, _ = disaggregated(model, str(prompts), tmp_path, 5720, "leave")
    assert output["reasons"] == ["error", "error"], output


def test_a_load_that_fails_under_recompute_is_computed_by_d_as_one_engine_would(model, prompts, tmp_path):
    """P exits right after its prefill; D's kv_load_failure_policy is "recompute": every read
    fails, the connector reports the blocks invalid, and vLLM computes the prompts itself, with
    the tokens one engine gives."""
    prompts, alone = prompts
    output, _ = disaggregated(model, prompts, tmp_path, 5740, "leave", policy="recompute")
    assert output["reasons"] == ["length"] * len(LENGTHS), output
    assert output["tokens"] == alone


def test_a_cluster_key_admits_its_holders_only(model, prompts, tmp_path):
    """Both engines read one cluster key from KVFLOW_CLUSTER_KEY_FILE: D loads as before. A D
    with another key never gets past P's side channel: its loads fail (under "fail" its
    requests end in error), and P holds the exports for their lease, freeing none for it."""
    prompts, alone = prompts
    keys = []
    for name in ("key-a", "key-b"):
        path = tmp_path / name
        path.write_text(secrets.token_hex(32))
        path.chmod(0o600)
        keys.append({"KVFLOW_CLUSTER_KEY_FILE": str(path)})
    (tmp_path / "same").mkdir()
    output, freed = disaggregated(model, prompts, tmp_path / "same", 5860, env=keys[0])
    assert output["tokens"] == alone
    assert freed["reasons"] == {"transferred": len(LENGTHS)}, freed
    (tmp_path / "other").mkdir()
    drain = dict(keys[0], PD_DRAIN="3")
    output, freed = disaggregated(model, prompts, tmp_path / "other", 5880, env=drain, d_env=keys[1])
    assert output["reasons"] == ["error"] * len(LENGTHS), output
    assert freed == dict(freed, freed=0, reasons={}), freed
