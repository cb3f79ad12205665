"""Where each worker's rank listens when one host runs several ranks, engines and roles, and
what parallelism the connector refuses."""

import itertools

import pytest
from vllm.config import KVTransferConfig, ParallelConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kvflow.vllm import KvflowConnector, side_channel_port


def test_every_rank_of_a_host_s_data_parallel_engines_listens_on_a_port_of_its_own():
    for dp, tp, roles in itertools.product((1, 2, 4), (1, 2, 8), (1, 2)):
        ports = [
            side_channel_port(5600, dp_index, roles, role, tp, tp_rank)
            for dp_index in range(dp)
            for role in range(roles)
            for tp_rank in range(tp)
        ]
        assert len(set(ports)) == len(ports), (dp, tp, roles, ports)
        # NixlConnector's layout where it coincides: one engine, one role, the base plus the
        # TP rank.
        assert min(ports) == 5600 and max(ports) == 5600 + dp * tp * roles - 1
    assert side_channel_port(5600, 0, 1, 0, 2, 1) == 5601
    # kv_both at TP 2, the second data-parallel engine: its P ranks, then its D ranks.
    assert [side_channel_port(5600, 1, 2, role, 2, rank) for role in (0, 1) for rank in (0, 1)] == [5604, 5605, 5606, 5607]


def test_pipeline_parallel_engines_are_refused_naming_the_size():
    transfer = KVTransferConfig(kv_connector="KvflowConnector", kv_connector_module_path="kvflow.vllm", kv_role="kv_producer")
    config = VllmConfig(parallel_config=ParallelConfig(pipeline_parallel_size=2), kv_transfer_config=transfer)
    with pytest.raises(ValueError, match="pipeline parallel size 1, not 2"):
        KvflowConnector(config, KVConnectorRole.SCHEDULER)
