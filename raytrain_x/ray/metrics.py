"""The job's metrics, through Ray's own metrics API (`ray.util.metrics`), where a Ray
cluster's operators already look: the Ray dashboard's metrics view and Grafana over
Prometheus (docs/metrics.md).

- Each worker exports its rank's steps and step times, its engine's counters and, on
  rank 0 while tuning, autotune's samples (`WorkerExporter`, a thread in the worker
  actor that reads `core.status` every `RAYTRAIN_X_METRICS_INTERVAL_S`: nothing is added
  to a training step but counting it).
- The driver exports the world size and, for elastic jobs, every event of the job's
  event log: rounds and why they formed, resets, failures by cause, drains, hosts on
  the blacklist and how long each recovery took (`DriverMetrics`).

`METRICS` is the one list of what is exported: the metrics are made from it, the Grafana
dashboard (`raytrain_x/ray/grafana.py`) is built from it and docs/metrics.md lists it.
Ray's exporter adds `ray_` in front of every name, and `_total` after a counter's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from raytrain_x.autotune.sampler import Phase
from raytrain_x.common import settings
from raytrain_x.common.periodic import Every
from raytrain_x.common.process import PROCESS
from raytrain_x.ray.job_progress import recent_rate

log = logging.getLogger("raytrain_x.metrics")

PREFIX = "raytrain_x_"
RANK_TAGS = ("job", "rank", "host")
JOB_TAGS = ("job",)
STEP_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
RECOVERY_BUCKETS = (0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)


@dataclass(frozen=True)
class Spec:
    """One exported metric: `kind` is counter, gauge or histogram; `name` without the
    prefix."""

    name: str
    kind: str
    doc: str
    tags: tuple[str, ...] = RANK_TAGS
    buckets: tuple[float, ...] = ()
    group: str = "training"  # the dashboard's row


METRICS: tuple[Spec, ...] = (
    # training, per rank
    Spec("steps", "counter", "training steps taken (DistributedOptimizer.step or mark_step)"),
    Spec("step_seconds", "histogram", "seconds between consecutive training steps",
         buckets=STEP_BUCKETS),
    Spec("steps_per_second", "gauge", "training steps per second over the last interval"),
    Spec("samples_per_second", "gauge",
         "samples per second over the last interval (where the job gave its batch size "
         "through autotune_batch_size)"),
    # engine, per rank
    Spec("collective_bytes", "counter", "bytes through collectives, by kind "
         "(allreduce, allgather, broadcast, ...)", (*RANK_TAGS, "kind"), group="engine"),
    Spec("collective_seconds", "counter", "seconds spent running collectives, by kind",
         (*RANK_TAGS, "kind"), group="engine"),
    Spec("engine_cycles", "counter", "engine cycles (each looks for ready tensors)",
         group="engine"),
    Spec("engine_active_cycles", "counter", "engine cycles that ran a collective",
         group="engine"),
    Spec("negotiations", "counter", "cycles that exchanged reports among the ranks (a round "
         "trip that response-cache hits and speculation avoid)", group="engine"),
    Spec("cache_hits", "counter", "collectives agreed from the response cache, with no "
         "report", group="engine"),
    Spec("speculated_cycles", "counter", "cycles whose batch went with its readiness count "
         "alone", group="engine"),
    Spec("fused_batches", "counter", "allreduce batches of several tensors", group="engine"),
    Spec("fused_tensors", "counter", "tensors in those batches (divided by fused_batches: "
         "the mean batch)", group="engine"),
    Spec("stalls", "counter", "stall warnings: a tensor some rank had not submitted for "
         "RAYTRAIN_X_STALL_CHECK_TIME_SECONDS", group="engine"),
    # autotune, rank 0
    Spec("autotune_samples", "counter", "autotune samples scored (warm-up ones included)",
         JOB_TAGS, group="autotune"),
    Spec("autotune_sample_score", "gauge", "each sample's score (steps/s, samples/s or "
         "bytes/s), by sample number", (*JOB_TAGS, "sample"), group="autotune"),
    Spec("autotune_best_score", "gauge", "the best score so far", JOB_TAGS, group="autotune"),
    Spec("autotune_knob", "gauge", "the knobs in effect, by name (booleans as 0/1)",
         (*JOB_TAGS, "knob"), group="autotune"),
    Spec("autotune_phase", "gauge", "1 for autotune's current phase, 0 for the others",
         (*JOB_TAGS, "phase"), group="autotune"),
    # durable checkpoints, from the workers
    Spec("checkpoints_written", "counter", "durable checkpoints completed (by the rank that "
         "writes the manifest)", RANK_TAGS, group="checkpoints"),
    Spec("checkpoint_failures", "counter", "durable checkpoint writes that failed or were "
         "given up (training went on)", RANK_TAGS, group="checkpoints"),
    Spec("checkpoint_restores", "counter", "restores from a durable checkpoint (no worker "
         "held the state in memory)", RANK_TAGS, group="checkpoints"),
    Spec("checkpoint_seconds", "histogram", "seconds each checkpoint's write or restore "
         "took, by what", (*RANK_TAGS, "what"), RECOVERY_BUCKETS, group="checkpoints"),
    Spec("checkpoint_commit", "gauge", "the commit number of the last checkpoint written, "
         "or restored, by what", (*RANK_TAGS, "what"), group="checkpoints"),
    # the job, from the driver
    Spec("world_size", "gauge", "workers in the job's current round", JOB_TAGS,
         group="elastic"),
    Spec("rounds", "counter", "rounds formed, by why (start, scale_up, failure, drain, "
         "restore; joined by + when one round had several)",
         (*JOB_TAGS, "reason"), group="elastic"),
    Spec("resets", "counter", "rounds that count against the reset limit", JOB_TAGS,
         group="elastic"),
    Spec("worker_failures", "counter", "workers failed, by cause (process_lost: killed or "
         "cut off; error: its function raised; lost_peer: only a peer failed)",
         (*JOB_TAGS, "cause"), group="elastic"),
    Spec("elastic_events", "counter", "every event of the elastic job's log, by kind "
         "(place, start, gave_up, failure, left, drain, ...)", (*JOB_TAGS, "kind"),
         group="elastic"),
    Spec("blacklisted_hosts", "gauge", "hosts on the blacklist now", JOB_TAGS,
         group="elastic"),
    Spec("recovery_seconds", "histogram", "seconds from a failure to the next round formed",
         JOB_TAGS, RECOVERY_BUCKETS, group="elastic"),
)
BY_NAME = {spec.name: spec for spec in METRICS}
_ENGINE_COUNTERS = {"cycles": "engine_cycles", "active_cycles": "engine_active_cycles",
                    "negotiations": "negotiations", "cache_hits": "cache_hits",
                    "speculated": "speculated_cycles", "fused": "fused_batches",
                    "fused_tensors": "fused_tensors", "stalls": "stalls"}
PHASES = tuple(phase.value for phase in Phase)  # autotune_phase's `phase` tag


class Recorder(Protocol):
    """Where values go: Ray's metrics (`RayRecorder`), or a list in tests."""

    def record(self, name: str, value: float, tags: dict[str, str]) -> None: ...


