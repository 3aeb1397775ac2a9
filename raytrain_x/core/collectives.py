"""Submitting collectives to the engine, the same for every framework face: reduce-op
names, automatic collective names, requests and handles, join and barrier. A face checks
and converts its tensors, builds the `Meta`, and calls `submit`."""

from __future__ import annotations

import itertools
import math
from typing import Any

from raytrain_x.common.errors import ConfigError
from raytrain_x.common.process import PROCESS
from raytrain_x.core.process_sets import ProcessSet, global_process_set, registered_id
from raytrain_x.core.runtime import engine
from raytrain_x.engine.messages import BARRIER, DTYPE_SIZES, Handle, Meta, Request

Average = "average"
Sum = "sum"
Min = "min"
Max = "max"
Product = "product"
Adasum = "adasum"
REDUCE_OPS = (Average, Sum, Adasum, Min, Max, Product)

def auto_name(kind: str, process_set: ProcessSet = global_process_set) -> str:
    """A name for an unnamed collective: the same on every member of `process_set` that
    submits the same unnamed collectives on it in the same order (as in Horovod). Counted
    per set, so a rank's collectives on the sets it alone is in leave the others' names
    unchanged. Counted per world (`common.process.World.names`): every rank of a round an
    elastic reset made numbers them from 0, a worker that just joined as the others."""
    key = (kind, registered_id(process_set))
    with PROCESS.lock:
        world = PROCESS.world
        names = world.names if world is not None else {}  # before init(): it fails there
        counter = names.setdefault(key, itertools.count())
        return f"{kind}.noname.{next(counter)}"


def named(kind: str, name: str) -> str:
    """Horovod's naming of a named collective: `<kind>.<name>` (kept when already so)."""
    name = str(name)
    return name if name.startswith(kind + ".") else f"{kind}.{name}"


def scale_factor(what: str, value: Any) -> float:
    """A prescale or postscale factor as a float: a finite number, else a `ConfigError` (a
    NaN never equals itself, and the ranks would be told they disagree)."""
    try:
        factor = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{what} must be a number, got {value!r}") from None
    if not math.isfinite(factor):
        raise ConfigError(f"{what} must be a finite number, got {value!r}")
    return factor


def check_dtype(name: str, shown: Any = None) -> str:
    """`name` when the engine supports that dtype, else a clear error."""
    if name not in DTYPE_SIZES:
        raise ConfigError(f"dtype {shown or name} is not supported by raytrain-x collectives; "
                          f"use one of {', '.join(sorted(DTYPE_SIZES))}")
    return name


def resolve_op(op: str | None, average: bool | None = None, default: str = Average) -> str:
    """The reduce op from `op` or Horovod's deprecated `average=` flag."""
    if average is not None:
        if op is not None:
            raise ConfigError("give either op= or the deprecated average=, not both")
        return Average if average else Sum
    op = default if op is None else op
    if op not in REDUCE_OPS:
        raise ConfigError(f"unknown reduce op {op!r}; use Average, Sum, Adasum, Min, Max or "
                          "Product")
    return op


def predivided(op: str, factor: float, size: int) -> tuple[str, float, float]:
    """Horovod's `gradient_predivide_factor` as (reduce op, prescale, postscale): the sum of
    gradients / factor, then * factor / size, the average with smaller intermediate values.
    A factor of 1 leaves `op` as it is, unscaled."""
    if factor == 1.0:
        return op, 1.0, 1.0
    if op != Average:
        raise ConfigError("gradient_predivide_factor needs op=rx.Average")
    return Sum, 1.0 / factor, factor / size


def request(name: str, meta: Meta, array: Any, output: Any = None) -> Request:
    """A request for the engine; each process set has its own name space, as in Horovod.
    A rank outside the set is refused here, at once, as Horovod refuses it (an
    invalid-argument error), instead of failing the set's negotiation later."""
    members = engine().groups.process_set(meta.process_set_id)  # unknown id: ConfigError
    if not members.included():
        raise ConfigError(f"{meta.kind}: rank {engine().rank} is not a member of "
                          f"process set {meta.process_set_id} (ranks {members.ranks}); call "
                          "it on the set's members only, or pass a set this rank is in")
    if meta.process_set_id:
        name = f"{name}@set{meta.process_set_id}"
    return Request(name, meta, array, Handle(name), output)


def submit(name: str, meta: Meta, array: Any, output: Any = None) -> Handle:
    """Queues one collective; returns its handle."""
    req = request(name, meta, array, output)
    engine().enqueue(req)
    return req.handle


def submit_many(requests: list[Request]) -> None:
    """Queues requests atomically, so that they are negotiated in one cycle and fused."""
    engine().enqueue_many(requests)


def synchronize(handle: Handle) -> Any:
    """Waits for `handle` and returns the collective's output.

    Args:
        handle: what an `*_async` call returned.
    """
    if not isinstance(handle, Handle):
        raise ConfigError(f"synchronize needs a handle from an *_async call, got {handle!r}")
    return handle.wait()


def poll(handle: Handle) -> bool:
    """True when the collective behind `handle` finished.

    Args:
        handle: what an `*_async` call returned.
    """
    return handle.done()


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Returns once every member reached the barrier.

    Args:
        process_set: the ranks that take part (default: every rank).
    """
    meta = Meta(BARRIER, "uint8", (0,), process_set_id=registered_id(process_set))
    synchronize(submit(auto_name(BARRIER, process_set), meta, None))


def join(device: int = -1) -> int:
    """Marks this rank as done: until every rank has joined, it contributes zeros to the
    others' allreduces. Returns the rank that joined last.

    Args:
        device: accepted for Horovod's signature (the zeros are made where each tensor is).
    """
    handle = Handle("join")
    engine().join(handle)
    return handle.wait()
