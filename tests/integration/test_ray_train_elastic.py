"""The elastic trainer (`RaytrainXTrainer` with `ScalingConfig(num_workers=(min, max))`)
under real faults on a multi-node local Ray cluster: a node added, a worker process
killed and a node drained, each mid-epoch, while a Ray Data dataset whose rows carry ids
is trained on; every id is counted once per epoch in the committed history. Then every
worker lost at once: the run goes on from its latest checkpoint with the data where it
was. And every batch format of the elastic shard."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import pytest

from raytrain_x.testing import drain_node
from tests.conftest import ELASTIC_RESOURCE
from tests.limits import limit, wait_until

ROWS = 400  # the dataset's ids; 4 rows a rank a step: 50 steps an epoch at 2 workers
BATCH = 4
FAST_POLL = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2"}


def _loop(config: dict) -> dict:
    """Trains a linear model on the ids, a `TorchState` holding the model, the optimizer,
    the shard (its position) and each epoch's ids as every rank saw them committed. Rank 0's
    report of an epoch says whether its ids were each seen once. With `report_every`, a
    checkpoint holding the model and the epoch's ids so far is reported every that many
    steps (and loaded when the run starts with a checkpoint)."""
    import os
    import tempfile
    import time
    import uuid

    import ray.train
    import torch
    from ray.train import Checkpoint

    import raytrain_x.torch as rx

    rx.init()
    model = torch.nn.Linear(1, 1)
    opt = rx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3),
                                  named_parameters=model.named_parameters())
    shard = ray.train.get_dataset_shard("train")
    state = rx.elastic.TorchState(model, opt, data=shard, epoch=0, seen=[], sizes=[],
                                  origin=uuid.uuid4().hex, resumed=0, steps=0)
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:  # a worker that joins a live run gets rank 0's state anyway
        with checkpoint.as_directory() as folder:
            saved = torch.load(os.path.join(folder, "state.pt"), weights_only=False)
        model.load_state_dict(saved["model"])
        state.epoch, state.seen, state.sizes = saved["epoch"], saved["seen"], saved["sizes"]
        state.steps, state.resumed = saved["steps"], 1
    progress = Path(config["progress"])

    def save_and_report(metrics: dict) -> None:
        with tempfile.TemporaryDirectory() as folder:
            if rx.rank() == 0:
                torch.save({"model": model.state_dict(), "epoch": state.epoch,
                            "seen": state.seen, "sizes": state.sizes, "steps": state.steps},
                           os.path.join(folder, "state.pt"))
            with open(os.path.join(folder, f"rank{rx.rank()}"), "w") as f:
                f.write(str(rx.size()))
            ray.train.report(metrics, checkpoint=Checkpoint.from_directory(folder))

    @rx.elastic.run
    def train(state):
        while True:
            stop = rx.broadcast_object(os.path.exists(config["stop"]), 0, name="stop")
            if stop and state.epoch >= config["min_epochs"]:
                return {"rank": rx.rank(), "origin": state.origin}
            for batch in state.data.iter_torch_batches(batch_size=BATCH):
                x = batch["id"].float()[:, None] / ROWS
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), 2 * x).backward()
                opt.step()
                ids = rx.allgather_object(batch["id"].tolist(), name="ids")
                state.seen.append(sum(ids, []))
                state.sizes.append(rx.size())
                state.steps += 1
                time.sleep(config["pause"])
                state.commit()
                context = ray.train.get_context()
                mine = progress / f"{os.getpid()}.json"
                # whole or not at all: the test's thread lists these files while they change
                mine.with_suffix(".tmp").write_text(json.dumps({
                    "pid": os.getpid(), "node": ray.get_runtime_context().get_node_id(),
                    "rank": context.get_world_rank(), "size": context.get_world_size(),
                    "epoch": state.epoch, "cursor": state.data.cursor,
                    "steps": state.steps, "time": time.time()}))
                os.replace(mine.with_suffix(".tmp"), mine)
                every = config.get("report_every")
                if every and state.steps % every == 0:
                    save_and_report({"epoch": state.epoch, "mid_epoch": True,
                                     "cursor": state.data.cursor})
            rows = sorted(sum(state.seen, []))
            save_and_report({"epoch": state.epoch, "rows_once": rows == list(range(ROWS)),
                             "rows": len(rows), "sizes": sorted(set(state.sizes)),
                             "resizes": sum(a != b for a, b in zip(state.sizes,
                                                                   state.sizes[1:])),
                             "origin": state.origin, "resumed": state.resumed,
                             "steps": state.steps})
            state.epoch, state.seen, state.sizes = state.epoch + 1, [], []
            state.commit()

    return train(state)


def _workers(progress: Path) -> list[dict]:
    """What each worker process wrote last (each file is replaced whole)."""
    return [json.loads(path.read_text()) for path in progress.glob("*.json")]


def _latest(progress: Path) -> dict:
    seen = _workers(progress)
    return max(seen, key=lambda w: w["time"]) if seen else {}


class _Fit:
    """`trainer.fit()` on a thread, so the test's thread can change the cluster."""

    def __init__(self, trainer) -> None:
        self.result = self.error = None
        self.thread = threading.Thread(target=self._run, args=(trainer,), daemon=True)
        self.thread.start()

    def _run(self, trainer) -> None:
        try:
            self.result = trainer.fit()
        except BaseException as exc:  # noqa: BLE001 - inspected by the test
            self.error = exc

    def join(self, work_s: float):
        self.thread.join(limit(work_s))
        assert not self.thread.is_alive(), "the elastic fit did not end"
        if self.error is not None:
            raise self.error
        return self.result


