"""Ray Tune trials that are distributed jobs, and offline experiments."""

from __future__ import annotations

import json

import pytest
import torch
from ray import tune

from raytrain_x import ConfigError
from raytrain_x.tune_integration import (
    DistributedTrainableCreator,
    autotune_experiments,
    report,
)


def _trial(config: dict) -> None:
    import raytrain_x.torch as rx

    x = torch.tensor([config["x"]])
    for step in range(3):
        total = rx.allreduce(x, op=rx.Sum, name=f"s{step}").item()
        # every rank reports; only rank 0's reaches Tune (rank is part of the metric)
        report({"score": -(total / rx.size() - 3.0) ** 2, "rank": rx.rank(),
                "size": rx.size(), "fusion": rx.knobs().fusion_threshold_bytes})


def test_tuner_with_distributed_trials_and_bayesopt(ray_cluster, tmp_path):
    from ray.tune.search.bayesopt import BayesOptSearch

    tuner = tune.Tuner(
        DistributedTrainableCreator(_trial, num_workers=2),
        param_space={"x": tune.uniform(0.0, 6.0), "raytrain_x": {"fusion_threshold_bytes": 4096}},
        tune_config=tune.TuneConfig(
            search_alg=BayesOptSearch(metric="score", mode="max", random_search_steps=2),
            num_samples=3, max_concurrent_trials=1),
        run_config=tune.RunConfig(storage_path=str(tmp_path), verbose=0))
    grid = tuner.fit()
    assert len(grid) == 3 and not grid.errors
    best = grid.get_best_result(metric="score", mode="max")
    assert best.metrics["rank"] == 0  # reports came from rank 0 only
    assert best.metrics["size"] == 2 and best.metrics["training_iteration"] == 3
    assert best.metrics["fusion"] == 4096  # knobs from the trial config
    assert best.metrics["score"] == max(r.metrics["score"] for r in grid)


def _experiment(config: dict) -> None:
    import raytrain_x.torch as rx

    if config["micro_batch_size"] > 48:
        raise MemoryError("out of memory (pretend) at this micro-batch size")
    for step in range(4):
        rx.allreduce(torch.ones(8), name=f"e{step}")
        report({"samples_per_sec": float(config["micro_batch_size"] * 10 + step)})


def test_experiments_with_a_failing_config(ray_cluster, tmp_path):
    """Two trials through Tune's `Tuner` and `DistributedTrainableCreator`, one failing on
    its workers: it is errored with the workers' own error, the other succeeds, and the
    best config and the outputs come from it."""
    result = autotune_experiments(
        _experiment, {"micro_batch_size": [32, 64]}, num_workers=2, search="grid",
        steps_per_experiment=4, start_step=1, output_dir=tmp_path / "exp")
    assert len(result.experiments) == 2
    failed = [e for e in result.experiments if e.metric is None]
    assert len(failed) == 1 and "out of memory" in failed[0].error
    assert result.best_config == {"micro_batch_size": 32}
    assert result.best.metric == pytest.approx(32 * 10 + 2.0)  # mean of steps 1..3
    out = tmp_path / "exp"
    assert json.loads((out / "best_config.json").read_text())["config"] == {"micro_batch_size": 32}
    assert (out / "summary.csv").read_text().count("\n") == 3
    assert (out / "metric_per_experiment.png").stat().st_size > 5000
    assert (out / "experiment_000" / "config.json").exists()


@pytest.mark.parametrize(
    "space,search,match",
    [
        ({}, "grid", "non-empty dict"),
        ({"lr": []}, "grid", "empty list"),
        ({"lr": (0.1, 0.01)}, "bayesopt", "low < high"),
        ({"lr": (0.01, 0.1)}, "grid", "grid search needs a list"),
        ({"opt": ["sgd", "adam"]}, "bayesopt", "use search='grid'"),
        ({"lr": 0.1}, "grid", "use a list of values"),
    ],
)
def test_bad_space_definitions(space, search, match):
    with pytest.raises(ConfigError, match=match):
        autotune_experiments(_experiment, space, search=search)


def test_tune_experiments_command(ray_cluster, tmp_path):
    """The command's wiring, on one experiment (choosing among several, and a failing one,
    is `test_experiments_with_a_failing_config`'s)."""
    import sys
    from pathlib import Path

    from tests import limits
    from tests.conftest import REPO

    out = limits.run(
        [str(Path(sys.executable).parent / "raytrain-x"), "tune-experiments",
         "--fn", "examples.experiment_step:step_fn", "--space", '{"micro_batch_size": [8]}',
         "--search", "grid", "--steps-per-experiment", "4", "--start-step", "1",
         "--address", ray_cluster, "--output-dir", str(tmp_path / "cli")],
        40, "the tune-experiments command", cwd=REPO,
        env={**__import__("os").environ, "RAY_AUTH_MODE": "disabled"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "best samples_per_sec" in out.stdout
    assert json.loads((tmp_path / "cli" / "best_config.json").read_text())["config"]
