"""Process groups over torch.distributed: gloo for CPU tensors, nccl for CUDA tensors.

raytrain-x builds its groups with the c10d constructors directly instead of
`init_process_group`, so it never owns torch's default group: a user script may still use
`torch.distributed` (DDP for instance) beside it, and elastic resets simply drop the old
groups and build new ones.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from raytrain_x.comm.rendezvous import Rendezvous
from raytrain_x.common.errors import ConfigError, InternalError

REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
    "product": dist.ReduceOp.PRODUCT,
    "band": dist.ReduceOp.BAND,
}


def nccl_available() -> bool:
    """True when CUDA tensors can use NCCL in this process."""
    return torch.cuda.is_available() and dist.is_nccl_available()


class Group:
    """A communicator over some ranks: a gloo group and, on GPU hosts, an nccl one.

    Every method is collective over the group's members and raises `InternalError` when a
    peer fails (connection closed, timeout), so callers never see torch's own errors.
    """

    def __init__(self, store: Any, rank: int, size: int, timeout_s: float, ranks: Sequence[int]):
        self.rank = rank
        self.size = size
        self.ranks = list(ranks)
        self._timeout = timedelta(seconds=timeout_s)
        self._store = store
        self._gloo = self._call("create gloo group", dist.ProcessGroupGloo, store, rank, size,
                                self._timeout)
        self._nccl = None

    def _backend(self, tensor: torch.Tensor) -> Any:
        if tensor.device.type != "cuda":
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
        except RuntimeError as exc:  # DistBackendError, DistNetworkError, gloo timeouts
            text = str(exc).strip() or type(exc).__name__
            first = text.splitlines()[0].split(" This is typically")[0][:300]
            raise InternalError(
                f"{what} failed: {first}. A peer process probably died or stalled; elastic "
                "jobs restore the last commit, others should be restarted."
            ) from exc

    def allreduce(self, tensor: torch.Tensor, op: str = "sum") -> None:
        """In-place allreduce."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = REDUCE_OPS[op]
        pg = self._backend(tensor)
        self._call("allreduce", lambda: pg.allreduce([tensor], opts).wait())

    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        """In-place broadcast from group rank `root`."""
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        opts.rootTensor = 0
        pg = self._backend(tensor)
        self._call("broadcast", lambda: pg.broadcast([tensor], opts).wait())

    def allgather(self, outputs: list[torch.Tensor], tensor: torch.Tensor) -> None:
        """Gathers equally shaped tensors from every member into `outputs`."""
        pg = self._backend(tensor)
        self._call("allgather", lambda: pg.allgather([outputs], [tensor]).wait())

    def alltoall(
        self,
        output: torch.Tensor,
        tensor: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
    ) -> None:
        """Scatters slices of `tensor` (first dim split by `input_splits`) to every member."""
        pg = self._backend(tensor)
        opts = dist.AllToAllOptions()
        self._call("alltoall", lambda: pg.alltoall_base(output, tensor, output_splits,
                                                        input_splits, opts).wait())

    def close(self) -> None:
        """Drops the backends now, while the interpreter is fully alive."""
        self._gloo = None
        self._nccl = None

    def reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor) -> None:
        """Sums `tensor` over members; member i keeps the i-th of `size` equal chunks."""
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        pg = self._backend(tensor)
        self._call("reduce_scatter", lambda: pg._reduce_scatter_base(output, tensor, opts).wait())

    def barrier(self) -> None:
        self._call("barrier", lambda: self._gloo.barrier().wait())

    def allgather_bytes(self, payload: bytes) -> list[bytes]:
        """Every member's payload, in group rank order (control plane, CPU)."""
        size = torch.tensor([len(payload)], dtype=torch.int64)
        sizes = [torch.empty(1, dtype=torch.int64) for _ in range(self.size)]
        self.allgather(sizes, size)
        longest = max(int(s.item()) for s in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        if payload:
            mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        outs = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.size)]
        self.allgather(outs, mine)
        return [o[: int(s.item())].numpy().tobytes() for o, s in zip(outs, sizes)]

    def broadcast_bytes(self, payload: bytes | None, root: int = 0) -> bytes:
        """`payload` from `root` on every member (control plane, CPU)."""
        size = torch.tensor([len(payload) if self.rank == root and payload else 0])
        self.broadcast(size, root)
        buf = torch.empty(int(size.item()), dtype=torch.uint8)
        if self.rank == root and payload:
            buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        if buf.numel():
            self.broadcast(buf, root)
        return buf.numpy().tobytes()

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        data = pickle.dumps(obj) if self.rank == root else None
        return pickle.loads(self.broadcast_bytes(data, root))


