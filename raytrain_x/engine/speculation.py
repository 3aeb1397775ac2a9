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
"""

from __future__ import annotations

from math import prod

from raytrain_x.engine.messages import ALLREDUCE, Request, Response
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
