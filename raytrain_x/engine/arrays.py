"""The small array protocol the engine works on, so that it serves every framework.

The engine never imports a framework. Each family of arrays (numpy here; torch tensors in
`raytrain_x.torch.arrays`; TensorFlow through numpy) registers an `ArrayOps` that does the
few things the engine needs besides moving bytes: tell dtype and device, allocate, scale,
concatenate. Moving bytes needs no help: the transports take any array through DLPack or
the buffer protocol without a copy. Requests keep the caller's arrays, so results are
written into (or returned as) the caller's own type.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np

from raytrain_x.common.errors import ConfigError


class ArrayOps:
    """What the engine does to one family of arrays. Arrays also support the operators
    common to numpy and torch: slicing, `reshape`, `a[...] = b`, `a *= x`, `a //= n`."""

    family = ""
    devices: tuple[str, ...] = ("cpu",)

    def scale(self, a: Any, factor: float) -> None:
        """Multiplies a floating point array by `factor` in place; 16-bit floats in float32
        math, rounded once (as Horovod scales them)."""
        a *= factor

    def dtype(self, a: Any) -> str:
        """Canonical dtype name: float32, float64, float16, bfloat16, int8, ..."""
        raise NotImplementedError

    def device(self, a: Any) -> str:
        """'cpu' or 'cuda'."""
        return "cpu"

    def is_contiguous(self, a: Any) -> bool:
        raise NotImplementedError

    def numel(self, a: Any) -> int:
        raise NotImplementedError

    def zeros(self, shape: Sequence[int], dtype: str, device: str = "cpu") -> Any:
        raise NotImplementedError

    def empty(self, shape: Sequence[int], dtype: str, device: str = "cpu") -> Any:
        raise NotImplementedError

    def concat(self, arrays: Sequence[Any]) -> Any:
        """Concatenation along dim 0 (a new array)."""
        raise NotImplementedError

    def stack(self, arrays: Sequence[Any]) -> Any:
        raise NotImplementedError

    def clone(self, a: Any) -> Any:
        raise NotImplementedError

    def cast(self, a: Any, dtype: str) -> Any:
        """A copy of `a` in `dtype`."""
        raise NotImplementedError

    def view_buffer(self, buffer: Any, count: int) -> Any:
        """The first `count` elements of a native `FusionBuffer`, as an array of this family
        over the same memory."""
        raise NotImplementedError

    def int32(self, values: Sequence[int]) -> Any:
        """A 1-D int32 array of `values` (alltoall's received splits)."""
        raise NotImplementedError

    def is_floating(self, a: Any) -> bool:
        return self.dtype(a).startswith(("float", "bfloat"))

    def span(self, arrays: Sequence[Any]) -> Any | None:
        """One flat array over the memory of `arrays` when they lie back to back in one
        buffer, in this order (gradients that are views of one flat buffer): a fused batch
        of them is reduced in place, without packing. None otherwise."""
        return None

    def follows(self, before: Any, after: Any) -> bool:
        """True when `after` starts where `before` ends, in one buffer (what `span` joins)."""
        return self.span([before, after]) is not None


class NumpyOps(ArrayOps):
    family = "numpy"

    def dtype(self, a: np.ndarray) -> str:
        return a.dtype.name

    def is_contiguous(self, a: np.ndarray) -> bool:
        return a.flags.c_contiguous

    def numel(self, a: np.ndarray) -> int:
        return a.size

    def zeros(self, shape, dtype, device="cpu"):
        return np.zeros(tuple(shape), dtype=_numpy_dtype(dtype, device))

    def empty(self, shape, dtype, device="cpu"):
        return np.empty(tuple(shape), dtype=_numpy_dtype(dtype, device))

    def concat(self, arrays):
        return np.concatenate(list(arrays))

    def stack(self, arrays):
        return np.stack(list(arrays))

    def clone(self, a):
        return a.copy()

    def scale(self, a, factor):
        if a.dtype.itemsize == 2:  # numpy would round the factor to 16 bits first
            np.multiply(a, np.float32(factor), out=a, dtype=np.float32, casting="unsafe")
        else:
            a *= factor

    def cast(self, a, dtype):
        return a.astype(_numpy_dtype(dtype, "cpu"))

    def view_buffer(self, buffer, count):
        dtype = _numpy_dtype(buffer.dtype, "cpu")
        raw = (ctypes.c_uint8 * (count * dtype.itemsize)).from_address(buffer.address)
        return np.frombuffer(raw, dtype=dtype, count=count)

    def int32(self, values):
        return np.asarray(list(values), dtype=np.int32)


def _numpy_dtype(name: str, device: str) -> np.dtype:
    if device != "cpu":
        raise ConfigError(f"numpy arrays live in host memory, not on {device!r}")
    try:
        return np.dtype(name)
    except TypeError:
        raise ConfigError(f"dtype {name} has no numpy equivalent; send it as a framework "
                          "tensor (torch) instead") from None


NUMPY = NumpyOps()
_by_type: dict[type, ArrayOps] = {np.ndarray: NUMPY}
_families: list[ArrayOps] = [NUMPY]


def register(ops: ArrayOps, *types: type) -> None:
    """Makes the engine handle arrays of `types` with `ops` (a framework face calls it on
    import). The latest family registered is the one a joined rank fills zeros with."""
    for t in types:
        _by_type[t] = ops
    if ops not in _families:
        _families.append(ops)


def ops_for(array: Any) -> ArrayOps:
    """The ops of `array`'s family (subclasses such as torch's Parameter included)."""
    ops = _by_type.get(type(array))
    if ops is None:
        for t in type(array).__mro__[1:]:
            if t in _by_type:
                ops = _by_type[type(array)] = _by_type[t]
                break
        else:
            raise ConfigError(f"raytrain-x cannot send a {type(array).__name__}; use numpy "
                              "arrays or a framework face (raytrain_x.torch)")
    return ops


def ops_for_device(device: str) -> ArrayOps:
    """The family that fills a joined rank's zeros on `device` (the latest registered that
    lives there)."""
    for ops in reversed(_families):
        if device in ops.devices:
            return ops
    raise ConfigError(f"no registered array family lives on {device!r}")
