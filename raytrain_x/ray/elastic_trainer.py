"""`RaytrainXTrainer.fit()` with `ScalingConfig(num_workers=(min, max))`: the training loop
on raytrain-x's elastic driver instead of Ray Train's controller, so a lost worker, a
drained node or new capacity changes the world in memory rather than restarting it.

What stays Ray Train's: the loop's `ray.train` calls (`train_worker.py`), the run's folder
and checkpoints under `RunConfig(storage_path, name)` (`train_reports.py`), `Result`,
`FailureConfig(max_failures)` (counted as Ray Train counts: the failures one reset recovers
from are one; a drained node is not a failure) and `RunConfig(callbacks=...)`'s
`UserCallback.after_report` (so Ray Tune's `TuneReportCallback` works). Ray Data datasets
are fed through one feed per dataset (`data_feed.py`), re-divided at every step.

When every worker is lost (nothing in memory survives), the run goes on as Ray Train's
does: new workers, `ray.train.get_checkpoint()` the latest checkpoint, each dataset where it
was at that checkpoint's report; it counts as one failure.
"""

from __future__ import annotations

import datetime
import importlib
import importlib.util
import logging
import os
import threading
from typing import Any

import pandas as pd
import ray
from ray.train.v2.api.exceptions import WorkerGroupError
from ray.train.v2.api.result import Result

from raytrain_x.common.errors import ConfigError, ElasticStateLost, WorkerError
from raytrain_x.ray import internals
from raytrain_x.ray.data_feed import start_feed
from raytrain_x.ray.elastic.settings import ElasticSettings
from raytrain_x.ray.executor import RayExecutor
from raytrain_x.ray.train_reports import start_reports, storage_uri
from raytrain_x.ray.train_worker import RunInfo, install

__all__ = ["COOLDOWN_RANGE_S", "REPORT_POLL_S", "TUNE_HAND_OVER_S", "check_elastic_scaling",
           "fit_elastic"]
log = logging.getLogger("raytrain_x.ray")
REPORT_POLL_S = 0.25  # how often the driver hands new reports to RunConfig's callbacks
# A node whose worker failed takes no new worker for 10 s, doubling per failure up to 5 min
# (Ray Train keeps no blacklist; raytrain-x's elastic driver keeps a failed host out for good
# without a cooldown, which on a small cluster would idle a node whose one process crashed).
COOLDOWN_RANGE_S = (10.0, 300.0)
# How long fit() waits, before it returns, for a Ray Tune trial to take the run's last report
# from `TuneReportCallback` (the trial's end would otherwise overtake it)
TUNE_HAND_OVER_S = 120.0
# The niceness of the thread that runs the elastic driver's loop: Ray's default for its
# worker processes (`RAY_worker_niceness`), where Ray Train's controller runs. At the
# driver's own priority the loop's wake-ups (ten a second) preempt the training workers on
# a host whose cores they fill (benchmarks/ray_train_vs_torch_trainer.py).
DRIVER_LOOP_NICENESS = 15


def check_elastic_scaling(scaling_config: Any) -> tuple[int, int]:
    """`ScalingConfig(num_workers=(min, max))`'s bounds.

    Raises:
        ConfigError: not two ints with 1 <= min <= max.
    """
    bounds = scaling_config.num_workers
    if (len(bounds) != 2 or not all(isinstance(b, int) for b in bounds)
            or not 1 <= bounds[0] <= bounds[1]):
        raise ConfigError(f"ScalingConfig(num_workers={bounds}): an elastic run needs "
                          "(min, max) with 1 <= min <= max")
    return bounds[0], bounds[1]


# Ray Train's default `elastic_resize_monitor_interval_s`: each of its resizes restarts the
# worker group, so it looks for capacity once a minute. A resize here is a join at the next
# commit, and the driver looks every second unless the user sets another interval.
RAY_TRAIN_RESIZE_INTERVAL_S = 60.0


