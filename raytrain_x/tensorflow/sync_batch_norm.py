"""`SyncBatchNormalization`: Keras batch normalization whose training statistics cover the
batches of every rank of a process set (Horovod's `hvd.SyncBatchNormalization`).

Each rank sums its count, values and squares per channel; one allreduce (Sum) of the three
gives the combined batch's mean and variance, so the layer normalizes as
`BatchNormalization` would on the concatenated batch. The allreduce is differentiable
(`raytrain_x.tensorflow.collectives`), so gradients flow through the shared statistics.
Inference uses the moving statistics, which are therefore equal on every rank.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf
from tensorflow import keras

from raytrain_x.core.collectives import Sum
from raytrain_x.core.process_sets import ProcessSet, global_process_set
from raytrain_x.tensorflow.collectives import allreduce


class SyncBatchNormalization(keras.layers.BatchNormalization):
    """`keras.layers.BatchNormalization` with statistics over every member's batch.

    Args:
        process_set: the ranks whose batches are combined (default: all).
        **kwargs: as `BatchNormalization` (axis, momentum, epsilon, center, scale, ...).
            Horovod's `fused` is accepted and ignored (Keras 3 has no fused kernel).
    """

    def __init__(self, fused: bool = False, process_set: ProcessSet = global_process_set,
                 **kwargs: Any) -> None:
        kwargs.pop("synchronized", None)  # this layer is synchronized by construction
        super().__init__(**kwargs)
        self.process_set = process_set

    def _moments(self, inputs: tf.Tensor, mask: Any) -> tuple[tf.Tensor, tf.Tensor]:
        axes = self._reduction_axes
        if mask is None:
            count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(inputs), axes)), inputs.dtype)
            total = tf.reduce_sum(inputs, axes)
            squares = tf.reduce_sum(tf.square(inputs), axes)
            count = tf.fill(tf.shape(total), count)
        else:
            weights = tf.cast(tf.broadcast_to(tf.expand_dims(mask, -1), tf.shape(inputs)),
                              inputs.dtype)
            total = tf.reduce_sum(inputs * weights, axes)
            squares = tf.reduce_sum(tf.square(inputs) * weights, axes)
            count = tf.reduce_sum(weights, axes)
        combined = allreduce(tf.stack([count, total, squares]), op=Sum,
                             process_set=self.process_set)
        count, total, squares = tf.unstack(combined)
        count = tf.maximum(count, 1.0)
        mean = total / count
        variance = tf.maximum(squares / count - tf.square(mean), 0.0)
        return mean, variance
