"""Horovod's PyTorch collectives on the raytrain-x engine.

Every collective has a blocking form and an `_async` form returning a handle for
`synchronize`/`poll`; trailing underscore forms work in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from raytrain_x.common.errors import ConfigError
from raytrain_x.core import collectives as _core
from raytrain_x.core.collectives import Average, Sum, synchronize
from raytrain_x.core.process_sets import ProcessSet, global_process_set, registered_id
from raytrain_x.engine.messages import (
    ALLGATHER,
    ALLREDUCE,
    ALLTOALL,
    BROADCAST,
    REDUCESCATTER,
    Handle,
    Meta,
    Request,
)
from raytrain_x.torch.arrays import dtype_name  # (importing it registers torch tensors)
from raytrain_x.torch.compression import Compression, Compressor


def _dtype_name(tensor: torch.Tensor) -> str:
    return _core.check_dtype(dtype_name(tensor.dtype), tensor.dtype)


def _check_tensor(tensor: Any, what: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise ConfigError(f"{what} needs a torch.Tensor, got {type(tensor).__name__}")
    return tensor


class _Decompressing(Handle):
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


# ------------------------------------------------------------------------- allreduce
def _allreduce_request(
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
    tensor = _check_tensor(tensor, "allreduce")
    if not tensor.is_contiguous():
        raise ConfigError(f"allreduce {name or ''}: tensor is not contiguous; call "
                          ".contiguous() first")
    op = _core.resolve_op(op, average)
    name = name or _core.auto_name(ALLREDUCE)
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
    meta = Meta(ALLREDUCE, _dtype_name(work), tuple(work.shape), op, 0, float(prescale_factor),
                float(postscale_factor), registered_id(process_set), wire, work.device.type,
                fuse=fuse, framework="torch")
    request = _core.request(name, meta, work, output=tensor if target is None else None)
    if target is not None:
        return request, _Decompressing(request.handle, compression, compressor_ctx, target)
    return request, request.handle


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
    compression: type[Compressor] = Compression.none,
    fuse: bool = True,
) -> Handle:
    """Starts an in-place allreduce; returns a handle for `synchronize`.

    Args:
        tensor: contiguous tensor, reduced in place.
        average: deprecated Horovod flag; use `op`.
        name: unique name of this collective (same on every rank); auto-numbered if None.
        op: Average (default), Sum, Min, Max or Product.
        prescale_factor, postscale_factor: multiply before / after the reduction (Sum and
            Average only).
        process_set: ranks that take part.
        compression: `Compression.fp16` sends float16 over the wire.
        fuse: False for a tensor that is already a bucket: it is reduced alone, in place.
    """
    request, handle = _allreduce_request(tensor, average, name, op, prescale_factor,
                                         postscale_factor, process_set, compression, fuse)
    _core.submit_many([request])
    return handle


def allreduce_async(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Handle:
    """Like `allreduce_async_` on a copy: the input is left unchanged."""
    return allreduce_async_(_check_tensor(tensor, "allreduce").detach().clone(
        memory_format=torch.contiguous_format), *args, **kwargs)


def allreduce_(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """In-place allreduce; returns `tensor`."""
    return synchronize(allreduce_async_(tensor, *args, **kwargs))


def allreduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """Allreduce returning a new tensor (default op: Average)."""
    return synchronize(allreduce_async(tensor, *args, **kwargs))


def grouped_allreduce_async_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
    compression: type[Compressor] = Compression.none,
) -> list[Handle]:
    """Starts in-place allreduces of several tensors, enqueued atomically so that they
    are negotiated in the same cycle and fused together (within the fusion threshold)."""
    base = name or _core.auto_name("grouped_allreduce")
    pairs = [_allreduce_request(t, average, f"{base}.{i}", op, prescale_factor,
                                postscale_factor, process_set, compression)
             for i, t in enumerate(tensors)]
    _core.submit_many([request for request, _ in pairs])
    return [handle for _, handle in pairs]


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], *args: Any,
                            **kwargs: Any) -> list[Handle]:
    """Like `grouped_allreduce_async_` on copies: the inputs are left unchanged."""
    copies = [_check_tensor(t, "allreduce").detach().clone(memory_format=torch.contiguous_format)
              for t in tensors]
    return grouped_allreduce_async_(copies, *args, **kwargs)


def grouped_allreduce_(tensors: Sequence[torch.Tensor], *args: Any,
                       **kwargs: Any) -> list[torch.Tensor]:
    return [synchronize(h) for h in grouped_allreduce_async_(tensors, *args, **kwargs)]


def grouped_allreduce(tensors: Sequence[torch.Tensor], *args: Any,
                      **kwargs: Any) -> list[torch.Tensor]:
    return [synchronize(h) for h in grouped_allreduce_async(tensors, *args, **kwargs)]


# ------------------------------------------------------------------------- others
def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Starts an allgather along dim 0; ranks may differ in dim 0, not in the others."""
    tensor = _check_tensor(tensor, "allgather").detach()
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)
    tensor = tensor.contiguous()
    meta = Meta(ALLGATHER, _dtype_name(tensor), tuple(tensor.shape),
                process_set_id=registered_id(process_set), device=tensor.device.type,
                framework="torch")
    return _core.submit(name or _core.auto_name(ALLGATHER), meta, tensor)


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenation of every member's tensor along dim 0, in rank order."""
    return synchronize(allgather_async(tensor, name, process_set))


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """Starts an in-place broadcast from global rank `root_rank`."""
    tensor = _check_tensor(tensor, "broadcast")
    if not tensor.is_contiguous():
        raise ConfigError("broadcast: tensor is not contiguous; call .contiguous() first")
    members = process_set.ranks if process_set.ranks is not None else None
    if members is not None and root_rank not in members:
        raise ConfigError(f"broadcast root_rank {root_rank} is not in the process set {members}")
    meta = Meta(BROADCAST, _dtype_name(tensor), tuple(tensor.shape), root=int(root_rank),
                process_set_id=registered_id(process_set), device=tensor.device.type,
                framework="torch")
    return _core.submit(name or _core.auto_name(BROADCAST), meta, tensor.detach(), output=tensor)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    return broadcast_async_(_check_tensor(tensor, "broadcast").detach().clone(
        memory_format=torch.contiguous_format), root_rank, name, process_set)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """`root_rank`'s tensor on every member (a new tensor)."""
    return synchronize(broadcast_async(tensor, root_rank, name, process_set))


