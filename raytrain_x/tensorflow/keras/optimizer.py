"""`DistributedOptimizer` for Keras 3 optimizers: gradients are averaged in `apply`."""

from __future__ import annotations

from typing import Any

from raytrain_x.common.errors import ConfigError
from raytrain_x.core import collectives as _core
from raytrain_x.core.collectives import Average
from raytrain_x.core.process_sets import ProcessSet, global_process_set
from raytrain_x.tensorflow.compression import Compression, Compressor
from raytrain_x.tensorflow.gradients import reduce_gradients


class _DistributedOptimizer:
    """Mixed in before the wrapped optimizer's class; see `DistributedOptimizer`."""

    _rx_settings: dict[str, Any] = {}

    def apply(self, grads: Any, trainable_variables: Any = None) -> Any:
        settings = self._rx_settings
        grads = reduce_gradients(list(grads), settings["name"], settings["op"],
                                 settings["gradient_predivide_factor"],
                                 settings["sparse_as_dense"], settings["process_set"],
                                 settings["compression"])
        return super().apply(grads, trainable_variables)


def DistributedOptimizer(optimizer: Any, name: str | None = None,
                         compression: type[Compressor] = Compression.none,
                         sparse_as_dense: bool = False, op: str = Average,
                         gradient_predivide_factor: float = 1.0,
                         process_set: ProcessSet = global_process_set) -> Any:
    """A copy of the Keras `optimizer` whose `apply`/`apply_gradients` first average the
    gradients over every rank (Horovod's `hvd.DistributedOptimizer`). `model.fit` uses it
    unchanged. The copy has the same class name and configuration.

    Args:
        optimizer: a Keras 3 optimizer (`tf.keras.optimizers.*`).
        name: prefix of the gradient collectives' names.
        compression: `Compression.fp16` sends floating point gradients as float16.
        sparse_as_dense: densify `tf.IndexedSlices` gradients (embeddings) instead of
            allgathering them.
        op: Average (default), Sum, Min, Max or Product.
        gradient_predivide_factor: divide by this before the sum and by size/factor after.
        process_set: ranks that take part.
    """
    if not (hasattr(optimizer, "apply") and hasattr(optimizer, "get_config")):
        raise ConfigError("DistributedOptimizer wraps a Keras optimizer (keras.optimizers.*), "
                          f"got {type(optimizer).__name__}")
    if isinstance(optimizer, _DistributedOptimizer):
        raise ConfigError("this optimizer is already a DistributedOptimizer")
    base = type(optimizer)
    cls = type(base.__name__, (_DistributedOptimizer, base), {})
    wrapped = cls.from_config(optimizer.get_config())
    wrapped._rx_settings = {
        "name": name or "DistributedOptimizer", "op": _core.resolve_op(op),
        "gradient_predivide_factor": float(gradient_predivide_factor),
        "sparse_as_dense": sparse_as_dense, "process_set": process_set,
        "compression": compression}
    return wrapped
