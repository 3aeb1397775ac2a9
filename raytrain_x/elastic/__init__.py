"""Elastic training: worker-side states and `run`, driver-side discovery and blacklist."""

from __future__ import annotations

from raytrain_x.elastic.state import ObjectState, State, run

__all__ = ["ObjectState", "State", "run"]
