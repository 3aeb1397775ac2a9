"""Ray Tune integration: distributed trials (`DistributedTrainableCreator`) and offline
autotune experiments. The in-training autotune search lives in `raytrain_x.autotune`."""

from __future__ import annotations

from raytrain_x.tune_integration.experiments import ExperimentsResult, autotune_experiments
from raytrain_x.tune_integration.trainable import (
    DistributedTrainableCreator,
    get_checkpoint,
    report,
)

__all__ = [
    "DistributedTrainableCreator",
    "ExperimentsResult",
    "autotune_experiments",
    "get_checkpoint",
    "report",
]
