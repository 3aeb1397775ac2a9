"""Transport choice: how a reduction travels once the engine has agreed to run it.

One host: the shared-memory group (`raytrain_x.comm.shm`) for the world's allreduces. Several
hosts: the backend's groups, and with `hierarchical_allreduce` on, local stages in the
host's shared-memory group (or the local group) around a cross-host allreduce of one shard.
Process sets always use their own backend group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from raytrain_x.comm.groups import ProcessGroups, ProcessSetGroup
from raytrain_x.comm.shm import SHM_DTYPES, open_host_group, open_local_group
from raytrain_x.common.errors import InternalError
from raytrain_x.engine.arrays import ArrayOps, ops_for


class Transport:
    """The routes of one rendezvous round; opened collectively (every rank, same order)."""

    def __init__(self, groups: ProcessGroups) -> None:
        self.groups = groups
        timeout_s = groups.rdv.timeout_s
        # Single-host worlds reduce through shared memory; in multi-host worlds each host's
        # ranks share memory for the local stages of hierarchical allreduce.
        self._shm = open_host_group(groups, timeout_s)
        self._local_shm = (open_local_group(groups, timeout_s)
                           if self._shm is None and self.multi_level() else None)

    @property
    def name(self) -> str:
        """'shm' when allreduces of the world go through shared memory; 'gloo+shm' when the
        world spans hosts (gloo) and each host's ranks share memory for the local stages of
        hierarchical allreduce (when that knob is on); else 'gloo'."""
        if self._shm is not None:
            return "shm"
        return "gloo+shm" if self._local_shm is not None else "gloo"

    def multi_level(self) -> bool:
        """True when the world has several hosts with several workers each (the case
        hierarchical collectives are for)."""
        rdv = self.groups.rdv
        return rdv.cross_size > 1 and rdv.local_size > 1 and self.groups.homogeneous()

    def abort(self) -> None:
        """Releases peers waiting in this host's shared memory now (this rank failed)."""
        for shm in (self._shm, self._local_shm):
            if shm is not None:
                shm.abort()

    def close(self) -> None:
        self.groups.close()
        self.groups.rdv.store = None
        self._shm = self._local_shm = None

    # ----------------------------------------------------------------- allreduce
    def world_allreduce(self, array: Any, op: str) -> None:
        """In-place allreduce over the world: shared memory when possible, else the
        backend."""
        if self._shm is not None and fits_shm(array):
            _shm_call(self._shm.allreduce, array, op)
        else:
            self.groups.world.allreduce(array, op)

    def allreduce(self, array: Any, op: str, pset: ProcessSetGroup,
                  hierarchical: bool) -> None:
        """In-place allreduce over `pset`'s members by the best route."""
        if self._shm is not None and pset.process_set_id == 0:
            self.world_allreduce(array, op)
        elif hierarchical and op == "sum" and pset.process_set_id == 0 and self.multi_level():
            self._hierarchical_allreduce(array)
        else:
            pset.group.allreduce(array, op)

    def can_reduce_many(self, pset: ProcessSetGroup, arrays: list[Any]) -> bool:
        """True when `allreduce_many` can reduce `arrays` straight from their memory."""
        return (self._shm is not None and pset.process_set_id == 0
                and all(fits_shm(a) for a in arrays))

    def allreduce_many(self, arrays: list[Any], op: str, prescale: float,
                       postscale: float) -> None:
        """Fused allreduce through the shared slots: each chunk is filled from the arrays
        (scaled) and the sums written back (scaled), with no fusion-buffer copies."""
        _shm_call(self._shm.allreduce_many, arrays, op, prescale, postscale)

    def _hierarchical_allreduce(self, array: Any) -> None:
        """Local reduce-scatter, cross allreduce of the shard, local allgather. With
        shared memory on this host: local allreduce and shard exchange in the segment.
        Shards are the same on every host either way (the cross allreduce pairs them)."""
        ops = ops_for(array)
        local, cross = self.groups.local, self.groups.cross
        flat = array.reshape(-1)
        pad = (-ops.numel(flat)) % local.size
        padded = _padded(ops, flat, pad)
        shm = self._local_shm
        if shm is not None and fits_shm(array):
            work = padded if pad else flat
            n = ops.numel(work) // local.size
            _shm_call(shm.allreduce, work, "sum")
            cross.allreduce(work[local.rank * n:(local.rank + 1) * n], "sum")
            _shm_call(shm.allgather_shards, work)
            if pad:
                flat[...] = work[: ops.numel(flat)]
            return
        work = padded if pad else ops.clone(flat)
        n = ops.numel(work) // local.size
        shard = ops.empty((n,), ops.dtype(work), ops.device(work))
        local.reduce_scatter(shard, work)
        cross.allreduce(shard, "sum")
        local.allgather([work[i * n:(i + 1) * n] for i in range(local.size)], shard)
        flat[...] = work[: ops.numel(flat)]

    # ----------------------------------------------------------------- allgather
    def allgather(self, outs: list[Any], array: Any, pset: ProcessSetGroup,
                  hierarchical: bool) -> None:
        if hierarchical and pset.process_set_id == 0 and self.multi_level():
            self._hierarchical_allgather(outs, array)
        else:
            pset.group.allgather(outs, array)

    def _hierarchical_allgather(self, outs: list[Any], array: Any) -> None:
        """Allgather within the host, then exchange whole host blocks across hosts."""
        ops = ops_for(array)
        local, cross = self.groups.local, self.groups.cross
        dtype, device = ops.dtype(array), ops.device(array)
        local_outs = [ops.empty(array.shape, dtype, device) for _ in range(local.size)]
        local.allgather(local_outs, array)
        block = ops.stack(local_outs)
        blocks = [ops.empty(block.shape, dtype, device) for _ in range(cross.size)]
        cross.allgather(blocks, block)
        layout = self.groups.layout
        for host_block, global_rank in zip(blocks, cross.ranks):
            host = layout[global_rank][1]
            host_ranks = [r for r, (_, c) in enumerate(layout) if c == host]
            for i, r in enumerate(host_ranks):
                outs[r][...] = host_block[i]


def fits_shm(array: Any) -> bool:
    """True when the shared-memory group can reduce `array` in place."""
    ops = ops_for(array)
    return (ops.device(array) == "cpu" and ops.dtype(array) in SHM_DTYPES
            and ops.is_contiguous(array))


def _padded(ops: ArrayOps, flat: Any, pad: int) -> Any:
    if not pad:
        return flat
    return ops.concat([flat, ops.zeros((pad,), ops.dtype(flat), ops.device(flat))])


def _shm_call(fn: Callable[..., Any], *args: Any) -> None:
    try:
        fn(*args)
    except RuntimeError as exc:
        raise InternalError(
            f"allreduce failed: {exc}. A peer process probably died or stalled; "
            "elastic jobs restore the last commit, others should be restarted."
        ) from exc
