"""Greedy generation from token ids, by vLLM (its CPU platform, one engine in this process) or by
transformers, printed as one JSON line: ``generate.py vllm|transformers MODEL PROMPTS_JSON MAX``.
"""

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def with_vllm(model: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, skip_tokenizer_init=True, enforce_eager=True, dtype="float32", max_model_len=1024, seed=0)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [list(o.outputs[0].token_ids) for o in outputs]


def with_transformers(model: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    import torch
    from transformers import LlamaForCausalLM

    llama = LlamaForCausalLM.from_pretrained(model, torch_dtype=torch.float32)
    out = []
    for p in prompts:
        ids = llama.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False)
        out.append(ids[0, len(p) :].tolist())
    return out


if __name__ == "__main__":
    engine, model, prompts, max_tokens = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
    run = {"vllm": with_vllm, "transformers": with_transformers}[engine]
    print(json.dumps(run(model, prompts, max_tokens)))
