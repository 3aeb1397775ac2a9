"""Chrome trace (chrome://tracing, Perfetto) of what the engine did, written on rank 0."""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any


class Timeline:
    """Streams complete ('X') events, one row per tensor name, to a JSON array file."""

    def __init__(self, path: str | os.PathLike, mark_cycles: bool = False) -> None:
        self.path = os.fspath(path)
        self.mark_cycles = mark_cycles
        self._file = open(path, "w")  # noqa: SIM115 - closed in close()
        self._rows: dict[str, int] = {}
        self._lock = threading.Lock()
        self._origin = time.perf_counter()
        start = {"name": "process_name", "ph": "M", "pid": 0,
                 "args": {"name": "raytrain-x rank 0",
                          "start_time_since_epoch_in_micros": int(time.time() * 1e6)}}
        self._file.write("[\n" + json.dumps(start) + ",\n")

    def now(self) -> float:
        return time.perf_counter()

    def record(self, row: str, activity: str, start: float, end: float, **args) -> None:
        """One activity (NEGOTIATE, QUEUE, MEMCPY_IN_FUSION_BUFFER, ALLREDUCE, ...) of a row."""
        with self._lock:
            if self._file.closed:
                return
            tid = self._rows.get(row)
            if tid is None:
                tid = self._rows[row] = len(self._rows) + 1
                meta = {"name": "thread_name", "ph": "M", "pid": 0, "tid": tid,
                        "args": {"name": row}}
                self._file.write(json.dumps(meta) + ",\n")
            event = {"name": activity, "ph": "X", "pid": 0, "tid": tid,
                     "ts": round((start - self._origin) * 1e6, 1),
                     "dur": round((end - start) * 1e6, 1)}
            if args:
                event["args"] = args
            self._file.write(json.dumps(event) + ",\n")

    def queued(self, requests: list[Any], began: float) -> None:
        """A QUEUE span for each request (None: not this rank's), from when it was enqueued
        (`time.monotonic`) until its batch `began` (`perf_counter`)."""
        for req in requests:
            if req is not None:
                self.record(req.name, "QUEUE", req.enqueued_at + _MONO_TO_PERF, began)

    def cycle_start(self, at: float) -> None:
        """An instant 'CYCLE_START' mark (only when the timeline marks cycles)."""
        if not self.mark_cycles:
            return
        with self._lock:
            if not self._file.closed:
                event = {"name": "CYCLE_START", "ph": "i", "s": "g", "pid": 0, "tid": 0,
                         "ts": round((at - self._origin) * 1e6, 1)}
                self._file.write(json.dumps(event) + ",\n")

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.write("{}]\n")
                self._file.close()


_MONO_TO_PERF = time.perf_counter() - time.monotonic()
