"""Chrome trace (chrome://tracing, Perfetto) of what the engine did, written on rank 0."""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

from raytrain_x.common.process import PROCESS

_END = "{}]\n"
_ORIGIN = time.perf_counter()  # every engine of this process on one time axis


class Timeline:
    """Streams complete ('X') events, one row per tensor name, to a JSON array file, each
    flushed as it is written so the trace can be opened while the job runs (chrome://tracing
    and Perfetto read an array that is not closed yet). A
    later engine of the same process (`init()` again, an elastic reset) adds its events
    to the file as a process of its own ("raytrain-x rank 0, engine 2"), so the trace of
    the round that failed stays."""

    def __init__(self, path: str | os.PathLike, mark_cycles: bool = False) -> None:
        self.path = os.fspath(path)
        self.mark_cycles = mark_cycles
        key = os.path.abspath(self.path)
        self._pid = PROCESS.timelines.get(key, 0)  # engines of this process that wrote it
        PROCESS.timelines[key] = self._pid + 1
        self._file = open(path, "w" if self._pid == 0 else "r+")  # noqa: SIM115 - close()
        if self._pid:  # reopen the array where the engine before closed it
            end = self._file.seek(0, os.SEEK_END)
            self._file.seek(max(0, end - len(_END)))
            if self._file.read() == _END:
                self._file.seek(end - len(_END))
                self._file.truncate()
        self._rows: dict[str, int] = {}
        self._lock = threading.Lock()
        self._origin = _ORIGIN
        name = "raytrain-x rank 0" + (f", engine {self._pid + 1}" if self._pid else "")
        start = {"name": "process_name", "ph": "M", "pid": self._pid,
                 "args": {"name": name,
                          "start_time_since_epoch_in_micros": int(time.time() * 1e6)}}
        # flushed with the first event (a write error then surfaces in the collective that
        # recorded it, as this rank's own failure, not in init())
        self._file.write(("[\n" if self._pid == 0 else "") + json.dumps(start) + ",\n")

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
                meta = {"name": "thread_name", "ph": "M", "pid": self._pid, "tid": tid,
                        "args": {"name": row}}
                self._file.write(json.dumps(meta) + ",\n")
            event = {"name": activity, "ph": "X", "pid": self._pid, "tid": tid,
                     "ts": round((start - self._origin) * 1e6, 1),
                     "dur": round((end - start) * 1e6, 1)}
            if args:
                event["args"] = args
            self._file.write(json.dumps(event) + ",\n")
            self._file.flush()

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
                event = {"name": "CYCLE_START", "ph": "i", "s": "g", "pid": self._pid, "tid": 0,
                         "ts": round((at - self._origin) * 1e6, 1)}
                self._file.write(json.dumps(event) + ",\n")
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.write(_END)
                self._file.close()


_MONO_TO_PERF = time.perf_counter() - time.monotonic()
