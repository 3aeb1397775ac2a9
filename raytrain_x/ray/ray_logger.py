"""Progress from the workers to the driver while a job runs (Horovod's
`horovod.ray.ray_logger`): `ray_logger.log(info)` in a worker hands `info` to each of the
`callbacks` given to `RayExecutor.run` (or `execute`) as it arrives.

In a fixed job only rank 0's values go (Horovod's `RayExecutor`: "every value logged by
the rank 0 worker"); in an elastic job every worker's do (Horovod's elastic executor), so a
callback sees the workers that joined after a resize too. Outside a run with callbacks,
`log` does nothing.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

from raytrain_x.common.process import PROCESS

log_ = logging.getLogger("raytrain_x.ray")


def log(info: Any) -> None:
    """Sends `info` (a dict, as Horovod's examples log) to the driver's callbacks."""
    sink = PROCESS.log_sink  # this worker's (queue, rank 0 only), while fn runs
    if sink is None:
        return
    queue, rank0_only = sink
    if rank0_only and os.environ.get("HOROVOD_RANK", "0") != "0":
        return
    queue.put(info)


class _Logged:
    """`fn` run with this worker's values going to `queue`. A class of this module, so the
    worker finds the module by name: a closure would be pickled by value, with a copy of the
    module's globals, and `log` would never see the sink it set."""

    def __init__(self, fn: Callable, queue: Any, rank0_only: bool) -> None:
        self.fn, self.queue, self.rank0_only = fn, queue, rank0_only
        self.__name__ = getattr(fn, "__name__", "logged")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        PROCESS.log_sink = (self.queue, self.rank0_only)
        try:
            return self.fn(*args, **kwargs)
        finally:
            PROCESS.log_sink = None


class Relay:
    """Driver side: a queue the workers log to and a thread that calls `callbacks` with
    each value; `wrap(fn)` gives the function the workers run."""

    POLL_S = 0.2

    def __init__(self, callbacks: Sequence[Callable[[Any], None]], rank0_only: bool) -> None:
        from ray.util.queue import Queue

        self.callbacks = list(callbacks)
        self.rank0_only = rank0_only
        self.queue = Queue(actor_options={"num_cpus": 0})
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._pump, daemon=True,
                                        name="raytrain-x-ray-logger")

    def wrap(self, fn: Callable) -> Callable:
        return _Logged(fn, self.queue, self.rank0_only)

    def __enter__(self) -> Relay:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        try:
            for info in self.queue.get_nowait_batch(self.queue.qsize()):
                self._call(info)
        finally:
            self.queue.shutdown(force=True)

    def _pump(self) -> None:
        from ray.util.queue import Empty

        while not self._stop.is_set():
            try:
                info = self.queue.get(block=True, timeout=self.POLL_S)
            except Empty:
                continue
            except Exception:  # noqa: BLE001 - the queue went with the job; nothing more
                return
            self._call(info)

    def _call(self, info: Any) -> None:
        for cb in self.callbacks:
            try:
                cb(info)
            except Exception:  # a progress callback never stops the training
                log_.exception("raytrain-x: a run() callback raised on %r", info)
