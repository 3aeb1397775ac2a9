"""Recursive doubling's schedule (`comm.doubling`): every rank of every size ends with the
whole reduction in at most log2 N + 2 steps, tested by playing all ranks' schedules
against one another without processes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from raytrain_x.comm.doubling import EXCHANGE, RECEIVE, SEND, schedule


def play(size: int) -> list[frozenset[int]]:
    """Runs every rank's schedule with sets of ranks as the values and union as the op,
    messages queued per (sender, receiver) as gloo's pairs keep them in order; fails on a
    deadlock or on a contribution counted twice."""
    values = [frozenset([r]) for r in range(size)]
    plans = [schedule(r, size) for r in range(size)]
    at, sent = [0] * size, [False] * size
    mail: dict[tuple[int, int], list[frozenset[int]]] = {}
    while any(at[r] < len(plans[r]) for r in range(size)):
        moved = False
        for r in range(size):
            if at[r] == len(plans[r]):
                continue
            step = plans[r][at[r]]
            if step.kind in (SEND, EXCHANGE) and not sent[r]:
                mail.setdefault((r, step.peer), []).append(values[r])
                sent[r], moved = True, True
            if step.kind in (RECEIVE, EXCHANGE):
                queue = mail.get((step.peer, r))
                if not queue:
                    continue
                theirs = queue.pop(0)
                if step.final:
                    values[r] = theirs
                else:
                    assert not values[r] & theirs, (size, r, step)  # nothing counted twice
                    values[r] = values[r] | theirs
            at[r], sent[r], moved = at[r] + 1, False, True
        assert moved, f"the schedules of {size} ranks deadlock"
    assert not any(mail.values()), "a message nobody received"
    return values


@given(st.integers(min_value=1, max_value=300))
def test_every_rank_ends_with_every_ranks_contribution_once(size):
    assert play(size) == [frozenset(range(size))] * size


@pytest.mark.parametrize("size", [2, 3, 5, 8, 12, 1000, 1024, 10_000])
def test_a_rank_takes_log_steps_and_talks_to_log_peers(size):
    """gloo's ring takes 2(N-1) steps in sequence; with lazily connected pairs a rank
    connects only the peers its schedule names."""
    log2 = size.bit_length() - 1
    for rank in range(size):
        steps = schedule(rank, size)
        assert len(steps) <= log2 + 2
        assert len({s.peer for s in steps}) <= log2 + 1


def test_a_rank_outside_the_group_is_refused():
    with pytest.raises(ValueError, match="not in a group of 4"):
        schedule(4, 4)