def _trainer(tmp_path: Path, workers: tuple[int, int], max_failures: int, **loop):
    import ray.data
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig

    from raytrain_x.ray.train import RaytrainXConfig, RaytrainXTrainer

    progress = tmp_path / "progress"
    progress.mkdir()
    config = {"progress": str(progress), "stop": str(tmp_path / "stop"), "pause": 0.05,
              "min_epochs": 2, **loop}
    return progress, RaytrainXTrainer(
        _loop, train_loop_config=config,
        raytrain_x_config=RaytrainXConfig(framework="torch", timeout_s=10),
        scaling_config=ScalingConfig(num_workers=workers,
                                     resources_per_worker={"CPU": 1, ELASTIC_RESOURCE: 1}),
        run_config=RunConfig(name="elastic_run", storage_path=str(tmp_path / "storage"),
                             failure_config=FailureConfig(max_failures=max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=2)),
        # preprocessing upstream keeps streaming: each epoch runs it again
        datasets={"train": ray.data.range(ROWS, override_num_blocks=8)
                  .map_batches(lambda b: {"id": b["id"]})})


def _mid_epoch(progress: Path, size: int, after_steps: int = 0) -> bool:
    """Rank 0 committed a step of a world of `size`, past `after_steps`, within the middle
    half of an epoch."""
    latest = _latest(progress)
    return (latest.get("size") == size and latest.get("steps", 0) > after_steps
            and ROWS // 4 < latest.get("cursor", 0) < 3 * ROWS // 4)


@pytest.fixture
def fast_poll(monkeypatch):
    for name, value in FAST_POLL.items():
        monkeypatch.setenv(name, value)


def test_a_node_added_a_worker_killed_and_a_node_drained_mid_epoch_train_every_row_once(
        cluster, elastic_nodes, tmp_path, fast_poll):
    nodes = elastic_nodes(2)
    progress, trainer = _trainer(tmp_path, (1, 3), max_failures=1)
    fit = _Fit(trainer)
    try:
        _grow_kill_drain(cluster, elastic_nodes, nodes, fit, progress, tmp_path)
    finally:  # a drained node takes no work: it is not kept for the next test
        for node in nodes:
            if node.node_id in _drained and node in cluster.worker_nodes:
                cluster.remove_node(node, allow_graceful=True)
        (tmp_path / "stop").touch()  # the run ends (early, where the test failed)
    result = fit.join(60)
    _check_grown_killed_drained(result, tmp_path)


_drained: set[str] = set()


def _grow_kill_drain(cluster, elastic_nodes, nodes, fit, progress: Path, tmp_path: Path):
    def waited(condition, what: str) -> None:
        def reached() -> bool:
            assert fit.thread.is_alive(), f"the fit ended early: {fit.error!r}"
            return condition()
        wait_until(reached, 60, what, state=lambda: _latest(progress))

    waited(lambda: _mid_epoch(progress, 2), "2 workers mid-epoch")
    nodes += elastic_nodes(1)  # capacity comes: the world grows to 3 at a commit
    waited(lambda: _latest(progress).get("size") == 3, "the world to grow to 3")
    steps = _latest(progress)["steps"]
    waited(lambda: _mid_epoch(progress, 3, steps), "3 workers mid-epoch")
    victim = max((w for w in _workers(progress) if w["size"] == 3), key=lambda w: w["rank"])
    os.kill(victim["pid"], signal.SIGKILL)  # a real process death: one failure
    waited(lambda: _latest(progress).get("size") == 2 and _latest(progress)["steps"] > steps,
           "the survivors to train on as 2")
    steps = _latest(progress)["steps"]
    waited(lambda: _mid_epoch(progress, 2, steps), "2 workers mid-epoch again")
    alive = [w for w in _workers(progress) if w["pid"] != victim["pid"] and w["size"] == 2
             and w["steps"] >= steps]
    draining = max(alive, key=lambda w: w["rank"])["node"]
    _drained.add(draining)
    drain_node(cluster.address, draining, deadline_s=60)  # a preemption: not a failure
    waited(lambda: _latest(progress).get("size") == 1, "the drained node's worker to leave")
    # the last worker trains on to the end of the drain's epoch (reported with its resizes)
    epoch = _latest(progress)["epoch"]
    waited(lambda: _latest(progress)["epoch"] > epoch, "the drain's epoch to end")


def _check_grown_killed_drained(result, tmp_path: Path) -> None:
    epochs = result.metrics_dataframe
    finished = epochs[epochs["rows_once"].notna()]
    assert len(finished) >= 2
    assert finished["rows_once"].all(), finished  # every id once per epoch, all epochs
    assert list(finished["epoch"]) == list(range(len(finished)))  # none lost, none again
    assert finished["origin"].nunique() == 1  # never restarted: the state stayed in memory
    assert not finished["resumed"].any()
    assert {3, 2, 1} <= set().union(*finished["sizes"])
    assert finished["resizes"].sum() >= 3  # the three changes came inside epochs
    # Ray Train's Result: the latest checkpoint with every rank's files, the 2 kept
    assert result.checkpoint is not None
    assert result.metrics["epoch"] == finished.iloc[-1]["epoch"] and result.metrics["rows_once"]
    assert len(result.best_checkpoints) == 2
    folders = sorted(p.name for p in (tmp_path / "storage" / "elastic_run").iterdir()
                     if p.name.startswith("checkpoint_"))
    assert len(folders) == 2  # the older ones were pruned (CheckpointConfig(num_to_keep=2))
    with result.checkpoint.as_directory() as folder:
        assert "state.pt" in os.listdir(folder) and "rank0" in os.listdir(folder)
    assert result.return_value["origin"] == finished.iloc[0]["origin"]


def test_every_worker_lost_goes_on_from_the_latest_checkpoint_with_the_data_where_it_was(
        cluster, elastic_nodes, tmp_path, fast_poll):
    elastic_nodes(2)
    progress, trainer = _trainer(tmp_path, (1, 2), max_failures=1, report_every=10,
                                 min_epochs=2)
    fit = _Fit(trainer)

    def reported_mid_epoch() -> bool:
        assert fit.thread.is_alive(), f"the fit ended early: {fit.error!r}"
        latest = _latest(progress)
        return latest.get("size") == 2 and latest.get("epoch") == 0 and \
            latest.get("steps", 0) > 25 and \
            len({w["pid"] for w in _workers(progress) if w["size"] == 2}) == 2  # both seen
    wait_until(reported_mid_epoch, 60, "2 workers past a mid-epoch checkpoint",
               state=lambda: _latest(progress))
    for worker in _workers(progress):  # the whole group at once
        try:
            os.kill(worker["pid"], signal.SIGKILL)
        except ProcessLookupError:
            pass
    (tmp_path / "stop").touch()  # the run ends at epoch 2, after the restart
    result = fit.join(120)

    epochs = result.metrics_dataframe
    finished = epochs[epochs["rows_once"].notna()]
    assert list(finished["epoch"]) == [0, 1]
    # epoch 0's ids before the checkpoint came from the checkpoint, the rest once after it
    assert finished["rows_once"].all(), finished
    assert finished.iloc[0]["resumed"] == 1  # the new group started from the checkpoint
    mid = epochs[epochs["mid_epoch"].notna()]
    assert len(mid[mid["epoch"] == 0]) >= 2  # epoch 0 reported mid-way before the loss



def _formats_loop(config: dict) -> dict:
    import ray.train

    import raytrain_x.torch as rx

    rx.init()
    shard = ray.train.get_dataset_shard("train")
    numpy_ids = [i for b in shard.iter_batches(batch_size=7) for i in b["id"].tolist()]
    pandas = list(shard.iter_batches(batch_size=10, batch_format="pandas"))
    rows = [r["id"] for r in shard.iter_rows()]
    whole = sorted(r["id"] for r in ray.train.get_dataset_shard("all").iter_rows())
    return {"numpy": numpy_ids, "pandas": [len(b) for b in pandas],
            "pandas_ids": [i for b in pandas for i in b["id"].tolist()], "rows": rows,
            "epoch": shard.epoch, "whole": whole}


def test_each_pass_is_an_epoch_in_every_batch_format_and_unsplit_datasets_are_whole(
        ray_cluster, tmp_path):
    """`iter_batches` (numpy, pandas) and `iter_rows` on the elastic shard: each pass is
    the next epoch, every row once; a dataset left out of `datasets_to_split` is read
    whole, as in Ray Train."""
    import ray.data
    from ray.train import DataConfig, RunConfig, ScalingConfig

    from raytrain_x.ray.train import RaytrainXConfig, RaytrainXTrainer

    result = RaytrainXTrainer(
        _formats_loop, raytrain_x_config=RaytrainXConfig(framework="torch"),
        scaling_config=ScalingConfig(num_workers=(1, 1)),
        run_config=RunConfig(name="formats", storage_path=str(tmp_path)),
        datasets={"train": ray.data.range(45).map_batches(lambda b: b),
                  "all": ray.data.range(5)},
        dataset_config=DataConfig(datasets_to_split=["train"])).fit()
    out = result.return_value
    assert out["numpy"] == list(range(45)) and out["rows"] == list(range(45))
    assert out["pandas_ids"] == list(range(45)) and out["pandas"] == [10, 10, 10, 10, 5]
    assert out["epoch"] == 3 and out["whole"] == list(range(5))


def _prepared_loop(config: dict) -> dict:
    """Ray Train's linear example ported to an elastic run as docs/ray_train.md says, its
    `prepare_model` and `prepare_data_loader` kept: rank 1 of the first world leaves at its
    third step; the loop goes on at one rank until a worker joins again."""
    import os
    import time

    import ray.train
    import ray.train.torch
    import torch

    import raytrain_x.torch as rx

    rx.init()
    torch.manual_seed(0)
    x = torch.linspace(-1, 1, 64).unsqueeze(1)
    loader = ray.train.torch.prepare_data_loader(torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, 3 * x + 1), batch_size=8, shuffle=True))
    model = ray.train.torch.prepare_model(torch.nn.Linear(1, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = rx.elastic.TorchState(model, opt, epoch=0, steps=0, worlds=[], rows=[],
                                  same=True)

    @rx.elastic.run
    def train(state):
        while True:
            worlds = state.worlds
            done = state.epoch >= 2 and 1 in worlds and worlds[-1] == 2 and \
                worlds.index(1) > 0
            if rx.broadcast_object(done or time.time() > config["deadline"], 0, name="end"):
                return {"worlds": worlds, "rows": state.rows, "same": state.same,
                        "weight": model.module.weight.item(),
                        "kind": [c.__name__ for c in type(model).__mro__]}
            loader.sampler.set_epoch(state.epoch)
            for xb, yb in loader:
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(xb), yb).backward()
                opt.step()
                state.steps += 1
                if rx.rank() == 1 and state.steps == 3 and not os.path.exists(config["left"]):
                    open(config["left"], "w").close()
                    os._exit(1)
                weights = rx.allgather_object(model.module.weight.item(), name="w")
                state.same = state.same and len(set(weights)) == 1
                if not state.worlds or state.worlds[-1] != rx.size():
                    state.worlds.append(rx.size())
                    state.rows.append(len(loader.sampler))
                time.sleep(0.05)
                state.commit()
            state.epoch += 1
            state.commit()

    return train(state)


def test_prepare_model_and_prepare_data_loader_follow_an_elastic_runs_world(ray_cluster,
                                                                            tmp_path):
    """`prepare_model` built DDP, whose group is fixed: the loop failed in torch ("Default
    process group has not been initialized"). In an elastic run it now builds raytrain-x's
    `DataParallel` and `prepare_data_loader` a sampler over the current world: a rank leaves
    and one joins, the ranks' weights stay equal at every step and each world's rank takes
    its part of the data."""
    import time

    from ray.train import FailureConfig, RunConfig, ScalingConfig

    from raytrain_x.ray.train import RaytrainXConfig, RaytrainXTrainer

    config = {"left": str(tmp_path / "left"), "deadline": time.time() + limit(120)}
    result = RaytrainXTrainer(
        _prepared_loop, train_loop_config=config,
        raytrain_x_config=RaytrainXConfig(framework="torch"),
        scaling_config=ScalingConfig(num_workers=(1, 2)),
        run_config=RunConfig(name="prepared", storage_path=str(tmp_path),
                             failure_config=FailureConfig(max_failures=1))).fit()
    assert result.error is None, result.error
    out = result.return_value
    assert "DataParallel" in out["kind"] and out["same"], out
    assert out["worlds"][:3] == [2, 1, 2], out  # a rank left, then one joined
    assert out["rows"][:3] == [32, 64, 32], out  # each world's rank took its part
    assert abs(out["weight"] - 3) < 1.0, out  # it learnt


def _torch_distributed_loop() -> None:
    import torch
    import torch.distributed

    import raytrain_x.torch as rx

    rx.init()
    torch.distributed.all_reduce(torch.ones(1))


def test_torch_distributed_in_an_elastic_run_says_what_to_use_instead(ray_cluster, tmp_path):
    """torch's default group is fixed; an elastic run changes its world in memory, so it has
    none. A collective of torch.distributed failed inside torch ("Default process group has
    not been initialized") with nothing said of what to do; the run's error says it first."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.v2.api.exceptions import WorkerGroupError

    from raytrain_x.ray.train import RaytrainXConfig, RaytrainXTrainer

    with pytest.raises(WorkerGroupError) as caught:
        RaytrainXTrainer(_torch_distributed_loop,
                         raytrain_x_config=RaytrainXConfig(framework="torch"),
                         scaling_config=ScalingConfig(num_workers=(2, 2)),
                         run_config=RunConfig(name="ddp", storage_path=str(tmp_path))).fit()
    said = str(caught.value).splitlines()[1]  # after Ray Train's own first line
    assert "default process group is fixed" in said and "rx.allreduce" in said, said
