"""Where NIXL's runtime is: the ``nixl_cu12`` (or ``nixl_cu13``) wheel of this Python
environment, unless ``KVFLOW_NIXL_DIR`` names the folder."""

from __future__ import annotations

import os
import pathlib
import sys

_PACKAGES = ("nixl_cu12", "nixl_cu13")


def runtime_dir() -> pathlib.Path:
    """The folder holding ``libnixl_capi.so``: ``KVFLOW_NIXL_DIR`` if set, else the one the
    ``nixl_cu12`` or ``nixl_cu13`` wheel installed (``site-packages/.nixl_cu12.mesonpy.libs``).
    Raises ``FileNotFoundError`` saying where it looked."""
    explicit = os.environ.get("KVFLOW_NIXL_DIR")
    if explicit:
        return pathlib.Path(explicit)
    looked = []
    for entry in sys.path:
        for package in _PACKAGES:
            folder = pathlib.Path(entry or ".") / f".{package}.mesonpy.libs"
            if (folder / "libnixl_capi.so").is_file():
                return folder
            looked.append(str(folder))
    raise FileNotFoundError(
        "no NIXL runtime: install nixl-cu12 (or nixl-cu13) into this Python environment, "
        f"or set KVFLOW_NIXL_DIR; looked in {', '.join(looked) or 'nothing'}"
    )
