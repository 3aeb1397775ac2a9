"""The torch face's asynchronous collectives and what every collective of the face shares.

Each `_async` form returns a handle for `synchronize`/`poll`; a trailing underscore works in
place. Below them: the tensor checks, Horovod's names (`allreduce.x`, `allreduce.noname.3`),
the requests submitted to the engine, and the handles that finish several requests (or
decompress one). The blocking, differentiable forms (`raytrain_x.torch.ops`) call these;
nothing here imports them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from raytrain_x.common.errors import ConfigError, UnsupportedOperationError
from raytrain_x.core import collectives as _core
from raytrain_x.core.collectives import Adasum, Average, Sum
from raytrain_x.core.process_sets import ProcessSet, global_process_set, registered_id
from raytrain_x.engine import adasum
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

# ----------------------------------------------------------------------------- requests

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
    request.contiguous = work.is_contiguous()  # checked above; a compressed form may not be
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


# ----------------------------------------------------------------------------- async forms
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
        op: Average (default), Sum, Adasum, Min, Max or Product.
        prescale_factor: multiplies the tensor before the reduction (Sum and Average;
            integers are scaled in float64 and cast back, as in Horovod).
        postscale_factor: multiplies the result after the reduction, likewise.
        process_set: ranks that take part.
        compression: `Compression.fp16` sends float16 over the wire (keyword only: not in
            Horovod's `*_async` signatures).
        fuse: False for a tensor that is already a bucket: it is reduced alone, in place.
    """
    request, handle = allreduce_request(tensor, average, name, op, prescale_factor,
                                         postscale_factor, process_set, compression, fuse)
    _core.submit_many([request])
    return handle


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: str | None = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set, **kwargs: Any) -> Handle:
    """Like `allreduce_async_` on a copy: the input is left unchanged.

    Args:
        tensor: the tensor; the same shape and dtype on every member.
        average: deprecated Horovod flag: True means `op=Average`, False `op=Sum`; use `op`.
        name: the collective's name, the same on every member; automatic if None.
        op: Average (default), Sum, Adasum, Min, Max or Product.
        prescale_factor: multiplies the input before the reduction (Sum and Average).
        postscale_factor: multiplies the result after the reduction (Sum and Average).
        process_set: the ranks that take part (default: every rank).
    """
    tensor = check_tensor(tensor, "allreduce")
    if tensor.is_sparse:
        raise ConfigError("allreduce of a sparse tensor: use rx.sparse_allreduce_async")
    return allreduce_async_(contiguous_copy(tensor, "allreduce"), average, name, op,
                            prescale_factor, postscale_factor, process_set, **kwargs)


def _grouped_allreduce_handles(tensors, average, name, op, prescale_factor, postscale_factor,
                               process_set, compression) -> list[Handle]:
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise ConfigError("grouped collectives need a non-empty list of tensors")
    base = op_name("grouped_allreduce", name, process_set)
    pairs = [allreduce_request(t, average, f"{base}.{i}", op, prescale_factor,
                                postscale_factor, process_set, compression)
             for i, t in enumerate(tensors)]
    _core.submit_many([request for request, _ in pairs])
    return [handle for _, handle in pairs]


def grouped_allreduce_async_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
    compression: type[Compressor] = Compression.none,
) -> Handle:
    """Starts in-place allreduces of several tensors, enqueued atomically so that they are
    negotiated in the same cycle and fused together (within the fusion threshold). Returns
    one handle; `synchronize` gives the list of tensors.

    Args:
        tensors: tensors, in the same order, dtypes and shapes on every member.
        average: deprecated Horovod flag: True means `op=Average`, False `op=Sum`; use `op`.
        name: the collective's name, the same on every member; automatic if None.
        op: Average (default), Sum, Adasum, Min, Max or Product.
        prescale_factor: multiplies the input before the reduction (Sum and Average).
        postscale_factor: multiplies the result after the reduction (Sum and Average).
        process_set: the ranks that take part (default: every rank).
        compression: `Compression.fp16` sends floating-point tensors as float16 (keyword only).
    """
    handles = _grouped_allreduce_handles(tensors, average, name, op, prescale_factor,
                                         postscale_factor, process_set, compression)
    return CompositeHandle(handles[0].name, handles)


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None,
                            name: str | None = None, op: str | None = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set,
                            **kwargs: Any) -> Handle:
    """Like `grouped_allreduce_async_` on copies: the inputs are left unchanged.

    Args:
        tensors: tensors, in the same order, dtypes and shapes on every member.
        average: deprecated Horovod flag: True means `op=Average`, False `op=Sum`; use `op`.
        name: the collective's name, the same on every member; automatic if None.
        op: Average (default), Sum, Adasum, Min, Max or Product.
        prescale_factor: multiplies the input before the reduction (Sum and Average).
        postscale_factor: multiplies the result after the reduction (Sum and Average).
        process_set: the ranks that take part (default: every rank).
    """
    copies = [contiguous_copy(t, "allreduce") for t in tensors]
    return grouped_allreduce_async_(copies, average, name, op, prescale_factor,
                                    postscale_factor, process_set, **kwargs)


