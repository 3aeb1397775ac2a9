"""Per-collective execution: what runs once every member agreed on a batch.

Allreduce batches are fused (straight through shared memory, or packed by the native core
into a persistent fusion buffer, or concatenated on the device for CUDA tensors), reduced
once and scaled; across a network a batch with large tensors crosses in pieces, a few on
the wire at once, each scaled while another crosses; the other collectives run one at a
time. Arrays are whatever the caller sent (`raytrain_x.engine.arrays`), so this module
knows no framework.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from raytrain_x.comm.groups import ProcessSetGroup
from raytrain_x.common.knobs import Knobs
from raytrain_x.engine import adasum
from raytrain_x.engine.arrays import ops_for, ops_for_device
from raytrain_x.engine.buffers import FusionBufferPool, pack, unpack
from raytrain_x.engine.messages import (
    ALLGATHER,
    ALLREDUCE,
    ALLTOALL,
    BARRIER,
    BROADCAST,
    DTYPE_SIZES,
    REDUCESCATTER,
    Meta,
    Request,
    Response,
)
from raytrain_x.engine.plan import (
    Batch,
    LayoutVotes,
    Route,
    allreduce_route,
    flat_route,
    gather_route,
    in_flight_pieces,
)
from raytrain_x.engine.timeline import Timeline
from raytrain_x.engine.transport import IN_FLIGHT_HELD, PieceStream, Transport, fits_shm


@dataclass
class Move:
    """What a route's mover needs of an allreduce batch on this rank."""

    batch: list[Response]
    tensors: list[Any]  # this rank's arrays (zeros for a joined rank's)
    reduce_op: str  # on the wire: sum for sum and average
    pre: float  # scaling on the way in and out (integers: 1, scaled outside)
    post: float
    pset: ProcessSetGroup
    dtype: str  # the arrays' (agreed)
    wire: str  # the dtype on the wire
    # each array is one contiguous array, as its face vouched (`Request.contiguous`): it is
    # reduced where it lies without asking its family
    contiguous: bool = False
    _ops: Any = None

    @property
    def ops(self) -> Any:
        """The arrays' `ArrayOps`, looked up where a move needs them (packing, spans)."""
        if self._ops is None:
            self._ops = ops_for(self.tensors[0])
        return self._ops

    @property
    def row(self) -> str:
        """The timeline's row."""
        return self.batch[0].name if len(self.batch) == 1 else f"fused[{len(self.batch)}]"


