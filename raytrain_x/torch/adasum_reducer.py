"""`DistributedOptimizer(op=Adasum)`: Horovod's delta optimizer, as a reducer.

When a parameter's gradient is ready, the local optimizer steps that parameter alone; the
change it made (the delta) is combined across the set by Adasum while backward goes on, and
`step()` sets every parameter to its value before the local step plus the combined delta.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from raytrain_x.core.collectives import Adasum, synchronize
from raytrain_x.engine.messages import Handle
from raytrain_x.torch.async_ops import allreduce_async_
from raytrain_x.torch.compression import Compressor
from raytrain_x.torch.grad_sync import GradientSync, Reducer


class AdasumReducer(Reducer):
    """Each parameter stepped locally when its gradient is ready; the deltas combined by
    Adasum.

    Args:
        compression: the wire's compressor.
    """

    kind = "adasum"
    require_names = False

    def __init__(self, compression: type[Compressor]) -> None:
        self._compression = compression
        self._handles: dict[torch.Tensor, Handle] = {}

    def bind(self, core: GradientSync) -> None:
        super().bind(core)
        self._starts = {p: torch.zeros_like(p, requires_grad=False)
                        for p in core.reduced_params}

    def ready(self, p: torch.Tensor) -> None:
        self._handles[p] = self._step_and_reduce(p)

    def busy(self, p: torch.Tensor) -> bool:
        return p in self._handles

    def in_flight(self) -> bool:
        return bool(self._handles)

    def forget(self) -> None:
        self._handles.clear()

    @torch.no_grad()
    def _step_and_reduce(self, p: torch.Tensor) -> Handle:
        core = self.core
        stashed = [group["params"] for group in core.param_groups]
        for group in core.param_groups:  # the local step, for p only
            group["params"] = [p] if any(p is q for q in group["params"]) else []
        try:
            self._starts[p].copy_(p)
            core.local_step()
        finally:
            for group, params in zip(core.param_groups, stashed):
                group["params"] = params
        p.sub_(self._starts[p])  # p now holds this rank's delta
        return allreduce_async_(p.data, name=f"adasum.{core.gradient_names[p]}", op=Adasum,
                                process_set=core.process_set, compression=self._compression)

    @torch.no_grad()
    def synchronize(self) -> None:
        """Waits for every delta's reduction and sets each parameter to its value before
        the local step plus the combined delta."""
        for p in self.core.reduced_params:
            if p not in self._handles:
                self._handles[p] = self._step_and_reduce(p)
        for p, handle in self._handles.items():
            synchronize(handle)
            self._starts[p].add_(p)  # start + combined delta
            p.copy_(self._starts[p])

    def step(self, closure: Callable[[], Any] | None, synchronize: bool) -> Any:
        loss = closure() if closure is not None else None
        self.core.synchronize()  # the local steps ran in the hooks; every delta is combined
        return loss
