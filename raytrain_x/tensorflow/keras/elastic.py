"""Elastic Keras: states and the callbacks that commit them during `model.fit`."""

from __future__ import annotations

from tensorflow import keras

from raytrain_x.common.errors import ConfigError
from raytrain_x.tensorflow.elastic import (
    KerasState,
    ObjectState,
    State,
    TensorFlowKerasState,
    TensorFlowState,
    restore_count,
    run,
)


class CommitStateCallback(keras.callbacks.Callback):
    """Commits the state every `batches_per_commit` batches and after each epoch (and
    checks for host changes there, as `state.commit()` does).

    A commit happens between batches (at the next batch's start, or when the epoch or
    `fit` ends), after every callback of the previous batch ran, so the state it saves
    already has the batch and epoch counters of `UpdateBatchStateCallback` and
    `UpdateEpochStateCallback`, whatever their order in the list.
    """

    def __init__(self, state: State, batches_per_commit: int = 1) -> None:
        super().__init__()
        if batches_per_commit < 1:
            raise ConfigError(f"batches_per_commit must be >= 1, got {batches_per_commit}")
        self.state = state
        self.batches_per_commit = batches_per_commit
        self._uncommitted = 0
        self._epoch_ended = False

    def _commit(self) -> None:
        self._uncommitted, self._epoch_ended = 0, False
        self.state.commit()

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if self._uncommitted >= self.batches_per_commit:
            self._commit()

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self._uncommitted += 1

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch_ended = True

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        if self._epoch_ended:
            self._commit()

    def on_train_end(self, logs: dict | None = None) -> None:
        if self._epoch_ended or self._uncommitted:
            self._commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keeps `state.batch` at the number of batches done in the current epoch. A `fit`
    that resumes an epoch should skip those batches (feed the data from
    `state.batch * batch_size`): the count goes on from where the state was."""

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state
        self.initial_batch = 0

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.initial_batch = self.state.batch

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.state.batch = self.initial_batch + batch + 1

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.batch = self.initial_batch = 0


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
           "TensorFlowState", "UpdateBatchStateCallback", "UpdateEpochStateCallback",
           "restore_count", "run"]
