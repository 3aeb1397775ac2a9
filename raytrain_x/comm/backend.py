"""The interface every collective backend implements, and the registry that picks one.

A `Group` is a communicator over some ranks. Backends move arrays given as numpy arrays or
as any framework's tensors (zero-copy through DLPack or the buffer protocol); the
control-plane helpers here (`allgather_bytes`, `broadcast_bytes`, `broadcast_object`) are
written once, on numpy, for every backend. The built-in backend is torch.distributed's
gloo (CPU) and nccl (CUDA), as in Ray's own `ray.util.collective`; it is imported only
when a group is created, so nothing above this layer needs torch to import.
"""

from __future__ import annotations

import ctypes
import importlib
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from raytrain_x.common.errors import ConfigError


class Group:
    """A communicator over `ranks` (global ranks, sorted); this process is `rank` of `size`.

    Every method is collective over the members and raises `InternalError` when a peer fails
    (connection closed, timeout), so callers never see a backend's own errors. Arrays are
    written in place.
    """

    rank: int
    size: int
    ranks: list[int]

    def allreduce(self, array: Any, op: str = "sum", prescale: float = 1.0,
                  postscale: float = 1.0) -> None:
        """In-place allreduce; `op` is sum, min, max, product or band. A floating point
        array is multiplied by `prescale` before and `postscale` after (an average's
        1/size, as NCCL's PreMulSum scales within the collective), 16-bit floats in
        float32 math, rounded once."""
        raise NotImplementedError

    def allreduce_async(self, array: Any, op: str = "sum",
                        landed: Callable[[], None] | None = None, prescale: float = 1.0,
                        postscale: float = 1.0) -> Callable[[], None]:
        """Starts an in-place allreduce; returns the function that waits for it (and
        raises as `allreduce` would; the array is scaled by `postscale` once it returns).
        `landed`, if given, is called once a started transfer has finished or failed, from
        whichever thread saw it (not when starting it raised). Backends that cannot overlap
        run it now."""
        self.allreduce(array, op, prescale, postscale)
        if landed is not None:
            landed()
        return lambda: None

    def allreduce_control(self, array: Any, op: str) -> None:
        """In-place allreduce of a small control array (a few int64 words: the status
        word) whose cost is the latency of its messages, not their bytes. Backends whose
        allreduce takes O(N) steps in sequence (gloo's ring) do it in O(log N)
        (`doubling.py`); the result is the same."""
        self.allreduce(array, op)

    def broadcast(self, array: Any, root: int) -> None:
        """In-place broadcast from group rank `root`."""
        raise NotImplementedError

    def allgather(self, outputs: list[Any], array: Any) -> None:
        """Gathers equally shaped arrays from every member into `outputs`."""
        raise NotImplementedError

    def alltoall(self, output: Any, array: Any, output_splits: list[int],
                 input_splits: list[int]) -> None:
        """Scatters slices of `array` (dim 0 split by `input_splits`) to every member."""
        raise NotImplementedError

    def reduce_scatter(self, output: Any, array: Any) -> None:
        """Sums `array` over members; member i keeps the i-th of `size` equal chunks."""
        raise NotImplementedError

    def allgather_into(self, output: Any, array: Any) -> None:
        """Every member's equally shaped `array`, member by member along dim 0 of `output`
        (`size` times `array`'s rows)."""
        rows = array.shape[0]
        self.allgather([output[i * rows:(i + 1) * rows] for i in range(self.size)], array)

    def gather(self, outputs: list[Any] | None, array: Any, root: int) -> None:
        """Equally shaped arrays from every member into `outputs` at group rank `root`
        (None elsewhere). Backends without a gather of their own allgather."""
        received = [np.empty_like(np.asarray(array)) for _ in range(self.size)] \
            if outputs is None else outputs
        self.allgather(received, array)

    def barrier(self) -> None:
        raise NotImplementedError

    def close(self, abort: bool = False) -> None:
        """Releases the communicator now, while the interpreter is fully alive.

        Args:
            abort: a peer or this rank failed: end this rank's collectives still under way
                on the device at once (an NCCL communicator's abort) rather than let them
                wait for a peer that will not come until the collective timeout.
        """

    # Control plane, the same for every backend.
    def allgather_bytes(self, payload: bytes) -> list[bytes]:
        """Every member's payload, in group rank order."""
        size = np.array([len(payload)], dtype=np.int64)
        sizes = [np.empty(1, dtype=np.int64) for _ in range(self.size)]
        self.allgather(sizes, size)
        longest = max(int(s[0]) for s in sizes)
        mine = np.zeros(longest, dtype=np.uint8)
        mine[: len(payload)] = np.frombuffer(payload, dtype=np.uint8)
        outs = [np.empty(longest, dtype=np.uint8) for _ in range(self.size)]
        self.allgather(outs, mine)
        return [o[: int(s[0])].tobytes() for o, s in zip(outs, sizes)]

    def gather_bytes(self, payload: bytes, root: int = 0) -> list[bytes] | None:
        """Every member's payload at `root`, in group rank order (None elsewhere): the root
        receives N payloads, every other member sends its own."""
        length = np.array([len(payload)], dtype=np.int64)
        self.allreduce_control(length, "max")
        mine = np.zeros(8 + int(length[0]), dtype=np.uint8)
        mine[:8].view(np.int64)[0] = len(payload)  # each payload's own length first
        mine[8:8 + len(payload)] = np.frombuffer(payload, dtype=np.uint8)
        outs = [np.empty_like(mine) for _ in range(self.size)] if self.rank == root else None
        self.gather(outs, mine, root)
        if outs is None:
            return None
        return [o[8:8 + int(o[:8].view(np.int64)[0])].tobytes() for o in outs]

    def broadcast_bytes(self, payload: bytes | None, root: int = 0) -> bytes:
        """`payload` from `root` on every member."""
        size = np.array([len(payload) if self.rank == root and payload else 0], dtype=np.int64)
        self.broadcast(size, root)
        buf = np.zeros(int(size[0]), dtype=np.uint8)
        if self.rank == root and payload:
            buf[:] = np.frombuffer(payload, dtype=np.uint8)
        if buf.size:
            self.broadcast(buf, root)
        return buf.tobytes()

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        data = pickle.dumps(obj) if self.rank == root else None
        return pickle.loads(self.broadcast_bytes(data, root))

    def vote_all(self, flag: bool) -> bool:
        """True on every member when `flag` is True on every member."""
        vote = np.array([1 if flag else 0], dtype=np.int64)
        self.allreduce_control(vote, "min")
        return bool(vote[0])


