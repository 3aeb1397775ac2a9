"""Averaging gradients: `DistributedGradientTape`, `PartialDistributedGradientTape` and what
the optimizers share.

A step's dense gradients go to the engine in the units `gradient_layout` cuts (Horovod's
`groups=` among what decides them), each submitted as soon as its gradients exist, and the
engine fuses the units of a cycle up to the fusion threshold. `tf.IndexedSlices` gradients
(embedding lookups) are allgathered, or densified and reduced with the rest when `sparse_as_dense`.
Gradients of registered local sources are not reduced: they stay this rank's own, divided
by the set's size when `scale_local_gradients` (Horovod's rule).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from raytrain_x.common.errors import ConfigError
from raytrain_x.common.process import PROCESS
from raytrain_x.core import collectives as _core
from raytrain_x.core import runtime
from raytrain_x.core.collectives import Average
from raytrain_x.core.process_sets import ProcessSet, global_process_set
from raytrain_x.tensorflow import kernels
from raytrain_x.tensorflow.arrays import check_dtype
from raytrain_x.tensorflow.chunked_reduce import grouped_reduce
from raytrain_x.tensorflow.compression import Compression, Compressor
from raytrain_x.tensorflow.gradient_layout import check_groups, ref
from raytrain_x.tensorflow.ops import allreduce_sparse

log = logging.getLogger("raytrain_x.tensorflow")


def warn_if_serial_graphs() -> None:
    """Logs once when TensorFlow runs a graph's ops on one thread and raytrain-x's kernels
    could not be built: TensorFlow's concatenation and `tf.numpy_function` then wait behind
    every op of backward, though they were ready long before, so nothing overlaps. Built,
    they run as soon as a chunk exists (`kernels`)."""
    if ("serial graphs" not in PROCESS.warned
            and tf.config.threading.get_inter_op_parallelism_threads() == 1
            and not kernels.available()):
        PROCESS.warned.add("serial graphs")
        log.warning("tf.config.threading inter-op parallelism is 1 and raytrain-x's "
                    "TensorFlow kernels are not built: inside tf.function (model.fit) the "
                    "gradient reductions then start only after backward ends; leave it at "
                    "TensorFlow's default (or >= 2) so they overlap")


class GradientReducer:
    """How a tape or optimizer combines its gradients: the settings Horovod's
    `DistributedGradientTape` and `DistributedOptimizer` share."""

    def __init__(self, name: str, op: str = Average, gradient_predivide_factor: float = 1.0,
                 sparse_as_dense: bool = False,
                 compression: type[Compressor] = Compression.none,
                 groups: int | Sequence[Sequence[Any]] | None = None, num_groups: int = 0,
                 process_set: ProcessSet = global_process_set,
                 scale_local_gradients: bool = True) -> None:
        self.name = name
        self.op = _core.resolve_op(op)
        self.predivide = float(gradient_predivide_factor)
        _core.predivided(self.op, self.predivide, 1)  # the clear error for a bad pair
        self.sparse_as_dense = sparse_as_dense
        self.compression = compression
        self.groups = check_groups(groups, num_groups)
        self.process_set = process_set
        self.scale_local_gradients = scale_local_gradients
        self.local_sources: set[Any] = set()
        warn_if_serial_graphs()

    def register_local_source(self, source: Any) -> None:
        """The gradient of `source` stays this rank's (not reduced)."""
        self.local_sources.add(ref(source))

    def is_local(self, source: Any) -> bool:
        """Whether the gradient of `source` stays this rank's (`register_local_source`)."""
        return ref(source) in self.local_sources

    def reduce(self, grads: Sequence[Any], sources: Sequence[Any] | None = None,
               step: bool = True) -> list[Any]:
        """Every rank's gradients combined by the op (None stays None); `step` marks the
        end of a training step for autotune."""
        grads = list(grads)
        if not _reduces(self.process_set):  # Horovod's rule: the rank's own gradients
            if step:
                runtime.mark_step()
            return grads
        local = [sources is not None and ref(s) in self.local_sources
                 for s in (sources or [None] * len(grads))]
        out: list[Any] = list(grads)
        size = self.process_set.size()
        dense: list[tuple[int, tf.Tensor]] = []
        for i, g in enumerate(grads):
            if g is None:
                continue
            if local[i]:
                out[i] = _divided(g, size) if self.scale_local_gradients else g
                continue
            if isinstance(g, tf.IndexedSlices):
                if not self.sparse_as_dense:
                    out[i] = allreduce_sparse(g, f"{self.name}.sparse{i}", self.op,
                                              self.process_set)
                    continue
                g = tf.convert_to_tensor(g)
            check_dtype(g.dtype, "gradient")
            dense.append((i, g))
        reduce_op, pre, post = _core.predivided(self.op, self.predivide, size)
        if dense:
            reduced = grouped_reduce([g for _, g in dense], self.name, reduce_op, pre, post,
                                     self.process_set, self.compression, step=step,
                                     groups=self.groups,
                                     sources=None if sources is None else
                                     [sources[i] for i, _ in dense])
            for (i, _), r in zip(dense, reduced):
                out[i] = r
        elif step:
            runtime.mark_step()
        return out


def _reduces(process_set: ProcessSet) -> bool:
    """Whether gradients are combined over `process_set` on this rank: a rank outside the
    set, or a set of one, keeps its own (as Horovod's tape and optimizers do), so every
    rank can build the same training step whichever sets it is in."""
    return process_set.included() and process_set.size() > 1