class RayRecorder:
    """Records into `ray.util.metrics`, each metric made once per process on first use.
    A counter takes increments, a gauge values, a histogram observations."""

    _made: dict[str, Any] = {}
    _lock = threading.Lock()

    def record(self, name: str, value: float, tags: dict[str, str]) -> None:
        metric = self._metric(name)
        spec = BY_NAME[name]
        if spec.kind == "counter":
            if value > 0:
                metric.inc(value, tags)
        elif spec.kind == "gauge":
            metric.set(value, tags)
        else:
            metric.observe(value, tags)

    def _metric(self, name: str) -> Any:
        with self._lock:
            made = self._made.get(name)
            if made is None:
                from ray.util import metrics

                spec = BY_NAME[name]
                full = PREFIX + name
                if spec.kind == "counter":
                    made = metrics.Counter(full, spec.doc, spec.tags)
                elif spec.kind == "gauge":
                    made = metrics.Gauge(full, spec.doc, spec.tags)
                else:
                    made = metrics.Histogram(full, spec.doc, list(spec.buckets), spec.tags)
                self._made[name] = made
            return made


def enabled() -> bool:
    return settings.METRICS.read()


# ---------------------------------------------------------------- the workers
class WorkerExporter:
    """Turns a rank's successive status snapshots (`core.status.snapshot`) into metric
    records: counters by their growth since the last snapshot, gauges as they are, each new
    step's duration into the histogram.

    Args:
        job: the job's name (the `job` tag).
        host: this worker's node (the `host` tag).
        recorder: where the records go.
    """

    def __init__(self, job: str, host: str, recorder: Recorder) -> None:
        self.job, self.host, self.recorder = job, host, recorder
        self._last: dict[str, Any] | None = None
        self._counted = 0  # autotune samples recorded
        self._rank = ""  # the rank it had last: between two rounds it has none

    def export(self, snap: dict[str, Any]) -> None:
        last = self._last or {"steps": 0, "time": snap["time"], "engine": None,
                              "autotune": None}
        if snap.get("rank") is not None:
            self._rank = str(snap["rank"])
        tags = {"job": self.job, "rank": self._rank, "host": self.host}
        self._training(snap, last, tags)
        if snap.get("engine") is not None:
            self._engine(snap["engine"], last.get("engine"), tags)
        if snap.get("autotune") is not None:
            self._autotune(snap["autotune"])
        if snap.get("checkpoints") is not None:
            self._checkpoints(snap["checkpoints"], last.get("checkpoints"), tags)
        self._last = snap

    def _checkpoints(self, now: dict[str, Any], last: dict[str, Any] | None,
                     tags: dict[str, str]) -> None:
        record = self.recorder.record
        last = last or {}
        for name, key in (("checkpoints_written", "written_count"),
                          ("checkpoint_failures", "failed_count"),
                          ("checkpoint_restores", "restored_count")):
            record(name, max(0, now[key] - last.get(key, 0)), tags)
        for what in ("written", "restored"):
            if now[f"{what}_count"]:
                what_tags = {**tags, "what": what}
                if now[f"{what}_count"] > last.get(f"{what}_count", 0):  # a new one: its time
                    seconds = now["last_write_s" if what == "written" else "last_restore_s"]
                    record("checkpoint_seconds", seconds, what_tags)
                record("checkpoint_commit", now[f"last_{what}"], what_tags)

    def _training(self, snap: dict[str, Any], last: dict[str, Any],
                  tags: dict[str, str]) -> None:
        record = self.recorder.record
        steps = max(0, snap["steps"] - last["steps"])
        record("steps", steps, tags)
        durations = snap.get("step_seconds") or []
        for seconds in durations[len(durations) - min(steps, len(durations)):]:
            record("step_seconds", seconds, tags)
        elapsed = snap["time"] - last["time"]
        if self._last is not None and elapsed > 0:
            rate = steps / elapsed
        else:  # the first export: the latest steps' rate
            rate = recent_rate(durations)
        if rate is not None:
            record("steps_per_second", rate, tags)
            if snap.get("batch_size"):
                record("samples_per_second", rate * snap["batch_size"], tags)

    def _engine(self, now: dict[str, Any], before: dict[str, Any] | None,
                tags: dict[str, str]) -> None:
        if before is None or now["cycles"] < before["cycles"]:
            before = None  # a new engine (an elastic reset): its counters start at 0
        record = self.recorder.record
        for field, name in _ENGINE_COUNTERS.items():
            record(name, now[field] - (before[field] if before else 0), tags)
        for key, name in (("bytes", "collective_bytes"), ("seconds", "collective_seconds")):
            for kind, value in now[key].items():
                earlier = before[key].get(kind, 0) if before else 0
                record(name, value - earlier, {**tags, "kind": kind})

    def _autotune(self, state: dict[str, Any]) -> None:
        record = self.recorder.record
        job = {"job": self.job}
        record("autotune_samples", len(state["samples"]) - self._counted, job)
        self._counted = len(state["samples"])
        # the gauges every time: Ray drops a gauge not set for two report intervals
        for sample in state["samples"]:
            record("autotune_sample_score", sample["score"],
                   {**job, "sample": str(sample["index"])})
        if state["best_score"] is not None:
            record("autotune_best_score", state["best_score"], job)
        for knob, value in state["knobs"].items():
            if isinstance(value, (bool, int, float)):
                record("autotune_knob", float(value), {**job, "knob": knob})
        for phase in PHASES:
            record("autotune_phase", float(phase == state["phase"]), {**job, "phase": phase})


