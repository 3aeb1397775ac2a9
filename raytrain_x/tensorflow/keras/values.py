"""Horovod's Keras-level collectives: they take values (numbers, lists, numpy arrays,
tensors) and return the result, as `horovod.keras` / `horovod.tensorflow.keras` do
(eagerly a tensor; in a graph, the value the Keras session computes). The positional order
is Horovod's Keras one: `allreduce(value, name, average, ...)`, where `name` names the
value, not the collective."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from raytrain_x.common.errors import UnsupportedOperationError
from raytrain_x.core.collectives import Average
from raytrain_x.tensorflow import collectives
from raytrain_x.tensorflow.compression import Compression, Compressor
from raytrain_x.tensorflow.functions import broadcast_global_variables as _tf_bcast_global


def _evaluated(result: Any) -> Any:
    if tf.executing_eagerly():
        return result
    return tf.compat.v1.keras.backend.get_session().run(result)


def _constant(value: Any, name: str | None) -> tf.Tensor:
    return tf.convert_to_tensor(value, name=name) if name else tf.convert_to_tensor(value)


def allreduce(value: Any, name: str | None = None, average: bool | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              op: str | None = None, compression: type[Compressor] = Compression.none) -> Any:
    """The allreduce of `value` over every rank (default: the average).

    Args:
        value: the value; the same shape on every rank.
        name: the collective's name, the same on every member; automatic if None.
        average: deprecated Horovod flag: True means `op=Average`, False `op=Sum`; use `op`.
        prescale_factor: multiplies the input before the reduction (Sum and Average).
        postscale_factor: multiplies the result after the reduction (Sum and Average).
        op: Average (default), Sum, Adasum, Min, Max or Product.
        compression: `Compression.fp16` sends floating-point tensors as float16 and casts back.
    """
    return _evaluated(collectives.allreduce(
        _constant(value, name), average=average, compression=compression, op=op,
        prescale_factor=prescale_factor, postscale_factor=postscale_factor))


def allgather(value: Any, name: str | None = None) -> Any:
    """Every rank's `value` concatenated along the first dimension, in rank order.

    Args:
        value: the value; ranks may differ in the first dimension only.
        name: the collective's name, the same on every member; automatic if None.
    """
    return _evaluated(collectives.allgather(_constant(value, name)))


def broadcast(value: Any, root_rank: int, name: str | None = None) -> Any:
    """`root_rank`'s `value` on every rank.

    Args:
        value: the value; the root's is sent.
        root_rank: the global rank whose value every member receives.
        name: the collective's name, the same on every member; automatic if None.
    """
    return _evaluated(collectives.broadcast(_constant(value, name), root_rank))


def reducescatter(value: Any, name: str | None = None, op: str = Average) -> Any:
    """This rank's share (along the first dimension) of the reduction of `value`.

    Args:
        value: the value to reduce; the same shape on every rank.
        name: the collective's name, the same on every member; automatic if None.
        op: Average (default) or Sum.
    """
    return _evaluated(collectives.reducescatter(_constant(value, name), op=op))


def broadcast_global_variables(root_rank: int) -> Any:
    """Assigns `root_rank`'s value to every global variable of the Keras session's graph
    (TensorFlow 1 style Keras); eagerly, use the `BroadcastGlobalVariablesCallback`.

    Args:
        root_rank: the global rank whose values every member takes.
    """
    if tf.executing_eagerly():
        raise UnsupportedOperationError(
            "broadcast_global_variables works on a tf.compat.v1 graph; with eager Keras use "
            "callbacks.BroadcastGlobalVariablesCallback(0)")
    return _evaluated(_tf_bcast_global(root_rank))


def load_model(filepath: str, custom_optimizers: Sequence[type] | None = None,
               custom_objects: dict[str, Any] | None = None,
               compression: type[Compressor] = Compression.none) -> Any:
    """`keras.models.load_model` whose optimizer comes back as a `DistributedOptimizer`,
    with its saved state (slots, iterations) restored.

    Args:
        filepath: the saved model (`.keras`).
        custom_optimizers: optimizer classes of your own, wrapped the same way.
        custom_objects: as for `keras.models.load_model`.
        compression: the compression of the wrapped optimizer.
    """
    from tensorflow import keras

    from raytrain_x.tensorflow.keras.optimizer import distributed_class

    classes = [c for c in vars(keras.optimizers).values()
               if isinstance(c, type) and issubclass(c, keras.optimizers.Optimizer)
               and c is not keras.optimizers.Optimizer]
    classes += list(custom_optimizers or [])
    objects = {c.__name__: distributed_class(c, compression=compression) for c in classes}
    objects.update(custom_objects or {})
    return keras.models.load_model(filepath, custom_objects=objects)
