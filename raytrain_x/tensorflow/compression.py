"""Gradient compression (Horovod's `Compression.none` / `Compression.fp16`).

The TensorFlow face compresses inside the engine's buffers: float32 is cast to float16 by
the native core while packing, other floating dtypes while being copied into their bucket.
"""

from __future__ import annotations


class Compressor:
    """What a collective sends on the wire; `wire_dtype` "" means the tensor's own."""

    wire_dtype: str = ""


class NoneCompressor(Compressor):
    """No compression."""


class FP16Compressor(Compressor):
    """Sends floating point tensors as float16; the result comes back in their dtype."""

    wire_dtype = "float16"


class Compression:
    """Namespace of the available compressors."""

    none = NoneCompressor
    fp16 = FP16Compressor
