"""Chrome trace (chrome://tracing, Perfetto) of what the engine did, written on rank 0."""

from __future__ import annotations

import json
import os
import threading
import time


class Timeline:
    """Streams complete ('X') events, one row per tensor name, to a JSON array file."""

    def __init__(self, path: str | os.PathLike) -> None:
        self._file = open(path, "w")  # noqa: SIM115 - closed in close()
        self._file.write("[\n")
        self._rows: dict[str, int] = {}
        self._lock = threading.Lock()
        self._origin = time.perf_counter()

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

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.write("{}]\n")
                self._file.close()
