"""What this rank has done so far, as plain numbers: its steps and their durations, its
engine's counters and, on rank 0 while tuning, autotune's state. Ray-free: the Ray
workers export it as metrics (`raytrain_x.ray.metrics`), `raytrain-x run` prints a
progress line from it, and a process `raytrain-x run` launched writes it to a file its
worker actor reads (`StatusFileWriter`).

Everything is cumulative since the process started; readers keep their own last reading
and take differences, so any number of them can read without disturbing each other.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import time
from typing import Any

from raytrain_x.common import settings
from raytrain_x.common.periodic import Every
from raytrain_x.common.process import PROCESS
from raytrain_x.core import runtime


def engine_counters() -> dict[str, Any] | None:
    """The engine's counters (`EngineStats`) as a dict; None before `init()`."""
    if not runtime.is_initialized():
        return None
    return dataclasses.asdict(runtime.engine_stats())  # its dicts copied too


def autotune_state() -> dict[str, Any] | None:
    """Rank 0's autotune while it is configured: the phase, the samples scored so far (each
    as sample number, score and the knobs it ran with), the best so far and the knobs in
    effect; None elsewhere. The samples are this process's, numbered on across elastic
    resets (each starts a new sampler)."""
    sampler = runtime.latest_autotune_sampler()
    if sampler is None:
        return None
    samples = [{"index": i, "score": s.score, "warmup": s.warmup, "knobs": s.knobs.to_dict()}
               for i, s in enumerate(runtime.autotune_samples())]
    best, knobs = sampler.best, runtime.last_knobs()  # a failed engine's knobs too
    return {"phase": sampler.phase.value, "unit": sampler.unit, "samples": samples,
            "best_score": None if best is None else best.score,
            "knobs": knobs.to_dict() if knobs is not None else {}}


def snapshot() -> dict[str, Any]:
    """This rank now: `time` (wall clock), `steps`, `step_seconds` (the latest steps'
    durations, the last ending at `steps`), `rank`/`size`/`round` (None before
    `init()`), `batch_size` (per rank, where the job told autotune), `engine` and
    `autotune` (None where there are none), `checkpoints` (`CheckpointCounters`: this
    rank's durable checkpoints, `PROCESS.checkpoints`)."""
    clock = runtime.step_clock()
    world = {"rank": None, "size": None, "round": None}
    if runtime.is_initialized():
        rdv = runtime.rendezvous()
        world = {"rank": rdv.rank, "size": rdv.size, "round": rdv.round}
    return {"time": time.time(), "steps": clock.steps, "step_seconds": clock.recent(),
            **world, "batch_size": runtime.batch_size(), "engine": engine_counters(),
            "autotune": autotune_state(),
            "checkpoints": dataclasses.asdict(PROCESS.checkpoints)}


class StatusFileWriter:
    """Writes `snapshot()` to `path` every `interval_s` on a daemon thread (replaced whole,
    so a reader never sees half of it). A process `raytrain-x run` launched has no Ray of
    its own: its worker actor reads the file (`RAYTRAIN_X_STATUS_FILE`)."""

    def __init__(self, path: str, interval_s: float) -> None:
        self.path = path
        self._wrote_a_step = False
        # quick until the first step is written: the metrics and the progress line show it
        self._every = Every(interval_s, self.write, "raytrain-x-status",
                            settled=lambda: self._wrote_a_step)

    def start(self) -> StatusFileWriter:
        self._every.start()
        return self

    def stop(self) -> None:
        self._every.stop()
        self.write()

    def write(self) -> None:
        tmp = f"{self.path}.{os.getpid()}.tmp"
        try:
            snap = snapshot()
            with open(tmp, "w") as f:
                json.dump(snap, f)
            os.replace(tmp, self.path)
            self._wrote_a_step = snap["steps"] > 0
        except (OSError, TypeError, ValueError):  # a status file is no reason to fail a job
            pass


def start_status_file() -> None:
    """In a process `raytrain-x run` launched (`RAYTRAIN_X_STATUS_FILE` set): starts writing
    its status there, once per process, and a last time at exit."""
    path = settings.STATUS_FILE.read()
    if not path or PROCESS.status_writer is not None:
        return
    writer = PROCESS.status_writer = StatusFileWriter(path,
                                                       settings.METRICS_INTERVAL_S.read())
    writer.start()
    atexit.register(writer.stop)


def read_status_file(path: str) -> dict[str, Any] | None:
    """The latest snapshot a launched process wrote; None before its first."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
