"""The links of a rendezvous round, and the moves over them.

One host: the shared-memory group (`raytrain_x.comm.shm`) for the world's allreduces and
allgathers. Several hosts: the backend's groups, and where every host's workers share
memory, local stages in the host's shared-memory group (or, for allgather, the local
group) around a cross-host stage. A process set whose members share a host gets a
shared-memory group of its own; other sets use their backend group.

`links(pset)` says what a set's links can do (the same on every member); which of them a
collective takes is `engine.plan`'s decision, and the moves here carry it out. Across a
network, the pieces of batches cross on a stream, a few at once (`PieceStream`).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from raytrain_x.comm.groups import ProcessGroups, ProcessSetGroup
from raytrain_x.comm.shm import (
    SHM_DTYPES,
    ShmGroup,
    open_group,
    open_host_group,
    open_local_group,
)
from raytrain_x.common.errors import InternalError
from raytrain_x.engine.arrays import ArrayOps, ops_for
from raytrain_x.engine.messages import DTYPE_SIZES
from raytrain_x.engine.plan import Links

# Hierarchical allreduce runs in chunks this size; with shared memory on the host, one
# chunk's local sum overlaps the previous chunk's network transfer.
PIPELINE_CHUNK_BYTES = 4 << 20
# Pieces crossing at once: gloo's two threads, one for each; the next piece goes out as
# soon as either lands, whichever it is. More wait in gloo's queue, which also holds the
# engine's next negotiation behind them: the torch face's gradients across a network gained
# a little with 4, the TensorFlow face's chunks lost more (each batch of chunks agreed later).
IN_FLIGHT_DEPTH = 2
# Pieces sent and not yet finished (landed, then scaled or unpacked in order): a large piece
# may still cross while smaller ones behind it land and more go out, up to this many.
IN_FLIGHT_HELD = 2 * IN_FLIGHT_DEPTH


class Transport:
    """The routes of one rendezvous round; opened collectively (every rank, same order)."""

    def __init__(self, groups: ProcessGroups) -> None:
        self.groups = groups
        rdv = groups.rdv
        timeout_s = rdv.timeout_s
        # several hosts with several workers each: the case hierarchical collectives are for
        self._multi_level = rdv.cross_size > 1 and rdv.local_size > 1 and groups.homogeneous()
        # Single-host worlds reduce through shared memory; in multi-host worlds each host's
        # ranks share memory for the local stages of hierarchical allreduce.
        self._shm = open_host_group(groups, timeout_s)
        self._local_shm = (open_local_group(groups, timeout_s)
                           if self._shm is None and self.multi_level() else None)
        # Hierarchical allreduce sums each host's arrays in its shared memory; with local
        # stages over gloo instead it cost 4.3x raw gloo (docs/performance.md, Hierarchical
        # allreduce). Every host must route alike, so the hosts vote on it.
        self.hierarchical_allreduce_applies = (
            self.multi_level() and _everyone(groups, self._local_shm is not None))
        self._set_shm: dict[int, ShmGroup] = {}  # process sets on one host (members only)

    @property
    def name(self) -> str:
        """'shm' when allreduces of the world go through shared memory; 'gloo+shm' when the
        world spans hosts (gloo) and each host's ranks share memory for the local stages of
        hierarchical allreduce and allgather (when those knobs are on); else 'gloo'."""
        if self._shm is not None:
            return "shm"
        return "gloo+shm" if self._local_shm is not None else "gloo"

    def name_of(self, pset: ProcessSetGroup) -> str:
        """How `pset`'s collectives travel: the world's `name` for the global set; 'shm' for
        a set on one host with shared memory; 'gloo' otherwise; 'none' on a non-member."""
        if pset.process_set_id == 0:
            return self.name
        if not pset.included():
            return "none"
        return "shm" if pset.process_set_id in self._set_shm else "gloo"

    def open_process_set(self, pset: ProcessSetGroup) -> None:
        """Collectively among `pset`'s members: a shared-memory group when they all run on
        this host (the same test as the world's: every member must be able to use it)."""
        hosts = {self.groups.layout[r][1] for r in pset.ranks}
        if pset.included() and len(hosts) == 1 and pset.size() > 1:
            shm = open_group(pset.group, self.groups.rdv.timeout_s)
            if shm is not None:
                self._set_shm[pset.process_set_id] = shm

    def close_process_set(self, process_set_id: int) -> None:
        self._set_shm.pop(process_set_id, None)

    def _shm_of(self, pset: ProcessSetGroup) -> ShmGroup | None:
        if pset.process_set_id == 0:
            return self._shm
        return self._set_shm.get(pset.process_set_id)

    def multi_level(self) -> bool:
        """True when the world has several hosts with several workers each (the case
        hierarchical collectives are for)."""
        return self._multi_level

    def abort(self) -> None:
        """This rank's engine failed: its peers must fail now, not at their timeout. Those
        waiting in this host's shared memory are released, and the groups are closed, so
        that peers waiting on this rank in a collective see its connections close (a peer
        that lost another rank stops taking part, but its process and sockets live on:
        without this, every rank that was not talking to the lost one at that moment
        waited for the collective timeout). Called on the engine thread, the only one that
        runs collectives, once it has stopped."""
        for shm in (self._shm, self._local_shm, *self._set_shm.values()):
            if shm is not None:
                shm.abort()
        self.groups.close(abort=True)

    def close(self) -> None:
        self.groups.close()
        self.groups.rdv.store = None
        self._shm = self._local_shm = None
        self._set_shm.clear()

    def links(self, pset: ProcessSetGroup) -> Links:
        """What `pset`'s links can do (`engine.plan`), the same on every member."""
        world = pset.process_set_id == 0
        return Links(shm=self._shm_of(pset) is not None,
                     hierarchical=world and self.hierarchical_allreduce_applies,
                     multi_level=world and self._multi_level)

    # ----------------------------------------------------------------- allreduce
    def world_allreduce(self, array: Any, op: str) -> None:
        """In-place allreduce of a small control array (int64, host memory) over the
        world: in shared memory on one host, else the backend's world group."""
        if self._shm is not None:
            _shm_call(self._shm.allreduce, array, op)
        else:
            self.groups.world.allreduce_control(array, op)

    def shm_allreduce(self, array: Any, op: str, pset: ProcessSetGroup) -> None:
        """`array` (host memory, contiguous) reduced in place in `pset`'s shared memory."""
        _shm_call(self._shm_of(pset).allreduce, array, op)

    def network_allreduce(self, array: Any, op: str, pset: ProcessSetGroup,
                          prescale: float = 1.0, postscale: float = 1.0) -> None:
        """`array` reduced in place by `pset`'s backend group (scaled on the way in and
        out by the group: `Group.allreduce`)."""
        pset.group.allreduce(array, op, prescale, postscale)

    def shm_allreduce_many(self, arrays: list[Any], op: str, prescale: float,
                       postscale: float, pset: ProcessSetGroup) -> None:
        """Fused allreduce through the shared slots: each chunk is filled from the arrays
        (scaled) and the sums written back (scaled), with no fusion-buffer copies."""
        _shm_call(self._shm_of(pset).allreduce_many, arrays, op, prescale, postscale)

    def hierarchical_allreduce(self, array: Any, prescale: float = 1.0,
                               postscale: float = 1.0) -> None:
        """Local sum in shared memory, cross allreduce of one shard per local rank, shards
        exchanged in shared memory, in chunks of `PIPELINE_CHUNK_BYTES`: while one chunk's
        shard crosses the network, the next chunk is summed in the segment. Scaled by
        `prescale` before and `postscale` after."""
        ops = ops_for(array)
        if prescale != 1.0:
            ops.scale(array, prescale)
        self._hierarchical_sum(array, ops)
        if postscale != 1.0:
            ops.scale(array, postscale)

    def _hierarchical_sum(self, array: Any, ops: ArrayOps) -> None:
        local, cross = self.groups.local, self.groups.cross
        flat = array.reshape(-1)
        pad = (-ops.numel(flat)) % local.size
        chunks = _chunks(ops.numel(flat) + pad, local.size,
                         PIPELINE_CHUNK_BYTES // DTYPE_SIZES.get(ops.dtype(array), 4))
        shm = self._local_shm
        work = _padded(ops, flat, pad)
        in_flight: list[tuple[Callable[[], None], Any]] = []
        for lo, hi in chunks:
            chunk, n = work[lo:hi], (hi - lo) // local.size
            _shm_call(shm.allreduce, chunk, "sum")
            in_flight.append((cross.allreduce_async(
                chunk[local.rank * n:(local.rank + 1) * n], "sum"), chunk))
            if len(in_flight) > 1:
                self._finish_chunk(*in_flight.pop(0))
        for wait, chunk in in_flight:
            self._finish_chunk(wait, chunk)
        if pad:
            flat[...] = work[: ops.numel(flat)]

    def _finish_chunk(self, wait: Callable[[], None], chunk: Any) -> None:
        wait()
        _shm_call(self._local_shm.allgather_shards, chunk)

    # ------------------------------------------------ allgather and reduce-scatter
    def shm_allgather(self, outs: list[Any], array: Any, pset: ProcessSetGroup) -> None:
        """Equally shaped, contiguous `array`s of every member into `outs`, through the
        set's shared memory."""
        block = _shm_allgather(self._shm_of(pset), array)
        for i, out in enumerate(outs):
            out[...] = block[i]

    def shm_allgather_into(self, out: Any, array: Any, pset: ProcessSetGroup) -> None:
        """Every member's equally shaped, contiguous `array`, member by member along dim 0
        of the contiguous `out`, in place in the set's shared memory."""
        rows = array.shape[0]
        mine = out[pset.rank() * rows:(pset.rank() + 1) * rows]
        if not _same_memory(mine, array):
            mine[...] = array
        _shm_call(self._shm_of(pset).allgather_shards, out)

    def shm_reducescatter(self, out: Any, array: Any, pset: ProcessSetGroup) -> None:
        """The sum of every member's contiguous `array` (dim 0 a multiple of the set's
        size), this member's equal share into `out`, reduced in the set's shared memory."""
        _shm_call(self._shm_of(pset).reduce_scatter, array, out, "sum")

    def hierarchical_allgather(self, outs: list[Any], array: Any) -> None:
        """Allgather of the global set within each host (shared memory when the host has
        it and it takes the dtype), then whole host blocks exchanged across hosts."""
        ops = ops_for(array)
        local, cross = self.groups.local, self.groups.cross
        dtype, device = ops.dtype(array), ops.device(array)
        if self._local_shm is not None and device == "cpu" and dtype in SHM_DTYPES:
            block = _shm_allgather(self._local_shm, array)
        else:
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


def _chunks(total: int, parts: int, chunk_elements: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges covering `total` elements (a multiple of `parts`), each a multiple of
    `parts` long and about `chunk_elements` (at least one element per part)."""
    step = max(parts, chunk_elements // parts * parts)
    return [(lo, min(lo + step, total)) for lo in range(0, total, step)] or [(0, 0)]


def _shm_allgather(shm: ShmGroup, array: Any) -> Any:
    """Every member's `array`, stacked in member order, gathered through the segment."""
    ops = ops_for(array)
    n = ops.numel(array)
    work = ops.empty((shm.size * n,), ops.dtype(array), ops.device(array))
    if n == 0:  # every member's block is empty alike (equal shapes): nothing to exchange
        return work.reshape(shm.size, *array.shape)
    work[shm.rank * n:(shm.rank + 1) * n] = array.reshape(-1)
    _shm_call(shm.allgather_shards, work)
    return work.reshape(shm.size, *array.shape)


def _same_memory(a: Any, b: Any) -> bool:
    """True when `b` is `a`'s very memory (an allgather's input already in its slot)."""
    pointer = getattr(a, "data_ptr", None)
    if pointer is not None:
        return a.data_ptr() == b.data_ptr() and a.shape == b.shape
    return a.__array_interface__["data"][0] == b.__array_interface__["data"][0]


def fits_shm(array: Any) -> bool:
    """True when the shared-memory group can reduce `array` in place."""
    ops = ops_for(array)
    return (ops.device(array) == "cpu" and ops.dtype(array) in SHM_DTYPES
            and ops.is_contiguous(array))


def _everyone(groups: ProcessGroups, yes: bool) -> bool:
    """True when `yes` holds on every rank of the world (a collective)."""
    vote = np.array([1 if yes else 0], dtype=np.int64)
    groups.world.allreduce(vote, "min")
    return bool(vote[0])


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


class _Piece:
    __slots__ = ("wait", "after", "done", "landed")

    def __init__(self, after: Callable[[], None]) -> None:
        # raises when the transfer failed; set as it is sent, before the stream holds it
        self.wait: Callable[[], None] | None = None
        self.after = after
        self.done: Callable[[BaseException | None], None] | None = None  # its batch's
        self.landed = False


class PieceStream:
    """Pieces of fused batches on a network group's wire, in order, `IN_FLIGHT_DEPTH`
    crossing at once, across batches: the last pieces of one batch are still crossing
    while the engine agrees on the next one. A piece goes out as soon as any crossing one
    lands. Pieces are finished in the order they were sent: each piece's `after` (its
    scaling or unpacking) runs once it and every piece before it have landed, at the next
    `send` (so that the next piece is already on the wire) or `drain`; a batch's `done`
    runs after its last piece's `after`.

    Every rank sends the same pieces in the same order (they are cut from agreed sizes), so
    when this rank's pieces land says nothing the others must match."""

    def __init__(self, wakes: threading.Condition | None = None) -> None:
        self._pieces: deque[_Piece] = deque()  # sent, not finished; oldest first
        self._cond = threading.Condition()  # a piece landed
        # notified (from the group's thread) whenever a piece lands: the condition an idle
        # engine waits on in `wait_for_work`
        self.wakes = wakes

    def __len__(self) -> int:
        return len(self._pieces)

    def send(self, group: Any, array: Any, op: str, after: Callable[[], None],
             prescale: float = 1.0, postscale: float = 1.0) -> None:
        """Puts `array` on the wire (scaled by the group on the way in and out:
        `Group.allreduce_async`), then finishes the pieces that landed before it."""
        piece = _Piece(after)
        piece.wait = group.allreduce_async(array, op, lambda: self._landed(piece),
                                           prescale, postscale)
        self._pieces.append(piece)
        self.finish_landed(before=piece)

    def make_room(self) -> None:
        """Waits until fewer than `IN_FLIGHT_DEPTH` pieces cross and fewer than
        `IN_FLIGHT_HELD` are unfinished (finishing the oldest for room)."""
        with self._cond:
            self._cond.wait_for(
                lambda: sum(not p.landed for p in self._pieces) < IN_FLIGHT_DEPTH)
        while len(self._pieces) >= IN_FLIGHT_HELD:
            self._land_oldest()

    def close_batch(self, done: Callable[[BaseException | None], None]) -> None:
        """`done(None)` once every piece sent so far has landed and been finished."""
        if self._pieces:
            self._pieces[-1].done = done
        else:
            done(None)

    def wait_for_work(self, has_work: Callable[[], bool], seconds: float) -> None:
        """Until `has_work()` (asked under `wakes`, which whoever brings work notifies) or
        `seconds` pass, finishing the pieces as they land (each landing notifies `wakes`
        too), so their batches complete while the engine has nothing else to do."""
        deadline = time.monotonic() + seconds
        while True:
            self.finish_landed()
            with self.wakes:
                left = deadline - time.monotonic()
                if has_work() or left <= 0:
                    return
                if not (self._pieces and self._pieces[0].landed):  # else: finish it first
                    self.wakes.wait(left)

    def drain(self) -> None:
        """Lands and finishes every piece."""
        while self._pieces:
            self._land_oldest()

    def fail(self, error: BaseException) -> None:
        """Gives `error` to every batch still on the wire and forgets them."""
        pieces = list(self._pieces)
        self._pieces.clear()
        for piece in pieces:
            if piece.done is not None:
                piece.done(error)

    def _landed(self, piece: _Piece) -> None:  # from the group's thread
        with self._cond:
            piece.landed = True
            self._cond.notify_all()
        if self.wakes is not None:
            with self.wakes:
                self.wakes.notify_all()

    def _land_oldest(self) -> None:
        oldest = self._pieces[0]
        with self._cond:
            self._cond.wait_for(lambda: oldest.landed)
        self.finish_landed()

    def finish_landed(self, before: _Piece | None = None) -> None:
        """Finishes the landed pieces at the head, oldest first (up to `before`); never
        waits for one still crossing."""
        while self._pieces and self._pieces[0].landed and self._pieces[0] is not before:
            piece = self._pieces[0]
            piece.wait()  # raises when the transfer failed: the piece stays for `fail`
            self._pieces.popleft()
            try:
                piece.after()
            except BaseException as exc:
                if piece.done is not None:
                    piece.done(exc)
                raise
            if piece.done is not None:
                piece.done(None)
