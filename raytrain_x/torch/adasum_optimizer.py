"""`DistributedOptimizer(op=Adasum)`: Horovod's delta optimizer.

When a parameter's gradient is ready, the local optimizer steps that parameter alone; the
change it made (the delta) is combined across the set by Adasum while backward goes on, and
`step()` sets every parameter to its value before the local step plus the combined delta.
"""

from __future__ import annotations

import torch

from raytrain_x.common.errors import ConfigError
from raytrain_x.core import runtime
from raytrain_x.core.collectives import Adasum, synchronize
from raytrain_x.engine.messages import Handle
from raytrain_x.torch.async_ops import allreduce_async_
from raytrain_x.torch.hooked_optimizer import HookedOptimizer, grad_ready_hooks


class AdasumOptimizer(HookedOptimizer):
    """Mixed in ahead of the wrapped optimizer's class; see `DistributedOptimizer`."""

    def __init__(self, params, named_parameters, compression, backward_passes_per_step,
                 process_set):
        super().__init__(params)
        self._compression = compression
        self._process_set = process_set
        self.backward_passes_per_step = backward_passes_per_step
        self._take_parameters(named_parameters, "adasum", require_all=False)
        self._starts = {p: torch.zeros_like(p, requires_grad=False)
                        for p in self._requires_update}
        self._handles: dict[torch.Tensor, Handle] = {}
        self._hooks = grad_ready_hooks(self, self._requires_update)

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if p in self._handles:
            raise ConfigError(f"gradient of {self._names[p]!r} computed twice before step(); "
                              "with gradient accumulation pass backward_passes_per_step")
        self._passes[p] += 1
        if self._passes[p] >= self.backward_passes_per_step:
            self._passes[p] = 0
            self._handles[p] = self._step_and_reduce(p)

    @torch.no_grad()
    def _step_and_reduce(self, p: torch.Tensor) -> Handle:
        stashed = [group["params"] for group in self.param_groups]
        for group in self.param_groups:  # the local step, for p only
            group["params"] = [p] if any(p is q for q in group["params"]) else []
        try:
            self._starts[p].copy_(p)
            super().step()
        finally:
            for group, params in zip(self.param_groups, stashed):
                group["params"] = params
        p.sub_(self._starts[p])  # p now holds this rank's delta
        return allreduce_async_(p.data, name=f"adasum.{self._names[p]}", op=Adasum,
                                process_set=self._process_set, compression=self._compression)

    @torch.no_grad()
    def synchronize(self) -> None:
        """Waits for every delta's reduction and sets each parameter to its value before
        the local step plus the combined delta."""
        try:
            for p in self._requires_update:
                if p not in self._handles:
                    self._handles[p] = self._step_and_reduce(p)
            for p, handle in self._handles.items():
                synchronize(handle)
                self._starts[p].add_(p)  # start + combined delta
                p.copy_(self._starts[p])
        finally:
            self._handles.clear()

    def step(self, closure=None):
        loss = closure() if closure is not None else None
        self.synchronize()
        runtime.mark_step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._handles:
            raise ConfigError("zero_grad() called while Adasum reductions are in flight; "
                              "call step() first")
        return super().zero_grad(set_to_none)
