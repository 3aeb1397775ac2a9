"""Every environment variable raytrain-x reads, once: its type, range, default and meaning,
the `raytrain-x run` flag and the config-file key that set it too, and Horovod's name for it.

Three kinds, by who sets them:

- `USER`: what people set to change how a job runs (the knobs of
  `raytrain_x.common.knobs`, autotune's options, timeouts, the timeline, metrics);
- `LAUNCHER`: the rendezvous a launcher hands each process (`RayExecutor` and `raytrain-x
  run` set them; a launcher of one's own sets them as torchrun sets `RANK`);
- `INTERNAL`: what raytrain-x hands its own processes (a job's checkpoint config, its
  name, the training settings of a config file); documented, never needed by hand.

A module that needs a value reads it here (`TIMEOUT_S.read()`): the value is parsed and
checked in `Setting.read` alone, a bad one is a `ConfigError` naming the variable and what
it takes. The CLI builds its flags from `flagged()`, docs/api.md's table is `table()`
(a test holds them equal). Fixed intervals that no user should need are constants below.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from raytrain_x.common.errors import ConfigError

USER, LAUNCHER, INTERNAL = "user", "launcher", "internal"
MB = 1024 * 1024

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def check_seconds(what: str, value: Any, minimum: float = 0.0, zero: str | None = None,
                  ) -> float:
    """`value` as a number of seconds: finite and above `minimum` (at least it, where
    `minimum` > 0), or 0 where `zero` says what 0 means. Else a one-line `ConfigError`
    naming `what` and the range."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{what} must be a number of seconds, got {value!r}")
    value = float(value)
    if value == 0 and zero is not None:
        return value
    ok = math.isfinite(value) and (value >= minimum if minimum > 0 else value > 0)
    if not ok:
        bound = f"at least {minimum:g}" if minimum > 0 else "above 0"
        also = f" (or 0: {zero})" if zero is not None else ""
        raise ConfigError(f"{what} must be a finite number of seconds {bound}{also}, got "
                          f"{value!r}")
    return value