def alltoall_async(tensor: torch.Tensor, splits: Sequence[int] | torch.Tensor | None = None,
                   name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> Handle:
    """Starts an alltoall: rows `splits[i]` of dim 0 go to member i (equal split if None)."""
    tensor = _check_tensor(tensor, "alltoall").detach().contiguous()
    n = process_set.size()
    if splits is None:
        if tensor.dim() == 0 or tensor.shape[0] % n:
            raise ConfigError(f"alltoall without splits needs dim 0 ({tuple(tensor.shape)}) "
                              f"divisible by the {n} members; pass splits=")
        split_list = [tensor.shape[0] // n] * n
    else:
        split_list = [int(s) for s in (splits.tolist() if torch.is_tensor(splits) else splits)]
        if len(split_list) != n or any(s < 0 for s in split_list) \
                or sum(split_list) != tensor.shape[0]:
            raise ConfigError(f"alltoall splits {split_list} must be {n} non-negative numbers "
                              f"summing to dim 0 ({tensor.shape[0] if tensor.dim() else 0})")
    meta = Meta(ALLTOALL, _dtype_name(tensor), tuple(tensor.shape),
                process_set_id=registered_id(process_set), device=tensor.device.type,
                framework="torch",
                splits=tuple(split_list))
    return _core.submit(name or _core.auto_name(ALLTOALL), meta, tensor)


def alltoall(tensor: torch.Tensor, splits: Sequence[int] | torch.Tensor | None = None,
             name: str | None = None, process_set: ProcessSet = global_process_set):
    """Returns the received rows; with `splits`, returns `(output, received_splits)`."""
    output, received = synchronize(alltoall_async(tensor, splits, name, process_set))
    return (output, received) if splits is not None else output


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: str | None = None,
                        process_set: ProcessSet = global_process_set,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Handle:
    """Starts a reduce-scatter along dim 0 (the first `dim0 % size` ranks get a row more)."""
    tensor = _check_tensor(tensor, "reducescatter").detach().contiguous()
    op = _core.resolve_op(op, None)
    if op not in (Average, Sum):
        raise ConfigError("reducescatter supports rx.Average and rx.Sum")
    if tensor.dim() == 0:
        raise ConfigError("reducescatter needs a tensor with at least one dimension")
    meta = Meta(REDUCESCATTER, _dtype_name(tensor), tuple(tensor.shape), op, 0,
                float(prescale_factor), float(postscale_factor), registered_id(process_set),
                device=tensor.device.type, framework="torch")
    return _core.submit(name or _core.auto_name(REDUCESCATTER), meta, tensor)


def reducescatter(tensor: torch.Tensor, name: str | None = None, op: str | None = None,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    return synchronize(reducescatter_async(tensor, name, op, process_set, prescale_factor,
                                           postscale_factor))

