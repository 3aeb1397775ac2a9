"""Storage that injects faults, as S3 throttling, a full disk or a crash mid-write produce
them: used by the tests (between real processes) and the simulator, under the same retries
and checks as real storage.

The faults are a plan: a JSON file (`RAYTRAIN_X_STORAGE_FAULTS` names it; `FilePlan`), read
at every operation and changed by whoever runs the test, so a fault can start and stop
while a job runs, its counters taken under a file lock (across processes, `"list": 2`
fails exactly the next two listings); or a dict in memory (`MemoryPlan`: the simulator's).
Its keys, all optional:

    "down": true                  every operation fails (storage unreachable)
    "list"/"read"/"write"/"delete": n   the next n operations of that kind fail (503 SlowDown)
    "full_disk": true             every write fails with ENOSPC
    "torn": n                     the next n uploads succeed, then lose half of a file
    "flip": n                     the next n uploads succeed, then one byte of a file flips
    "zero_metadata": n            the next n uploads succeed, then `.metadata` is zero-filled
                                  at the same size (a crash before the data reached the disk)
    "midway": n                   the next n reads fail after their first chunk (a
                                  connection reset while a file streams)
    "slow_s": x                   every operation waits x seconds first
    "stall": n, "stall_s": x      the next n operations wait x seconds first (the plan's
                                  count says when one has begun waiting)
    "match": "shard_00001"        faults apply only to paths holding this text
    "op": "upload"                faults apply only to this operation (a `Storage` method)
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

from raytrain_x.elastic.storage import Entry, Storage

_KIND = {"list": "list", "read": "read", "chunks": "read", "sizes": "read",
         "download": "read", "publish": "write", "create": "write", "upload": "write",
         "delete": "delete", "delete_file": "delete"}


def write_plan(path: str, **faults: Any) -> None:
    """Sets the faults of the plan at `path` (replacing the file whole)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(faults, f)
    os.replace(tmp, path)


def read_plan(path: str) -> dict[str, Any]:
    """The plan at `path` as it stands, read under the lock its users rewrite it under (read
    without it, a plan being rewritten can read as empty)."""
    with open(path) as f:
        fcntl.flock(f, fcntl.LOCK_SH)
        return json.loads(f.read() or "{}")


def take(plan: dict[str, Any], op: str, path: str) -> tuple[dict[str, Any], bool]:
    """The faults `plan` gives operation `op` on `path`, its counters taken (in place);
    and whether `plan` changed."""
    if (plan.get("match") and plan["match"] not in path) or plan.get("op", op) != op:
        return {}, False
    hit = {k: plan[k] for k in ("down", "full_disk", "slow_s") if plan.get(k)}
    counted = [_KIND[op], "stall"] + \
        (["torn", "flip", "zero_metadata"] if op == "upload" else []) + \
        (["midway"] if op == "chunks" else [])
    changed = False
    for key in counted:
        if plan.get(key, 0) > 0:
            plan[key] -= 1
            hit[key] = True
            changed = True
    if hit.get("stall"):
        hit["stall_s"] = plan.get("stall_s", 0.0)
    return hit, changed


class MemoryPlan:
    """A plan held in this process (`faults`, changed in place by its owner)."""

    def __init__(self, **faults: Any) -> None:
        self.faults: dict[str, Any] = dict(faults)

    def take(self, op: str, path: str) -> dict[str, Any]:
        return take(self.faults, op, path)[0]


