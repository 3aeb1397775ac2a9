"""Autotune: rank 0's sampler (a cycle hook on the engine) and the search controller
(Ray Tune's BayesOptSearch, imported only when a search starts)."""

from __future__ import annotations

from raytrain_x.autotune.controller import AutotuneController, SearchSpace
from raytrain_x.autotune.host import local_controller
from raytrain_x.autotune.observer import JobShape
from raytrain_x.autotune.sampler import AutotuneSampler

__all__ = ["AutotuneController", "AutotuneSampler", "JobShape", "SearchSpace",
           "local_controller"]
