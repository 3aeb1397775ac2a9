"""A call repeated on a daemon thread: the status file, the metrics exporters and the
progress line each run one."""

from __future__ import annotations

import threading
from collections.abc import Callable

QUICK_S = 0.5  # how often a call repeats while it waits for its first news (`settled`)


class Every:
    """Calls `fn()` every `interval_s` seconds on a daemon thread named `name`, from
    `start()` until `stop()` (which waits for a call under way to end). With `settled`, it
    calls every `QUICK_S` until `settled()` first holds (a job's first step is shown within
    a second, not an interval later), then every `interval_s`."""

    def __init__(self, interval_s: float, fn: Callable[[], None], name: str,
                 settled: Callable[[], bool] | None = None) -> None:
        self.interval_s, self.fn = interval_s, fn
        self._settled = settled
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> Every:
        self._thread.start()
        return self

    def stop(self, timeout_s: float | None = None) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def _run(self) -> None:
        while not self._stop.wait(self._wait()):
            self.fn()

    def _wait(self) -> float:
        if self._settled is None:
            return self.interval_s
        if self._settled():
            self._settled = None
            return self.interval_s
        return min(QUICK_S, self.interval_s)
