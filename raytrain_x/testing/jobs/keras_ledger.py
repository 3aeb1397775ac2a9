"""The Keras face's ledger job: every step it commits is recorded and returned for
`raytrain_x.testing.jobs.ledger.ledger_errors` to check."""

from __future__ import annotations

import os
import time

from raytrain_x.testing.jobs.ledger import write_progress


def keras_ledger_train(steps: int, pause: float = 0.05, *, progress: str | None = None,
                       epochs: int = 2) -> dict:
    """The Keras face's ledger job, written as Horovod's elastic Keras example is: `fit`
    with the elastic callbacks (commit at every batch), `steps` batches per epoch for
    `epochs` epochs. Returns the same keys as `ledger_train` (no `seen`: every rank fits
    the whole of the small dataset, as Horovod's example does)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import numpy as np
    from tensorflow import keras

    import raytrain_x.tensorflow.keras as rx

    rx.init()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=rx.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    state = rx.elastic.TensorFlowKerasState(model, epoch=0, batch=0, done_steps=[], sizes=[])

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            # UpdateBatchStateCallback ran first: state.batch counts this batch
            state.done_steps.append(state.epoch * steps + state.batch - 1)
            state.sizes.append(rx.size())
            time.sleep(pause)

    class Progress(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):  # after the commit
            if progress and rx.rank() == 0:
                write_progress(progress, len(state.done_steps), rx.size())

    callbacks = [rx.elastic.UpdateBatchStateCallback(state), Record(),
                 rx.elastic.CommitStateCallback(state), Progress(),
                 rx.elastic.UpdateEpochStateCallback(state)]
    x = (np.arange(steps * 4, dtype=np.float32).reshape(steps, 4) % 7) / 7
    y = x.sum(axis=1, keepdims=True)

    @rx.elastic.run
    def train(state):
        while state.epoch < epochs:
            model.fit(x[state.batch:], y[state.batch:], batch_size=1, epochs=1, verbose=0,
                      shuffle=False, callbacks=callbacks)
        weights = [float(v) for w in model.weights for v in np.ravel(w.numpy())]
        return {"step": len(state.done_steps), "done_steps": list(state.done_steps),
                "sizes": list(state.sizes), "rank": rx.rank(), "weight": weights,
                "restores": rx.elastic.restore_count()}

    return train(state)
