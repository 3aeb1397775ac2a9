"""Commands the suite runs beside the other tests: a subprocess that needs one core and
nothing else (the simulator's share of schedules, the docs build) starts when collection
ends and the test that owns it reads its result when its turn comes. The suite's own tests
leave part of the two cores idle (they wait on Ray nodes, workers and timeouts); these use
that time instead of adding theirs.

A test module registers its command at import; the test carries
`@pytest.mark.background("name")` and calls `result("name", work_s)`. Only commands whose
test was collected and selected start; every one still running at the end is killed
(`stop_all`), before the suite checks for processes left behind.
"""

from __future__ import annotations

import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from tests.limits import limit


@dataclass
class _Job:
    cmd: list[str]
    kwargs: dict[str, Any]
    process: subprocess.Popen | None = None
    started: float = 0.0
    files: list[Any] = field(default_factory=list)


_jobs: dict[str, _Job] = {}


def register(name: str, cmd: list[str], **kwargs: Any) -> None:
    """What `name` runs (`subprocess.Popen` arguments besides the output)."""
    _jobs[name] = _Job(list(cmd), kwargs)


def start(name: str) -> None:
    job = _jobs[name]
    if job.process is not None:
        return
    out, err = (tempfile.TemporaryFile(mode="w+") for _ in range(2))
    job.files = [out, err]
    job.started = time.monotonic()
    job.process = subprocess.Popen(job.cmd, stdout=out, stderr=err, text=True, **job.kwargs)


def result(name: str, work_s: float) -> subprocess.CompletedProcess:
    """Waits for `name` (started at collection, or now) up to the limit of `work_s` of work
    counted from its start; its output as `subprocess.run` gives it."""
    start(name)
    job = _jobs[name]
    left = limit(work_s) - (time.monotonic() - job.started)
    try:
        job.process.wait(timeout=max(left, 1.0))
    except subprocess.TimeoutExpired:
        job.process.kill()
        job.process.wait()
        raise AssertionError(f"gave up waiting for {name} ({' '.join(job.cmd)}) after "
                             f"{limit(work_s):.0f}s") from None
    out, err = (f.seek(0) or f.read() for f in job.files)
    return subprocess.CompletedProcess(job.cmd, job.process.returncode, out, err)


def start_selected(items: list) -> None:
    """Starts the commands of the selected tests that declare one."""
    for item in items:
        mark = item.get_closest_marker("background")
        if mark and mark.args[0] in _jobs:
            start(mark.args[0])


def stop_all() -> None:
    for job in _jobs.values():
        if job.process is not None and job.process.poll() is None:
            job.process.kill()
            job.process.wait()
        for f in job.files:
            f.close()

