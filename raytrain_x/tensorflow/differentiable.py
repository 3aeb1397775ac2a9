"""The TensorFlow face's collectives with Horovod's gradient rules attached (see
`raytrain_x.tensorflow.collectives` for the rules themselves)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from raytrain_x.tensorflow.compression import Compressor


def differentiable(forward: Callable[..., list[tf.Tensor]],
                    backward: Callable[[list[tf.Tensor]], list[tf.Tensor]],
                    inputs: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    """`forward(*inputs)`, with `backward(output grads) -> input grads` as its gradient
    when every input is floating point.

    A `tf.compat.v1` session runs the ops of one `run` that do not depend on each other in
    whatever order its threads pick, and each collective kernel waits in one thread until
    every rank submitted it: two ranks each waiting in a different collective would wait
    forever. So a backward collective runs after its forward one, and a backward of two
    collectives runs them one after the other (`tf.function` orders them by itself)."""
    if not inputs or not all(t.dtype.is_floating for t in inputs):
        return forward(*inputs)

    @tf.custom_gradient
    def fn(*xs):
        outs = forward(*xs)

        def grad(*dys):
            dys = [tf.zeros_like(o) if d is None else d for d, o in zip(dys, outs)]
            # after the forward collective: a session runs independent ops in any order,
            # and two ranks must not each wait in a different collective (see _chained)
            with tf.control_dependencies(outs):
                return backward(dys)

        return outs, grad

    return list(fn(*inputs))


def engine_compressed(compression: Any) -> bool:
    """Compressors of this face compress inside the engine's buffers; any other object
    with Horovod's `compress`/`decompress` runs around the collective."""
    return isinstance(compression, type) and issubclass(compression, Compressor)
