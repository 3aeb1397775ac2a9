"""Ray Tune integration: the autotune controller, distributed trials, offline experiments."""

from __future__ import annotations

from raytrain_x.tune_integration.autotune import AutotuneController, SearchSpace

__all__ = ["AutotuneController", "SearchSpace"]
