"""Where each data-parallel engine listens, and what parallelism the connector refuses."""

import pytest
from vllm.config import KVTransferConfig, ParallelConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kvflow.vllm import KvflowConnector, side_channel_port


def test_each_data_parallel_engine_listens_on_the_base_port_plus_its_index():
    # NixlConnector's plan: one port per data-parallel engine, shared by its TP ranks (and by
    # both roles of a kv_both engine); test_rank.py runs two ranks on one port.
    assert [side_channel_port(5600, dp_index) for dp_index in range(4)] == [5600, 5601, 5602, 5603]


def test_pipeline_parallel_engines_are_refused_naming_the_size():
    transfer = KVTransferConfig(kv_connector="KvflowConnector", kv_connector_module_path="kvflow.vllm", kv_role="kv_producer")
    config = VllmConfig(parallel_config=ParallelConfig(pipeline_parallel_size=2), kv_transfer_config=transfer)
    with pytest.raises(ValueError, match="pipeline parallel size 1, not 2"):
        KvflowConnector(config, KVConnectorRole.SCHEDULER)
