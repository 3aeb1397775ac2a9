"""Whole-object helpers: broadcast parameters, optimizer state and Python objects (the
last from the core, where they are framework-neutral)."""

from __future__ import annotations

from typing import Any

import torch

from raytrain_x.common.errors import ConfigError
from raytrain_x.core.collectives import synchronize
from raytrain_x.core.objects import allgather_object, broadcast_object
from raytrain_x.core.process_sets import ProcessSet, global_process_set
from raytrain_x.torch.async_ops import broadcast_async_

__all__ = ["allgather_object", "broadcast_object", "broadcast_optimizer_state",
           "broadcast_parameters"]


def broadcast_parameters(params: Any, root_rank: int,
                         process_set: ProcessSet = global_process_set) -> None:
    """Overwrites every parameter with `root_rank`'s value, in place.

    Args:
        params: `model.state_dict()`, `model.named_parameters()`, a list of (name, tensor)
            or a list of tensors (`model.parameters()`), as Horovod takes.
        root_rank: rank whose values win.
    """
    if isinstance(params, dict):
        items = sorted(params.items())
    else:
        items = [p if isinstance(p, tuple) else (f"noname.{i}", p)
                 for i, p in enumerate(params)]
    if any(len(item) != 2 for item in items):
        raise ConfigError("broadcast_parameters needs a state_dict, (name, tensor) pairs or "
                          "a list of tensors")
    handles = []
    for name, p in items:
        if p is None:
            continue
        tensor = p.data if isinstance(p, torch.nn.Parameter) else p
        if not torch.is_tensor(tensor):
            continue
        handles.append(broadcast_async_(tensor, root_rank, f"broadcast_parameters.{name}",
                                        process_set))
    for h in handles:
        synchronize(h)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int,
                              model: torch.nn.Module | None = None,
                              process_set: ProcessSet = global_process_set) -> None:
    """Gives every member `root_rank`'s optimizer state (and hyper-parameters).

    `model` is accepted in Horovod's position and not needed: the whole `state_dict` goes
    as one object, so an optimizer that has not stepped yet needs no dummy step.

    Args:
        optimizer: a `torch.optim.Optimizer` (or a `DistributedOptimizer`).
        root_rank: the global rank whose value every member receives.
        model: accepted in Horovod's position; not needed.
        process_set: the ranks that take part (default: every rank).
    """
    if model is not None and not isinstance(model, torch.nn.Module):
        raise ConfigError(f"broadcast_optimizer_state's model= must be a torch.nn.Module, "
                          f"got {type(model).__name__}")
    state = broadcast_object(optimizer.state_dict(), root_rank, "optimizer_state", process_set)
    optimizer.load_state_dict(state)