@dataclass(frozen=True)
class Setting:
    """One environment variable.

    `kind` is bool, int, float or str. A float with `seconds` is a number of seconds above
    0 (at least `minimum` where that is above 0; 0 too where `zero` says what 0 means);
    other numbers lie in [`minimum`, `maximum`]. `flag` and `flag_scale`: the `raytrain-x
    run` flag and the unit it takes (MB for bytes); `config_key`: the key of a config file
    (`RAYTRAIN_X_CONFIG_FILE`) that sets it too; `horovod`: Horovod's variable, read where
    ours is unset."""

    env: str
    default: Any
    kind: type
    doc: str
    scope: str = USER
    minimum: float | None = None
    maximum: float | None = None
    seconds: bool = False
    zero: str | None = None
    choices: tuple[str, ...] = ()
    flag: str | None = None
    flag_scale: int = 1
    config_key: str | None = None
    horovod: str | None = None

    def raw(self, env: Mapping[str, str] | None = None) -> str | None:
        """The variable's text in `env` (default: the process's environment), Horovod's
        where ours is unset; None where neither is set."""
        env = os.environ if env is None else env
        for name in (self.env, self.horovod):
            if name and (env.get(name) or "").strip():
                return env[name]
        return None

    def read(self, env: Mapping[str, str] | None = None) -> Any:
        """The value in `env` (default: the process's environment), else the default."""
        raw = self.raw(env)
        return self.default if raw is None else self.parse(raw, f"environment {self.env}")

    def parse(self, raw: Any, source: str) -> Any:
        """`raw` (text or a plain value) as this setting takes it, checked; `source` names
        where it came from in the error."""
        if self.kind is bool:
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text in _TRUE or text in _FALSE:
                return text in _TRUE
            raise ConfigError(f"{source}={raw!r} is not a boolean: use 1/0 or true/false")
        if self.kind is str:
            text = str(raw)
            if self.choices and text not in self.choices:
                raise ConfigError(f"{source}={raw!r} is not one of {', '.join(self.choices)}")
            return text
        try:
            value = float(raw)
        except (TypeError, ValueError):
            raise ConfigError(f"{source}={raw!r} is not a number") from None
        if self.seconds:
            try:
                return check_seconds(source, value, self.minimum or 0.0, self.zero)
            except ConfigError as exc:
                raise ConfigError(f"{exc}; unset it for the default "
                                  f"{self.default:g}") from None
        low = -math.inf if self.minimum is None else self.minimum
        high = math.inf if self.maximum is None else self.maximum
        if math.isfinite(value) and self.kind is int and value != int(value):
            raise ConfigError(f"{source}={raw!r} is not a whole number")
        if not (math.isfinite(value) and low <= value <= high):
            raise ConfigError(f"{source}={raw!r} is out of range: {self.range()}")
        return self.kind(value)

    def parse_scaled(self, raw: Any, source: str) -> Any:
        """`raw` in the unit of the setting's flag and config alias (`flag_scale` of its
        own: MB for bytes), as `parse` takes it in its own unit."""
        if self.flag_scale == 1 or self.kind is bool:
            return self.parse(raw, source)
        try:
            value = float(raw)
        except (TypeError, ValueError):
            raise ConfigError(f"{source}={raw!r} is not a number") from None
        scaled = value * self.flag_scale
        if self.kind is int and math.isfinite(scaled):
            scaled = round(scaled)  # a fraction of a MB is a whole number of bytes
        try:
            return self.parse(scaled, source)
        except ConfigError:
            low, high = (None if x is None else f"{x / self.flag_scale:g}"
                         for x in (self.minimum, self.maximum))
            raise ConfigError(f"{source}={raw!r} is out of range: {low} to {high} (MB)") from None

    def range(self) -> str:
        """What the setting takes, in words (docs/api.md's table)."""
        if self.kind is bool:
            return "0 or 1"
        if self.choices:
            return " or ".join(self.choices)
        if self.kind is str:
            return "a path"
        if self.seconds:
            bound = f"at least {self.minimum:g}" if self.minimum else "above 0"
            return f"seconds, {bound}" + (f"; 0: {self.zero}" if self.zero else "")
        low, high = (None if x is None else _number(x, self.kind)
                     for x in (self.minimum, self.maximum))
        if low is not None and high is not None:
            return f"{low} to {high}"
        return f"at least {low}" if low is not None else "a number"

    def shown_default(self) -> str:
        """The default as the docs show it."""
        if isinstance(self.default, bool):
            return "1" if self.default else "0"
        if isinstance(self.default, (int, float)):
            return _number(self.default, self.kind)
        return str(self.default) if self.default not in (None, "") else "none"


def _number(value: float, kind: type) -> str:
    """A number as the docs show it: whole numbers whole, others as short as they go."""
    return str(int(value)) if kind is int else f"{value:g}"


# ----------------------------------------------------------------------------- user
TIMEOUT_S = Setting(
    "RAYTRAIN_X_TIMEOUT", 30.0, float,
    "seconds a rank waits for its peers at a rendezvous or in a collective before it "
    "reports them lost (the store's timeout too)", seconds=True, flag="--timeout")
START_TIMEOUT_S = Setting(
    "RAYTRAIN_X_START_TIMEOUT", 300.0, float,
    "seconds an elastic worker may take to start (process, imports, runtime_env, image "
    "pull) before it is given up on", seconds=True, flag="--start-timeout")
SHM = Setting(
    "RAYTRAIN_X_SHM", True, bool,
    "ranks on one host reduce through shared memory; 0 keeps world allreduces on gloo")
STALL_WARNING_S = Setting(
    "RAYTRAIN_X_STALL_CHECK_TIME_SECONDS", 60.0, float,
    "seconds a collective may wait for a rank before a warning names it", seconds=True,
    minimum=1.0, zero="no stall check (horovodrun's --no-stall-check)",
    horovod="HOROVOD_STALL_CHECK_TIME_SECONDS", flag="--stall-check-warning-time-seconds")
