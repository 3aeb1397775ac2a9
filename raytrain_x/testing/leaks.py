"""What a test run, a soak or a fresh-clone run left behind: Ray's processes, processes
started from here, the engine's shared-memory segments, temp dirs and network namespaces.

One check for the suite (`tests/conftest.py`), the chaos soak (`tools/chaos.py`) and the
fresh-clone runner (`tools/fresh_setup.py`): take a `Snapshot` before, then
`leftovers(snapshot)` (or `wait_until_clean`) after.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from raytrain_x.common.procs import processes, with_descendants

# What Ray's processes run (stray ones are re-parented to init, so their lineage does not
# find them)
RAY_MARKERS = ("raylet", "gcs_server", "ray.util.client.server", "ray/dashboard",
               "log_monitor.py", "ray/autoscaler", "default_worker.py", "ray::",
               "runtime_env/agent", "runtime_env_agent")
SHM_PREFIX = "rtx-"  # the engine's shared-memory segments


@dataclass(frozen=True)
class Snapshot:
    """What there was before: processes, shared-memory segments, temp dirs."""

    pids: frozenset[int]
    shm: frozenset[str]
    temp: frozenset[str] = field(default=frozenset())
    temp_prefix: str = ""


def _shm() -> frozenset[str]:
    return frozenset(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else frozenset()


def _temp(prefix: str) -> frozenset[str]:
    return frozenset(n for n in os.listdir("/tmp") if n.startswith(prefix)) if prefix \
        else frozenset()


def snapshot(temp_prefix: str = "") -> Snapshot:
    """Now, before a run (`temp_prefix`: the run's temp dirs in /tmp start with it)."""
    return Snapshot(frozenset(processes()), _shm(), _temp(temp_prefix), temp_prefix)


def new_processes(before: Snapshot, marker: str | None = None,
                  ray_anywhere: bool = True) -> dict[int, str]:
    """pid -> command line of the processes started since `before`: those whose command
    line holds `marker` or, without one, those descended from this process or (with
    `ray_anywhere`) running Ray (multiprocessing's resource tracker aside: it lives as long
    as its parent, by design).
    """
    procs = processes()
    me = os.getpid()
    mine = with_descendants({me}, procs)

    def new(pid: int, cmd: str) -> bool:
        if pid in before.pids or pid == me or "multiprocessing.resource_tracker" in cmd:
            return False
        if marker is not None:
            return marker in cmd
        return pid in mine or (ray_anywhere and any(m in cmd for m in RAY_MARKERS))

    return {p: c for p, (_, c) in procs.items() if new(p, c)}


def leftovers(before: Snapshot, marker: str | None = None,
              namespaces: Sequence[str] = ()) -> dict[str, list[str]]:
    """What is here now and was not `before`, by kind (empty lists when clean).

    Args:
        before: the snapshot taken before the run.
        marker: only processes whose command line holds it (a run's temp dir); by default,
            those descended from this process or running Ray.
        namespaces: network namespaces the run made (each still listed is left).
    """
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True,
                            text=True).stdout if namespaces else ""
    return {
        "processes": sorted(f"{p}: {c[:160]}" for p, c in new_processes(before, marker).items()),
        "shared memory": sorted(n for n in _shm() - before.shm if n.startswith(SHM_PREFIX)),
        "temp dirs": sorted(f"/tmp/{n}" for n in _temp(before.temp_prefix) - before.temp),
        "network namespaces": [n for n in namespaces if n in listed.split()],
    }


def wait_until_clean(before: Snapshot, timeout_s: float = 30.0, **kwargs) -> dict[str, list[str]]:
    """`leftovers`, asked again until nothing is left or `timeout_s` passed (Ray's processes
    take a few seconds to exit); returns the kinds with something left."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = {k: v for k, v in leftovers(before, **kwargs).items() if v}
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(1)


def describe(found: dict[str, list[str]]) -> str:
    """`found` as lines: each kind, then what was left of it."""
    return "\n".join(f"  {kind}:\n" + "\n".join(f"    {item}" for item in items)
                     for kind, items in found.items())


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m raytrain_x.testing.leaks BEFORE.json`: what was left since a snapshot
    written by a Python that had no raytrain-x yet (`{"pids": [...], "shm": [...]}`, as
    `tools/fresh_setup.py` writes before it clones); prints it as JSON and exits 1
    when a process or a segment was left."""
    import json
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m raytrain_x.testing.leaks BEFORE.json", file=sys.stderr)
        return 2
    with open(args[0]) as f:
        saved = json.load(f)
    before = Snapshot(frozenset(saved["pids"]), frozenset(saved["shm"]))
    found = wait_until_clean(before)
    print(json.dumps(found))
    return 1 if found.get("processes") or found.get("shared memory") else 0


if __name__ == "__main__":
    raise SystemExit(main())
