"""The Ray layer: `RayExecutor` places worker actors and forms their rendezvous.

The public names are loaded when first asked for: a worker actor's process, or a control
actor's, imports the one module it runs (`raytrain_x.ray.worker`, `...elastic.rounds`) and
not the driver's executor and elastic job with it (about 0.2 s of CPU for each process Ray
starts).
"""

from __future__ import annotations

from raytrain_x.common.exports import lazy_names

_HOMES: dict[str, str | None] = {
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
    "ray_logger": None,
}

__all__ = sorted(_HOMES)
__getattr__, __dir__ = lazy_names(__name__, _HOMES)
