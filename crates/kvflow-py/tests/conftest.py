"""What the tests share: the random model, saved once, and a runner for the engine scripts."""

import pathlib
import subprocess
import sys

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