class FilePlan:
    """A plan in a JSON file, shared by every process that opens storage (under a lock)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def take(self, op: str, path: str) -> dict[str, Any]:
        try:
            fd = os.open(self.path, os.O_RDWR)
        except FileNotFoundError:
            return {}
        with os.fdopen(fd, "r+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                plan = json.loads(f.read() or "{}")
            except ValueError:
                return {}
            hit, changed = take(plan, op, path)
            if changed:
                f.seek(0)
                f.truncate()
                f.write(json.dumps(plan))
            return hit


class FaultyStorage(Storage):
    """`inner` with the faults of `plan` (a `MemoryPlan`, or a plan file's path) injected."""

    def __init__(self, inner: Storage, plan: str | MemoryPlan | FilePlan,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.inner, self._sleep = inner, sleep
        self.plan = FilePlan(plan) if isinstance(plan, str) else plan

    def _enter(self, op: str, path: str) -> dict[str, Any]:
        hit = self.plan.take(op, path)
        if hit.get("slow_s"):
            self._sleep(float(hit["slow_s"]))
        if hit.get("stall"):
            self._sleep(float(hit.get("stall_s", 0.0)))
        if hit.get("down"):
            raise OSError(errno.EHOSTUNREACH, f"storage unreachable (injected) at {path}")
        if hit.get("full_disk") and _KIND[op] == "write":
            raise OSError(errno.ENOSPC, f"No space left on device (injected) at {path}")
        if hit.get(_KIND[op]):
            raise OSError(f"AWS Error SLOW_DOWN during {op}: 503 SlowDown, please reduce "
                          f"your request rate (injected) at {path}")
        return hit

    def describe(self, path: str = "") -> str:
        return self.inner.describe(path)

    def list(self, folder: str) -> list[Entry]:
        self._enter("list", folder)
        return self.inner.list(folder)

    def read(self, path: str) -> bytes | None:
        self._enter("read", path)
        return self.inner.read(path)

    def chunks(self, path: str, offset: int = 0, length: int | None = None
               ) -> Iterator[bytes]:
        hit = self._enter("chunks", path)
        stream = self.inner.chunks(path, offset, length)
        return _cut_off(stream, path) if hit.get("midway") else stream

    def sizes(self, paths: list[str]) -> list[int | None]:
        self._enter("sizes", paths[0] if paths else "")
        return self.inner.sizes(paths)

    def publish(self, path: str, data: bytes) -> None:
        self._enter("publish", path)
        self.inner.publish(path, data)

    def create(self, path: str, data: bytes) -> bool:
        self._enter("create", path)
        return self.inner.create(path, data)

    def upload(self, local_dir: str, folder: str) -> None:
        hit = self._enter("upload", folder)
        self.inner.upload(local_dir, folder)
        if hit.get("torn") or hit.get("flip") or hit.get("zero_metadata"):
            self._damage(folder, hit)

    def _damage(self, folder: str, hit: dict[str, Any]) -> None:
        """Damages one uploaded file in place: the largest (its data), or `.metadata`."""
        files = [e for e in self.inner.list(folder) if not e.is_dir and e.size > 0]
        if not files:
            return
        if hit.get("zero_metadata"):
            target = next((e for e in files if e.name == ".metadata"), None)
            if target is None:
                return
            data = bytes(target.size)
        else:
            target = max(files, key=lambda e: e.size)
            data = bytearray(self.inner.read(f"{folder}/{target.name}") or b"")
            if hit.get("torn"):
                data = data[:len(data) // 2]
            else:
                data[len(data) // 2] ^= 0x40
        self.inner.publish(f"{folder}/{target.name}", bytes(data))

    def download(self, folder: str, local_dir: str) -> None:
        self._enter("download", folder)
        self.inner.download(folder, local_dir)

    def delete(self, folder: str) -> None:
        self._enter("delete", folder)
        self.inner.delete(folder)

    def delete_file(self, path: str) -> None:
        self._enter("delete_file", path)
        self.inner.delete_file(path)

    def local(self, path: str) -> str | None:
        return self.inner.local(path)


def _cut_off(stream: Iterator[bytes], path: str) -> Iterator[bytes]:
    """`stream`'s first chunk, then the error of a connection reset mid-file."""
    for chunk in stream:
        yield chunk
        break
    raise OSError(errno.ECONNRESET, f"Connection reset while reading (injected) at {path}")
