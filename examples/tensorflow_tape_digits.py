"""A custom TensorFlow training loop on scikit-learn's digits: `DistributedGradientTape`
inside `tf.function`.

Run on 2 workers:   raytrain-x run -np 2 python examples/tensorflow_tape_digits.py
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from keras_digits import load_shard  # noqa: E402


def train(epochs: int = 20, batch_size: int = 32, lr: float = 0.05) -> float:
    import tensorflow as tf
    from tensorflow import keras

    import raytrain_x.tensorflow as rx

    rx.init()
    (x, y), (x_test, y_test) = load_shard(rx.rank(), rx.size())
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"),
                              keras.layers.Dense(10)])
    opt = keras.optimizers.SGD(lr * rx.size(), momentum=0.9)
    opt.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    # every rank starts from rank 0's weights and optimizer slots
    rx.broadcast_variables(model.variables + opt.variables, root_rank=0)

    @tf.function
    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        tape = rx.DistributedGradientTape(tape)  # gradients averaged over every rank
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    data = tf.data.Dataset.from_tensor_slices((x, y))
    for epoch in range(epochs):
        total, steps = 0.0, 0
        for xb, yb in data.shuffle(len(x), seed=epoch).batch(batch_size, drop_remainder=True):
            total += float(train_step(xb, yb))
            steps += 1
        mean_loss = float(rx.allreduce(tf.constant(total / steps), name="epoch_loss"))
        if rx.rank() == 0 and (epoch % 5 == 4 or epoch == epochs - 1):
            print(f"epoch {epoch + 1}/{epochs}: loss {mean_loss:.4f}", flush=True)
    predictions = tf.argmax(model(x_test), axis=1).numpy()
    accuracy = float((predictions == y_test).mean())
    if rx.rank() == 0:
        print(f"test accuracy {accuracy:.3f} on {rx.size()} workers", flush=True)
    return accuracy


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="DistributedGradientTape on sklearn digits")
    parser.add_argument("--epochs", type=int, default=20)
    train(parser.parse_args().epochs)
