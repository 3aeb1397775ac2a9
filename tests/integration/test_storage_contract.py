"""The storage contract of durable checkpoints between real processes, with real faults
(a file-size limit under torch DCP) and injected ones (`RAYTRAIN_X_STORAGE_FAULTS`):
`state.checkpoint()` raises on every rank as soon as a part cannot be written, a failure
inside DCP is logged and counted, another job's state is refused, a second run on a live
job's path is refused (and a takeover fences the first), and a resume while storage
throttles continues from the latest checkpoint, not from step 0."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch

from raytrain_x.common.checkpoint_config import CheckpointConfig
from raytrain_x.elastic.checkpoints import CheckpointStore
from raytrain_x.elastic.storage_faults import write_plan
from tests.workers import run_workers


def _job(storage: str, steps: int, stage: int = 0, width: int = 5,
         checkpoint_at: tuple[int, ...] = (), fault_at: int = 0, plan: str = "",
         fsize_limit_rank: int = -1, takeover: bool = False, hold: str = "",
         down_sync_at: int = 0) -> dict:
    """Trains a small model to `steps`, a commit each step, `state.checkpoint()` after the
    steps in `checkpoint_at` (its error caught and returned). At step `fault_at` rank 0
    sets the fault plan `plan` to a full disk on rank 1's shard, and rank
    `fsize_limit_rank` meets a file-size limit (torch DCP's own writes fail). With `hold`,
    the job waits at its last step until the file `hold/go` exists. At step
    `down_sync_at` storage goes down (`plan`) for a sync, as a reset makes one."""
    import resource
    import signal

    import raytrain_x.torch as rx
    from raytrain_x.common.errors import CheckpointError
    from raytrain_x.common.process import PROCESS

    rx.init()
    model = torch.nn.Sequential(torch.nn.Linear(6, width), torch.nn.Linear(width, 3))
    opt = rx.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.05),
                                  named_parameters=model.named_parameters(), zero_stage=stage)
    config = CheckpointConfig(storage, name="job", takeover=takeover)
    state = rx.elastic.TorchState(model, opt, checkpoint=config, step=0)
    out: dict = {"errors": [], "started_at": None}

    @rx.elastic.run
    def train(state):
        out["started_at"] = state.step
        while state.step < steps:
            opt.zero_grad()
            model(torch.randn(4, 6)).square().mean().backward()
            opt.step()
            state.step += 1
            state.commit()
            if state.step == fault_at:
                if plan and rx.rank() == 0:
                    write_plan(plan, full_disk=True, match="shard_00001")
                if rx.rank() == fsize_limit_rank:
                    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                    resource.setrlimit(resource.RLIMIT_FSIZE, (64, resource.RLIM_INFINITY))
            if state.step == down_sync_at:
                if rx.rank() == 0:
                    write_plan(plan, down=True)
                state.sync()  # the survivors hold the state: nothing to restore
                if rx.rank() == 0:
                    write_plan(plan)
            if state.step in checkpoint_at:
                began = time.monotonic()
                try:
                    state.checkpoint()
                except CheckpointError as exc:
                    out["errors"].append((str(exc), time.monotonic() - began))
            if hold and state.step == steps:
                Path(hold, f"ready.{rx.rank()}").touch()
                while not Path(hold, "go").exists():
                    time.sleep(0.05)
                try:
                    state.checkpoint()
                except CheckpointError as exc:
                    out["errors"].append((str(exc), 0.0))

    train(state)
    out.update(step=state.step, counters=dict(vars(PROCESS.checkpoints)))
    rx.shutdown()
    return out


def test_checkpoint_raises_on_every_rank_as_soon_as_a_part_cannot_be_written(tmp_path):
    plan = str(tmp_path / "faults.json")
    write_plan(plan)
    storage = str(tmp_path / "store")
    out = run_workers(_job, 2, storage, 3, 1, 5, (2, 3), 3, plan,
                      env={"RAYTRAIN_X_STORAGE_FAULTS": plan}, work_s=40)
    for rank in out:
        assert len(rank["errors"]) == 1, rank["errors"]  # step 2's checkpoint was written
        message, seconds = rank["errors"][0]
        assert "rank 1: " in message and "No space left on device" in message, message
        assert str(tmp_path / "store" / "job") in message
        assert seconds < 30  # not after the 600 s write_timeout_s
    assert out[1]["counters"]["failed_count"] == 1
    [kept] = CheckpointStore(CheckpointConfig(storage, name="job")).checkpoints()
    assert kept.values["step"] == 2


def test_a_failure_inside_torch_dcp_is_logged_counted_and_raised(tmp_path, capfd):
    storage = str(tmp_path / "store")
    out = run_workers(_job, 2, storage, 3, 1, 5, (3,), 2, "", 1, work_s=40)
    for rank in out:
        [(message, _)] = rank["errors"]
        assert "rank 1: torch.distributed.checkpoint: " in message, message
        assert "File too large" in message, message
    assert out[1]["counters"]["failed_count"] == 1
    err = capfd.readouterr().err
    assert "Exception in thread" not in err  # not a traceback from the writer's thread
    assert CheckpointStore(CheckpointConfig(storage, name="job")).checkpoints() == []


def test_a_checkpoint_of_another_state_is_refused_naming_both(tmp_path):
    storage = str(tmp_path / "store")
    run_workers(_job, 2, storage, 2, 0, 5, (2,), work_s=40)
    other = run_workers(_job, 2, storage, 2, 0, 4, work_s=40, allow_failures=True)
    for failure in other:
        assert isinstance(failure, str), failure
        assert "CheckpointError" in failure and "holds another job's state" in failure
        assert "model.0.weight: saved [[5, 6], 'torch.float32'], here [[4, 6]" in failure
        assert "CheckpointConfig(name=...)" in failure


def test_a_second_run_on_a_live_jobs_path_is_refused_and_a_takeover_fences_the_first(
        tmp_path):
    storage = str(tmp_path / "store")
    hold = tmp_path / "hold"
    hold.mkdir()
    first: list = []
    runner = threading.Thread(target=lambda: first.append(
        run_workers(_job, 2, storage, 2, 0, 5, (2,), 0, "", -1, False, str(hold),
                    work_s=90)),
        daemon=True)
    runner.start()
    deadline = time.monotonic() + 60
    while len(list(hold.glob("ready.*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(list(hold.glob("ready.*"))) == 2, "the first run did not reach its hold"
    refused = run_workers(_job, 2, storage, 3, work_s=40, allow_failures=True)
    for failure in refused:
        assert isinstance(failure, str) and "CheckpointLeaseHeld" in failure, failure
        assert "another run of this job is writing its checkpoints" in failure
    took_over = run_workers(_job, 2, storage, 3, 0, 5, (3,), 0, "", -1, True, work_s=40)
    assert took_over[0]["started_at"] == 2  # from the first run's checkpoint
    assert took_over[0]["errors"] == []
    (hold / "go").touch()
    runner.join(60)
    for rank in first[0]:
        [(message, _)] = rank["errors"]
        assert "no longer holds the writer lease" in message, message
    [kept, *_] = CheckpointStore(CheckpointConfig(storage, name="job")).checkpoints()
    assert kept.values["step"] == 3 and kept.generation == 2


def test_a_resume_while_storage_throttles_continues_from_the_latest_checkpoint(tmp_path):
    storage = str(tmp_path / "store")
    plan = str(tmp_path / "faults.json")
    run_workers(_job, 2, storage, 4, 0, 5, (4,), work_s=40)
    write_plan(plan, list=2)  # S3's 503 SlowDown on the first two listings
    env = {"RAYTRAIN_X_STORAGE_FAULTS": plan}
    resumed = run_workers(_job, 2, storage, 6, 0, 5, (6,), env=env, work_s=40)
    assert [r["started_at"] for r in resumed] == [4, 4]
    write_plan(plan, down=True)  # storage unreachable: an error, never a start from 0
    lost = run_workers(_job, 2, storage, 8, env=env, work_s=60, allow_failures=True)
    for failure in lost:
        assert isinstance(failure, str) and "StorageError" in failure, failure
        assert "storage unreachable" in failure and str(tmp_path / "store") in failure
    write_plan(plan)
    kept = CheckpointStore(CheckpointConfig(storage, name="job")).checkpoints()
    assert [m.values["step"] for m in kept] == [6, 4]


def test_a_round_that_restores_nothing_trains_on_while_storage_is_down(tmp_path):
    storage = str(tmp_path / "store")
    plan = str(tmp_path / "faults.json")
    write_plan(plan)
    out = run_workers(_job, 2, storage, 4, 0, 5, (4,), 0, plan, -1, False, "", 2,
                      env={"RAYTRAIN_X_STORAGE_FAULTS": plan}, work_s=60)
    assert [r["step"] for r in out] == [4, 4] and out[0]["errors"] == []
    [kept] = CheckpointStore(CheckpointConfig(storage, name="job")).checkpoints()
    assert kept.values["step"] == 4


def _part_fails_with_its_note(storage: str, plan: str) -> dict:
    """ZeRO-1 on 2 ranks, a background checkpoint due at every commit: at step 4 rank 1's
    shard meets a full disk, its `.failed` note too (the same storage); at step 30 the
    disk has room again. Returns rank 0's counters and the step at which it counted the
    first failed checkpoint."""
    import raytrain_x.torch as rx
    from raytrain_x.common.process import PROCESS

    rx.init()
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    opt = rx.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.05),
                                  named_parameters=model.named_parameters(), zero_stage=1)
    config = CheckpointConfig(storage, name="job", every_s=0.001, write_timeout_s=600)
    state = rx.elastic.TorchState(model, opt, checkpoint=config, step=0)
    out: dict = {"failed_at": None}

    @rx.elastic.run
    def train(state):
        while state.step < 45:
            if rx.rank() == 0 and state.step == 4:
                write_plan(plan, full_disk=True, match="shard_00001")
            if rx.rank() == 0 and state.step == 30:
                write_plan(plan)
            opt.zero_grad()
            model(torch.randn(4, 6)).square().mean().backward()
            opt.step()
            state.step += 1
            state.commit()
            if out["failed_at"] is None and PROCESS.checkpoints.failed_count:
                out["failed_at"] = state.step
            time.sleep(0.1)  # a step's work: writes overlap it

    train(state)
    state.finish_writes()
    out.update(counters=dict(vars(PROCESS.checkpoints)))
    rx.shutdown()
    return out


def test_a_failed_part_reaches_rank_0_at_the_next_commit_not_through_failing_storage(
        tmp_path):
    """Rank 1's part and its `.failed` note both fail (a full disk): rank 0 learns of it
    from the commit's small allreduce and gives the write up at once, instead of waiting
    `write_timeout_s` (600 s) for a part that will never come; once the disk has room,
    checkpoints complete again."""
    plan = str(tmp_path / "faults.json")
    write_plan(plan)
    storage = str(tmp_path / "store")
    out = run_workers(_part_fails_with_its_note, 2, storage, plan,
                      env={"RAYTRAIN_X_STORAGE_FAULTS": plan}, work_s=90)
    rank0 = out[0]
    assert rank0["failed_at"] is not None and rank0["failed_at"] < 30, rank0
    assert rank0["counters"]["failed_count"] >= 1
    [newest, *_] = CheckpointStore(CheckpointConfig(storage, name="job")).checkpoints()
    assert newest.values["step"] > 30 and rank0["counters"]["last_written"] == newest.number
