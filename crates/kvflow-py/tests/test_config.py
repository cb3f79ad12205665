"""vLLM's own ``KVTransferConfig``, as a user writes ``--kv-transfer-config``, gives kvflow's
connector its settings, and a bad one is refused naming the value."""

import pytest
from vllm.config import KVTransferConfig

from kvflow.config import settings


def config(connector="KvflowConnector", **extra):
    return KVTransferConfig(
        kv_connector=connector,
        kv_role="kv_producer",
        kv_connector_module_path="kvflow.vllm",
        kv_connector_extra_config=extra,
    )


def test_vllm_s_config_gives_the_connector_s_settings():
    pull = settings(config(kv_lease_duration=6.0))
    assert pull["mode"] == "pull"
    assert pull["kv_role"] == "kv_producer"
    assert pull["kv_connector_module_path"] == "kvflow.vllm"
    assert pull["engine_id"]  # vLLM makes one up
    assert pull["kv_lease_duration"] == 6.0
    assert pull["heartbeat_interval"] == pytest.approx(1.0)  # lease / 6
    assert pull["heartbeat_lease_extension"] == pytest.approx(4.0)  # 2 x lease / 3
    assert pull["kv_load_failure_policy"] == "fail"  # vLLM's default
    push = settings(config("KvflowPushConnector", num_threads=4))
    assert (push["mode"], push["num_threads"], push["kv_lease_duration"]) == ("push", 4, 30.0)


@pytest.mark.parametrize(
    "connector, extra, says",
    [
        ("KvflowConnector", {"kv_lease_duration": 0}, "kv_lease_duration must be positive, not 0"),
        ("KvflowConnector", {"kv_leese_duration": 5}, "unknown field `kv_leese_duration`"),
        ("KvflowConnector", {"mode": "push"}, "push"),
        ("KvflowConnector", {"backends": ["MOONCAKE"]}, "MOONCAKE"),
        ("LMCacheConnectorV1", {}, "LMCacheConnectorV1"),
    ],
)
def test_a_bad_config_is_refused_naming_the_value(connector, extra, says):
    with pytest.raises(ValueError, match="kv_transfer_config") as refused:
        settings(config(connector, **extra))
    assert says in str(refused.value)
