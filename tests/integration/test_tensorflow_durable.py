"""Durable checkpoints in the TensorFlow/Keras face: written by rank 0 in the background in
`tf.train.Checkpoint` format, read by plain TensorFlow, and restored by a new job of
another size when no worker holds the state."""

from __future__ import annotations

import os

import numpy as np

from raytrain_x.common.checkpoint_config import CheckpointConfig
from raytrain_x.elastic.checkpoints import CheckpointStore
from tests.workers import run_workers

ENV = {"TF_CPP_MIN_LOG_LEVEL": "3", "TF_NUM_INTRAOP_THREADS": "1",
       "TF_NUM_INTEROP_THREADS": "2"}


def _keras_train(storage: str, steps: int, checkpoint_at: tuple[int, ...] = ()) -> dict:
    """A Keras model and Adam trained to `steps` with a commit per step, from the latest
    durable checkpoint where one exists; `state.checkpoint()` after the steps in
    `checkpoint_at`."""
    import tensorflow as tf
    from tensorflow import keras

    import raytrain_x.tensorflow.keras as hvd

    hvd.init()
    keras.utils.set_random_seed(100 + hvd.rank())  # the ranks start apart
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3),
                              keras.layers.Dense(1)])
    opt = keras.optimizers.Adam(0.05)
    config = CheckpointConfig(storage, name="keras", every_s=1e9)
    state = hvd.elastic.KerasState(model, opt, checkpoint=config, step=0, seen=[])
    started_at: list[int] = []

    @hvd.elastic.run
    def train(state):
        started_at.append(state.step)
        while state.step < steps:
            x = tf.constant(np.full((2, 4), state.step + 1.0, np.float32))
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x) - 1.0))
            tape = hvd.DistributedGradientTape(tape)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            state.step += 1
            state.seen = [*state.seen, state.step]
            state.commit()
            if state.step in checkpoint_at:
                state.checkpoint()

    train(state)
    restored = getattr(state, "restored_from", None)
    out = {"started_at": started_at[0], "restored": None if restored is None else
           restored.number, "step": state.step, "seen": state.seen,
           "values": [v.numpy() for v in state.variables]}
    hvd.shutdown()
    return out


def test_a_keras_checkpoint_of_2_ranks_resumes_a_job_of_3_and_reads_in_plain_tf(tmp_path):
    storage = str(tmp_path / "checkpoints")
    first = run_workers(_keras_train, 2, storage, 4, (4,), env=ENV, work_s=90)
    assert all(r["started_at"] == 0 and r["restored"] is None for r in first), first
    store = CheckpointStore(CheckpointConfig(storage, name="keras"))
    manifest = store.latest()
    assert manifest is not None and manifest.values["step"] == 4, manifest
    assert manifest.info["layout"] == "tensorflow" and manifest.world_size == 2

    # plain TensorFlow reads it: the variables by path, the same values training ended with
    import tensorflow as tf

    (part,) = manifest.parts
    prefix = os.path.join(store.where(manifest.key), part, "state")
    names = tf.train.load_checkpoint(prefix).get_variable_to_shape_map()
    assert any("dense" in n and "kernel" in n for n in names), sorted(names)
    from raytrain_x.tensorflow.durable import load

    saved = load(os.path.join(store.where(manifest.key), part))
    for a, b in zip(saved["values"], first[0]["values"]):
        np.testing.assert_array_equal(a, b)
    assert saved["attributes"]["seen"] == [1, 2, 3, 4]

    # a new job of 3: no rank holds the state, so it resumes from step 4 on every rank
    second = run_workers(_keras_train, 3, storage, 6, env=ENV, work_s=90)
    assert all(r["started_at"] == 4 and r["restored"] == manifest.number for r in second)
    assert all(r["seen"] == [1, 2, 3, 4, 5, 6] for r in second), second
    for r in second[1:]:
        for a, b in zip(r["values"], second[0]["values"]):
            np.testing.assert_array_equal(a, b)