def resize_interval(scaling_config: Any) -> float:
    """Seconds between the driver's looks for capacity to grow into: the user's
    `ScalingConfig(elastic_resize_monitor_interval_s=...)`, or 1 s where it is Ray Train's
    default. Failures and drains are handled as they come, whatever the interval."""
    given = float(getattr(scaling_config, "elastic_resize_monitor_interval_s",
                          RAY_TRAIN_RESIZE_INTERVAL_S))
    if given == RAY_TRAIN_RESIZE_INTERVAL_S:
        return ElasticSettings.discovery_interval_s
    return max(given, 0.1)


# torch's message when a collective of torch.distributed runs without a default group
_NO_DEFAULT_GROUP = "Default process group has not been initialized"


def what_to_do(detail: str) -> str:
    """A line that says what to change, in front of a loop's error where one is known ("":
    none): torch.distributed's default group is fixed, so an elastic run has none."""
    if _NO_DEFAULT_GROUP in detail:
        return ("torch.distributed's default process group is fixed and cannot follow an "
                "elastic run's changes of world, so an elastic run has none: use "
                "raytrain-x's collectives in its place (rx.allreduce, rx.allgather, "
                "rx.broadcast, ...; docs/ray_train.md, 'Porting a TorchTrainer loop'). ")
    return ""


def _worker(train_fn: Any, run: RunInfo, framework: str | None) -> Any:
    install(run)
    if framework in (None, "torch") and importlib.util.find_spec("torch") is not None:
        _prepare_model_follows_the_world()
    return train_fn()


def _prepare_model_follows_the_world() -> None:
    """`ray.train.torch.prepare_model` and `prepare_data_loader`, in this worker, build
    raytrain-x's `DataParallel` and `WorldSampler` where they would build DDP and
    `DistributedSampler`, whose world is fixed. Looked up by name: the driver side never
    imports a framework face (docs/architecture.md); this runs in a worker."""
    face = importlib.import_module("raytrain_x.torch.data_parallel")
    for utils in ("ray.train.v2.torch.train_loop_utils",  # Ray Train v2's, then v1's
                  "ray.train.torch.train_loop_utils"):
        face.stand_in_for_ddp(importlib.import_module(utils))


def fit_elastic(trainer: Any) -> Result:
    """Runs `trainer` (a `RaytrainXTrainer` with elastic scaling) and returns its `Result`.

    Raises:
        WorkerGroupError: the run failed (a worker's error, more failures than
            `FailureConfig(max_failures)`, too long below `min` workers), as Ray Train raises
            it; the cause is chained.
    """
    low, high = check_elastic_scaling(trainer.scaling_config)
    run_config = trainer.run_config
    name = run_config.name or f"raytrain_x_run-{datetime.datetime.now():%Y-%m-%d_%H-%M-%S}"
    storage_path = run_config.storage_path
    config = trainer.backend_config
    split = internals.datasets_to_split(trainer.data_config, list(trainer.datasets))
    whole = {n: ds for n, ds in trainer.datasets.items() if n not in split}
    callbacks = [cb for cb in (run_config.callbacks or [])
                 if hasattr(cb, "after_report")]
    most = run_config.failure_config.max_failures
    left = None if most < 0 else most
    scaling = trainer.scaling_config
    executor = RayExecutor(
        RayExecutor.create_settings(timeout_s=config.timeout_s), min_workers=low,
        max_workers=high, cpus_per_worker=scaling.num_cpus_per_worker or 1,
        use_gpu=scaling.use_gpu, gpus_per_worker=scaling.num_gpus_per_worker or None,
        resources_per_worker=scaling.additional_resources_per_worker, knobs=config.knobs,
        autotune=config.autotune, name=name, max_failures=left,
        cooldown_range=COOLDOWN_RANGE_S, policies=config.policies)
    executor.discovery_interval_s = resize_interval(scaling)
    train_fn = trainer._get_train_func()
    actors: list[Any] = []  # the run's ledger and feeds: gone when fit() returns or raises
    reports: Any = None
    handed = [0]  # reports handed to the callbacks

    def hand_over() -> None:
        for record in ray.get(reports.since.remote(handed[0])):
            handed[0] += 1
            checkpoint = paths.checkpoint(record["checkpoint"]) if record["checkpoint"] \
                else None
            for callback in callbacks:
                callback.after_report(trainer.train_run_context, record["all_metrics"],
                                      checkpoint)

    try:
        reports = start_reports(storage_path, name, run_config.checkpoint_config)
        actors.append(reports)
        feeds = {n: start_feed(ds, n) for n, ds in trainer.datasets.items() if n in split}
        actors.extend(feeds.values())
        paths = RunInfo(name, storage_path, reports, feeds, whole, None)
        executor.start(extra_env_vars=dict(config._file_env))
        while True:
            run = RunInfo(name, storage_path, reports, feeds, whole,
                          ray.get(reports.latest.remote()))
            try:  # the last report is handed over before this returns
                results = _run_reporting(executor, train_fn, run, config.framework,
                                         hand_over)
                break
            except (ElasticStateLost, WorkerError) as exc:
                if isinstance(exc, WorkerError) and not exc.process_lost:
                    raise WorkerGroupError(f"the elastic run {name} failed: "
                                           f"{what_to_do(exc.detail)}{exc}", {}) from exc
                job = executor.last_elastic_job
                used = (job.failures if job is not None else 0) + 1
                if left is not None and used > left:
                    raise WorkerGroupError(
                        f"every worker was lost, with {used} failures in all: more than "
                        f"FailureConfig(max_failures={most})", {}) from exc
                left = None if left is None else left - used
                executor.max_failures = left
                log.warning("raytrain-x: every worker of run %s was lost; it goes on from its "
                            "latest checkpoint (%s)", name, exc)
            except ConfigError:
                raise
            except Exception as exc:  # noqa: BLE001 - raised as Ray Train raises it
                raise WorkerGroupError(f"the elastic run {name} failed: {exc}", {}) from exc
        records = ray.get(reports.since.remote(0))
        _wait_tune(callbacks)
    finally:
        executor.shutdown()
        for actor in actors:
            ray.kill(actor, no_restart=True)
    return _result(records, paths, results[0] if results else None)


