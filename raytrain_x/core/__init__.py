"""The framework-neutral core every face shares: init/shutdown, ranks and sizes, knobs,
process sets, transport, collectives' submission, and objects as bytes.

`raytrain_x.torch` (and later `raytrain_x.tensorflow`) re-export these and add tensors.
"""

from __future__ import annotations

from raytrain_x.core.collectives import (
    Average,
    Max,
    Min,
    Product,
    Sum,
    barrier,
    join,
    poll,
    synchronize,
)
from raytrain_x.core.objects import (
    allgather_bytes,
    allgather_object,
    broadcast_bytes,
    broadcast_object,
)
from raytrain_x.core.process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)
from raytrain_x.core.runtime import (
    autotune_batch_size,
    cross_rank,
    cross_size,
    init,
    is_initialized,
    knobs,
    local_rank,
    local_size,
    mark_step,
    rank,
    set_knobs,
    shutdown,
    size,
    transport,
)

__all__ = [
    "Average",
    "Max",
    "Min",
    "ProcessSet",
    "Product",
    "Sum",
    "add_process_set",
    "allgather_bytes",
    "allgather_object",
    "autotune_batch_size",
    "barrier",
    "broadcast_bytes",
    "broadcast_object",
    "cross_rank",
    "cross_size",
    "global_process_set",
    "init",
    "is_initialized",
    "join",
    "knobs",
    "local_rank",
    "local_size",
    "mark_step",
    "poll",
    "rank",
    "remove_process_set",
    "set_knobs",
    "shutdown",
    "size",
    "synchronize",
    "transport",
]
