"""Horovod's PyTorch API on raytrain-x: `import raytrain_x.torch as rx`.

A Horovod script ports by changing `import horovod.torch as hvd` to this import.
"""

from __future__ import annotations

from raytrain_x.common.errors import (
    ConfigError,
    HostsUpdatedInterrupt,
    InternalError,
    RaytrainXError,
    TensorMismatchError,
)
from raytrain_x.fusion import runtime as _runtime
from raytrain_x.fusion.runtime import (
    ProcessSet,
    add_process_set,
    autotune_batch_size,
    global_process_set,
    init,
    is_initialized,
    mark_step,
    remove_process_set,
    shutdown,
)
from raytrain_x.torch import elastic
from raytrain_x.torch.compression import Compression
from raytrain_x.torch.functions import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from raytrain_x.torch.ops import (
    Average,
    Max,
    Min,
    Product,
    Sum,
    allgather,
    allgather_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    join,
    poll,
    reducescatter,
    reducescatter_async,
    synchronize,
)
from raytrain_x.torch.optimizer import DistributedOptimizer


def rank() -> int:
    """Global rank of this worker."""
    return _runtime.rendezvous().rank


def size() -> int:
    """Number of workers."""
    return _runtime.rendezvous().size


def local_rank() -> int:
    """Rank among the workers on this host."""
    return _runtime.rendezvous().local_rank


def local_size() -> int:
    return _runtime.rendezvous().local_size


def cross_rank() -> int:
    """Index of this worker's host."""
    return _runtime.rendezvous().cross_rank


def cross_size() -> int:
    """Number of hosts."""
    return _runtime.rendezvous().cross_size


def knobs():
    """The communication knobs in effect now."""
    return _runtime.engine().knobs


def transport() -> str:
    """How world allreduces travel: 'shm' (shared memory, every rank on one host) or
    'gloo'. Set `RAYTRAIN_X_SHM=0` to force gloo."""
    return _runtime.engine().transport


def set_knobs(new_knobs) -> None:
    """Requests new knobs; rank 0's request switches every rank at the same cycle (other
    ranks' requests are ignored)."""
    _runtime.engine().request_knobs(new_knobs)


__all__ = [name for name in dir() if not name.startswith("_")]