def sparse_allreduce_async(tensor: torch.Tensor, name: str | None = None,
                           op: str | None = None,
                           process_set: ProcessSet = global_process_set) -> Handle:
    """Allreduce of a sparse tensor as Horovod does it: an allgather of its indices and of
    its values. The handle is callable (or pass it to `synchronize`); it gives a sparse
    tensor whose duplicate indices sum up (divided by the set's size for Average).

    Args:
        tensor: a sparse COO tensor; members may hold different indices.
        name: the collective's name, the same on every member; automatic if None.
        op: Average (default) or Sum.
        process_set: the ranks that take part (default: every rank).
    """
    tensor = check_tensor(tensor, "sparse_allreduce_async")
    if not tensor.is_sparse:
        raise ConfigError("sparse_allreduce_async needs a sparse tensor (tensor.to_sparse())")
    op = _core.resolve_op(op, None)
    if op not in (Average, Sum):
        raise ConfigError("sparse_allreduce_async supports rx.Average and rx.Sum")
    base = op_name("sparse_allreduce", name, process_set)
    tensor = tensor.coalesce()
    indices = allgather_async(tensor.indices().t().contiguous(), f"{base}.indices", process_set)
    values = allgather_async(tensor.values().contiguous(), f"{base}.values", process_set)
    n = process_set.size()

    def finish(results: list[torch.Tensor]) -> torch.Tensor:
        gathered_indices, gathered_values = results
        if op == Average:
            gathered_values = gathered_values / n
        return torch.sparse_coo_tensor(gathered_indices.t(), gathered_values, tensor.shape)

    return CompositeHandle(base, [indices, values], finish)


