"""Speculative cycles: one round trip for a small allreduce that repeats every step.

Over a network every negotiating cycle costs a round trip (the status-word allreduce)
before the data's own allreduce, so a small cached allreduce pays two. A training loop,
though, sends the same small batches every step, in the same order. Once every rank has
seen the same cached batch follow the one before it twice in a row, each rank expects it
again, and the next cycle sends one allreduce(sum) of [readiness, the batch's data]: a
rank adds 1 when its pending requests are exactly that batch (same names, same
descriptions) and it has nothing else to say (no shutdown, join or knob change), else 0
and zeros. A count equal to the world size means every rank contributed the real data:
the sums are the result and the step took one round trip. Any other count discards the
sums (the inputs were copied, not reduced in place), the expectation is dropped on every
rank alike, and the cycle goes on with ordinary negotiation. The decision is a function
of agreed history only, so every rank makes the same one.

Everything of it is here: what every rank expects (`Speculator`, from the batches that
negotiation agreed), whether this rank is ready, the exchange of readiness and data, and
its verdict (`Speculation`). The engine asks it first in a cycle where a batch is expected,
and completes the batch's handles when it succeeded; execution lends it a fusion buffer
and a flat sum over the network.
"""

from __future__ import annotations

from math import prod
from typing import Any

from raytrain_x.comm.groups import ProcessSetGroup
from raytrain_x.common.knobs import Knobs
from raytrain_x.engine.arrays import ops_for, ops_for_device
from raytrain_x.engine.buffers import pack, unpack
from raytrain_x.engine.execution import CollectiveRunner, scale_integers, scales
from raytrain_x.engine.messages import ALLREDUCE, DTYPE_SIZES, Request, Response
from raytrain_x.engine.planner import fusion_key

MAX_BYTES = 64 << 10  # beyond this the saved round trip is noise next to the data
# dtypes whose sum of 0/1 counts stays exact for any world this engine runs
COUNT_DTYPES = frozenset({"float32", "float64", "int32", "int64"})


def speculable(batch: list[Response]) -> bool:
    """Whether a negotiated batch may be sent speculatively next time: allreduces of the
    global set, fusable together, in a dtype that holds the readiness count exactly, summed
    (or averaged), in host memory, small."""
    if not batch:
        return False
    key = fusion_key(batch[0])
    meta = batch[0].meta
    return (all(not r.error and r.meta.kind == ALLREDUCE and fusion_key(r) == key
                for r in batch)
            and meta.process_set_id == 0 and meta.device == "cpu"
            and meta.op in ("sum", "average") and meta.dtype in COUNT_DTYPES
            and meta.wire_dtype in ("", meta.dtype)
            and sum(r.meta.nbytes_on_wire() for r in batch) <= MAX_BYTES)


def elements(batch: list[Response]) -> list[int]:
    return [prod(r.meta.shape) for r in batch]


class Speculator:
    """What every rank expects the next cycle to run (identical on all ranks).

    It learns which batch followed which (a loop of one batch, or of several small
    allreduces in turn: loss, then accuracy) from the batches every rank ran, and expects a
    successor once it followed the same batch twice in a row.
    """

    MAX_TRANSITIONS = 64

    def __init__(self) -> None:
        self._prev: tuple | None = None  # the last batch run (None: not speculable)
        # batch -> (the batch that followed it, how many times in a row)
        self._next: dict[tuple, tuple[list[Response], int]] = {}
        self.expected: list[Response] | None = None
        self.hits = 0
        self.misses = 0

    def observe(self, responses: list[Response], cached: bool) -> None:
        """After a negotiated cycle that ran `responses` (all in the response cache when
        `cached`)."""
        if responses:
            self._advance(responses if cached and speculable(responses) else None)

    def ready(self, pending: dict[str, Request]) -> bool:
        """Whether this rank's pending requests are exactly the expected batch."""
        expected = self.expected
        if expected is None or len(pending) != len(expected):
            return False
        for r in expected:
            req = pending.get(r.name)
            if req is None or req.meta != r.meta:
                return False
        return True

    def succeeded(self) -> None:
        self.hits += 1
        self._advance(self.expected)

    def failed(self) -> None:
        """Forgets the transition that was expected (every rank sees the same count, so
        all forget it); the negotiated batch that runs instead follows the same one."""
        self.misses += 1
        self._next.pop(self._prev, None)
        self.expected = None

    def reset(self) -> None:
        """Knobs changed: expect nothing until batches repeat under the new ones."""
        self._prev = None
        self._next.clear()
        self.expected = None

    def _advance(self, batch: list[Response] | None) -> None:
        key = _key(batch) if batch is not None else None
        if self._prev is not None and key is not None:
            follower = self._next.get(self._prev)
            times = follower[1] + 1 if follower and _key(follower[0]) == key else 1
            if len(self._next) >= self.MAX_TRANSITIONS and self._prev not in self._next:
                self._next.clear()
            self._next[self._prev] = (batch, times)
        self._prev = key
        follower = self._next.get(key) if key is not None else None
        self.expected = follower[0] if follower is not None and follower[1] >= 2 else None