def _divided(grad: Any, size: int) -> Any:
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values / tf.cast(size, grad.values.dtype), grad.indices,
                                grad.dense_shape)
    return grad / tf.cast(size, grad.dtype)


class DistributedGradientTape:
    """Wraps a `tf.GradientTape` so that `gradient()` returns gradients averaged (or
    combined by `op`) over every rank, as Horovod's `hvd.DistributedGradientTape`.

    Usage: `tape = rx.DistributedGradientTape(tape)` after the `with tf.GradientTape()`
    block, or `with rx.DistributedGradientTape(tf.GradientTape()) as tape:`; eagerly or
    inside `tf.function`.

    Args:
        gradtape: the tape to wrap.
        device_dense: where TensorFlow places the ops around dense tensors.
        device_sparse: where TensorFlow places the ops around `tf.IndexedSlices`.
        compression: `Compression.fp16` sends floating point gradients as float16.
        sparse_as_dense: densify `tf.IndexedSlices` gradients and reduce them with the rest
            (better when most rows are touched); otherwise they are allgathered.
        op: Average (default) or Sum, Min, Max, Product.
        gradient_predivide_factor: divide by this before the sum and by size/factor after.
        num_groups: deprecated spelling of `groups=<int>`.
        groups: an int k sends the gradients in k fixed groups of about equal count; lists
            of variables send each list's gradients together (the rest each alone).
        process_set: ranks that take part.
        scale_local_gradients: divide the gradients of local sources
            (`register_local_source`) by the set's size.
    """

    def __init__(self, gradtape: tf.GradientTape, device_dense: str = "",
                 device_sparse: str = "", compression: type[Compressor] = Compression.none,
                 sparse_as_dense: bool = False, op: str = Average,
                 gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                 groups: int | Sequence[Sequence[Any]] | None = None,
                 process_set: ProcessSet = global_process_set,
                 scale_local_gradients: bool = True) -> None:
        if not isinstance(gradtape, tf.GradientTape):
            raise ConfigError("DistributedGradientTape wraps a tf.GradientTape, got "
                              f"{type(gradtape).__name__}")
        self._tape = gradtape
        self._device_dense = device_dense
        self._reducer = GradientReducer("DistributedGradientTape", op,
                                        gradient_predivide_factor, sparse_as_dense,
                                        compression, groups, num_groups, process_set,
                                        scale_local_gradients)

    def register_local_source(self, source: Any) -> None:
        """Keeps the gradient of `source` (a variable) local: not reduced across ranks."""
        self._reducer.register_local_source(source)

    def __enter__(self) -> DistributedGradientTape:
        self._tape.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._tape.__exit__(*exc)

    def __getattr__(self, attr: str) -> Any:  # watch, stop_recording, reset, ...
        return getattr(self._tape, attr)

    def gradient(self, target: Any, sources: Any, output_gradients: Any = None,
                 unconnected_gradients: Any = tf.UnconnectedGradients.NONE) -> Any:
        grads = self._tape.gradient(target, sources, output_gradients, unconnected_gradients)
        flat = tf.nest.flatten(grads, expand_composites=False)
        flat_sources = tf.nest.flatten(sources, expand_composites=False)
        with tf.device(self._device_dense):
            reduced = self._reducer.reduce(flat, flat_sources)
        return tf.nest.pack_sequence_as(grads, reduced)


def PartialDistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "",
                                   device_sparse: str = "",
                                   compression: type[Compressor] = Compression.none,
                                   sparse_as_dense: bool = False, op: str = Average,
                                   gradient_predivide_factor: float = 1.0,
                                   num_groups: int = 0,
                                   groups: int | Sequence[Sequence[Any]] | None = None,
                                   process_set: ProcessSet = global_process_set,
                                   local_layers: Any = None,
                                   scale_local_gradients: bool = True) -> DistributedGradientTape:
    """A `DistributedGradientTape` that keeps the gradients of `local_layers` (Keras layers
    each rank trains on its own) local.

    Args:
        gradtape: the `tf.GradientTape` that recorded the loss.
        device_dense: accepted for Horovod's signature (the tensors stay where they are).
        device_sparse: accepted for Horovod's signature, likewise.
        compression: `Compression.fp16` sends floating-point tensors as float16 and casts back.
        sparse_as_dense: densify `tf.IndexedSlices` gradients and reduce them with the rest instead
            of allgathering them.
        op: Average (default), Sum or Adasum.
        gradient_predivide_factor: divide by this before the sum and by size / factor after it
            (Average only).
        num_groups: split the gradients into this many fused groups (0: the fusion threshold
            decides).
        groups: explicit groups: a list of lists of variables, each reduced as one collective.
        process_set: the ranks that take part (default: every rank).
        local_layers: a Keras layer or a list of them whose gradients stay local.
        scale_local_gradients: divide the local gradients by the number of members, as the others
            are averaged.
    """
    from tensorflow import keras

    if local_layers is None:
        local_layers = []
    elif isinstance(local_layers, keras.layers.Layer):
        local_layers = [local_layers]
    elif not all(isinstance(layer, keras.layers.Layer) for layer in local_layers):
        raise ConfigError("local_layers must be Keras layers (keras.layers.Layer)")
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression,
                                   sparse_as_dense, op, gradient_predivide_factor, num_groups,
                                   groups, process_set, scale_local_gradients)
    for layer in local_layers:
        for var in layer.trainable_weights:
            tape.register_local_source(var)
    return tape
