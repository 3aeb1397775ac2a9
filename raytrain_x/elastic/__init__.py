"""Elastic training, the worker side: the framework-neutral states and `run` (the driver
side is `raytrain_x.ray.elastic`)."""

from __future__ import annotations

from raytrain_x.elastic.state import ObjectState, State, run
from raytrain_x.elastic.storage import Entry, Storage
from raytrain_x.elastic.storage_schemes import register_storage

__all__ = ["Entry", "ObjectState", "State", "Storage", "register_storage", "run"]
