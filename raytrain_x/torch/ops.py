"""Horovod's PyTorch collectives on the raytrain-x engine, in Horovod's positional order:
the blocking forms.

Every collective has a blocking form here and an `_async` form
(`raytrain_x.torch.async_ops`) returning a handle for `synchronize`/`poll`; trailing
underscore forms work in place. The blocking out-of-place forms are autograd functions with
Horovod's gradients (`raytrain_x.torch.autograd`); the in-place forms stay outside autograd,
as in Horovod. Names get Horovod's kind prefix (`name="x"` is `allreduce.x` in the timeline
and in errors). The order of imports is one way: ops > autograd > async_ops > requests.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from raytrain_x.core import collectives as _core
from raytrain_x.core.collectives import Average, synchronize
from raytrain_x.core.process_sets import ProcessSet, global_process_set
from raytrain_x.torch import autograd
from raytrain_x.torch.async_ops import (
    allreduce_async_,
    broadcast_async_,
    grouped_allreduce_async_,
)
from raytrain_x.torch.compression import Compression, Compressor
from raytrain_x.torch.requests import check_tensor


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: str | None = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In-place allreduce; returns `tensor` (outside autograd, as in Horovod).

    Args:
        tensor: the tensor, reduced in place; the same shape and dtype on every member.
        average: deprecated Horovod flag: True means `op=Average`, False `op=Sum`; use `op`.
        name: the collective's name, the same on every member; automatic if None.
        op: Average (default), Sum, Adasum, Min, Max or Product.
        prescale_factor: multiplies the input before the reduction (Sum and Average).
        postscale_factor: multiplies the result after the reduction (Sum and Average).
        process_set: the ranks that take part (default: every rank).
    """
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set))


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: type[Compressor] = Compression.none, op: str | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Allreduce returning a new tensor (default op: Average). Differentiable: the gradient
    is the allreduce of the gradient with the same op and factors.

    Args:
        tensor: the tensor; the same shape and dtype on every member.
        average: deprecated Horovod flag: True means `op=Average`, False `op=Sum`; use `op`.
        name: the collective's name, the same on every member; automatic if None.
        compression: `Compression.fp16` sends floating-point tensors as float16 and casts back.
        op: Average (default), Sum, Adasum, Min, Max or Product.
        prescale_factor: multiplies the input before the reduction (Sum and Average).
        postscale_factor: multiplies the result after the reduction (Sum and Average).
        process_set: the ranks that take part (default: every rank).
    """
    op = _core.resolve_op(op, average)
    return autograd.allreduce(check_tensor(tensor, "allreduce"), name, compression, op,
                              prescale_factor, postscale_factor, process_set)


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                       name: str | None = None, op: str | None = None,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Reduces `tensors` in place, as one fused collective; returns them.

    Args:
        tensors: contiguous tensors, each reduced in place.
        average: deprecated Horovod flag; use `op`.
        name: the group's name, the same on every rank; automatic if None.
        op: Average (default), Sum, Adasum, Min, Max or Product.
        prescale_factor: multiplies each tensor before the reduction.
        postscale_factor: multiplies each result after the reduction.
        process_set: ranks that take part.
    """
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None,
                      name: str | None = None,
                      compression: type[Compressor] = Compression.none,
                      op: str | None = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allreduces of several tensors, fused; differentiable like `allreduce`.

    Args:
        tensors: tensors, in the same order, dtypes and shapes on every member.
        average: deprecated Horovod flag: True means `op=Average`, False `op=Sum`; use `op`.
        name: the collective's name, the same on every member; automatic if None.
        compression: `Compression.fp16` sends floating-point tensors as float16 and casts back.
        op: Average (default), Sum, Adasum, Min, Max or Product.
        prescale_factor: multiplies the input before the reduction (Sum and Average).
        postscale_factor: multiplies the result after the reduction (Sum and Average).
        process_set: the ranks that take part (default: every rank).
    """
    op = _core.resolve_op(op, average)
    return autograd.grouped_allreduce(list(tensors), name, compression, op, prescale_factor,
                                      postscale_factor, process_set)


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenation of every member's tensor along dim 0, in rank order. Differentiable:
    a rank's gradient is its own rows of the members' averaged gradient (Horovod's rule).

    Args:
        tensor: the tensor; members may differ in dim 0, not in the other dims.
        name: the collective's name, the same on every member; automatic if None.
        process_set: the ranks that take part (default: every rank).
    """
    return autograd.allgather(check_tensor(tensor, "allgather"), name, process_set)


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allgathers of several tensors; differentiable like `allgather`.

    Args:
        tensors: tensors in the same order on every member; each may differ across members in dim 0
            only.
        name: the collective's name, the same on every member; automatic if None.
        process_set: the ranks that take part (default: every rank).
    """
    return autograd.grouped_allgather(list(tensors), name, process_set)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Overwrites `tensor` on every member with `root_rank`'s; returns it.

    Args:
        tensor: the tensor, overwritten in place with the root's.
        root_rank: the global rank whose value every member receives.
        name: the collective's name, the same on every member; automatic if None.
        process_set: the ranks that take part (default: every rank).
    """
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """`root_rank`'s tensor on every member (a new tensor). Differentiable: the root gets
    the members' averaged gradient, the others zeros (Horovod's rule).

    Args:
        tensor: the tensor; the root's is sent, and every member's has its shape and dtype.
        root_rank: the global rank whose value every member receives.
        name: the collective's name, the same on every member; automatic if None.
        process_set: the ranks that take part (default: every rank).
    """
    return autograd.broadcast(check_tensor(tensor, "broadcast"), root_rank, name, process_set)


