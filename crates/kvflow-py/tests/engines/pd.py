"""One vLLM engine of the disaggregated test, in a process of its own:

``pd.py plain MODEL PROMPTS OUT``: no transfer, 16 greedy tokens per prompt.
``pd.py prefill MODEL PROMPTS OUT DONE [noise] [leave]``: P (kv_producer) computes each prompt
with max_tokens 1, writes the handoffs (kv_transfer_params) to OUT, optionally overwrites its
whole KV cache with noise (or exits at once: leave), serves D's reads until DONE exists, then steps until vLLM has freed every
request's blocks (the connector reported them finished sending) and prints ``{"freed": n}``.
``pd.py decode MODEL PROMPTS OUT HANDOFFS DONE``: D (kv_consumer) decodes 16 greedy tokens per
prompt from the KV it loads through the handoff, writes them and each request's finish reason
to OUT, then creates DONE.
"""

import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def engine(model, role, port):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    config = None
    if role:
        os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(port)
        config = KVTransferConfig(
            kv_connector="KvflowConnector",
            kv_connector_module_path="kvflow.vllm",
            kv_role=role,
            kv_connector_extra_config={"kv_lease_duration": 60},
        )
    return LLM(
        model=model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        max_model_len=1024,
        seed=0,
        kv_transfer_config=config,
    )


def params(max_tokens, kv_transfer_params=None):
    from vllm import SamplingParams

    extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
    return SamplingParams(max_tokens=max_tokens, temperature=0, detokenize=False, extra_args=extra)


def wait_for(path, seconds):
    deadline = time.monotonic() + seconds
    while not os.path.exists(path) and time.monotonic() < deadline:
        yield


if __name__ == "__main__":
    what, model, prompts, out = sys.argv[1:5]
    prompts = [{"prompt_token_ids": p} for p in json.load(open(prompts))]
    if what == "plain":
        outputs = engine(model, None, 0).generate(prompts, params(16))
        json.dump([list(o.outputs[0].token_ids) for o in outputs], open(out, "w"))
    elif what == "prefill":
        done, noise, leave = sys.argv[5], "noise" in sys.argv[6:], "leave" in sys.argv[6:]
        llm = engine(model, "kv_producer", int(os.environ.get("PD_PORT", "5610")))
        outputs = llm.generate(prompts, params(1, {"do_remote_decode": True}))
        if noise:
            import torch
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            with torch.no_grad():
                for layer in get_kv_transfer_group()._kv_caches.values():
                    layer.normal_()
        json.dump([o.kv_transfer_params for o in outputs], open(out + ".tmp", "w"))
        os.rename(out + ".tmp", out)
        if leave:
            # Gone before D reads: its side channel closes with the process.
            os._exit(0)
        for _ in wait_for(done, 300):
            llm.llm_engine.step()
            time.sleep(0.01)
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        deadline = time.monotonic() + 30
        while scheduler.requests and time.monotonic() < deadline:
            llm.llm_engine.step()
            time.sleep(0.01)
        print(json.dumps({"freed": len(prompts) - len(scheduler.requests)}))
    elif what == "decode":
        handoffs, done = json.load(open(sys.argv[5])), sys.argv[6]
        llm = engine(model, "kv_consumer", int(os.environ.get("PD_PORT", "5610")) + 100)
        tokens, reasons = [], []
        for prompt, handoff in zip(prompts, handoffs):
            output = llm.generate([prompt], params(16, handoff))[0]
            tokens.append(list(output.outputs[0].token_ids))
            reasons.append(output.outputs[0].finish_reason)
        json.dump({"tokens": tokens, "reasons": reasons}, open(out, "w"))
        open(done, "w").write("done")
