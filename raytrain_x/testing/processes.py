"""This machine's processes from /proc: what a cluster started, and stopping it."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable

from raytrain_x.common.procs import processes

__all__ = ["cluster_processes", "environ_has", "processes", "stop", "with_descendants"]


def environ_has(pid: int, name: str, value: str) -> bool:
    """Whether process `pid` was started with `name=value` in its environment."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"{name}={value}".encode() in f.read().split(b"\0")
    except OSError:
        return False


def with_descendants(roots: Iterable[int], procs: dict[int, tuple[int, str]]) -> set[int]:
    """`roots` and every process below them (Ray's agents rename themselves, so a
    command line alone does not find them)."""
    found = set(roots)
    grew = True
    while grew:
        children = {p for p, (parent, _) in procs.items() if parent in found} - found
        grew = bool(children)
        found |= children
    return found


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
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if sig == signal.SIGTERM:
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline and any(_alive(p) for p in pids):
                time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
