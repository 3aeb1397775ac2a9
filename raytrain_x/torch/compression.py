"""Gradient compression (Horovod's `Compression.none` / `Compression.fp16`)."""

from __future__ import annotations

from typing import Any

import torch


class Compressor:
    """Compresses a tensor before a collective and restores it afterwards."""

    wire_dtype: str = ""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class NoneCompressor(Compressor):
    """No compression."""


class FP16Compressor(Compressor):
    """Sends floating point tensors as float16. float32 CPU tensors are cast by the native
    core while packing the fusion buffer (no extra copy); others are cast here."""

    wire_dtype = "float16"

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if tensor.is_floating_point():
            return tensor.to(torch.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor.to(ctx) if ctx is not None else tensor


class Compression:
    """Namespace of the available compressors."""

    none = NoneCompressor
    fp16 = FP16Compressor
