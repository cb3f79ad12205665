"""One vLLM engine of the disaggregated test, in a process of its own:

``pd.py plain MODEL PROMPTS OUT [n2]``: no transfer, 16 greedy tokens per prompt (with ``n2``,
n = 2, sampled with a seed: both siblings' tokens).
``pd.py prefill MODEL PROMPTS OUT DONE [noise] [leave] [n2] [tp2] [after-ready] [both]``: P
(kv_producer, or kv_both with ``both``; with ``after-ready``, once the file ``PD_READY`` names
exists) computes each prompt with max_tokens 1 (with ``n2``, n = 2: two parallel-sampling
siblings, of which vLLM returns one handoff; with ``tp2``, at TP 2: two worker processes, each
a rank of its own), writes the handoffs (kv_transfer_params) to OUT, optionally overwrites its
whole KV cache with noise (or exits at once: leave), serves D's reads until DONE exists, then
steps until vLLM has freed every request's blocks (the connector reported them finished
sending) and prints what it freed.
``pd.py decode MODEL PROMPTS OUT HANDOFFS DONE [queued] [abort] [die] [block64] [both] [n2]
[garbage] [reject]``: D (kv_consumer, or kv_both with ``both``; with ``n2``, n = 2, sampled with a seed,
both siblings' tokens per prompt; with ``garbage``, prompts 1, 3 and 5 come with handoffs a
client made up, 4 with NixlConnector's fields of P's answer only, 6 with a block size of 0, and 7 with
P's export cut to one block) decodes 16 greedy tokens per prompt from the KV it loads through
the handoff, writes them and each request's finish reason to OUT, then creates DONE. One request at a time,
or with ``queued`` all of them at once into an engine whose KV cache (8 blocks, 1024 tokens) a
request computed there first fills for 120 tokens of decode (50 ms a step), so they wait in
vLLM's queue for blocks (OUT also gets how long each waited for its first token); with
``abort`` the last two are aborted while they wait, with ``die`` D kills itself (SIGKILL) a
second after they were queued, writing the time first. ``reject``: as ``rejected`` says.
``block64``: D's blocks are 64 tokens,
P's 128.

``pd.py push-prefill MODEL PROMPTS OUT DONE GO [chunked] [abort] [preempt]`` and ``pd.py push-decode MODEL
PROMPTS OUT DONE GO``: push (``KvflowPushConnector``), with the requests at D first, as a proxy sends them. P
starts, creates GO.ready and waits for GO; D queues every request with a handoff it built from what a proxy knows
ahead (P's engine id and side-channel address, the request id it gives P, the prompt's length),
so its ranks register its blocks with P's, then creates GO; P computes the prompts under those
ids and writes their KV into D's blocks; D decodes 16 greedy tokens per prompt as above. With
``chunked`` P computes at most 96 tokens a step (vLLM's chunked prefill: a longer prompt takes
several steps, whose chunks end inside its 128-token blocks), and its ranks write each chunk's
layers as vLLM stores them; with ``abort`` P aborts the last prompt once vLLM has scheduled 192
of its tokens (after one of its chunks went ahead), with ``preempt`` it preempts every request
running then (as vLLM's ``reset_prefix_cache`` does), and its output also gives the tokens
scheduled of the last prompt then and the requests preempted.

With ``PD_STATS=1`` both engines keep vLLM's stats, and their outputs give kvflow's samples on
vLLM's Prometheus registry. ``PD_DRAIN`` is how long P steps after DONE for its requests to be freed (30 s by default).
``PD_LEASE`` (seconds, 60 by default) is both engines' ``kv_lease_duration``, ``PD_POLICY``
their ``kv_load_failure_policy`` (``fail`` by default); P's output also
gives its exports freed by reason and when its last request was freed, on a line of its own
that starts with ``RESULT`` (vLLM's workers log to stdout too).
"""

import json
import os
import signal
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def engine(model, role, port, connector="KvflowConnector", engine_id=None, **options):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    config = None
    if role:
        os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(port)
        config = KVTransferConfig(
            kv_connector=connector,
            **({"engine_id": engine_id} if engine_id else {}),
            kv_connector_module_path="kvflow.vllm",
            kv_role=role,
            kv_connector_extra_config={"kv_lease_duration": float(os.environ.get("PD_LEASE", "60"))},
            kv_load_failure_policy=os.environ.get("PD_POLICY", "fail"),
        )
    return LLM(
        model=model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        max_model_len=1024,
        seed=0,
        kv_transfer_config=config,
        disable_log_stats=os.environ.get("PD_STATS") != "1",
        **options,
    )


