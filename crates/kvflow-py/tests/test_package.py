"""The wheel installs beside vLLM and its native module loads."""

import pathlib
import tomllib

import kvflow


def test_the_native_module_is_this_workspace_s_build():
    manifest = pathlib.Path(__file__).parents[3] / "Cargo.toml"
    version = tomllib.loads(manifest.read_text())["workspace"]["package"]["version"]
    assert kvflow.__version__ == version