def _key(batch: list[Response]) -> tuple:
    return tuple((r.name, r.meta) for r in batch)


class Speculation:
    """The speculative cycles of one engine (where the world meets over a network: shared
    memory answers the status word in microseconds).

    Args:
        enabled: speculate at all (a world of several ranks without shared memory).
        runner: the engine's execution (a fusion buffer and a flat sum).
    """

    def __init__(self, enabled: bool, runner: CollectiveRunner) -> None:
        self.enabled = enabled
        self.learned = Speculator()
        self._runner = runner

    def expected(self) -> list[Response] | None:
        """The batch every rank sends speculatively this cycle, or None (same on all)."""
        return self.learned.expected if self.enabled else None

    def observe(self, responses: list[Response], cached: bool) -> None:
        """After a negotiated cycle that ran `responses` (all in the response cache when
        `cached`)."""
        if self.enabled:
            self.learned.observe(responses, cached)

    def reset(self) -> None:
        """Knobs changed: expect nothing until batches repeat under the new ones."""
        self.learned.reset()

    def cycle(self, pending: dict[str, Request], quiet: bool, pset: ProcessSetGroup,
              knobs: Knobs) -> tuple[list[Request], list[Any]] | None:
        """Sends the expected batch with this rank's readiness: ready when `pending` is
        exactly that batch and the rank is `quiet` (no shutdown, join or knob change to
        report). Returns the batch's requests and results when every member was ready;
        None when some was not (the inputs are untouched, the expectation dropped)."""
        expected = self.learned.expected
        ready = quiet and self.learned.ready(pending)
        requests = [pending[r.name] for r in expected] if ready else []
        results = self._exchange(expected, requests, pset, knobs)
        if results is None:
            self.learned.failed()
            return None
        self.learned.succeeded()
        return requests, results

    def _exchange(self, batch: list[Response], requests: list[Request],
                  pset: ProcessSetGroup, knobs: Knobs) -> list[Any] | None:
        """One allreduce(sum) of [readiness, the batch fused]. `requests` is the batch's
        requests on a ready rank, empty on one that is not (it sends zeros). Returns the
        results when every member was ready, else None."""
        meta = batch[0].meta
        counts = elements(batch)
        buf = self._runner.fusion_buffer(meta.dtype,
                                         (sum(counts) + 1) * DTYPE_SIZES[meta.dtype])
        flat = ops_for_device("cpu").view_buffer(buf, sum(counts) + 1)
        ready = bool(requests)
        floating = meta.dtype.startswith("float") or meta.dtype == "bfloat16"
        pre, post = scales(meta, pset.size())
        int_pre, int_post = (1.0, 1.0) if floating else (pre, post)
        if not floating:
            pre = post = 1
        names = [r.name for r in batch]
        if ready:
            tensors = [req.tensor for req in requests]
            packed = tensors
            if int_pre != 1.0:  # scaled copies: the inputs stay untouched until all are ready
                packed = [ops_for(t).clone(t) for t in tensors]
                scale_integers(packed, int_pre)
            pack(packed, buf, pre, 1, names)
        else:
            flat[1:] = 0
        flat[0] = 1 if ready else 0
        row = batch[0].name if len(batch) == 1 else f"fused[{len(batch)}]"
        self._runner.sum_flat(flat, meta.dtype, row, pset, knobs)
        if int(flat[0]) != pset.size() or not ready:
            return None
        unpack(buf, tensors, post, 1, names)
        scale_integers(tensors, int_post)
        return [req.output if req.output is not None else req.tensor for req in requests]
