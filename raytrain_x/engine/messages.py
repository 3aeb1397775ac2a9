"""What ranks tell each other: requests (one per enqueued tensor) and agreed responses."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from raytrain_x.common.process import PROCESS

# Collectives the engine runs; only allreduce goes through the response cache and fusion.
ALLREDUCE, ALLGATHER, BROADCAST, ALLTOALL, REDUCESCATTER, BARRIER = (
    "allreduce", "allgather", "broadcast", "alltoall", "reducescatter", "barrier")


class Handle:
    """Completion of one asynchronous collective; `wait()` returns its output.

    A bare lock, held from creation until the engine completes the handle: cheaper to make
    and to wake than a `threading.Event` (this is on every collective's path). The first
    completion wins.
    """

    __slots__ = ("name", "cycle", "_lock", "_done", "_result", "_error")

    def __init__(self, name: str) -> None:
        self.name = name
        # The engine cycle the collective was agreed in: the same number on every rank
        # (cycles are lockstep), so ranks agree on "before/after a knob change"
        # (`Engine.knobs_at`) without clocks.
        self.cycle = -1
        self._lock = threading.Lock()
        self._lock.acquire()
        self._done = False
        self._result: Any = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._done

    def wait(self, timeout: float | None = None) -> Any:
        """Blocks until the collective finished; raises the error it failed with."""
        if not self._done:
            began = time.perf_counter()
            if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
                raise TimeoutError(f"collective {self.name!r} not done after {timeout}s")
            self._lock.release()  # let any other waiter through
            PROCESS.steps.blocked(time.perf_counter() - began)  # not this rank's own work
        if self._error is not None:
            raise self._error
        return self._result

    def set_result(self, result: Any) -> None:
        if not self._done:
            self._result = result
            self._done = True
            self._lock.release()

    def set_error(self, error: BaseException) -> None:
        if not self._done:
            self._error = error
            self._done = True
            self._lock.release()


@dataclass(frozen=True)
class Meta:
    """The part of a request every rank must agree on (sent during negotiation)."""

    kind: str
    dtype: str
    shape: tuple[int, ...]
    op: str = ""
    root: int = 0
    prescale: float = 1.0
    postscale: float = 1.0
    process_set_id: int = 0
    wire_dtype: str = ""  # compression: dtype on the wire, "" = same as dtype
    device: str = "cpu"
    # alltoall: elements of dim 0 sent to each rank; an allreduce of a TensorFlow chunk:
    # its tensors' shapes, each its rank then its dims (so ranks with different tensors
    # disagree)
    splits: tuple[int, ...] = ()
    # False: a unit its face formed (a bucket, a run of gradients): it crosses the wire as it
    # is, fused with nothing, cut in nothing, in place
    fuse: bool = True
    # The face that submitted it ("torch", "tensorflow"; "" for the core's numpy arrays):
    # ranks that send one name from different frameworks get a clear mismatch error.
    framework: str = ""

    def cache_key(self) -> str:
        """Everything but name/dtype/shape, as the response cache's op string."""
        return (f"{self.kind}|{self.op}|{self.prescale!r}|{self.postscale!r}|"
                f"{self.process_set_id}|{self.wire_dtype}|{self.device}|{int(self.fuse)}|"
                f"{self.framework}|{','.join(map(str, self.splits))}")

    @staticmethod
    def from_cache(entry: dict[str, Any]) -> Meta:
        kind, op, pre, post, pset, wire, device, fuse, framework, splits = entry["op"].split("|")
        return Meta(kind, entry["dtype"], tuple(entry["shape"]), op, 0, float(pre), float(post),
                    int(pset), wire, device, tuple(int(s) for s in splits.split(",") if s),
                    fuse == "1", framework)

    def nbytes_on_wire(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * DTYPE_SIZES[self.wire_dtype or self.dtype]


DTYPE_SIZES = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int32": 4, "int64": 8,
               "int8": 1, "uint8": 1, "bool": 1, "int16": 2}


@dataclass
class Request:
    """One enqueued collective on this rank."""

    name: str
    meta: Meta
    tensor: Any  # input (and, for in-place allreduce/broadcast, output)
    handle: Handle
    output: Any = None
    enqueued_at: float = field(default_factory=time.monotonic)
    reported: bool = False
    stall_reported_at: float = 0.0
    cache_checked: int = -1  # engine cache version of the last lookup
    cache_hit: bool = False
    # the face vouches that `tensor` is one contiguous array (the torch face's allreduces,
    # a unit's buffer): the engine reduces it where it lies without asking its family
    contiguous: bool = False


@dataclass
class Response:
    """A collective every member agreed to run now.

    Attributes:
        rank_dims: allgather: dim 0 of every member; alltoall: every member's splits.
        error: set when ranks disagreed; each member fails its handle with it.
    """

    name: str
    meta: Meta
    rank_dims: tuple[Any, ...] = ()
    error: str = ""
