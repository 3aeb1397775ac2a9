"""Horovod's TensorFlow API on raytrain-x: `import raytrain_x.tensorflow as rx`.

A Horovod script ports by changing `import horovod.tensorflow as hvd` to this import (and
`horovod.tensorflow.keras` to `raytrain_x.tensorflow.keras`). Importing it loads neither
torch nor Ray; `rx.init()` loads torch.distributed, whose gloo is the transport between
hosts (see docs/tensorflow.md).
"""

from __future__ import annotations

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
    knobs,
    local_rank,
    local_size,
    mark_step,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    remove_process_set,
    rocm_built,
    set_knobs,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
    transport,
)
from raytrain_x.tensorflow import elastic
from raytrain_x.tensorflow.arrays import unwrap_error
from raytrain_x.tensorflow.collectives import (
    allgather,
    allreduce,
    alltoall,
    broadcast,
    broadcast_,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    reducescatter,
)
from raytrain_x.tensorflow.compression import Compression
from raytrain_x.tensorflow.functions import (
    BroadcastGlobalVariablesHook,
    allgather_object,
    broadcast_global_variables,
    broadcast_object,
    broadcast_object_fn,
    broadcast_variables,
)
from raytrain_x.tensorflow.gradients import (
    DistributedGradientTape,
    PartialDistributedGradientTape,
)
from raytrain_x.tensorflow.local_steps import DiLoCo, LocalSGD
from raytrain_x.tensorflow.optimizer import DistributedOptimizer
from raytrain_x.tensorflow.runtime_ops import (
    join,
    local_rank_op,
    local_size_op,
    process_set_included_op,
    rank_op,
    size_op,
)
from raytrain_x.tensorflow.sync_batch_norm import SyncBatchNormalization

HorovodInternalError = InternalError  # Horovod's name for a failed peer or transport

__all__ = _public_names(globals())
