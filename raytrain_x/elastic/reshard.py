"""Re-sharding in memory: which rank sends which rows to which when a sharded model's world
changes size.

A sharded parameter (FSDP2's `fully_shard`, `Shard(0)`) is cut along dim 0 as
`torch.chunk` cuts it: with N ranks each chunk has ceil(rows / N) rows and rank i holds
rows [i * c, min((i + 1) * c, rows)), so the last ranks may hold fewer rows or none. Its
optimizer state is cut the same way. At a commit each rank's chunk is also copied to
`replicas` peers. When the world goes from N ranks to M, every new rank needs the rows of
its new chunk: the rows it already holds (its own chunk, or a copy it keeps for a peer)
stay where they are, and every other row comes from exactly one live holder of the old
chunk it lay in. That is the least a re-shard can move: a rank must receive every row it
lacks, and nothing else is sent.

Where each member lands in the new layout is free: the chunk a position holds depends on
the position, not on the rank, and FSDP2 takes its mesh in any order. Ranks kept in their
old order move nearly everything (a chunk of 4 rows out of 1,024 ranks is 5 rows out of
1,000: every later chunk starts elsewhere), so `place_members` gives each member the
position whose rows it already holds most of (its own chunk or a copy it keeps), and
newcomers the positions left.

Both are pure functions of the layouts and who holds what, working on arrays (a
7B-parameter model's few hundred tensors over a thousand ranks place and plan in well
under a second); the transfers come back as arrays too.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

# the columns of a plan's transfers, one row per transfer
TENSOR = 0  # the tensor's index in the layout
SOURCE = 1  # the new rank that sends
DEST = 2  # the new rank that receives
START = 3  # the first row
STOP = 4  # the row after the last


@dataclass(frozen=True)
class ShardedTensor:
    """One tensor cut along dim 0: its name, its rows and the bytes of one row (of every
    tensor cut alike with it: a parameter's row and its optimizer state's rows)."""

    name: str
    rows: int
    row_bytes: int


def chunk_bounds(rows: int, world: int) -> np.ndarray:
    """Where each rank's chunk of `rows` starts, as `torch.chunk` cuts them: `world + 1`
    bounds, rank i holding rows [bounds[i], bounds[i + 1]) (empty at the end when the rows
    run out before the ranks do)."""
    if world < 1:
        raise ValueError(f"a world has at least one rank, not {world}")
    size = -(-rows // world) if rows else 0
    return np.minimum(np.arange(world + 1, dtype=np.int64) * size, rows)


def segments(rows: int, old_world: int,
             new_world: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`rows` cut at both worlds' chunk bounds: each piece's first row, the row after its
    last, the old chunk it lay in and the new chunk it lies in."""
    old, new = chunk_bounds(rows, old_world), chunk_bounds(rows, new_world)
    cuts = np.union1d(old, new)
    starts, stops = cuts[:-1], cuts[1:]
    return (starts, stops, np.searchsorted(old, starts, side="right") - 1,
            np.searchsorted(new, starts, side="right") - 1)


@dataclass
class ReshardPlan:
    """The transfers of a re-shard and what they cost.

    Attributes:
        transfers: int64 array, one row per transfer: (tensor index, source new rank,
            destination new rank, first row, row after the last), columns `TENSOR` ..
            `STOP`; ordered by tensor, then rows.
        kept_bytes: bytes already where the new layout wants them.
        moved_bytes: bytes the transfers move (the least any re-shard can move).
        lost: (tensor name, old rank) of every chunk no live rank holds.
    """

    transfers: np.ndarray
    kept_bytes: int
    moved_bytes: int
    lost: list[tuple[str, int]]

    def sent_by(self, rank: int) -> np.ndarray:
        return self.transfers[self.transfers[:, SOURCE] == rank]

    def received_by(self, rank: int) -> np.ndarray:
        return self.transfers[self.transfers[:, DEST] == rank]