def alltoall(tensor: torch.Tensor, splits: Sequence[int] | torch.Tensor | None = None,
             name: str | None = None, process_set: ProcessSet = global_process_set):
    """Returns the received rows; with `splits`, returns `(output, received_splits)`.
    Differentiable: the gradient goes back to the senders with the received splits.

    Args:
        tensor: the rows to send, split along dim 0 by `splits`.
        splits: how many rows of dim 0 go to each member, in member order (equal parts if None).
        name: the collective's name, the same on every member; automatic if None.
        process_set: the ranks that take part (default: every rank).
    """
    output, received = autograd.alltoall(check_tensor(tensor, "alltoall"), splits, name,
                                         process_set)
    return (output, received) if splits is not None else output


def reducescatter(tensor: torch.Tensor, name: str | None = None,
                  compression: type[Compressor] = Compression.none, op: str | None = Average,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """This rank's rows of the members' reduced tensor. Differentiable: the gradient is the
    allgather of the gradient (times the set's size for Sum, Horovod's rule).

    Args:
        tensor: the tensor to reduce; the same shape on every member, its dim 0 shared out.
        name: the collective's name, the same on every member; automatic if None.
        compression: `Compression.fp16` sends floating-point tensors as float16 and casts back.
        op: Average (default) or Sum.
        process_set: the ranks that take part (default: every rank).
        prescale_factor: multiplies the input before the reduction (Sum and Average).
        postscale_factor: multiplies the result after the reduction (Sum and Average).
    """
    return autograd.reducescatter(check_tensor(tensor, "reducescatter"), name, compression,
                                  _core.resolve_op(op, None), process_set, prescale_factor,
                                  postscale_factor)


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None,
                          compression: type[Compressor] = Compression.none,
                          op: str | None = Average,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """Reduce-scatters of several tensors; differentiable like `reducescatter`.

    Args:
        tensors: tensors, in the same order, dtypes and shapes on every member.
        name: the collective's name, the same on every member; automatic if None.
        compression: `Compression.fp16` sends floating-point tensors as float16 and casts back.
        op: Average (default) or Sum.
        process_set: the ranks that take part (default: every rank).
        prescale_factor: multiplies the input before the reduction (Sum and Average).
        postscale_factor: multiplies the result after the reduction (Sum and Average).
    """
    return autograd.grouped_reducescatter(list(tensors), name, compression,
                                          _core.resolve_op(op, None), process_set,
                                          prescale_factor, postscale_factor)
