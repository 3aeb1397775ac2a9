"""Which way an agreed allreduce batch (and an allgather or reduce-scatter) travels: one
pure decision, from facts every member shares (the batch's agreed metadata, what the
set's links can do, the knobs), so every member of the set takes the same route without
asking the others.

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
  wire at once, the engine going on while the last ones cross (`engine.pieces`);
- `NETWORK`: across a network, the batch as one flat array (in place where its arrays lie
  back to back, else packed) through the set's backend group.

What a rank does within a route with its own memory (reduce a span where it lies, or pack)
never changes what crosses: the elements go in batch order either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from raytrain_x.comm.shm import SHM_DTYPES
from raytrain_x.engine.messages import Meta
from raytrain_x.engine.pieces import IN_FLIGHT_MIN_BYTES


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
