"""Horovod's PyTorch collectives on the raytrain-x engine, in Horovod's positional order:
the blocking forms, and their gradients.

Every collective has a blocking form here and an `_async` form
(`raytrain_x.torch.async_ops`) returning a handle for `synchronize`/`poll`; trailing
underscore forms work in place. The blocking out-of-place forms are autograd functions with
Horovod's gradients (horovod/torch/mpi_ops.py); the in-place forms stay outside autograd, as
in Horovod. Names get Horovod's kind prefix (`name="x"` is `allreduce.x` in the timeline and
in errors).

The gradients:

- allreduce: the allreduce of the gradient, with the same op and factors;
- allgather: this rank's rows of the members' *averaged* gradient (first dimensions may
  differ per rank);
- broadcast: the members' averaged gradient on the root, zeros elsewhere;
- alltoall: the gradient goes back to the senders, split as it was received;
- reducescatter: the allgather of the gradient, times the set's size for Sum (and times
  the pre- and postscale factors).

Grouped forms do the same per tensor in one grouped collective. Each function runs the
forward collective once; autograd records it only when an input requires a gradient.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from raytrain_x.core import collectives as _core
from raytrain_x.core.collectives import Average, Sum, synchronize
from raytrain_x.core.process_sets import ProcessSet, global_process_set
from raytrain_x.core.runtime import rank
from raytrain_x.torch import async_ops
from raytrain_x.torch.async_ops import (
    allreduce_async_,
    broadcast_async_,
    check_tensor,
    grouped_allreduce_async_,
)
from raytrain_x.torch.compression import Compression, Compressor

_NONE = Compression.none

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
    return _diff_allreduce(check_tensor(tensor, "allreduce"), name, compression, op,
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
    return _diff_grouped_allreduce(list(tensors), name, compression, op, prescale_factor,
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
    return _diff_allgather(check_tensor(tensor, "allgather"), name, process_set)


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allgathers of several tensors; differentiable like `allgather`.

    Args:
        tensors: tensors in the same order on every member; each may differ across members in dim 0
            only.
        name: the collective's name, the same on every member; automatic if None.
        process_set: the ranks that take part (default: every rank).
    """
    return _diff_grouped_allgather(list(tensors), name, process_set)


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
    return _diff_broadcast(check_tensor(tensor, "broadcast"), root_rank, name, process_set)


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
    output, received = _diff_alltoall(check_tensor(tensor, "alltoall"), splits, name,
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
    return _diff_reducescatter(check_tensor(tensor, "reducescatter"), name, compression,
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
    return _diff_grouped_reducescatter(list(tensors), name, compression,
                                          _core.resolve_op(op, None), process_set,
                                          prescale_factor, postscale_factor)


# ----------------------------------------------------------------------------- gradients
def _compressed_allreduce_async(tensor: torch.Tensor, name: str | None,
                                compression: type[Compressor], op: str, pre: float,
                                post: float, process_set: ProcessSet):
    return async_ops.allreduce_async(tensor, None, name, op, pre, post, process_set,
                               compression=compression)


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, compression, op, pre, post, process_set):
        ctx.args = (compression, op, pre, post, process_set)
        return synchronize(_compressed_allreduce_async(tensor, name, compression, op, pre,
                                                       post, process_set))

    @staticmethod
    def backward(ctx, grad):
        compression, op, pre, post, process_set = ctx.args
        return (_diff_allreduce(grad.contiguous(), None, compression, op, pre, post,
                                process_set),
                None, None, None, None, None, None)


def _diff_allreduce(tensor, name, compression, op, pre, post, process_set) -> torch.Tensor:
    return _Allreduce.apply(tensor, name, compression, op, pre, post, process_set)


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, compression, op, pre, post, process_set, *tensors):
        ctx.args = (compression, op, pre, post, process_set)
        handle = async_ops.grouped_allreduce_async(list(tensors), None, name, op, pre, post,
                                                   process_set, compression=compression)
        return tuple(synchronize(handle))

    @staticmethod
    def backward(ctx, *grads):
        compression, op, pre, post, process_set = ctx.args
        reduced = _diff_grouped_allreduce([g.contiguous() for g in grads], None, compression,
                                          op, pre, post, process_set)
        return (None, None, None, None, None, None, *reduced)


def _diff_grouped_allreduce(tensors, name, compression, op, pre, post,
                            process_set) -> list[torch.Tensor]:
    return list(_GroupedAllreduce.apply(name, compression, op, pre, post, process_set,
                                        *tensors))


