"""`GlobalBatch`: the global batch held across elastic resizes by gradient accumulation."""

from __future__ import annotations

import logging
import math
from typing import Any

from raytrain_x.common.errors import ConfigError
from raytrain_x.core.runtime import rank, size

log = logging.getLogger("raytrain_x.elastic")


class GlobalBatch:
    """Keeps the samples per optimizer step the same whatever the world size, so that the
    optimisation a user tuned (learning rate, warm-up, schedule) does not change when
    workers come and go: each rank runs `accumulation` backward passes of
    `micro_batch_size` samples per step, `accumulation = ceil(global_batch_size /
    (micro_batch_size * size))`. Where that does not divide exactly the step takes the
    next larger batch, `effective_batch_size = micro_batch_size * size * accumulation`
    (logged once per world size).

    Args:
        global_batch_size: samples per optimizer step over every rank.
        micro_batch_size: samples per backward pass on one rank.
        optimizer: a `DistributedOptimizer` whose `backward_passes_per_step` follows
            `accumulation` (None: the caller accumulates itself).

    Register `update` as a reset callback (`state.register_reset_callbacks([gb.update])`)
    and scale each pass's loss by `loss_scale`, so the step's gradient is the mean over the
    global batch at any size:

        for _ in range(gb.accumulation):
            (loss_fn(model(x), y) * gb.loss_scale).backward()
        opt.step()
    """

    def __init__(self, global_batch_size: int, micro_batch_size: int,
                 optimizer: Any = None) -> None:
        for name, value in (("global_batch_size", global_batch_size),
                            ("micro_batch_size", micro_batch_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"GlobalBatch({name}=...) must be an int >= 1, got "
                                  f"{value!r}")
        if optimizer is not None and not hasattr(optimizer, "set_backward_passes_per_step"):
            raise ConfigError("GlobalBatch(optimizer=...) takes a DistributedOptimizer (one "
                              "with set_backward_passes_per_step)")
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.optimizer = optimizer
        self.accumulation = 1
        self.effective_batch_size = micro_batch_size
        self._warned: set[int] = set()
        self.update()

    @property
    def loss_scale(self) -> float:
        """What each backward pass's loss is multiplied by: 1 / accumulation."""
        return 1.0 / self.accumulation

    def update(self) -> None:
        """Follows the current world size (a reset callback)."""
        n = size()
        self.accumulation = max(1, math.ceil(self.global_batch_size
                                             / (self.micro_batch_size * n)))
        self.effective_batch_size = self.micro_batch_size * n * self.accumulation
        if self.optimizer is not None:
            self.optimizer.set_backward_passes_per_step(self.accumulation)
        if self.effective_batch_size != self.global_batch_size and n not in self._warned:
            self._warned.add(n)
            if rank() == 0:
                log.warning("raytrain-x elastic: a global batch of %d does not divide into "
                            "%d workers x %d samples; each step takes %d (%d passes a rank)",
                            self.global_batch_size, n, self.micro_batch_size,
                            self.effective_batch_size, self.accumulation)
