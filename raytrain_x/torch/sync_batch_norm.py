"""Horovod's `SyncBatchNorm`: batch normalisation with the statistics of the whole batch
across the ranks of a process set, in the forward and the backward pass.

Cost per layer and training step: one allgather of `2 * C + 1` numbers per rank in the
forward pass (count, mean and M2 of each channel: exact for uneven batches, and without the
cancellation of a sum of squares), one allreduce of `2 * C` numbers in the backward pass.
In eval mode, or on a set of one rank, it is `nn.BatchNorm*d` with the running statistics.
"""

from __future__ import annotations

import torch
from torch import nn

from raytrain_x.common.errors import ConfigError
from raytrain_x.core.collectives import Sum, synchronize
from raytrain_x.core.process_sets import ProcessSet, global_process_set
from raytrain_x.torch import async_ops as ops


class SyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """Drop-in for `nn.BatchNorm1d/2d/3d` whose batch statistics span every member of
    `process_set`; the result equals `nn.BatchNorm*d` on the members' combined batch.

    Args:
        num_features: channels, as in `nn.BatchNorm*d`.
        eps: added to the variance, as in `nn.BatchNorm*d`.
        momentum: running statistics' momentum; None for a cumulative average.
        affine: learn a scale and a shift, as in `nn.BatchNorm*d`.
        track_running_stats: keep running statistics, as in `nn.BatchNorm*d`.
        process_set: the ranks whose batches are combined.
        device: where the parameters are made, as in `nn.BatchNorm*d`.
        dtype: the parameters' dtype, as in `nn.BatchNorm*d`.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 process_set: ProcessSet = global_process_set,
                 device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype)
        self.process_set = process_set

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ConfigError(f"SyncBatchNorm expects an input of 2 to 5 dimensions "
                              f"(N, C, ...), got {input.dim()}")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if input.shape[1] != self.num_features:
            raise ConfigError(f"SyncBatchNorm({self.num_features}) got {input.shape[1]} "
                              "channels (dim 1)")
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked)
        use_batch = self.training or not self.track_running_stats
        if not use_batch or self.process_set.size() == 1:
            return nn.functional.batch_norm(
                input, self.running_mean if not use_batch or self.track_running_stats
                else None,
                self.running_var if not use_batch or self.track_running_stats else None,
                self.weight, self.bias, use_batch, factor, self.eps)
        return _SyncBatchNormFunction.apply(
            input, self.weight, self.bias,
            self.running_mean if self.track_running_stats else None,
            self.running_var if self.track_running_stats else None,
            self.eps, factor, self.process_set)


def _channels_last(x: torch.Tensor) -> torch.Tensor:
    """(N, C, *) as (N * prod(*), C)."""
    return x.transpose(0, 1).reshape(x.shape[1], -1).t()


def _per_channel(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A (C,) vector shaped to broadcast against (N, C, *)."""
    return v.reshape(1, -1, *([1] * (x.dim() - 2)))


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, process_set):
        flat = _channels_last(x.detach())
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        flat = flat.to(work)
        count = flat.shape[0]
        mean = flat.mean(dim=0) if count else torch.zeros(flat.shape[1], dtype=work,
                                                             device=flat.device)
        m2 = ((flat - mean) ** 2).sum(dim=0) if count else torch.zeros_like(mean)
        mine = torch.cat([torch.tensor([float(count)], dtype=work, device=flat.device), mean,
                          m2]).reshape(1, -1)
        everyone = synchronize(ops.allgather_async(mine, None, process_set))
        counts, means, m2s = everyone[:, 0], everyone[:, 1:1 + mean.numel()], \
            everyone[:, 1 + mean.numel():]
        total = counts.sum()
        if total < 2:
            raise ConfigError(f"SyncBatchNorm needs more than one value per channel across "
                              f"the process set in training, got {int(total)}")
        g_mean = (counts[:, None] * means).sum(dim=0) / total
        g_m2 = (m2s + counts[:, None] * (means - g_mean) ** 2).sum(dim=0)
        var = g_m2 / total
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(g_mean.to(running_mean.dtype), alpha=momentum)
            unbiased = g_m2 / (total - 1)
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        x_hat = (x.to(work) - _per_channel(g_mean, x)) * _per_channel(invstd, x)
        out = x_hat
        if weight is not None:
            out = out * _per_channel(weight.to(work), x) + _per_channel(bias.to(work), x)
        ctx.save_for_backward(x, weight, g_mean, invstd)
        ctx.total, ctx.process_set = total, process_set
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, mean, invstd = ctx.saved_tensors
        work = mean.dtype
        dy = grad_out.to(work)
        x_mu = x.to(work) - _per_channel(mean, x)
        dims = [d for d in range(x.dim()) if d != 1]
        sum_dy = dy.sum(dim=dims)
        sum_dy_xmu = (dy * x_mu).sum(dim=dims)
        # this rank's parameter gradients (DistributedOptimizer combines them as any other)
        grad_weight = (sum_dy_xmu * invstd).to(weight.dtype) if weight is not None else None
        grad_bias = sum_dy.to(weight.dtype) if weight is not None else None
        both = synchronize(ops.allreduce_async(torch.cat([sum_dy, sum_dy_xmu]), None, None,
                                               Sum, process_set=ctx.process_set))
        all_dy, all_dy_xmu = both[:sum_dy.numel()], both[sum_dy.numel():]
        scale = invstd if weight is None else invstd * weight.to(work)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = _per_channel(scale, x) * (
                dy - _per_channel(all_dy / ctx.total, x)
                - x_mu * _per_channel(invstd ** 2 * all_dy_xmu / ctx.total, x))
            grad_x = grad_x.to(x.dtype)
        return grad_x, grad_weight, grad_bias, None, None, None, None, None