class ExportThread:
    """Calls `read()` every `interval_s` and exports what it returns (None: nothing yet),
    on a daemon thread; `stop()` exports once more. A failure to export is logged once and
    never reaches the job."""

    def __init__(self, read: Callable[[], dict[str, Any] | None], exporter: WorkerExporter,
                 interval_s: float) -> None:
        self.read, self.exporter = read, exporter
        self._export = safe(self._read_and_export)
        self._lock = threading.Lock()
        self.exports, self.busy_s = 0, 0.0  # what exporting has cost (benchmarks read it)
        self._exported_a_step = False
        # quick until a step's time is exported, so a job's series appear with its start
        self._every = Every(interval_s, self.once, "raytrain-x-metrics",
                            settled=lambda: self._exported_a_step)

    def start(self) -> ExportThread:
        self._every.start()
        return self

    def stop(self) -> None:
        self._every.stop()
        self.once()

    def once(self) -> None:
        with self._lock:
            start = time.perf_counter()
            self._export()
            self.exports += 1
            self.busy_s += time.perf_counter() - start

    def _read_and_export(self) -> None:
        snap = self.read()
        if snap is not None:
            self.exporter.export(snap)
            # a step's duration, not only its count: exported at the first step alone, the
            # step-time series and the rate would wait a whole interval
            self._exported_a_step = bool(snap.get("step_seconds"))


