"""``load.py MODEL``: both of kvflow's connector classes, built by vLLM's own factory from their
module path, in every ``kv_role`` and both connector roles (scheduler, worker), with this
Python's vLLM and kvflow; prints ``RESULT`` and, for each, the class vLLM built, the role and
whether P's and D's schedulers are there."""

import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

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
                    }
                )
                connector.shutdown()
    print("RESULT", json.dumps(loaded))
