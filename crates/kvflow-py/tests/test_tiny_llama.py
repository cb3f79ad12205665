"""tiny-llama (kv-model, issue 33) as Hugging Face's transformers loads it: the model kvflow's
engines run, written by `tiny_llama DIR` (config.json and model.safetensors with transformers'
tensor names), gives the tokens kvflow's forward pass generates. Each generated token,
teacher-forced, is transformers' argmax, or loses to it only by rounding (less than 1e-3 of the
logits' scale)."""

import json
import os
import subprocess

import pytest
from check_tokens import disagreements, load


def test_transformers_agrees_with_every_token_tiny_llama_generates(tmp_path):
    binary = os.environ.get("KVFLOW_TINY_LLAMA")
    if not binary:
        pytest.fail("KVFLOW_TINY_LLAMA names no tiny_llama binary: run the tests with `cargo xtask vllm`")
    done = subprocess.run([binary, str(tmp_path / "model"), "20"], capture_output=True, text=True, timeout=300, check=True)
    requests = json.loads(done.stdout)["requests"]
    assert len(requests) == 20 and all(len(r["generated_ids"]) == 16 for r in requests)
    disagree = disagreements(load(tmp_path / "model"), requests)
    assert not disagree, f"transformers' argmax differs beyond rounding at {disagree}"
    assert len({tuple(r["generated_ids"]) for r in requests}) >= 18, "the prompts decode to too few distinct sequences"
