"""Ray Train v2 jobs whose workers form a raytrain-x world: real Ray Train, Ray Data, Tune."""

from __future__ import annotations

import csv
import itertools
import os
import signal
import tempfile
import time

import pytest

from raytrain_x import ConfigError, Knobs
from raytrain_x.common.autotune_config import AutotuneConfig, SearchRules

ROWS = 40  # the Ray Data dataset's rows; 2 workers see 20 each per epoch
# Ray Train's controller polls its workers this often (Ray's default 2 s): each fit waits up
# to one interval to see a report, a finished loop or a dead worker, which is test time only
FAST_POLL = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2"}


@pytest.fixture(autouse=True)
def _fast_poll(monkeypatch):
    for name, value in FAST_POLL.items():  # Ray Train passes it to its controller
        monkeypatch.setenv(name, value)


def _torch_loop(config: dict) -> None:
    import ray.train
    import torch
    from ray.train import Checkpoint

    import raytrain_x.torch as rx

    rx.init()
    context = ray.train.get_context()
    places = (rx.rank(), rx.size(), rx.local_rank(), rx.local_size())
    assert places == (context.get_world_rank(), context.get_world_size(),
                      context.get_local_rank(), context.get_local_world_size()), places
    torch.manual_seed(rx.rank())  # unequal on purpose: the broadcast makes them equal
    model = torch.nn.Linear(1, 1)
    opt = rx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3),
                                  named_parameters=model.named_parameters())
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            state = torch.load(os.path.join(folder, "state.pt"))
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["epoch"] + 1
    rx.broadcast_parameters(model.state_dict(), root_rank=0)
    rx.broadcast_optimizer_state(opt, root_rank=0)
    shard = ray.train.get_dataset_shard("train")
    for epoch in range(start, config["epochs"]):
        seen = []
        for batch in shard.iter_torch_batches(batch_size=5):
            x = batch["id"].float()[:, None] / ROWS
            seen += batch["id"].tolist()
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), 2 * x).backward()
            opt.step()
        rows = sorted(sum(rx.allgather_object(seen, name=f"seen{epoch}"), []))
        weights = rx.allgather_object([p.tolist() for p in model.parameters()],
                                      name=f"w{epoch}")
        metrics = {"epoch": epoch, "start": start, "rank": rx.rank(),
                   "rows_once": rows == list(range(ROWS)), "mine": len(seen),
                   "equal": all(w == weights[0] for w in weights),
                   "fusion": rx.knobs().fusion_threshold_bytes}
        if rx.rank() == 0:
            with tempfile.TemporaryDirectory() as folder:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                            "epoch": epoch}, os.path.join(folder, "state.pt"))
                ray.train.report(metrics, checkpoint=Checkpoint.from_directory(folder))
        else:
            ray.train.report(metrics)
        marker = config.get("die_once")
        if marker and epoch == 0 and rx.rank() == 1 and not os.path.exists(marker):
            _committed(config["run_dir"], epoch)
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)  # a real worker death, after epoch 0's commit


def _committed(run_dir: str, epoch: int) -> None:
    """Waits until Ray Train's controller has registered the checkpoint of `epoch` (it
    records each in the run's checkpoint manager snapshot), so the kill comes after it."""
    import json

    from tests.limits import wait_until

    path = os.path.join(run_dir, "checkpoint_manager_snapshot.json")

    def registered() -> bool:
        try:
            with open(path) as f:
                results = json.load(f)["checkpoint_results"]
        except (OSError, ValueError, KeyError):
            return False
        return any(r["metrics"].get("epoch") == epoch for r in results)

    wait_until(registered, 15, f"Ray Train to register epoch {epoch}'s checkpoint")


