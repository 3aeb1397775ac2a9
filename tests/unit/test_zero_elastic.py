"""Which generation of a sharded elastic state a new round restores, who sends what, and
where each rank's copies go (pure logic; the real kills are in tests/integration/
test_elastic.py)."""

from __future__ import annotations

import pytest

from raytrain_x.common.errors import ElasticStateLost
from raytrain_x.torch.zero_elastic import Report, plan_restore, replica_holders

A, B, C, D = (("optimizer", i) for i in range(4))
EVERY = frozenset({A, B, C, D})


def _report(taken: int, **generations) -> Report:
    return Report(taken, {int(n[1:]): (frozenset(keys), EVERY) for n, keys in
                          generations.items()})


def test_the_survivors_copies_make_the_newest_generation_whole():
    # rank 0 holds its shard (A, B) and rank 2's copy (D); rank 1 holds C (and A, B)
    plan = plan_restore([_report(5, g5={A, B, D}), _report(5, g5={C, A, B})])
    assert plan.generation == 5 and plan.root == 0
    assert plan.senders == {A: 0, B: 0, C: 1, D: 0}


def test_a_generation_staged_everywhere_wins_over_the_one_taken():
    # every rank staged 6; one took it up, the other's commit broke off before
    plan = plan_restore([_report(6, g6={A, B, C, D}), _report(5, g5=EVERY, g6={C, D})])
    assert plan.generation == 6


def test_a_staged_generation_that_is_not_whole_falls_back_to_the_one_taken():
    plan = plan_restore([_report(5, g5={A, B}, g6={A, B}), _report(5, g5={C, D})])
    assert plan.generation == 5 and plan.senders[C] == 1


def test_a_newcomer_holds_nothing_that_counts():
    plan = plan_restore([_report(0, g0=set()), _report(3, g3=EVERY)])
    assert plan.generation == 3 and plan.root == 1


def test_losing_every_copy_of_a_shard_names_it():
    with pytest.raises(ElasticStateLost, match=r"2 parameter\(s\) \(optimizer parameter 2, "
                                                r"optimizer parameter 3\).*replicas=2"):
        plan_restore([_report(4, g4={A, B}), _report(4, g4={A})])


def test_a_job_that_never_committed_starts_from_its_initial_state():
    plan = plan_restore([Report(0, {0: (frozenset(), None)}), Report(0, {0: (frozenset(), None)})])
    assert plan.generation == 0 and plan.senders == {}


def test_copies_go_to_other_hosts_first():
    hosts = [0, 0, 1, 1]  # ranks 0 and 1 on host 0, ranks 2 and 3 on host 1
    assert replica_holders(0, hosts, 1) == [2]
    assert replica_holders(3, hosts, 1) == [0]
    assert replica_holders(1, hosts, 3) == [2, 3, 0]
    assert replica_holders(0, [0, 0, 0], 1) == [1]  # one host: the next rank
    assert replica_holders(0, [0], 1) == []  # alone: nowhere to keep a copy
