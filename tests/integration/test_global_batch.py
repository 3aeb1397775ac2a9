"""`rx.elastic.GlobalBatch`: the same optimisation at any world size (real processes)."""

from __future__ import annotations

import pytest
import torch

from tests.workers import run_workers

GLOBAL, MICRO = 8, 2


def _steps(global_batch: int, steps: int, stage: int = 0) -> dict:
    import raytrain_x.torch as rx

    rx.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = rx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters(), zero_stage=stage)
    gb = rx.elastic.GlobalBatch(global_batch, micro_batch_size=MICRO, optimizer=opt)
    data = torch.Generator().manual_seed(1)
    x = torch.randn(steps * gb.effective_batch_size, 3, generator=data)
    y = torch.randn(steps * gb.effective_batch_size, 1, generator=data)
    n, r = rx.size(), rx.rank()
    for s in range(steps):
        opt.zero_grad()
        for k in range(gb.accumulation):  # this rank's share of the step's global batch
            at = s * gb.effective_batch_size + (k * n + r) * MICRO
            loss = torch.nn.functional.mse_loss(model(x[at:at + MICRO]), y[at:at + MICRO])
            (loss * gb.loss_scale).backward()
        opt.step()
    out = {"weight": model.weight.detach().clone(), "accumulation": gb.accumulation,
           "effective": gb.effective_batch_size}
    rx.shutdown()
    return out


@pytest.mark.parametrize("stage", [0, 1])
def test_the_same_global_batch_trains_to_the_same_weights_at_1_2_and_4_workers(stage):
    runs = {n: run_workers(_steps, n, GLOBAL, 3, stage, work_s=30)[0] for n in (1, 2, 4)}
    assert [runs[n]["accumulation"] for n in (1, 2, 4)] == [4, 2, 1]
    for n in (2, 4):
        assert torch.allclose(runs[n]["weight"], runs[1]["weight"], atol=1e-6), n
    assert runs[1]["effective"] == GLOBAL


def test_a_global_batch_that_does_not_divide_takes_the_next_larger_one():
    out = run_workers(_steps, 3, 10, 1, work_s=30)[0]
    assert (out["accumulation"], out["effective"]) == (2, 12)


def test_bad_sizes_are_config_errors():
    import raytrain_x.torch as rx
    from raytrain_x.common.errors import ConfigError

    for bad in (0, -1, 2.5, True):
        with pytest.raises(ConfigError, match="must be an int >= 1"):
            rx.elastic.GlobalBatch(bad, 2)