def test_torch_job_reports_checkpoints_shards_data_and_restarts_after_a_kill(ray_cluster,
                                                                           tmp_path):
    import ray.data
    from ray.train import FailureConfig, RunConfig, ScalingConfig

    from raytrain_x.ray.train import RaytrainXConfig, RaytrainXTrainer

    trainer = RaytrainXTrainer(
        _torch_loop,
        train_loop_config={"epochs": 2, "die_once": str(tmp_path / "died"),
                           "run_dir": str(tmp_path / "storage" / "torch_job")},
        raytrain_x_config=RaytrainXConfig(framework="torch",
                                          knobs=Knobs(fusion_threshold_bytes=1 << 20)),
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="torch_job", storage_path=str(tmp_path / "storage"),
                             failure_config=FailureConfig(max_failures=1)),
        datasets={"train": ray.data.range(ROWS)})
    result = trainer.fit()
    assert (tmp_path / "died").exists()  # rank 1 was killed once, after epoch 0
    metrics = result.metrics
    assert metrics["epoch"] == 1 and metrics["rank"] == 0
    assert metrics["start"] == 1  # the restarted group resumed from epoch 0's checkpoint
    assert metrics["rows_once"] and metrics["mine"] == ROWS // 2 and metrics["equal"]
    assert metrics["fusion"] == 1 << 20  # the knobs of the config
    assert result.checkpoint is not None
    assert str(tmp_path / "storage") in result.checkpoint.path
    with result.checkpoint.as_directory() as folder:
        assert os.path.exists(os.path.join(folder, "state.pt"))


def _keras_loop(config: dict) -> None:
    import numpy as np
    import ray.train
    import tensorflow as tf
    from ray.train import Checkpoint

    tf.config.threading.set_intra_op_parallelism_threads(1)
    import keras

    import raytrain_x.tensorflow.keras as rx

    rx.init()
    assert rx.rank() == ray.train.get_context().get_world_rank()
    rng = np.random.default_rng(rx.rank())
    x = rng.normal(size=(64, 4)).astype("float32")
    y = x @ np.array([[1.0], [-2.0], [0.5], [3.0]], dtype="float32")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=rx.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="mse")
    callbacks = [rx.callbacks.BroadcastGlobalVariablesCallback(0)]
    import raytrain_x

    batch = raytrain_x.training_settings().get("micro_batch_size", 8)  # the config file's
    for epoch in range(config["epochs"]):
        history = model.fit(x, y, batch_size=batch, epochs=1, verbose=0, callbacks=callbacks)
        callbacks = []
        weights = rx.allgather_object([w.tolist() for w in model.get_weights()],
                                      name=f"w{epoch}")
        metrics = {"epoch": epoch, "loss": float(history.history["loss"][-1]),
                   "equal": all(w == weights[0] for w in weights), "batch": batch}
        if rx.rank() == 0:
            with tempfile.TemporaryDirectory() as folder:
                model.save_weights(os.path.join(folder, "model.weights.h5"))
                ray.train.report(metrics, checkpoint=Checkpoint.from_directory(folder))
        else:
            ray.train.report(metrics)


def test_keras_job_reports_metrics_and_a_checkpoint(ray_cluster, tmp_path):
    from ray.train import RunConfig, ScalingConfig

    from raytrain_x.ray.train import RaytrainXConfig, RaytrainXTrainer

    best = tmp_path / "best_config.json"  # as autotune_experiments writes it
    best.write_text('{"config": {"micro_batch_size": 16}, "samples_per_sec": 1.0}')
    result = RaytrainXTrainer(
        _keras_loop, train_loop_config={"epochs": 3},
        raytrain_x_config=RaytrainXConfig(framework="tensorflow", config_file=str(best)),
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="keras_job", storage_path=str(tmp_path))).fit()
    assert result.metrics["epoch"] == 2 and result.metrics["equal"]
    assert result.metrics["batch"] == 16
    losses = [m["loss"] for m in result.metrics_dataframe.to_dict("records")]
    assert losses[-1] < losses[0]
    with result.checkpoint.as_directory() as folder:
        assert os.path.exists(os.path.join(folder, "model.weights.h5"))


def _autotuned_loop() -> None:
    import torch

    import raytrain_x.torch as rx
    from raytrain_x.core import runtime
    from tests.limits import limit

    rx.init()
    tensors = [torch.ones(1024) for _ in range(60)]
    # trains until the search is done on every rank (the controller actor's first answer
    # waits for its imports, so no fixed number of steps is enough on every machine)
    deadline = time.monotonic() + limit(30)
    finished = False
    for step in itertools.count():
        rx.grouped_allreduce_(tensors, name="grads")
        sampler = runtime.autotune_sampler()
        done = 1.0 if sampler is None or sampler.done else 0.0
        late = 1.0 if time.monotonic() > deadline else 0.0
        if step % 5 == 4:  # one Min: done on every rank, or late on any
            agreed = rx.allreduce(torch.tensor([done, -late]), op=rx.Min, name=f"d{step}")
            finished = agreed[0].item() == 1.0
            if finished or agreed[1].item() == -1.0:
                break
    _report_with_checkpoint({"finished": finished, "knobs": rx.knobs().to_dict()},
                            rx.rank())


