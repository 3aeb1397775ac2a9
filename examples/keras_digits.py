"""Keras `model.fit` on scikit-learn's bundled digits, data-parallel with raytrain-x.

Two ways to run it on 2 workers:
    raytrain-x run -np 2 python examples/keras_digits.py
    python examples/keras_digits.py --executor      # RayExecutor from a driver script
"""

from __future__ import annotations

import argparse
import os

# quiet TensorFlow's start-up banner on every worker
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def load_shard(rank: int, size: int):
    """This rank's shard of the training split and the whole test split (numpy)."""
    import numpy as np
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    split = int(0.8 * len(x))
    return (x[:split][rank::size], y[:split][rank::size]), (x[split:], y[split:])


def train(epochs: int = 20, batch_size: int = 32, lr: float = 0.05) -> float:
    """Trains and returns the test accuracy (the same on every rank)."""
    return fit(epochs, batch_size, lr)[1]


def fit(epochs: int, batch_size: int, lr: float):
    """The trained model and its test accuracy."""
    from tensorflow import keras

    import raytrain_x.tensorflow.keras as rx

    rx.init()
    (x, y), (x_test, y_test) = load_shard(rx.rank(), rx.size())
    keras.utils.set_random_seed(rx.rank())  # different on purpose: the callback syncs them
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"),
                              keras.layers.Dense(10)])
    scaled_lr = lr * rx.size()
    opt = rx.DistributedOptimizer(keras.optimizers.SGD(scaled_lr, momentum=0.9))
    model.compile(optimizer=opt, metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    callbacks = [
        rx.callbacks.BroadcastGlobalVariablesCallback(0),  # rank 0's initial weights
        rx.callbacks.MetricAverageCallback(),  # logs show the whole job's loss/accuracy
        rx.callbacks.LearningRateWarmupCallback(scaled_lr, warmup_epochs=2),
    ]
    model.fit(x, y, batch_size=batch_size, epochs=epochs, callbacks=callbacks, shuffle=True,
              verbose=2 if rx.rank() == 0 else 0)
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    if rx.rank() == 0:
        print(f"test accuracy {accuracy:.3f} on {rx.size()} workers", flush=True)
    return model, float(accuracy)


def main() -> None:
    parser = argparse.ArgumentParser(description="Keras on sklearn digits with raytrain-x")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--executor", action="store_true",
                        help="start 2 workers with RayExecutor instead of being launched")
    parser.add_argument("--address", default=None, help="Ray cluster (with --executor)")
    a = parser.parse_args()
    if not a.executor:  # launched by `raytrain-x run`: this process is one rank
        train(a.epochs)
        return
    import ray

    from raytrain_x.ray import RayExecutor

    ray.init(address=a.address, include_dashboard=False)
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=2)
    executor.start()
    try:
        accuracies = executor.run(train, kwargs={"epochs": a.epochs})
    finally:
        executor.shutdown()
    print(f"RayExecutor: test accuracy {accuracies[0]:.3f} on {len(accuracies)} workers")


if __name__ == "__main__":
    main()