STALL_SHUTDOWN_S = Setting(
    "RAYTRAIN_X_STALL_SHUTDOWN_TIME_SECONDS", 0.0, float,
    "seconds of such a stall before the job stops", seconds=True, minimum=1.0,
    zero="never", horovod="HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",
    flag="--stall-check-shutdown-time-seconds")
LOG_LEVEL = Setting(
    "RAYTRAIN_X_LOG_LEVEL", "", str,
    "the level of raytrain-x's log in every process (empty: Python's default, WARNING)",
    choices=("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL"),
    horovod="HOROVOD_LOG_LEVEL", flag="--log-level")
TIMELINE = Setting(
    "RAYTRAIN_X_TIMELINE", "", str,
    "a path: rank 0 writes a Chrome trace of every collective there",
    flag="--timeline-filename", horovod="HOROVOD_TIMELINE")
TIMELINE_MARK_CYCLES = Setting(
    "RAYTRAIN_X_TIMELINE_MARK_CYCLES", False, bool,
    "a `CYCLE_START` mark in the timeline per cycle that ran a collective",
    horovod="HOROVOD_TIMELINE_MARK_CYCLES", flag="--timeline-mark-cycles")
GPU_OPERATIONS = Setting(
    "RAYTRAIN_X_GPU_OPERATIONS", "nccl", str,
    "how CUDA tensors travel: nccl (one GPU per rank), or gloo for ranks that share a GPU "
    "(NCCL refuses two ranks on one device)", choices=("nccl", "gloo"),
    horovod="HOROVOD_GPU_OPERATIONS")
CONFIG_FILE = Setting(
    "RAYTRAIN_X_CONFIG_FILE", "", str,
    "a YAML or JSON file of knobs and training settings (docs/knobs.md)",
    flag="--config-file")
METRICS = Setting(
    "RAYTRAIN_X_METRICS", True, bool,
    "export the job's metrics through Ray's metrics API (docs/metrics.md); 0 turns them off")
METRICS_INTERVAL_S = Setting(
    "RAYTRAIN_X_METRICS_INTERVAL_S", 5.0, float,
    "how often each worker reads its counters and exports them (a step only counts itself)",
    seconds=True, minimum=0.1)

# the communication knobs (`raytrain_x.common.knobs`: autotune moves them)
FUSION_THRESHOLD = Setting(
    "RAYTRAIN_X_FUSION_THRESHOLD", 64 * MB, int,
    "bytes: the largest batch reduced at once (DistributedOptimizer's runs of gradients are "
    "cut at it; per-tensor requests are fused up to it); 0: nothing fused (the flag and the "
    "`fusion_threshold_mb` key take MB)", minimum=0,
    maximum=4096 * MB, flag="--fusion-threshold-mb", flag_scale=MB,
    config_key="fusion_threshold_bytes", horovod="HOROVOD_FUSION_THRESHOLD")
CYCLE_TIME = Setting(
    "RAYTRAIN_X_CYCLE_TIME", 1.0, float,
    "milliseconds between engine cycles while work keeps arriving", minimum=0.0,
    maximum=1000.0, flag="--cycle-time-ms", config_key="cycle_time_ms",
    horovod="HOROVOD_CYCLE_TIME")
CACHE_CAPACITY = Setting(
    "RAYTRAIN_X_CACHE_CAPACITY", 1024, int,
    "response-cache entries; 0 turns the cache off", minimum=0, maximum=1 << 20,
    flag="--cache-capacity", config_key="cache_capacity", horovod="HOROVOD_CACHE_CAPACITY")
HIERARCHICAL_ALLREDUCE = Setting(
    "RAYTRAIN_X_HIERARCHICAL_ALLREDUCE", True, bool,
    "several hosts with several workers each: sum on each host in shared memory, one shard "
    "per local rank across hosts", flag="--hierarchical-allreduce",
    config_key="hierarchical_allreduce", horovod="HOROVOD_HIERARCHICAL_ALLREDUCE")