def kvflow_metrics():
    """kvflow's samples on this process's Prometheus registry (vLLM's endpoint shows it), and
    vLLM's count of prompt tokens a connector held (external prefix cache): ``[name, labels,
    value]`` without vLLM's own labels."""
    from prometheus_client import REGISTRY

    return [
        [sample.name, {k: v for k, v in sample.labels.items() if k not in ("model_name", "engine")}, sample.value]
        for family in REGISTRY.collect()
        for sample in family.samples
        if sample.name.startswith(("vllm:kvflow_", "vllm:external_prefix_cache_")) and not sample.name.endswith("_created")
    ]


def params(max_tokens, kv_transfer_params=None, n=1, temperature=1.0):
    from vllm import SamplingParams

    extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
    # vLLM refuses n > 1 with greedy sampling: siblings sample, seeded (sibling i with seed i),
    # so two engines that compute the same logits sample the same tokens.
    sampling = {"temperature": temperature, "seed": 0} if n > 1 else {"temperature": 0}
    return SamplingParams(max_tokens=max_tokens, n=n, detokenize=False, extra_args=extra, **sampling)


def queued(llm, prompts, handoffs_path, flags, out, done):
    """Every prompt into an engine whose KV cache a request of its own fills while it decodes
    (stepping 80 ms apart), so that they wait in vLLM's queue for blocks. Once that request
    runs, D creates ``PD_READY`` (P waits for it before it computes anything, so that no lease
    starts before D is up) and takes the handoffs as soon as P has written them."""
    engine, ids = llm.llm_engine, [f"r{i}" for i in range(len(prompts))]
    added, first, tokens, reasons = {}, {}, {}, {}
    handoffs = []

    def add(i):
        added[ids[i]] = time.monotonic()
        engine.add_request(ids[i], prompts[i], params(16, handoffs[i]))

    def step(until, seconds=120):
        deadline = time.monotonic() + seconds
        while not until() and time.monotonic() < deadline:
            for output in engine.step():
                got = list(output.outputs[0].token_ids)
                tokens[output.request_id] = got
                if got:
                    first.setdefault(output.request_id, time.monotonic())
                if output.finished:
                    reasons[output.request_id] = output.outputs[0].finish_reason
            time.sleep(0.08)

    engine.add_request("hog", {"prompt_token_ids": [7] * 900}, params(120))
    step(lambda: "hog" in first)
    open(os.environ["PD_READY"], "w").write("ready")
    step(lambda: os.path.exists(handoffs_path))
    handoffs.extend(json.load(open(handoffs_path)))
    for i in range(len(prompts)):
        add(i)
    if "die" in flags:
        step(lambda: False, 1.0)
        json.dump({"died_at": time.time()}, open(out, "w"))
        open(done, "w").write("done")
        os.kill(os.getpid(), signal.SIGKILL)
    if "abort" in flags:
        step(lambda: False, 0.5)
        engine.abort_request(ids[-2:])
        for rid in ids[-2:]:
            reasons.setdefault(rid, "abort")
    step(lambda: all(rid in reasons for rid in ids + ["hog"]))
    return {
        "tokens": [tokens.get(rid) for rid in ids],
        "reasons": [reasons.get(rid) for rid in ids],
        "waited": [first[rid] - added[rid] if rid in first else None for rid in ids],
    }


def rejected(llm, prompts, handoffs):
    """Requests D does not load: 0 and 4 vLLM's serving layer refused before admission (it
    submits them aborted, with their handoffs, through ``notify_kv_transfer_request_rejected``,
    called here as vLLM's OpenAI server calls it), 2 comes without its first token and 6 with
    its first token changed. The others load. Every prompt's tokens are then what D
    decodes for it (the refused ones sent again without a handoff, as a client would), and
    ``edited`` those of the edited prompts with their handoffs and without."""
    import asyncio
    import types

    from vllm.v1.engine.async_llm import AsyncLLM

    core = llm.llm_engine.engine_core

    async def add_request_async(request):
        core.add_request(request)

    serving = types.SimpleNamespace(engine_core=types.SimpleNamespace(add_request_async=add_request_async))
    for i in (0, 4):
        asyncio.run(AsyncLLM.notify_kv_transfer_request_rejected(serving, f"refused{i}", handoffs[i]))
        handoffs[i] = None
    # (vLLM computes a prompt's last token again after a load: edits before it are what count.)
    edited = {2: prompts[2]["prompt_token_ids"][1:], 6: [2] + prompts[6]["prompt_token_ids"][1:]}
    tokens, edited_tokens = [], []
    for i, prompt in enumerate(prompts):
        prompt = {"prompt_token_ids": edited[i]} if i in edited else prompt
        tokens.append(list(llm.generate([prompt], params(16, handoffs[i]))[0].outputs[0].token_ids))
        if i in edited:
            edited_tokens.append([tokens[-1], list(llm.generate([prompt], params(16))[0].outputs[0].token_ids)])
    return {"tokens": tokens, "edited": edited_tokens}


