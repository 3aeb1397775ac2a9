"""`DistributedTrainableCreator`: every Ray Tune trial is a raytrain-x distributed job.

The trial's resources are one placement group: a bundle for the trial driver and one per
worker, so Tune schedules whole distributed jobs. Rank 0's `report` calls travel to the
trial driver through a Ray queue and reach Tune there; checkpoints travel as bytes, so
workers and the driver need not share a disk.
"""

from __future__ import annotations

import io
import os
import resource
import sys
import tarfile
import tempfile
from collections.abc import Callable
from typing import Any

import ray
from ray import tune

from raytrain_x.common.errors import ConfigError
from raytrain_x.common.knobs import Knobs
from raytrain_x.common.process import PROCESS
from raytrain_x.common.settings import TIMEOUT_S

PEAK_MEMORY = "peak_memory_mb"  # added to every report that does not give its own


def peak_memory_mb() -> float:
    """This process's peak memory so far: the CUDA allocator's peak where CUDA is in use,
    else the peak resident memory."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def over_memory(peak_mb: float | None, max_mb: float | None) -> str | None:
    """Why an experiment whose peak memory is `peak_mb` fails a cap of `max_mb` (None: it
    fits, or either is unknown)."""
    if max_mb is None or peak_mb is None or not peak_mb > max_mb:
        return None
    return f"peak memory {peak_mb:.0f} MB over max_memory_per_worker {max_mb:g} MB"


def _pack_dir(path: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        tar.add(path, arcname=".")
    return buf.getvalue()


def _unpack_dir(data: bytes) -> str:
    target = tempfile.mkdtemp(prefix="raytrain_x_ckpt_")
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        tar.extractall(target, filter="data")
    return target


def report(metrics: dict[str, Any], checkpoint: str | tune.Checkpoint | None = None) -> None:
    """Reports metrics (and optionally a checkpoint directory) to Ray Tune.

    Call it on every rank: rank 0's calls reach Tune, the other ranks' calls are accepted
    and ignored, so the training function needs no `if rank == 0`. Each report also
    carries rank 0's `peak_memory_mb` (the CUDA allocator's peak where CUDA is in use, else
    the peak resident memory) unless `metrics` gives its own.

    Args:
        metrics: a dict of numbers (and strings).
        checkpoint: a directory path or a `ray.tune.Checkpoint` to save with this report.
    """
    if not isinstance(metrics, dict):
        raise ConfigError(f"report needs a dict of metrics, got {type(metrics).__name__}")
    queue = PROCESS.tune_session.get("queue")
    if queue is None:
        raise ConfigError("raytrain_x.autotune.report is only available inside a "
                          "function run by DistributedTrainableCreator or autotune_experiments")
    if PROCESS.tune_session.get("rank") != 0:
        return
    data = None
    if checkpoint is not None:
        path = checkpoint.to_directory() if isinstance(checkpoint, tune.Checkpoint) \
            else str(checkpoint)
        if not os.path.isdir(path):
            raise ConfigError(f"checkpoint {path!r} is not a directory")
        data = _pack_dir(path)
    queue.put(({PEAK_MEMORY: peak_memory_mb(), **metrics}, data))


def get_checkpoint() -> str | None:
    """The directory of the checkpoint this trial resumes from (on every rank), or None."""
    data = PROCESS.tune_session.get("checkpoint")
    if data is None:
        return None
    if "checkpoint_dir" not in PROCESS.tune_session:
        PROCESS.tune_session["checkpoint_dir"] = _unpack_dir(data)
    return PROCESS.tune_session["checkpoint_dir"]


def _worker_entry(train_fn: Callable[[dict], Any], config: dict, queue: Any,
                  checkpoint: bytes | None) -> Any:
    from raytrain_x import core  # runs inside the worker; no framework needed here

    core.init()
    PROCESS.tune_session.update(queue=queue, rank=core.rank(), checkpoint=checkpoint)
    try:
        return train_fn(config)
    finally:
        PROCESS.tune_session.clear()


def _pump(queue: Any) -> None:
    """Hands rank 0's queued reports to Tune, in order."""
    while not queue.empty():
        metrics, data = queue.get()
        if data is None:
            tune.report(metrics)
            continue
        directory = _unpack_dir(data)
        tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(directory))


def DistributedTrainableCreator(  # noqa: N802 - Horovod's name
    train_fn: Callable[[dict], Any],
    num_workers: int = 2,
    num_hosts: int | None = None,
    num_workers_per_host: int | None = None,
    cpus_per_worker: float = 1,
    use_gpu: bool = False,
    timeout_s: float = TIMEOUT_S.default,
) -> Any:
    """A Ray Tune trainable that runs `train_fn(config)` on a distributed raytrain-x job.

    Args:
        train_fn: runs on every worker with `raytrain_x.torch` initialised; reports with
            `raytrain_x.autotune.report` and resumes from `get_checkpoint()`.
        num_workers: workers per trial (or `num_hosts` x `num_workers_per_host`).
        cpus_per_worker: CPUs each worker asks Ray for.
        use_gpu: whether each worker asks for a GPU.
        timeout_s: collective/rendezvous timeout of each trial's job.

    Returns:
        A trainable for `tune.Tuner`. A trial's `config["raytrain_x"]` (a dict of knobs)
        sets the communication knobs of its job, so Tune can search knobs across trials.
    """
    from raytrain_x.ray import RayExecutor  # the ray layer; imported lazily

    if not callable(train_fn):
        raise ConfigError(f"train_fn must be callable, got {type(train_fn).__name__}")
    if num_hosts is not None:
        per_host = num_workers_per_host or 1
        world = num_hosts * per_host
    else:
        if num_workers < 1:
            raise ConfigError(f"num_workers must be >= 1, got {num_workers}")
        world = num_workers
    worker_bundle = {"CPU": cpus_per_worker, **({"GPU": 1} if use_gpu else {})}
    # the trial driver only waits on its workers: no CPU of its own (an empty head bundle),
    # so a 2-worker trial fits a 2-CPU machine
    resources = tune.PlacementGroupFactory([{}] + [worker_bundle] * world)

    def trainable(config: dict) -> None:
        knobs = None
        if "raytrain_x" in config:
            knobs = Knobs().replace(**dict(config["raytrain_x"]))
        resume = tune.get_checkpoint()
        data = _pack_dir(resume.to_directory()) if resume is not None else None
        from ray.util.queue import Queue

        queue = Queue(actor_options={"num_cpus": 0})
        executor = RayExecutor(RayExecutor.create_settings(timeout_s=timeout_s),
                               num_workers=None if num_hosts else num_workers,
                               num_hosts=num_hosts,
                               num_workers_per_host=num_workers_per_host or 1,
                               cpus_per_worker=cpus_per_worker, use_gpu=use_gpu, knobs=knobs)
        executor.start()
        try:
            refs = executor.run_remote(_worker_entry, args=(train_fn, config, queue, data))
            pending = list(refs)
            while pending:
                _, pending = ray.wait(pending, num_returns=len(pending), timeout=0.1)
                _pump(queue)
            _pump(queue)
            executor.collect(refs)  # raises WorkerError naming the failing rank
        finally:
            executor.shutdown()
            ray.kill(queue.actor, no_restart=True)

    trainable.__name__ = getattr(train_fn, "__name__", "raytrain_x_trainable")
    return tune.with_resources(trainable, resources)