HIERARCHICAL_ALLGATHER = Setting(
    "RAYTRAIN_X_HIERARCHICAL_ALLGATHER", False, bool,
    "two-level allgather: local, then across hosts", flag="--hierarchical-allgather",
    config_key="hierarchical_allgather", horovod="HOROVOD_HIERARCHICAL_ALLGATHER")

# autotune (`raytrain_x.common.autotune_config.AutotuneConfig`: Horovod's options and
# Bagua's time-based ones)
AUTOTUNE = Setting(
    "RAYTRAIN_X_AUTOTUNE", False, bool, "tune the free knobs while training",
    flag="--autotune", horovod="HOROVOD_AUTOTUNE")
AUTOTUNE_LOG = Setting(
    "RAYTRAIN_X_AUTOTUNE_LOG", "", str,
    "a CSV: one row per sample and a final `best` row (rank 0 writes it)",
    flag="--autotune-log-file", horovod="HOROVOD_AUTOTUNE_LOG")
AUTOTUNE_WARMUP_SAMPLES = Setting(
    "RAYTRAIN_X_AUTOTUNE_WARMUP_SAMPLES", 3, int,
    "samples measured and discarded first", minimum=0, flag="--autotune-warmup-samples",
    horovod="HOROVOD_AUTOTUNE_WARMUP_SAMPLES")
AUTOTUNE_STEPS_PER_SAMPLE = Setting(
    "RAYTRAIN_X_AUTOTUNE_STEPS_PER_SAMPLE", 10, int,
    "training steps per sample", minimum=1, flag="--autotune-steps-per-sample",
    horovod="HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE")
AUTOTUNE_MAX_SAMPLES = Setting(
    "RAYTRAIN_X_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", 20, int,
    "scored samples at most, the starting knobs included", minimum=1,
    flag="--autotune-bayes-opt-max-samples", horovod="HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES")
AUTOTUNE_NOISE = Setting(
    "RAYTRAIN_X_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", 0.8, float,
    "the Gaussian process's alpha (the noise of the standardised scores)", minimum=0.0,
    flag="--autotune-gaussian-process-noise",
    horovod="HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE")
AUTOTUNE_WARMUP_TIME = Setting(
    "RAYTRAIN_X_AUTOTUNE_WARMUP_TIME", 0.0, float,
    "seconds of warm-up instead of warm-up samples", seconds=True, zero="count samples",
    flag="--autotune-warmup-time")
AUTOTUNE_SAMPLING_TIME = Setting(
    "RAYTRAIN_X_AUTOTUNE_SAMPLING_TIME", 0.0, float,
    "seconds per sample instead of steps per sample", seconds=True, zero="count steps",
    flag="--autotune-sampling-time")
AUTOTUNE_RESUME_FROM = Setting(
    "RAYTRAIN_X_AUTOTUNE_RESUME_FROM", "", str,
    "an autotune log or knobs JSON: start at its best knobs and do not tune",
    flag="--autotune-resume-from")

# ----------------------------------------------------------------------------- launcher
RANK = Setting("RAYTRAIN_X_RANK", 0, int, "this process's rank", scope=LAUNCHER, minimum=0)
SIZE = Setting("RAYTRAIN_X_SIZE", 1, int, "the number of ranks", scope=LAUNCHER, minimum=1)
LOCAL_RANK = Setting("RAYTRAIN_X_LOCAL_RANK", None, int,
                     "its rank on its host (default: its rank)", scope=LAUNCHER, minimum=0)
LOCAL_SIZE = Setting("RAYTRAIN_X_LOCAL_SIZE", None, int,
                     "the ranks on its host (default: the number of ranks)", scope=LAUNCHER,
                     minimum=1)
CROSS_RANK = Setting("RAYTRAIN_X_CROSS_RANK", 0, int, "its host's number", scope=LAUNCHER,
                     minimum=0)
CROSS_SIZE = Setting("RAYTRAIN_X_CROSS_SIZE", 1, int, "the number of hosts", scope=LAUNCHER,
                     minimum=1)
