"""Elastic Keras: states and the callbacks that commit them during `model.fit`."""

from __future__ import annotations

from tensorflow import keras

from raytrain_x.tensorflow.elastic import (
    KerasState,
    ObjectState,
    State,
    TensorFlowKerasState,
    TensorFlowState,
    run,
)


class CommitStateCallback(keras.callbacks.Callback):
    """Commits the state every `batches_per_commit` batches (and checks for host
    changes there, as `state.commit()` does)."""

    def __init__(self, state: State, batches_per_commit: int = 1) -> None:
        super().__init__()
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keeps `state.batch` at the number of batches done in this epoch."""

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.state.batch = batch + 1

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keeps `state.epoch` at the number of epochs done; pass `epochs=total - state.epoch`
    to `fit` (as Horovod does) so that a restarted `fit` counts on from there."""

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state
        self.initial_epoch = 0

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.epoch = self.initial_epoch + epoch + 1


__all__ = ["CommitStateCallback", "KerasState", "ObjectState", "State", "TensorFlowKerasState",
           "TensorFlowState", "UpdateBatchStateCallback", "UpdateEpochStateCallback", "run"]
