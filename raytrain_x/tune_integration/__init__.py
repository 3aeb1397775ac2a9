"""Ray Tune integration: distributed trials (`DistributedTrainableCreator`) and offline
autotune experiments. The in-training autotune search lives in `raytrain_x.autotune`."""

from __future__ import annotations

from raytrain_x.common.extras import import_extra

import_extra("ray.tune", "tune", "raytrain_x.tune_integration")

from raytrain_x.tune_integration.experiments import (  # noqa: E402 - after the check
    ExperimentsResult,
    autotune_experiments,
)
from raytrain_x.tune_integration.trainable import (  # noqa: E402
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
