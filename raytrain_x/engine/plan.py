"""The cycle's plan: pure decisions from what every member agreed, identical on every rank,
so every member acts alike without asking the others.

- which agreed requests share a batch (`plan_batches`): per-tensor allreduces of one key
  fused up to the fusion threshold (Horovod's tensor fusion); a unit a face formed
  (`Meta.fuse` False) always alone, as formed;
- the pieces a batch crosses a network in (`in_flight_pieces`), cut from agreed sizes and
  the layout facts agreed in negotiation;
- the route each batch takes (`allreduce_route`, `gather_route`, `flat_route`).

The routes:

- `ADASUM`: Adasum's own exchange of the fused batch (`engine.adasum`);
- `DEVICE`: arrays in device memory, fused on the device and reduced by the set's backend
  group (NCCL, or gloo for ranks sharing a GPU);
- `SHM`: the set's members share a host and a shared-memory group: the batch is summed in
  the shared slots straight from its arrays (or a packed buffer where the wire dtype
  differs or an array is not contiguous);
- `HIERARCHICAL`: several hosts with several workers each: each host's arrays summed in
  its shared memory, one shard per local rank across hosts, shards shared back;
- `IN_FLIGHT`: across a network, a batch with a large array crosses in pieces, a few on the
  wire at once, the engine going on while the last ones cross (`transport.PieceStream`);
- `NETWORK`: across a network, the batch as one flat array (in place where its arrays lie
  back to back, else packed) through the set's backend group.

What a rank does within a route with its own memory (reduce a span where it lies, or pack)
never changes what crosses: the elements go in batch order either way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

from raytrain_x.comm.shm import SHM_DTYPES
from raytrain_x.engine.messages import ALLREDUCE, Meta, Response

# Over a network, a fused batch with arrays of at least this many bytes crosses in pieces,
# the smaller arrays packed together first, each piece scaled (the small ones unpacked)
# while others cross, rather than the whole batch packed and unpacked while the link idles.
IN_FLIGHT_MIN_BYTES = 1 << 20
# Arrays that lie back to back on every rank cross together, in pieces up to this size (DDP's
# bucket): fewer, larger transfers than one per array, each costing a round of messages and
# the engine's handling; gloo over loopback, where that CPU is taken from the transfers, took
# 6% less a step than with 4 MB pieces, and a 1 Gbit/s link the same.
IN_FLIGHT_PIECE_BYTES = 25 << 20


def fusion_key(response: Response) -> tuple:
    """Responses with equal keys may share one fused collective."""
    m = response.meta
    return (m.dtype, m.wire_dtype, m.op, m.prescale, m.postscale, m.process_set_id, m.device)


def plan_batches(responses: list[Response], threshold_bytes: int,
                 plans: dict | None = None) -> list[list[Response]]:
    """Greedy fusion in response order: an allreduce joins the open batch with its key while
    the batch stays within `threshold_bytes` (0 = no fusion); everything else runs alone.
    Batches come out ordered by their first response, so every rank runs the same plan.
    `plans` (`Agreement.plans`) keeps each threshold's plan of these same responses."""
    if plans is not None and threshold_bytes in plans:
        return plans[threshold_bytes]
    batches: list[list[Response]] = []
    open_batch: dict[tuple, tuple[int, int]] = {}  # key -> (batch index, bytes so far)
    for r in responses:
        if r.error or r.meta.kind != ALLREDUCE or threshold_bytes <= 0 or not r.meta.fuse:
            batches.append([r])
            continue
        key = fusion_key(r)
        size = r.meta.nbytes_on_wire()
        current = open_batch.get(key)
        if current is not None and current[1] + size <= threshold_bytes:
            batches[current[0]].append(r)
            open_batch[key] = (current[0], current[1] + size)
        else:
            batches.append([r])
            open_batch[key] = (len(batches) - 1, size)
    if plans is not None:
        plans[threshold_bytes] = batches
    return batches


class Route(Enum):
    ADASUM = "adasum"
    DEVICE = "device"
    SHM = "shm"
    HIERARCHICAL = "hierarchical"
    IN_FLIGHT = "in_flight"
    NETWORK = "network"


@dataclass(frozen=True)
class Links:
    """What a process set's transport can do, the same on every member (set when the round
    or the set opened, collectively)."""

    shm: bool = False  # the members share a shared-memory group
    hierarchical: bool = False  # the global set of a world where hierarchical allreduce
    # applies: several hosts with several workers each, every host with shared memory
    multi_level: bool = False  # the global set of a world of several hosts with several
    # workers each (where a hierarchical allgather applies)


@dataclass(frozen=True)
class Batch:
    """The agreed facts of an allreduce batch that choose its route."""

    op: str  # the request's op: average, sum, min, max, product or adasum
    dtype: str
    wire_dtype: str  # the dtype it crosses in (fp16 compression), else `dtype`
    device: str  # "cpu" for host memory (every member's, as agreed)
    largest_bytes: int  # the largest array's bytes on the wire

    @staticmethod
    def of(metas: Sequence[Meta]) -> Batch:
        first = metas[0]
        device = "cpu" if all(m.device == "cpu" for m in metas) else first.device
        return Batch(first.op, first.dtype, first.wire_dtype or first.dtype, device,
                     max(m.nbytes_on_wire() for m in metas))

    @property
    def reduce_op(self) -> str:
        """The reduction on the wire: a sum for sum and average (scaled around it)."""
        return "sum" if self.op in ("sum", "average") else self.op


