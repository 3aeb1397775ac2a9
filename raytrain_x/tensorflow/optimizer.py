"""`rx.DistributedOptimizer` of the TensorFlow face: Horovod's, for both kinds of optimizer.

A `tf.compat.v1.train.Optimizer` (TensorFlow 1 graphs, `MonitoredTrainingSession`) gets a
wrapper whose `compute_gradients` returns gradients combined across ranks; a Keras optimizer
gets `raytrain_x.tensorflow.keras.DistributedOptimizer`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from raytrain_x.common.errors import ConfigError
from raytrain_x.core.collectives import Adasum, Average
from raytrain_x.core.process_sets import ProcessSet, global_process_set
from raytrain_x.tensorflow.compression import Compression, Compressor
from raytrain_x.tensorflow.gradients import GradientReducer

_LegacyOptimizer = tf.compat.v1.train.Optimizer


class _LegacyDistributedOptimizer(_LegacyOptimizer):
    """Wraps a `tf.compat.v1.train.Optimizer`: `compute_gradients` combines the gradients
    across ranks; everything else is the wrapped optimizer's."""

    def __init__(self, optimizer: Any, name: str, use_locking: bool,
                 reducer: GradientReducer) -> None:
        super().__init__(name=name, use_locking=use_locking)
        self._optimizer = optimizer
        self._reducer = reducer

    def register_local_var(self, var: Any) -> None:
        """Keeps the gradient of `var` local: not reduced across ranks."""
        self._reducer.register_local_source(var)

    def compute_gradients(self, *args: Any, **kwargs: Any) -> list[tuple[Any, Any]]:
        pairs = self._optimizer.compute_gradients(*args, **kwargs)
        if not pairs:
            return pairs
        grads, variables = zip(*pairs)
        reduced = self._reducer.reduce(list(grads), list(variables))
        return list(zip(reduced, variables))

    def apply_gradients(self, grads_and_vars: Any, global_step: Any = None,
                        name: str | None = None) -> Any:
        return self._optimizer.apply_gradients(grads_and_vars, global_step=global_step,
                                               name=name)

    def get_slot(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.variables(*args, **kwargs)


def DistributedOptimizer(optimizer: Any, name: str | None = None, use_locking: bool = False,
                         device_dense: str = "", device_sparse: str = "",
                         compression: type[Compressor] = Compression.none,
                         sparse_as_dense: bool = False, backward_passes_per_step: int = 1,
                         op: str = Average, gradient_predivide_factor: float = 1.0,
                         average_aggregated_gradients: bool = False, num_groups: int = 0,
                         groups: int | Sequence[Sequence[Any]] | None = None,
                         process_set: ProcessSet = global_process_set,
                         scale_local_gradients: bool = True) -> Any:
    """Horovod's `hvd.DistributedOptimizer` (arguments in its order): gradients combined
    across ranks before they are applied. See `raytrain_x.tensorflow.keras.DistributedOptimizer`
    for Keras optimizers and the arguments."""
    if isinstance(optimizer, _LegacyOptimizer):
        if op == Adasum:
            raise ConfigError("op=Adasum is in the PyTorch face only; use rx.Average")
        if backward_passes_per_step != 1:
            raise ConfigError("backward_passes_per_step > 1 needs a Keras optimizer (or "
                              "accumulate in the graph yourself); a tf.compat.v1 optimizer "
                              "reduces every step")
        reducer = GradientReducer(name or f"Distributed{type(optimizer).__name__}", op,
                                  gradient_predivide_factor, sparse_as_dense, compression,
                                  groups, num_groups, process_set, scale_local_gradients)
        return _LegacyDistributedOptimizer(optimizer,
                                           name or f"Distributed{type(optimizer).__name__}",
                                           use_locking, reducer)
    from raytrain_x.tensorflow.keras.optimizer import DistributedOptimizer as keras_optimizer

    return keras_optimizer(optimizer, name, device_dense, device_sparse, compression,
                           sparse_as_dense, gradient_predivide_factor, op,
                           backward_passes_per_step, average_aggregated_gradients,
                           num_groups, groups, process_set, scale_local_gradients)
