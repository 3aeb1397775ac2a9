"""Elastic training under real faults on a multi-node Ray cluster: killed actors, removed
and added nodes, blacklisting with cooldown, reset_limit and min_workers."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import ray
import torch

from raytrain_x import ResetLimitExceeded
from raytrain_x.ray import RayExecutor
from raytrain_x.ray.elastic import pool as worker_pool
from raytrain_x.ray.worker import WORKER_OPTIONS, WorkerActor
from tests.conftest import ELASTIC_RESOURCE
from tests.limits import limit, wait_until

STEPS = 40
SAMPLES = 50  # the sampler's dataset: 40 steps of 2 or 3 workers run one to three epochs


def _elastic_train(steps: int, pause: float, bad_node: str | None = None,
                   progress: str | None = None) -> dict:
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
    # one sample per rank and step, from a sampler that re-shards what is left at a reset
    sampler = rx.elastic.ElasticSampler(range(SAMPLES), seed=1)
    state = rx.elastic.TorchState(model, opt, sampler=sampler, step=0, done_steps=[],
                                  sizes=[], epoch=0, seen={0: []})

    @rx.elastic.run
    def train(state):
        batches = enumerate(state.sampler)
        while state.step < steps:
            batch = next(batches, None)
            if batch is None:  # the epoch is done: the next one
                state.epoch += 1
                state.sampler.set_epoch(state.epoch)
                state.seen[state.epoch] = []
                batches = enumerate(state.sampler)
                batch = next(batches)
            batch_idx, index = batch
            position = batch_idx * state.sampler.num_replicas + state.sampler.rank
            padding = position >= len(state.sampler.remaining_indices)  # equal shards
            opt.zero_grad()
            model(torch.ones(8, 4)).sum().backward()
            opt.step()
            everyone = rx.allgather_object([] if padding else [index])
            state.seen[state.epoch].extend(i for part in everyone for i in part)
            state.sampler.record_batch(batch_idx, 1)
            state.done_steps.append(state.step)
            state.sizes.append(rx.size())
            state.step += 1
            time.sleep(pause)
            state.commit()
            if progress and rx.rank() == 0:
                with open(progress, "w") as f:
                    f.write(f"{state.step} {rx.size()}")
        return {"step": state.step, "done_steps": list(state.done_steps),
                "sizes": list(state.sizes), "rank": rx.rank(), "seen": dict(state.seen),
                "weight": model.weight.detach().clone()}

    return train(state)


def _executor(min_workers: int, max_workers: int, **kwargs) -> RayExecutor:
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=10), min_workers=min_workers,
                           max_workers=max_workers, cpus_per_worker=1,
                           resources_per_worker={ELASTIC_RESOURCE: 1}, **kwargs)
    executor.start()
    return executor


class _Job:
    """Runs `executor.run` in a thread so the test's main thread can inject faults
    (Cluster.add_node/remove_node must run on the main thread)."""

    def __init__(self, executor: RayExecutor, *args) -> None:
        self.executor = executor
        self.result = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=args, daemon=True)
        self.thread.start()

    def _run(self, *args) -> None:
        try:
            self.result = self.executor.run(_elastic_train, args=args)
        except BaseException as exc:  # noqa: BLE001 - inspected by the test
            self.error = exc

    def wait_until(self, condition, what: str, work_s: float = 30.0) -> None:
        def reached() -> bool:
            assert self.thread.is_alive(), f"the job ended early: {self.error!r}"
            return condition()

        wait_until(reached, work_s, what, state=self.state)

    def state(self) -> str:
        job = self.executor.last_elastic_job
        if job is None:
            return "no elastic job yet"
        return (f"{len(job.members)} members, {len(job.pending)} starting, round {job.rounds}, "
                f"last events {job.events[-3:]}")

    def trained(self, progress: Path, steps: int, size: int) -> bool:
        """Rank 0 committed `steps` steps in a world of `size`."""
        try:
            step, world = map(int, progress.read_text().split())
        except (OSError, ValueError):
            return False
        return step >= steps and world == size

    def join(self, work_s: float = 45.0):
        self.thread.join(limit(work_s))
        assert not self.thread.is_alive(), \
            f"gave up after {limit(work_s):.0f}s waiting for the elastic job to finish; " \
            f"last seen: {self.state()}"
        if self.error is not None:
            raise self.error
        return self.result


def _youngest(executor: RayExecutor):
    return max(executor.last_elastic_job.members.values(), key=lambda m: m.age)


def _check_committed_history(results: list[dict], steps: int = STEPS) -> None:
    for r in results:
        assert r["step"] == steps  # the planned step count
        assert r["done_steps"] == list(range(steps))  # none lost, none repeated
        # the ElasticSampler across the resets: each sample once per finished epoch, and
        # none twice in the epoch under way
        *finished, current = [r["seen"][e] for e in sorted(r["seen"])]
        assert finished, "the test should finish at least one epoch"
        for seen in finished:
            assert sorted(seen) == list(range(SAMPLES))
        assert len(set(current)) == len(current)
    assert all(torch.equal(results[0]["weight"], r["weight"]) for r in results)


def test_killed_worker_actor_training_finishes(elastic_nodes, tmp_path):
    elastic_nodes(3)
    executor = _executor(2, 3)
    progress = tmp_path / "progress"
    job = _Job(executor, STEPS, 0.1, None, str(progress))
    job.wait_until(lambda: job.trained(progress, 10, 3),  # mid-epoch, 3 workers
                   "rank 0 to commit 10 steps with 3 workers")
    ray.kill(_youngest(executor).actor, no_restart=True)
    results = job.join()
    events = executor.last_elastic_job.events
    rounds = executor.last_elastic_job.rounds
    executor.shutdown()
    assert len(results) == 2  # the survivors finished
    _check_committed_history(results)
    assert any(kind == "failure" for _, kind, _ in events)
    assert rounds >= 2
    assert 3 in results[0]["sizes"] and results[0]["sizes"][-1] == 2


def test_removed_node_survivors_continue(cluster, elastic_nodes, tmp_path):
    nodes = elastic_nodes(3)
    executor = _executor(2, 3)
    progress = tmp_path / "progress"
    job = _Job(executor, STEPS, 0.1, None, str(progress))
    job.wait_until(lambda: job.trained(progress, 10, 3),
                   "rank 0 to commit 10 steps with 3 workers")
    victim = _youngest(executor)
    cluster.remove_node(next(n for n in nodes if n.node_id == victim.node),
                        allow_graceful=False)
    results = job.join()
    executor.shutdown()
    assert len(results) == 2
    _check_committed_history(results)
    assert 3 in results[0]["sizes"] and results[0]["sizes"][-1] == 2


def test_added_node_joins_at_the_next_commit(elastic_nodes, tmp_path):
    elastic_nodes(2)
    executor = _executor(2, 3)
    progress = tmp_path / "progress"
    job = _Job(executor, 2 * STEPS, 0.1, None, str(progress))
    job.wait_until(lambda: job.trained(progress, 5, 2),
                   "rank 0 to commit 5 steps with 2 workers")
    elastic_nodes(1)
    results = job.join()
    events = executor.last_elastic_job.events
    executor.shutdown()
    assert len(results) == 3  # the new worker finished with the others
    _check_committed_history(results, 2 * STEPS)  # it received the committed state
    sizes = results[0]["sizes"]
    assert 2 in sizes and sizes[-1] == 3
    assert any(kind == "scale_up" for _, kind, _ in events)


def test_failing_host_is_blacklisted_with_cooldown_and_reset_limit_stops_the_job(
        elastic_nodes):
    bad = elastic_nodes(3)[0]
    executor = _executor(2, 3, cooldown_range=(1.0, 30.0), reset_limit=4)
    start = time.monotonic()
    with pytest.raises(ResetLimitExceeded, match="reset_limit=4"):
        executor.run(_elastic_train, args=(10_000, 0.05, bad.node_id))
    job = executor.last_elastic_job
    executor.shutdown()
    cooldowns = [(t, wait) for host, t, wait in job.cooldowns if host == bad.node_id]
    places = [t for t, kind, host in job.events if kind == "place" and host == bad.node_id]
    assert len(cooldowns) >= 2
    for n, (failed_at, wait) in enumerate(cooldowns[:2], start=1):
        lo = 1.0 * 2 ** (n - 1)  # the rule: lo * 2^(n-1) plus jitter up to lo (lo = 1)
        assert lo <= wait <= lo + 1.0, (n, wait)
        back = next(t for t in places if t > failed_at)  # rediscovered and placed again
        assert wait <= back - failed_at <= wait + 2.5, (n, back - failed_at, wait)
    assert time.monotonic() - start < limit(30)  # stopped by reset_limit, not by the steps


def _held_start_worker(gate: Path):
    """The worker actor class with a start that waits until `gate` exists (a loaded node, a
    large runtime_env, an image pull), so a test decides when workers come up. The class is
    made here, so Ray ships it by value with the path in it."""

    class HeldStart(WorkerActor):
        def __init__(self) -> None:
            deadline = time.monotonic() + 300  # a test that forgot its gate ends anyway
            while not gate.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            super().__init__()

    return ray.remote(**WORKER_OPTIONS)(HeldStart)


def test_slow_starts_are_waited_for_and_a_vanished_slot_is_given_up_with_a_reason(
        cluster, elastic_nodes, monkeypatch, capfd, tmp_path):
    """Every worker's start is held (a loaded node, a large runtime_env, an image pull), and
    one node is removed meanwhile: that worker is given up on, naming why; the two slow
    ones are waited for past the progress line and train once they are up. (Which start is
    given up on, and when, is `ScalingPolicy.give_ups`, tested with a fake clock in
    tests/unit/test_elastic_policies.py; this is the wiring.)"""
    nodes = elastic_nodes(3)
    gate = tmp_path / "gate"
    monkeypatch.setattr(worker_pool, "Worker", _held_start_worker(gate))
    executor = _executor(2, 3, elastic_timeout=90)
    job = _Job(executor, STEPS, 0.05)
    job.wait_until(lambda: executor.last_elastic_job is not None
                   and len(executor.last_elastic_job.pending) == 3, "3 workers starting")
    cluster.remove_node(nodes[0], allow_graceful=False)  # its worker can never start now
    lost = nodes[0].node_id
    job.wait_until(lambda: any(host == lost for _, host, _ in
                               executor.last_elastic_job.gave_up),
                   f"the slot on the removed node {lost} to be given up", work_s=4)
    printed: list[str] = []
    job.wait_until(lambda: printed.append(capfd.readouterr().out) or
                   "waiting for 2 workers to start" in "".join(printed),
                   "the progress line of the slow starts", work_s=8)
    held = executor.last_elastic_job
    assert len(held.pending) == 2  # still waited for
    gate.touch()
    results = job.join()
    executor.shutdown()
    assert [(host, why) for _, host, why in held.gave_up] == [
        (lost, "its node left the cluster")]
    assert len(results) == 2  # the other two started (slowly) and trained
    _check_committed_history(results)
