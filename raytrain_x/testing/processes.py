"""This machine's processes from /proc: what a cluster started, and stopping it; a
cluster start tried once more when Ray's own start limit ran out."""

from __future__ import annotations

import os
import signal
import time
import warnings
from collections.abc import Callable, Iterable
from typing import TypeVar

from raytrain_x.common.procs import kill, processes, with_descendants

__all__ = ["cluster_processes", "cpu_shares", "environ_has", "kill", "processes",
           "start_once_more", "stop", "with_descendants"]

T = TypeVar("T")


def start_once_more(start: Callable[[], T], what: str) -> T:
    """Runs `start`. A start that ran past Ray's own limit for a node (its raylet has 30 s
    to register with the GCS, not configurable) is tried once more, with a warning: on a
    busy machine that limit is about load, not about the code under test. Any other
    failure, and a second one, is raised. `start` stops what it started when it fails."""
    try:
        return start()
    except Exception as exc:
        if "timed out during startup" not in str(exc):
            raise
        warnings.warn(f"{what} did not start in the time Ray allows ({exc}); stopped it and "
                      "trying once more", stacklevel=2)
        return start()


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


_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_shares(pids: Iterable[int], window_s: float) -> dict[int, tuple[str, float]]:
    """pid -> (a label, the share of one core it used) of each process of `pids` alive
    through the next `window_s` seconds (user and system time; this call sleeps through
    them). The label is what `ps` shows of it: a Ray worker's `ray::Class.method` title, a
    script's name, or the program's."""
    before = _cpu_seconds(pids)
    time.sleep(window_s)
    after = _cpu_seconds(before)
    return {pid: (label, (seconds - before[pid][1]) / window_s)
            for pid, (label, seconds) in after.items()}


def _cpu_seconds(pids: Iterable[int]) -> dict[int, tuple[str, float]]:
    """pid -> (its label, CPU seconds used so far) of each live process of `pids`."""
    out = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        scripts = [os.path.basename(a) for a in args if a.endswith(".py")]
        if args[0].startswith("ray::"):
            label = args[0].split()[0]
        elif scripts:
            label = scripts[0]
        else:
            label = os.path.basename(args[0]) or stat.split("(")[1].split(")")[0]
        if label.startswith("python") and "-c" in args:
            label = "python -c (a worker or helper)"
        out[pid] = (label, (int(fields[11]) + int(fields[12])) / _TICKS)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
