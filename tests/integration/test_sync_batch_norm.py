"""`rx.SyncBatchNorm` between real processes: forward, backward and running statistics equal
`nn.BatchNorm*d` on the ranks' combined batch, with uneven per-rank batches."""

from __future__ import annotations

import pytest
import torch

from tests.workers import run_workers

BATCHES = [3, 1, 2]  # rows per rank: uneven


def _batch(rank: int, shape: tuple) -> torch.Tensor:
    g = torch.Generator().manual_seed(7 + rank)
    return torch.randn(BATCHES[rank], *shape, generator=g, dtype=torch.float64) * 3 + rank


def _weights(rank: int, shape: tuple) -> torch.Tensor:
    g = torch.Generator().manual_seed(50 + rank)
    return torch.randn(BATCHES[rank], *shape, generator=g, dtype=torch.float64)


def _sync_bn(shape: tuple, momentum) -> dict:
    import raytrain_x.torch as rx

    rx.init()
    r = rx.rank()
    bn = rx.SyncBatchNorm(shape[0], momentum=momentum).double()
    with torch.no_grad():
        bn.weight.copy_(torch.linspace(0.5, 2.0, shape[0]))
        bn.bias.copy_(torch.linspace(-1.0, 1.0, shape[0]))
    out = {"y": [], "dx": []}
    for step in range(2):  # two steps: running statistics accumulate
        x = (_batch(r, shape) + step).requires_grad_()
        y = bn(x)
        (y * _weights(r, shape)).sum().backward()
        out["y"].append(y.detach())
        out["dx"].append(x.grad)
    out["dw"], out["db"] = bn.weight.grad, bn.bias.grad
    out["running"] = (bn.running_mean.clone(), bn.running_var.clone(),
                      int(bn.num_batches_tracked))
    bn.eval()
    out["eval"] = bn(_batch(r, shape))
    rx.shutdown()
    return out


@pytest.mark.parametrize("size,shape,momentum", [
    (2, (4,), 0.1),          # BatchNorm1d on (N, C)
    (3, (3, 5, 4), 0.3),     # BatchNorm2d on (N, C, H, W), three ranks, uneven
    (2, (2, 3, 2, 2), None),  # BatchNorm3d, cumulative average
])
def test_sync_batch_norm_equals_batch_norm_on_the_combined_batch(size, shape, momentum):
    results = run_workers(_sync_bn, size, shape, momentum, work_s=15)
    kind = {1: torch.nn.BatchNorm1d, 2: torch.nn.BatchNorm1d, 3: torch.nn.BatchNorm2d,
            4: torch.nn.BatchNorm3d}[len(shape)]
    bn = kind(shape[0], momentum=momentum).double()
    with torch.no_grad():
        bn.weight.copy_(torch.linspace(0.5, 2.0, shape[0]))
        bn.bias.copy_(torch.linspace(-1.0, 1.0, shape[0]))
    offsets = [sum(BATCHES[:k]) for k in range(size)]
    for step in range(2):
        x = torch.cat([_batch(k, shape) + step for k in range(size)]).requires_grad_()
        y = bn(x)
        (y * torch.cat([_weights(k, shape) for k in range(size)])).sum().backward()
        for r, got in enumerate(results):
            rows = slice(offsets[r], offsets[r] + BATCHES[r])
            assert torch.allclose(got["y"][step], y[rows], atol=1e-10)
            assert torch.allclose(got["dx"][step], x.grad[rows], atol=1e-10)
        x.grad = None
    # parameter gradients: each rank has its rows' part; together, the whole batch's
    assert torch.allclose(sum(got["dw"] for got in results), bn.weight.grad, atol=1e-10)
    assert torch.allclose(sum(got["db"] for got in results), bn.bias.grad, atol=1e-10)
    for got in results:
        mean, var, tracked = got["running"]
        assert torch.allclose(mean, bn.running_mean) and torch.allclose(var, bn.running_var)
        assert tracked == 2
    bn.eval()
    for r, got in enumerate(results):
        assert torch.allclose(got["eval"], bn(_batch(r, shape)), atol=1e-10)
