"""raytrain-x: data-parallel training on Ray with fused collectives and self-tuning knobs."""

from __future__ import annotations

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
    "training_settings",
]
