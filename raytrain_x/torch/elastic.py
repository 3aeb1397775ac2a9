"""`rx.elastic`: elastic training for PyTorch (Horovod's `hvd.elastic`)."""

from __future__ import annotations

import copy
from typing import Any

import torch

from raytrain_x.core.runtime import rank
from raytrain_x.elastic.state import ObjectState, State, restore_count, run
from raytrain_x.torch.functions import (
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)


class TorchState(ObjectState):
    """A model, an optimizer and any plain attributes, committed by deep copy.

    Args:
        model: the module whose `state_dict` is committed and synced.
        optimizer: the optimizer whose state is committed and synced.
        **kwargs: plain attributes (epoch, batch, ...), as in `ObjectState`.
    """

    def __init__(self, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, **kwargs: Any) -> None:
        self.model = model
        self.optimizer = optimizer
        self._model_state = None
        self._optimizer_state = None
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **kwargs)
        self._save_tensors()

    def _save_tensors(self) -> None:
        if self.model is not None:
            self._model_state = copy.deepcopy(self.model.state_dict())
        if self.optimizer is not None:
            self._optimizer_state = copy.deepcopy(self.optimizer.state_dict())

    def save(self) -> None:
        self._save_tensors()
        super().save()

    def restore(self) -> None:
        if self.model is not None and self._model_state is not None:
            self.model.load_state_dict(self._model_state)
        if self.optimizer is not None and self._optimizer_state is not None:
            self.optimizer.load_state_dict(self._optimizer_state)
        super().restore()

    def sync(self) -> None:
        if self.model is not None:
            broadcast_parameters(self.model.state_dict(), root_rank=0)
        if self.optimizer is not None:
            broadcast_optimizer_state(self.optimizer, root_rank=0)
        super().sync()  # plain attributes, then save() commits everything


__all__ = ["ObjectState", "State", "TorchState", "restore_count", "run"]
