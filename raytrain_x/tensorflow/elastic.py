"""`rx.elastic`: elastic training for TensorFlow and Keras (Horovod's `hvd.elastic`).

States commit by copying variable values to host memory, restore by assigning them back,
and sync by broadcasting rank 0's variables. `run` is the core's, with one addition:
TensorFlow reports an error raised inside a graph as a `tf.errors.OpError`, so the
raytrain-x error behind it (a lost peer, a reset) is raised again in its own type first.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from raytrain_x.common.checkpoint_config import CheckpointConfig, from_env
from raytrain_x.core.runtime import rank
from raytrain_x.elastic.state import ObjectState, State, restore_count
from raytrain_x.elastic.state import run as _run
from raytrain_x.tensorflow.arrays import unwrap_error
from raytrain_x.tensorflow.functions import broadcast_object, broadcast_variables


def _values(variables: list[Any]) -> list[np.ndarray]:
    return [np.array(v.numpy(), copy=True) for v in variables]


class TensorFlowState(ObjectState):
    """A list of variables and any plain attributes (epoch, batch, ...).

    Args:
        variables: the `tf.Variable`s committed, restored and synced (e.g.
            `model.variables + optimizer.variables`).
        checkpoint: durable checkpoints of the commits (`CheckpointConfig`), written by
            rank 0 in the background in `tf.train.Checkpoint` format and restored when no
            worker holds the state (default: the one `RayExecutor(checkpoint=...)` or
            `raytrain-x run --checkpoint-path` gives, else none).
        **kwargs: plain attributes, as in `ObjectState`.
    """

    def __init__(self, variables: Iterable[Any] | None = None, *,
                 checkpoint: CheckpointConfig | None = None, **kwargs: Any) -> None:
        self.variables = list(variables or [])
        self._saved_values = _values(self.variables)
        config = checkpoint.named(None) if checkpoint else from_env()
        if config is not None:
            from raytrain_x.tensorflow.durable import open_checkpoints

            self._durable = open_checkpoints(config)
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **kwargs)

    def save(self) -> None:
        if self._durable is not None:
            self._durable.number += 1
        self._saved_values = _values(self.variables)
        super().save()

    def write_checkpoint(self, write_id: int, background: bool = True) -> Any:
        from raytrain_x.tensorflow.durable import write_parts

        return write_parts(self._durable, self, write_id, background)

    def restore(self) -> None:
        for var, value in zip(self.variables, self._saved_values):
            var.assign(value)
        super().restore()

    def sync(self) -> None:
        if self._durable is not None:
            from raytrain_x.tensorflow.durable import restore_from_storage

            restore_from_storage(self._durable, self)  # rank 0 loads; broadcast below
            self._durable.number = broadcast_object(self._durable.number, 0,
                                                    name="elastic.durable.number")
        if self.variables:
            broadcast_variables(self.variables, root_rank=0)
        super().sync()  # plain attributes, then save() commits everything


class TensorFlowKerasState(TensorFlowState):
    """A Keras model, its optimizer and plain attributes.

    The optimizer's variables are created here when it has none yet, so that a worker
    that joins a running job holds the same variables as rank 0 before the first sync.

    Args:
        model: a built Keras model.
        optimizer: its optimizer (default: `model.optimizer`).
        **kwargs: `checkpoint=` and plain attributes, as in `TensorFlowState`.
    """

    def __init__(self, model: Any, optimizer: Any = None, **kwargs: Any) -> None:
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer",
                                                                         None)
        if self.optimizer is not None and not self.optimizer.built:
            self.optimizer.build(model.trainable_variables)
        variables = list(model.variables)
        if self.optimizer is not None:
            variables += list(self.optimizer.variables)
        super().__init__(variables, **kwargs)


KerasState = TensorFlowKerasState  # Horovod's name in horovod.tensorflow.keras.elastic


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Makes `func(state, *args, **kwargs)` elastic (see `raytrain_x.elastic.run`)."""

    @functools.wraps(func)
    def unwrapped(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except Exception as exc:
            original = unwrap_error(exc)
            if original is exc:
                raise
            raise original from exc

    return _run(unwrapped)


__all__ = ["KerasState", "ObjectState", "State", "TensorFlowKerasState", "TensorFlowState",
           "restore_count", "run"]
