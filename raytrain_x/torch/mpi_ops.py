"""`horovod.torch.mpi_ops` under raytrain-x: the collectives and their handles, and
`_basics`, the object Horovod's tests and tools query for the runtime's state.

Scripts that import `from horovod.torch.mpi_ops import allreduce_async_, synchronize` port
by changing the import to `raytrain_x.torch.mpi_ops`.
"""

from __future__ import annotations

from raytrain_x import core
from raytrain_x.core import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
    join,
    poll,
    synchronize,
)
from raytrain_x.core.runtime import engine
from raytrain_x.torch.async_ops import (
    allgather_async,
    allreduce_async,
    allreduce_async_,
    alltoall_async,
    broadcast_async,
    broadcast_async_,
    grouped_allgather_async,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter_async,
    reducescatter_async,
    sparse_allreduce_async,
)
from raytrain_x.torch.ops import (
    allgather,
    allreduce,
    allreduce_,
    alltoall,
    broadcast,
    broadcast_,
    grouped_allgather,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_reducescatter,
    reducescatter,
)


class _Basics:
    """Horovod's `HorovodBasics` as far as scripts reach into it: the runtime's queries by
    attribute, and the registered process sets."""

    def __getattr__(self, name: str):
        value = getattr(core, name, None)
        if value is None or name.startswith("_"):
            raise AttributeError(f"horovod's _basics.{name} has no counterpart in raytrain-x")
        return value

    @staticmethod
    def _get_process_set_ids_and_ranks() -> dict[int, list[int]]:
        """Every registered process set's id and its global ranks, the global set (id 0)
        included."""
        groups = engine().groups
        return {i: list(groups.process_set(i).ranks) for i in sorted(groups.process_set_ids())}


_basics = _Basics()

__all__ = [
    "Adasum", "Average", "Max", "Min", "Product", "Sum", "allgather", "allgather_async",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "alltoall",
    "alltoall_async", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "grouped_allgather", "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter",
    "grouped_reducescatter_async", "join", "poll", "reducescatter", "reducescatter_async",
    "sparse_allreduce_async", "synchronize",
]