class CollectiveRunner:
    """Runs agreed batches on this rank; `run` returns one result per response."""

    def __init__(self, transport: Transport, timeline: Timeline | None, stats: Any,
                 stream: PieceStream, layout: LayoutVotes) -> None:
        self.transport = transport
        self.timeline = timeline
        self.stats = stats  # the engine's EngineStats: counts fused and in-place batches
        self._buffers = FusionBufferPool()
        self._slot = 0  # the buffer slot the last packed piece took
        # the engine's pieces on a network's wire across batches: the in-flight route puts
        # a batch's pieces on it; the engine closes each batch on it and drains it
        self.stream = stream
        # which arrays lie back to back on every rank, as agreed in negotiation
        self.layout = layout
        self._kinds = {ALLREDUCE: self._allreduce, ALLGATHER: self._allgather,
                       BROADCAST: self._broadcast, ALLTOALL: self._alltoall,
                       REDUCESCATTER: self._reducescatter, BARRIER: self._barrier}
        self._movers = {Route.SHM: self._shm, Route.HIERARCHICAL: self._hierarchical,
                        Route.NETWORK: self._network, Route.IN_FLIGHT: self._in_flight,
                        Route.DEVICE: self._device}
        self._flat_movers = {
            Route.SHM: lambda flat, pset: transport.shm_allreduce(flat, "sum", pset),
            Route.HIERARCHICAL: lambda flat, pset: transport.hierarchical_allreduce(flat),
            Route.NETWORK: lambda flat, pset: transport.network_allreduce(flat, "sum", pset)}

    def run(self, batch: list[Response], requests: list[Request | None],
            pset: ProcessSetGroup, knobs: Knobs) -> list[Any]:
        """Results of `batch` (None for a response this rank did not submit: it joined).
        An allreduce batch across a network may still be crossing when this returns: its
        results are ready once `stream.close_batch` says so."""
        if batch[0].meta.kind != ALLREDUCE:
            self.stream.drain()
        return self._kinds[batch[0].meta.kind](batch, requests, pset, knobs)

    def fusion_buffer(self, dtype: str, nbytes: int) -> Any:
        """The first fusion buffer of `dtype`, at least `nbytes`, once no piece on the
        stream uses it (a speculative cycle packs its batch there)."""
        self.stream.drain()
        return self._buffers.get(dtype, nbytes)

    def sum_flat(self, flat: Any, dtype: str, row: str, pset: ProcessSetGroup,
                 knobs: Knobs) -> None:
        """Sums one flat host array of `dtype` over `pset` at once, by its route
        (`flat_route`), timed on the timeline's `row`."""
        route = flat_route(dtype, self.transport.links(pset), knobs.hierarchical_allreduce)
        self._timed(row, "ALLREDUCE", lambda: self._flat_movers[route](flat, pset))

    def _allreduce(self, batch, requests, pset, knobs):
        meta = batch[0].meta
        facts = Batch.of([r.meta for r in batch])
        route = allreduce_route(facts, self.transport.links(pset), knobs.hierarchical_allreduce)
        if route is not Route.IN_FLIGHT:
            self.stream.drain()
        tensors = [req.tensor if req is not None else _zeros(r.meta)
                   for r, req in zip(batch, requests)]
        if route is Route.ADASUM:
            return self._adasum(batch, requests, tensors, ops_for(tensors[0]), pset)
        floating = is_floating(meta.dtype)
        pre, post = scales(meta, len(pset.ranks))
        if not floating:  # Horovod's rule: integers are scaled in float64, outside the sum
            scale_integers(tensors, pre)
            int_post, pre, post = post, 1, 1
        if len(batch) > 1:
            self.stats.fused += 1
            self.stats.fused_tensors += len(batch)
        move = Move(batch, tensors, facts.reduce_op, pre, post, pset, meta.dtype,
                    facts.wire_dtype, all(req is not None and req.contiguous for req in requests))
        self._movers[route](move)
        if not floating:
            if route is Route.IN_FLIGHT:  # scaled in float64 once summed
                self.stream.drain()
            scale_integers(tensors, int_post)
        return [None if req is None else req.output if req.output is not None else req.tensor
                for req in requests]

    # ----------------------------------------------------------------- one mover per route
    def _shm(self, m: Move) -> None:
        """Summed in the set's shared slots straight from the arrays (scaled on the way in
        and out), or from a packed buffer where the wire dtype differs or an array is not
        contiguous."""
        arrays = m.tensors
        if len(arrays) > 1 and (span := m.ops.span(arrays)) is not None:
            arrays = [span]
            self.stats.fused_in_place += 1
        if m.wire == m.dtype and (m.contiguous or all(fits_shm(a) for a in arrays)):
            self._timed(m.row, "ALLREDUCE", lambda: self.transport.shm_allreduce_many(
                arrays, m.reduce_op, m.pre, m.post, m.pset))
        else:
            self._packed(m, lambda flat: self.transport.shm_allreduce(flat, m.reduce_op,
                                                                      m.pset))

    def _hierarchical(self, m: Move) -> None:
        self._flat(m, self.transport.hierarchical_allreduce)

    def _network(self, m: Move) -> None:
        self._flat(m, lambda flat, pre, post: self.transport.network_allreduce(
            flat, m.reduce_op, m.pset, pre, post))

    def _in_flight(self, m: Move) -> None:
        self.stats.fused_in_place += len(m.batch) > 1
        self._timed(m.row, "ALLREDUCE", lambda: self._allreduce_in_flight(m))

    def _device(self, m: Move) -> None:
        """Device memory: the native core packs host memory, so fuse on the device."""
        if len(m.tensors) == 1 and m.wire == m.dtype:
            self._timed(m.row, "ALLREDUCE", lambda: self.transport.network_allreduce(
                m.tensors[0], m.reduce_op, m.pset, m.pre, m.post))
            return
        ops = m.ops
        flat = ops.cast(ops.concat([t.reshape(-1) for t in m.tensors]), m.wire)
        if m.pre != 1.0:
            ops.scale(flat, m.pre)
        self._timed(m.row, "ALLREDUCE",
                    lambda: self.transport.network_allreduce(flat, m.reduce_op, m.pset))
        offset = 0
        for t in m.tensors:
            n = ops.numel(t)
            t[...] = flat[offset:offset + n].reshape(t.shape)
            offset += n
        if m.post != 1.0:
            for t in m.tensors:
                ops.scale(t, m.post)

    def _flat(self, m: Move, reduce: Callable[[Any, float, float], None]) -> None:
        """The batch as one flat host array: its one array, or its arrays where they lie
        back to back (DistributedOptimizer's gradients: no copies), scaled by the move
        (`reduce(array, pre, post)`), else packed into a fusion buffer (cast to the wire
        dtype, scaled while packing). The elements are in batch order each way, so ranks
        that pack agree with ranks that do not."""
        if m.wire == m.dtype:
            whole = m.tensors[0] if len(m.tensors) == 1 else m.ops.span(m.tensors)
            if whole is not None and (m.contiguous or m.ops.is_contiguous(whole)):
                self.stats.fused_in_place += len(m.tensors) > 1
                self._timed(m.row, "ALLREDUCE", lambda: reduce(whole, m.pre, m.post))
                return
        self._packed(m, lambda flat: reduce(flat, 1.0, 1.0))

    def _packed(self, m: Move, reduce: Callable[[Any], None]) -> None:
        total = sum(m.ops.numel(t) for t in m.tensors)
        buf = self._buffers.get(m.wire, total * DTYPE_SIZES[m.wire])
        names = [r.name for r in m.batch]
        self._timed(m.row, "MEMCPY_IN_FUSION_BUFFER",
                    lambda: pack(m.tensors, buf, m.pre, 0, names))
        flat = m.ops.view_buffer(buf, total)
        self._timed(m.row, "ALLREDUCE", lambda: reduce(flat))
        self._timed(m.row, "MEMCPY_OUT_FUSION_BUFFER",
                    lambda: unpack(buf, m.tensors, m.post, 0, names))

    def _allreduce_in_flight(self, m: Move) -> None:
        """A batch across a network, in pieces cut from the agreed sizes and memory layout
        (`in_flight_pieces`) onto the stream: arrays back to back on every rank reduced
        where they lie, up to `IN_FLIGHT_PIECE_BYTES` at a time, the small rest packed
        together; each piece is scaled (unpacked) while the next one crosses, and the
        batch's last pieces may still cross when this returns (`PieceStream`). A rank whose
        arrays no longer lie as agreed packs that piece (same elements on the wire, in the
        same order). A piece reduced where it lies is scaled by the transfer itself; a
        packed one while packing and unpacking."""
        batch, tensors, pre, post, wire = m.batch, m.tensors, m.pre, m.post, m.wire
        # the family is asked only for a pair of arrays not voted on yet (a unit has none)
        joined = self.layout.joined(m.pset.process_set_id, [r.name for r in batch],
                                    lambda i: m.ops.follows(tensors[i], tensors[i + 1]))
        pieces = in_flight_pieces([r.meta.nbytes_on_wire() for r in batch], joined)
        self.stats.in_flight_pieces += len(pieces)

        def prepare(k: int) -> tuple[Any, Callable[[], Any], float, float]:
            """The piece's array on the wire, what finishes it, and its scaling there."""
            members = [tensors[i] for i in pieces[k]]
            whole = members[0] if len(members) == 1 else m.ops.span(members)
            if whole is None:
                names = [batch[i].name for i in pieces[k]]
                ops = m.ops
                # packed pieces take turns over buffers enough for those not finished
                self._slot = self._slot % (IN_FLIGHT_HELD + 1) + 1
                total = sum(ops.numel(t) for t in members)
                buf = self._buffers.get(wire, total * DTYPE_SIZES[wire], slot=self._slot)
                pack(members, buf, pre, 0, names)
                return (ops.view_buffer(buf, total),
                        lambda: unpack(buf, members, post, 0, names), 1.0, 1.0)
            return whole, _nothing, pre, post

        # room is made before each send, not after the last: the next cycle negotiates
        # while this batch's last pieces cross
        stream = self.stream
        ready = prepare(0)
        for k in range(len(pieces)):
            stream.make_room()
            array, after, piece_pre, piece_post = ready
            stream.send(m.pset.group, array, m.reduce_op, after, piece_pre, piece_post)
            ready = prepare(k + 1) if k + 1 < len(pieces) else None

    def _adasum(self, batch, requests, tensors, ops, pset):
        """The batch's tensors, each combined by Adasum across the set (engine.adasum)."""
        meta = batch[0].meta
        flat = ops.concat([ops.cast(t.reshape(-1), "float64") for t in tensors])
        if meta.prescale != 1.0:
            ops.scale(flat, meta.prescale)
        row = batch[0].name if len(batch) == 1 else f"fused[{len(batch)}]"
        self._timed(row, "ADASUM", lambda: adasum.allreduce(
            flat, [ops.numel(t) for t in tensors], pset.group, pset.rank(), pset.size(), ops))
        if meta.postscale != 1.0:
            ops.scale(flat, meta.postscale)
        offset = 0
        for t in tensors:
            n = ops.numel(t)
            t[...] = ops.cast(flat[offset:offset + n].reshape(t.shape), ops.dtype(t))
            offset += n
        return [None if req is None else req.output if req.output is not None else req.tensor
                for req in requests]

    def _allgather(self, batch, requests, pset, knobs):
        (resp,), (req,) = batch, requests
        dims = list(resp.rank_dims)
        tensor = req.tensor
        ops = ops_for(tensor)
        dtype, device = ops.dtype(tensor), ops.device(tensor)
        route = gather_route(resp.meta.dtype, resp.meta.device, self.transport.links(pset),
                             knobs.hierarchical_allgather)
        if route is not Route.NETWORK:
            tensor = _contiguous(tensor, ops)
        longest = max(dims)
        if min(dims) == longest and route is not Route.HIERARCHICAL:
            out = _output_that_fits(req, (longest * len(dims), *tensor.shape[1:]), ops)
            if ops.numel(out):  # else every member's block is empty alike
                move = (self.transport.shm_allgather_into if route is Route.SHM
                        else lambda o, a, p: p.group.allgather_into(o, a))
                self._timed(resp.name, "ALLGATHER", lambda: move(out, tensor, pset))
            return [out]
        padded = tensor
        if tensor.shape[0] != longest:
            padded = ops.zeros((longest, *tensor.shape[1:]), dtype, device)
            padded[: tensor.shape[0]] = tensor
        outs = [ops.empty(padded.shape, dtype, device) for _ in dims]
        moves = {Route.SHM: lambda: self.transport.shm_allgather(outs, padded, pset),
                 Route.HIERARCHICAL: lambda: self.transport.hierarchical_allgather(outs, padded),
                 Route.NETWORK: lambda: pset.group.allgather(outs, padded)}
        self._timed(resp.name, "ALLGATHER", moves[route])
        return [ops.concat([o[:d] for o, d in zip(outs, dims)])]

    def _broadcast(self, batch, requests, pset, knobs):
        (resp,), (req,) = batch, requests
        root = pset.ranks.index(resp.meta.root)
        self._timed(resp.name, "BROADCAST", lambda: pset.group.broadcast(req.tensor, root))
        return [req.output if req.output is not None else req.tensor]

    def _alltoall(self, batch, requests, pset, knobs):
        (resp,), (req,) = batch, requests
        ops = ops_for(req.tensor)
        me = pset.rank()
        in_splits = list(resp.rank_dims[me])
        out_splits = [splits[me] for splits in resp.rank_dims]
        output = ops.empty((sum(out_splits), *req.tensor.shape[1:]), ops.dtype(req.tensor),
                           ops.device(req.tensor))
        self._timed(resp.name, "ALLTOALL",
                    lambda: pset.group.alltoall(output, req.tensor, out_splits, in_splits))
        return [(output, ops.int32(out_splits))]

    def _reducescatter(self, batch, requests, pset, knobs):
        (resp,), (req,) = batch, requests
        meta = resp.meta
        ops = ops_for(req.tensor)
        work = req.tensor  # read, never written, when there is no prescaling
        floating = ops.is_floating(work)
        if meta.prescale != 1.0:
            work = ops.clone(work)
            if floating:
                ops.scale(work, meta.prescale)
            else:
                scale_integers([work], meta.prescale)
        n, dim0 = pset.size(), work.shape[0]
        me = pset.rank()
        if dim0 % n == 0:  # equal shares: a true reduce-scatter
            work = _contiguous(work, ops)
            out = _output_that_fits(req, (dim0 // n, *work.shape[1:]), ops)
            move = (self.transport.shm_reducescatter
                    if gather_route(meta.dtype, meta.device, self.transport.links(pset))
                    is Route.SHM else lambda o, a, p: p.group.reduce_scatter(o, a))
            if ops.numel(work):  # else there is nothing to reduce, on any member
                self._timed(resp.name, "REDUCESCATTER", lambda: move(out, work, pset))
        else:  # Horovod's uneven split (the first dim0 % n members one row more)
            if work is req.tensor:
                work = ops.clone(work)
            self._timed(resp.name, "REDUCESCATTER", lambda: pset.group.allreduce(work, "sum"))
            sizes = [dim0 // n + (1 if i < dim0 % n else 0) for i in range(n)]
            out = ops.clone(work[sum(sizes[:me]): sum(sizes[: me + 1])])
        post = meta.postscale / (n if meta.op == "average" else 1)
        if floating:
            if post != 1.0:
                ops.scale(out, post)
        else:
            scale_integers([out], post)
        return [out]

    def _barrier(self, batch, requests, pset, knobs):
        return [None]  # negotiation itself was the rendezvous of every member

    def _timed(self, row: str, activity: str, fn: Callable[[], Any]) -> Any:
        if self.timeline is None:
            return fn()
        began = time.perf_counter()
        out = fn()
        self.timeline.record(row, activity, began, time.perf_counter())
        return out


def is_floating(dtype: str) -> bool:
    """Whether arrays of `dtype` (a canonical name) are floating point."""
    return dtype.startswith(("float", "bfloat"))


def scales(meta: Meta, size: int) -> tuple[float, float]:
    """The factors applied on the way into and out of a sum (average: 1/size after)."""
    scaled = meta.op in ("sum", "average")
    pre = meta.prescale if scaled else 1.0
    post = meta.postscale if scaled else 1.0
    if meta.op == "average":
        post /= size
    return pre, post


def scale_integers(tensors: list[Any], factor: float) -> None:
    """Scales integer tensors as Horovod does: in float64, cast back toward zero (so a
    factor below 1 does not turn every value into 0, and an average truncates)."""
    if factor == 1.0:
        return
    for t in tensors:
        ops = ops_for(t)
        t[...] = ops.cast(ops.cast(t, "float64") * factor, ops.dtype(t))


def _nothing() -> None:
    pass


def _zeros(meta: Meta) -> Any:
    """A joined rank's contribution to an allreduce it did not submit."""
    return ops_for_device(meta.device).zeros(meta.shape, meta.dtype, meta.device)


def _contiguous(array: Any, ops) -> Any:
    """`array`, or a contiguous copy of it (what shared memory and the backends take)."""
    if ops.is_contiguous(array):
        return array
    copy = ops.empty(tuple(array.shape), ops.dtype(array), ops.device(array))
    copy[...] = array
    return copy


def _output_that_fits(req, shape: tuple, ops) -> Any:
    """The caller's `output` buffer where it can take the result in place (this shape,
    contiguous, the input's dtype and device), else a new array."""
    dtype, device = ops.dtype(req.tensor), ops.device(req.tensor)
    out = req.output
    if out is None or tuple(out.shape) != shape or not ops.is_contiguous(out) or \
            ops.dtype(out) != dtype or ops.device(out) != device:
        return ops.empty(shape, dtype, device)
    return out
