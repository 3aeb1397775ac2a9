"""Whole-object helpers: broadcast parameters, optimizer state and Python objects."""

from __future__ import annotations

from typing import Any

import cloudpickle
import torch

from raytrain_x.common.errors import ConfigError
from raytrain_x.fusion.runtime import ProcessSet, global_process_set
from raytrain_x.torch.ops import (
    allgather,
    broadcast_,
    broadcast_async_,
    synchronize,
)


def broadcast_parameters(params: Any, root_rank: int,
                         process_set: ProcessSet = global_process_set) -> None:
    """Overwrites every parameter with `root_rank`'s value, in place.

    Args:
        params: `model.state_dict()`, `model.named_parameters()` or a list of (name, tensor).
        root_rank: rank whose values win.
    """
    items = sorted(params.items()) if isinstance(params, dict) else list(params)
    if items and not isinstance(items[0], tuple):
        raise ConfigError("broadcast_parameters needs a state_dict or (name, tensor) pairs")
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


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """`root_rank`'s object on every member (pickled with cloudpickle)."""
    from raytrain_x.fusion import runtime

    name = name or type(obj).__name__
    is_root = runtime.rendezvous().rank == root_rank
    payload = cloudpickle.dumps(obj) if is_root else b""
    length = torch.tensor([len(payload)], dtype=torch.int64)
    broadcast_(length, root_rank, f"broadcast_object.{name}.length", process_set)
    data = torch.zeros(int(length.item()), dtype=torch.uint8)
    if is_root:
        data.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    if data.numel():
        broadcast_(data, root_rank, f"broadcast_object.{name}.data", process_set)
    return obj if is_root else cloudpickle.loads(data.numpy().tobytes())


def allgather_object(obj: Any, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> list[Any]:
    """Every member's object, in rank order."""
    name = name or type(obj).__name__
    payload = torch.frombuffer(bytearray(cloudpickle.dumps(obj)), dtype=torch.uint8)
    sizes = allgather(torch.tensor([payload.numel()], dtype=torch.int64),
                      f"allgather_object.{name}.sizes", process_set)
    data = allgather(payload, f"allgather_object.{name}.data", process_set)
    out, offset = [], 0
    for size in sizes.tolist():
        out.append(cloudpickle.loads(data[offset:offset + size].numpy().tobytes()))
        offset += size
    return out


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int,
                              process_set: ProcessSet = global_process_set) -> None:
    """Gives every member `root_rank`'s optimizer state (and hyper-parameters)."""
    state = broadcast_object(optimizer.state_dict(), root_rank, "optimizer_state", process_set)
    optimizer.load_state_dict(state)