def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Starts an allgather along dim 0; ranks may differ in dim 0, not in the others.

    Args:
        tensor: the tensor; members may differ in dim 0, not in the other dims.
        name: the collective's name, the same on every member; automatic if None.
        process_set: the ranks that take part (default: every rank).
    """
    request = allgather_request(tensor, op_name(ALLGATHER, name, process_set), process_set)
    _core.submit_many([request])
    return request.handle


def allgather_into_async(tensor: torch.Tensor, output: torch.Tensor, name: str,
                         process_set: ProcessSet = global_process_set) -> Handle:
    """An allgather of equally shaped tensors written into `output` (`tensor` may be this
    member's own slice of it); the handle gives `output`, or a new tensor where the engine
    took a route that cannot write in place (the caller copies it then)."""
    request = allgather_request(tensor, op_name(ALLGATHER, name, process_set), process_set,
                                output=output)
    _core.submit_many([request])
    return request.handle


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> Handle:
    """Starts allgathers of several tensors in one cycle; one handle gives the list.

    Args:
        tensors: tensors in the same order on every member; each may differ across members in dim 0
            only.
        name: the collective's name, the same on every member; automatic if None.
        process_set: the ranks that take part (default: every rank).
    """
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise ConfigError("grouped collectives need a non-empty list of tensors")
    base = op_name("grouped_allgather", name, process_set)
    requests = [allgather_request(t, f"{base}.{i}", process_set)
                for i, t in enumerate(tensors)]
    _core.submit_many(requests)
    return CompositeHandle(base, [r.handle for r in requests])


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """Starts an in-place broadcast from global rank `root_rank`.

    Args:
        tensor: the tensor, overwritten in place with the root's.
        root_rank: the global rank whose value every member receives.
        name: the collective's name, the same on every member; automatic if None.
        process_set: the ranks that take part (default: every rank).
    """
    tensor = check_tensor(tensor, "broadcast")
    if not tensor.is_contiguous():
        raise ConfigError("broadcast: tensor is not contiguous; call .contiguous() first")
    members = process_set.ranks if process_set.ranks is not None else None
    if members is not None and root_rank not in members:
        raise ConfigError(f"broadcast root_rank {root_rank} is not in the process set {members}")
    meta = Meta(BROADCAST, checked_dtype(tensor), tuple(tensor.shape), root=int(root_rank),
                process_set_id=registered_id(process_set), device=tensor.device.type,
                framework="torch")
    return _core.submit(op_name(BROADCAST, name, process_set), meta, tensor.detach(), output=tensor)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Starts a broadcast of `root_rank`'s tensor into a new tensor; returns a handle for
    `synchronize`, which returns the new tensor (the input is left as it is).

    Args:
        tensor: the tensor; the root's is sent, and every member's has its shape and dtype.
        root_rank: the global rank whose value every member receives.
        name: the collective's name, the same on every member; automatic if None.
        process_set: the ranks that take part (default: every rank).
    """
    return broadcast_async_(contiguous_copy(tensor, "broadcast"), root_rank, name, process_set)


def alltoall_async(tensor: torch.Tensor, splits: Sequence[int] | torch.Tensor | None = None,
                   name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> Handle:
    """Starts an alltoall: rows `splits[i]` of dim 0 go to member i (equal split if None).
    The handle gives `(output, received_splits)`.

    Args:
        tensor: the rows to send, split along dim 0 by `splits`.
        splits: how many rows of dim 0 go to each member, in member order (equal parts if None).
        name: the collective's name, the same on every member; automatic if None.
        process_set: the ranks that take part (default: every rank).
    """
    tensor = check_tensor(tensor, "alltoall").detach().contiguous()
    n = process_set.size()
    if splits is None:
        if tensor.dim() == 0 or tensor.shape[0] % n:
            raise ConfigError(f"alltoall without splits needs dim 0 ({tuple(tensor.shape)}) "
                              f"divisible by the {n} members; pass splits=")
        split_list = [tensor.shape[0] // n] * n
    else:
        if torch.is_tensor(splits) and splits.dtype not in (torch.int32, torch.int64):
            raise ConfigError(f"alltoall splits must be integers, got {splits.dtype}")
        split_list = [int(s) for s in (splits.tolist() if torch.is_tensor(splits) else splits)]
        if len(split_list) != n or any(s < 0 for s in split_list) \
                or sum(split_list) != (tensor.shape[0] if tensor.dim() else 0):
            raise ConfigError(f"alltoall splits {split_list} must be {n} non-negative numbers "
                              f"summing to dim 0 ({tensor.shape[0] if tensor.dim() else 0})")
    meta = Meta(ALLTOALL, checked_dtype(tensor), tuple(tensor.shape),
                process_set_id=registered_id(process_set), device=tensor.device.type,
                framework="torch",
                splits=tuple(split_list))
    return _core.submit(op_name(ALLTOALL, name, process_set), meta, tensor)


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: str | None = Average,
                        process_set: ProcessSet = global_process_set,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Handle:
    """Starts a reduce-scatter along dim 0 (the first `dim0 % size` ranks get a row more).

    Args:
        tensor: the tensor to reduce; the same shape on every member, its dim 0 shared out.
        name: the collective's name, the same on every member; automatic if None.
        op: Average (default) or Sum.
        process_set: the ranks that take part (default: every rank).
        prescale_factor: multiplies the input before the reduction (Sum and Average).
        postscale_factor: multiplies the result after the reduction (Sum and Average).
    """
    request = reducescatter_request(tensor, op_name(REDUCESCATTER, name, process_set), op,
                                    process_set, prescale_factor, postscale_factor)
    _core.submit_many([request])
    return request.handle


def reducescatter_into_async(tensor: torch.Tensor, output: torch.Tensor, name: str,
                             op: str | None, process_set: ProcessSet,
                             prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0) -> Handle:
    """A reduce-scatter whose share is written into `output` where the shares are equal;
    the handle gives `output`, or a new tensor where the engine took a route that cannot
    write there (the caller copies it then)."""
    request = reducescatter_request(tensor, op_name(REDUCESCATTER, name, process_set), op,
                                    process_set, prescale_factor, postscale_factor,
                                    output=output)
    _core.submit_many([request])
    return request.handle


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                                op: str | None = Average,
                                process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> Handle:
    """Starts reduce-scatters of several tensors in one cycle; one handle gives the list.

    Args:
        tensors: tensors, in the same order, dtypes and shapes on every member.
        name: the collective's name, the same on every member; automatic if None.
        op: Average (default) or Sum.
        process_set: the ranks that take part (default: every rank).
        prescale_factor: multiplies the input before the reduction (Sum and Average).
        postscale_factor: multiplies the result after the reduction (Sum and Average).
    """
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise ConfigError("grouped collectives need a non-empty list of tensors")
    base = op_name("grouped_reducescatter", name, process_set)
    requests = [reducescatter_request(t, f"{base}.{i}", op, process_set, prescale_factor,
                                       postscale_factor) for i, t in enumerate(tensors)]
    _core.submit_many(requests)
    return CompositeHandle(base, [r.handle for r in requests])
