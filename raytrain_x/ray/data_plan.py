"""How an epoch of a Ray Data stream is divided into steps (pure: no Ray).

An epoch is one row stream, numbered from 0 in the order its blocks come (the feed fixes
that order: `raytrain_x.ray.data_feed`). Its position is one integer, the cursor: every row
before it was handed out. A step at cursor `c` of a world of `W` ranks, each asking for
`b` rows, hands out rows `[c, c + W*b)`, rank `r` the `r`-th of `W` even parts, so the
position is the same on every rank and a new world simply goes on from it.

The end of an epoch: rows left over after a step that would be fewer than `W` join that
step (a rank gets at most `b + 1` rows), so no rank is ever handed an empty batch while
another has rows, which would make the ranks' step counts differ. Only an epoch shorter
than its world hands some ranks no rows.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence


def step_ranges(cursor: int, world: int, per_rank: int, available: int,
                ended: bool) -> list[tuple[int, int]] | None:
    """Each rank's rows `[start, end)` of the step at `cursor`; `[]` when the epoch is done;
    None when more rows must come first (`available` rows have come; `ended`: all have).

    Raises:
        ValueError: `world` or `per_rank` below 1.
    """
    if world < 1 or per_rank < 1:
        raise ValueError(f"a step needs world >= 1 and per_rank >= 1, got {world}, {per_rank}")
    full = world * per_rank
    if not ended:
        if available < cursor + full + world:  # not yet known whether the end is near
            return None
        rows = full
    else:
        left = available - cursor
        if left <= 0:
            return []
        rows = left if left - full < world else full
    return [(cursor + r * rows // world, cursor + (r + 1) * rows // world)
            for r in range(world)]


def block_slices(starts: Sequence[int], sizes: Sequence[int], start: int,
                 end: int) -> list[tuple[int, int, int]]:
    """The rows `[start, end)` as `(block index, first row, end row)` within the blocks that
    begin at `starts` (ascending) with `sizes` rows each."""
    out = []
    index = max(bisect_right(starts, start) - 1, 0)
    while start < end and index < len(starts):
        first = max(start - starts[index], 0)
        last = min(end - starts[index], sizes[index])
        if last > first:
            out.append((index, first, last))
        start = starts[index] + last
        index += 1
    if start < end:
        raise ValueError(f"rows up to {end} asked for, only {start} are held")
    return out
