"""Time limits from what a test does, and waits that say what they were waiting for.

A limit is a step's own work, as long as it takes on an idle 2-core runner, times
WORK_MARGIN, plus Ray's own allowance for each Ray node the step starts; all of it times the
number of suite processes sharing the machine (pytest-xdist's `-n`: `make test` runs two,
and each test then runs about twice as long as alone) and RAYTRAIN_X_TEST_TIME_SCALE
(default 1) for runners slower than that. WORK_MARGIN is 4: with one of the two cores busy
the suite ran 1.5-2x slower (docs/performance.md), and the rest is headroom for a busier
moment or a slower runner. pytest-timeout's per-test limits (the ini default, the `timeout`
marks) are scaled the same way by tests/conftest.py.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from collections.abc import Callable, Sequence

from raytrain_x.testing import waiting

# pytest-xdist sets the count in each of its processes before conftest.py is imported
SUITE_PROCESSES = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
SCALE = float(os.environ.get("RAYTRAIN_X_TEST_TIME_SCALE", "1")) * SUITE_PROCESSES
WORK_MARGIN = 4.0
# What Ray itself allows a node to start: its raylet has 30 s to register with the GCS (fixed
# in ray._private.node), after the GCS has answered, which Ray waits for up to
# RAY_gcs_server_request_timeout_seconds.
RAY_START_S = 30.0 + float(os.environ.get("RAY_gcs_server_request_timeout_seconds", "60"))


def limit(work_s: float, ray_starts: int = 0) -> float:
    """Seconds allowed for a step whose work takes `work_s` on an idle runner and which starts
    `ray_starts` Ray nodes."""
    return SCALE * (WORK_MARGIN * work_s + ray_starts * RAY_START_S)


def wait_until(condition: Callable[[], bool], work_s: float, what: str,
               state: Callable[[], object] | None = None, poll_s: float = 0.05) -> None:
    """Polls `condition` until it holds; past the limit, fails naming `what` it waited for
    and, with `state`, what it saw last."""
    waiting.wait_until(condition, limit(work_s), what, state, poll_s)


def run(cmd: Sequence[str], work_s: float, what: str, ray_starts: int = 0,
        **kwargs) -> subprocess.CompletedProcess:
    """`subprocess.run` with text output captured and a limit. Past the limit the command is
    killed and the test fails naming what the command was doing and its last output."""
    seconds = limit(work_s, ray_starts)
    try:
        return subprocess.run(list(cmd), capture_output=True, text=True, timeout=seconds,
                              **kwargs)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(
            f"gave up after {seconds:.0f}s waiting for {what} ({shlex.join(cmd)}); its last "
            f"output:\n{_tail(exc.stdout)}\n{_tail(exc.stderr)}") from None


def _tail(output: str | bytes | None, lines: int = 30) -> str:
    if isinstance(output, bytes):
        output = output.decode(errors="replace")
    return "\n".join((output or "").splitlines()[-lines:])


def first_error(output: str, context_lines: int = 15) -> str:
    """The first traceback in a process's output, whole (up to its exception line), then
    the output's last lines: a failing test shows the process's own error first, not only
    the tail of Ray's logs after it."""
    lines = output.splitlines()
    start = next((i for i, line in enumerate(lines) if "Traceback (most recent call last)"
                  in line), None)
    tail = "\n".join(lines[-context_lines:])
    if start is None:
        return f"(no traceback in its output); its last lines:\n{tail}"
    end = start + 1
    while end < len(lines) and (lines[end].startswith((" ", "\t")) or not lines[end].strip()):
        end += 1
    error = "\n".join(lines[start:end + 1])
    return f"its first error:\n{error}\n... its last lines:\n{tail}"
