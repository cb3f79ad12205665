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


def test_a_newer_vllm_s_fields_and_nixl_connector_s_keys_start_the_engine_with_a_warning():
    # A deployment's config written for NixlConnector, run on a vLLM that added a field.
    given = {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_producer",
        "kv_cache_prefetch": True,
        "kv_connector_extra_config": {"engine_ttl": 600, "enforce_handshake_compat": False, "backends": ["UCX"]},
    }
    read = settings(given)
    assert read["mode"] == "pull"
    assert read["ignored_keys"] == ["kv_cache_prefetch"]
    assert read["warnings"] == [
        "kv_connector_extra_config keys of NixlConnector that kvflow does not act on are ignored: "
        "enforce_handshake_compat, engine_ttl"
    ]
    assert settings(config())["warnings"] == []
    with pytest.raises(ValueError, match="unknown field `engine_tll`"):
        settings(config(engine_tll=600))


def test_the_old_abort_timeout_variable_sets_the_lease_with_a_warning(monkeypatch):
    monkeypatch.setenv("VLLM_NIXL_ABORT_REQUEST_TIMEOUT", "120")
    read = settings(config())
    assert read["kv_lease_duration"] == 120.0
    assert read["heartbeat_interval"] == pytest.approx(20.0)
    assert "VLLM_NIXL_ABORT_REQUEST_TIMEOUT=120 sets the lease" in read["warnings"][0]
    assert settings(config(kv_lease_duration=6.0))["kv_lease_duration"] == 6.0
    monkeypatch.setenv("VLLM_NIXL_ABORT_REQUEST_TIMEOUT", "soon")
    with pytest.raises(ValueError, match='VLLM_NIXL_ABORT_REQUEST_TIMEOUT="soon" is not a number of seconds'):
        settings(config())


def test_warnings_a_client_can_cause_are_limited_and_say_how_many_were_left_out(monkeypatch):
    from kvflow import vllm

    lines = []
    monkeypatch.setattr(vllm.logger, "warning", lambda message, *args: lines.append(message % args))
    clock = [100.0]
    monkeypatch.setattr(vllm.time, "monotonic", lambda: clock[0])
    limited = vllm._Limited(per_window=2, window=10.0)
    for i in range(5):
        limited.warning("refused", "%s's handoff is refused", f"req-{i}")
    limited.warning("unpaired", "%s is not paired", "req-9")
    assert lines == ["kvflow: req-0's handoff is refused", "kvflow: req-1's handoff is refused", "kvflow: req-9 is not paired"]
    clock[0] += 10
    limited.warning("refused", "%s's handoff is refused", "req-5")
    assert lines[-1] == "kvflow: req-5's handoff is refused (3 like it left out before)"
