"""Averaging gradients: `DistributedGradientTape` and what the Keras optimizer shares.

All dense gradients of a step go to the engine in one kernel call (one graph op inside
`tf.function`), bucketed by the fusion threshold. `tf.IndexedSlices` gradients (embedding
lookups) are allgathered, or densified and reduced with the rest when `sparse_as_dense`.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from raytrain_x.common.errors import ConfigError
from raytrain_x.core import collectives as _core
from raytrain_x.core.collectives import Average
from raytrain_x.core.process_sets import ProcessSet, global_process_set
from raytrain_x.tensorflow.arrays import check_dtype
from raytrain_x.tensorflow.compression import Compression, Compressor
from raytrain_x.tensorflow.ops import allreduce_sparse, grouped_reduce


def reduce_gradients(grads: list[Any], name: str, op: str, gradient_predivide_factor: float,
                     sparse_as_dense: bool, process_set: ProcessSet,
                     compression: type[Compressor]) -> list[Any]:
    """Every rank's gradients combined by `op` (None stays None), and a step marked for
    autotune."""
    op = _core.resolve_op(op)
    reduce_op, pre, post = _core.predivided(op, gradient_predivide_factor, process_set.size())
    out: list[Any] = list(grads)
    dense = []
    for i, g in enumerate(grads):
        if g is None:
            continue
        if isinstance(g, tf.IndexedSlices):
            if not sparse_as_dense:
                out[i] = allreduce_sparse(g, f"{name}.sparse{i}", op, process_set)
                continue
            g = tf.convert_to_tensor(g)
        check_dtype(g.dtype, "gradient")
        dense.append((i, g))
    reduced = grouped_reduce([g for _, g in dense], name, reduce_op, pre, post, process_set,
                             compression, step=True)
    for (i, _), r in zip(dense, reduced):
        out[i] = r
    return out


class DistributedGradientTape:
    """Wraps a `tf.GradientTape` so that `gradient()` returns gradients averaged (or
    combined by `op`) over every rank, as Horovod's `hvd.DistributedGradientTape`.

    Usage: `tape = rx.DistributedGradientTape(tape)` after the `with tf.GradientTape()`
    block, or `with rx.DistributedGradientTape(tf.GradientTape()) as tape:`; eagerly or
    inside `tf.function`.

    Args:
        gradtape: the tape to wrap.
        compression: `Compression.fp16` sends floating point gradients as float16.
        sparse_as_dense: densify `tf.IndexedSlices` gradients and reduce them with the rest
            (better when most rows are touched); otherwise they are allgathered.
        op: Average (default) or Sum, Min, Max, Product.
        gradient_predivide_factor: divide by this before the sum and by size/factor after.
        process_set: ranks that take part.
    """

    def __init__(self, gradtape: tf.GradientTape, device_dense: str = "",
                 device_sparse: str = "",
                 compression: type[Compressor] = Compression.none,
                 sparse_as_dense: bool = False, op: str = Average,
                 gradient_predivide_factor: float = 1.0,
                 process_set: ProcessSet = global_process_set) -> None:
        if not isinstance(gradtape, tf.GradientTape):
            raise ConfigError("DistributedGradientTape wraps a tf.GradientTape, got "
                              f"{type(gradtape).__name__}")
        self._tape = gradtape
        self._compression = compression
        self._sparse_as_dense = sparse_as_dense
        self._op = _core.resolve_op(op)
        self._predivide = float(gradient_predivide_factor)
        self._process_set = process_set

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
        reduced = reduce_gradients(flat, "DistributedGradientTape", self._op, self._predivide,
                                   self._sparse_as_dense, self._process_set, self._compression)
        return tf.nest.pack_sequence_as(grads, reduced)