def _report_with_checkpoint(metrics: dict, rank: int) -> None:
    """Ray Train v2 keeps the metrics of reports that carry a checkpoint (`Result.metrics`)."""
    import ray.train
    from ray.train import Checkpoint

    if rank != 0:
        ray.train.report(metrics)
        return
    with tempfile.TemporaryDirectory() as folder:
        ray.train.report(metrics, checkpoint=Checkpoint.from_directory(folder))


def test_autotune_through_the_config_writes_its_log(ray_cluster, tmp_path):
    from ray.train import RunConfig, ScalingConfig

    from raytrain_x.ray.internals import alive_actor_ids
    from raytrain_x.ray.train import HorovodConfig, HorovodTrainer
    from tests.limits import wait_until

    def job_actors() -> set[str]:
        return alive_actor_ids("StoreActor") | alive_actor_ids("BackgroundController")

    before = job_actors()
    log = tmp_path / "autotune.csv"
    config = HorovodConfig(timeout_s=30, autotune=AutotuneConfig(
        log_file=str(log), warmup_samples=0, steps_per_sample=2, bayes_opt_max_samples=3,
        rules=SearchRules(convergence_patience=0, confirm_top=0, sub_windows=1)))
    result = HorovodTrainer(_autotuned_loop, horovod_config=config,
                            scaling_config=ScalingConfig(num_workers=2),
                            run_config=RunConfig(name="tuned", storage_path=str(tmp_path))).fit()
    assert result.metrics["finished"]  # tuning finished on every rank
    rows = list(csv.DictReader(log.open()))
    assert [r["kind"] for r in rows][:4] == ["sample"] * 3 + ["best"]
    best = rows[3]
    assert result.metrics["knobs"]["fusion_threshold_bytes"] == int(
        best["fusion_threshold_bytes"])
    # the store and the autotune controller went with the job (ray.kill is asynchronous)
    wait_until(lambda: job_actors() <= before, 5, "the job's store and controller to go",
               state=job_actors)


def _tuned_trial(config: dict) -> None:
    from ray import tune
    from ray.train import RunConfig, ScalingConfig
    from ray.tune.integration.ray_train import TuneReportCallback

    from raytrain_x.ray.train import RaytrainXConfig, RaytrainXTrainer

    elastic = config["x"] == 3.0  # one trial on Ray Train's controller, one elastic
    RaytrainXTrainer(
        _scored_loop, train_loop_config=config,
        raytrain_x_config=RaytrainXConfig(framework="torch"),
        scaling_config=ScalingConfig(num_workers=(1, 2) if elastic else 2),
        run_config=RunConfig(name=f"trial-{tune.get_context().get_trial_id()}",
                             storage_path=config["storage"],
                             callbacks=[TuneReportCallback()])).fit()


def _scored_loop(config: dict) -> None:
    import ray.train
    import torch

    import raytrain_x.torch as rx

    rx.init()
    total = rx.allreduce(torch.tensor([config["x"]]), op=rx.Sum, name="x").item()
    ray.train.report({"score": -(total / rx.size() - 3.0) ** 2, "size": rx.size()})


def test_tune_runs_two_trials_of_the_trainer(ray_cluster, tmp_path):
    """Ray Tune over the trainer: one trial with a fixed world, one elastic
    (`num_workers=(1, 2)`: the elastic driver hands each report to Tune's
    `TuneReportCallback`, a `RunConfig` callback, as Ray Train's controller does, and the
    last one before `fit()` returns)."""
    from ray import tune

    tuner = tune.Tuner(
        _tuned_trial,
        param_space={"x": tune.grid_search([1.0, 3.0]), "storage": str(tmp_path / "train")},
        tune_config=tune.TuneConfig(metric="score", mode="max", max_concurrent_trials=2),
        run_config=tune.RunConfig(storage_path=str(tmp_path / "tune"), verbose=0))
    grid = tuner.fit()
    assert len(grid) == 2 and not grid.errors
    best = grid.get_best_result()
    assert best.config["x"] == 3.0 and best.metrics["score"] == 0.0
    assert best.metrics["size"] in (1, 2)  # the elastic world when it reported


# ----------------------------------------------------------------------------- bad input
def _never_runs() -> None:
    raise AssertionError("a worker started")