def _own_rows(grads: Sequence[torch.Tensor], dims: Sequence[int],
              process_set: ProcessSet) -> list[torch.Tensor]:
    """Each gradient's rows that belong to this rank, given each tensor's own dim 0."""
    all_dims = synchronize(async_ops.allgather_async(
        torch.tensor(list(dims), dtype=torch.int64).reshape(1, -1), None, process_set))
    me = process_set.rank()
    offsets = all_dims[:me].sum(dim=0).tolist() if me else [0] * len(dims)
    return [g.narrow(0, int(off), int(d)) for g, off, d in zip(grads, offsets, dims)]


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.shape, ctx.process_set = tensor.shape, process_set
        return synchronize(async_ops.allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        reduced = _diff_allreduce(grad.contiguous(), None, _NONE, Average, 1.0, 1.0,
                                  ctx.process_set)
        dim = ctx.shape[0] if len(ctx.shape) else 1
        (mine,) = _own_rows([reduced], [dim], ctx.process_set)
        return mine.reshape(ctx.shape), None, None


def _diff_allgather(tensor, name, process_set) -> torch.Tensor:
    return _Allgather.apply(tensor, name, process_set)


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.shapes, ctx.process_set = [t.shape for t in tensors], process_set
        return tuple(synchronize(async_ops.grouped_allgather_async(list(tensors), name,
                                                                   process_set)))

    @staticmethod
    def backward(ctx, *grads):
        reduced = _diff_grouped_allreduce([g.contiguous() for g in grads], None, _NONE,
                                          Average, 1.0, 1.0, ctx.process_set)
        dims = [s[0] if len(s) else 1 for s in ctx.shapes]
        mine = _own_rows(reduced, dims, ctx.process_set)
        return (None, None, *[m.reshape(s) for m, s in zip(mine, ctx.shapes)])


def _diff_grouped_allgather(tensors, name, process_set) -> list[torch.Tensor]:
    return list(_GroupedAllgather.apply(name, process_set, *tensors))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return synchronize(async_ops.broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        reduced = _diff_allreduce(grad.contiguous(), None, _NONE, Average, 1.0, 1.0,
                                  ctx.process_set)
        if rank() != ctx.root_rank:
            reduced = torch.zeros_like(reduced)
        return reduced, None, None, None


def _diff_broadcast(tensor, root_rank, name, process_set) -> torch.Tensor:
    return _Broadcast.apply(tensor, root_rank, name, process_set)


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        output, received = synchronize(async_ops.alltoall_async(tensor, splits, name, process_set))
        ctx.received, ctx.process_set = received, process_set
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad, _received_grad):
        back, _ = synchronize(async_ops.alltoall_async(grad.contiguous(), ctx.received, None,
                                                       ctx.process_set))
        return back, None, None, None


def _diff_alltoall(tensor, splits, name, process_set) -> tuple[torch.Tensor, torch.Tensor]:
    return _Alltoall.apply(tensor, splits, name, process_set)


def _reducescatter_grad_scale(op: str, process_set: ProcessSet, pre: float,
                              post: float) -> float:
    return (process_set.size() if op == Sum else 1.0) * pre * post


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, compression, op, process_set, pre, post):
        ctx.args = (op, process_set, pre, post)
        work, state = compression.compress(tensor)
        out = synchronize(async_ops.reducescatter_async(work, name, op, process_set, pre, post))
        return compression.decompress(out, state)

    @staticmethod
    def backward(ctx, grad):
        op, process_set, pre, post = ctx.args
        gathered = _diff_allgather(grad.contiguous(), None, process_set)
        scale = _reducescatter_grad_scale(op, process_set, pre, post)
        return (gathered * scale if scale != 1.0 else gathered,
                None, None, None, None, None, None)


def _diff_reducescatter(tensor, name, compression, op, process_set, pre, post) -> torch.Tensor:
    return _Reducescatter.apply(tensor, name, compression, op, process_set, pre, post)


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, compression, op, process_set, pre, post, *tensors):
        ctx.args = (op, process_set, pre, post)
        pairs = [compression.compress(t) for t in tensors]
        outs = synchronize(async_ops.grouped_reducescatter_async(
            [w for w, _ in pairs], name, op, process_set, pre, post))
        return tuple(compression.decompress(o, s) for o, (_, s) in zip(outs, pairs))

    @staticmethod
    def backward(ctx, *grads):
        op, process_set, pre, post = ctx.args
        gathered = _diff_grouped_allgather([g.contiguous() for g in grads], None, process_set)
        scale = _reducescatter_grad_scale(op, process_set, pre, post)
        return (None, None, None, None, None, None,
                *[g * scale if scale != 1.0 else g for g in gathered])


def _diff_grouped_reducescatter(tensors, name, compression, op, process_set, pre,
                                post) -> list[torch.Tensor]:
    return list(_GroupedReducescatter.apply(name, compression, op, process_set, pre, post,
                                            *tensors))
