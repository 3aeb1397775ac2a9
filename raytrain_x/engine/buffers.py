"""Persistent fusion buffers and the pack/unpack calls into the native core."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from raytrain_x import _native
from raytrain_x.common.errors import ConfigError

FusionBuffer = _native.FusionBuffer

_TORCH_DTYPE_NAMES = {
    "torch.float32": "float32",
    "torch.float64": "float64",
    "torch.float16": "float16",
    "torch.bfloat16": "bfloat16",
    "torch.int32": "int32",
    "torch.int64": "int64",
    "torch.int8": "int8",
    "torch.uint8": "uint8",
}


def dtype_name(dtype: Any) -> str:
    """Canonical dtype name ('float32', ...) of a torch/numpy dtype or a name."""
    text = str(dtype)
    return _TORCH_DTYPE_NAMES.get(text, text)


class FusionBufferPool:
    """Persistent `FusionBuffer`s per (device, dtype), allocated once and reused: slot 0
    for a batch packed whole, the others for packed pieces still on the wire while the
    next are packed (`CollectiveRunner`)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, str, int], FusionBuffer] = {}

    def get(self, dtype: Any, nbytes: int, device: str = "cpu", slot: int = 0) -> FusionBuffer:
        """The buffer for (device, dtype, slot) with room for at least `nbytes`."""
        key = (str(device), dtype_name(dtype), slot)
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = _create(key[1])
        buf.reserve(nbytes)
        return buf

    def allocations(self) -> int:
        """Total allocations over all buffers (constant once training is in steady state)."""
        return sum(b.allocations for b in self._buffers.values())

    def clear(self) -> None:
        self._buffers.clear()


def _create(dtype: str) -> FusionBuffer:
    try:
        return FusionBuffer(dtype)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def pack(
    tensors: Sequence[Any],
    buffer: Any,
    prescale: float = 1.0,
    offset: int = 0,
    names: Sequence[str] | None = None,
) -> int:
    """Copies `tensors` back to back into `buffer`, scaled by `prescale`.

    Args:
        tensors: contiguous CPU arrays of one dtype (torch, numpy, anything with DLPack).
        buffer: a `FusionBuffer` or a writable contiguous array.
        prescale: factor applied while copying.
        offset: first element of `buffer` to write.
        names: tensor names, used in error messages.

    Returns:
        The number of elements written.

    Raises:
        ConfigError: mixed dtypes, a non-contiguous or non-CPU tensor, an unsupported dtype,
            or a buffer too small; the message names the tensor.
    """
    try:
        return _native.pack(list(tensors), buffer, prescale, offset, list(names or ()))
    except (ValueError, TypeError) as exc:
        raise ConfigError(_explain(exc)) from None


def unpack(
    buffer: Any,
    tensors: Sequence[Any],
    postscale: float = 1.0,
    offset: int = 0,
    names: Sequence[str] | None = None,
) -> int:
    """Copies out of `buffer` into `tensors`, scaled by `postscale`; see `pack`."""
    try:
        return _native.unpack(buffer, list(tensors), postscale, offset, list(names or ()))
    except (ValueError, TypeError) as exc:
        raise ConfigError(_explain(exc)) from None


def _explain(exc: Exception) -> str:
    if isinstance(exc, TypeError):
        return (
            "the native packer could not take these arguments: tensors must be writable, "
            "contiguous CPU arrays (torch, numpy or DLPack) and the buffer a FusionBuffer or "
            f"array; detail: {str(exc).splitlines()[0]}"
        )
    return str(exc)
