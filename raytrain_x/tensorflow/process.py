"""What the TensorFlow face keeps in this process, held by `common.process.PROCESS` as all of
raytrain-x's process state is: its asynchronous kernel (the library once loaded, the
kernels of the graphs built, the threads that run them), the chunked allreduces in flight
and the errors a kernel's text refers to. It lives as long as the process: graphs built in
one world run their kernels in the next."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from raytrain_x.common.process import PROCESS


class KernelRunners:
    """Threads that run kernels: one per call in flight (an idle one is reused), so no
    call waits for another to finish before it reaches the engine."""

    def __init__(self) -> None:
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = 0
        self._lock = threading.Lock()

    def submit(self, fn: Callable[[], None]) -> None:
        with self._lock:
            spawn = self._idle == 0
            if not spawn:
                self._idle -= 1
        self._work.put(fn)
        if spawn:
            threading.Thread(target=self._run, name="raytrain-x-tf-kernel", daemon=True).start()

    def _run(self) -> None:
        while True:
            fn = self._work.get()
            fn()
            with self._lock:
                self._idle += 1


@dataclass
class TensorFlowProcess:
    """The TensorFlow face's state in this process (see the module)."""

    # kernel id -> the numpy kernel (arrays in, arrays out), its output dtypes, whether it
    # returns at once (it runs on TensorFlow's thread: no handoff)
    kernels: dict[int, tuple[Callable[..., list[np.ndarray]], list[np.dtype], bool]] = \
        field(default_factory=dict)
    loaded: Any = None  # (the op module, the library) once loaded; False if it cannot be
    lock: threading.Lock = field(default_factory=threading.Lock)  # guards the loading
    runners: KernelRunners = field(default_factory=KernelRunners)
    # a chunked allreduce's token -> its handle, its buffer on the wire, its flat input
    pending: dict[int, tuple[Any, np.ndarray, np.ndarray]] = field(default_factory=dict)
    errors: dict[int, BaseException] = field(default_factory=dict)  # by number


def tf_process() -> TensorFlowProcess:
    """This process's `TensorFlowProcess`, made on first use."""
    state = PROCESS.tensorflow
    if state is None:
        with PROCESS.lock:
            if PROCESS.tensorflow is None:
                PROCESS.tensorflow = TensorFlowProcess()
            state = PROCESS.tensorflow
    return state
