"""Allreduce through shared memory when every rank of the world runs on one host.

On one host, gloo moves every byte through loopback TCP (kernel copies, syscalls, one
thread per pair). The native `ShmGroup` instead maps one segment into every rank: each
rank copies a chunk into its slot, the ranks meet at a futex barrier, and each rank sums
the slots in rank order, so every rank holds bit-identical results (measured speed-ups
against gloo: docs/performance.md). It takes any host array through DLPack, so it needs
no framework at all.

In a multi-host world, the ranks of each host open such a group for the local stages of
hierarchical allreduce and allgather; a process set whose members share a host opens one
of its own. A group is opened collectively at engine start; if any rank cannot
create, open or see its peers (no /dev/shm, separate PID namespaces, `RAYTRAIN_X_SHM=0` on
some rank), every rank keeps using gloo. The segment's name is removed as soon as all
ranks have mapped it, and by its creator on every way out of the opening (a peer that dies
mid-vote, an error), so /dev/shm keeps no name of it unless its creator itself is killed in
the moment between creating and the others' mapping it.
"""

from __future__ import annotations

import logging
import os
import uuid

from raytrain_x import _native
from raytrain_x.comm.backend import Group
from raytrain_x.comm.groups import ProcessGroups
from raytrain_x.common import settings

log = logging.getLogger("raytrain_x.engine")

ShmGroup = _native.ShmGroup
SHM_ENV = settings.SHM.env
SLOT_BYTES = 256 << 10  # per-rank chunk: fits the L2 cache; measured best of 64 KB..4 MB
SHM_DTYPES = frozenset({"float32", "float64", "float16", "bfloat16", "int32", "int64", "int8",
                        "uint8"})


def shm_enabled() -> bool:
    """False when `RAYTRAIN_X_SHM` is 0/false/off on this rank."""
    return settings.SHM.read()


def open_host_group(groups: ProcessGroups, timeout_s: float) -> _native.ShmGroup | None:
    """Collectively opens the shared-memory group of a single-host world, or returns None
    on every rank (multi-host world, one rank, or any rank unable to use it)."""
    if len({cross for _, cross in groups.layout}) != 1:
        return None
    return _open_for(groups.world, timeout_s)


def open_local_group(groups: ProcessGroups, timeout_s: float) -> _native.ShmGroup | None:
    """Collectively (among this host's ranks) opens a shared-memory group for the local
    stages of hierarchical allreduce in a multi-host world, or returns None."""
    return _open_for(groups.local, timeout_s)


def open_group(comm: Group, timeout_s: float) -> _native.ShmGroup | None:
    """Collectively (among `comm`'s members, all on one host) opens a shared-memory group,
    or returns None on every member (for a process set on one host)."""
    return _open_for(comm, timeout_s)


def _open_for(comm: Group, timeout_s: float) -> _native.ShmGroup | None:
    if comm.size < 2 or not comm.vote_all(shm_enabled()):
        return None
    name = comm.broadcast_object(f"/rtx-{os.getpid()}-{uuid.uuid4().hex[:12]}")
    group, reason = None, ""
    if comm.rank == 0:
        group, reason = _open(name, comm.rank, comm.size, True, timeout_s)
    try:
        if not comm.vote_all(comm.rank != 0 or group is not None):
            return _give_up(comm.rank, reason or "rank 0 could not create the segment")
        if comm.rank != 0:
            group, reason = _open(name, comm.rank, comm.size, False, timeout_s)
        opened = comm.vote_all(group is not None)
        visible = opened and comm.vote_all(group.peers_visible())
    finally:
        if group is not None:
            group.unlink()  # everyone has mapped it, given up or died: drop the name now
    if not visible:
        reason = reason or ("a rank could not open the segment" if not opened
                            else "ranks cannot see each other's processes")
        return _give_up(comm.rank, reason)
    return group


def _open(name: str, rank: int, size: int, create: bool,
          timeout_s: float) -> tuple[_native.ShmGroup | None, str]:
    try:
        return _native.ShmGroup(name, rank, size, SLOT_BYTES, create, timeout_s), ""
    except (RuntimeError, ValueError) as exc:
        return None, str(exc)


def _give_up(rank: int, reason: str) -> None:
    if rank == 0:
        log.info("raytrain-x: shared-memory allreduce unavailable (%s); using gloo", reason)
    return None
