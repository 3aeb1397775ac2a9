"""Policies a user injects into the elastic driver, as pure decisions: `SlowWorkers` sends
the slowest worker away only when the others would train more samples a second without
it; a member a policy asked to leave goes at the rendezvous as a drained one does, on the
node its peers stay on; the work per step each worker reports is its step less its waits."""

from __future__ import annotations

import threading
import time

import pytest

from raytrain_x.common.errors import ConfigError
from raytrain_x.common.process import StepClock
from raytrain_x.ray.elastic.blacklist import Blacklist
from raytrain_x.ray.elastic.history import RoundHistory
from raytrain_x.ray.elastic.policies import (
    DriverPolicy,
    Heartbeats,
    JobSnapshot,
    MemberView,
    SlowWorkers,
    WorkerSample,
    decide_round,
)


def _job(*work_s: float, steps: int = 20, min_workers: int = 1) -> JobSnapshot:
    return JobSnapshot(tuple(WorkerSample(f"w{i}", "n", i, w, steps)
                             for i, w in enumerate(work_s)), min_workers, 1, 0.0)


def test_the_slowest_leaves_when_the_others_would_train_faster_without_it():
    policy = SlowWorkers()
    assert isinstance(policy, DriverPolicy)
    # one of 3 twice as slow: 2 workers at 100 ms beat 3 at 200 ms by 4/3
    leave = policy.decide(_job(0.1, 0.2, 0.1))
    assert [x.worker_id for x in leave] == ["w1"] and leave[0].cooldown_s == 300.0
    assert "2.0x its peers'" in leave[0].reason and "1.33x" in leave[0].reason
    assert policy.gain(_job(0.1, 0.2, 0.1)) == pytest.approx(4 / 3)
    # one of 2 twice as slow: one worker alone trains as many samples a second
    assert policy.decide(_job(0.1, 0.2)) == []
    # a little slower: not worth a new round
    assert policy.decide(_job(0.1, 0.11, 0.1, 0.1)) == []
    # three times as slow, one of 2: worth it
    assert [x.worker_id for x in policy.decide(_job(0.1, 0.3))] == ["w1"]


def test_it_waits_for_every_member_to_measure_and_keeps_min_workers():
    policy = SlowWorkers(min_steps=10)
    assert policy.decide(_job(0.1, 0.2, 0.1, steps=9)) == []
    unmeasured = JobSnapshot((WorkerSample("a", "n", 0, 0.1, 20),
                              WorkerSample("b", "n", 1, 0.3, 20),
                              WorkerSample("c", "n", 2, 0.0, 0)), 1, 1, 0.0)
    assert policy.decide(unmeasured) == []
    assert policy.decide(_job(0.1, 0.2, 0.1, min_workers=3)) == []
    assert policy.decide(_job(0.1, 0.2, 0.1, min_workers=2)) != []


@pytest.mark.parametrize("kwargs, says", [
    ({"min_gain": 1.0}, "min_gain=...) must be > 1"),
    ({"min_steps": 0}, "min_steps=...) must be an int >= 1"),
    ({"cooldown_s": -1}, "cooldown_s=...) must be >= 0"),
])
def test_bad_arguments_get_one_clear_error(kwargs, says):
    with pytest.raises(ConfigError, match=r"SlowWorkers\(" + says.replace("(", r"\(")
                       .replace(")", r"\)").replace(".", r"\.")):
        SlowWorkers(**kwargs)


def test_a_member_asked_to_leave_goes_as_a_drained_one_while_its_node_stays():
    members = [MemberView("a", "n1", in_round=True), MemberView("b", "n1", in_round=True),
               MemberView("c", "n1", in_round=True, asked_to_leave=True)]
    there = decide_round(["a", "b", "c"], members, draining=(), min_workers=1)
    assert there.leave == ["c"] and there.form and there.ranks == ["a", "b"]
    early = decide_round(["a", "b"], members, draining=(), min_workers=1)
    assert early.form and early.departed == ["c"]
    # it alone holds the committed state: it stays until the others hold it too
    kept = decide_round(["a", "b", "c"], members, (), 1, holders=["c"])
    assert kept.leave == [] and kept.kept == ["c"]


def test_a_policys_leave_is_not_a_reset_and_its_host_rests_without_a_failure():
    history = RoundHistory(clock=lambda: 0.0)
    history.record(1, 3, 1, 0, 0, 0)
    history.note("policy", left=1)
    assert not history.is_reset()
    now = [0.0]
    blacklist = Blacklist(cooldown_range=(10, 10), clock=lambda: now[0])
    blacklist.rest("n1", 300)
    assert blacklist.is_blacklisted("n1") and blacklist.failures == {}
    now[0] = 301
    assert not blacklist.is_blacklisted("n1")


def test_a_workers_work_per_step_is_its_step_less_its_waits_and_a_new_world_starts_over():
    clock = StepClock()
    clock.mark()
    for _ in range(3):
        time.sleep(0.02)  # its own work
        clock.blocked(1e6)  # a wait longer than any step: the work is never below 0
        clock.mark()
    work, steps = clock.work()
    assert steps == 3 and work == 0.0
    clock.new_world()
    assert clock.work() == (0.0, 0)
    clock.mark()
    time.sleep(0.02)
    other = threading.Thread(target=clock.blocked, args=(1.0,))  # not the stepping thread
    other.start()
    other.join()
    clock.mark()
    work, steps = clock.work()
    assert steps == 1 and work >= 0.02


def test_the_heartbeat_keeps_each_members_work_until_its_next_round():
    beats = Heartbeats()
    beats.record({"a": (0.0, 1, 0.1, 12), "b": (0.0, 1)}, (), (), 0.0)
    assert beats.work == {"a": (0.1, 12)}
    beats.assigned(["a"], 1.0)  # a new round: what it measured was the last one's
    assert beats.work == {}
