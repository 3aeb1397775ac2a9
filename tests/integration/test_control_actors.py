"""The job's control actors (the rendezvous store and the elastic rounds) with more parked
callers than Ray's default concurrency for async actors (1,000): real actors on the local
Ray cluster, real calls. With that default, the thousand-and-first parked call queued, and
every call behind it (a write that would answer the waiters, the driver's look at who
waits) never ran. The suite parks 1,100 of each (10,000 flooded the shared 2-core runner
for minutes: `benchmarks/control_plane.py --parked 10000` measures that size)."""

from __future__ import annotations

import pytest

from tests.limits import limit, wait_until

WORKERS = 1_100  # past Ray's default of 1,000


def test_more_parked_callers_than_rays_default_leave_the_store_and_the_rounds_answering(
        ray_cluster):
    import ray

    from raytrain_x.comm.store import ABANDONED
    from raytrain_x.comm.store_actor import StoreActor, control_concurrency
    from raytrain_x.common.errors import ElasticJobStopped
    from raytrain_x.ray.elastic.rounds import ElasticRounds

    calls = control_concurrency(WORKERS)
    store = StoreActor.options(max_concurrency=calls).remote()
    rounds = ElasticRounds.options(max_concurrency=calls).remote()
    try:
        parked = [store.wait.remote([f"round1/rank{i}"], 600.0) for i in range(WORKERS)]
        joins = [rounds.join.remote(f"w{i}") for i in range(WORKERS)]
        wait_until(lambda: ray.get(store.parked.remote()) == WORKERS and
                   len(ray.get(rounds.waiting.remote())) == WORKERS, 30,
                   "every call parked in the store and the rounds")
        # a write answers the call waiting for its key, and wakes no other
        ray.get(store.set.remote("round1/rank7", b"x"), timeout=limit(5))
        assert ray.get(parked[7], timeout=limit(5)) is True
        assert ray.get(store.parked.remote(), timeout=limit(5)) == WORKERS - 1
        # the driver is answered while every worker waits to join
        ray.get(rounds.publish.remote({"w3": {"rank": 0}}), timeout=limit(5))
        assert ray.get(joins[3], timeout=limit(5)) == {"rank": 0}
        # a round given up answers its waiters at once, not at their timeout
        ray.get(store.abandon.remote("round1/"), timeout=limit(5))
        rest = parked[:7] + parked[8:]
        assert set(ray.get(rest, timeout=limit(60))) == {ABANDONED}
        ray.get(rounds.fail.remote("the job stopped"), timeout=limit(5))
        with pytest.raises(ElasticJobStopped):
            ray.get(joins[0], timeout=limit(60))
        assert ray.get(store.parked.remote(), timeout=limit(5)) == 0
    finally:
        ray.kill(store, no_restart=True)
        ray.kill(rounds, no_restart=True)


def test_a_job_sizes_its_control_actors_for_its_workers():
    import sys

    from raytrain_x.comm.store_actor import (
        MOST_CONTROL_CONCURRENCY,
        RAY_ASYNC_CONCURRENCY,
        control_concurrency,
    )

    assert control_concurrency(2) == RAY_ASYNC_CONCURRENCY
    assert control_concurrency(10_000) > 3 * 10_000  # each worker's threads, and the driver
    # an elastic job without max_workers: Ray takes an int32
    assert control_concurrency(sys.maxsize) == MOST_CONTROL_CONCURRENCY < 2**31


def test_a_group_forms_in_a_constant_number_of_store_calls_per_rank(ray_cluster):
    """gloo's full mesh waited for and read every rank's address one key at a time: 2N + 1
    calls to the store actor per rank, 2N^2 + N per group. Its reads now come in one call:
    a set and a multi_get per rank, whatever N. Real gloo groups (one per thread), a real
    store actor."""
    import threading

    import numpy as np
    import ray

    from raytrain_x.comm.store import ActorStore
    from raytrain_x.comm.store_actor import StoreActor
    from raytrain_x.comm.torch_backend import TorchBackend

    size = 8
    store = StoreActor.remote()
    sums: dict[int, float] = {}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            group = TorchBackend().create_group(ActorStore(store, limit(30)), "round1/world", r,
                                                size, list(range(size)), limit(30),
                                                "127.0.0.1")
            values = np.full(4, float(r + 1), dtype=np.float32)
            group.allreduce(values)
            sums[r] = float(values[0])
            group.close()
        except BaseException as exc:  # noqa: BLE001 - raised on the test's thread
            errors.append(exc)

    try:
        threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(limit(60))
        assert not errors, errors
        assert sums == {r: size * (size + 1) / 2 for r in range(size)}  # the group works
        calls = ray.get(store.calls.remote(), timeout=limit(5))
        assert calls == {"set": size, "multi_get": size}, calls
    finally:
        ray.kill(store, no_restart=True)
