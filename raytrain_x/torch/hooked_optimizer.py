"""What ZeRO's sharded optimizer takes from the gradient-sync core (`grad_sync`): its
parameters' names and counting backward passes."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from raytrain_x.common.errors import ConfigError
from raytrain_x.torch.grad_sync import parameter_names


class HookedOptimizer:
    """The backward-pass counting both optimizers share (a mixin ahead of the wrapped
    optimizer's class)."""

    backward_passes_per_step: int
    param_groups: list[dict]
    _passes: dict[torch.Tensor, int]

    def _take_parameters(self, named_parameters: Iterable[tuple[str, torch.Tensor]] | None,
                         kind: str, require_all: bool = True) -> None:
        """The groups' parameters: their names (`parameter_names`), those that need
        gradients, and a pass count for each of those."""
        params = [p for group in self.param_groups for p in group["params"]]
        self._names = parameter_names(named_parameters, params, kind, require_all)
        self._requires_update = [p for p in params if p.requires_grad]
        self._passes = {p: 0 for p in self._requires_update}

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Changes how many backward passes are accumulated per allreduce (Horovod's
        method); counts start again."""
        if passes < 1:
            raise ConfigError(f"backward_passes_per_step must be >= 1, got {passes}")
        self.backward_passes_per_step = passes
        self._reset_passes()

    def _reset_passes(self) -> None:
        for p in self._passes:
            self._passes[p] = 0
