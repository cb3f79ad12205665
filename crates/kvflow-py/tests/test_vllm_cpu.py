"""vLLM runs a real model on this machine's CPU: the ground the connector's tests stand on.

A random Llama-architecture model saved locally; vLLM's greedy tokens, from prompts of 5 to
260 tokens (several of vLLM's 128-token CPU blocks), equal transformers' on every prompt. Each
engine runs in a process of its own, as the connector's engines will.
"""

import json

from conftest import run


def test_vllm_decodes_as_transformers_does(model):
    prompts = [[(7 * i + 3 * j) % 1000 + 1 for j in range(n)] for i, n in enumerate([5, 40, 130, 260])]
    args = (model, json.dumps(prompts), "16")
    by_vllm = json.loads(run("generate.py", "vllm", *args).strip().splitlines()[-1])
    by_transformers = json.loads(run("generate.py", "transformers", *args).strip().splitlines()[-1])
    assert [len(t) for t in by_vllm] == [16] * len(prompts)
    assert by_vllm == by_transformers
