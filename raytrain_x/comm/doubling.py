"""Recursive doubling: an allreduce of a small array in log2 N steps, not gloo's ring's 2(N-1).

The status word every negotiating cycle and-s across the world is a few words long, so its
allreduce costs one message latency per step: gloo's ring sends 2(N-1) of them one after
another (9,998 at 10,000 ranks). Recursive doubling pairs rank r with r xor 2^k at step k,
each exchanging its partial result with the partner and combining: after log2 P steps every
rank of a power of two P holds the whole reduction. The R = N - P ranks beyond the largest
power of two fold in first (rank 2i gives its array to 2i+1 and sits out) and get the result
back last (MPICH's scheme), so any N takes at most log2 N + 2 steps and a rank talks to at
most log2 N + 1 peers (with lazily connected pairs, the only ones it connects).

Both partners of a step combine the same two partial results, so with a commutative op
every rank ends with bitwise the same array (floating point sums included).
"""

from __future__ import annotations

from dataclasses import dataclass

SEND, RECEIVE, EXCHANGE = "send", "receive", "exchange"


@dataclass(frozen=True)
class Step:
    """One step of a rank's schedule: `send` its array to `peer` (and wait for nothing
    more from it this step), `receive` the peer's array (combining it in, or taking it as
    the result: `final`), or `exchange` (send and receive at once, then combine)."""
    kind: str
    peer: int
    final: bool = False


def schedule(rank: int, size: int) -> list[Step]:
    """The steps `rank` of `size` takes, in order."""
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not in a group of {size}")
    power = 1 << (size.bit_length() - 1)  # the largest power of two <= size
    extra = size - power
    steps: list[Step] = []
    if rank < 2 * extra and rank % 2 == 0:
        # folds its array into its odd neighbour, which stands for both, and gets the result
        return [Step(SEND, rank + 1), Step(RECEIVE, rank + 1, final=True)]
    if rank < 2 * extra:
        steps.append(Step(RECEIVE, rank - 1))
        virtual = rank // 2
    else:
        virtual = rank - extra
    mask = 1
    while mask < power:
        partner = virtual ^ mask
        steps.append(Step(EXCHANGE, 2 * partner + 1 if partner < extra else partner + extra))
        mask <<= 1
    if rank < 2 * extra:
        steps.append(Step(SEND, rank - 1))
    return steps
