"""Elastic training under real faults on a multi-node Ray cluster: killed actors, removed
and added nodes, blacklisting with cooldown, reset_limit and min_workers."""

from __future__ import annotations

import threading
import time

import pytest
import ray
import torch

from raytrain_x import ResetLimitExceeded
from raytrain_x.elastic.driver import ElasticTimeout
from raytrain_x.ray import RayExecutor
from tests.conftest import ELASTIC_RESOURCE

STEPS = 40


def _elastic_train(steps: int, pause: float, bad_node: str | None = None) -> dict:
    import os

    import raytrain_x.torch as rx

    rx.init()
    if bad_node is not None and ray.get_runtime_context().get_node_id() == bad_node:
        time.sleep(0.5)
        os._exit(1)  # this host keeps failing
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = rx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                  named_parameters=model.named_parameters())
    state = rx.elastic.TorchState(model, opt, step=0, done_steps=[], sizes=[])

    @rx.elastic.run
    def train(state):
        while state.step < steps:
            opt.zero_grad()
            model(torch.ones(8, 4)).sum().backward()
            opt.step()
            state.done_steps.append(state.step)
            state.sizes.append(rx.size())
            state.step += 1
            time.sleep(pause)
            state.commit()
        return {"step": state.step, "done_steps": list(state.done_steps),
                "sizes": list(state.sizes), "rank": rx.rank(),
                "weight": model.weight.detach().clone()}

    return train(state)


def _executor(min_workers: int, max_workers: int, **kwargs) -> RayExecutor:
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=10), min_workers=min_workers,
                           max_workers=max_workers, cpus_per_worker=1,
                           resources_per_worker={ELASTIC_RESOURCE: 1}, **kwargs)
    executor.start()
    return executor


def _in_background(action, when) -> threading.Thread:
    def run():
        while not when():
            time.sleep(0.1)
        action()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _check_committed_history(results: list[dict]) -> None:
    for r in results:
        assert r["step"] == STEPS  # the planned step count
        assert r["done_steps"] == list(range(STEPS))  # none lost, none repeated
    assert all(torch.equal(results[0]["weight"], r["weight"]) for r in results)


def test_killed_worker_actor_training_finishes(elastic_nodes):
    elastic_nodes(3)
    executor = _executor(2, 3)

    def running_rounds() -> bool:
        job = executor.last_elastic_job
        return job is not None and job.rounds >= 1 and len(job.members) == 3

    def kill_one():
        time.sleep(1.0)  # mid-epoch
        victim = next(m for m in executor.last_elastic_job.members.values() if m.rank == 2)
        ray.kill(victim.actor, no_restart=True)

    _in_background(kill_one, running_rounds)
    results = executor.run(_elastic_train, args=(STEPS, 0.1))
    job = executor.last_elastic_job
    executor.shutdown()
    assert len(results) == 2  # the survivors finished
    _check_committed_history(results)
    assert any(kind == "failure" for _, kind, _ in job.events)
    assert job.rounds >= 2
    assert results[0]["sizes"][0] == 3 and results[0]["sizes"][-1] == 2


def test_removed_node_survivors_continue(cluster, elastic_nodes):
    nodes = elastic_nodes(3)
    executor = _executor(2, 3)

    def remove_a_node():
        time.sleep(1.0)
        job = executor.last_elastic_job
        victim = next(m for m in job.members.values() if m.rank == 1)
        node = next(n for n in nodes if n.unique_id == victim.node)
        cluster.remove_node(node, allow_graceful=False)

    _in_background(remove_a_node, lambda: executor.last_elastic_job is not None
                   and executor.last_elastic_job.rounds >= 1)
    results = executor.run(_elastic_train, args=(STEPS, 0.1))
    executor.shutdown()
    assert len(results) == 2
    _check_committed_history(results)
    assert results[0]["sizes"][-1] == 2


def test_added_node_joins_at_the_next_commit(elastic_nodes):
    elastic_nodes(2)
    executor = _executor(2, 3)
    _in_background(lambda: (time.sleep(1.0), elastic_nodes(1)),
                   lambda: executor.last_elastic_job is not None
                   and executor.last_elastic_job.rounds >= 1)
    results = executor.run(_elastic_train, args=(STEPS, 0.15))
    job = executor.last_elastic_job
    executor.shutdown()
    assert len(results) == 3  # the new worker finished with the others
    _check_committed_history(results)  # it received the state from rank 0
    sizes = results[0]["sizes"]
    assert sizes[0] == 2 and sizes[-1] == 3
    assert any(kind == "scale_up" for _, kind, _ in job.events)


def test_failing_host_is_blacklisted_with_cooldown_and_reset_limit_stops_the_job(
        elastic_nodes):
    bad = elastic_nodes(1)[0]
    elastic_nodes(2)
    executor = _executor(2, 3, cooldown_range=(2.0, 30.0), reset_limit=4)
    start = time.monotonic()
    with pytest.raises(ResetLimitExceeded, match="reset_limit=4"):
        executor.run(_elastic_train, args=(10_000, 0.05, bad.unique_id))
    job = executor.last_elastic_job
    executor.shutdown()
    on_bad = [(t, kind) for t, kind, host in job.events if host == bad.unique_id]
    failures = [t for t, kind in on_bad if kind == "failure"]
    restarts = [t for t, kind in on_bad if kind == "start"][1:]  # after the first start
    assert len(failures) >= 2 and len(restarts) >= 1
    # first failure waits lo (+ jitter up to lo); it is rediscovered within a second more
    gap = restarts[0] - failures[0]
    assert 2.0 <= gap <= 2.0 + 2.0 + 1.0 + 2.0, gap
    if len(restarts) >= 2:  # the second failure waits 2 * lo (+ jitter)
        gap2 = restarts[1] - failures[1]
        assert 4.0 <= gap2 <= 4.0 + 2.0 + 1.0 + 2.0, gap2
    assert time.monotonic() - start < 60


def test_below_min_workers_waits_then_fails(elastic_nodes):
    elastic_nodes(2)
    executor = _executor(3, 3, elastic_timeout=4)
    start = time.monotonic()
    with pytest.raises(ElasticTimeout, match="fewer than min_workers=3"):
        executor.run(_elastic_train, args=(STEPS, 0.05))
    elapsed = time.monotonic() - start
    executor.shutdown()
    assert 4.0 <= elapsed < 20.0
