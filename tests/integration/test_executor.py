"""RayExecutor on a real Ray cluster: run, execute, failures, bad arguments."""

from __future__ import annotations

import time

import pytest
import torch

from raytrain_x import ConfigError, Knobs, WorkerError
from raytrain_x.ray import RayExecutor
from tests.conftest import ELASTIC_RESOURCE


def _identity(tag: str) -> dict:
    import raytrain_x.torch as rx

    rx.init()
    total = rx.allreduce(torch.tensor([float(rx.rank())]), op=rx.Sum).item()
    return {"rank": rx.rank(), "size": rx.size(), "local_rank": rx.local_rank(),
            "local_size": rx.local_size(), "cross_size": rx.cross_size(), "sum": total,
            "tag": tag, "fusion": rx.knobs().fusion_threshold_bytes}


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_run_on_n_workers(ray_cluster, workers):
    settings = RayExecutor.create_settings(timeout_s=20)
    with RayExecutor(settings, num_workers=workers,
                     knobs=Knobs(fusion_threshold_bytes=1 << 20)) as executor:
        results = executor.run(_identity, args=("a",))
        again = executor.run(_identity, kwargs={"tag": "b"})
    assert [r["rank"] for r in results] == list(range(workers))
    assert [r["local_rank"] for r in results] == list(range(workers))  # one node here
    assert all(r["size"] == workers and r["local_size"] == workers and r["cross_size"] == 1
               for r in results)
    assert all(r["sum"] == sum(range(workers)) for r in results)
    assert all(r["fusion"] == 1 << 20 for r in results)  # knobs reached every worker
    assert [r["tag"] for r in again] == ["b"] * workers


def _where_a_relative_path_goes() -> tuple[str, str]:
    import os

    from raytrain_x import CheckpointConfig

    return os.getcwd(), CheckpointConfig("ckpts").named("job").storage_path


def test_a_relative_checkpoint_path_on_a_worker_is_the_drivers(ray_cluster, tmp_path,
                                                               monkeypatch):
    """Workers run in a working directory of Ray's (a copy of the driver's, which Ray
    deletes): a `CheckpointConfig("ckpts")` made on a worker is under the driver's."""
    monkeypatch.chdir(tmp_path)
    with RayExecutor(RayExecutor.create_settings(timeout_s=20), num_workers=2) as executor:
        results = executor.run(_where_a_relative_path_goes)
    assert any(cwd != str(tmp_path) for cwd, _ in results)  # not the driver's, there
    assert {path for _, path in results} == {str(tmp_path / "ckpts")}


class Counter:
    def __init__(self, start: int) -> None:
        import raytrain_x.torch as rx

        rx.init()
        self.rx = rx
        self.value = start

    def bump(self) -> int:
        self.value += 1
        return int(self.rx.allreduce(torch.tensor(self.value), op=self.rx.Sum,
                                     name=f"bump{self.value}").item())


def test_execute_keeps_state_between_calls(ray_cluster):
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=20), num_workers=2)
    executor.start(executable_cls=Counter, executable_args=(10,))
    try:
        assert executor.execute(lambda c: c.bump()) == [22, 22]
        assert executor.execute(lambda c: c.bump()) == [24, 24]
        assert executor.execute_single(lambda c: (c.rx.rank(), c.value)) == (0, 12)
        refs = executor.run_remote(lambda: 5)
        import ray

        assert ray.get(refs) == [5, 5]
    finally:
        executor.shutdown()


def _fails_on_rank_1(kind: str) -> str:
    import sys

    import raytrain_x.torch as rx

    rx.init()
    rx.allreduce(torch.ones(2), name="before")
    if rx.rank() == 1:
        if kind == "raise":
            raise ValueError("boom on purpose")
        sys.exit(3)
    rx.allreduce(torch.ones(2), name="never-completes")  # rank 1 is gone: must not hang
    return "unreachable"


