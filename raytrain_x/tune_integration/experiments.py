"""Offline autotune experiments: short distributed runs, one configuration each.

Like DeepSpeed's autotuning experiments, but on Ray Tune: each experiment runs the user's
function on `num_workers` workers with one configuration (user parameters such as
`micro_batch_size` and/or raytrain-x knobs); the metric is the mean of what rank 0 reports
between `start_step` and `steps_per_experiment`. An experiment that raises scores as
failed and the search goes on.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ray import tune

from raytrain_x.common.errors import ConfigError
from raytrain_x.common.knobs import Knobs
from raytrain_x.common.logs import progress_logger
from raytrain_x.tune_integration.trainable import PEAK_MEMORY, over_memory

progress = progress_logger("raytrain_x.tune.progress")


@dataclass
class Experiment:
    index: int
    config: dict[str, Any]
    metric: float | None  # None when it failed
    error: str = ""
    steps: int = 0


@dataclass
class ExperimentsResult:
    """What `autotune_experiments` found.

    Attributes:
        experiments: every experiment run, in order.
        best: the experiment with the best metric, None if none finished.
        output_dir: the folder with one folder per experiment and the summaries.
        metric: the metric compared.
        mode: `max` or `min`.
        space: the search space as given.
    """

    experiments: list[Experiment]
    best: Experiment | None
    output_dir: Path
    metric: str
    mode: str
    space: dict[str, Any] = field(default_factory=dict)

    @property
    def best_config(self) -> dict[str, Any] | None:
        return self.best.config if self.best else None


def _validate_space(space: Mapping[str, Any], search: str) -> dict[str, Any]:
    """Turns the user's space into Tune's; raises ConfigError with the fix."""
    if not isinstance(space, Mapping) or not space:
        raise ConfigError("space must be a non-empty dict: name -> list of values (grid) or "
                          "(low, high) (bayesopt)")
    knob_names = set(Knobs.specs())
    tune_space: dict[str, Any] = {}
    for name, spec in space.items():
        if isinstance(spec, list):
            if not spec:
                raise ConfigError(f"space[{name!r}] is an empty list; give the values to try")
            if search == "bayesopt":
                numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool)
                              for v in spec)
                if not numeric:
                    raise ConfigError(f"space[{name!r}]: bayesopt searches numbers; use "
                                      "search='grid' for categorical values")
                tune_space[name] = tune.uniform(min(spec), max(spec)) if len(spec) > 1 \
                    else spec[0]
            else:
                tune_space[name] = tune.grid_search(list(spec))
        elif isinstance(spec, tuple):
            if len(spec) != 2 or not all(isinstance(v, (int, float)) for v in spec) \
                    or not spec[0] < spec[1]:
                raise ConfigError(f"space[{name!r}] = {spec!r}: a range is (low, high) with "
                                  "low < high")
            if search == "grid":
                raise ConfigError(f"space[{name!r}]: grid search needs a list of values, "
                                  f"not a range {spec!r}")
            tune_space[name] = tune.uniform(float(spec[0]), float(spec[1]))
        else:
            raise ConfigError(f"space[{name!r}] = {spec!r}: use a list of values or a "
                              "(low, high) tuple")
        if name in knob_names:
            tune_space.setdefault("raytrain_x", {})
    return tune_space


def _round_like(space: Mapping[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """BayesOpt proposes floats; give integer parameters integers."""
    out = {}
    for name, value in config.items():
        spec = space.get(name)
        values = list(spec) if isinstance(spec, (list, tuple)) else []
        if values and all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            value = int(round(value))
        out[name] = value
    return out


class _PatienceStopper(tune.Stopper):
    """Stops the whole search after `patience` finished experiments without a better one."""

    def __init__(self, metric: str, mode: str, patience: int | None) -> None:
        self.metric, self.mode, self.patience = metric, mode, patience
        self.best = -math.inf
        self.since_best = 0

    def __call__(self, trial_id: str, result: dict) -> bool:
        return False

    def on_trial_done(self, score: float | None) -> None:
        if score is None:
            self.since_best += 1
            return
        signed = score if self.mode == "max" else -score
        if signed > self.best:
            self.best, self.since_best = signed, 0
        else:
            self.since_best += 1

    def stop_all(self) -> bool:
        return self.patience is not None and self.since_best >= self.patience


def autotune_experiments(
    train_fn: Callable[[dict], Any],
    space: Mapping[str, Any],
    num_workers: int = 2,
    metric: str = "samples_per_sec",
    mode: str = "max",
    max_experiments: int = 10,
    steps_per_experiment: int = 10,
    start_step: int = 2,
    search: str = "bayesopt",
    early_stop_patience: int | None = None,
    output_dir: str | os.PathLike = "raytrain_x_experiments",
    cpus_per_worker: float = 1,
    seed: int = 0,
    max_memory_per_worker: float | None = None,
    global_batch_size: int | None = None,
) -> ExperimentsResult:
    """Runs short experiments and picks the best configuration.

    `train_fn(config)` runs on every worker and calls
    `raytrain_x.autotune.report({metric: value})` once per step; knob names in the
    space (e.g. `fusion_threshold_bytes`) are applied as communication knobs.

    Returns:
        The experiments, the best one, and `output_dir` holding one folder per experiment
        (config.json, metrics.csv, log.txt), summary.csv, best_config.json and
        metric_per_experiment.png.

    Args:
        train_fn: runs on every worker; calls `raytrain_x.autotune.report({metric: value})` once per
            step.
        space: Ray Tune search space; knob names (such as `fusion_threshold_bytes`) become
            communication knobs.
        num_workers: workers per experiment.
        metric: the reported metric to compare.
        mode: `max` or `min`.
        max_experiments: how many configurations to try.
        steps_per_experiment: steps each experiment trains.
        start_step: steps left out of the score (warm-up); 0 <= start_step < steps_per_experiment.
        search: `bayesopt` (Ray Tune's BayesOptSearch), `grid`, or `zero`: DeepSpeed's
            fast mode over a space of `zero_stage` and `micro_batch_size` lists (each
            stage in order, its micro-batch sizes upward until the memory cap or until
            the metric stops rising; a stage that does not beat the one before ends the
            search).
        early_stop_patience: stop after this many experiments without a better one; None: never.
        output_dir: where the results go.
        cpus_per_worker: CPUs each worker asks Ray for.
        seed: the search's seed.
        max_memory_per_worker: MB; an experiment whose reported `peak_memory_mb` (rank
            0's, added to every report) exceeds it counts as failed.
        global_batch_size: with `micro_batch_size` in the space, the function also gets
            `gradient_accumulation_steps` = global_batch_size // (micro_batch_size *
            num_workers), so that every experiment trains the same global batch.
    """
    from raytrain_x.tune_integration.trainable import DistributedTrainableCreator

    if search not in ("bayesopt", "grid", "zero"):
        raise ConfigError(f"search must be 'bayesopt', 'grid' or 'zero', got {search!r}")
    if mode not in ("max", "min"):
        raise ConfigError(f"mode must be 'max' or 'min', got {mode!r}")
    if not 0 <= start_step < steps_per_experiment:
        raise ConfigError(f"need 0 <= start_step < steps_per_experiment, got {start_step}, "
                          f"{steps_per_experiment}")
    plan = _zero_plan(space, max_memory_per_worker, mode) if search == "zero" else None
    tune_space = _validate_space(space, "grid" if plan else search)
    tune_space.pop("raytrain_x", None)
    knob_names = set(Knobs.specs())
    out = Path(output_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)

    def experiment_fn(config: dict) -> Any:
        params = _round_like(space, {k: v for k, v in config.items() if k != "raytrain_x"})
        if global_batch_size and "micro_batch_size" in params:
            params["gradient_accumulation_steps"] = max(
                1, global_batch_size // (params["micro_batch_size"] * num_workers))
        return train_fn(params)

    trainable = DistributedTrainableCreator(experiment_fn, num_workers=num_workers,
                                            cpus_per_worker=cpus_per_worker)
    search_alg = None
    if plan is not None:
        from raytrain_x.tune_integration.zero_search import FastModeSearcher

        search_alg = FastModeSearcher(plan, metric, mode, start_step, max_experiments)
        tune_space = {}
    elif search == "bayesopt":
        from ray.tune.search.bayesopt import BayesOptSearch

        search_alg = BayesOptSearch(metric=metric, mode=mode, random_state=seed,
                                    random_search_steps=min(3, max_experiments))
    param_space = dict(tune_space)
    knob_params = [n for n in space if n in knob_names]
    if knob_params:  # knobs reach the job through config["raytrain_x"]
        param_space["raytrain_x"] = {n: tune_space[n] for n in knob_params}
        for n in knob_params:
            param_space.pop(n)
    stopper = _PatienceStopper(metric, mode, early_stop_patience)
    tuner = tune.Tuner(
        trainable,
        param_space=param_space,
        tune_config=tune.TuneConfig(
            search_alg=search_alg,
            num_samples=max_experiments if search in ("bayesopt", "zero") else 1,
            max_concurrent_trials=1),
        run_config=tune.RunConfig(
            name="raytrain_x_experiments", storage_path=str(out / "tune"),
            stop=_StopAfter(steps_per_experiment, stopper, metric), verbose=0))
    grid = tuner.fit()

    experiments = []
    for i, result in enumerate(grid):
        config = dict(result.config)
        knobs = config.pop("raytrain_x", {})
        config = _round_like(space, {**config, **knobs})
        frame = result.metrics_dataframe
        error = ""
        value = None
        steps = 0 if frame is None else len(frame)
        if result.error is not None:
            error = str(result.error)
        elif frame is not None and PEAK_MEMORY in frame and (over := over_memory(
                frame[PEAK_MEMORY].max(), max_memory_per_worker)):
            error = over
        elif frame is not None and metric in frame and steps > start_step:
            value = float(frame[metric].iloc[start_step:steps_per_experiment].mean())
        else:
            error = f"the function reported {steps} steps of {metric!r}, fewer than needed"
        experiments.append(Experiment(i, config, value, error, steps))
        _write_experiment(out / f"experiment_{i:03d}", experiments[-1], frame)
        if max_experiments and len(experiments) >= max_experiments:
            break
    scored = [e for e in experiments if e.metric is not None]
    best = (max if mode == "max" else min)(scored, key=lambda e: e.metric) if scored else None
    result = ExperimentsResult(experiments, best, out, metric, mode, dict(space))
    _write_summary(result)
    return result


def _zero_plan(space: Mapping[str, Any], max_memory: float | None, mode: str) -> Any:
    """DeepSpeed's fast mode over `zero_stage` and `micro_batch_size`; ConfigError with the
    fix for any other space."""
    from raytrain_x.tune_integration.zero_search import FastMode

    if set(space) != {"zero_stage", "micro_batch_size"}:
        raise ConfigError("search='zero' takes a space of exactly zero_stage and "
                          "micro_batch_size lists, e.g. {'zero_stage': [0, 1, 2], "
                          f"'micro_batch_size': [1, 2, 4, 8, 16]}}; got {sorted(space)}")
    stages, sizes = space["zero_stage"], space["micro_batch_size"]
    if not isinstance(stages, list) or not stages or any(s not in (0, 1, 2) for s in stages):
        raise ConfigError(f"zero_stage must be a list of 0, 1 and 2, got {stages!r}")
    if not isinstance(sizes, list) or not sizes or any(
            not isinstance(m, int) or isinstance(m, bool) or m < 1 for m in sizes):
        raise ConfigError(f"micro_batch_size must be a list of ints >= 1, got {sizes!r}")
    if max_memory is not None and not max_memory > 0:
        raise ConfigError(f"max_memory_per_worker must be > 0 (MB), got {max_memory!r}")
    return FastMode(list(stages), list(sizes), max_memory, mode)


class _StopAfter(tune.Stopper):
    """Ends each experiment after `steps` reports; asks the patience stopper about the
    whole search."""

    def __init__(self, steps: int, patience: _PatienceStopper, metric: str) -> None:
        self.steps, self.patience, self.metric = steps, patience, metric
        self.values: dict[str, list[float]] = {}

    def __call__(self, trial_id: str, result: dict) -> bool:
        self.values.setdefault(trial_id, []).append(result.get(self.metric, math.nan))
        done = result.get("training_iteration", 0) >= self.steps
        if done:
            vals = [v for v in self.values[trial_id] if v == v]
            self.patience.on_trial_done(sum(vals) / len(vals) if vals else None)
        return done

    def stop_all(self) -> bool:
        return self.patience.stop_all()


def _write_experiment(folder: Path, exp: Experiment, frame: Any) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(exp.config, indent=2, default=str))
    if frame is not None:
        frame.to_csv(folder / "metrics.csv", index=False)
    (folder / "log.txt").write_text(exp.error or f"ok: {exp.steps} steps, metric {exp.metric}")


def _error_line(text: str) -> str:
    """The line of a failed experiment's error that names it: the last `Name: message`
    line (the innermost exception; Ray's first line only names the actor, and the last may
    be a note on the other ranks), without terminal colours."""
    lines = [line.strip() for line in re.sub(r"\x1b\[[0-9;]*m", "", text).splitlines()
             if line.strip()]
    named = [line for line in lines if re.match(r"[A-Za-z_][\w.]*: \S", line)]
    return (named or lines or [""])[-1][:200]


def _write_summary(result: ExperimentsResult) -> None:
    out = result.output_dir
    names = sorted({k for e in result.experiments for k in e.config})
    with (out / "summary.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["experiment", *names, result.metric, "status", "error"])
        for e in result.experiments:
            writer.writerow([e.index, *[e.config.get(n) for n in names],
                             "" if e.metric is None else e.metric,
                             "ok" if e.metric is not None else "failed",
                             _error_line(e.error) if e.error else ""])
    if result.best is not None:
        (out / "best_config.json").write_text(json.dumps(
            {"config": result.best.config, result.metric: result.best.metric}, indent=2,
            default=str))
    progress.info("tuning space: %s", result.space)
    progress.info("experiments: %d (%d failed)", len(result.experiments),
                  sum(e.metric is None for e in result.experiments))
    for e in result.experiments:
        shown = "FAILED" if e.metric is None else f"{e.metric:.4g}"
        progress.info("  #%d: %s -> %s %s", e.index, e.config, result.metric, shown)
    if result.best is not None:
        progress.info("best %s: %.4g with %s", result.metric, result.best.metric,
                      result.best.config)
    _plot(result, out / "metric_per_experiment.png")


def _plot(result: ExperimentsResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    ok = [e for e in result.experiments if e.metric is not None]
    failed = [e for e in result.experiments if e.metric is None]
    ax.bar([e.index for e in ok], [e.metric for e in ok], label=result.metric)
    if failed:
        ax.scatter([e.index for e in failed], [0] * len(failed), marker="x", color="red",
                   label="failed", zorder=3)
    if result.best is not None:
        ax.bar([result.best.index], [result.best.metric], color="green", label="best")
    ax.set_xlabel("experiment")
    ax.set_ylabel(result.metric)
    ax.set_title("raytrain-x experiments")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