PUSH_PREFILL = "kvflow-push-prefill"


def push_prefill(model, prompts, done, go, flags):
    port = int(os.environ.get("PD_PORT", "5610"))
    options = {"max_num_batched_tokens": 96, "max_num_seqs": 8} if "chunked" in flags else {}
    llm = engine(model, "kv_producer", port, connector="KvflowPushConnector", engine_id=PUSH_PREFILL, **options)
    open(go + ".ready", "w").write("ready")
    for _ in wait_for(go, 300):
        time.sleep(0.05)
    engine_ = llm.llm_engine
    nixl = os.environ.get("PD_FORM") == "nixl"
    for i, prompt in enumerate(prompts):
        # vLLM's push proxy pairs the legs by a transfer id, each leg under its own request id.
        handoff = {"do_remote_decode": True, "transfer_id": f"xfer-{i}"} if nixl else {"do_remote_decode": True}
        engine_.add_request(f"p{i}", prompt, params(1, handoff))
    aborted_at, preempted = None, []
    if "abort" in flags or "preempt" in flags:
        last, scheduler = f"p{len(prompts) - 1}", engine_.engine_core.engine_core.scheduler
        # vLLM's own id of a request is the one given with a random suffix.
        external = lambda rid: rid.rsplit("-", 1)[0]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            engine_.step()
            request = next((r for rid, r in scheduler.requests.items() if external(rid) == last), None)
            if request is None or request.num_computed_tokens >= 192:
                aborted_at = request and request.num_computed_tokens
                break
        if "abort" in flags:
            engine_.abort_request([last])
        else:
            preempted = [external(r.request_id) for r in scheduler.running]
            try:
                engine_.reset_prefix_cache(reset_running_requests=True)
            except RuntimeError:
                # The blocks of exports D's writes still read keep the prefix cache; the
                # preemption is done.
                pass
    return dict(serve_until_freed(llm, len(prompts), done), aborted_at=aborted_at, preempted=preempted)


