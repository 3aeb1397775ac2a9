"""A GPT sharded by torch's FSDP2 (`fully_shard` per block, AdamW) trained elastically under
`RayExecutor(min_workers, max_workers)`: a killed worker, a drained node and an added one.
The model's chunks and optimizer state are re-sharded in memory over each new world (no
storage is read), and with the global batch held the job follows the loss curve of the
same model trained whole without faults."""

from __future__ import annotations

from pathlib import Path

import ray

from raytrain_x.common.checkpoint_config import CheckpointConfig
from raytrain_x.elastic.checkpoints import CheckpointStore
from raytrain_x.testing import drain_node
from raytrain_x.testing.jobs.fsdp_gpt import reference_losses
from raytrain_x.testing.jobs.ledger import read_progress
from tests.integration.test_elastic import _executor, _Job, _youngest
from tests.integration.test_ray_train_elastic import _Fit


def _train(steps, pause, progress, stop=None, replicas=1) -> dict:  # runs in the workers
    from raytrain_x.testing.jobs.fsdp_gpt import fsdp_train

    return fsdp_train(steps, pause, stop=stop, progress=progress, replicas=replicas)


def _train_in_background(steps, pause, progress, stop=None) -> dict:  # runs in the workers
    from raytrain_x.testing.jobs.fsdp_gpt import fsdp_train

    return fsdp_train(steps, pause, stop=stop, progress=progress, background=True)


def _check_no_commit_lost(progress) -> None:
    """Rank 0's commits, in order, each after the one before: none taken back by a restore
    (a failed worker loses no committed step; a commit at which the world changes raises
    before it is noted, so a step may be missing from the notes, never repeated)."""
    steps = [int(line) for line in Path(f"{progress}.steps").read_text().split()]
    assert steps and all(a < b for a, b in zip(steps, steps[1:])), steps


def _check_losses(results: list[dict], steps: int) -> None:
    expected = reference_losses(steps)
    for result in results:
        assert result["step"] == steps
        got = result["losses"]
        worst = max(abs(a - b) / b for a, b in zip(got, expected))
        assert worst < 1e-3, (worst, got, expected)  # the target is 1%; it holds to 1e-6


def _trains_on(job, progress, size: int, first: str) -> None:
    """Waits for a step with `size` workers (`first` names it), then 3 more with them."""
    job.wait_until(lambda: job.trained(progress, 0, size), first)
    step, _ = read_progress(progress)
    job.wait_until(lambda: job.trained(progress, step + 3, size), f"3 more steps with {size}")


def test_a_kill_a_drain_and_an_add_reshard_in_memory_and_follow_the_fault_free_curve(
        cluster, elastic_nodes, tmp_path):
    """3 workers; one killed (its chunks come from their copy on a survivor), then one of
    the two left drained (it leaves at a commit), then a node added (the newcomer receives
    its chunks only): 3 -> 2 -> 1 -> 2 ranks, the global batch the same at every step."""
    nodes = elastic_nodes(3)
    executor = _executor(1, 3)
    progress, stop = tmp_path / "progress", tmp_path / "stop"
    job = _Job(executor, None, 0.05, str(progress), str(stop), fn=_train)
    try:
        job.wait_until(lambda: job.trained(progress, 4, 3), "4 steps with 3 workers")
        victim = _youngest(executor)
        ray.kill(victim.actor, no_restart=True)
        _trains_on(job, progress, 2, "a step with the 2 left")
        left = [m for m in executor.last_elastic_job.members.values()]
        drained = next(n for n in nodes if n.node_id == max(left, key=lambda m: m.age).node)
        drain_node(cluster.address, drained.node_id, deadline_s=60)
        job.wait_until(lambda: job.trained(progress, 0, 1), "a step with the last worker")
        cluster.remove_node(drained)  # its worker left: the node goes, as at its deadline
        step, _ = read_progress(progress)
        job.wait_until(lambda: job.trained(progress, step + 3, 1), "3 more steps with 1")
        elastic_nodes(1)
        _trains_on(job, progress, 2, "a step with the newcomer")
        stop.touch()
        results = job.join()
        events = [kind for _, kind, _ in executor.last_elastic_job.events]
    finally:
        stop.touch()
        executor.shutdown()
    assert len(results) == 2
    sizes = results[0]["sizes"]
    assert [s for i, s in enumerate(sizes) if i == 0 or sizes[i - 1] != s] == [3, 2, 1, 2]
    assert "failure" in events and "scale_up" in events, events
    _check_no_commit_lost(progress)
    _check_losses(results, results[0]["step"])


