"""The fusion layer: persistent buffers, native pack/unpack, response cache, the engine."""

from __future__ import annotations

from raytrain_x import _native
from raytrain_x.fusion.buffers import FusionBuffer, FusionBufferPool, pack, unpack

ResponseCache = _native.ResponseCache

__all__ = ["FusionBuffer", "FusionBufferPool", "ResponseCache", "pack", "unpack"]
