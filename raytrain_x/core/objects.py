"""Python objects between ranks, as bytes (cloudpickle) in numpy arrays: the same for every
framework, and what elastic states sync with by default."""

from __future__ import annotations

from typing import Any

import cloudpickle
import numpy as np

from raytrain_x.core.collectives import auto_name, submit, synchronize
from raytrain_x.core.process_sets import ProcessSet, global_process_set, registered_id
from raytrain_x.core.runtime import rendezvous
from raytrain_x.engine.messages import ALLGATHER, ALLREDUCE, BROADCAST, Meta

# The name of unnamed object collectives: never the object's type (the root's object and
# the others' None would never meet) and never a per-process counter (a worker that joined
# an elastic job later would count from 0 while the others count on)
UNNAMED = "noname"


def broadcast_bytes(payload: bytes | None, root_rank: int = 0, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> bytes:
    """`root_rank`'s bytes on every member (others pass None)."""
    name = name or auto_name("broadcast_bytes", process_set)
    is_root = rendezvous().rank == root_rank
    length = np.array([len(payload or b"") if is_root else 0], dtype=np.int64)
    _broadcast(length, root_rank, f"{name}.length", process_set)
    data = np.zeros(int(length[0]), dtype=np.uint8)
    if is_root and payload:
        data[:] = np.frombuffer(payload, dtype=np.uint8)
    if data.size:
        _broadcast(data, root_rank, f"{name}.data", process_set)
    return payload if is_root else data.tobytes()


def allgather_bytes(payload: bytes, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> list[bytes]:
    """Every member's bytes, in rank order."""
    name = name or auto_name("allgather_bytes", process_set)
    sizes = _allgather(np.array([len(payload)], dtype=np.int64), f"{name}.sizes", process_set)
    data = _allgather(np.frombuffer(payload, dtype=np.uint8).copy(), f"{name}.data",
                      process_set)
    out, offset = [], 0
    for size in sizes.tolist():
        out.append(data[offset:offset + size].tobytes())
        offset += size
    return out


def broadcast_ints(values: list[int], root_rank: int = 0, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> list[int]:
    """`root_rank`'s few integers on every member, in one allreduce (a sum to which only
    the root adds): a small allreduce that repeats every step crosses a network with its
    readiness in one round trip (the engine's speculative cycles), where an object's
    broadcast takes two collectives of two round trips each. Every member passes as many
    values as the root (what others pass is not looked at); each fits in an int64."""
    name = name or auto_name("broadcast_ints", process_set)
    is_root = rendezvous().rank == root_rank
    array = np.array(values if is_root else [0] * len(values), dtype=np.int64)
    meta = Meta(ALLREDUCE, "int64", array.shape, "sum",
                process_set_id=registered_id(process_set))
    return [int(v) for v in synchronize(submit(name, meta, array))]


def max_ints(values: list[int], name: str | None = None,
             process_set: ProcessSet = global_process_set) -> list[int]:
    """The largest of each of every member's few integers, in one allreduce (as
    `broadcast_ints`: a small allreduce that repeats every step). A root's values reach
    every member where the others pass 0 and the root's are not negative."""
    name = name or auto_name("max_ints", process_set)
    meta = Meta(ALLREDUCE, "int64", (len(values),), "max",
                process_set_id=registered_id(process_set))
    return [int(v) for v in synchronize(submit(name, meta, np.array(values, dtype=np.int64)))]


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """`root_rank`'s object on every member (pickled with cloudpickle).

    Args:
        obj: the object to send (the root's); cloudpickle pickles it. Other members may
            pass anything (None): what they pass is not looked at.
        root_rank: the global rank whose value every member receives.
        name: the collective's name, the same on every member; if None, one fixed name
            for every unnamed object broadcast (they complete one at a time on a thread,
            in the same order on every member, an elastic newcomer's included).
        process_set: the ranks that take part (default: every rank).
    """
    name = f"broadcast_object.{name or UNNAMED}"
    is_root = rendezvous().rank == root_rank
    data = broadcast_bytes(cloudpickle.dumps(obj) if is_root else None, root_rank, name,
                           process_set)
    return obj if is_root else cloudpickle.loads(data)


def allgather_object(obj: Any, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> list[Any]:
    """Every member's object, in rank order.

    Args:
        obj: any object cloudpickle can pickle, of any type on each member.
        name: the collective's name, the same on every member; if None, one fixed name
            (as for `broadcast_object`).
        process_set: the ranks that take part (default: every rank).
    """
    name = f"allgather_object.{name or UNNAMED}"
    return [cloudpickle.loads(b) for b in allgather_bytes(cloudpickle.dumps(obj), name,
                                                          process_set)]


def _broadcast(array: np.ndarray, root_rank: int, name: str, process_set: ProcessSet) -> None:
    meta = Meta(BROADCAST, array.dtype.name, array.shape, root=int(root_rank),
                process_set_id=registered_id(process_set))
    synchronize(submit(name, meta, array))


def _allgather(array: np.ndarray, name: str, process_set: ProcessSet) -> np.ndarray:
    meta = Meta(ALLGATHER, array.dtype.name, array.shape, process_set_id=registered_id(process_set))
    return synchronize(submit(name, meta, array))
