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


def test_a_trial_asks_one_cpu_per_worker_and_none_for_its_driver():
    """A 2-worker trial asked 1 CPU for its driver and 1 per worker: on a 2-core machine it
    stayed PENDING forever (`examples/tune_digits.py` hung). The driver only waits on its
    workers; the placement group's head bundle is empty."""
    trainable = DistributedTrainableCreator(lambda config: None, num_workers=2)
    request = trainable._resources  # what tune.with_resources attached
    assert request.head_bundle_is_empty
    assert request.required_resources == {"CPU": 2.0}


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
    """Throughput grows with the micro-batch (a little less with each ZeRO stage); memory
    too, halved by stage 1 (reported, standing in for the measured peak); at 48 or more
    the job runs out of memory."""
    import raytrain_x.torch as rx

    mbs, stage = config["micro_batch_size"], config.get("zero_stage", 0)
    if mbs > 48:
        raise MemoryError("out of memory (pretend) at this micro-batch size")
    assert config.get("gradient_accumulation_steps", 1) * mbs * rx.size() in (64, mbs * 2)
    for step in range(4):
        rx.allreduce(torch.ones(8), name=f"e{step}")
        report({"samples_per_sec": float(mbs * 10 + step - stage),
                "peak_memory_mb": mbs * 10 / (1 + stage)})


@pytest.mark.parametrize(
    "space,search,match",
    [
        ({}, "grid", "non-empty dict"),
        ({"lr": []}, "grid", "empty list"),
        ({"lr": (0.1, 0.01)}, "bayesopt", "low < high"),
        ({"lr": (0.01, 0.1)}, "grid", "grid search needs a list"),
        ({"opt": ["sgd", "adam"]}, "bayesopt", "use search='grid'"),
        ({"lr": 0.1}, "grid", "use a list of values"),
        ({"micro_batch_size": [1, 2]}, "zero", "exactly zero_stage and micro_batch_size"),
        ({"zero_stage": [3], "micro_batch_size": [1]}, "zero", "a list of 0, 1 and 2"),
        ({"zero_stage": [0], "micro_batch_size": [0.5]}, "zero", "ints >= 1"),
    ],
)
def test_bad_space_definitions(space, search, match):
    with pytest.raises(ConfigError, match=match):
        autotune_experiments(_experiment, space, search=search)


def test_tune_experiments_command_searches_stage_and_micro_batch(ray_cluster, tmp_path):
    """`raytrain-x tune-experiments --search zero`, DeepSpeed's fast mode under a memory
    cap, through Tune's `Tuner` and `DistributedTrainableCreator`: stage 0 at micro-batch
    16, then 32 over the cap (the stage ends); stage 1 from 16, 32, then 64 fails on its
    workers with their own error (the stage ends, better than stage 0, no stage left).
    The best config, the summary, the plot and each experiment's folder come from them."""
    import sys
    from pathlib import Path

    from tests import limits
    from tests.conftest import REPO

    out_dir = tmp_path / "exp"
    out = limits.run(
        [str(Path(sys.executable).parent / "raytrain-x"), "tune-experiments",
         "--fn", "tests.integration.test_tune:_experiment",
         "--space", '{"zero_stage": [0, 1], "micro_batch_size": [16, 32, 64]}',
         "--search", "zero", "--max-memory-per-worker", "300", "--global-batch-size", "64",
         "--steps-per-experiment", "4", "--start-step", "1",
         "--address", ray_cluster, "--output-dir", str(out_dir)],
        50, "the tune-experiments command", cwd=REPO,
        env={**__import__("os").environ, "RAY_AUTH_MODE": "disabled"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "experiments: 5 (2 failed)" in out.stdout, out.stdout[-2000:]
    assert "best samples_per_sec: 321 with {'zero_stage': 1, 'micro_batch_size': 32}" \
        in out.stdout, out.stdout[-2000:]
    best = json.loads((out_dir / "best_config.json").read_text())
    assert best["config"] == {"zero_stage": 1, "micro_batch_size": 32}
    assert best["samples_per_sec"] == pytest.approx(32 * 10 + 2.0 - 1)  # steps 1..3
    summary = (out_dir / "summary.csv").read_text()
    tried = [tuple(json.loads((out_dir / f"experiment_{i:03d}" / "config.json").read_text())
                   .values()) for i in range(5)]
    assert tried == [(0, 16), (0, 32), (1, 16), (1, 32), (1, 64)]
    assert summary.count("\n") == 6 and "out of memory" in summary
    assert "peak memory 320 MB over max_memory_per_worker 300 MB" in summary
    assert (out_dir / "metric_per_experiment.png").stat().st_size > 5000
    assert (out_dir / "experiment_000" / "config.json").exists()
