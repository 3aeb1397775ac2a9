"""Elastic Keras on scikit-learn's digits: `model.fit` that survives workers that die or
join, committing its state in memory every few batches.

Run:  raytrain-x run -np 2 --min-np 1 --max-np 3 python examples/keras_elastic_digits.py

Each `fit` call runs one epoch from the first batch not yet committed, so that after a
reset nothing committed is redone and nothing is skipped.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from keras_digits import load_shard  # noqa: E402


def main(epochs: int = 20, batch_size: int = 32, lr: float = 0.05) -> float:
    import numpy as np
    from tensorflow import keras

    import raytrain_x.tensorflow.keras as rx

    rx.init()
    (x, y), (x_test, y_test) = load_shard(0, 1)  # every round shards by its current rank
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"),
                              keras.layers.Dense(10)])
    opt = rx.DistributedOptimizer(keras.optimizers.SGD(lr, momentum=0.9))
    model.compile(optimizer=opt, metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    state = rx.elastic.TensorFlowKerasState(model, epoch=0, batch=0)

    def on_reset():  # the world changed size: rescale the learning rate
        model.optimizer.learning_rate = lr * rx.size()

    state.register_reset_callbacks([on_reset])
    on_reset()
    callbacks = [rx.elastic.CommitStateCallback(state, batches_per_commit=5),
                 rx.elastic.UpdateBatchStateCallback(state),
                 rx.elastic.UpdateEpochStateCallback(state)]

    @rx.elastic.run
    def train(state):
        while state.epoch < epochs:
            order = np.random.default_rng(state.epoch).permutation(len(x))
            shard = order[rx.rank()::rx.size()]
            start = state.batch * batch_size  # batches of this epoch already committed
            model.fit(x[shard][start:], y[shard][start:], batch_size=batch_size, epochs=1,
                      shuffle=False, callbacks=callbacks, verbose=0)
            if rx.rank() == 0:
                print(f"epoch {state.epoch}/{epochs} on {rx.size()} workers", flush=True)
        return model.evaluate(x_test, y_test, verbose=0)[1]

    accuracy = float(train(state))
    if rx.rank() == 0:
        print(f"test accuracy {accuracy:.3f} on {rx.size()} workers", flush=True)
    return accuracy


if __name__ == "__main__":
    main()