def test_commits_sent_in_the_background_survive_a_kill_and_an_add(cluster, elastic_nodes,
                                                                  tmp_path):
    """`commit_in_background=True`: 2 workers, one killed while its last commit's copies
    may still travel (the survivor restores the newest commit whose copies landed, from
    memory), then a node added (the commit under way is taken up before the ranks go to
    the new round): 2 -> 1 -> 2 ranks, on the fault-free curve."""
    elastic_nodes(2)
    executor = _executor(1, 2)
    progress, stop = tmp_path / "progress", tmp_path / "stop"
    job = _Job(executor, None, 0.05, str(progress), str(stop), fn=_train_in_background)
    try:
        job.wait_until(lambda: job.trained(progress, 4, 2), "4 steps with 2 workers")
        ray.kill(_youngest(executor).actor, no_restart=True)
        _trains_on(job, progress, 1, "a step with the one left")
        elastic_nodes(1)
        _trains_on(job, progress, 2, "a step with the newcomer")
        stop.touch()
        results = job.join()
    finally:
        stop.touch()
        executor.shutdown()
    assert len(results) == 2
    sizes = results[0]["sizes"]
    assert [s for i, s in enumerate(sizes) if i == 0 or sizes[i - 1] != s] == [2, 1, 2]
    _check_losses(results, results[0]["step"])


def test_losing_every_worker_restores_the_chunks_from_storage_at_another_size(
        cluster, elastic_nodes, tmp_path):
    """3 workers writing durable checkpoints (DCP parts, one a rank); two nodes go and the
    last worker is killed: no worker holds the chunks, so the next round (1 worker)
    restores the latest checkpoint, each rank reading the chunks that overlap its own,
    and training follows the fault-free curve from that commit on."""
    nodes = elastic_nodes(3)
    config = CheckpointConfig(str(tmp_path / "checkpoints"), name="job", every_s=0.3)
    executor = _executor(1, 3, cooldown_range=(1.0, 1.0), checkpoint=config)
    store = CheckpointStore(config)
    progress, stop = tmp_path / "progress", tmp_path / "stop"
    job = _Job(executor, None, 0.05, str(progress), str(stop), fn=_train)
    try:
        job.wait_until(lambda: job.trained(progress, 4, 3) and store.checkpoints(),
                       "a durable checkpoint after 4 steps with 3 workers")
        members = sorted(executor.last_elastic_job.members.values(), key=lambda m: m.age)
        kept = next(n for n in nodes if n.node_id == members[0].node)
        for node in nodes:
            if node is not kept:
                cluster.remove_node(node, allow_graceful=False)
        ray.kill(members[0].actor, no_restart=True)
        job.wait_until(lambda: job.trained(progress, 0, 1), "a step after the restore")
        step, _ = read_progress(progress)
        job.wait_until(lambda: job.trained(progress, step + 3, 1), "3 more steps with 1")
        stop.touch()
        results = job.join(work_s=60)
    finally:
        stop.touch()
        executor.shutdown()
    assert len(results) == 1 and results[0]["restored_from"] is not None, results
    assert results[0]["sizes"][0] == 3 and results[0]["sizes"][-1] == 1
    _check_losses(results, results[0]["step"])


def _trainer_loop(config: dict) -> dict:  # runs in Ray Train's workers
    from raytrain_x.testing.jobs.fsdp_gpt import fsdp_train

    return fsdp_train(None, 0.05, stop=config["stop"], progress=config["progress"])


def test_the_elastic_trainer_grows_an_fsdp2_run_in_memory(cluster, elastic_nodes, tmp_path,
                                                         monkeypatch):
    """`RaytrainXTrainer(scaling_config=ScalingConfig(num_workers=(1, 3)))`: 2 workers,
    then a node comes and the run grows to 3 at a commit, the newcomer receiving its
    chunks from the two (Ray Train's own elastic mode restarts every worker from a
    checkpoint instead)."""
    from ray.train import RunConfig, ScalingConfig

    from raytrain_x.ray.train import RaytrainXConfig, RaytrainXTrainer
    from tests.conftest import ELASTIC_RESOURCE
    from tests.limits import wait_until

    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
    elastic_nodes(2)
    progress, stop = tmp_path / "progress", tmp_path / "stop"
    trainer = RaytrainXTrainer(
        _trainer_loop, train_loop_config={"progress": str(progress), "stop": str(stop)},
        raytrain_x_config=RaytrainXConfig(framework="torch", timeout_s=10),
        scaling_config=ScalingConfig(num_workers=(1, 3),
                                     resources_per_worker={"CPU": 1, ELASTIC_RESOURCE: 1}),
        run_config=RunConfig(name="fsdp_run", storage_path=str(tmp_path / "storage")))
    fit = _Fit(trainer)
    try:
        def trained(steps: int, size: int) -> bool:
            assert fit.thread.is_alive(), f"the fit ended early: {fit.error!r}"
            step, world = read_progress(progress)
            return step >= steps and world == size

        wait_until(lambda: trained(3, 2), 60, "3 steps with 2 workers")
        elastic_nodes(1)
        wait_until(lambda: trained(0, 3), 60, "a step with the newcomer")
        step, _ = read_progress(progress)
        wait_until(lambda: trained(step + 3, 3), 60, "3 more steps with 3")
    finally:
        stop.touch()
    result = fit.join(60).return_value
    assert [s for i, s in enumerate(result["sizes"])
            if i == 0 or result["sizes"][i - 1] != s] == [2, 3]
    assert result["restores"] == 0  # grown at a commit: nothing rolled back
    _check_losses([result], result["step"])
