"""This machine's processes from /proc: what a cluster started, and stopping it."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable

from raytrain_x.common.procs import kill, processes, with_descendants

__all__ = ["cluster_processes", "environ_has", "kill", "processes", "stop",
           "with_descendants"]


def environ_has(pid: int, name: str, value: str) -> bool:
    """Whether process `pid` was started with `name=value` in its environment."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"{name}={value}".encode() in f.read().split(b"\0")
    except OSError:
        return False


def cluster_processes(markers: Iterable[str]) -> set[int]:
    """The processes whose command line holds any of `markers` (a cluster's temp dir, its
    GCS port as `:PORT `), with their descendants; never this process."""
    procs = processes()
    markers = tuple(markers)
    roots = {pid for pid, (_, cmd) in procs.items() if any(m in cmd + " " for m in markers)}
    return with_descendants(roots, procs) - {os.getpid()}


def stop(pids: Iterable[int], grace_s: float = 1.0) -> None:
    """SIGTERM, a grace period, then SIGKILL for whatever is still there."""
    pids = set(pids)
    kill(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    kill(pids)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
