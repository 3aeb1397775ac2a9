"""What the torch face's collectives share: tensor checks, Horovod's names, the requests
they submit to the engine and the handles that finish several of them (or decompress one)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from raytrain_x.common.errors import ConfigError, UnsupportedOperationError
from raytrain_x.core import collectives as _core
from raytrain_x.core.collectives import Adasum, Average, Sum
from raytrain_x.core.process_sets import ProcessSet, registered_id
from raytrain_x.engine import adasum
from raytrain_x.engine.messages import ALLGATHER, ALLREDUCE, REDUCESCATTER, Handle, Meta, Request
from raytrain_x.torch.arrays import dtype_name  # (importing it registers torch tensors)
from raytrain_x.torch.compression import Compression, Compressor


def op_name(kind: str, name: str | None, process_set: ProcessSet) -> str:
    """Horovod's naming: `<kind>.<name>`, or `<kind>.noname.<n>` for an unnamed one (`n`
    counted per process set)."""
    return _core.auto_name(kind, process_set) if name is None else _core.named(kind, name)


def checked_dtype(tensor: torch.Tensor) -> str:
    return _core.check_dtype(dtype_name(tensor.dtype), tensor.dtype)


def check_tensor(tensor: Any, what: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise ConfigError(f"{what} needs a torch.Tensor, got {type(tensor).__name__}")
    return tensor


def contiguous_copy(tensor: torch.Tensor, what: str) -> torch.Tensor:
    return check_tensor(tensor, what).detach().clone(memory_format=torch.contiguous_format)


class CompositeHandle(Handle):
    """One handle over several collectives; `wait()` returns `finish(their results)`.
    Callable, as Horovod's `sparse_allreduce_async` handle is."""

    __slots__ = ("_inners", "_finish", "_value", "_finished")

    def __init__(self, name: str, inners: Sequence[Handle],
                 finish: Any = None) -> None:
        super().__init__(name)
        self._inners = list(inners)
        self._finish = finish or list
        self._finished = False
        self._value: Any = None

    def done(self) -> bool:
        return all(h.done() for h in self._inners)

    def wait(self, timeout: float | None = None) -> Any:
        if not self._finished:
            self._value = self._finish([h.wait(timeout) for h in self._inners])
            self._finished = True
        return self._value

    __call__ = wait


class DecompressingHandle(Handle):
    """A handle whose result is decompressed (and copied into `target`) on wait."""

    __slots__ = ("_inner", "_compressor", "_ctx", "_target")

    def __init__(self, inner: Handle, compressor: type[Compressor], ctx: Any, target: Any):
        super().__init__(inner.name)
        self._inner, self._compressor, self._ctx, self._target = inner, compressor, ctx, target

    def done(self) -> bool:
        return self._inner.done()

    def wait(self, timeout: float | None = None) -> Any:
        out = self._compressor.decompress(self._inner.wait(timeout), self._ctx)
        if self._target is not None:
            self._target.copy_(out)
            return self._target
        return out


def allreduce_request(
    tensor: torch.Tensor,
    average: bool | None,
    name: str | None,
    op: str | None,
    prescale_factor: float,
    postscale_factor: float,
    process_set: ProcessSet,
    compression: type[Compressor],
    fuse: bool = True,
) -> tuple[Request, Handle]:
    """The request for an in-place allreduce and the handle the caller should wait on."""
    tensor = check_tensor(tensor, "allreduce")
    if tensor.is_sparse:
        raise ConfigError("allreduce of a sparse tensor: use rx.sparse_allreduce_async, or "
                          "DistributedOptimizer(sparse_as_dense=True)")
    if not tensor.is_contiguous():
        raise ConfigError(f"allreduce {name or ''}: tensor is not contiguous; call "
                          ".contiguous() first")
    op = _core.resolve_op(op, average)
    if op == Adasum:
        adasum.check_size(process_set.size())
        if not tensor.is_floating_point():
            raise ConfigError(f"op=Adasum needs floating point tensors, got {tensor.dtype}")
    name = op_name(ALLREDUCE, name, process_set)
    wire = ""
    target = None
    compressor_ctx = None
    work = tensor.detach()
    if compression is not Compression.none:
        if getattr(compression, "wire_dtype", None) and work.dtype == torch.float32:
            wire = compression.wire_dtype  # the native core casts while packing
        else:
            work, compressor_ctx = compression.compress(work)
            target = tensor
    meta = Meta(ALLREDUCE, checked_dtype(work), tuple(work.shape), op, 0,
                _core.scale_factor("prescale_factor", prescale_factor),
                _core.scale_factor("postscale_factor", postscale_factor),
                registered_id(process_set), wire, work.device.type,
                fuse=fuse, framework="torch")
    request = _core.request(name, meta, work, output=tensor if target is None else None)
    if target is not None:
        return request, DecompressingHandle(request.handle, compression, compressor_ctx, target)
    return request, request.handle


def allgather_request(tensor: torch.Tensor, name: str, process_set: ProcessSet,
                      output: torch.Tensor | None = None) -> Request:
    """`output`, where given, receives the result when every member's dim 0 is the same
    (the handle then gives `output` itself)."""
    tensor = check_tensor(tensor, "allgather").detach()
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)
    tensor = tensor.contiguous()
    meta = Meta(ALLGATHER, checked_dtype(tensor), tuple(tensor.shape),
                process_set_id=registered_id(process_set), device=tensor.device.type,
                framework="torch")
    request = _core.request(name, meta, tensor)
    request.output = output
    return request


def reducescatter_request(tensor: torch.Tensor, name: str, op: str | None,
                           process_set: ProcessSet, prescale_factor: float,
                           postscale_factor: float,
                           output: torch.Tensor | None = None) -> Request:
    """`output`, where given, receives this member's share when the shares are equal (the
    handle then gives `output` itself)."""
    tensor = check_tensor(tensor, "reducescatter").detach().contiguous()
    op = _core.resolve_op(op, None)
    if op not in (Average, Sum):
        raise UnsupportedOperationError(f"reducescatter supports rx.Average and rx.Sum, not "
                                        f"{op!r}")
    if tensor.dim() == 0:
        raise ConfigError("reducescatter needs a tensor with at least one dimension")
    meta = Meta(REDUCESCATTER, checked_dtype(tensor), tuple(tensor.shape), op, 0,
                _core.scale_factor("prescale_factor", prescale_factor),
                _core.scale_factor("postscale_factor", postscale_factor),
                registered_id(process_set),
                device=tensor.device.type, framework="torch")
    request = _core.request(name, meta, tensor)
    request.output = output
    return request
