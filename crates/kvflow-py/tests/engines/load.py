"""``load.py MODEL``: both of kvflow's connector classes, built by vLLM's own factory from their
module path, in every ``kv_role`` and both connector roles (scheduler, worker), with this
Python's vLLM and kvflow; prints ``RESULT`` and, for each, the class vLLM built, the role and
whether P's and D's schedulers are there. A consumer's scheduler side also takes a request
vLLM's own way (its ``Request`` from an ``EngineCoreRequest`` carrying a handoff) through the
hooks vLLM calls before a load: ``on_new_request``, ``get_num_new_matched_tokens``,
``update_state_after_alloc``, ``build_connector_meta``, and ``request_finished`` once aborted
(``flow`` in the output: what each returned)."""

import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

def flow(connector, push):
    """One request with a handoff through D's scheduler-side hooks, vLLM's objects throughout."""
    import time

    from vllm import SamplingParams
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.request import Request, RequestStatus

    prompt = list(range(1, 301))
    # The engine's own block size (vLLM's CPU build 128, its CUDA build 16), which P shares.
    blocks = -(-len(prompt) // connector._block_size)
    handoff = {
        "do_remote_prefill": True,
        "kvflow": {
            "prefill": {"engine": "p0", "addresses": ["127.0.0.1:9"], "tp_size": 1, "pp_size": 1},
            "request": "r0",
            "instance": None,
            "prompt_tokens": len(prompt),
            # Pull reads P's export (its lease's deadline and P's finish on P's clock, in ns);
            # push, whose request reaches D first, has none yet.
            "export": None if push else {"blocks": list(range(blocks)), "deadline": 10**18, "finished": 0},
            "consumer": None,
        },
    }
    sampling = SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": handoff})
    core = EngineCoreRequest(
        request_id="r0",
        prompt_token_ids=prompt,
        mm_features=None,
        sampling_params=sampling,
        pooling_params=None,
        arrival_time=time.time(),
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
    )
    request = Request.from_engine_core_request(core, None)
    connector.on_new_request(request)
    matched = connector.get_num_new_matched_tokens(request, 0)

    class Blocks:  # vLLM's KVCacheBlocks, as far as the hook reads it
        def get_block_ids(self):
            return (list(range(4, 4 + blocks)),)

    connector.update_state_after_alloc(request, Blocks(), matched[0])
    meta = connector.build_connector_meta(None)
    request.status = RequestStatus.FINISHED_ABORTED
    finished = connector.request_finished(request, Blocks().get_block_ids()[0])
    commands = [json.loads(c) for c in meta.decode.get(0, [])]
    return {"matched": list(matched), "commands": sorted(k for c in commands for k in c), "finished": list(finished)}


if __name__ == "__main__":
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs

    loaded = []
    for name in ("KvflowConnector", "KvflowPushConnector"):
        for kv_role in ("kv_producer", "kv_consumer", "kv_both"):
            transfer = KVTransferConfig(kv_connector=name, kv_connector_module_path="kvflow.vllm", kv_role=kv_role)
            args = EngineArgs(model=sys.argv[1], skip_tokenizer_init=True, enforce_eager=True, kv_transfer_config=transfer)
            config = args.create_engine_config()
            for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
                connector = KVConnectorFactory.create_connector(config, role, None)
                loaded.append(
                    {
                        "class": type(connector).__module__ + "." + type(connector).__name__,
                        "kv_role": kv_role,
                        "role": role.name,
                        "decode_scheduler": connector._decode is not None,
                        # The KV cache layout the connector asks vLLM for.
                        "required_layout": type(connector).get_required_kvcache_layout(config),
                    }
                )
                if role == KVConnectorRole.SCHEDULER and kv_role == "kv_consumer":
                    loaded[-1]["flow"] = flow(connector, name == "KvflowPushConnector")
                connector.shutdown()
    print("RESULT", json.dumps(loaded))
