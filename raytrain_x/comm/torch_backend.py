"""The torch.distributed backend: gloo for host memory, nccl for CUDA tensors.

raytrain-x builds its groups with the c10d constructors directly instead of
`init_process_group`, so it never owns torch's default group: a user script may still use
`torch.distributed` (DDP for instance) beside it, and elastic resets simply drop the old
groups and build new ones. Arrays of any framework arrive here; numpy arrays and DLPack
tensors are wrapped as torch tensors over the same memory (no copy).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from raytrain_x.comm.backend import Backend, Group, writable_alias
from raytrain_x.comm.doubling import EXCHANGE, RECEIVE, SEND, schedule
from raytrain_x.comm.torch_store import group_store
from raytrain_x.common.errors import ConfigError, InternalError, RendezvousTimeout
from raytrain_x.common.process import PROCESS
from raytrain_x.common.settings import GPU_OPERATIONS

log = logging.getLogger("raytrain_x.comm")

# torch.distributed exports every collective's options class but this one
_AllgatherOptions = getattr(dist, "AllgatherOptions", None) or \
    torch._C._distributed_c10d.AllgatherOptions

REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
    "product": dist.ReduceOp.PRODUCT,
    "band": dist.ReduceOp.BAND,
}

# how `TorchGroup.allreduce_control` combines a partner's partial result into its own
COMBINE = {
    "sum": torch.Tensor.add_,
    "min": lambda mine, theirs: torch.minimum(mine, theirs, out=mine),
    "max": lambda mine, theirs: torch.maximum(mine, theirs, out=mine),
    "product": torch.Tensor.mul_,
    "band": torch.Tensor.bitwise_and_,
}

# gloo's tag for the doubling's messages: a collective's slots carry a prefix in their top
# byte, so a point-to-point tag under 2^56 never meets one
DOUBLING_TAG = 0xD0B


def nccl_available() -> bool:
    """True when CUDA tensors can use NCCL in this process."""
    return torch.cuda.is_available() and dist.is_nccl_available()


def as_tensor(array: Any) -> torch.Tensor:
    """`array` as a torch tensor over the same memory."""
    if isinstance(array, torch.Tensor):
        return array
    if isinstance(array, np.ndarray):
        if not array.flags.writeable:
            # only send buffers arrive read-only and gloo only reads those, but torch
            # warns about any read-only array: alias it instead of copying
            array = writable_alias(array)
        return torch.from_numpy(array)
    return torch.from_dlpack(array)


# dtypes gloo has no kernels for: moved as bytes, reduced in a wider type
GLOO_WIDENED = {torch.int16: torch.int32}


# Max and Min of floats through integers of the same width whose order is the floats',
# with NaN above (Max) or below (Min) every number: gloo's and NCCL's own Max/Min keep a NaN
# only from some ranks, and a divergence check by `allreduce(x, op=Max)` would miss it
ORDERED_INTS = {torch.float64: torch.int64, torch.float32: torch.int32,
                torch.float16: torch.int16, torch.bfloat16: torch.int16}


def to_ordered(tensor: torch.Tensor, op: str) -> torch.Tensor:
    """`tensor` (floating) as integers ordered as its values, every NaN the greatest (Max)
    or the least (Min) of them (both still NaN bit patterns when turned back)."""
    ints = ORDERED_INTS[tensor.dtype]
    end = torch.iinfo(ints).max if op == "max" else torch.iinfo(ints).min
    return torch.where(torch.isnan(tensor), end, _flip_negatives(tensor.view(ints)))


def from_ordered(ordered: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The floats `to_ordered` turned into `ordered`."""
    return _flip_negatives(ordered).view(dtype)


def _flip_negatives(bits: torch.Tensor) -> torch.Tensor:
    """Sign-magnitude bits to two's complement order and back (the same map both ways)."""
    mask = torch.iinfo(bits.dtype).max
    return torch.where(bits < 0, bits ^ mask, bits)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A uint8 view of `tensor`'s memory with the same first dimension (rows stay rows, so
    alltoall's row splits still hold); writes through it land in `tensor`."""
    rows = tensor.shape[0] if tensor.dim() else 1
    rest = tensor.numel() // rows if rows else 0
    return tensor.reshape(rows, rest).view(torch.uint8)


