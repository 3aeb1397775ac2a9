"""raytrain-x: data-parallel training on Ray with fused collectives and self-tuning knobs."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from raytrain_x.common.checkpoint_config import CheckpointConfig
from raytrain_x.common.errors import (
    CheckpointError,
    CheckpointLeaseHeld,
    ConfigError,
    ControlActorLost,
    ElasticStateLost,
    ElasticTimeout,
    FailureLimitExceeded,
    HostsUpdatedInterrupt,
    InternalError,
    LocalError,
    RaytrainXError,
    RendezvousTimeout,
    ResetLimitExceeded,
    StorageError,
    StoreAuthError,
    TensorMismatchError,
    UnsupportedOperationError,
    WorkerError,
)
from raytrain_x.common.knobs import Knobs, load_knobs
from raytrain_x.common.training import training_settings

__version__ = "0.1.0"


def run(func: Callable[..., Any], args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None, np: int = 1, **options: Any) -> list[Any]:
    """Horovod's `horovod.run`: `func(*args, **kwargs)` on `np` Ray workers joined into one
    world; each rank's result, in rank order. The options (`min_np`, `max_np`, `hosts`,
    `slots`, `reset_limit`, `start_timeout`, `verbose`, `address`) are
    `raytrain_x.ray.horovod_run.run`'s. Ray is loaded only when this is called (looked up,
    not imported: every layer's modules import this package, and none may reach Ray)."""
    run_on_ray = importlib.import_module("raytrain_x.ray.horovod_run").run
    return run_on_ray(func, args, kwargs, np, **options)

__all__ = [
    "CheckpointConfig",
    "CheckpointError",
    "CheckpointLeaseHeld",
    "ConfigError",
    "ControlActorLost",
    "ElasticStateLost",
    "ElasticTimeout",
    "HostsUpdatedInterrupt",
    "InternalError",
    "LocalError",
    "Knobs",
    "RaytrainXError",
    "RendezvousTimeout",
    "ResetLimitExceeded",
    "FailureLimitExceeded",
    "StorageError",
    "StoreAuthError",
    "TensorMismatchError",
    "UnsupportedOperationError",
    "WorkerError",
    "load_knobs",
    "run",
    "training_settings",
]
