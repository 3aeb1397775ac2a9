"""The Ray layer: `RayExecutor` places worker actors and forms their rendezvous.

The public names are loaded when first asked for: a worker actor's process, or a control
actor's, imports the one module it runs (`raytrain_x.ray.worker`, `...elastic.rounds`) and
not the driver's executor and elastic job with it (about 0.2 s of CPU for each process Ray
starts).
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "CheckpointConfig": "raytrain_x.common.checkpoint_config",
    "DriverPolicy": "raytrain_x.ray.elastic.policies",
    "JobSnapshot": "raytrain_x.ray.elastic.policies",
    "Leave": "raytrain_x.ray.elastic.policies",
    "SlowWorkers": "raytrain_x.ray.elastic.policies",
    "WorkerSample": "raytrain_x.ray.elastic.policies",
    "HostDiscovery": "raytrain_x.ray.elastic.ray_nodes",
    "RayHostDiscovery": "raytrain_x.ray.elastic.ray_nodes",
    "TestDiscovery": "raytrain_x.ray.elastic.ray_nodes",
    "ElasticRayExecutor": "raytrain_x.ray.elastic_executor",
    "RayExecutor": "raytrain_x.ray.executor",
    "Settings": "raytrain_x.ray.executor",
    "ensure_ray": "raytrain_x.ray.executor",
}

__all__ = sorted([*_WHERE, "ray_logger"])


def __getattr__(name: str) -> Any:
    if name == "ray_logger":
        return importlib.import_module("raytrain_x.ray.ray_logger")
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
        globals()[name] = value  # looked up once
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
