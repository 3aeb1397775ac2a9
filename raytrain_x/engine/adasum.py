"""Adasum (Maleki et al., "Scaling Distributed Training with Adaptive Summation", 2021), the
way Horovod's CPU path runs it: recursive vector halving with distance doubling.

Two vectors a and b combine as

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

(a coefficient is 1 when its vector is zero): parallel gradients are averaged, orthogonal
ones summed. Over 2^k ranks the pairs combine as a binary tree: ranks (0,1), (2,3), ... at
the first level, then the pairs' results, and so on. Each level halves the part of the vector
a rank holds (it sends the other half to its partner, `rank ^ distance`), so the bytes a rank
sends add up to about one vector, as in a reduce-scatter; the dot products of a level are
partial sums over the pieces, added up across the ranks that hold the two vectors of a pair
(one small allreduce per level). An allgather puts the result together at the end.

Coefficients are computed per tensor, so a fused batch gives each tensor what it would get
on its own. Works on any arrays of the engine's protocol, in float64.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from raytrain_x.common.errors import ConfigError
from raytrain_x.engine.arrays import ArrayOps

# Below this a squared norm counts as zero (its coefficient is 1): the square root of the
# smallest normal double, Horovod's bound. An absolute bound any larger turns the Adasum of
# tiny (but representable) gradients into their sum.
EPS = sys.float_info.min ** 0.5


def check_size(size: int) -> None:
    """Adasum's tree needs a power-of-two number of ranks, as in Horovod."""
    if size < 1 or size & (size - 1):
        raise ConfigError(f"op=Adasum needs a power-of-two number of ranks in the process set "
                          f"(1, 2, 4, 8, ...), got {size}; use op=rx.Average, or a process "
                          "set of 2^k ranks")


def combine(a: Any, b: Any, dot: float, a_sq: float, b_sq: float) -> Any:
    """The pairwise Adasum of `a` and `b` given their full dot product and squared norms."""
    ca = 1.0 - dot / (2.0 * a_sq) if a_sq > EPS else 1.0
    cb = 1.0 - dot / (2.0 * b_sq) if b_sq > EPS else 1.0
    return a * ca + b * cb


def segment(rank: int, size: int, total: int) -> tuple[int, int]:
    """The elements of the result `rank` holds after the halving levels."""
    lo, hi, distance = 0, total, 1
    while distance < size:
        mid = lo + (hi - lo) // 2
        lo, hi = (lo, mid) if not rank & distance else (mid, hi)
        distance *= 2
    return lo, hi


def _pieces(bounds: Sequence[int], lo: int, hi: int):
    """(tensor index, start, end) of each tensor's overlap with [lo, hi)."""
    for i in range(len(bounds) - 1):
        start, end = max(lo, bounds[i]), min(hi, bounds[i + 1])
        if start < end:
            yield i, start, end


def allreduce(flat: Any, counts: Sequence[int], group: Any, rank: int, size: int,
              ops: ArrayOps) -> None:
    """Replaces `flat` (float64, 1-D: the batch's tensors back to back, `counts` elements
    each) with the Adasum of every member's `flat`, in place."""
    check_size(size)
    if size == 1:
        return
    total = sum(counts)
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    device = ops.device(flat)
    lo, hi, distance = 0, total, 1
    while distance < size:
        partner = rank ^ distance
        lower = not rank & distance
        mid = lo + (hi - lo) // 2
        keep, give = ((lo, mid), (mid, hi)) if lower else ((mid, hi), (lo, mid))
        received = ops.empty((keep[1] - keep[0],), "float64", device)
        into = [0] * size
        out = [0] * size
        into[partner], out[partner] = keep[1] - keep[0], give[1] - give[0]
        group.alltoall(received, flat[give[0]:give[1]], into, out)
        mine = flat[keep[0]:keep[1]]
        a, b = (mine, received) if lower else (received, mine)
        # partial dot products of each tensor, in this level's block's slot
        block, blocks = rank // (2 * distance), size // (2 * distance)
        partial = ops.zeros((blocks * 3 * len(counts),), "float64", device)
        base = block * 3 * len(counts)
        for i, start, end in _pieces(bounds, *keep):
            pa, pb = a[start - keep[0]:end - keep[0]], b[start - keep[0]:end - keep[0]]
            partial[base + 3 * i] = float((pa * pb).sum())
            partial[base + 3 * i + 1] = float((pa * pa).sum())
            partial[base + 3 * i + 2] = float((pb * pb).sum())
        group.allreduce(partial, "sum")
        for i, start, end in _pieces(bounds, *keep):
            dot, a_sq, b_sq = (float(partial[base + 3 * i + k]) for k in range(3))
            piece = slice(start - keep[0], end - keep[0])
            mine[piece] = combine(a[piece], b[piece], dot, a_sq, b_sq)
        lo, hi = keep
        distance *= 2
    # put the pieces together: every rank's segment, padded to one length for the allgather
    segments = [segment(r, size, total) for r in range(size)]
    longest = max(end - start for start, end in segments)
    padded = ops.zeros((longest,), "float64", device)
    padded[:hi - lo] = flat[lo:hi]
    gathered = [ops.empty((longest,), "float64", device) for _ in range(size)]
    group.allgather(gathered, padded)
    for (start, end), piece in zip(segments, gathered):
        flat[start:end] = piece[:end - start]