STORE_ADDR = Setting("RAYTRAIN_X_STORE_ADDR", "", str,
                     "the job's TCP store (rank 0 hosts it, on that address)", scope=LAUNCHER)
STORE_PORT = Setting("RAYTRAIN_X_STORE_PORT", 0, int, "the store's port", scope=LAUNCHER,
                     minimum=0, maximum=65535)
STORE_SECRET = Setting(
    "RAYTRAIN_X_STORE_SECRET", "", str,
    "the job's secret, the same on every process (at least 16 bytes); the store answers no "
    "process without it; may be left out where the store's address is a loopback one",
    scope=LAUNCHER)

# ----------------------------------------------------------------------------- internal
LAUNCHED = Setting(
    "RAYTRAIN_X_LAUNCHED", False, bool,
    "set by `raytrain-x run` for the processes it launches: `init()` takes the rendezvous "
    "from the environment", scope=INTERNAL)
STATUS_FILE = Setting(
    "RAYTRAIN_X_STATUS_FILE", "", str,
    "set by `raytrain-x run` for the processes it launches: where each writes its status "
    "for its worker actor to export", scope=INTERNAL)
CHECKPOINT = Setting(
    "RAYTRAIN_X_CHECKPOINT", "", str,
    "set by the executor for its workers: the job's `CheckpointConfig` as JSON",
    scope=INTERNAL)
CHECKPOINT_NAME = Setting(
    "RAYTRAIN_X_CHECKPOINT_NAME", "", str,
    "set by the executor for its workers: the folder a `CheckpointConfig` without a name "
    "takes (the driver's job name, Tune trial or command)", scope=INTERNAL)
DRIVER_DIR = Setting(
    "RAYTRAIN_X_DRIVER_DIR", "", str,
    "set by the executor for its workers: the driver's working directory, which a relative "
    "checkpoint path given on a worker is taken against (not the worker's copy)",
    scope=INTERNAL)
CHECKPOINT_RUN = Setting(
    "RAYTRAIN_X_CHECKPOINT_RUN", "", str,
    "set by the executor for its workers: the token of this run of the job, which holds "
    "the writer lease of its checkpoints (`raytrain_x.elastic.lease`)", scope=INTERNAL)
CHECKPOINT_DRIVER = Setting(
    "RAYTRAIN_X_CHECKPOINT_DRIVER", "", str,
    "set by the executor for its workers: `host:pid` of the driver, which renews the "
    "writer lease too (a lease is free at once only when every process renewing it is "
    "gone)", scope=INTERNAL)
STORAGE_FAULTS = Setting(
    "RAYTRAIN_X_STORAGE_FAULTS", "", str,
    "set by tests and the simulator: a JSON file of storage faults to inject under every "
    "durable checkpoint's storage (`raytrain_x.elastic.storage_faults`)", scope=INTERNAL)
JOB_NAME = Setting(
    "RAYTRAIN_X_JOB_NAME", "", str,
    "set by the executor and `raytrain-x run` from the job's name: the `job` tag of its "
    "metrics; set by hand for a driver, it names its checkpoints' folder too", scope=INTERNAL)
AUTOTUNE_INITIAL_KNOBS = Setting(
    "RAYTRAIN_X_AUTOTUNE_INITIAL_KNOBS", "", str,
    "set for the workers from `AutotuneConfig.initial_knobs`: JSON", scope=INTERNAL)
AUTOTUNE_RULES = Setting(
    "RAYTRAIN_X_AUTOTUNE_RULES", "", str,
    "set for the workers from `AutotuneConfig.rules` where they are not the defaults: JSON",
    scope=INTERNAL)
ZERO_STAGE = Setting(
    "RAYTRAIN_X_ZERO_STAGE", "", str,
    "set for the workers from a config file's `zero_stage`", scope=INTERNAL,
    config_key="zero_stage")
MICRO_BATCH_SIZE = Setting(
    "RAYTRAIN_X_MICRO_BATCH_SIZE", "", str,
    "set for the workers from a config file's `micro_batch_size`", scope=INTERNAL,
    config_key="micro_batch_size")
