"""The simulated job's model as FSDP2 would shard it: every round re-shards its chunks
(`raytrain_x.elastic.reshard.plan_resize`), and every plan is checked.

Each commit is a generation of chunks: the rank at each position of the round holds its
chunk and `REPLICAS` peers keep a copy (`replica_holders`, on other nodes first). When a
round syncs the job's last commit from memory, its members are placed and the transfers
planned from who holds which chunk, as the workers do; `check_plan` replays the plan row by
row: every row of the new layout is either kept where it is or sent once, by a member
holding its old chunk, and the bytes moved are the new layout's less those kept. A chunk
no member holds is lost (the real job restores from storage then): counted, not a
violation, since the simulated driver decides restores on whole copies.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from raytrain_x.elastic.reshard import (
    TENSOR,
    ReshardPlan,
    ShardedTensor,
    chunk_bounds,
    plan_reshard,
    plan_resize,
    replica_holders,
)

REPLICAS = 1
# a small model of uneven rows: embedding, blocks, a norm of few rows (fewer than most
# worlds: the last positions hold none of it)
LAYOUT = [ShardedTensor("embed", 97, 64 * 10), ShardedTensor("block.0", 64, 64 * 10),
          ShardedTensor("block.1", 255, 64 * 10), ShardedTensor("norm", 3, 10)]


@dataclass
class Generation:
    """A commit's chunks: the step, the world they were cut for, and the workers holding
    each position's chunk."""

    step: int
    world: int
    holders: dict[int, set[str]]


def generation(step: int, order: Sequence[str], members: Sequence[str],
               hosts: Sequence[str]) -> Generation:
    """The chunks a round's commit leaves: `order` the worker at each position, `members`
    the worker at each rank and `hosts` each rank's node (copies go by rank)."""
    rank = {w: r for r, w in enumerate(members)}
    holders = {}
    for position, worker in enumerate(order):
        copies = replica_holders(rank[worker], list(hosts), REPLICAS)
        holders[position] = {worker, *(members[r] for r in copies)}
    return Generation(step, len(order), holders)


def check_plan(plan: ReshardPlan, tensors: Sequence[ShardedTensor], old_world: int,
               new_world: int, holders: Mapping[int, Sequence[int]]) -> list[str]:
    """What the plan breaks, a line each (empty: every row of the new layout is kept by a
    holder or sent once by one, and the bytes add up)."""
    problems: list[str] = []
    moved = kept = 0
    for index, tensor in enumerate(tensors):
        old, new = chunk_bounds(tensor.rows, old_world), chunk_bounds(tensor.rows, new_world)
        covered = np.zeros(tensor.rows, dtype=np.int64)
        for position in range(new_world):
            for row in range(int(new[position]), int(new[position + 1])):
                chunk = int(np.searchsorted(old, row, side="right") - 1)
                if position in holders.get(chunk, ()):
                    covered[row] += 1
                    kept += tensor.row_bytes
        mine = plan.transfers[plan.transfers[:, TENSOR] == index].tolist()
        for _, source, dest, start, stop in mine:
            chunk = int(np.searchsorted(old, start, side="right") - 1)
            if source not in holders.get(chunk, ()):
                problems.append(f"{tensor.name} rows {start}:{stop} sent by {source}, which "
                                f"holds no copy of chunk {chunk}")
            if stop > old[chunk + 1] or start < new[dest] or stop > new[dest + 1]:
                problems.append(f"{tensor.name} rows {start}:{stop} to {dest} cross a chunk")
            covered[start:stop] += 1
            moved += int(stop - start) * tensor.row_bytes
        lost = {c for c in range(old_world) if not holders.get(c)}
        owners = np.searchsorted(old, np.arange(tensor.rows), side="right") - 1
        wrong = np.flatnonzero((covered != 1) & ~np.isin(owners, list(lost)))
        if len(wrong):
            problems.append(f"{tensor.name} row {wrong[0]} arrives {covered[wrong[0]]} times")
    if moved != plan.moved_bytes or kept != plan.kept_bytes:
        problems.append(f"the plan counts {plan.moved_bytes} bytes moved, {plan.kept_bytes} "
                        f"kept; its transfers move {moved}, its members keep {kept}")
    return problems


def reshard_round(last: Generation, members: Sequence[str]
                  ) -> tuple[list[str], list[str], list[str]]:
    """A round of `members` (in rank order) syncing `last` from memory: the worker at each
    new position, the problems of its plan, and the chunks lost."""
    rank = {w: r for r, w in enumerate(members)}
    holders = {p: [rank[w] for w in sorted(ws, key=str) if w in rank]
               for p, ws in last.holders.items()}
    positions, plan = plan_resize(LAYOUT, last.world, holders, list(range(len(members))))
    order = [""] * len(members)
    for r, p in positions.items():
        order[p] = members[r]
    at = {j: [positions[r] for r in rs] for j, rs in holders.items()}
    problems = check_plan(plan, LAYOUT, last.world, len(members), at)
    in_order = plan_reshard(LAYOUT, last.world, len(members), holders)
    if plan.kept_bytes < in_order.kept_bytes:
        problems.append(f"the placement keeps {plan.kept_bytes} bytes in place, the members "
                        f"in rank order {in_order.kept_bytes}")
    lost = [f"{name} chunk {chunk}" for name, chunk in plan.lost]
    return order, problems, lost
