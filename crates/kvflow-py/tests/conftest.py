"""What the tests share: the random model, saved once, a runner for the engine scripts, and for
the tests that drive kvflow's native ranks from Python: NIXL's runtime, a connector
configuration, and the loop that carries commands and reports between schedulers and ranks."""

import json
import pathlib
import subprocess
import sys
import time

import pytest

ENGINES = pathlib.Path(__file__).parent / "engines"


def run(script, *args, env=None, returncode=0):
    """Runs ``engines/script`` with this Python and returns its stdout; fails with its stderr
    unless it exits with ``returncode``."""
    done = subprocess.run(
        [sys.executable, str(ENGINES / script), *args], capture_output=True, text=True, timeout=600, env=env
    )
    assert done.returncode == returncode, f"{script} {args[:1]} exited {done.returncode}:\n{done.stderr[-4000:]}"
    return done.stdout


@pytest.fixture(scope="session")
def model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("model")
    run("model.py", str(path))
    return str(path)


# The connector configuration of the tests that build ranks and schedulers themselves.
RANK_CONFIG = json.dumps(
    {"kv_connector": "KvflowConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"kv_lease_duration": 10}}
)


@pytest.fixture(scope="module")
def nixl():
    """NIXL's runtime, loaded for the ranks a test builds."""
    from kvflow import _kvflow as native
    from kvflow.nixl import runtime_dir

    native.prepare_nixl(str(runtime_dir()))


def carry(schedulers, until, seconds=20):
    """Carries each rank's reports to its scheduler and the schedulers' commands to their
    ranks until ``until(events)``; ``schedulers`` pairs each scheduler with its ranks, in rank
    order. Returns the schedulers' other events."""
    deadline = time.monotonic() + seconds
    events = []
    while not until(events) and time.monotonic() < deadline:
        for scheduler, ranks in schedulers:
            for index, r in enumerate(ranks):
                for report in r.reports():
                    scheduler.report(index, report)
            for what, event in scheduler.poll():
                if what == "to_rank":
                    ranks[event[0]].command(event[1])
                else:
                    events.append((what, event))
        time.sleep(0.002)
    return events
