"""Settings that are not knobs: each with its environment variable and its default, once.

Knobs (`raytrain_x.common.knobs`) are what autotune moves. These are fixed for a job: how
long to wait for peers, whether ranks on one host share memory, when a stall is reported,
where the timeline goes. A module that needs one reads it here (`TIMEOUT_S.read()`), and a
function that takes one as an argument uses its `default`, so no default is written twice.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from raytrain_x.common.errors import ConfigError

_FALSE = ("0", "false", "off", "no")


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
    env: str  # the environment variable
    default: Any
    kind: type  # float, bool or str
    doc: str
    minimum: float = 0.0  # a float setting: finite and at least this (above 0 where 0)
    zero: str | None = None  # what 0 means, where 0 is allowed below `minimum`

    def read(self, env: Mapping[str, str] | None = None) -> Any:
        """The value in `env` (default: the process's environment), else the default."""
        raw = (os.environ if env is None else env).get(self.env)
        if raw is None or raw.strip() == "":
            return self.default
        if self.kind is bool:
            return raw.strip().lower() not in _FALSE
        if self.kind is float:
            try:
                value = float(raw)
            except ValueError:
                raise ConfigError(f"environment {self.env}={raw!r} is not a number") from None
            try:
                return check_seconds(f"environment {self.env}", value, self.minimum, self.zero)
            except ConfigError as exc:
                raise ConfigError(f"{exc}; unset it for the default "
                                  f"{self.default:g}") from None
        return raw


TIMEOUT_S = Setting(
    "RAYTRAIN_X_TIMEOUT", 30.0, float,
    "seconds a rank waits for its peers at a rendezvous or in a collective before it "
    "reports them lost")
START_TIMEOUT_S = Setting(
    "RAYTRAIN_X_START_TIMEOUT", 300.0, float,
    "seconds an elastic worker may take to start (process, imports, runtime_env, image "
    "pull) before it is given up on; measured in docs/elastic.md")
SHM = Setting(
    "RAYTRAIN_X_SHM", True, bool,
    "ranks on one host reduce through shared memory; 0 forces gloo")
STALL_WARNING_S = Setting(
    "RAYTRAIN_X_STALL_CHECK_TIME_SECONDS", 60.0, float,
    "seconds a collective may wait for a rank before a warning names it", minimum=1.0)
STALL_SHUTDOWN_S = Setting(
    "RAYTRAIN_X_STALL_SHUTDOWN_TIME_SECONDS", 0.0, float,
    "seconds of such a stall before the job stops (0: never)", minimum=1.0, zero="never")
TIMELINE = Setting(
    "RAYTRAIN_X_TIMELINE", "", str,
    "a path: rank 0 writes a Chrome trace of every collective there")
TIMELINE_MARK_CYCLES = Setting(
    "RAYTRAIN_X_TIMELINE_MARK_CYCLES", False, bool,
    "mark each engine cycle in the timeline")
GPU_OPERATIONS = Setting(
    "RAYTRAIN_X_GPU_OPERATIONS", "nccl", str,
    "how CUDA tensors travel: nccl (one GPU per rank), or gloo (ranks that share a GPU, "
    "which NCCL refuses)")
CONFIG_FILE = Setting(
    "RAYTRAIN_X_CONFIG_FILE", "", str,
    "a YAML file of knobs (see docs/knobs.md)")

DRAIN_POLL_S = Setting(
    "RAYTRAIN_X_DRAIN_POLL_S", 0.2, float,
    "how often an elastic job asks the GCS for draining nodes (a preemption notice may give "
    "only seconds)", minimum=0.01)
STRAGGLER_POLL_S = Setting(
    "RAYTRAIN_X_STRAGGLER_POLL_S", 1.0, float,
    "how often an elastic job looks for workers missing from a rendezvous", minimum=0.01)
METRICS = Setting(
    "RAYTRAIN_X_METRICS", True, bool,
    "export the job's metrics through Ray's metrics API (docs/metrics.md); 0 turns them off")
METRICS_INTERVAL_S = Setting(
    "RAYTRAIN_X_METRICS_INTERVAL_S", 5.0, float,
    "how often each worker reads its counters and exports them (nothing is done per step "
    "beyond counting it)", minimum=0.1)
JOB_NAME = Setting(
    "RAYTRAIN_X_JOB_NAME", "", str,
    "the job's name in its metrics (the `job` tag); the executor sets it from its `name`")
STATUS_FILE = Setting(
    "RAYTRAIN_X_STATUS_FILE", "", str,
    "set by `raytrain-x run` for the processes it launches: where each writes its status "
    "for its worker actor to export")
CHECKPOINT = Setting(
    "RAYTRAIN_X_CHECKPOINT", "", str,
    "set by the executor for its workers: the job's `CheckpointConfig` as JSON (where and "
    "how often durable checkpoints are written)")

ALL = (TIMEOUT_S, START_TIMEOUT_S, SHM, STALL_WARNING_S, STALL_SHUTDOWN_S, TIMELINE,
       TIMELINE_MARK_CYCLES, GPU_OPERATIONS, CONFIG_FILE, DRAIN_POLL_S, STRAGGLER_POLL_S,
       METRICS, METRICS_INTERVAL_S, JOB_NAME, STATUS_FILE, CHECKPOINT)

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

NODE_ID_SHOWN = 8  # characters of a Ray node id in messages (as `ray status` shows them)


def short_node(node_id: str) -> str:
    """A node id as messages show it."""
    return node_id[:NODE_ID_SHOWN]
