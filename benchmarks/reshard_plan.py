"""Planning an in-memory re-shard of a 7B-parameter model (`elastic.reshard.plan_resize`):
how long placing the members and planning take and how many bytes the plan moves, for
worlds of hundreds to thousands of ranks. The placements of the same members: the
survivors in their old order (what a new mesh in rank order gives); `place_members`' (its
best assignment, scipy's, up to `BEST_UP_TO` members); its greedy pairing and swaps (what
it does beyond, or without scipy); and the least any placement moves (the best assignment,
computed here apart: the baseline). The whole model is what a restart's restore, or a
gather and re-scatter, moves.

The layout is Llama-2-7B's (32 blocks of q/k/v/o 4096 x 4096, gate/up 11008 x 4096, down
4096 x 11008 and two norms; the embedding and the head 32000 x 4096), every tensor cut
along dim 0 as FSDP2 cuts it, each row carrying the parameter in bf16 and AdamW's two
fp32 moments (10 bytes an element). Each rank's chunks have `--replicas` copies on the
ranks 8, 16, ... after it (another host of 8). A resize loses `--lost` ranks spread
through the world (none of a chunk's copies with it) and adds `--joined`.

Run: .venv/bin/python benchmarks/reshard_plan.py [--worlds 256 1024 4096] [--lost 24]
Writes results/reshard_plan.json.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from raytrain_x.elastic import reshard
from raytrain_x.elastic.reshard import (
    ShardedTensor,
    chunk_overlaps,
    place_members,
    plan_reshard,
    plan_resize,
)

from common import print_table, write_json

HIDDEN, FFN, VOCAB, BLOCKS = 4096, 11008, 32000, 32
BYTES_PER_ELEMENT = 2 + 4 + 4  # bf16 parameter, AdamW's exp_avg and exp_avg_sq in fp32


def llama_7b() -> list[ShardedTensor]:
    shapes = [("embed", VOCAB, HIDDEN)]
    for b in range(BLOCKS):
        shapes += [(f"{b}.{n}", HIDDEN, HIDDEN) for n in ("q", "k", "v", "o")]
        shapes += [(f"{b}.gate", FFN, HIDDEN), (f"{b}.up", FFN, HIDDEN),
                   (f"{b}.down", HIDDEN, FFN), (f"{b}.norm1", HIDDEN, 1),
                   (f"{b}.norm2", HIDDEN, 1)]
    shapes += [("norm", HIDDEN, 1), ("head", VOCAB, HIDDEN)]
    return [ShardedTensor(name, rows, cols * BYTES_PER_ELEMENT) for name, rows, cols in shapes]


def resize(world: int, lost: int, joined: int, replicas: int, stride: int = 8):
    """After losing `lost` ranks spread through the world and adding `joined`: each old
    chunk's holders (old ranks; newcomers are "new0", ...) and the members, survivors in
    their old order then newcomers."""
    step = max(1, world // max(lost, 1))
    gone = {(i * step + 3) % world for i in range(lost)}
    survivors = [r for r in range(world) if r not in gone]
    holders = {old: [k for k in dict.fromkeys((old + i * stride) % world
                                              for i in range(replicas + 1)) if k not in gone]
               for old in range(world)}
    return holders, survivors + [f"new{i}" for i in range(joined)]


def best_kept(tensors, world, holders, members) -> int:
    """The most bytes any placement keeps in place (scipy's assignment over every member
    and position)."""
    from scipy.optimize import linear_sum_assignment

    index = {m: i for i, m in enumerate(members)}
    weights = np.zeros((len(members), len(members)))
    for j, k, w in zip(*chunk_overlaps(tensors, world, len(members))):
        for m in holders.get(int(j), ()):
            weights[index[m], k] += w
    rows, cols = linear_sum_assignment(weights, maximize=True)
    return int(weights[rows, cols].sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--lost", type=int, default=24)
    parser.add_argument("--joined", type=int, default=0)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    tensors = llama_7b()
    model_bytes = sum(t.rows * t.row_bytes for t in tensors)
    rows = []
    for world in args.worlds:
        holders, members = resize(world, args.lost, args.joined, args.replicas)
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            positions, plan = plan_resize(tensors, world, holders, members)
            times.append(time.perf_counter() - start)
        assert not plan.lost, plan.lost[:3]
        in_order = {m: i for i, m in enumerate(members)}
        ordered = plan_reshard(tensors, world, len(members), {
            j: [in_order[m] for m in ms] for j, ms in holders.items()})
        best = best_kept(tensors, world, holders, members)
        start = time.perf_counter()
        place_members(tensors, world, holders, members)
        place_s = time.perf_counter() - start
        saved, reshard.BEST_UP_TO = reshard.BEST_UP_TO, 0
        start = time.perf_counter()
        _, greedy = plan_resize(tensors, world, holders, members)
        greedy_s = time.perf_counter() - start
        reshard.BEST_UP_TO = saved
        rows.append({"from": world, "to": len(members), "plan_s": round(min(times), 3),
                     "place_s": round(place_s, 3), "transfers": len(plan.transfers),
                     "model_gb": round(model_bytes / 1e9, 1),
                     "in_order_moved_gb": round(ordered.moved_bytes / 1e9, 1),
                     "placed_moved_gb": round(plan.moved_bytes / 1e9, 1),
                     "greedy_moved_gb": round(greedy.moved_bytes / 1e9, 1),
                     "greedy_plan_s": round(greedy_s, 3),
                     "least_moved_gb": round((model_bytes - best) / 1e9, 1),
                     "placed_vs_least": round(plan.moved_bytes / max(model_bytes - best, 1),
                                              3),
                     "greedy_vs_least": round(greedy.moved_bytes / max(model_bytes - best, 1),
                                              3)})
        print(rows[-1], flush=True)
    print_table(rows, ["from", "to", "plan_s", "place_s", "greedy_plan_s", "model_gb",
                       "in_order_moved_gb", "placed_moved_gb", "greedy_moved_gb",
                       "least_moved_gb", "placed_vs_least", "greedy_vs_least"])
    print(f"wrote {write_json('reshard_plan', {'args': vars(args), 'plans': rows}, args.json)}")


if __name__ == "__main__":
    main()
