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
from raytrain_x.engine import adasum
from raytrain_x.tensorflow.compression import Compression, Compressor
from raytrain_x.tensorflow.gradients import GradientReducer

_LegacyOptimizer = tf.compat.v1.train.Optimizer


class _Wrapping(_LegacyOptimizer):
    """A v1 optimizer around `self._optimizer`, whose slots and variables are the wrapped
    one's."""

    _optimizer: Any

    def get_slot(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.variables(*args, **kwargs)


class _LegacyDistributedOptimizer(_Wrapping):
    """Wraps a `tf.compat.v1.train.Optimizer`: `compute_gradients` combines the gradients
    across ranks; everything else is the wrapped optimizer's. With
    `backward_passes_per_step=k` (graphs only, as in Horovod) the gradients accumulate in
    variables and every k-th pass communicates and applies them; the other passes only
    count the global step."""

    def __init__(self, optimizer: Any, name: str, use_locking: bool,
                 reducer: GradientReducer, passes: int = 1,
                 average_aggregated: bool = False) -> None:
        super().__init__(name=name, use_locking=use_locking)
        self._optimizer = optimizer
        self._reducer = reducer
        self._passes = passes
        self._average_aggregated = average_aggregated
        self._is_update = None  # the accumulation's "this pass updates" tensor
        self._accumulators: list[Any] = []

    def register_local_var(self, var: Any) -> None:
        """Keeps the gradient of `var` local: not reduced across ranks."""
        self._reducer.register_local_source(var)

    def compute_gradients(self, *args: Any, **kwargs: Any) -> list[tuple[Any, Any]]:
        pairs = self._optimizer.compute_gradients(*args, **kwargs)
        if not pairs:
            return pairs
        grads, variables = zip(*pairs)
        if self._passes == 1:
            reduced = self._reducer.reduce(list(grads), list(variables))
        else:
            reduced = self._accumulated(list(grads), list(variables))
        return list(zip(reduced, variables))

    def _accumulated(self, grads: list[Any], variables: list[Any]) -> list[Any]:
        """Adds this pass's gradients to accumulators; every `passes`-th pass returns their
        sum (or mean) combined across ranks, the other passes zeros (not applied)."""
        if tf.executing_eagerly():
            raise ConfigError("backward_passes_per_step > 1 with a tf.compat.v1 optimizer "
                              "needs a graph (a session); eagerly use a Keras optimizer")
        kept = [(i, tf.convert_to_tensor(g)) for i, g in enumerate(grads) if g is not None]
        with tf.compat.v1.variable_scope(self.get_name() + "_aggregation"):
            self._accumulators = [
                tf.compat.v1.Variable(tf.zeros(g.shape, g.dtype), trainable=False,
                                      name=f"accumulator_{i}") for i, g in kept]
            counter = tf.compat.v1.Variable(0, trainable=False, dtype=tf.int64,
                                            name="passes")
        added = [a.assign_add(g) for a, (_, g) in zip(self._accumulators, kept)]
        with tf.control_dependencies(added):
            count = counter.assign_add(1)
        self._is_update = tf.equal(count % self._passes, 0)

        def communicate() -> list[Any]:
            sums = [tf.convert_to_tensor(a) for a in self._accumulators]
            if self._average_aggregated:
                sums = [a / tf.cast(self._passes, a.dtype) for a in sums]
            return self._reducer.reduce(sums, [variables[i] for i, _ in kept])

        def wait() -> list[Any]:
            return [tf.zeros_like(g) for _, g in kept]

        combined = tf.cond(self._is_update, communicate, wait)
        out: list[Any] = [None] * len(grads)
        for (i, _), c in zip(kept, combined):
            out[i] = c
        return out

    def apply_gradients(self, grads_and_vars: Any, global_step: Any = None,
                        name: str | None = None) -> Any:
        if self._is_update is None:
            return self._optimizer.apply_gradients(grads_and_vars, global_step=global_step,
                                                   name=name)
        grads_and_vars = list(grads_and_vars)

        def update() -> Any:
            applied = self._optimizer.apply_gradients(grads_and_vars, global_step=global_step,
                                                      name=name)
            with tf.control_dependencies([applied]):
                return tf.group(*[a.assign(tf.zeros_like(a)) for a in self._accumulators])

        def count_only() -> Any:  # the global step counts every pass, as in Horovod
            return tf.group(global_step.assign_add(1)) if global_step is not None \
                else tf.no_op()

        return tf.cond(self._is_update, update, count_only)


class _LegacyAdasumOptimizer(_Wrapping):
    """Horovod's Adasum for a `tf.compat.v1.train.Optimizer`: each rank applies its own
    gradients, then every `passes`-th pass the ranks combine the change of each variable
    since the last combination with Adasum and all continue from the combined value (a
    model delta, not a gradient, as in Horovod's `DistributedOptimizer(op=Adasum)`)."""

    def __init__(self, optimizer: Any, name: str, use_locking: bool, passes: int,
                 compression: type[Compressor]) -> None:
        super().__init__(name=name, use_locking=use_locking)
        self._optimizer = optimizer
        self._passes = passes
        self._compression = compression

    def compute_gradients(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.compute_gradients(*args, **kwargs)

    def apply_gradients(self, grads_and_vars: Any, global_step: Any = None,
                        name: str | None = None) -> Any:
        from raytrain_x.tensorflow.collectives import grouped_allreduce

        if tf.executing_eagerly():
            raise ConfigError("op=Adasum with a tf.compat.v1 optimizer needs a graph (a "
                              "session); eagerly use rx.allreduce(..., op=rx.Adasum)")
        pairs = [(g, v) for g, v in grads_and_vars if g is not None]
        variables = [v for _, v in pairs]
        with tf.compat.v1.variable_scope(self.get_name() + "_adasum"):
            starts = [tf.compat.v1.Variable(tf.zeros(v.shape, v.dtype), trainable=False,
                                            name=f"start_{i}") for i, v in enumerate(variables)]
            counter = tf.compat.v1.Variable(0, trainable=False, dtype=tf.int64, name="passes")
        # the first pass starts from the variables' values (broadcast by then)
        first = tf.cond(tf.equal(counter, 0),
                        lambda: tf.group(*[s.assign(v) for s, v in zip(starts, variables)]),
                        tf.no_op)
        with tf.control_dependencies([first]):
            applied = self._optimizer.apply_gradients(pairs, global_step=global_step,
                                                      name=name)
        with tf.control_dependencies([applied]):
            count = counter.assign_add(1)

        def combine() -> Any:
            deltas = [tf.convert_to_tensor(v) - s for v, s in zip(variables, starts)]
            combined = grouped_allreduce(deltas, op=Adasum, compression=self._compression)
            updates = []
            for v, s, d in zip(variables, starts, combined):
                new = s + d
                updates += [v.assign(new), s.assign(new)]
            return tf.group(*updates)

        return tf.cond(tf.equal(count % self._passes, 0), combine, tf.no_op)


def DistributedOptimizer(optimizer: Any, name: str | None = None, use_locking: bool = False,
                         device_dense: str = "", device_sparse: str = "",
                         compression: type[Compressor] = Compression.none,
                         sparse_as_dense: bool = False, backward_passes_per_step: int = 1,
                         op: str = Average, gradient_predivide_factor: float = 1.0,
                         average_aggregated_gradients: bool = False, num_groups: int = 0,
                         groups: int | Sequence[Sequence[Any]] | None = None,
                         process_set: ProcessSet = global_process_set,
                         scale_local_gradients: bool = True, reducer: Any = None) -> Any:
    """Horovod's `hvd.DistributedOptimizer` (arguments in its order): gradients combined
    across ranks before they are applied. See `raytrain_x.tensorflow.keras.DistributedOptimizer`
    for Keras optimizers and the arguments.

    Args:
        optimizer: the optimizer to wrap: a Keras optimizer or a `tf.compat.v1.train.Optimizer`.
        name: prefix of the gradient collectives' names.
        use_locking: accepted for Horovod's signature.
        device_dense: accepted for Horovod's signature (the tensors stay where they are).
        device_sparse: accepted for Horovod's signature, likewise.
        compression: `Compression.fp16` sends floating-point tensors as float16 and casts back.
        sparse_as_dense: densify `tf.IndexedSlices` gradients and reduce them with the rest instead
            of allgathering them.
        backward_passes_per_step: accumulate this many local gradients before each allreduce.
        op: Average (default), Sum or Adasum.
        gradient_predivide_factor: divide by this before the sum and by size / factor after it
            (Average only).
        average_aggregated_gradients: divide the accumulated gradients by
            `backward_passes_per_step`.
        num_groups: split the gradients into this many fused groups (0: the fusion threshold
            decides).
        groups: explicit groups: a list of lists of variables, each reduced as one collective.
        process_set: the ranks that take part (default: every rank).
        scale_local_gradients: with local variables, divide their gradients by the number of
            members.
        reducer: `rx.LocalSGD(...)` or `rx.DiLoCo(...)` for slow links (Keras optimizers).
    """
    if isinstance(optimizer, _LegacyOptimizer):
        if reducer is not None:
            raise ConfigError("reducer= (LocalSGD, DiLoCo) takes a Keras optimizer "
                              "(tf.keras.optimizers.*), not a tf.compat.v1 one")
        if op == Adasum:
            if process_set is not global_process_set:
                raise ConfigError("op=Adasum works on the global process set (as in Horovod)")
            adasum.check_size(process_set.size())
            return _LegacyAdasumOptimizer(optimizer,
                                          name or f"DistributedDelta{type(optimizer).__name__}",
                                          use_locking, int(backward_passes_per_step),
                                          compression)
        if int(backward_passes_per_step) < 1:
            raise ConfigError("backward_passes_per_step must be >= 1, got "
                              f"{backward_passes_per_step}")
        reducer = GradientReducer(name or f"Distributed{type(optimizer).__name__}", op,
                                  gradient_predivide_factor, sparse_as_dense, compression,
                                  groups, num_groups, process_set, scale_local_gradients)
        return _LegacyDistributedOptimizer(optimizer,
                                           name or f"Distributed{type(optimizer).__name__}",
                                           use_locking, reducer, int(backward_passes_per_step),
                                           bool(average_aggregated_gradients))
    from raytrain_x.tensorflow.keras.optimizer import DistributedOptimizer as keras_optimizer

    return keras_optimizer(optimizer, name, device_dense, device_sparse, compression,
                           sparse_as_dense, gradient_predivide_factor, op,
                           backward_passes_per_step, average_aggregated_gradients,
                           num_groups, groups, process_set, scale_local_gradients, reducer)
