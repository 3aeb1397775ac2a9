"""Gradient compression (Horovod's `Compression.none` / `Compression.fp16`).

An allreduce compresses inside the engine's buffers: float32 is cast to float16 by the
native core while packing, other floating dtypes while being copied into their bucket.
Other collectives (reducescatter) and user compressors use Horovod's
`compress(tensor) -> (tensor, ctx)` / `decompress(tensor, ctx)` around the collective.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf


class Compressor:
    """What a collective sends on the wire; `wire_dtype` "" means the tensor's own."""

    wire_dtype: str = ""

    @staticmethod
    def compress(tensor: tf.Tensor) -> tuple[tf.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: Any) -> tf.Tensor:
        return tensor


class NoneCompressor(Compressor):
    """No compression."""


class FP16Compressor(Compressor):
    """Sends floating point tensors as float16; the result comes back in their dtype."""

    wire_dtype = "float16"

    @staticmethod
    def compress(tensor: tf.Tensor) -> tuple[tf.Tensor, Any]:
        if tensor.dtype.is_floating and tensor.dtype != tf.float16:
            return tf.cast(tensor, tf.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: Any) -> tf.Tensor:
        return tensor if ctx is None else tf.cast(tensor, ctx)


class Compression:
    """Namespace of the available compressors."""

    none = NoneCompressor
    fp16 = FP16Compressor
