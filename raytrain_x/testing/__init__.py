"""Clusters on one machine for tests, benchmarks and trying features out: a local Ray
cluster whose nodes an autoscaler starts and stops (`LocalAutoscalingCluster`), several
hosts joined by a real, shaped network (`EmulatedCluster`), and the process bookkeeping
that stops exactly what such a cluster started.

The clusters load when first named, so that the harness's Ray-free parts (`leaks`,
`waiting`, `results`) import where Ray is not installed, as on a GPU machine that runs
`tests/gpu/` between plain processes.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {"LocalAutoscalingCluster": "autoscaling", "drain_node": "autoscaling",
          "kill_node": "autoscaling", "EmulatedCluster": "cluster",
          "NamespacesUnavailable": "cluster"}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
