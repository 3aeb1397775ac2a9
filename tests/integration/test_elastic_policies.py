"""Driver policies on a real Ray cluster: with `SlowWorkers`, a worker slowed on purpose
leaves at a commit (nothing failed, nothing restored), the other two train on, and no new
worker is placed on its host during the cooldown; without a policy the job keeps it."""

from __future__ import annotations

import os
import threading
import time

import pytest

from raytrain_x.ray import RayExecutor, SlowWorkers
from raytrain_x.testing.jobs.ledger import read_progress
from tests.conftest import ELASTIC_RESOURCE
from tests.limits import limit, wait_until

SLOW_S = 0.5  # the slowed worker's extra work per step
PAUSE_S = 0.02  # every worker's own


def _train(claim: str, progress: str, stop: str) -> dict:
    """A small model trained elastically until `stop` exists (every rank agrees at one
    step). The first worker to claim the `claim` file works `SLOW_S` longer each step;
    rank 0 writes "step world-size" to `progress` at each commit."""
    import torch

    import raytrain_x.torch as rx
    from raytrain_x.testing.jobs.ledger import write_progress

    try:
        os.close(os.open(claim, os.O_CREAT | os.O_EXCL))
        slowed = True
    except FileExistsError:
        slowed = False
    rx.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = rx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                  named_parameters=model.named_parameters())
    state = rx.elastic.TorchState(model, opt, step=0, sizes=[])

    @rx.elastic.run
    def train(state):
        while True:
            flag = torch.tensor([float(os.path.exists(stop))])
            if rx.allreduce(flag, op=rx.Max, name="policies.stop").item():
                return {"step": state.step, "sizes": state.sizes, "slowed": slowed,
                        "rank": rx.rank()}
            opt.zero_grad()
            model(torch.randn(8, 4)).sum().backward()
            time.sleep(PAUSE_S + (SLOW_S if slowed else 0.0))
            opt.step()
            state.step += 1
            state.sizes = [*state.sizes[-50:], rx.size()]
            state.commit()
            if rx.rank() == 0:
                write_progress(progress, state.step, rx.size())

    return train(state)


@pytest.mark.parametrize("policies", [[SlowWorkers(min_steps=5, cooldown_s=600)], []],
                         ids=["slow-workers", "none"])
def test_a_slowed_worker_leaves_at_a_commit_with_the_slow_workers_policy(
        elastic_nodes, tmp_path, policies):
    elastic_nodes(3)
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=10), min_workers=2,
                           max_workers=3, cpus_per_worker=1,
                           resources_per_worker={ELASTIC_RESOURCE: 1},
                           cooldown_range=(600, 600), policies=policies)
    executor.start()
    progress, stop = tmp_path / "progress", tmp_path / "stop"
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(results=executor.run(
        _train, args=[str(tmp_path / "claim"), str(progress), str(stop)])), daemon=True)
    thread.start()
    try:
        wait_until(lambda: read_progress(progress)[1] == 3, 60, "a round of 3 to commit")
        first = read_progress(progress)[0]
        if policies:
            wait_until(lambda: read_progress(progress)[1] == 2, 60,
                       "the slowed worker to leave (a round of 2 to commit)")
            at = read_progress(progress)[0]
            wait_until(lambda: read_progress(progress)[0] >= at + 10, 60, "10 more steps of 2")
        else:  # as many steps as the policy waits and more: the three train on
            wait_until(lambda: read_progress(progress)[0] >= first + 20, 60, "20 more steps")
        stop.touch()
        thread.join(limit(60))
        assert not thread.is_alive(), "the job did not stop"
        job = executor.last_elastic_job
        events = [(e.kind, e.detail) for e in job.events]
    finally:
        stop.touch()
        executor.shutdown()
    results = out["results"]
    kinds = [kind for kind, _ in events]
    assert "failure" not in kinds and "restore_storage" not in kinds
    if not policies:
        assert len(results) == 3 and "asked_to_leave" not in kinds
        assert results[0]["sizes"][-1] == 3
        return
    asked = [detail for kind, detail in events if kind == "asked_to_leave"]
    assert len(asked) == 1, asked
    assert asked[0]["policy"] == "SlowWorkers" and "slow:" in asked[0]["reason"]
    # the two that stayed finished; the slowed one left and none took its place
    assert len(results) == 2 and not any(r["slowed"] for r in results)
    assert results[0]["sizes"][-1] == 2 and 3 in results[0]["sizes"]
    assert kinds.count("place") == 3  # its host took no new worker in the cooldown
    rounds = [detail for kind, detail in events if kind == "round"]
    assert "policy" in rounds[-1]["reason"] and not rounds[-1]["reset"]
