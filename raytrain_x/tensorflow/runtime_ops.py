"""Horovod's TensorFlow ops for the runtime's values (rank, sizes, process-set membership)
and `join`, usable in graphs."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import tensorflow as tf

from raytrain_x.common.errors import ConfigError
from raytrain_x.core import collectives as _core
from raytrain_x.core import runtime


def _scalar_op(value: Callable[[], int], name: str | None) -> tf.Tensor:
    """An int32 scalar op that reads `value()` when the graph runs, not when it is built
    (Horovod's `rank_op` and friends): a graph built before `init` still works."""
    if tf.executing_eagerly():
        return tf.constant(value(), tf.int32)
    out = tf.numpy_function(lambda: np.int32(value()), [], tf.int32, stateful=True,
                            name=name)
    out.set_shape([])
    return out


def rank_op(name: str | None = None) -> tf.Tensor:
    """This process's rank, read when the op runs.

    Args:
        name: the op's name.
    """
    return _scalar_op(runtime.rank, name)


def local_rank_op(name: str | None = None) -> tf.Tensor:
    """This process's rank on its host, read when the op runs.

    Args:
        name: the op's name.
    """
    return _scalar_op(runtime.local_rank, name)


def size_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """The number of processes of a process set (default: all), read when the op runs.

    Args:
        process_set_id: the process set's id (0: every rank).
        name: the op's name.
    """
    return _scalar_op(lambda: runtime.engine().groups.process_set(process_set_id).size(),
                      name)


def local_size_op(name: str | None = None) -> tf.Tensor:
    """The number of processes on this host, read when the op runs.

    Args:
        name: the op's name.
    """
    return _scalar_op(runtime.local_size, name)


PROCESS_SET_ERROR_INIT = -1
PROCESS_SET_ERROR_UNKNOWN_SET = -2


def process_set_included_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """1 when this process belongs to the process set, 0 when not; -1 before `init`, -2
    for a set that is not registered (Horovod's codes).

    Args:
        process_set_id: the process set's id (0: every rank).
        name: the op's name.
    """
    def included() -> int:
        if not runtime.is_initialized():
            return PROCESS_SET_ERROR_INIT
        try:
            group = runtime.engine().groups.process_set(process_set_id)
        except (KeyError, ConfigError):
            return PROCESS_SET_ERROR_UNKNOWN_SET
        return int(group.included())

    return _scalar_op(included, name)


def join() -> tf.Tensor:
    """Marks this rank as done (it contributes zeros to the others' allreduces until every
    rank joined) and gives the rank that joined last: at once eagerly, when the op runs in
    a graph."""
    return _scalar_op(_core.join, None)