def _ray_train_linear_loop(config: dict) -> None:
    """Ray Train's own linear example as a `TorchTrainer` loop writes it: no raytrain-x, the
    model through `ray.train.torch.prepare_model` (DDP), the data through
    `prepare_data_loader` (a DistributedSampler)."""
    import ray.train
    import ray.train.torch
    import torch

    torch.manual_seed(0)
    x = torch.linspace(-1, 1, 64).unsqueeze(1)
    data = torch.utils.data.TensorDataset(x, 3 * x + 1)
    loader = ray.train.torch.prepare_data_loader(
        torch.utils.data.DataLoader(data, batch_size=8, shuffle=True))
    model = ray.train.torch.prepare_model(torch.nn.Linear(1, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(config["epochs"]):
        loader.sampler.set_epoch(epoch)
        for xb, yb in loader:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(xb), yb).backward()
            opt.step()
        weight = model.module.weight.detach().clone()
        everyone = [torch.zeros_like(weight) for _ in range(ray.train.get_context()
                                                            .get_world_size())]
        torch.distributed.all_gather(everyone, weight)
        metrics = {"epoch": epoch, "weight": weight.item(), "rows": len(loader.sampler),
                   "same": all(torch.equal(w, weight) for w in everyone)}
        with tempfile.TemporaryDirectory() as folder:  # v2 keeps the metrics of checkpoints
            torch.save(model.module.state_dict(), os.path.join(folder, "model.pt"))
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(folder))


def test_a_torch_trainer_loop_with_prepare_model_and_prepare_data_loader(ray_cluster, tmp_path):
    """Ray Train's `prepare_model` and `prepare_data_loader` (most Ray Train scripts) failed
    at 2 workers with "Default process group has not been initialized": the workers now
    have torch's default group, as under `TorchTrainer`, made through the world's store."""
    from ray.train import RunConfig, ScalingConfig

    from raytrain_x.ray.train import RaytrainXTrainer

    result = RaytrainXTrainer(
        _ray_train_linear_loop, train_loop_config={"epochs": 12},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="prepared", storage_path=str(tmp_path))).fit()
    assert result.error is None, result.error
    metrics = result.metrics
    assert metrics["same"] and metrics["rows"] == 32  # DDP kept the ranks alike; half each
    assert abs(metrics["weight"] - 3) < 0.5, metrics  # it learnt


def test_bad_input_is_one_line_before_any_worker_starts(monkeypatch):
    import importlib.util

    from ray.train import ScalingConfig

    from raytrain_x.ray.train import HorovodConfig, RaytrainXConfig, RaytrainXTrainer

    with pytest.raises(ConfigError, match="num_workers >= 1"):
        RaytrainXTrainer(_never_runs, scaling_config=ScalingConfig(num_workers=0))
    with pytest.raises(ConfigError, match=r"\(min, max\) with 1 <= min <= max"):
        RaytrainXTrainer(_never_runs, scaling_config=ScalingConfig(num_workers=(0, 2)))
    with pytest.raises(ConfigError, match="nothing to tune"):
        RaytrainXConfig(knobs=Knobs(), autotune=True)
    with pytest.raises(ConfigError, match="framework must be one of"):
        RaytrainXConfig(framework="jax")
    with pytest.raises(ConfigError, match="Ray places and connects"):
        HorovodConfig(nics={"eth0"})
    with pytest.raises(ConfigError, match="raytrain_x_config must be a RaytrainXConfig"):
        RaytrainXTrainer(_never_runs, raytrain_x_config={"knobs": None})
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorflow" else real(name, *a))
    with pytest.raises(ConfigError, match=r"tensorflow is not installed.*raytrain-x\[tensorflow\]"):
        RaytrainXConfig(framework="tensorflow")


def test_the_elastic_trainer_reads_the_resize_interval():
    """`ScalingConfig(elastic_resize_monitor_interval_s=...)` was never read: it is how often
    the elastic driver looks for capacity to grow into; Ray Train's default (60 s, bounding
    its restarts) leaves raytrain-x's 1 s, as growing here restarts nothing."""
    from ray.train import ScalingConfig

    from raytrain_x.ray.elastic_trainer import resize_interval

    assert resize_interval(ScalingConfig(num_workers=(1, 2))) == 1.0
    assert resize_interval(ScalingConfig(num_workers=(1, 2),
                                         elastic_resize_monitor_interval_s=5)) == 5.0
    assert resize_interval(ScalingConfig(num_workers=(1, 2),
                                         elastic_resize_monitor_interval_s=0)) == 0.1
