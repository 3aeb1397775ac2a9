"""Re-shard plans carried out between real processes (`raytrain_x.torch.reshard`): each rank
starts with the chunks it holds of the old layout (its own, copies it keeps, or none: a
newcomer) and ends with exactly its chunk of the new layout, as `torch.chunk` cuts the
whole tensor, having received only the rows the plan moves."""

from __future__ import annotations

import pytest

from tests.workers import run_workers


def _full(rows: int, cols: int, dtype, seed: int):
    import torch

    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=generator) * 100).to(dtype)


def _resize(old_world: int, lost: list[int], joined: int, replicas: int) -> dict:
    """Each new rank's chunk after the plan, checked against the whole tensors, and the
    bytes it received."""
    import torch

    import raytrain_x.torch as rx
    from raytrain_x.elastic.reshard import DEST, ShardedTensor, chunk_bounds, plan_resize
    from raytrain_x.torch.reshard import reshard

    rx.init()
    shapes = [(37, 3, torch.float32), (5, 2, torch.int64), (1, 4, torch.float64),
              (0, 2, torch.float32), (100, 1, torch.bfloat16)]
    full = [_full(r, c, d, seed) for seed, (r, c, d) in enumerate(shapes)]
    layout = [ShardedTensor(f"t{i}", t.shape[0], t[:1].numel() * t.element_size())
              for i, t in enumerate(full)]
    survivors = [r for r in range(old_world) if r not in lost]
    members = survivors + [f"new{i}" for i in range(joined)]
    assert len(members) == rx.size()
    holders = {j: [k for k in dict.fromkeys((j + i) % old_world for i in range(replicas + 1))
                   if k not in lost] for j in range(old_world)}
    positions, plan = plan_resize(layout, old_world, holders, members)
    # this process plays the member placed at its rank
    me = next(m for m, p in positions.items() if p == rx.rank())
    held = {j: [t[chunk_bounds(t.shape[0], old_world)[j]:
                  chunk_bounds(t.shape[0], old_world)[j + 1]] for t in full]
            for j, ms in holders.items() if me in ms}
    mine = reshard(plan, layout, old_world, rx.rank(), rx.size(), held, full)
    expected = [list(torch.chunk(t, rx.size())) for t in full]
    ok = all(torch.equal(got, want[rx.rank()] if rx.rank() < len(want) else t[:0])
             for got, want, t in zip(mine, expected, full))
    received = plan.transfers[plan.transfers[:, DEST] == rx.rank()]
    moved = sum(int(b - a) * layout[t].row_bytes for t, _, _, a, b in received.tolist())
    return {"ok": ok, "received": moved, "planned": plan.moved_bytes, "me": str(me)}


@pytest.mark.parametrize("old_world,lost,joined,replicas", [
    (4, [3], 0, 1),     # a worker lost: its chunks come from its copy
    (2, [], 1, 0),      # a newcomer: it holds nothing and receives its chunks
    (4, [0, 2], 1, 1),  # two lost (rank 0 among them) and one joined at once
])
def test_every_rank_ends_with_its_new_chunk_having_received_only_what_moves(
        old_world, lost, joined, replicas):
    size = old_world - len(lost) + joined
    results = run_workers(_resize, size, old_world, lost, joined, replicas, work_s=30)
    assert all(r["ok"] for r in results), results
    assert sum(r["received"] for r in results) == results[0]["planned"]