class Backend:
    """Creates the groups of one rendezvous round.

    Args (of `create_group`):
        store: the round's rendezvous store (a `raytrain_x.comm.store.ActorStore`, or a
            store the backend itself understands; None for a world of one).
        prefix: key prefix that keeps this group's keys apart from every other group's.
        rank, size, ranks: this process's rank in the group, the group size, and the
            members' global ranks.
        timeout_s: how long a collective may wait for a peer before it fails.
        address: the IP address to listen on for peers ("" = the backend's default).
    """

    name: str

    def create_group(self, store: Any, prefix: str, rank: int, size: int,
                     ranks: Sequence[int], timeout_s: float, address: str = "") -> Group:
        raise NotImplementedError


# name -> "module:attribute" (imported on first use) or a Backend instance
_backends: dict[str, str | Backend] = {
    "torch": "raytrain_x.comm.torch_backend:TorchBackend",
}
DEFAULT_BACKEND = "torch"


def register_backend(name: str, backend: str | Backend | Callable[[], Backend]) -> None:
    """Makes a backend available as `name` (an instance, a factory or "module:attr")."""
    _backends[name] = backend() if callable(backend) and not isinstance(backend, Backend) \
        else backend


def get_backend(name: str = DEFAULT_BACKEND) -> Backend:
    entry = _backends.get(name)
    if entry is None:
        raise ConfigError(f"no collective backend named {name!r}; known: {sorted(_backends)}")
    if isinstance(entry, str):
        module, _, attr = entry.partition(":")
        try:
            entry = getattr(importlib.import_module(module), attr)()
        except ImportError as exc:
            if (exc.name or "raytrain_x").split(".")[0] == "raytrain_x":
                raise
            raise ConfigError(f"the {name!r} collective backend needs {exc.name}, which is "
                              "not installed; install raytrain-x[torch]") from None
        _backends[name] = entry
    return entry


def writable_alias(array: np.ndarray) -> np.ndarray:
    """A writable array over a read-only array's memory, without a copy (a copy only for
    a non-contiguous or empty one). For memory the caller may write or that is only read
    by an API that refuses read-only arrays; the caller keeps `array` alive meanwhile."""
    if not array.flags.c_contiguous or array.size == 0:
        return array.copy()
    raw = (ctypes.c_char * array.nbytes).from_address(array.ctypes.data)
    return np.frombuffer(raw, dtype=array.dtype).reshape(array.shape)


def built_libraries() -> dict[str, bool]:
    """Which collective libraries this installation can use, for Horovod's `*_built()`
    queries: gloo always (torch's, the default backend); nccl and CUDA when the installed
    torch has them. Imports torch lazily, as creating a group does."""
    try:
        torch = importlib.import_module("torch")
        dist = importlib.import_module("torch.distributed")
    except ImportError:
        return {"gloo": False, "nccl": False, "cuda": False}
    return {"gloo": bool(dist.is_gloo_available()),
            "nccl": bool(dist.is_available() and dist.is_nccl_available()),
            "cuda": torch.version.cuda is not None}
