"""kvflow's connector settings from vLLM's ``kv_transfer_config``, checked by kvflow's own rules."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from kvflow._kvflow import connector_settings


def settings(kv_transfer_config: Any) -> dict[str, Any]:
    """The settings of kvflow's connector that ``kv_transfer_config`` gives: vLLM's
    ``KVTransferConfig`` or a dict of its keys. Raises ``ValueError`` naming what is wrong
    (an unknown connector, an unknown or bad key of ``kv_connector_extra_config``, a mode or
    failure policy that disagrees with the connector's)."""
    if dataclasses.is_dataclass(kv_transfer_config):
        kv_transfer_config = dataclasses.asdict(kv_transfer_config)
    return connector_settings(json.dumps(kv_transfer_config))
