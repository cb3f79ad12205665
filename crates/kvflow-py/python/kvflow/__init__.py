"""kvflow: KV-cache transfer between the prefill and decode engines of disaggregated serving.

The native module (``kvflow._kvflow``) is kvflow's Rust workspace, built with maturin.
"""

from kvflow._kvflow import version as _version

__version__: str = _version()

__all__ = ["__version__"]
