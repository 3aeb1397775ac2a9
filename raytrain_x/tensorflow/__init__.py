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
    rank,
    remove_process_set,
    set_knobs,
    shutdown,
    size,
    transport,
)
from raytrain_x.tensorflow import elastic
from raytrain_x.tensorflow.arrays import unwrap_error
from raytrain_x.tensorflow.compression import Compression
from raytrain_x.tensorflow.functions import (
    allgather_object,
    broadcast_object,
    broadcast_variables,
)
from raytrain_x.tensorflow.gradients import DistributedGradientTape
from raytrain_x.tensorflow.ops import (
    allgather,
    allreduce,
    alltoall,
    broadcast,
    grouped_allreduce,
    reducescatter,
)

__all__ = [name for name in dir() if not name.startswith("_")]