def serve_until_freed(llm, requests, done):
    """P steps, serving D, until ``done`` exists, then for ``PD_DRAIN`` seconds at most (30 by
    default) until vLLM freed every request's blocks; what it freed, by reason, and when."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    for _ in wait_for(done, 300):
        llm.llm_engine.step()
        time.sleep(0.01)
    deadline = time.monotonic() + float(os.environ.get("PD_DRAIN", "30"))
    while scheduler.requests and time.monotonic() < deadline:
        llm.llm_engine.step()
        time.sleep(0.01)
    return {
        "freed": requests - len(scheduler.requests),
        "reasons": dict(scheduler.connector.freed_by_reason),
        "freed_at": time.time(),
        "metrics": kvflow_metrics(),
    }


def push_decode(model, prompts, done, go):
    port = int(os.environ.get("PD_PORT", "5610"))
    llm = engine(model, "kv_consumer", port + 100, connector="KvflowPushConnector")
    nixl = os.environ.get("PD_FORM") == "nixl"
    # kvflow's form: the proxy gives both legs of a request one id. NixlPushConnector's: each leg
    # its own, and P's coordinates with the transfer id that pairs them.
    engine_, ids = llm.llm_engine, [f"{'d' if nixl else 'p'}{i}" for i in range(len(prompts))]
    # P's one rank on its engine's side-channel port (host:port/tpRANK, as P's answer lists it).
    prefill = {"engine": PUSH_PREFILL, "addresses": [f"127.0.0.1:{port}/tp0"], "tp_size": 1, "pp_size": 1}
    for i, (rid, prompt) in enumerate(zip(ids, prompts)):
        if nixl:
            handoff = {
                "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": PUSH_PREFILL,
                "remote_host": "localhost", "remote_port": port, "tp_size": 1, "pp_size": 1,
                "remote_request_id": None, "transfer_id": f"xfer-{i}",
            }
        else:
            remote = {
                "prefill": prefill,
                "request": rid,
                "instance": None,
                "prompt_tokens": len(prompt["prompt_token_ids"]),
                "export": None,
                "consumer": None,
            }
            handoff = {"kvflow": remote, "do_remote_prefill": True}
        engine_.add_request(rid, prompt, params(16, handoff))
    tokens, reasons = {}, {}

    def step():
        for output in engine_.step():
            tokens[output.request_id] = list(output.outputs[0].token_ids)
            if output.finished:
                reasons[output.request_id] = output.outputs[0].finish_reason
        time.sleep(0.01)

    # A few steps: vLLM allocates the blocks and the ranks register them with P's.
    for _ in range(20):
        step()
    open(go, "w").write("go")
    deadline = time.monotonic() + 180
    while len(reasons) < len(ids) and time.monotonic() < deadline:
        step()
    return {"tokens": [tokens.get(rid) for rid in ids], "reasons": [reasons.get(rid) for rid in ids]}


def wait_for(path, seconds):
    deadline = time.monotonic() + seconds
    while not os.path.exists(path) and time.monotonic() < deadline:
        yield


if __name__ == "__main__":
    what, model, prompts, out = sys.argv[1:5]
    prompts = [{"prompt_token_ids": p} for p in json.load(open(prompts))]
    if what == "plain":
        if "n2" in sys.argv[5:]:
            outputs = engine(model, None, 0).generate(prompts, params(16, n=2))
            json.dump([[list(c.token_ids) for c in o.outputs] for o in outputs], open(out, "w"))
        else:
            outputs = engine(model, None, 0).generate(prompts, params(16))
            json.dump([list(o.outputs[0].token_ids) for o in outputs], open(out, "w"))
    elif what == "prefill":
        done, noise, leave = sys.argv[5], "noise" in sys.argv[6:], "leave" in sys.argv[6:]
        n = 2 if "n2" in sys.argv[6:] else 1
        tp = {}
        if "tp2" in sys.argv[6:]:
            tp = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
            # vLLM binds each CPU worker to a NUMA node of its own unless told otherwise.
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        role = "kv_both" if "both" in sys.argv[6:] else "kv_producer"
        llm = engine(model, role, int(os.environ.get("PD_PORT", "5610")), **tp)
        if "after-ready" in sys.argv[6:]:
            for _ in wait_for(os.environ["PD_READY"], 300):
                time.sleep(0.1)
        outputs = llm.generate(prompts, params(1, {"do_remote_decode": True}, n))
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
        print("RESULT", json.dumps(serve_until_freed(llm, n * len(prompts), done)))
    elif what == "push-prefill":
        print("RESULT", json.dumps(push_prefill(model, prompts, sys.argv[5], sys.argv[6], sys.argv[7:])))
    elif what == "push-decode":
        json.dump(push_decode(model, prompts, sys.argv[5], sys.argv[6]), open(out, "w"))
        open(sys.argv[5], "w").write("done")
    elif what == "decode":
        handoffs, done, flags = sys.argv[5], sys.argv[6], sys.argv[7:]
        options = {"block_size": 64} if "block64" in flags else {}
        if "queued" in flags:
            # 8 blocks and vLLM's null block.
            options["num_gpu_blocks_override"] = 9
        role = "kv_both" if "both" in flags else "kv_consumer"
        llm = engine(model, role, int(os.environ.get("PD_PORT", "5610")) + 100, **options)
        if "queued" in flags:
            result = queued(llm, prompts, handoffs, flags, out, done)
        elif "reject" in flags:
            result = rejected(llm, prompts, json.load(open(handoffs)))
        else:
            tokens, reasons = [], []
            n = 2 if "n2" in flags else 1
            handoffs = json.load(open(handoffs))
            if "garbage" in flags:
                # What a client may send instead of P's handoff.
                handoffs[1] = {"do_remote_prefill": True, "kvflow": "not a handoff"}
                handoffs[3] = {"do_remote_prefill": True, "kvflow": {"prefill": [], "request": {}}}
                # P's answer as a router that rebuilds NixlConnector's fields passes it on.
                handoffs[4] = {k: v for k, v in handoffs[4].items() if not k.startswith("kvflow")}
                handoffs[5] = dict(handoffs[5], kvflow_layout=5)
                handoffs[6] = dict(handoffs[6], kvflow_layout={"block_size": 0})
                # P's real export, cut to one of its 5 blocks.
                export = dict(handoffs[7]["kvflow"]["export"], blocks=handoffs[7]["kvflow"]["export"]["blocks"][:1])
                handoffs[7] = dict(handoffs[7], kvflow=dict(handoffs[7]["kvflow"], export=export))
            for prompt, handoff in zip(prompts, handoffs):
                output = llm.generate([prompt], params(16, handoff, n))[0]
                if n == 1:
                    tokens.append(list(output.outputs[0].token_ids))
                    reasons.append(output.outputs[0].finish_reason)
                else:
                    tokens.append([list(o.token_ids) for o in output.outputs])
                    reasons.append([o.finish_reason for o in output.outputs])
            result = {"tokens": tokens, "reasons": reasons, "metrics": kvflow_metrics()}
        json.dump(result, open(out, "w"))
        open(done, "w").write("done")
