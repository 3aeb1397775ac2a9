"""Re-shard plans (`elastic.reshard`): each new rank gets every row of its new chunk from
exactly one live holder, rows it holds stay, nothing else moves; chunks no live rank holds
are named. Checked against torch's own chunking and by playing every plan row by row."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from raytrain_x.elastic import reshard
from raytrain_x.elastic.reshard import (
    DEST,
    SOURCE,
    STOP,
    TENSOR,
    ShardedTensor,
    chunk_bounds,
    place_members,
    plan_reshard,
    plan_resize,
)


@pytest.mark.parametrize("rows", [0, 1, 5, 7, 8, 64, 100, 1023])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 6, 8, 13])
def test_chunks_are_cut_as_torch_chunk_cuts_them(rows, world):
    bounds = chunk_bounds(rows, world)
    sizes = [len(c) for c in torch.chunk(torch.arange(rows), world)] if rows else []
    sizes += [0] * (world - len(sizes))
    assert list(np.diff(bounds)) == sizes


def replica_holders(old_world: int, survivors: dict[int, int], replicas: int,
                    stride: int = 1) -> dict[int, list[int]]:
    """Old rank r's chunks on r itself and on r + stride, r + 2 stride, ... (as many as
    `replicas`), as held by the survivors (old rank -> new rank)."""
    holders = {}
    for old in range(old_world):
        keepers = [(old + k * stride) % old_world for k in range(replicas + 1)]
        holders[old] = list(dict.fromkeys(survivors[k] for k in keepers if k in survivors))
    return holders


def play(tensors, old_world, new_world, holders, plan):
    """Every new rank's rows after the plan, row by row: each row must come from exactly
    one place (kept, or one transfer from a rank that holds its old chunk). Returns the
    bytes that had to move (rows a new rank did not hold), counted row by row."""
    must_move = 0
    for index, tensor in enumerate(tensors):
        old = chunk_bounds(tensor.rows, old_world)
        new = chunk_bounds(tensor.rows, new_world)
        got = np.zeros(tensor.rows, dtype=np.int64)
        mine = plan.transfers[plan.transfers[:, TENSOR] == index]
        for _, source, dest, start, stop in mine:
            assert new[dest] <= start < stop <= new[dest + 1], "rows outside the new chunk"
            owner = np.searchsorted(old, start, side="right") - 1
            assert stop <= old[owner + 1], "a transfer spans two old chunks"
            assert source in holders[owner], "sent by a rank that does not hold it"
            assert source != dest
            got[start:stop] += 1
        for dest in range(new_world):
            for row in range(new[dest], new[dest + 1]):
                owner = np.searchsorted(old, row, side="right") - 1
                if dest in holders[owner]:
                    got[row] += 1  # kept where it is
                elif holders[owner]:
                    must_move += tensor.row_bytes
        lost_rows = {row for row in range(tensor.rows)
                     if not holders[np.searchsorted(old, row, side="right") - 1]}
        assert all(got[r] == (0 if r in lost_rows else 1) for r in range(tensor.rows))
    return must_move


MODEL = [ShardedTensor("embed", 100, 64), ShardedTensor("w1", 37, 128),
         ShardedTensor("bias", 5, 4), ShardedTensor("norm", 1, 16)]


@pytest.mark.parametrize("old_world,new_world,lost,replicas", [
    (4, 3, {3}, 1),           # a worker lost: its chunks from its copy
    (4, 2, {1, 2}, 1),        # two lost at once, neither copy lost with its owner
    (3, 4, set(), 0),         # a newcomer: it receives its chunks only
    (4, 6, set(), 2),         # two newcomers, two copies each
    (8, 5, {0, 3, 6}, 1),     # rank 0 among the lost
    (5, 5, {2}, 1),           # one lost, one joined in its place
    (2, 1, {1}, 0),           # the last copy gone: named, not sent
])
def test_table_of_resizes_moves_the_least_and_names_what_is_lost(old_world, new_world,
                                                                  lost, replicas):
    survivors = [r for r in range(old_world) if r not in lost]
    mapping = {old: new for new, old in enumerate(survivors)}
    holders = replica_holders(old_world, mapping, replicas)
    plan = plan_reshard(MODEL, old_world, new_world, holders)
    assert plan.moved_bytes == play(MODEL, old_world, new_world, holders, plan)
    total = sum(t.rows * t.row_bytes for t in MODEL)
    lost_bytes = sum(
        t.row_bytes * int(np.diff(chunk_bounds(t.rows, old_world))[r])
        for t in MODEL for r in range(old_world) if not holders[r])
    assert plan.kept_bytes + plan.moved_bytes + lost_bytes == total
    assert {r for _, r in plan.lost} == {r for r in range(old_world) if not holders[r]} & {
        r for t in MODEL for r in range(old_world)
        if np.diff(chunk_bounds(t.rows, old_world))[r]}


def test_a_newcomer_receives_its_chunks_and_nothing_moves_between_survivors_that_hold_them():
    """3 -> 4 ranks, every survivor keeping a copy of every chunk (replicas 2): each
    survivor already holds all its new rows, so only the newcomer receives, and what it
    receives is exactly its new chunk."""
    holders = replica_holders(3, {0: 0, 1: 1, 2: 2}, 2)
    plan = plan_reshard(MODEL, 3, 4, holders)
    assert set(plan.transfers[:, DEST]) == {3}
    assert plan.moved_bytes == sum(t.row_bytes * int(np.diff(chunk_bounds(t.rows, 4))[3])
                                   for t in MODEL)


def test_the_copies_of_a_chunk_share_its_sending():
    """A lost rank's chunk of a wide tensor, needed by many new ranks, is sent by both of
    its live copies, not all by one."""
    wide = [ShardedTensor("w", 1000, 8)]
    survivors = {r: r for r in range(1, 8)}  # old rank 0 lost, its copies on 1 and 2
    holders = {0: [1, 2], **{r: [r] for r in range(1, 8)}}
    plan = plan_reshard(wide, 8, 30, {**holders, **{r: [r] for r in survivors}})
    from_lost = plan.transfers[plan.transfers[:, STOP] <= 125]
    assert set(from_lost[:, SOURCE]) == {1, 2}


def test_bad_holders_are_refused():
    with pytest.raises(ValueError, match="outside the old world"):
        plan_reshard(MODEL, 2, 2, {5: [0]})
    with pytest.raises(ValueError, match="outside the new world"):
        plan_reshard(MODEL, 2, 2, {0: [0], 1: [3]})
    with pytest.raises(ValueError, match="at least one rank"):
        plan_reshard(MODEL, 0, 2, {})


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_any_resize_sequence_keeps_every_row_once_and_moves_the_least(data):
    """Random models, random sequences of resizes (losses, several at once, joins), each
    with 0-2 copies per chunk on random survivors: every plan is played row by row."""
    tensors = [ShardedTensor(f"t{i}", rows, bytes_)
               for i, (rows, bytes_) in enumerate(data.draw(st.lists(
                   st.tuples(st.integers(0, 40), st.integers(1, 16)), min_size=1,
                   max_size=4)))]
    world = data.draw(st.integers(1, 9))
    for _ in range(data.draw(st.integers(1, 3))):
        replicas = data.draw(st.integers(0, 2))
        lost = data.draw(st.sets(st.integers(0, world - 1), max_size=world - 1))
        survivors = [r for r in range(world) if r not in lost]
        joined = data.draw(st.integers(0, 4))
        new_world = len(survivors) + joined
        order = data.draw(st.permutations(range(new_world)))  # where survivors land
        mapping = {old: order[i] for i, old in enumerate(survivors)}
        stride = data.draw(st.integers(1, max(1, world - 1)))
        holders = replica_holders(world, mapping, replicas, stride)
        plan = plan_reshard(tensors, world, new_world, holders)
        assert plan.moved_bytes == play(tensors, world, new_world, holders, plan)
        world = new_world


def test_an_unchanged_world_keeps_every_member_in_place_and_moves_nothing():
    holders = {r: [r, (r + 1) % 4] for r in range(4)}
    positions, plan = plan_resize(MODEL, 4, holders, [0, 1, 2, 3])
    assert positions == {0: 0, 1: 1, 2: 2, 3: 3}
    assert plan.moved_bytes == 0 and not len(plan.transfers)


def test_members_are_placed_where_they_hold_the_most_not_in_rank_order():
    """1,024 ranks of 4-row chunks lose 24: kept in order, every later chunk starts
    elsewhere and nearly every byte moves; placed where they hold the most, well under
    half does (the plan is played row by row on a smaller world below)."""
    model = [ShardedTensor("w", 4096, 8)]
    gone = {3 + 42 * i for i in range(24)}
    members = [r for r in range(1024) if r not in gone]
    holders = {r: [] if r in gone else [r] for r in range(1024)}
    positions, placed = plan_resize(model, 1024, holders, members)
    in_order = plan_reshard(model, 1024, 1000, {
        r: [members.index(r)] if r not in gone else [] for r in range(1024)})
    assert sorted(positions.values()) == list(range(1000))
    assert in_order.moved_bytes > 0.9 * 4096 * 8
    assert placed.moved_bytes < 0.5 * in_order.moved_bytes


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_placed_members_get_every_row_once_and_keep_at_least_what_rank_order_keeps(data):
    tensors = [ShardedTensor(f"t{i}", rows, bytes_)
               for i, (rows, bytes_) in enumerate(data.draw(st.lists(
                   st.tuples(st.integers(0, 60), st.integers(1, 16)), min_size=1,
                   max_size=4)))]
    world = data.draw(st.integers(1, 12))
    lost = data.draw(st.sets(st.integers(0, world - 1), max_size=world - 1))
    replicas = data.draw(st.integers(0, 2))
    survivors = [r for r in range(world) if r not in lost]
    members = survivors + [f"new{i}" for i in range(data.draw(st.integers(0, 4)))]
    holders = {r: [k for k in dict.fromkeys((r + i) % world for i in range(replicas + 1))
                   if k not in lost] for r in range(world)}
    in_order = {m: i for i, m in enumerate(members)}
    ordered = plan_reshard(tensors, world, len(members),
                           {j: [in_order[m] for m in ms] for j, ms in holders.items()})
    for best_up_to in (4096, 0):  # scipy's assignment, then the greedy pairing and swaps
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(reshard, "BEST_UP_TO", best_up_to)
            positions, plan = plan_resize(tensors, world, holders, members)
        assert sorted(positions.values()) == list(range(len(members)))
        at = {j: [positions[m] for m in ms] for j, ms in holders.items()}
        assert plan.moved_bytes == play(tensors, world, len(members), at, plan)
        assert plan.kept_bytes >= ordered.kept_bytes


def test_a_member_listed_twice_is_refused():
    with pytest.raises(ValueError, match="listed twice"):
        place_members(MODEL, 2, {0: [0], 1: [1]}, [0, 0])


@pytest.mark.parametrize("best_up_to,within", [(4096, 1.0), (0, 1.1)])
def test_placement_moves_the_least_there_is_or_close_to_it(monkeypatch, best_up_to, within):
    """Three row counts over 256 ranks (their chunks change size differently when 24 ranks
    go, one copy each on the rank 8 on): the bytes moved against the best assignment of
    members to positions there is (scipy's), and against rank order; with scipy's
    assignment (up to `BEST_UP_TO` members) and with the greedy pairing and swaps."""
    from scipy.optimize import linear_sum_assignment

    from raytrain_x.elastic.reshard import chunk_overlaps

    monkeypatch.setattr(reshard, "BEST_UP_TO", best_up_to)

    model = [ShardedTensor("embed", 32000, 80), ShardedTensor("ffn", 11008, 40),
             ShardedTensor("attn", 4096, 40)]
    gone = {(3 + 10 * i) % 256 for i in range(24)}
    members = [r for r in range(256) if r not in gone]
    holders = {j: [k for k in (j, (j + 8) % 256) if k not in gone] for j in range(256)}
    _, placed = plan_resize(model, 256, holders, members)
    weights = np.zeros((len(members), len(members)))
    for j, k, w in zip(*chunk_overlaps(model, 256, len(members))):
        for m in holders[int(j)]:
            weights[members.index(m), k] += w
    rows, cols = linear_sum_assignment(weights, maximize=True)
    least = sum(t.rows * t.row_bytes for t in model) - weights[rows, cols].sum()
    assert placed.moved_bytes <= within * least
    in_order = plan_reshard(model, 256, len(members), {
        j: [members.index(m) for m in ms] for j, ms in holders.items()})
    assert placed.moved_bytes < 0.8 * in_order.moved_bytes
