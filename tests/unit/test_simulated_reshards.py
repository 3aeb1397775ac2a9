"""The simulator's check of every re-shard plan (`raytrain_x.testing.simulation.reshards`):
it passes the real plans and catches a plan that gathers whole, one sent by a member
without the rows, and bytes that do not add up."""

from __future__ import annotations

import numpy as np

from raytrain_x.elastic.reshard import ReshardPlan, chunk_bounds, plan_reshard
from raytrain_x.testing.simulation.reshards import (
    LAYOUT,
    check_plan,
    generation,
    reshard_round,
)


def test_a_real_plan_passes_and_a_full_gather_is_caught():
    holders = {0: [0], 1: [1], 2: [0]}  # 3 -> 2: rank 2 lost, rank 0 keeps its copy
    plan = plan_reshard(LAYOUT, 3, 2, holders)
    assert check_plan(plan, LAYOUT, 3, 2, holders) == []
    rows = []  # every rank receives every row of its chunk, held or not
    for index, tensor in enumerate(LAYOUT):
        old, new = chunk_bounds(tensor.rows, 3), chunk_bounds(tensor.rows, 2)
        for dest in range(2):
            for chunk in range(3):
                a, b = max(old[chunk], new[dest]), min(old[chunk + 1], new[dest + 1])
                if a < b:
                    rows.append([index, holders[chunk][0], dest, a, b])
    moved = sum((b - a) * LAYOUT[t].row_bytes for t, _, _, a, b in rows)
    gather = ReshardPlan(np.array(rows, dtype=np.int64), 0, moved, [])
    problems = check_plan(gather, LAYOUT, 3, 2, holders)
    assert any("arrives 2 times" in p for p in problems), problems


def test_a_sender_without_the_rows_and_bytes_that_do_not_add_up_are_caught():
    holders = {0: [0], 1: [1]}
    plan = plan_reshard(LAYOUT, 2, 3, holders)  # a newcomer at 2
    wrong = plan.transfers.copy()
    wrong[0, 1] = 2  # the newcomer sends
    assert any("holds no copy" in p for p in check_plan(
        ReshardPlan(wrong, plan.kept_bytes, plan.moved_bytes, []), LAYOUT, 2, 3, holders))
    assert any("the plan counts" in p for p in check_plan(
        ReshardPlan(plan.transfers, plan.kept_bytes, plan.moved_bytes + 1, []), LAYOUT, 2, 3,
        holders))


def test_a_round_places_survivors_on_what_they_hold_and_names_chunks_lost():
    nodes = ["n0", "n1", "n2", "n3"]
    last = generation(7, ["a", "b", "c", "d"], ["a", "b", "c", "d"], nodes)
    # "a" died: its copy is on "b"; "e" is new
    order, problems, lost = reshard_round(last, ["b", "c", "d", "e"])
    assert problems == [] and lost == []
    assert sorted(order) == ["b", "c", "d", "e"]
    # "a" and "b", its copy holder, both gone: chunk 0 has no copy
    order, problems, lost = reshard_round(last, ["c", "d"])
    assert problems == [] and any("chunk 0" in name for name in lost), lost
