"""Every reducer keeps the reducer contract (`raytrain_x.testing.reducer_contract`) between
two real processes: the built-in ways (allreduce, Adasum, ZeRO 1 and 2, LocalSGD, DiLoCo,
PowerSGD) and a reducer written outside the package in a few lines, as docs/reducers.md
shows one; a reducer that reduces nothing is caught."""

from __future__ import annotations

import torch

from raytrain_x.torch.grad_sync import Reducer
from tests.workers import run_workers


class MeanAtStep(Reducer):
    """A user's reducer (docs/reducers.md): no hooks; at the step every gradient is
    averaged in one grouped allreduce."""

    kind = "meanatstep"
    hooks = False

    def synchronize(self) -> None:
        import raytrain_x.torch as rx

        params = self.core.reduced_params
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        rx.grouped_allreduce_([p.grad for p in params], name="meanatstep",
                              op=rx.Average, process_set=self.core.process_set)


class Forgetful(Reducer):
    """A broken reducer: it reduces nothing, so each rank steps on its own gradients."""

    kind = "forgetful"
    hooks = False


def _every_way() -> dict[str, list[str]]:
    import raytrain_x.torch as rx
    from raytrain_x.testing.reducer_contract import check_reducer

    rx.init()
    ways = {
        "allreduce": (None, {}),
        "adasum": (None, {"op": rx.Adasum}),
        "zero 1": (None, {"zero_stage": 1}),
        "zero 2": (None, {"zero_stage": 2}),
        "localsgd": (lambda: rx.LocalSGD(sync_every=2), {}),
        "diloco": (lambda: rx.DiLoCo(sync_every=2), {}),
        "powersgd": (lambda: rx.PowerSGD(matrix_rank=2, start_iter=2), {}),
        "a user's": (MeanAtStep, {}),
    }
    kept = {}
    for name, (make, options) in ways.items():
        try:
            kept[name] = check_reducer(make, **options)
        except Exception as e:
            raise AssertionError(f"{name}: {e}") from e
    try:
        check_reducer(Forgetful)
    except AssertionError as e:
        kept["broken"] = [str(e)]
    rx.shutdown()
    return kept


def test_every_reducer_keeps_the_contract():
    from raytrain_x.testing.reducer_contract import REDUCER_CONTRACT

    for kept in run_workers(_every_way, 2, work_s=60):
        broken = kept.pop("broken")
        assert kept == {name: list(REDUCER_CONTRACT) for name in kept}
        assert len(kept) == 8
        assert broken[0].startswith("replicas agree: ranks differ after step 0"), broken