@pytest.mark.parametrize("kind", ["raise", "exit"])
def test_failing_rank_is_reported_and_others_released(ray_cluster, kind):
    # The run (the world's forming included) must end well before the collective timeout
    # the other ranks would otherwise wait out: a long one, so that how long forming takes
    # on a loaded machine cannot reach it (it took 20 s with a core kept busy).
    settings = RayExecutor.create_settings(timeout_s=60)
    executor = RayExecutor(settings, num_workers=3)
    executor.start()
    try:
        start = time.monotonic()
        with pytest.raises(WorkerError) as info:
            executor.run(_fails_on_rank_1, args=(kind,))
        elapsed = time.monotonic() - start
        assert info.value.rank == 1
        if kind == "raise":
            assert "ValueError: boom on purpose" in str(info.value)
            assert "_fails_on_rank_1" in str(info.value)  # the remote traceback
        else:
            assert "exited" in str(info.value)
        assert elapsed < settings.timeout_s
        if kind == "raise":  # the same workers form a new world afterwards
            assert [r["sum"] for r in executor.run(_identity, args=("x",))] == [3.0] * 3
    finally:
        executor.shutdown()


def test_bad_arguments(ray_cluster):
    with pytest.raises(ConfigError, match="does not take"):
        RayExecutor.create_settings(ssh_port=22)
    with pytest.raises(ConfigError, match="exactly one"):
        RayExecutor(num_workers=2, num_hosts=2)
    with pytest.raises(ConfigError, match="cooldown_range"):
        RayExecutor(num_workers=2, cooldown_range=(5, 1))
    with pytest.raises(ConfigError, match="min_workers"):
        RayExecutor(min_workers=3, max_workers=2)
    with pytest.raises(ConfigError, match="knobs must be"):
        RayExecutor(num_workers=1, knobs={"cycle_time_ms": 1})
    with pytest.raises(ConfigError, match="not started"):
        RayExecutor(num_workers=1).run(lambda: 1)
    executor = RayExecutor(RayExecutor.create_settings(placement_group_timeout_s=2),
                           num_workers=50)
    with pytest.raises(Exception, match="could not place 50 workers"):
        executor.start()


def test_horovods_arguments_as_horovods_docs_write_them(ray_cluster, caplog):
    """Horovod's guide: `create_settings(verbose=True)`, `RayExecutor(settings,
    min_workers=1, use_gpu=True, cpus_per_slot=2)`; its tests pass the unused shape
    arguments as None; its users catch ValueError and TimeoutError."""
    settings = RayExecutor.create_settings(verbose=True)
    assert settings.verbose == 1
    executor = RayExecutor(settings, min_workers=1, use_gpu=True, cpus_per_slot=2)
    assert (executor.cpus_per_worker, executor.gpus_per_worker) == (2, 1)
    fixed = RayExecutor(settings, num_workers=4, num_hosts=None, num_workers_per_host=None)
    assert (fixed.num_workers, fixed.num_workers_per_host) == (4, 1)
    hosts = RayExecutor(settings, num_workers=None, num_hosts=2, num_workers_per_host=3)
    assert (hosts.num_hosts, hosts.num_workers_per_host) == (2, 3)
    with caplog.at_level("WARNING", logger="raytrain_x"):
        RayExecutor.create_settings(ssh_identity_file="~/.ssh/id", nics={"eth0"})
    assert "create_settings(nics, ssh_identity_file): not used; Ray places" in caplog.text
    with pytest.raises(ValueError, match="Both `min_workers` and `num_workers` provided"):
        RayExecutor(settings, num_workers=2, min_workers=1)
    with pytest.raises(ValueError, match="cpus_per_worker or cpus_per_slot"):
        RayExecutor(settings, num_workers=2, cpus_per_worker=1, cpus_per_slot=2)
    with pytest.raises(ConfigError, match="verbose must be"):
        RayExecutor.create_settings(verbose="loud")
    with pytest.raises(ConfigError, match="settings must come from"):
        RayExecutor({"timeout_s": 5}, num_workers=1)
    infeasible = RayExecutor(RayExecutor.create_settings(placement_group_timeout_s=1),
                             num_workers=50)
    with pytest.raises(TimeoutError, match="could not place 50 workers"):
        infeasible.start()


def _hostname_and_rank() -> tuple[int, int]:
    import raytrain_x.torch as rx

    rx.init()
    return rx.rank(), rx.size()


