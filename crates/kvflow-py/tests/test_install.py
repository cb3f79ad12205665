"""The wheel installs into a fresh virtualenv beside vLLM, and vLLM loads both connector classes
from their module path in every kv_role, in its scheduler and its worker roles; vLLM 0.33 too."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from conftest import ENGINES


def test_the_wheel_installs_into_a_fresh_virtualenv_and_vllm_loads_both_connectors_in_every_role(model, tmp_path):
    wheel = os.environ.get("KVFLOW_WHEEL")
    if not wheel:
        pytest.fail("KVFLOW_WHEEL names no wheel: run the tests with `cargo xtask vllm`")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    # Beside vLLM: the environment's packages are visible, kvflow is not among them.
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True, check=True
    ).stdout.strip()
    beside = [p for p in sys.path if p.endswith("site-packages")]
    (pathlib.Path(site) / "beside_vllm.pth").write_text("\n".join(beside) + "\n")
    where = subprocess.run([str(python), "-c", "import kvflow; print(kvflow.__file__)"], capture_output=True, text=True)
    assert where.returncode == 0 and not where.stdout.startswith(site)
    # Shadow the environment's own install: the fresh one comes first on the path.
    subprocess.run(
        [str(python), "-m", "pip", "install", "--no-deps", "--ignore-installed", "--no-cache-dir", "-q", "--disable-pip-version-check", wheel],
        check=True,
    )
    where = subprocess.run([str(python), "-c", "import kvflow; print(kvflow.__file__)"], capture_output=True, text=True, check=True)
    assert where.stdout.startswith(site), f"kvflow came from {where.stdout.strip()}, not the fresh virtualenv {site}"
    assert_loads(python, model)


def assert_loads(python, model, env=None):
    """``python``'s vLLM builds both connector classes in every role, and a consumer's
    scheduler side takes a request through the hooks before a load (load.py)."""
    done = subprocess.run(
        [str(python), str(ENGINES / "load.py"), model], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-4000:]
    line = [l for l in done.stdout.splitlines() if l.startswith("RESULT ")][-1]
    loaded = json.loads(line[len("RESULT ") :])
    got = {(c["class"], c["kv_role"], c["role"], c["decode_scheduler"]) for c in loaded}
    want = {
        (f"kvflow.vllm.{name}", kv_role, role, role == "SCHEDULER" and kv_role != "kv_producer")
        for name in ("KvflowConnector", "KvflowPushConnector")
        for kv_role in ("kv_producer", "kv_consumer", "kv_both")
        for role in ("SCHEDULER", "WORKER")
    }
    assert got == want
    # Each asks vLLM for HND (LBHNC), so that no layout interleaves the layers.
    assert {c["required_layout"] for c in loaded} == {"LBHNC"}
    # 300 prompt tokens matched for an asynchronous load, D's ranks told to track and load
    # it, and vLLM told to keep its blocks once it is aborted while loading.
    flows = [c["flow"] for c in loaded if "flow" in c]
    assert flows == [{"matched": [300, True], "commands": ["load", "track"], "finished": [True, None]}] * 2, flows


def test_vllm_0_33_loads_both_connectors_and_calls_their_hooks_as_0_32_does(model):
    """vLLM 0.33 (the CUDA build GPU users install: its Python code over this environment's
    packages, its platform set to CPU, since no GPU is here) builds both connectors in every
    role, and D's scheduler side goes through the same hooks with the same results."""
    python = os.environ.get("KVFLOW_VLLM_033")
    if not python:
        pytest.fail("KVFLOW_VLLM_033 names no Python with vLLM 0.33: run the tests with `cargo xtask vllm`")
    version = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True, check=True)
    assert version.stdout.strip() == "0.33.0"
    assert_loads(python, model, env=dict(os.environ, VLLM_TARGET_DEVICE="cpu"))
