"""Horovod's PyTorch API on raytrain-x: `import raytrain_x.torch as rx`.

A Horovod script ports by changing `import horovod.torch as hvd` to this import.
"""

from __future__ import annotations

from raytrain_x.common.checkpoint_config import CheckpointConfig
from raytrain_x.common.errors import (
    ConfigError,
    HostsUpdatedInterrupt,
    InternalError,
    RaytrainXError,
    TensorMismatchError,
    UnsupportedOperationError,
)
from raytrain_x.common.exports import public_names as _public_names
from raytrain_x.core import (
    Adasum,
    Average,
    Max,
    Min,
    ProcessSet,
    Product,
    Sum,
    add_process_set,
    autotune_batch_size,
    barrier,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
    is_initialized,
    join,
    knobs,
    local_rank,
    local_size,
    mark_step,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    poll,
    rank,
    remove_process_set,
    rocm_built,
    set_knobs,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
    synchronize,
    transport,
)
from raytrain_x.torch import elastic, mpi_ops
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
from raytrain_x.torch.compression import Compression
from raytrain_x.torch.functions import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from raytrain_x.torch.grad_sync import Reducer
from raytrain_x.torch.local_steps import DiLoCo, LocalSGD
from raytrain_x.torch.mesh import device_mesh
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
from raytrain_x.torch.optimizer import DistributedOptimizer
from raytrain_x.torch.powersgd import PowerSGD
from raytrain_x.torch.sync_batch_norm import SyncBatchNorm

HorovodInternalError = InternalError  # Horovod's name for a failed peer or transport

__all__ = _public_names(globals(), ("elastic", "mpi_ops"))
