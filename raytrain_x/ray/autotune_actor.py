"""The autotune controller as a Ray actor, so that the search runs beside the workers."""

from __future__ import annotations

import ray

from raytrain_x.autotune.host import BackgroundController
from raytrain_x.common.autotune_config import AutotuneConfig
from raytrain_x.common.knobs import Knobs
from raytrain_x.ray.placement import stable_node_strategy


def start_controller_actor(config: AutotuneConfig, start: Knobs, fixed: frozenset[str]):
    """Starts the controller as a Ray actor (no CPU reserved) on a node that stays."""
    return ray.remote(num_cpus=0)(BackgroundController).options(
        scheduling_strategy=stable_node_strategy()).remote(config, start, fixed)