def test_horovods_deprecated_elastic_ray_executor_runs(elastic_nodes):
    from raytrain_x.ray import ElasticRayExecutor

    elastic_nodes(2)
    settings = ElasticRayExecutor.create_settings(min_np=1, max_np=2, verbose=True,
                                                  elastic_timeout=60)
    with pytest.warns(DeprecationWarning, match="use RayExecutor"):
        executor = ElasticRayExecutor(settings, cpus_per_slot=1, env_vars={"X": "1"})
    executor.executor.resources_per_worker = {ELASTIC_RESOURCE: 1}
    executor.start()
    try:
        results = executor.run(_hostname_and_rank)
    finally:
        executor.shutdown()
    assert sorted(results) == [(0, 2), (1, 2)] or results == [(0, 1)], results


class _FailsToBuild:
    def __init__(self) -> None:
        raise RuntimeError("no model today")


def _leftovers() -> tuple[list, set]:
    """Placement groups not removed, and live actors of an executor's classes."""
    import ray

    from raytrain_x.ray import internals

    groups = [pg["placement_group_id"] for pg in ray.util.placement_group_table().values()
              if pg["state"] != "REMOVED"]
    return groups, set().union(*(internals.alive_actor_ids(c) for c in
                                 ("WorkerActor", "StoreActor", "BackgroundController")))


def test_a_failed_start_leaves_nothing_and_can_start_again(ray_cluster):
    """A start that failed leaked its placement group, workers and autotune actor, and the
    next `start()` said "already started"; in a `with` block `__exit__` never ran."""
    from raytrain_x.common.autotune_config import AutotuneConfig

    before = _leftovers()
    with pytest.raises(ConfigError, match="extra_env_vars takes strings"):
        RayExecutor(num_workers=2).start(extra_env_vars={"X": 1})
    executor = RayExecutor(num_workers=2)
    with pytest.raises(WorkerError, match="no model today"):
        executor.start(executable_cls=_FailsToBuild)  # after the workers and their group
    assert executor.workers == []
    assert _leftovers() == before
    with pytest.raises(Exception, match="could not place 50 workers"):
        with RayExecutor(RayExecutor.create_settings(placement_group_timeout_s=2),
                         num_workers=50, autotune=AutotuneConfig()):
            pass  # never: the placement fails in __enter__
    assert _leftovers() == before
    executor.start()  # the same executor again, as if it had never started
    try:
        assert [r["sum"] for r in executor.run(_identity, args=("again",))] == [1.0, 1.0]
    finally:
        executor.shutdown()
    assert _leftovers() == before


def test_num_hosts_spreads_over_nodes_with_cross_ranks(elastic_nodes):
    from tests.conftest import ELASTIC_RESOURCE

    elastic_nodes(2)  # one worker slot each; the head has none of this resource
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=20), num_hosts=2,
                           num_workers_per_host=1, cpus_per_worker=1,
                           resources_per_worker={ELASTIC_RESOURCE: 1})
    with executor:
        results = executor.run(_identity, args=("spread",))
        nodes = {slot.node_id for slot in executor.slots}
    assert len(nodes) == 2  # STRICT_SPREAD: one host each
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["cross_size"] == 2 and r["local_size"] == 1 and r["local_rank"] == 0
               for r in results)
    assert all(r["sum"] == 1.0 for r in results)


def _init_twice() -> list[int]:
    import raytrain_x.torch as rx

    sums, rank = [], None
    for _ in range(2):  # shutdown() then init() again, inside one run()
        if rank == 1:
            time.sleep(1.0)  # rank 0 meets first: it must not find rank 1's old address
        rx.init()
        rank = rx.rank()
        sums.append(int(rx.allreduce(torch.tensor(rank + 1), op=rx.Sum).item()))
        rx.shutdown()
    return sums


def test_init_after_shutdown_in_one_run_meets_in_a_fresh_key_space(ray_cluster):
    # the second init() used to read the first one's gloo addresses: "Connection refused"
    with RayExecutor(RayExecutor.create_settings(timeout_s=20), num_workers=2) as executor:
        assert executor.run(_init_twice) == [[3, 3], [3, 3]]
        assert executor.run(_init_twice) == [[3, 3], [3, 3]]  # and in the next round
