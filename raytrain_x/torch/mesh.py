"""The round's device mesh: torch's default process group over this raytrain-x world, for
models sharded with torch's `fully_shard` (FSDP2).

`device_mesh()` makes torch's default group on the round's own rendezvous store and
returns a 1-D `DeviceMesh` over it. The group is gloo whose pairs connect when a
collective first needs them (`raytrain_x.comm.torch_backend.lazy_gloo_group`): making it
waits for no peer, so a worker that joins a running job can shard its model before the
others reach it, and a world of thousands publishes one address a rank. Each elastic
round has its own group, made when first asked for and made again when a re-shard places
the members in another order (a mesh's positions follow its group's ranks: torch's
`DeviceMesh` does not reorder a group's ranks). The group of the round before is
destroyed first: in a raytrain-x job, `device_mesh()` owns torch's default group.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from raytrain_x.comm.torch_backend import lazy_gloo_group
from raytrain_x.comm.torch_store import group_store
from raytrain_x.common.errors import ConfigError
from raytrain_x.common.process import PROCESS
from raytrain_x.core import runtime

BACKEND = "raytrain_x_gloo"  # torch's name for the round's lazily connected gloo group


def _make_group(store: Any, rank: int, size: int, timeout: timedelta) -> Any:
    return lazy_gloo_group(store, rank, size, timeout, runtime.rendezvous().address)


def _register_backend() -> None:
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _make_group, devices=["cpu"])


def device_mesh(order: Sequence[int] | None = None) -> Any:
    """A 1-D `DeviceMesh` over this round's world, on torch's default process group, for
    `fully_shard(module, mesh=...)`. Not a collective: every rank calls it, in any order
    with the round's other work.

    Args:
        order: the raytrain-x rank at each position of the mesh (default: rank order). A
            rank's position is its rank in torch's default group.

    Raises:
        ConfigError: `order` is not an order of this world's ranks.
    """
    from torch.distributed.device_mesh import init_device_mesh

    world = PROCESS.world
    rank, size = runtime.rank(), runtime.size()
    order = tuple(range(size)) if order is None else tuple(int(r) for r in order)
    if sorted(order) != list(range(size)):
        raise ConfigError(f"a mesh's order names every rank of the world of {size} once; "
                          f"got {list(order)[:16]}")
    if world is not None and world.mesh is not None and world.mesh[0] == order:
        return world.mesh[1]
    _register_backend()
    release()
    rdv = runtime.rendezvous()
    digest = hashlib.blake2b(repr(order).encode(), digest_size=8).hexdigest()
    store = group_store(rdv.store, f"torch-mesh/{rdv.round}/{digest}")
    dist.init_process_group(BACKEND, store=store, rank=order.index(rank), world_size=size,
                            timeout=timedelta(seconds=rdv.timeout_s))
    mesh = init_device_mesh("cpu", (size,))
    assert world is not None  # runtime.rank() answered
    # the store stays referenced: torch's C++ group holds no reference to its Python side
    world.mesh = (order, mesh, store)
    return mesh


def release() -> None:
    """Destroys torch's default process group where this process has one (a round's
    before, or one made by hand before `device_mesh()`)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def is_peer_failure(exc: BaseException) -> bool:
    """Whether `exc` is torch's process group reporting a lost or stuck peer (gloo's
    transport errors and timeouts, NCCL's `DistBackendError`), which an elastic job
    recovers from as from a failed raytrain-x collective."""
    if isinstance(exc, dist.DistBackendError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("gloo/transport" in text
                                              or "gloo/" in text and "Timed out" in text)
