"""The job's control actors (the rendezvous store and the elastic rounds) with more parked
callers than Ray's default concurrency for async actors (1,000): real actors on the local
Ray cluster, real calls. With that default, the thousand-and-first parked call queued, and
every call behind it (a write that would answer the waiters, the driver's look at who
waits) never ran. The suite parks 10,000 of each (about 9 s on a 2-core machine)."""

from __future__ import annotations

import pytest

from tests.limits import limit, wait_until

WORKERS = 10_000  # ten times Ray's default of 1,000


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


def test_the_driver_waiting_for_a_rounds_workers_hears_the_joins_it_waits_for_as_they_land(
        ray_cluster):
    """While a round waits for its workers, the driver keeps a `next_join` call out for as
    many as its decision waits for (`RoundsClient.watch_joins`); it returns as the last of
    them lands, not at each join before, and ends the driver's poll of outcomes
    (`WorkerPool.wake`), which would otherwise wait out its timeout (here 600 s). A watch
    for no more than already wait returns at once, and a job that stops ends it."""
    import time

    import ray

    from raytrain_x.ray.elastic import pool as pools
    from raytrain_x.ray.elastic.parts import RoundsClient
    from raytrain_x.ray.elastic.rounds import ElasticRounds

    rounds = ElasticRounds.options(max_concurrency=8).remote()
    client, pool = RoundsClient(rounds), pools.WorkerPool(None, time.monotonic)
    try:
        first = rounds.join.remote("w0")
        wait_until(lambda: client.waiting() == ["w0"], 30, "w0 to wait")
        watch = rounds.next_join.remote(3, 600.0)  # the round waits for two more
        client.watch_joins(3, pool.wake)
        rounds.join.remote("w1")
        wait_until(lambda: len(client.waiting()) == 2, 30, "w1 to wait")
        # a join the round does not form on yet ends neither watch (each woke at its
        # join's call, before `waiting` answered)
        assert not ray.wait([watch], timeout=0.5)[0]
        started = time.monotonic()
        assert pool.poll(timeout_s=0.5) == pools.Outcomes({}, [], [])
        assert time.monotonic() - started >= 0.45  # not woken: it waited out its time
        rounds.join.remote("w2")  # lands before or during the poll: either ends it
        started = time.monotonic()
        out = pool.poll(timeout_s=600.0)
        assert time.monotonic() - started < limit(30)
        assert (out.finished, out.failed, out.left) == ({}, [], [])
        assert ray.get(watch, timeout=limit(30)) == 3 and sorted(client.waiting()) == \
            ["w0", "w1", "w2"]
        # a watch for no more than wait answers at once
        assert ray.get(rounds.next_join.remote(2, 600.0), timeout=limit(30)) == 3
        ray.get(rounds.publish.remote({"w0": {"rank": 0}}))
        assert ray.get(first, timeout=limit(30)) == {"rank": 0}
        # the job stops: a watch out ends
        stopped = rounds.next_join.remote(5, 600.0)
        ray.get(rounds.fail.remote("the job stopped"))
        assert ray.get(stopped, timeout=limit(30)) == 0
    finally:
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


def _calls_of_one_group(size: int, collective: str) -> dict[str, int]:
    """The store actor's calls while `size` ranks (one thread each, a real gloo group each)
    form a world group and run `collective` once."""
    import threading

    import numpy as np
    import ray

    from raytrain_x.comm.store import ActorStore
    from raytrain_x.comm.store_actor import StoreActor
    from raytrain_x.comm.torch_backend import TorchBackend

    store = StoreActor.remote()
    results: dict[int, float] = {}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            group = TorchBackend().create_group(ActorStore(store, limit(30)), "round1/world", r,
                                                size, list(range(size)), limit(30),
                                                "127.0.0.1")
            values = np.full(4, float(r + 1), dtype=np.float32)
            if collective == "allreduce":
                group.allreduce(values)
            elif collective == "control":
                values = np.array([r + 1, ~(1 << r), r + 1], dtype=np.int64)
                group.allreduce_control(values[:1], "sum")
                group.allreduce_control(values[1:2], "band")
                group.allreduce_control(values[2:], "min")
                assert values[1] == ~((1 << size) - 1) and values[2] == 1, values
            else:
                group.broadcast(values, 0)
            results[r] = float(values[0])
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
        expected = size * (size + 1) / 2 if collective in ("allreduce", "control") else 1.0
        assert results == {r: expected for r in range(size)}  # the group works
        return ray.get(store.calls.remote(), timeout=limit(5))
    finally:
        ray.kill(store, no_restart=True)


def test_a_group_forms_in_one_store_call_per_rank_and_connects_only_the_peers_it_uses(
        ray_cluster):
    """gloo's full mesh waited for and read every rank's address one key at a time: 2N + 1
    calls to the store actor per rank, 2N^2 + N per group, and N^2 connections. A rank now
    sets its address (one call) and reads a peer's (one call) only when a collective first
    needs that peer: a ring allreduce connects 2 peers whatever N, a tree broadcast at most
    log2 N. Real gloo groups (one per thread), a real store actor."""
    for size in (4, 16):
        calls = _calls_of_one_group(size, "allreduce")
        assert calls == {"set": size, "multi_get": 2 * size}, (size, calls)
    calls = _calls_of_one_group(16, "broadcast")
    assert calls["set"] == 16 and calls["multi_get"] <= 16 * 4, calls  # log2(16) a rank


def test_the_status_word_reduces_in_log_steps_over_log_peers(ray_cluster):
    """The control allreduce (the status word each negotiating cycle and-s across the
    world) takes recursive doubling's log2 N + 2 steps, not gloo's ring's 2(N-1) in
    sequence, and connects at most log2 N + 1 peers a rank: at 12 ranks (not a power of
    two, so 4 fold in first) every rank gets the same sum, and and minimum."""
    calls = _calls_of_one_group(12, "control")
    assert calls["set"] == 12 and calls["multi_get"] <= 12 * 4, calls  # log2(12) + 1 a rank
    calls = _calls_of_one_group(2, "control")
    assert calls == {"set": 2, "multi_get": 2}, calls


def test_a_rounds_keys_are_deleted_and_its_abandonment_forgotten(ray_cluster):
    """The driver deletes a round's keys once the second round after it formed
    (`round_forming.ROUNDS_KEPT`; the simulator checks no member still meets in it):
    the store holds two rounds' keys, not every round's of the job's life."""
    import ray

    from raytrain_x.comm.store_actor import StoreActor

    store = StoreActor.remote()
    try:
        for round_id in (1, 2):
            for rank in range(3):
                ray.get(store.set.remote(f"rtx/round{round_id}/world/0/{rank}", b"a"))
        ray.get(store.abandon.remote("rtx/round1/"))
        assert ray.get(store.delete_prefix.remote("rtx/round1/"), timeout=limit(5)) == 3
        assert ray.get(store.num_keys.remote()) == 3  # round 2's
        # a key set again under the forgotten prefix is waited for, not answered abandoned
        waiting = store.get.remote("rtx/round1/world/0/0", limit(10))
        ray.get(store.set.remote("rtx/round1/world/0/0", b"b"))
        assert ray.get(waiting, timeout=limit(10)) == b"b"
    finally:
        ray.kill(store, no_restart=True)
