"""The Ray layer: `RayExecutor` places worker actors and forms their rendezvous."""

from __future__ import annotations

from raytrain_x.common.checkpoint_config import CheckpointConfig
from raytrain_x.ray import ray_logger
from raytrain_x.ray.elastic.policies import (
    DriverPolicy,
    JobSnapshot,
    Leave,
    SlowWorkers,
    WorkerSample,
)
from raytrain_x.ray.elastic.ray_nodes import HostDiscovery, RayHostDiscovery, TestDiscovery
from raytrain_x.ray.elastic_executor import ElasticRayExecutor
from raytrain_x.ray.executor import RayExecutor, Settings, ensure_ray

__all__ = ["CheckpointConfig", "DriverPolicy", "ElasticRayExecutor", "HostDiscovery",
           "JobSnapshot", "Leave", "RayExecutor", "RayHostDiscovery", "Settings",
           "SlowWorkers", "TestDiscovery", "WorkerSample", "ensure_ray", "ray_logger"]
