"""kvflow's stats as vLLM's loggers take them: summed across workers and intervals, reduced to
one log line. (Their way from real engines to vLLM's Prometheus registry is in
test_pd_vllm.py.)"""

import json

from kvflow.vllm import KvflowConnector, KvflowStats


def key(name, **labels):
    return json.dumps([name, sorted(labels.items())])


def test_stats_sum_counters_keep_the_latest_gauge_and_pool_samples():
    rank0 = KvflowStats(
        data={
            "counters": {key("kvflow_transfers_posted_total", engine="d", rank="0"): 3},
            "gauges": {key("kvflow_blocks_held", engine="d", rank="0"): 4.0},
            "histograms": {key("kvflow_xfer_time_seconds", engine="d", rank="0"): [0.001, 0.003]},
        }
    )
    rank1 = KvflowStats(
        data={
            "counters": {key("kvflow_transfers_posted_total", engine="d", rank="1"): 2},
            "histograms": {key("kvflow_xfer_time_seconds", engine="d", rank="1"): [0.002]},
        }
    )
    later = KvflowConnector.build_kv_connector_stats(
        {
            "counters": {key("kvflow_transfers_posted_total", engine="d", rank="0"): 1},
            "gauges": {key("kvflow_blocks_held", engine="d", rank="0"): 0.0},
        }
    )
    both = rank0.aggregate(rank1).aggregate(later)
    assert both.data["counters"][key("kvflow_transfers_posted_total", engine="d", rank="0")] == 4
    assert both.data["gauges"] == {key("kvflow_blocks_held", engine="d", rank="0"): 0.0}
    assert both.reduce() == {
        "transfers_posted_total": 6,
        "xfer_time_seconds_count": 3,
        "xfer_time_seconds_mean": 0.002,
    }
    assert not both.is_empty()
    both.reset()
    assert both.is_empty()
    assert KvflowConnector.build_kv_connector_stats().is_empty()
