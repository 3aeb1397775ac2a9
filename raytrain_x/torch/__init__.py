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
from raytrain_x.core import (
    Average,
    Max,
    Min,
    ProcessSet,
    Product,
    Sum,
    add_process_set,
    autotune_batch_size,
    barrier,
    cross_rank,
    cross_size,
    global_process_set,
    init,
    is_initialized,
    join,
    knobs,
    local_rank,
    local_size,
    mark_step,
    poll,
    rank,
    remove_process_set,
    set_knobs,
    shutdown,
    size,
    synchronize,
    transport,
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
    allgather,
    allgather_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    reducescatter,
    reducescatter_async,
)
from raytrain_x.torch.optimizer import DistributedOptimizer

__all__ = [name for name in dir() if not name.startswith("_")]