def holders_table(old_world: int, holders: Mapping[int, Sequence[int]]) -> np.ndarray:
    """`holders` (old rank -> the new ranks that hold its chunks: its own new rank if it
    survived, then the survivors that keep a copy) as an (old_world, copies) array padded
    with -1."""
    width = max((len(h) for h in holders.values()), default=0) or 1
    table = np.full((old_world, width), -1, dtype=np.int64)
    for old, ranks in holders.items():
        if not 0 <= old < old_world:
            raise ValueError(f"old rank {old} is outside the old world of {old_world}")
        table[old, :len(ranks)] = list(ranks)
    return table


def plan_reshard(tensors: Sequence[ShardedTensor], old_world: int, new_world: int,
                 holders: Mapping[int, Sequence[int]]) -> ReshardPlan:
    """The transfers that give every rank of a world of `new_world` its chunk of every
    tensor, from a world of `old_world` whose chunks are held as `holders` says (old rank
    -> the new ranks holding its chunks; a chunk with none is lost).

    Each row a new rank lacks comes from one holder of the old chunk it lay in; the
    holders of a chunk take turns by destination, so a chunk's copies share its sending.
    Rows a new rank already holds (its old chunk, or a copy it kept) are not sent.
    """
    table = holders_table(old_world, holders)
    copies = (table >= 0).sum(axis=1)
    if (table >= new_world).any():
        raise ValueError(f"a holder's new rank is outside the new world of {new_world}")
    parts, kept, moved, lost = [], 0, 0, []
    for index, tensor in enumerate(tensors):
        starts, stops, owner, dest = segments(tensor.rows, old_world, new_world)
        if not len(starts):
            continue
        held = (table[owner] == dest[:, None]).any(axis=1)
        rows = stops - starts
        kept += int(rows[held].sum()) * tensor.row_bytes
        need = ~held
        gone = need & (copies[owner] == 0)
        for old_rank in np.unique(owner[gone]):
            lost.append((tensor.name, int(old_rank)))
        send = need & ~gone
        owner, dest, starts, stops = owner[send], dest[send], starts[send], stops[send]
        source = table[owner, dest % copies[owner]]
        moved += int((stops - starts).sum()) * tensor.row_bytes
        parts.append(np.stack([np.full(len(owner), index), source, dest, starts, stops],
                              axis=1))
    transfers = np.concatenate(parts) if parts else np.empty((0, 5), dtype=np.int64)
    return ReshardPlan(transfers.astype(np.int64), kept, moved, lost)