def allreduce_route(batch: Batch, links: Links, hierarchical_knob: bool) -> Route:
    """The route every member of the set takes for `batch`."""
    if batch.op == "adasum":
        return Route.ADASUM
    if batch.device != "cpu":
        return Route.DEVICE
    if links.shm:
        return Route.SHM if batch.wire_dtype in SHM_DTYPES else Route.NETWORK
    hierarchical = hierarchical_knob and batch.reduce_op == "sum" and links.hierarchical
    if hierarchical:
        return Route.HIERARCHICAL if batch.wire_dtype in SHM_DTYPES else Route.NETWORK
    if batch.wire_dtype == batch.dtype and batch.largest_bytes >= IN_FLIGHT_MIN_BYTES:
        return Route.IN_FLIGHT
    return Route.NETWORK


def gather_route(dtype: str, device: str, links: Links, hierarchical_knob: bool = False) -> Route:
    """The route of an allgather or a reduce-scatter over the set, from agreed facts only
    (a rank's own memory never decides it: a rank whose array is not contiguous copies it
    and takes the same route): `SHM` where the members share memory that takes the dtype,
    `HIERARCHICAL` for an allgather of the global set across several hosts with several
    workers each when the knob asks for it, else `NETWORK` (the set's backend group)."""
    if links.shm and device == "cpu" and dtype in SHM_DTYPES:
        return Route.SHM
    if hierarchical_knob and links.multi_level:
        return Route.HIERARCHICAL
    return Route.NETWORK


def flat_route(dtype: str, links: Links, hierarchical_knob: bool) -> Route:
    """The route of one flat host array summed over the set at once (a speculative
    cycle's readiness and batch): never in pieces, the engine waits for its result."""
    route = allreduce_route(Batch("sum", dtype, dtype, "cpu", 0), links, hierarchical_knob)
    return Route.NETWORK if route is Route.IN_FLIGHT else route


def in_flight_pieces(sizes: list[int], joined: list[bool] | None = None) -> list[list[int]]:
    """A batch's arrays (their bytes, in batch order) as pieces for the wire, in batch order
    after one packed piece of the small ones. `joined[i]`: array i lies right after array
    i - 1 in memory on every rank (views of one buffer, as `DistributedOptimizer`'s
    gradients are). Runs of joined arrays are cut into pieces of up to
    `IN_FLIGHT_PIECE_BYTES` (a larger array alone), each reduced where it lies; a piece of
    under `IN_FLIGHT_MIN_BYTES` gives its arrays to the packed piece, which goes first."""
    joined = joined or [False] * len(sizes)
    small: list[int] = []
    pieces: list[list[int]] = []
    piece: list[int] = []
    nbytes = 0

    def close() -> None:
        if nbytes >= IN_FLIGHT_MIN_BYTES:
            pieces.append(piece)
        else:
            small.extend(piece)

    for i, size in enumerate(sizes):
        if piece and (not joined[i] or nbytes + size > IN_FLIGHT_PIECE_BYTES):
            close()
            piece, nbytes = [], 0
        piece.append(i)
        nbytes += size
    if piece:
        close()
    return ([small] if small else []) + pieces


# ------------------------------------------------------------ layout facts
# Which arrays of a batch lie back to back on every rank: facts agreed in negotiation.
#
# Across a network, arrays that follow each other in memory on every member cross as one
# piece (`in_flight_pieces`), but whether they do is each rank's own fact, and every
# member must cut a batch into the same pieces. So the first time a pair of names meets in a
# world batch, each rank notes its own answer and the batch is cut as if they lay apart; the
# next cycle's status word (`engine.negotiation`) carries every rank's answers, and-ed, to all; from
# then on the batches that hold both cut alike, agreed, with no collective of their own. A
# layout that changes later costs a rank a copy (it packs that piece), never a wrong result.
#
# Pairs of other process sets are never voted on (the world's status word is not theirs):
# their arrays cross piece by piece.

Key = tuple[int, str, str]  # (process set, name, the next name)

# agreed pairs kept (a model's gradients: a few hundred); past it they are forgotten on
# every rank in the same cycle and asked again
AGREED_PAIRS = 1 << 16


class LayoutVotes:
    """The agreed layout facts of one engine, and this rank's answers waiting to be sent."""

    def __init__(self, capacity: int = AGREED_PAIRS) -> None:
        self._capacity = capacity
        self._agreed: dict[Key, bool] = {}
        self._asked: dict[Key, bool] = {}  # this rank's answers, in the order met

    def joined(self, set_id: int, names: Sequence[str],
               follows: Callable[[int], bool]) -> list[bool]:
        """For each array of a batch (`names`, in batch order), whether it crosses with the
        one before it: True only where every member agreed that it lies right after it.
        `follows(i)` is this rank's answer for arrays i and i + 1, asked once per pair."""
        out = [False]
        for i, (a, b) in enumerate(zip(names, names[1:])):
            key = (set_id, a, b)
            agreed = self._agreed.get(key)
            if agreed is None and set_id == 0 and key not in self._asked:
                self._asked[key] = follows(i)
            out.append(bool(agreed))
        return out

    def votes(self) -> list[bool]:
        """This rank's answers not sent yet, in the order met (the same pairs, in the same
        order, on every rank: batches run in the agreed order)."""
        return list(self._asked.values())

    def settle(self, agreed: Sequence[bool]) -> None:
        """Takes the and-ed answers to `votes()` from the status word."""
        if not self._asked:
            return
        if len(self._agreed) + len(self._asked) > self._capacity:
            self._agreed.clear()
        self._agreed.update(zip(self._asked, agreed))
        self._asked = {}