GRADIENT_ACCUMULATION_STEPS = Setting(
    "RAYTRAIN_X_GRADIENT_ACCUMULATION_STEPS", "", str,
    "set for the workers from a config file's `gradient_accumulation_steps`",
    scope=INTERNAL, config_key="gradient_accumulation_steps")
TF_ASYNC = Setting(
    "RAYTRAIN_X_TF_ASYNC", True, bool,
    "0: TensorFlow graphs run the collectives as numpy functions instead of raytrain-x's "
    "asynchronous op (benchmarks compare the two)", scope=INTERNAL)

ALL: tuple[Setting, ...] = tuple(v for v in list(globals().values())
                                 if isinstance(v, Setting))


def of_scope(scope: str) -> list[Setting]:
    """The settings of one kind (`USER`, `LAUNCHER`, `INTERNAL`), as declared."""
    return [s for s in ALL if s.scope == scope]


def flagged() -> list[Setting]:
    """The settings `raytrain-x run` takes as flags."""
    return [s for s in ALL if s.flag]


def by_env(name: str) -> Setting:
    """The setting of variable `name`."""
    for setting in ALL:
        if setting.env == name:
            return setting
    raise KeyError(name)


def horovod_aliases() -> dict[str, str]:
    """Ours -> Horovod's variable, for those Horovod has."""
    return {s.env: s.horovod for s in ALL if s.horovod}


def table(scope: str) -> str:
    """docs/api.md's table of the settings of `scope` (a test holds the two equal)."""
    if scope != USER:
        rows = ["| variable | meaning |", "|---|---|"]
        rows += [f"| `{s.env}` | {s.doc} |" for s in of_scope(scope)]
        return "\n".join(rows)
    rows = ["| variable | default | takes | flag | meaning |", "|---|---|---|---|---|"]
    for s in of_scope(USER):
        flag = f"`{s.flag}`" if s.flag else ""
        alias = f" (Horovod: `{s.horovod}`)" if s.horovod else ""
        rows.append(f"| `{s.env}` | {s.shown_default()} | {s.range()} | {flag} | "
                    f"{s.doc}{alias} |")
    return "\n".join(rows)


# ----------------------------------------------------------------------------- constants
# The driver's fixed intervals: not settings, each follows from what it waits for.
# A worker's `ping` runs on a thread of its own, so a reachable worker answers in
# milliseconds even mid-collective; this much silence means its node is cut off or gone.
PROBE_TIMEOUT_S = 5.0
# An elastic member silent this long to the driver's heartbeat (`policies.Heartbeats`) while
# its peers wait for it at the rendezvous is lost: cut off or gone.
SILENT_LOST_S = PROBE_TIMEOUT_S
# A member that answers but stays away from the rendezvous its peers wait at longer than the
# collective timeout and this is stuck (`StragglerRule`): a healthy one fails its own
# collective within the timeout and restores in well under this.
STUCK_GRACE_S = 5.0
# A worker that has been in its call to join a round this long without the rounds actor
# receiving it has the call held back by Ray (`policies.held_joins`); a join arrives in
# milliseconds.
JOIN_HELD_S = 3.0
PROGRESS_EVERY_S = 5.0  # how often "waiting for N workers to start" is shown
# How often an elastic job asks the GCS for draining nodes (one small RPC; a preemption
# notice may give only seconds) and looks for workers missing from a rendezvous.
DRAIN_POLL_S = 0.2
STRAGGLER_POLL_S = 1.0
# How often a job that must read storage to go on (a round that restores, a restart after
# its control actors died) asks it again while it does not answer: each ask is a listing
# with the store's own retries; `elastic_timeout` bounds the wait.
STORAGE_POLL_S = 1.0

NODE_ID_SHOWN = 8  # characters of a Ray node id in messages (as `ray status` shows them)


def short_node(node_id: str) -> str:
    """A node id as messages show it."""
    return node_id[:NODE_ID_SHOWN]
