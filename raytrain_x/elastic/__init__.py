"""Elastic training, the worker side: the framework-neutral states and `run` (the driver
side is `raytrain_x.ray.elastic`)."""

from __future__ import annotations

from raytrain_x.elastic.state import ObjectState, State, run

__all__ = ["ObjectState", "State", "run"]