@dataclass
class ProcessSet:
    """A subset of ranks that runs collectives among themselves (Horovod's process sets).

    Attributes:
        process_set_id: 0 is the global set.
        ranks: global ranks of the members, sorted.
    """

    process_set_id: int
    ranks: list[int]
    group: Group | None = None  # None on non-members

    def included(self) -> bool:
        return self.group is not None

    def size(self) -> int:
        return len(self.ranks)

    def rank(self) -> int:
        """This process's rank inside the set (-1 when not a member)."""
        return self.group.rank if self.group is not None else -1


class ProcessGroups:
    """All communicators of one rendezvous round: global, local, cross and process sets."""

    def __init__(self, rdv: Rendezvous) -> None:
        self.rdv = rdv
        store = rdv.store if rdv.store is not None else dist.HashStore()
        self._store = dist.PrefixStore(f"rtx/round{rdv.round}", store)
        self.world = Group(dist.PrefixStore("world", self._store), rdv.rank, rdv.size,
                           rdv.timeout_s, range(rdv.size))
        layout = self.world.allgather_bytes(pickle.dumps((rdv.local_rank, rdv.cross_rank)))
        self.layout: list[tuple[int, int]] = [pickle.loads(x) for x in layout]
        self._local: Group | None = None
        self._cross: Group | None = None
        self._sets: dict[int, ProcessSet] = {0: ProcessSet(0, list(range(rdv.size)), self.world)}
        self._next_set_id = 1

    @property
    def local(self) -> Group:
        """Group of the ranks on this host (built on first use, collectively)."""
        if self._local is None:
            ranks = [r for r, (_, cross) in enumerate(self.layout) if cross == self.rdv.cross_rank]
            self._local = self._subgroup(f"local{self.rdv.cross_rank}", ranks)
        return self._local

    @property
    def cross(self) -> Group:
        """Group of the ranks with this local rank on every host."""
        if self._cross is None:
            ranks = [r for r, (local, _) in enumerate(self.layout) if local == self.rdv.local_rank]
            self._cross = self._subgroup(f"cross{self.rdv.local_rank}", ranks)
        return self._cross

    def homogeneous(self) -> bool:
        """True when every host runs the same number of workers (hierarchical ops need it)."""
        per_host: dict[int, int] = {}
        for _, cross in self.layout:
            per_host[cross] = per_host.get(cross, 0) + 1
        return len(set(per_host.values())) == 1

    def _subgroup(self, prefix: str, ranks: list[int]) -> Group:
        return Group(dist.PrefixStore(prefix, self._store), ranks.index(self.rdv.rank),
                     len(ranks), self.rdv.timeout_s, ranks)

    def close(self) -> None:
        """Releases every communicator of this round (the store last)."""
        for ps in self._sets.values():
            if ps.group is not None and ps.group is not self.world:
                ps.group.close()
        for group in (self._local, self._cross, self.world):
            if group is not None:
                group.close()
        self._sets.clear()
        self._local = self._cross = None
        self._store = None

    def add_process_set(self, ranks: Sequence[int]) -> ProcessSet:
        """Registers a process set; every rank must call it with the same ranks, in the same
        order of calls. Returns the set (with a group only on members)."""
        members = sorted(set(int(r) for r in ranks))
        if not members or members[0] < 0 or members[-1] >= self.rdv.size:
            raise ConfigError(f"process set ranks {list(ranks)} must be within "
                              f"0..{self.rdv.size - 1}")
        if len(members) != len(list(ranks)):
            raise ConfigError(f"process set ranks {list(ranks)} contain duplicates")
        for existing in self._sets.values():
            if existing.ranks == members:
                raise ConfigError(f"a process set with ranks {members} already exists "
                                  f"(id {existing.process_set_id})")
        set_id = self._next_set_id
        self._next_set_id += 1
        group = self._subgroup(f"set{set_id}", members) if self.rdv.rank in members else None
        ps = ProcessSet(set_id, members, group)
        self._sets[set_id] = ps
        return ps

    def remove_process_set(self, process_set_id: int) -> None:
        if process_set_id == 0:
            raise ConfigError("the global process set (id 0) cannot be removed")
        if self._sets.pop(process_set_id, None) is None:
            raise ConfigError(f"no process set with id {process_set_id}")

    def process_set(self, process_set_id: int) -> ProcessSet:
        try:
            return self._sets[process_set_id]
        except KeyError:
            raise ConfigError(f"no process set with id {process_set_id}; create it with "
                              "add_process_set on every rank first") from None
