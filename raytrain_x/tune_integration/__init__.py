"""Ray Tune integration: the autotune controller, distributed trials, offline experiments."""

from __future__ import annotations

from raytrain_x.tune_integration.autotune import AutotuneController, SearchSpace
from raytrain_x.tune_integration.experiments import ExperimentsResult, autotune_experiments
from raytrain_x.tune_integration.trainable import (
    DistributedTrainableCreator,
    get_checkpoint,
    report,
)

__all__ = [
    "AutotuneController",
    "DistributedTrainableCreator",
    "ExperimentsResult",
    "SearchSpace",
    "autotune_experiments",
    "get_checkpoint",
    "report",
]
