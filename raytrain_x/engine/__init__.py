"""The engine: the cycle thread and queue, negotiation (response cache, status bits,
coordinator), planning, transport choice, per-collective execution, fusion buffers and the
timeline. It works on any array family registered in `raytrain_x.engine.arrays`."""

from __future__ import annotations

from raytrain_x import _native
from raytrain_x.engine.buffers import FusionBuffer, FusionBufferPool, pack, unpack

ResponseCache = _native.ResponseCache

__all__ = ["FusionBuffer", "FusionBufferPool", "ResponseCache", "pack", "unpack"]