def export_this_process(read: Callable[[], dict[str, Any] | None], job: str,
                        host: str) -> ExportThread | None:
    """Starts exporting this worker process's metrics (`read` gives its status), once per
    process; None where metrics are turned off."""
    with PROCESS.lock:
        if PROCESS.metrics_export is None and enabled():
            PROCESS.metrics_export = ExportThread(
                read, WorkerExporter(job, host, RayRecorder()),
                settings.METRICS_INTERVAL_S.read()).start()
        return PROCESS.metrics_export


def rank_status() -> dict[str, Any] | None:
    """This process's status once it has joined a world or taken a step, else None."""
    from raytrain_x.core import status

    snap = status.snapshot()
    return snap if snap["rank"] is not None or snap["steps"] else None


# ---------------------------------------------------------------- the driver
# how often the driver sets its gauges again at the longest: under Ray's report interval
# (`metrics_report_interval_ms`, 10 s by default), two of which drop a gauge not set
GAUGE_REFRESH_S = 5.0


class DriverMetrics:
    """The job's view from the driver: its world size and, as an elastic job's event log
    listener (`on_event`), its rounds, resets, failures, drains, blacklist and recoveries.

    Args:
        job: the job's name (the `job` tag).
        recorder: where the records go.
        blacklisted: how many hosts the blacklist holds now (elastic jobs).
    """

    def __init__(self, job: str, recorder: Recorder,
                 blacklisted: Callable[[], int] | None = None) -> None:
        self.job, self.recorder, self.blacklisted = job, recorder, blacklisted
        self._failed_at: float | None = None  # the first failure since the last round
        self._gauges: dict[str, float] = {}
        self._every: Every | None = None

    def start(self, interval_s: float) -> DriverMetrics:
        """Sets the job's gauges again every `interval_s` (at most `GAUGE_REFRESH_S`) until
        `close()`: Ray's agent drops a gauge that was not set for two of its report
        intervals, whatever the job's own export interval."""
        record = safe(self.recorder.record)

        def refresh() -> None:
            for name, value in list(self._gauges.items()):
                record(name, value, {"job": self.job})

        self._every = Every(min(interval_s, GAUGE_REFRESH_S), refresh,
                            "raytrain-x-job-metrics").start()
        return self

    def close(self) -> None:
        """Stops setting the gauges (the job is over: Ray lets them go)."""
        if self._every is not None:
            self._every.stop()

    def _gauge(self, name: str, value: float) -> None:
        self._gauges[name] = value
        self.recorder.record(name, value, {"job": self.job})

    def world_size(self, size: int) -> None:
        self._gauge("world_size", size)

    def on_event(self, event: Any) -> None:
        """One event of the elastic job's log (`events.Event`)."""
        record, job = self.recorder.record, {"job": self.job}
        record("elastic_events", 1, {**job, "kind": event.kind})
        detail = event.detail
        if event.kind == "failure":
            record("worker_failures", 1, {**job, "cause": detail.get("cause", "error")})
            if self._failed_at is None:
                self._failed_at = event.time
        elif event.kind == "round":
            self.world_size(detail["size"])
            record("rounds", 1, {**job, "reason": detail["reason"]})
            if detail.get("reset"):
                record("resets", 1, job)
            if self._failed_at is not None:
                record("recovery_seconds", event.time - self._failed_at, job)
                self._failed_at = None
        if self.blacklisted is not None:
            self._gauge("blacklisted_hosts", self.blacklisted())


def safe(fn: Callable[..., None]) -> Callable[..., None]:
    """`fn` such that a failure to record is logged once and never stops the job."""
    warned = []

    def call(*args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - metrics must not stop a job
            if not warned:
                log.warning("raytrain-x metrics: could not record (%r); going on", exc)
                warned.append(exc)

    return call
