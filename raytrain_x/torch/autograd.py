"""Gradients through the collectives, with Horovod's rules (horovod/torch/mpi_ops.py):

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
from typing import Any

import torch

from raytrain_x.core.collectives import Average, Sum, synchronize
from raytrain_x.core.process_sets import ProcessSet
from raytrain_x.core.runtime import rank
from raytrain_x.torch import async_ops as ops
from raytrain_x.torch.compression import Compression, Compressor

_NONE = Compression.none


def _compressed_allreduce_async(tensor: torch.Tensor, name: str | None,
                                compression: type[Compressor], op: str, pre: float,
                                post: float, process_set: ProcessSet):
    return ops.allreduce_async(tensor, None, name, op, pre, post, process_set,
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
        return (allreduce(grad.contiguous(), None, compression, op, pre, post, process_set),
                None, None, None, None, None, None)


def allreduce(tensor, name, compression, op, pre, post, process_set) -> torch.Tensor:
    return _Allreduce.apply(tensor, name, compression, op, pre, post, process_set)


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, compression, op, pre, post, process_set, *tensors):
        ctx.args = (compression, op, pre, post, process_set)
        handle = ops.grouped_allreduce_async(list(tensors), None, name, op, pre, post,
                                             process_set, compression=compression)
        return tuple(synchronize(handle))

    @staticmethod
    def backward(ctx, *grads):
        compression, op, pre, post, process_set = ctx.args
        reduced = grouped_allreduce([g.contiguous() for g in grads], None, compression, op,
                                    pre, post, process_set)
        return (None, None, None, None, None, None, *reduced)


def grouped_allreduce(tensors, name, compression, op, pre, post,
                      process_set) -> list[torch.Tensor]:
    return list(_GroupedAllreduce.apply(name, compression, op, pre, post, process_set,
                                        *tensors))


def _own_rows(grads: Sequence[torch.Tensor], dims: Sequence[int],
              process_set: ProcessSet) -> list[torch.Tensor]:
    """Each gradient's rows that belong to this rank, given each tensor's own dim 0."""
    all_dims = synchronize(ops.allgather_async(
        torch.tensor(list(dims), dtype=torch.int64).reshape(1, -1), None, process_set))
    me = process_set.rank()
    offsets = all_dims[:me].sum(dim=0).tolist() if me else [0] * len(dims)
    return [g.narrow(0, int(off), int(d)) for g, off, d in zip(grads, offsets, dims)]


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.shape, ctx.process_set = tensor.shape, process_set
        return synchronize(ops.allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        reduced = allreduce(grad.contiguous(), None, _NONE, Average, 1.0, 1.0, ctx.process_set)
        dim = ctx.shape[0] if len(ctx.shape) else 1
        (mine,) = _own_rows([reduced], [dim], ctx.process_set)
        return mine.reshape(ctx.shape), None, None


def allgather(tensor, name, process_set) -> torch.Tensor:
    return _Allgather.apply(tensor, name, process_set)


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.shapes, ctx.process_set = [t.shape for t in tensors], process_set
        return tuple(synchronize(ops.grouped_allgather_async(list(tensors), name,
                                                             process_set)))

    @staticmethod
    def backward(ctx, *grads):
        reduced = grouped_allreduce([g.contiguous() for g in grads], None, _NONE, Average,
                                    1.0, 1.0, ctx.process_set)
        dims = [s[0] if len(s) else 1 for s in ctx.shapes]
        mine = _own_rows(reduced, dims, ctx.process_set)
        return (None, None, *[m.reshape(s) for m, s in zip(mine, ctx.shapes)])


def grouped_allgather(tensors, name, process_set) -> list[torch.Tensor]:
    return list(_GroupedAllgather.apply(name, process_set, *tensors))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return synchronize(ops.broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        reduced = allreduce(grad.contiguous(), None, _NONE, Average, 1.0, 1.0, ctx.process_set)
        if rank() != ctx.root_rank:
            reduced = torch.zeros_like(reduced)
        return reduced, None, None, None


def broadcast(tensor, root_rank, name, process_set) -> torch.Tensor:
    return _Broadcast.apply(tensor, root_rank, name, process_set)


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        output, received = synchronize(ops.alltoall_async(tensor, splits, name, process_set))
        ctx.received, ctx.process_set = received, process_set
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad, _received_grad):
        back, _ = synchronize(ops.alltoall_async(grad.contiguous(), ctx.received, None,
                                                 ctx.process_set))
        return back, None, None, None


def alltoall(tensor, splits, name, process_set) -> tuple[torch.Tensor, torch.Tensor]:
    return _Alltoall.apply(tensor, splits, name, process_set)


def _reducescatter_grad_scale(op: str, process_set: ProcessSet, pre: float,
                              post: float) -> float:
    return (process_set.size() if op == Sum else 1.0) * pre * post


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, compression, op, process_set, pre, post):
        ctx.args = (op, process_set, pre, post)
        work, state = compression.compress(tensor)
        out = synchronize(ops.reducescatter_async(work, name, op, process_set, pre, post))
        return compression.decompress(out, state)

    @staticmethod
    def backward(ctx, grad):
        op, process_set, pre, post = ctx.args
        gathered = allgather(grad.contiguous(), None, process_set)
        scale = _reducescatter_grad_scale(op, process_set, pre, post)
        return (gathered * scale if scale != 1.0 else gathered,
                None, None, None, None, None, None)


def reducescatter(tensor, name, compression, op, process_set, pre, post) -> torch.Tensor:
    return _Reducescatter.apply(tensor, name, compression, op, process_set, pre, post)


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, compression, op, process_set, pre, post, *tensors):
        ctx.args = (op, process_set, pre, post)
        pairs = [compression.compress(t) for t in tensors]
        outs = synchronize(ops.grouped_reducescatter_async([w for w, _ in pairs], name, op,
                                                           process_set, pre, post))
        return tuple(compression.decompress(o, s) for o, (_, s) in zip(outs, pairs))

    @staticmethod
    def backward(ctx, *grads):
        op, process_set, pre, post = ctx.args
        gathered = grouped_allgather([g.contiguous() for g in grads], None, process_set)
        scale = _reducescatter_grad_scale(op, process_set, pre, post)
        return (None, None, None, None, None, None,
                *[g * scale if scale != 1.0 else g for g in gathered])


def grouped_reducescatter(tensors, name, compression, op, process_set, pre,
                          post) -> list[torch.Tensor]:
    return list(_GroupedReducescatter.apply(name, compression, op, process_set, pre, post,
                                            *tensors))


__all__: list[Any] = []
