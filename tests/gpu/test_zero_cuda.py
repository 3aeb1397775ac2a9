"""Sharded optimizers (`zero_stage` 1 and 2) on CUDA tensors, between real processes.

Two ranks share one GPU over gloo (`RAYTRAIN_X_GPU_OPERATIONS=gloo`); NCCL runs at world
size 1. Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

from tests.workers import run_workers

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

OVER_GLOO = {"RAYTRAIN_X_GPU_OPERATIONS": "gloo"}


def _train_every_stage(steps: int) -> dict:
    import raytrain_x.torch as rx

    rx.init()
    out = {}
    for stage in (0, 1, 2):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                    torch.nn.Linear(16, 5), torch.nn.Tanh(),
                                    torch.nn.Linear(5, 3)).cuda()
        opt = rx.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01),
                                      named_parameters=model.named_parameters(),
                                      zero_stage=stage, bucket_cap_mb=0.001)
        g = torch.Generator().manual_seed(10 + rx.rank())
        for _ in range(steps):
            opt.zero_grad()
            x, y = torch.randn(6, 8, generator=g).cuda(), torch.randint(0, 3, (6,), generator=g)
            torch.nn.functional.cross_entropy(model(x), y.cuda()).backward()
            opt.step()
        state = opt.state_dict()
        out[stage] = {
            "devices": sorted({str(p.device) for p in model.parameters()}
                              | {str(p.grad.device) for p in model.parameters()
                                 if p.grad is not None}),
            "weights": {k: v.cpu() for k, v in model.state_dict().items()},
            "moments": {i: s["exp_avg"].cpu() for i, s in state["state"].items()},
        }
    rx.shutdown()
    return out


@pytest.mark.parametrize("ranks", [2, 1])
def test_stages_1_and_2_on_cuda_train_to_the_unsharded_weights(ranks):
    """Two ranks over gloo sharing the GPU, or one rank on NCCL: AdamW on CUDA parameters,
    stages 1 and 2 end at stage 0's weights, with the same consolidated state, on the GPU."""
    env = OVER_GLOO if ranks == 2 else {}
    for out in run_workers(_train_every_stage, ranks, 10, env=env, work_s=60):
        for stage in (1, 2):
            assert out[stage]["devices"] == ["cuda:0"], out[stage]["devices"]
            for name, value in out[0]["weights"].items():
                torch.testing.assert_close(out[stage]["weights"][name], value,
                                           rtol=1e-5, atol=1e-6)
            for index, value in out[0]["moments"].items():
                torch.testing.assert_close(out[stage]["moments"][index], value,
                                           rtol=1e-5, atol=1e-6)
