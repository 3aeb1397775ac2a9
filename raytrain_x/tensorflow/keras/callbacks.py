"""Horovod's Keras callbacks: broadcast the initial variables, average the metrics, warm
up and schedule the learning rate."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
from tensorflow import keras

from raytrain_x.common.errors import ConfigError
from raytrain_x.core import runtime
from raytrain_x.core.collectives import Average
from raytrain_x.tensorflow.collectives import allreduce
from raytrain_x.tensorflow.functions import broadcast_variables

log = logging.getLogger("raytrain_x.tensorflow")


def _model_variables(model: Any) -> list[Any]:
    variables = list(model.variables)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        if not optimizer.built:  # Keras 3 creates them lazily; every rank needs the same
            optimizer.build(model.trainable_variables)
        variables += list(optimizer.variables)
    return variables


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Gives every rank `root_rank`'s model and optimizer variables when training begins,
    so that all start from the same weights (random or restored from a checkpoint).

    Args:
        root_rank: the rank whose values every rank takes.
        device: accepted for Horovod's signature (the broadcast runs on host memory).
        local_variables: variables each rank keeps its own (not broadcast).
    """

    def __init__(self, root_rank: int = 0, device: str = "",
                 local_variables: Any = None) -> None:
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        local = local_variables if isinstance(local_variables, (list, tuple, set)) else \
            ([] if local_variables is None else [local_variables])
        self._local = {id(v) for v in local}
        self.broadcast_done = False

    def on_train_begin(self, logs: dict | None = None) -> None:
        if not self.broadcast_done and self.model.variables:
            shared = [v for v in _model_variables(self.model) if id(v) not in self._local]
            broadcast_variables(shared, self.root_rank)
            self.broadcast_done = True

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        # a model first built by its first batch: broadcast after it
        if not self.broadcast_done:
            self.on_train_begin(logs)


class MetricAverageCallback(keras.callbacks.Callback):
    """Replaces each epoch's metrics with their average over every rank (one allreduce),
    so that rank 0 logs and checkpoints on the whole job's figures. Put it before the
    callbacks that read the metrics. `device` is accepted for Horovod's signature."""

    def __init__(self, device: str = "") -> None:
        super().__init__()
        self.device = device

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if not logs:
            return
        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0)
        values = np.array([float(logs[k]) for k in keys], dtype=np.float64)
        averaged = allreduce(values, name=f"MetricAverageCallback.{len(keys)}", op=Average)
        for k, v in zip(keys, averaged.numpy().tolist()):
            logs[k] = v


class _LearningRateCallback(keras.callbacks.Callback):
    """Sets the optimizer's learning rate to `initial_lr * multiplier(epoch)` inside
    [start_epoch, end_epoch); per batch (fractional epochs) unless `staircase`."""

    def __init__(self, initial_lr: float, multiplier: float | Callable[[float], float],
                 start_epoch: int = 0, end_epoch: int | None = None, staircase: bool = True,
                 momentum_correction: bool = True, steps_per_epoch: int | None = None,
                 verbose: int = 0) -> None:
        super().__init__()
        if initial_lr is None:
            raise ConfigError("give initial_lr (the learning rate before scaling)")
        self.initial_lr = float(initial_lr)
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch: multiplier)
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.verbose = verbose
        self.current_epoch = 0
        self._warned = False

    def _in_range(self, epoch: float) -> bool:
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def _set_lr(self, epoch: float) -> None:
        lr = self.initial_lr * float(self.multiplier(epoch))
        optimizer = self.model.optimizer
        try:
            optimizer.learning_rate = lr
        except (TypeError, ValueError, AttributeError) as exc:
            raise ConfigError("a learning-rate callback needs an optimizer with a plain "
                              f"learning rate, not a schedule ({exc})") from None
        if self.momentum_correction and not self._warned and \
                isinstance(getattr(optimizer, "momentum", None), float) and optimizer.momentum:
            # Keras 3 traces momentum into the step function as a constant
            log.info("momentum_correction has no effect on Keras 3 optimizers")
            self._warned = True

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self.current_epoch = epoch
        if self.staircase and self._in_range(epoch):
            self._set_lr(epoch)

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if self.staircase:
            return
        steps = self.steps_per_epoch or self.params.get("steps")
        if not steps:
            raise ConfigError("staircase=False needs steps_per_epoch (fit could not tell)")
        epoch = self.current_epoch + batch / steps
        if self._in_range(epoch):
            self._set_lr(epoch)


class LearningRateScheduleCallback(_LearningRateCallback):
    """Horovod's schedule: `lr = initial_lr * multiplier` (a number, or a function of the
    epoch) from `start_epoch` until `end_epoch`."""


class LearningRateWarmupCallback(_LearningRateCallback):
    """Horovod's gradual warmup (Goyal et al.): the learning rate grows from
    `initial_lr / size` to `initial_lr` over `warmup_epochs`, per batch, so that a large
    world's scaled rate does not diverge early. `initial_lr` is the scaled rate."""

    def __init__(self, initial_lr: float, warmup_epochs: int = 5,
                 momentum_correction: bool = True, steps_per_epoch: int | None = None,
                 verbose: int = 0) -> None:
        def multiplier(epoch: float) -> float:
            size = runtime.size()
            return 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch, verbose=verbose)
        self.warmup_epochs = warmup_epochs

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if epoch == self.warmup_epochs - 1:
            self.model.optimizer.learning_rate = self.initial_lr
            if self.verbose and runtime.rank() == 0:
                print(f"Epoch {epoch + 1}: finished gradual learning rate warmup to "
                      f"{self.initial_lr:g}.")


_UNSET = "<set BestModelCheckpoint.filepath>.keras"


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Horovod's `BestModelCheckpoint`: a `ModelCheckpoint` that keeps only the best model
    by `monitor`. Horovod's estimators set `filepath` later; here pass it, or set the
    attribute before `fit`. Save from one rank (add it to rank 0's callbacks)."""

    def __init__(self, monitor: str = "val_loss", verbose: int = 0, mode: str = "auto",
                 save_freq: str | int = "epoch", filepath: str | None = None) -> None:
        super().__init__(filepath=filepath or _UNSET, monitor=monitor, verbose=verbose,
                         save_best_only=True, save_weights_only=False, mode=mode,
                         save_freq=save_freq)

    def on_train_begin(self, logs: dict | None = None) -> None:
        if self.filepath == _UNSET:
            raise ConfigError("BestModelCheckpoint needs a filepath: pass filepath= or set "
                              "callback.filepath before fit (a path ending in .keras)")
        super().on_train_begin(logs)
