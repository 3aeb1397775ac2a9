"""CUDA tensors through the torch face, between real processes (no Ray needed).

Two ranks share one GPU: NCCL refuses two ranks on one device, so they run over gloo
(`RAYTRAIN_X_GPU_OPERATIONS=gloo`); NCCL itself runs at world size 1. Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

from tests.workers import run_workers

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

OVER_GLOO = {"RAYTRAIN_X_GPU_OPERATIONS": "gloo"}


def _collectives() -> dict:
    import raytrain_x.torch as rx

    rx.init()
    r, n = rx.rank(), rx.size()
    dev = torch.device("cuda", 0)
    out = {}
    x = torch.arange(6, dtype=torch.float32, device=dev) + r
    out["allreduce_avg"] = rx.allreduce(x, op=rx.Average)
    out["allreduce_sum"] = rx.allreduce(x, op=rx.Sum)
    y = x.clone()
    rx.allreduce_(y, op=rx.Sum)
    out["allreduce_inplace"] = y
    out["allgather"] = rx.allgather(torch.full((r + 1, 2), float(r), device=dev))
    out["broadcast"] = rx.broadcast(torch.full((3,), float(r + 5), device=dev), root_rank=1)
    out["alltoall"] = rx.alltoall(torch.arange(2 * n, dtype=torch.float32, device=dev) + 10 * r)
    out["reducescatter"] = rx.reducescatter(torch.ones(2 * n, 3, device=dev) * (r + 1),
                                            op=rx.Sum)
    out["grouped"] = rx.grouped_allreduce([torch.ones(4, device=dev) * r,
                                           torch.ones(2, 2, device=dev, dtype=torch.float64)],
                                          op=rx.Sum)
    out["half"] = rx.allreduce(torch.ones(5, device=dev, dtype=torch.float16), op=rx.Sum)
    out["devices"] = sorted({str(t.device) for v in out.values()
                             for t in (v if isinstance(v, list) else [v])})
    out = {k: [t.cpu() for t in v] if isinstance(v, list) and k != "devices" else
           (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in out.items()}
    rx.shutdown()
    return out


def test_every_collective_takes_cuda_tensors_and_returns_them_on_the_gpu():
    results = run_workers(_collectives, 2, env=OVER_GLOO, work_s=60)
    base = torch.arange(6, dtype=torch.float32)
    for r, out in enumerate(results):
        assert out["devices"] == ["cuda:0"], out["devices"]
        assert torch.equal(out["allreduce_avg"], base + 0.5)
        assert torch.equal(out["allreduce_sum"], 2 * base + 1)
        assert torch.equal(out["allreduce_inplace"], 2 * base + 1)
        assert torch.equal(out["allgather"], torch.tensor([[0.0, 0.0], [1, 1], [1, 1]]))
        assert torch.equal(out["broadcast"], torch.full((3,), 6.0))
        assert torch.equal(out["alltoall"], torch.tensor([0.0, 1, 10, 11]) + 2 * r)
        assert torch.equal(out["reducescatter"], torch.full((2, 3), 3.0))
        assert torch.equal(out["grouped"][0], torch.ones(4))
        assert torch.equal(out["grouped"][1], torch.full((2, 2), 2.0, dtype=torch.float64))
        assert torch.equal(out["half"], torch.full((5,), 2.0, dtype=torch.float16))


def _optimizer_steps(steps: int) -> list:
    import raytrain_x.torch as rx

    rx.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 1)).cuda()
    opt = rx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters())
    rx.broadcast_parameters(model.state_dict(), root_rank=0)
    g = torch.Generator().manual_seed(1)
    data = torch.randn(steps, 4, 8, generator=g).cuda()
    target = torch.randn(steps, 4, 1, generator=g).cuda()
    r, n = rx.rank(), rx.size()
    per = 4 // n
    for s in range(steps):
        opt.zero_grad()
        xb, yb = data[s, r * per:(r + 1) * per], target[s, r * per:(r + 1) * per]
        torch.nn.functional.mse_loss(model(xb), yb).backward()
        opt.step()
    params = [p.detach().cpu() for p in model.parameters()]
    rx.shutdown()
    return params


def test_distributed_optimizer_on_cuda_matches_one_process_on_the_whole_batch():
    two = run_workers(_optimizer_steps, 2, 3, env=OVER_GLOO, work_s=60)
    one = run_workers(_optimizer_steps, 1, 3, work_s=60)[0]  # NCCL at world size 1
    for a, b, c in zip(two[0], two[1], one):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)


def _sync_bn() -> dict:
    import raytrain_x.torch as rx

    rx.init()
    r = rx.rank()
    bn = rx.SyncBatchNorm(3).cuda()
    g = torch.Generator().manual_seed(3 + r)
    x = (torch.randn(2 + r, 3, 4, generator=g) * 2 + r).cuda().requires_grad_()
    y = bn(x)
    (y * y).sum().backward()
    out = {"y": y.detach().cpu(), "dx": x.grad.cpu(), "mean": bn.running_mean.cpu(),
           "var": bn.running_var.cpu(), "x": x.detach().cpu()}
    rx.shutdown()
    return out


def test_sync_batch_norm_on_cuda_equals_batch_norm_on_the_combined_batch():
    a, b = run_workers(_sync_bn, 2, env=OVER_GLOO, work_s=60)
    x = torch.cat([a["x"], b["x"]]).requires_grad_()
    bn = torch.nn.BatchNorm1d(3)
    y = bn(x)
    (y * y).sum().backward()
    torch.testing.assert_close(torch.cat([a["y"], b["y"]]), y.detach(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.cat([a["dx"], b["dx"]]), x.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(a["mean"], bn.running_mean, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(a["var"], bn.running_var, rtol=1e-4, atol=1e-5)


def _nccl_alone() -> dict:
    import raytrain_x.torch as rx

    rx.init()
    x = torch.arange(4, dtype=torch.float32, device="cuda")
    out = {"allreduce": rx.allreduce(x, op=rx.Sum).cpu(),
           "allgather": rx.allgather(x).cpu(),
           "broadcast": rx.broadcast(x, root_rank=0).cpu()}
    rx.shutdown()
    return out


def test_nccl_at_world_size_one():
    out = run_workers(_nccl_alone, 1, work_s=60)[0]
    for value in out.values():
        assert torch.equal(value, torch.arange(4, dtype=torch.float32))


def _cupy_arrays() -> list:
    import cupy

    import raytrain_x.torch as rx

    rx.init()
    a = cupy.arange(6, dtype=cupy.float32) * (rx.rank() + 1)
    t = torch.from_dlpack(a)  # the same GPU memory, no copy
    rx.allreduce_(t, op=rx.Sum)
    rx.shutdown()
    return cupy.asnumpy(a).tolist()


def test_cupy_arrays_reduce_in_place_through_dlpack():
    pytest.importorskip("cupy")
    results = run_workers(_cupy_arrays, 2, env=OVER_GLOO, work_s=60)
    assert results == [[3.0 * i for i in range(6)]] * 2
