"""Two real vLLM engines, each in its own process, with kvflow's connector (pull) moving the KV
over NIXL: a prefill engine (kv_producer, max_tokens 1) and a decode engine (kv_consumer) that
decodes 16 greedy tokens from the KV it loaded. Its tokens equal a no-transfer engine's on
every prompt, P frees every request's blocks once D has read them, and with P's KV overwritten
by noise before D reads, every output changes: the tokens come from what moved."""

import json
import os
import subprocess
import sys
import time

from conftest import ENGINES, run

# Prompts of 3 to 520 tokens: within one of vLLM's 128-token CPU blocks, exactly one, just
# over, and spanning several.
LENGTHS = [3, 17, 64, 127, 128, 129, 300, 520]


def disaggregated(model, prompts, tmp_path, port, *flags):
    """D's output (tokens and finish reasons per prompt), and how many requests P freed (None
    if P left)."""
    handoffs, tokens, done = tmp_path / "handoffs.json", tmp_path / "tokens.json", tmp_path / "done"
    env = dict(os.environ, PD_PORT=str(port))
    args = ["prefill", model, prompts, str(handoffs), str(done), *flags]
    prefill = subprocess.Popen(
        [sys.executable, str(ENGINES / "pd.py"), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        deadline = time.monotonic() + 300
        while not handoffs.exists() and prefill.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert handoffs.exists(), f"P wrote no handoffs:\n{prefill.stderr.read()[-4000:] if prefill.poll() is not None else ''}"
        run("pd.py", "decode", model, prompts, str(tokens), str(handoffs), str(done), env=env)
        out, err = prefill.communicate(timeout=120)
    finally:
        if prefill.poll() is None:
            prefill.kill()
    assert prefill.returncode == 0, f"P failed:\n{err[-4000:]}"
    freed = None if "leave" in flags else json.loads(out.strip().splitlines()[-1])["freed"]
    return json.loads(tokens.read_text()), freed


def test_decode_from_kv_moved_by_kvflow_equals_one_engine(model, tmp_path):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([[(11 * i + 5 * j) % 1000 + 1 for j in range(n)] for i, n in enumerate(LENGTHS)]))
    run("pd.py", "plain", model, str(prompts), str(tmp_path / "plain.json"))
    alone = json.loads((tmp_path / "plain.json").read_text())
    assert [len(t) for t in alone] == [16] * len(LENGTHS)

    (tmp_path / "moved").mkdir()
    output, freed = disaggregated(model, str(prompts), tmp_path / "moved", 5610)
    assert output["tokens"] == alone
    assert freed == len(LENGTHS), "P frees every request's blocks once D read them"

    (tmp_path / "noise").mkdir()
    output, freed = disaggregated(model, str(prompts), tmp_path / "noise", 5630, "noise")
    changed = [t != a for t, a in zip(output["tokens"], alone)]
    assert all(changed), f"with P's KV replaced by noise, outputs {[i for i, c in enumerate(changed) if not c]} did not change"
    assert freed == len(LENGTHS)


def test_a_load_from_a_prefill_engine_that_left_fails_and_nothing_decodes_from_it(model, tmp_path):
    """P exits right after its prefill: D's reads fail, and with vLLM's default
    kv_load_failure_policy ("fail") every request ends in error rather than decoding from
    blocks that hold no KV."""
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([[(13 * i + 7 * j) % 1000 + 1 for j in range(n)] for i, n in enumerate([40, 300])]))
    output, _ = disaggregated(model, str(prompts), tmp_path, 5650, "leave")
    assert output["reasons"] == ["error", "error"], output