def _moved(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as gloo can move it: itself, or its bytes for a dtype gloo lacks."""
    if tensor.dtype in GLOO_WIDENED and tensor.device.type == "cpu":
        return as_bytes(tensor)
    return tensor


# torch tries a gloo full-mesh connect that times out 5 times over, each try with the
# group's timeout (measured with torch 2.13: a peer killed after it published its address
# held the others 5x the timeout, 150 s with the default 30 s). The group is given a fifth
# of the job's timeout, so such a connect fails within the job's timeout; every collective
# passes the job's timeout itself, and store waits keep it (`RayStore.set_timeout`).
GLOO_CONNECT_TRIES = 5


def gloo_options(timeout: timedelta, address: str) -> Any:
    """Gloo's options: listen on `address` (the Ray node's IP) unless `GLOO_SOCKET_IFNAME`
    names interfaces or no address is known; then gloo's own default, the address the
    hostname resolves to. That default is loopback wherever /etc/hosts maps the hostname to
    127.0.x.1, which peers on other hosts cannot reach. The group's own timeout bounds
    its connect (`GLOO_CONNECT_TRIES`)."""
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout / GLOO_CONNECT_TRIES
    interfaces = os.environ.get("GLOO_SOCKET_IFNAME")
    if interfaces:
        options._devices = [dist.ProcessGroupGloo.create_device(interface=name.strip())
                            for name in interfaces.split(",") if name.strip()]
    elif address:
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    else:
        options._devices = [dist.ProcessGroupGloo.create_default_device()]
    options._threads = 2 * len(options._devices)  # what gloo's own default gives a device
    return options


# torch reads it when a gloo group is made (torch 2.13 has no option for it)
_LAZY_INIT_ENV = "TORCH_GLOO_LAZY_INIT"


def lazy_gloo_group(store: Any, rank: int, size: int, timeout: timedelta, address: str) -> Any:
    """A gloo group whose pairs connect when a collective first needs them. Made, a rank
    has published its address (one store call) and waited for no one; a ring allreduce
    then connects 2 peers, a tree broadcast or the barrier log2 N, an alltoall all. A full
    mesh (gloo's default) made every rank wait for, read and connect to every other at
    creation: N^2 connections and 2N^2 store reads a group, whatever the collectives.
    torch 2.13 takes the choice from the environment when the options are made, so only
    that moment sees the variable set."""
    with PROCESS.environ_lock:
        before = os.environ.get(_LAZY_INIT_ENV)
        os.environ[_LAZY_INIT_ENV] = "1"
        try:
            options = gloo_options(timeout, address)
        finally:
            if before is None:
                del os.environ[_LAZY_INIT_ENV]
            else:
                os.environ[_LAZY_INIT_ENV] = before
    return dist.ProcessGroupGloo(store, rank, size, options)


def _gpu_operations() -> str:
    value = str(GPU_OPERATIONS.read()).strip().lower()
    if value not in ("nccl", "gloo"):
        raise ConfigError(f"{GPU_OPERATIONS.env}={value!r}: give nccl (one GPU per rank) or "
                          "gloo (ranks that share a GPU)")
    return value


def _on_landed(work: Any, landed: Callable[[], None] | None) -> None:
    """Calls `landed` once `work` finished or failed (from the backend's thread)."""
    if landed is not None:
        work.get_future().add_done_callback(lambda _: landed())


class TorchGroup(Group):
    """A gloo group and, on first use by a CUDA tensor, an nccl one (gloo carries CUDA
    tensors too where `RAYTRAIN_X_GPU_OPERATIONS=gloo`: ranks sharing one GPU)."""

    def __init__(self, store: Any, rank: int, size: int, timeout_s: float,
                 ranks: Sequence[int], address: str = "") -> None:
        self.rank = rank
        self.size = size
        self.ranks = list(ranks)
        self._timeout = timedelta(seconds=timeout_s)
        self._store = store
        self._gloo = self._call("create gloo group", lazy_gloo_group, store, rank, size,
                                self._timeout, address)
        self._nccl = None
        self._cuda_over_gloo = _gpu_operations() == "gloo"

    def _backend(self, tensor: torch.Tensor) -> Any:
        if tensor.device.type != "cuda" or self._cuda_over_gloo:
            return self._gloo
        if self._nccl is None:
            if not nccl_available():
                raise ConfigError("a CUDA tensor needs NCCL, which this torch build lacks")
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self._timeout
            self._nccl = self._call("create nccl group", dist.ProcessGroupNCCL,
                                    dist.PrefixStore("nccl", self._store), self.rank, self.size,
                                    opts)
        return self._nccl

    @staticmethod
    def _call(what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except RendezvousTimeout as exc:
            # the store's own error, passed through torch unchanged: a peer that did not
            # come is a lost peer, as a failed connect is (elastic jobs restore and re-form)
            raise InternalError(f"{what} failed: {exc}") from exc
        except RuntimeError as exc:  # DistBackendError, DistNetworkError, gloo timeouts
            text = str(exc).strip() or type(exc).__name__
            first = text.splitlines()[0].split(" This is typically")[0][:300]
            raise InternalError(
                f"{what} failed: {first}. A peer process probably died or stalled; elastic "
                "jobs restore the last commit, others should be restarted."
            ) from exc

    def allreduce(self, array: Any, op: str = "sum", prescale: float = 1.0,
                  postscale: float = 1.0) -> None:
        self.allreduce_async(array, op, None, prescale, postscale)()

    def allreduce_async(self, array: Any, op: str = "sum",
                        landed: Callable[[], None] | None = None, prescale: float = 1.0,
                        postscale: float = 1.0) -> Callable[[], None]:
        tensor = as_tensor(array)
        if prescale != 1.0:
            tensor.mul_(prescale)  # torch's 16-bit floats: float32 math, rounded once
        if postscale != 1.0:
            reduced = self.allreduce_async(tensor, op, landed)

            def scaled() -> None:
                reduced()
                tensor.mul_(postscale)
            return scaled
        if op in ("max", "min") and tensor.dtype in ORDERED_INTS:
            ordered = to_ordered(tensor, op)
            reduced = self.allreduce_async(ordered, op, landed)

            def unordered() -> None:
                reduced()
                tensor.copy_(from_ordered(ordered, tensor.dtype))
            return unordered
        opts = dist.AllreduceOptions()
        opts.reduceOp = REDUCE_OPS[op]
        opts.timeout = self._timeout
        pg = self._backend(tensor)
        wide = GLOO_WIDENED.get(tensor.dtype) if tensor.device.type == "cpu" else None
        if wide is not None:
            work_tensor = tensor.to(wide)
            work = self._call("allreduce", lambda: pg.allreduce([work_tensor], opts))
            _on_landed(work, landed)

            def finish() -> None:
                self._call("allreduce", work.wait)
                tensor.copy_(work_tensor)
            return finish
        work = self._call("allreduce", lambda: pg.allreduce([tensor], opts))
        _on_landed(work, landed)
        return lambda: self._call("allreduce", lambda: (work.wait(), tensor))

    def allreduce_control(self, array: Any, op: str) -> None:
        tensor = as_tensor(array)
        if tensor.device.type != "cpu" or tensor.dtype in GLOO_WIDENED:
            self.allreduce(tensor, op)
            return
        self._call("allreduce", self._doubling, tensor, op)

    def _doubling(self, tensor: torch.Tensor, op: str) -> None:
        """Recursive doubling (`doubling.schedule`) over gloo's point-to-point messages,
        sent from this thread: quicker than gloo's ring at every size measured, 2 ranks
        included, since gloo runs a collective on its own worker threads
        (`benchmarks/status_word.py`)."""
        combine, theirs = COMBINE[op], torch.empty_like(tensor)
        for step in schedule(self.rank, self.size):
            sent = None
            if step.kind in (SEND, EXCHANGE):
                sent = self._gloo.send([tensor], step.peer, DOUBLING_TAG)
            if step.kind in (RECEIVE, EXCHANGE):
                into = tensor if step.final else theirs
                self._gloo.recv([into], step.peer, DOUBLING_TAG).wait(self._timeout)
            if sent is not None:
                sent.wait(self._timeout)  # gloo reads the array until then
            if step.kind in (RECEIVE, EXCHANGE) and not step.final:
                combine(tensor, theirs)

    def broadcast(self, array: Any, root: int) -> None:
        tensor = as_tensor(array)
        opts = dist.BroadcastOptions()
        opts.timeout = self._timeout
        opts.rootRank = root
        opts.rootTensor = 0
        pg = self._backend(tensor)
        moved = _moved(tensor)
        self._call("broadcast", lambda: pg.broadcast([moved], opts).wait())

    def allgather(self, outputs: list[Any], array: Any) -> None:
        tensor = as_tensor(array)
        pg = self._backend(tensor)
        outs = [_moved(as_tensor(o)) for o in outputs]
        moved = _moved(tensor)
        opts = _AllgatherOptions()
        opts.timeout = self._timeout
        self._call("allgather", lambda: pg.allgather([outs], [moved], opts).wait())

    def alltoall(self, output: Any, array: Any, output_splits: list[int],
                 input_splits: list[int]) -> None:
        tensor, out = as_tensor(array), as_tensor(output)
        pg = self._backend(tensor)
        tensor, out = _moved(tensor), _moved(out)
        opts = dist.AllToAllOptions()
        opts.timeout = self._timeout
        self._call("alltoall", lambda: pg.alltoall_base(out, tensor, output_splits,
                                                        input_splits, opts).wait())

    def _staged(self, tensor: torch.Tensor) -> bool:
        """True for a CUDA tensor that gloo carries (ranks sharing a GPU): gloo moves device
        memory itself (pinned, pipelined copies) in allreduces, broadcasts and alltoalls,
        but reduce-scatters and allgathers it only through a host copy of the whole."""
        return tensor.device.type == "cuda" and self._cuda_over_gloo

    def reduce_scatter(self, output: Any, array: Any) -> None:
        tensor, out = as_tensor(array), as_tensor(output)
        if self._staged(tensor):
            self.reduce_scatter_by_alltoall(out, tensor)
            return
        wide = GLOO_WIDENED.get(tensor.dtype) if tensor.device.type == "cpu" else None
        if wide is not None:
            wide_out = torch.empty(out.shape, dtype=wide)
            self.reduce_scatter(wide_out, tensor.to(wide))
            out.copy_(wide_out)
            return
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        opts.timeout = self._timeout
        pg = self._backend(tensor)
        self._call("reduce_scatter", lambda: pg._reduce_scatter_base(out, tensor, opts).wait())

    def allgather_into(self, output: Any, array: Any) -> None:
        tensor, out = as_tensor(array), as_tensor(output)
        if self._staged(tensor):
            self.gather_by_broadcasts(out, tensor)
            return
        pg = self._backend(tensor)
        rows = tensor.shape[0]
        if out[self.rank * rows:(self.rank + 1) * rows].data_ptr() == tensor.data_ptr() \
                and pg is self._gloo:
            tensor = tensor.clone()  # gloo copies the input into its slot: not onto itself
        moved, out_moved = _moved(tensor), _moved(out)
        opts = _AllgatherOptions()
        opts.timeout = self._timeout
        self._call("allgather", lambda: pg._allgather_base(out_moved, moved, opts).wait())

    def reduce_scatter_by_alltoall(self, out: torch.Tensor, tensor: torch.Tensor) -> None:
        """A reduce-scatter as an alltoall (each member receives every member's copy of its
        own share) and a sum of those copies where they are (`_staged`)."""
        received = torch.empty_like(tensor)
        self.alltoall(received, tensor, [], [])
        torch.sum(received.reshape(self.size, *out.shape), dim=0, dtype=out.dtype, out=out)

    def gather_by_broadcasts(self, out: torch.Tensor, tensor: torch.Tensor) -> None:
        """An allgather into `out` as one broadcast per member from its own block, all in
        flight at once (`_staged`)."""
        rows = tensor.shape[0]
        mine = out[self.rank * rows:(self.rank + 1) * rows]
        if mine.data_ptr() != tensor.data_ptr():
            mine.copy_(tensor)
        pg = self._backend(tensor)
        works = []
        for root in range(self.size):
            opts = dist.BroadcastOptions()
            opts.timeout = self._timeout
            opts.rootRank = root
            opts.rootTensor = 0
            block = _moved(out[root * rows:(root + 1) * rows])
            works.append(self._call("allgather", pg.broadcast, [block], opts))
        for work in works:
            self._call("allgather", work.wait)

    def gather(self, outputs: list[Any] | None, array: Any, root: int) -> None:
        tensor = as_tensor(array)
        pg = self._backend(tensor)
        opts = dist.GatherOptions()
        opts.rootRank = root
        opts.timeout = self._timeout
        outs = [[_moved(as_tensor(o)) for o in outputs]] if outputs is not None else []
        moved = _moved(tensor)
        self._call("gather", lambda: pg.gather(outs, [moved], opts).wait())

    def barrier(self) -> None:
        opts = dist.BarrierOptions()
        opts.timeout = self._timeout
        self._call("barrier", lambda: self._gloo.barrier(opts).wait())

    def close(self, abort: bool = False) -> None:
        nccl, self._nccl = self._nccl, None
        self._gloo = None
        if nccl is not None and abort:
            _abort_nccl(nccl)


def _abort_nccl(group: Any) -> None:
    """Aborts an NCCL communicator (TorchFT does the same when a peer dies): the kernels of
    its collectives still on this rank's streams end, instead of waiting for the peer until
    NCCL's timeout. Dropping the reference does not: the communicator lives on, its
    kernels spinning."""
    try:
        group.abort()
    except Exception as exc:  # noqa: BLE001 - the group is being dropped either way
        log.warning("raytrain-x: aborting an NCCL communicator failed: %s", exc)


class TorchBackend(Backend):
    name = "torch"

    def create_group(self, store: Any, prefix: str, rank: int, size: int,
                     ranks: Sequence[int], timeout_s: float, address: str = "") -> Group:
        return TorchGroup(group_store(store, prefix), rank, size, timeout_s, ranks, address)