def chunk_overlaps(tensors: Sequence[ShardedTensor], old_world: int,
                   new_world: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The bytes old chunk j and new position k share, summed over the tensors: (j, k,
    bytes) for every pair that shares any."""
    keys, weights = [], []
    for tensor in tensors:
        starts, stops, owner, dest = segments(tensor.rows, old_world, new_world)
        keys.append(owner * new_world + dest)
        weights.append((stops - starts) * tensor.row_bytes)
    if not keys:
        empty = np.empty(0, dtype=np.int64)
        return empty, empty, empty
    pairs, inverse = np.unique(np.concatenate(keys), return_inverse=True)
    total = np.bincount(inverse, weights=np.concatenate(weights)).astype(np.int64)
    return pairs // new_world, pairs % new_world, total


# swap passes after the greedy pairing: each looks at every pair once
SWAP_PASSES = 8
# the best assignment (scipy's, where installed) for worlds up to this many members: its
# matrix of members by positions takes 8 bytes a cell (134 MB at 4,096)
BEST_UP_TO = 4096


def place_members(tensors: Sequence[ShardedTensor], old_world: int,
                  holders: Mapping[int, Sequence[Hashable]],
                  members: Sequence[Hashable]) -> dict[Hashable, int]:
    """Each member's position in the new layout (a world of `len(members)`), keeping in
    place as many of the bytes the members hold as it finds (`holders`: old chunk -> the
    members holding it, its owner and the peers keeping a copy). Up to `BEST_UP_TO`
    members with scipy installed, the most there is (a maximum-weight assignment);
    otherwise the pairs of member and position that keep the most bytes first, then two
    members swap positions wherever that keeps more (within a few percent of the most at
    a few hundred ranks, `benchmarks/reshard_plan.py`). Members holding nothing
    (newcomers) take the positions left. Never keeps fewer bytes in place than `members`
    in their own order."""
    new_world = len(members)
    if len(set(members)) != new_world:
        raise ValueError("a member is listed twice")
    index = {m: i for i, m in enumerate(members)}
    chunk, position, shared = chunk_overlaps(tensors, old_world, new_world)
    edges: dict[tuple[int, int], int] = {}
    for j, k, w in zip(chunk.tolist(), position.tolist(), shared.tolist()):
        for member in holders.get(j, ()):
            if member in index:
                key = (index[member], k)
                edges[key] = edges.get(key, 0) + w
    placed = _best(edges, new_world) if new_world <= BEST_UP_TO else None
    if placed is None:
        placed = _swaps(edges, _greedy(edges, new_world))
    in_order = {m: m for m in range(new_world)}
    if sum(edges.get(p, 0) for p in in_order.items()) > \
            sum(edges.get(p, 0) for p in placed.items()):
        placed = in_order  # the greedy pairing can lose to it in small worlds
    return {members[m]: k for m, k in placed.items()}


def _best(edges: Mapping[tuple[int, int], int], new_world: int) -> dict[int, int] | None:
    """The assignment that keeps the most bytes (scipy's `linear_sum_assignment`); None
    without scipy."""
    try:
        from scipy.optimize import linear_sum_assignment
    except ImportError:
        return None
    weights = np.zeros((new_world, new_world))
    for (m, k), w in edges.items():
        weights[m, k] = w
    rows, cols = linear_sum_assignment(weights, maximize=True)
    return dict(zip(rows.tolist(), cols.tolist()))


def _greedy(edges: Mapping[tuple[int, int], int], new_world: int) -> dict[int, int]:
    placed: dict[int, int] = {}
    taken: set[int] = set()
    for (m, k), _ in sorted(edges.items(), key=lambda e: (-e[1], e[0])):
        if m not in placed and k not in taken:
            placed[m] = k
            taken.add(k)
    free = iter(sorted(set(range(new_world)) - taken))
    return {**placed, **{m: next(free) for m in range(new_world) if m not in placed}}


def _swaps(edges: Mapping[tuple[int, int], int], placed: dict[int, int]) -> dict[int, int]:
    """`placed` with two members swapped wherever one of them keeps bytes at the other's
    position and the swap keeps more in all, pass after pass until none does (at most
    `SWAP_PASSES`)."""
    placed = dict(placed)
    at = {k: m for m, k in placed.items()}
    for _ in range(SWAP_PASSES):
        swapped = False
        for (m, k), w in edges.items():
            here = placed[m]
            if k == here:
                continue
            other = at[k]
            gain = w + edges.get((other, here), 0) - edges.get((m, here), 0) \
                - edges.get((other, k), 0)
            if gain > 0:
                placed[m], placed[other] = k, here
                at[k], at[here] = m, other
                swapped = True
        if not swapped:
            break
    return placed


def plan_resize(tensors: Sequence[ShardedTensor], old_world: int,
                holders: Mapping[int, Sequence[Hashable]],
                members: Sequence[Hashable]) -> tuple[dict[Hashable, int], ReshardPlan]:
    """`place_members`, then `plan_reshard` from the chunks' holders at their new
    positions: where each member goes, and the transfers."""
    positions = place_members(tensors, old_world, holders, members)
    at = {j: [positions[m] for m in ms if m in positions] for j, ms in holders.items()}
    return positions, plan_reshard(tensors, old_world, len(members), at)


def replica_holders(rank: int, hosts: Sequence[Hashable], replicas: int) -> list[int]:
    """The ranks that keep copies of `rank`'s shard: the next ranks on other hosts, then the
    next on its own host."""
    size = len(hosts)
    others = [(rank + i) % size for i in range(1, size)]
    elsewhere = [r for r in others if hosts[r] != hosts[rank]]
    return (elsewhere + [r for r in others if hosts[r] == hosts[rank]])[:replicas]


def holders_of(rank: int, hosts: Sequence[Hashable], replicas: int) -> list[int]:
    """The ranks whose chunks `rank` keeps a copy of."""
    return [r for r in range(len(hosts)) if r != rank
            and rank in replica_holders(r, hosts, replicas)]
