"""Elastic state on a GPU: commits to pinned host memory, ordered before the next step, and
NCCL communicators aborted when a round fails. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from tests.workers import run_workers

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

OVER_GLOO = {"RAYTRAIN_X_GPU_OPERATIONS": "gloo"}


def _commit_then_step() -> dict:
    import raytrain_x.torch as rx

    rx.init()
    torch.manual_seed(0)
    dev = torch.device("cuda", 0)
    # a large layer, so that the copy to the host is still running when the step is queued
    model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.BatchNorm1d(4096),
                                torch.nn.Linear(4096, 8)).to(dev)
    opt = rx.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters())
    state = rx.elastic.TorchState(model, opt, step=0)
    x = torch.randn(64, 4096, device=dev)

    def step() -> None:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    for _ in range(2):
        step()
        state.commit()  # warm: the buffers of the next snapshot exist
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    state.step = 2
    state.commit()
    committed_device_bytes = torch.cuda.memory_allocated() - before
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    expected_opt = [s["exp_avg"].clone() for s in opt.state.values()]
    step()  # queued at once after the commit: it must not change what was committed
    state.step = 3
    moved = any(not torch.equal(v, expected[k]) for k, v in model.state_dict().items())
    snap = state._commits.committed().tree()["handled"]["model"]
    placed = sorted({(str(t.device), t.is_pinned()) for t in snap.values()
                     if torch.is_tensor(t)})
    state.restore()
    torch.cuda.synchronize()
    restored = all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())
    restored_opt = all(torch.equal(s["exp_avg"], e)
                       for s, e in zip(opt.state.values(), expected_opt))
    out = {"device_bytes": committed_device_bytes, "moved": moved, "placed": placed,
           "restored": restored, "restored_opt": restored_opt, "step": state.step,
           "on": sorted({str(p.device) for p in model.parameters()})}
    rx.shutdown()
    return out


@pytest.mark.parametrize("size", [1, 2])
def test_a_commit_goes_to_pinned_host_memory_and_the_next_step_does_not_change_it(size):
    results = run_workers(_commit_then_step, size, env=OVER_GLOO if size > 1 else None,
                          work_s=60)
    for out in results:
        assert out["device_bytes"] == 0, out
        assert out["placed"] == [("cpu", True)], out
        assert out["moved"] and out["restored"] and out["restored_opt"], out
        assert out["step"] == 2 and out["on"] == ["cuda:0"], out


def _nccl_aborted() -> dict:
    import logging
    import time

    import raytrain_x.torch as rx
    from raytrain_x.core import runtime

    warnings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    logging.getLogger("raytrain_x.comm").addHandler(Keep())
    rx.init()
    x = torch.ones(4, device="cuda")
    rx.allreduce(x, op=rx.Sum)
    group = runtime.engine().groups.world
    nccl = group._nccl
    began = time.perf_counter()
    group.close(abort=True)  # what the engine does when a peer or this rank fails
    closed_s = time.perf_counter() - began
    try:
        nccl.allreduce([x]).wait()
        after = "ran"
    except Exception as exc:  # noqa: BLE001 - what an aborted communicator says
        after = type(exc).__name__
    try:
        rx.shutdown()
    except Exception:  # noqa: BLE001 - its world group is gone: only the abort is checked
        pass
    return {"had_nccl": nccl is not None, "closed_s": closed_s, "warnings": warnings,
            "after": after}


def test_a_failed_rounds_nccl_communicator_is_aborted():
    out = run_workers(_nccl_aborted, 1, work_s=60)[0]
    assert out["had_nccl"] and not out["warnings"], out
    assert out["closed_s"] < 10, out
    assert out["after"] != "ran", out
