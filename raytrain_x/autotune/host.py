"""Where the autotune search runs: its policy (`controller.AutotuneController`) hosted in
a process of its own, so that its numerics never hold the GIL rank 0 trains with.

`BackgroundController` is the policy at low priority on one thread (the Ray executor runs
it as an actor, `raytrain_x.ray.autotune_actor`); `ProcessController` hosts it in a child
process for a rank 0 without that actor; `local_controller` picks.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import subprocess
import sys
import threading
from typing import Any

from raytrain_x.autotune.controller import AutotuneController
from raytrain_x.common.autotune_config import AutotuneConfig
from raytrain_x.common.errors import AutotuneError
from raytrain_x.common.knobs import Knobs

log = logging.getLogger("raytrain_x.autotune")


def _yield_cpu_to_training() -> None:
    """Runs the search's numerics on one thread at low priority: on a small machine every
    training rank is busy, and a BLAS pool spinning on every core would slow them all."""
    try:
        os.nice(10)
    except OSError:
        pass
    try:
        from threadpoolctl import threadpool_limits

        threadpool_limits(1)
    except ImportError:  # threadpoolctl comes with scikit-learn, which bayes_opt needs
        pass


class BackgroundController(AutotuneController):
    """The controller in a process of its own (a Ray actor or a child process)."""

    def __init__(self, config: AutotuneConfig, start: Knobs, fixed: frozenset[str]) -> None:
        _yield_cpu_to_training()
        super().__init__(config, start, fixed)


class ProcessController:
    """The controller in a child process, for rank 0 of a job without a controller actor
    (a script launched by `raytrain-x run`, or any plain multi-process job).

    Each search step fits a Gaussian process (tens of milliseconds of CPU); inside the
    training process it would hold the GIL that rank 0's training and engine threads need,
    and every rank would wait for rank 0 (measured: 150-400 ms lost per knob switch on 2
    cores, against 30-40 ms with the search out of the process).

    The child is a fresh interpreter that imports only this package (`python -c`), never the
    training script: a `spawn` child re-ran a script without an `if __name__ == "__main__":`
    guard (Horovod's style), whose `init()` then failed. It ends when this process's end of
    the pipe closes.
    """

    def __init__(self, config: AutotuneConfig, start: Knobs, fixed: frozenset[str]) -> None:
        self._conn, child = multiprocessing.Pipe()
        fd = child.fileno()
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [package_root, *filter(None, [os.environ.get("PYTHONPATH")])])}
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            env[var] = "1"
        self._process = subprocess.Popen(
            [sys.executable, "-c", f"from raytrain_x.autotune.host import serve; serve({fd})"],
            pass_fds=(fd,), env=env, stdin=subprocess.DEVNULL)
        child.close()
        self._lock = threading.Lock()
        self._conn.send((config, start, fixed))

    def _call(self, method: str, *args: Any) -> Any:
        with self._lock:
            try:
                self._conn.send((method, args))
                ok, value = self._conn.recv()
            except (EOFError, OSError) as exc:
                raise AutotuneError(f"the autotune controller process ended: {exc!r}") \
                    from None
        if not ok:
            raise AutotuneError(f"the autotune controller failed: {value}")
        return value

    def begin(self, searched: list[str] | None = None) -> list[str]:
        return self._call("begin", searched)

    def report(self, score: float) -> dict[str, Any]:
        return self._call("report", score)


def serve(fd: int) -> None:
    """The child process of `ProcessController`: takes the controller's arguments, then
    answers calls until the parent is gone."""
    conn = multiprocessing.connection.Connection(fd)
    try:
        config, start, fixed = conn.recv()
    except (EOFError, OSError):
        return
    controller = BackgroundController(config, start, fixed)
    while True:
        try:
            method, args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            conn.send((True, getattr(controller, method)(*args)))
        except Exception as exc:  # noqa: BLE001 - reported to the caller
            conn.send((False, f"{type(exc).__name__}: {exc}"))


def local_controller(config: AutotuneConfig, start: Knobs, fixed: frozenset[str]):
    """The controller for a rank 0 without a controller actor: in a child process, or in
    this process where none can be started."""
    try:
        return ProcessController(config, start, fixed)
    except (AssertionError, OSError) as exc:
        log.warning("raytrain-x autotune: searching in the training process (%s); the "
                    "search's numerics will slow rank 0 a little", exc)
        return AutotuneController(config, start, fixed)