def _run_reporting(executor: RayExecutor, train_fn: Any, run: RunInfo,
                   framework: str | None, hand_over: Any) -> list[Any]:
    """`executor.run` on a thread while this one hands new reports to the callbacks."""
    out: dict[str, Any] = {}

    def target() -> None:
        _lower_priority()
        try:
            out["results"] = executor.run(_worker, args=(train_fn, run, framework))
        except BaseException as exc:  # noqa: BLE001 - raised on the caller's thread
            out["error"] = exc

    thread = threading.Thread(target=target, name="raytrain-x elastic fit", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(REPORT_POLL_S)
        hand_over()
    if "error" in out:
        raise out["error"]
    return out["results"]


def _lower_priority() -> None:
    """Gives this thread (Linux: a thread has its own niceness) the niceness of Ray's
    workers; where that cannot be done, the thread keeps its priority."""
    try:
        now = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        if now < DRIVER_LOOP_NICENESS:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), DRIVER_LOOP_NICENESS)
    except (AttributeError, OSError):  # not Linux, or not allowed
        pass


def _wait_tune(callbacks: list[Any]) -> None:
    """Returns once each `TuneReportCallback` among `callbacks` has had its reports taken by
    the Tune trial (the trial reports its end as soon as `fit()` returns)."""
    for callback in callbacks:
        queue = internals.tune_report_queue(callback)
        if queue is not None and not internals.wait_tune_took_reports(queue,
                                                                      TUNE_HAND_OVER_S):
            log.warning("raytrain-x: Ray Tune took no report from TuneReportCallback for "
                        "%.0fs; the trial may end without the run's last report",
                        TUNE_HAND_OVER_S)


def _result(records: list[dict[str, Any]], run: RunInfo, value: Any) -> Result:
    """Ray Train's `Result` of the run's reports."""
    kept = [r for r in records if r["checkpoint"]]
    latest = kept[-1] if kept else None
    return Result(
        metrics=records[-1]["metrics"] if records else None,
        checkpoint=run.checkpoint(latest["checkpoint"]) if latest else None,
        error=None, path=storage_uri(run.storage_path, run.name),
        metrics_dataframe=pd.DataFrame([r["metrics"] for r in records]),
        best_checkpoints=[(run.checkpoint(r["checkpoint"]), r["metrics"]) for r in kept],
        return_value=value)
