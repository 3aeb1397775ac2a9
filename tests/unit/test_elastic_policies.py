"""Every decision of the elastic controller, as pure policies with a fake clock: where to
start workers, what to ask the autoscaler for, when to give up on a starting worker, what a
drain and a failure mean, min_workers over time, the straggler rule, when a round forms, and
the event log they write to."""

from __future__ import annotations

import math
import random

import pytest

from raytrain_x.common.errors import (
    ConfigError,
    ElasticTimeout,
    FailureLimitExceeded,
    ResetLimitExceeded,
)
from raytrain_x.ray.elastic.blacklist import Blacklist
from raytrain_x.ray.elastic.events import EventLog
from raytrain_x.ray.elastic.policies import (
    DrainNotice,
    FailurePolicy,
    Heartbeats,
    MemberView,
    MinimumWatch,
    PendingView,
    ScalingPolicy,
    StragglerRule,
    abandons_forming_round,
    asks_checkpoint,
    batch_awaited,
    decide_round,
    drain_line,
    elastic_timeout_error,
    held_back,
    held_joins,
    holds_newcomers,
    kept_on_drain,
    last_resort_nodes,
    notice_drains,
    spare_last_holders,
    state_lost,
    state_lost_error,
)
from raytrain_x.ray.elastic.rounds import current_holders, plan_round
from raytrain_x.ray.elastic.settings import ElasticSettings


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def settings(**overrides) -> ElasticSettings:
    base = dict(min_workers=2, max_workers=4, cpus_per_worker=1.0, gpus_per_worker=0.0,
                resources_per_worker={}, reset_limit=None, cooldown_range=(1.0, 8.0),
                elastic_timeout=30.0, timeout_s=10.0, start_timeout_s=300.0)
    base.update(overrides)
    return ElasticSettings(**base)


def blacklist(clock: Clock, cooldown=(1.0, 8.0)) -> Blacklist:
    return Blacklist(cooldown, clock, random.Random(0))


# ----------------------------------------------------------------------------- scaling
def test_workers_start_on_usable_slots_up_to_max_workers_in_node_order():
    clock = Clock()
    policy = ScalingPolicy(settings(max_workers=4))
    bl = blacklist(clock)
    bl.record_failure("n3")
    usable = policy.usable_slots({"n2": 2, "n1": 1, "n3": 5, "n4": 0, "n5": 2},
                                 draining={"n5"}, blacklist=bl)
    assert usable == {"n1": 1, "n2": 2}  # blacklisted, draining and full nodes left out
    assert policy.starts(usable, members=0, pending=0) == ["n1", "n2", "n2"]
    assert policy.starts(usable, members=2, pending=1) == ["n1"]
    assert policy.starts(usable, members=3, pending=1) == []
    clock.now += 60  # the cooldown is over: the host is usable again
    assert "n3" in policy.usable_slots({"n3": 1}, (), bl)


def test_the_autoscaler_is_asked_for_max_workers_plus_unusable_slots_until_full():
    policy = ScalingPolicy(settings(max_workers=4))
    assert policy.bundles(staying=1, pending=1, unusable_slots=0) == 4
    assert policy.bundles(staying=1, pending=0, unusable_slots=3) == 7
    assert policy.bundles(staying=3, pending=1, unusable_slots=3) == 0  # full: withdrawn
    assert policy.bundles(staying=5, pending=0, unusable_slots=0) == 0


def test_a_starting_worker_is_given_up_only_when_it_cannot_start():
    clock = Clock()
    policy = ScalingPolicy(settings(start_timeout_s=300.0, cpus_per_worker=2.0))
    pending = [PendingView("gone", "n9", clock()), PendingView("small", "n2", clock()),
               PendingView("slow", "n1", clock() - 299.0),
               PendingView("late", "n1", clock() - 301.0)]
    nodes = {"n1": {"CPU": 4.0}, "n2": {"CPU": 1.0}}
    assert policy.give_ups(pending, nodes, clock()) == [
        ("gone", "its node left the cluster"),
        ("small", "its node can no longer fit a worker"),
        ("late", "it did not start within start_timeout_s=300s")]


def test_a_job_no_node_or_node_type_can_fit_fails_before_starting():
    policy = ScalingPolicy(settings(gpus_per_worker=1.0))
    cpu_only = {"n1": {"CPU": 8.0}}
    with pytest.raises(ConfigError, match=r"a worker needs \{CPU: 1, GPU: 1\}.*CPU: 8"):
        policy.check_feasible(cpu_only, {"cpu_type": {"CPU": 4.0}})
    policy.check_feasible(cpu_only, {"gpu_type": {"CPU": 4.0, "GPU": 1.0}})  # may come
    policy.check_feasible(cpu_only, None)  # an autoscaler that does not say
    policy.check_feasible({"n1": {"CPU": 2.0, "GPU": 1.0}}, {})


# ----------------------------------------------------------------------------- drains
def test_a_new_drain_gives_up_its_starting_workers_and_sends_its_members_away():
    pending = [PendingView("p1", "n2", 0.0), PendingView("p2", "n3", 0.0)]
    notice = notice_drains({"n1": math.inf, "n2": 5000.0}, known={"n1"}, pending=pending,
                           member_nodes=["n1", "n2", "n2", "n3"])
    assert notice.new == {"n2": 5000.0}  # n1 was known
    assert notice.give_up == ["p1"]
    assert notice.leaving == {"n2": 2} and notice.interrupt
    quiet = notice_drains({"n4": 1.0}, known=(), pending=[], member_nodes=["n1"])
    assert quiet.new == {"n4": 1.0} and not quiet.interrupt  # none of ours there
    assert "no deadline" in drain_line("abcdef0123", math.inf, 0.0, 2)
    assert "deadline in 30 s" in drain_line("abcdef0123", 130.0, 100.0, 1)


def test_a_drain_gives_up_a_round_still_forming_with_a_member_on_its_node():
    notice = notice_drains({"n2": 5000.0}, known=(), pending=[], member_nodes=["n1", "n2"])
    # round 4 has formed when rank 0 committed in it; before, it is still forming
    assert abandons_forming_round(notice, in_round=["n1", "n2"], round_id=4, committed_round=3)
    assert not abandons_forming_round(notice, ["n1", "n2"], round_id=4, committed_round=4)
    # the draining member is a newcomer not in the round: the round forms without it anyway
    assert not abandons_forming_round(notice, in_round=["n1"], round_id=4, committed_round=3)
    quiet = notice_drains({"n3": 1.0}, known=(), pending=[], member_nodes=["n1", "n2"])
    assert not abandons_forming_round(quiet, ["n1", "n2"], round_id=4, committed_round=0)
    # every member synced in round 4: it runs its first step, and a drain then was taken
    # for a failure (the newcomer restarted, the others restoring and redoing a step);
    # now its draining member leaves at the round's first commit, nothing restored
    assert not abandons_forming_round(notice, ["n1", "n2"], round_id=4, committed_round=3,
                                      synced=True)


def test_a_given_up_rounds_newcomers_wait_for_the_round_after_the_recovery():
    a, b = MemberView("a", "n1", in_round=True), MemberView("b", "n2", in_round=True)
    new = MemberView("new", "n3")  # in the given-up round; a newcomer again
    everyone = ["a", "b", "new"]
    assert held_back({"new"}, [a, b, new], {"n2"}, min_workers=1, responsive=everyone,
                     holders=["a", "b"]) == {"new"}
    # the recovery round forms of the veterans alone, though the newcomer waits too
    decision = decide_round(["a", "b"], [a, b, new], {"n2"}, 1)
    assert decision.form and decision.ranks == ["a"] and decision.leave == ["b"]
    # too few veterans for a round of their own: everyone waits for the newcomer
    assert held_back({"new"}, [a, b, new], {"n2"}, 2, everyone, holders=["a"]) == set()
    # the first round was given up: no veterans at all
    first = [MemberView("a", "n1"), MemberView("new", "n3")]
    assert held_back({"a", "new"}, first, (), 1, everyone, holders=None) == set()
    # the veteran's node is gone unseen (it missed the last heartbeat): the newcomer,
    # which may hold the only copy of the state by now, is waited for
    assert held_back({"new"}, [a, b, new], {"n2"}, 1, ["b", "new"], holders=["a"]) == set()
    # the newcomer synced the state before the give-up: it is not restarted
    assert held_back({"new"}, [a, b, new], {"n2"}, 1, everyone, ["a", "new"]) == set()


# ----------------------------------------------------------------------------- minimum
def test_fewer_than_min_workers_is_waited_for_up_to_elastic_timeout():
    clock = Clock()
    watch = MinimumWatch(settings(min_workers=2, elastic_timeout=30.0))
    assert watch.observe(2, clock()) == "ok"
    assert watch.observe(1, clock()) == "below"  # warned once
    clock.now += 30.0
    assert watch.observe(1, clock()) == "waiting"
    assert watch.observe(3, clock()) == "ok"  # recovered: the wait starts over
    assert watch.observe(1, clock()) == "below"
    clock.now += 30.5
    assert watch.observe(1, clock()) == "timeout"
    # a start: no worker yet, both on their way, is no shortage (it warned at every start)
    start = MinimumWatch(settings(min_workers=2, elastic_timeout=30.0))
    assert start.observe(0, clock(), starting=2) == "waiting"
    assert start.observe(1, clock(), starting=1) == "waiting"
    assert start.observe(1, clock(), starting=0) == "below"  # one of them gave up
    assert start.observe(2, clock()) == "ok"
    clock.now += 31.0
    assert start.observe(0, clock(), starting=2) == "waiting"
    clock.now += 30.5  # starting or not, the wait is bounded
    assert start.observe(0, clock(), starting=2) == "timeout"
    error = elastic_timeout_error(settings(), 1, starting=2, bundles=4,
                                  blacklisted=["abcdef0123456"])
    assert isinstance(error, ElasticTimeout)
    assert "only 1 workers (2 still starting) for 30s" in str(error)
    assert "room for 4 workers of {CPU: 1}" in str(error) and "abcdef01" in str(error)


# ----------------------------------------------------------------------------- failures
def test_a_failure_blacklists_its_host_with_a_growing_cooldown():
    clock = Clock()
    bl = blacklist(clock, (1.0, 8.0))
    policy = FailurePolicy(settings(), bl)
    first = policy.on_failure("n1")
    assert first.kind == "failure" and 1.0 <= first.cooldown_s <= 2.0
    second = policy.on_failure("n1")
    assert 2.0 <= second.cooldown_s <= 3.0  # lo * 2^(n-1) plus jitter
    assert bl.is_blacklisted("n1")
    clock.now += second.cooldown_s + 0.01
    assert not bl.is_blacklisted("n1")
    for _ in range(5):
        last = policy.on_failure("n1")
    assert last.cooldown_s == 8.0  # capped
    forever = FailurePolicy(settings(cooldown_range=None), Blacklist(None, clock))
    assert forever.on_failure("n2").cooldown_s == float("inf")


def test_a_worker_lost_with_its_draining_node_does_not_blacklist_it():
    clock = Clock()
    policy = FailurePolicy(settings(), blacklist(clock))
    policy.note_drained("n1")
    assert policy.on_failure("n1").kind == "lost_draining"
    assert not policy.blacklist.is_blacklisted("n1")


def test_resets_past_reset_limit_fail_the_job_and_drain_rounds_do_not_count():
    policy = FailurePolicy(settings(reset_limit=2), blacklist(Clock()))
    policy.count_round(is_reset=False)
    policy.count_round(is_reset=True)
    policy.count_round(is_reset=True)
    assert policy.resets == 2
    with pytest.raises(ResetLimitExceeded, match="reset 3 times.*reset_limit=2.*boom"):
        policy.count_round(is_reset=True, last_failure="boom")
    unlimited = FailurePolicy(settings(reset_limit=None), blacklist(Clock()))
    for _ in range(100):
        unlimited.count_round(is_reset=True)


def test_max_failures_counts_the_failures_one_reset_recovers_from_as_one_and_drains_as_none():
    """Ray Train's `FailureConfig(max_failures)`: a node lost with two workers is one
    failure (one group restart there), a drained node's workers none."""
    policy = FailurePolicy(settings(max_failures=1), blacklist(Clock()))
    policy.on_failure("n1")
    policy.on_failure("n2")  # lost together: one reset recovers from both
    policy.count_round(is_reset=True)
    assert policy.failures == 1
    policy.note_drained("n3")
    policy.on_failure("n3")  # lost with its draining node
    policy.count_round(is_reset=True)
    policy.count_round(is_reset=True)  # a newcomer's round
    assert policy.failures == 1
    policy.on_failure("n4")
    with pytest.raises(FailureLimitExceeded, match="failed 2 times.*max_failures=1.*boom"):
        policy.count_round(is_reset=True, last_failure="boom")


def test_an_absent_member_silent_to_the_heartbeat_is_lost_at_once():
    clock = Clock()
    rule = StragglerRule(lost_after_s=5.0)
    assert rule.observe(waiting=[], present=["a", "b"], now=clock()) == (False, [], [], [])
    assert rule.observe(["a", "b"], ["a", "b"], clock()) == (True, [], [], [])  # all left
    # b absent but it answers (silent 0.5 s): noted, not lost
    assert rule.observe(["a"], ["a", "b"], clock(), silent={"b": 0.5}) == (True, [], [], ["b"])
    # b has not answered for 11 s (cut off since before a left its collective): lost now,
    # at the first look, with no probe's wait
    assert rule.observe(["a"], ["a", "b"], clock(), in_round=["a", "b"],
                        silent={"a": 0.2, "b": 11.0}).lost == ["b"]
    # a call that failed (its process or node gone) counts at once, however recent
    assert rule.observe(["a"], ["a", "b"], clock(), failed=["b"]).lost == ["b"]
    assert rule.observe([], ["a", "b"], clock(), silent={"b": 30.0}) == (False, [], [], [])
    assert rule.absent_since == {}


def test_a_newcomers_silence_fails_it_not_only_its_death_does():
    # c is a newcomer (never given a rank) loading its framework, silent for 12 s while a
    # and b wait: no one left a collective for it, so it is absent, not lost
    rule = StragglerRule(lost_after_s=5.0, stuck_after_s=15.0)
    verdict = rule.observe(["a", "b"], ["a", "b", "c"], now=0.0, in_round=["a", "b"],
                           silent={"c": 12.0})
    assert verdict == (True, [], [], ["c"])
    # the first round (no member was in one) waits for it the same way
    assert rule.observe(["a"], ["a", "c"], now=1.0, silent={"c": 30.0}).lost == []
    # its call failed (Ray reports its process or node gone): lost at once
    assert rule.observe(["a"], ["a", "c"], now=2.0, failed=["c"]).lost == ["c"]


def test_silence_alone_fails_no_one():
    # a host cut off for less than the collective timeout: its peers are still in their
    # collective, nobody waits at the rendezvous, so its silence costs it nothing
    rule = StragglerRule(lost_after_s=5.0)
    assert rule.observe([], ["a", "b"], now=0.0, silent={"b": 60.0}, failed=["b"]) == \
        (False, [], [], [])


def test_heartbeats_count_silence_from_the_oldest_unanswered_call():
    beats = Heartbeats()
    beats.sent("a", 10.0)
    assert beats.silent_for("a", 10.0) == 0.0
    beats.sent("a", 11.0)  # a second call while the first is out: the first counts
    assert beats.silent_for("a", 16.0) == 6.0
    beats.answered("a", joining_s=2.5)
    assert beats.silent_for("a", 16.0) == 0.0 and beats.joining["a"] == 2.5
    beats.sent("a", 17.0)
    beats.call_failed("a")  # failed: silent from when it went out, and marked
    assert beats.silent_for("a", 18.0) == 1.0 and beats.failed == {"a"}
    beats.answered("a", 0.0)
    assert beats.failed == set()
    assert beats.silent_for("never-asked", 100.0) == 0.0
    # one heartbeat round: a answered, b's call failed, a call went out to c
    beats.record({"a": (1.5, 0)}, failed=["b"], sent=["c"], now=20.0)
    assert beats.joining["a"] == 1.5 and beats.failed == {"b"}
    assert beats.silent_for("c", 26.0) == 6.0
    beats.keep(["a"])  # b and c left the job
    assert set(beats.out_since) == set() and beats.failed == set() and set(beats.joining) == {"a"}


def test_a_join_counts_only_when_it_began_after_the_members_last_rank():
    beats = Heartbeats()
    # a newcomer waits 4 s for a round; its answer to the call sent at 10.0 says so
    beats.sent("new", 10.0)
    beats.record({"new": (4.0, 0)}, failed=[], sent=[], now=10.5)
    assert beats.joins() == {"new": 4.0}  # never given a rank: any join counts
    beats.assigned(["new"], 11.0)  # its round is published: that join is over
    assert beats.joins() == {}
    # the actor's answer has not reached it yet: it still says it is joining, 5 s now
    beats.sent("new", 11.5)
    beats.record({"new": (5.0, 0)}, failed=[], sent=[], now=12.0)
    assert beats.joins() == {}  # began by 6.5, before its rank at 11.0
    # a later join, begun after its rank (sent 20.0, in it 3.5 s: began after 16.5)
    beats.sent("new", 20.0)
    beats.record({"new": (3.5, 0)}, failed=[], sent=[], now=20.1)
    assert beats.joins() == {"new": 3.5}
    beats.answered("new", 0.0)  # not joining
    assert beats.joins() == {}
    beats.answered("new", 9.0)  # when the call went out is unknown: it cannot count
    assert beats.joins() == {}
    beats.keep([])
    assert not beats.join_began and not beats.assigned_at


def test_a_member_that_says_it_holds_the_latest_state_is_a_holder():
    # a synced the state in round 6, which never committed (the last commit was in round
    # 5); b holds round 4's state; c never synced
    beats = Heartbeats()
    beats.record({"a": (0.0, 6), "b": (2.0, 4), "c": (1.0, 0)}, failed=[], sent=[], now=1.0)
    assert current_holders(beats.state_rounds, 5) == ["a"]
    assert current_holders(beats.state_rounds, 7) == []  # a later round committed without them
    beats.keep(["b", "c"])
    assert current_holders(beats.state_rounds, 4) == ["b"]


def test_a_round_is_needed_when_every_member_left_its_round_at_once():
    # a round that failed for all its members together (their rendezvous timed out at one
    # moment after a partition): they all wait within one poll, none is ever seen absent
    rule = StragglerRule()
    assert rule.observe(["a", "b", "c"], ["a", "b", "c"], now=0.0) == (True, [], [], [])


def test_a_member_that_answers_but_stays_away_from_the_rendezvous_is_stuck():
    clock = Clock()
    rule = StragglerRule(lost_after_s=5.0, stuck_after_s=15.0)
    members = ["a", "b", "new"]  # "new" is a newcomer still starting: never stuck
    verdicts = []
    for _ in range(16):  # one poll a second; b and new answer every heartbeat
        verdicts.append(rule.observe(["a"], members, clock(), in_round=["a", "b"],
                                     silent={"b": 0.4, "new": 0.9}))
        clock.now += 1.0
    assert all(v.needs_round and v.lost == [] for v in verdicts)
    assert all(v.absent == ["b", "new"] for v in verdicts)
    assert all(v.stuck == [] for v in verdicts[:15])
    assert verdicts[15].stuck == ["b"]
    # b arrives: the count is over; it starts again at the next absence
    assert rule.observe(["a", "b"], ["a", "b"], clock()) == (True, [], [], [])
    assert rule.observe(["a"], ["a", "b"], clock(), in_round=["a", "b"]).stuck == []


def test_an_absence_counts_from_the_members_last_placement():
    # b was absent for 10 s, then a round placed it: the rounds actor's answer reaches it
    # late, so it still looks absent while its peers wait again, but its absence starts anew
    rule = StragglerRule(lost_after_s=5.0, stuck_after_s=15.0)
    for now in range(0, 11):
        rule.observe(["a"], ["a", "b"], float(now), in_round=["a", "b"], silent={"b": 0.1})
    rule.forget(["a", "b"])
    assert rule.observe(["a"], ["a", "b"], 12.0, in_round=["a", "b"]).stuck == []
    assert rule.observe(["a"], ["a", "b"], 26.0, in_round=["a", "b"]).stuck == []
    assert rule.observe(["a"], ["a", "b"], 27.0, in_round=["a", "b"]).stuck == ["b"]


def test_a_join_that_the_rounds_actor_never_received_is_held():
    joining = {"a": 0.0, "b": 4.0, "c": 1.0, "d": 9.0}  # seconds in their join call
    # a is not joining, c only just began, d's join arrived: b's is held back by Ray
    assert held_joins(joining, waiting=["d"], held_after_s=3.0) == ["b"]
    assert held_joins({}, waiting=[], held_after_s=3.0) == []


# ----------------------------------------------------------------------------- rounds
def test_a_round_forms_once_every_staying_member_waits_and_drained_ones_leave():
    members = [MemberView("a", "n1"), MemberView("b", "n1"), MemberView("c", "n2"),
               MemberView("d", "n3", leaving=True)]
    assert decide_round(["a"], members, draining=(), min_workers=2) == \
        decide_round(["a"], members, (), 2)
    waiting_some = decide_round(["a", "b"], members, (), 2)
    assert waiting_some.leave == [] and not waiting_some.form  # c is on its way
    all_there = decide_round(["a", "b", "c"], members, (), 2)
    assert all_there.form
    drained = decide_round(["a", "b", "c"], members, draining={"n2"}, min_workers=2)
    assert drained.leave == ["c"] and drained.form  # c leaves; a and b form the round
    too_few = decide_round(["a", "b", "c"], members, draining={"n1"}, min_workers=2)
    assert too_few.leave == ["a", "b"] and not too_few.form  # below min_workers


def test_a_later_round_does_not_wait_for_newcomers_still_starting():
    members = [MemberView("a", "n1", in_round=True), MemberView("b", "n2", in_round=True),
               MemberView("c", "n3", in_round=True), MemberView("new", "n4")]
    # c's node drains: a and b recover at once, without the newcomer still starting
    drained = decide_round(["a", "b", "c"], members, draining={"n3"}, min_workers=2)
    assert drained.leave == ["c"] and drained.form and drained.ranks == ["a", "b"]
    assert not drained.interrupt
    # the newcomer arrives while the others train: they are asked over, not waited for
    arrived = decide_round(["new"], members, (), 2)
    assert not arrived.form and arrived.interrupt
    # ... once their round has committed: not while it still forms (a recovery)
    forming = decide_round(["new"], members, (), 2, round_committed=False)
    assert not forming.form and not forming.interrupt
    # they reach their next commit: one round of all four
    together = decide_round(["a", "b", "c", "new"], members, (), 2)
    assert together.form and together.ranks == ["a", "b", "c", "new"]
    # a member of the last round still on its way holds the round up, as before
    assert not decide_round(["a", "new"], members, (), 2).form
    # the first round waits for everyone it started
    first = [MemberView("x", "n1"), MemberView("y", "n2")]
    assert not decide_round(["x"], first, (), 1).form
    assert decide_round(["x", "y"], first, (), 1).ranks == ["x", "y"]


def test_a_round_waiting_for_its_workers_says_how_many_more_joins_can_change_it():
    """The driver's join watch wakes it once `awaits` more workers wait, so a round of
    thousands costs it a look or two, not one a join (benchmarks/control_plane.py
    --forming)."""
    veterans = [MemberView(w, f"n{i}", in_round=True) for i, w in enumerate("abcd")]
    # nobody back yet (or all training): any arrival may matter, a newcomer asking over
    assert decide_round([], veterans, (), 1).awaits == 1
    # survivors coming back: the rest of them
    assert decide_round(["a"], veterans, (), 1).awaits == 3
    assert decide_round(["a", "b", "c"], veterans, (), 1).awaits == 1
    everyone = decide_round(["a", "b", "c", "d"], veterans, (), 1)
    assert everyone.form and everyone.awaits == 0
    # a newcomer's arrival does not change what the others wait for
    newcomer = [*veterans, MemberView("new", "n9")]
    assert decide_round(["a", "new"], newcomer, (), 1, round_committed=False).awaits == 3
    # the first round waits for everyone it started; min_workers may ask more of it
    first = [MemberView(w, f"n{i}") for i, w in enumerate("xyz")]
    assert decide_round(["x"], first, (), 1).awaits == 2
    assert decide_round(["x"], first[:1], (), 3).awaits == 2  # two more must come
    # a member leaving is not waited for
    assert decide_round(["a"], veterans, {"n3"}, 1).awaits == 2


def test_a_drained_member_slower_to_the_rendezvous_departs_with_the_round_formed_without_it():
    members = [MemberView("a", "n1", in_round=True), MemberView("b", "n2", in_round=True),
               MemberView("c", "n3", in_round=True), MemberView("new", "n3")]
    # c (its node draining) is not at the rendezvous yet: a and b form the round, c departs
    early = decide_round(["a", "b"], members, draining={"n3"}, min_workers=1)
    assert early.form and early.ranks == ["a", "b"] and early.leave == []
    assert early.departed == ["c"]  # a newcomer on the node never was in a round
    # there first, it is sent away at the rendezvous instead
    there = decide_round(["a", "b", "c"], members, draining={"n3"}, min_workers=1)
    assert there.leave == ["c"] and there.departed == []
    # no round forms: nobody departs yet
    assert decide_round(["a"], members, draining={"n3"}, min_workers=1).departed == []


def test_a_drained_member_that_alone_holds_the_state_stays_until_a_staying_one_does():
    """The simulator's finding: a drain sent the job's last state holder away while a
    newcomer waited, and the job stopped with ElasticStateLost. Now the holder stays one
    round (rank 0, the newcomers sync from it) and leaves after that round's commit."""
    members = [MemberView("old", "n1", in_round=True), MemberView("new", "n2")]
    decision = decide_round(["old", "new"], members, draining={"n1"}, min_workers=1,
                            holders=["old"])
    assert decision.leave == [] and decision.form and decision.ranks == ["new", "old"]
    assert decision.kept == ["old"]
    # that round committed: both were in it; it is asked over, the drained one then leaves
    both = [MemberView("old", "n1", in_round=True), MemberView("new", "n2", in_round=True)]
    asked = decide_round([], both, draining={"n1"}, min_workers=1, holders=["old"])
    assert asked.release and not asked.form
    after = decide_round(["old", "new"], both, draining={"n1"}, min_workers=1,
                         holders=["old", "new"])
    assert after.leave == ["old"] and after.ranks == ["new"] and after.kept == []


def test_a_round_all_on_draining_nodes_trains_on_without_a_round_per_commit():
    """The last holder's node drains after the others did and there is nowhere to go: its
    round commits and is not asked over (each commit would form a round of the same
    member, one per step, until the node went)."""
    alone = [MemberView("last", "n2", in_round=True), MemberView("gone", "n1", departed=True,
                                                                  leaving=True)]
    decision = decide_round([], alone, draining={"n1", "n2"}, min_workers=1,
                            holders=["last"])
    assert not decision.release and not decision.form and not decision.interrupt
    # it arrives at the rendezvous anyway (a fault, a newcomer asked over): kept, it forms
    there = decide_round(["last"], alone, draining={"n1", "n2"}, min_workers=1,
                         holders=["last"])
    assert there.form and there.ranks == ["last"] and there.kept == ["last"]


def test_a_staying_holder_counts_only_once_it_waits_at_the_rendezvous():
    """One on its way may have died unseen: until it waits, the drained holder stays."""
    members = [MemberView("d", "n1", in_round=True), MemberView("s", "n2", in_round=True)]
    assert kept_on_drain(members, {"n1"}, ["d", "s"], waiting=["d"]) == {"d"}
    assert kept_on_drain(members, {"n1"}, ["d", "s"], waiting=["d", "s"]) == set()
    # a drained member the last round formed without: a holder until that round commits
    # (the rounds actor then no longer counts it: `current_holders`)
    gone = [MemberView("d", "n1", in_round=True, departed=True), members[1]]
    assert kept_on_drain(gone, {"n1"}, ["d"], waiting=["d"]) == {"d"}
    assert kept_on_drain(gone, {"n1"}, ["s"], waiting=["d"]) == set()
    # before the first commit there is no state to keep, but a last round all on
    # draining nodes is waited for: it trains on to its next commit
    only = [MemberView("d", "n1", in_round=True), MemberView("new", "n2")]
    assert kept_on_drain(only, {"n1"}, None, waiting=["new"]) == {"d"}
    decision = decide_round(["new"], only, draining={"n1"}, min_workers=1)
    assert not decision.form and decision.departed == []


def test_a_worker_holds_the_latest_state_while_no_later_round_has_committed():
    reported = {"left_round_3": 3, "synced_in_5": 5, "never_synced": 0, "in_4": 4}
    assert current_holders(reported, committed_round=4) == ["in_4", "synced_in_5"]
    assert current_holders(reported, committed_round=0) == ["in_4", "left_round_3",
                                                            "synced_in_5"]


def test_a_held_or_stuck_member_that_alone_holds_the_state_is_not_restarted():
    assert spare_last_holders(["a"], members=["a", "b"], holders=["a", "b"]) == ["a"]
    assert spare_last_holders(["a"], members=["a", "new"], holders=["a"]) == []
    # the other holder does not answer the heartbeat: it may be gone unseen
    assert spare_last_holders(["a"], members=["a"], holders=["a", "b"]) == []
    assert spare_last_holders(["a"], members=["a"], holders=None) == ["a"]  # no commit yet
    # only the others were asked (a ping), and none answered
    assert spare_last_holders(["a", "c"], members=[], holders=["a", "b"]) == ["c"]


def test_rank_0_is_the_oldest_member_that_holds_the_state():
    """The simulator's finding: an older member that joined but never synced became rank
    0, and the round synced everyone to its initial state."""
    members = {"never_synced": ("n1", 1), "holder": ("n2", 5), "new": ("n1", 7)}
    places = plan_round(members, round_id=4, hosts_version=0, holders=["holder", "gone"])
    assert places["holder"]["rank"] == 0 and places["holder"]["cross_rank"] == 0  # on n2
    assert plan_round(members, 4, 0)["never_synced"]["rank"] == 0  # no commit yet: by age


def test_nodes_where_a_worker_lately_did_not_start_are_tried_last():
    policy = ScalingPolicy(settings(max_workers=3))
    usable = {"n1": 1, "n2": 1, "n3": 1, "n4": 1}
    assert policy.starts(usable, members=1, pending=0) == ["n1", "n2"]
    assert policy.starts(usable, 1, 0, last_resort={"n1", "n2"}) == ["n3", "n4"]
    assert policy.starts({"n1": 2}, 0, 0, last_resort={"n1"}) == ["n1", "n1"]  # only one


def test_a_node_with_a_worker_still_starting_takes_more_only_after_the_others():
    policy = ScalingPolicy(settings(min_workers=2, max_workers=3))
    usable = {"n5": 1, "n6": 2}
    # a worker has been starting on n5 for a while (it may never): the next goes to n6
    assert policy.starts(usable, members=1, pending=1, starting={"n5"}) == ["n6"]
    assert policy.starts(usable, members=0, pending=1, starting={"n5"}) == ["n6", "n6"]
    assert policy.starts({"n5": 1}, members=1, pending=1, starting={"n5"}) == ["n5"]
    # a last resort still comes after a node with a start under way
    assert policy.starts({"n5": 1, "n4": 1}, 1, 1, last_resort={"n4"},
                         starting={"n5"}) == ["n5"]
    assert policy.starts(usable, members=1, pending=0) == ["n5", "n6"]  # none starting



def test_a_node_no_worker_started_on_takes_one_start_before_any_takes_a_second():
    policy = ScalingPolicy(settings(min_workers=2, max_workers=4))
    usable = {"n3": 2, "n4": 2, "n5": 2}
    # the job's first placement packs: no node is proven yet
    assert policy.starts(usable, members=0, pending=0) == ["n3", "n3", "n4", "n4"]
    # replacements once n1 and n2 ran workers: the unproven nodes one start each first (two
    # starts on a node whose starts never end would hold both up for start_timeout_s)
    assert policy.starts(usable, members=1, pending=0, proven={"n1", "n2"}) == \
        ["n3", "n4", "n5"]
    assert policy.starts(usable, members=0, pending=0, proven={"n1", "n2"}) == \
        ["n3", "n4", "n5", "n3"]
    # a proven node is filled as before
    assert policy.starts(usable, members=0, pending=0, proven={"n4"}) == \
        ["n3", "n4", "n4", "n5"]


def test_a_drain_of_every_holder_asks_for_a_durable_checkpoint():
    nodes = {"w0": "n1", "w1": "n2", "w2": "n3"}
    pool = DrainNotice(new={"n1": 60.0, "n2": 60.0}, leaving={"n1": 1, "n2": 1})
    # every holder drains: asked, only with durable checkpoints
    assert asks_checkpoint(pool, ["w0", "w1"], nodes, {"n1", "n2"}, durable=True)
    assert not asks_checkpoint(pool, ["w0", "w1"], nodes, {"n1", "n2"}, durable=False)
    # a holder stays (its node does not drain): it keeps the state, nothing to write
    assert not asks_checkpoint(pool, ["w0", "w1", "w2"], nodes, {"n1", "n2"}, durable=True)
    # the last holder's node drains after the others did: this notice asks
    last = DrainNotice(new={"n3": 60.0}, leaving={"n3": 1})
    assert asks_checkpoint(last, ["w0", "w2"], nodes, {"n1", "n3"}, durable=True)
    # a drain of nodes that hold nothing asks nothing; nor does a job that never committed
    other = DrainNotice(new={"n3": 60.0}, leaving={"n3": 1})
    assert not asks_checkpoint(other, ["w0"], nodes, {"n1", "n3"}, durable=True)
    assert not asks_checkpoint(pool, None, nodes, {"n1", "n2"}, durable=True)


def test_below_min_workers_a_start_waiting_past_half_its_timeout_is_hedged():
    policy = ScalingPolicy(settings(min_workers=2, max_workers=3, start_timeout_s=30.0))
    assert policy.hedge_after_s == 15.0
    pending = [PendingView("hung", "n2", 0.0), PendingView("slow", "n3", 5.0),
               PendingView("new", "n5", 18.0)]
    assert [p.key for p in policy.stale(pending, now=21.0)] == ["hung", "slow"]
    usable = {"n4": 1}
    # one worker stays and two start: max_workers is full, min_workers is not yet met
    assert policy.starts(usable, members=1, pending=2, staying=1) == []
    # both starts waited past 15 s: they no longer count toward min_workers
    assert policy.starts(usable, members=1, pending=2, staying=1, stale=2) == ["n4"]
    # at min_workers there is nothing to hedge
    assert policy.starts(usable, members=2, pending=1, staying=2, stale=1) == []


def test_once_hedges_joined_the_oldest_stale_starts_past_max_workers_are_given_up():
    policy = ScalingPolicy(settings(min_workers=2, max_workers=3, start_timeout_s=30.0))
    pending = [PendingView("slow", "n3", 5.0), PendingView("hung", "n2", 0.0)]
    # the hedge joined: 2 stay, 2 still starting, one too many for max_workers=3
    assert [p.key for p in policy.surplus(pending, staying=2, now=21.0)] == ["hung"]
    # below min_workers nothing is given up for a hedge, even past max_workers: a slow
    # start may still be the first to arrive
    assert policy.surplus([*pending, PendingView("hedge", "n4", 20.0),
                           PendingView("hedge2", "n5", 20.0)], staying=1, now=21.0) == []
    # a start not yet stale is never given up on for this
    assert policy.surplus(pending, staying=3, now=10.0) == []


def test_members_on_draining_nodes_do_not_hold_back_min_workers_staying_ones():
    policy = ScalingPolicy(settings(min_workers=2, max_workers=3))
    usable = {"n5": 2, "n6": 2}
    # 3 members, all on draining nodes (kept: they alone hold the state): max_workers is
    # full, but none stays, so 2 replacements start to take the state over
    assert policy.starts(usable, members=3, pending=0) == []
    assert policy.starts(usable, members=3, pending=0, staying=0) == ["n5", "n5"]
    assert policy.starts(usable, members=3, pending=1, staying=0) == ["n5"]
    # enough stay: max_workers bounds the starts as before
    assert policy.starts(usable, members=3, pending=0, staying=2) == []


def test_a_node_where_a_worker_did_not_start_is_a_last_resort_until_one_does():
    gave_up = [(10.0, "n1", "it did not start within start_timeout_s=30s"),
               (12.0, "n2", "its actor died while starting: boom"),
               (14.0, "n3", "its node left the cluster"),  # not the node's starts
               (50.0, "n2", "it did not start within start_timeout_s=30s")]
    # n1 failed long ago and has not started a worker since: still a last resort;
    # n2 started one at 20 s, then failed again at 50 s
    assert last_resort_nodes(gave_up, started=[(20.0, "n2")]) == {"n1": 10.0, "n2": 50.0}
    assert last_resort_nodes(gave_up, started=[(20.0, "n2"), (60.0, "n2"),
                                               (11.0, "n1")]) == {}
    assert last_resort_nodes([], started=[]) == {}


def test_the_last_resort_given_up_on_longest_ago_goes_first():
    policy = ScalingPolicy(settings(min_workers=2, max_workers=3))
    usable = {"n4": 1, "n7": 1, "n9": 1}
    # n4 and n7 keep failing (their starts never end); n9 failed once, long ago
    assert policy.starts(usable, 1, 0, last_resort={"n4": 208.0, "n7": 220.0,
                                                     "n9": 111.0}) == ["n9", "n4"]


def test_the_state_is_lost_once_no_staying_worker_holds_it():
    assert not state_lost(["a", "b"], holders=[], committed=False)  # a fresh start
    assert not state_lost(["a", "n"], holders=["a"], committed=True)  # a holds it
    assert state_lost(["n", "m"], holders=["a"], committed=True)  # only newcomers left
    assert state_lost([], holders=["a"], committed=True)
    error = state_lost_error("rank 0 failed:\nthe worker process exited", workers_lost=5)
    assert "every worker that held the job's committed state was lost" in str(error)
    assert "5 workers failed" in str(error) and "the worker process exited" in str(error)


# ----------------------------------------------------------------------------- the log
def test_one_event_log_gives_the_history_cooldowns_and_give_ups():
    clock = Clock()
    log = EventLog(clock)
    log.add("place", "n1")
    clock.now += 1
    log.add("failure", "n1", cooldown_s=2.5)
    log.add("gave_up", "n2", why="its node left the cluster")
    log.note("failure", failed=1)
    entry = log.record_round(1, size=2, hosts=1, starting=0, requested=0, draining_nodes=0)
    assert entry["round"] == 1 and entry["reason"] == "failure+start" and entry["failed"] == 1
    assert [e.kind for e in log.events] == ["place", "failure", "gave_up", "round"]
    assert log.cooldowns == [("n1", 1001.0, 2.5)]
    assert log.gave_up == [(1001.0, "n2", "its node left the cluster")]
    assert log.history == [entry] and log.of("round")[0].detail == {**entry, "reset": False}
    t, kind, host = log.events[0]  # events read as the (time, kind, host) tuples they were
    assert (t, kind, host) == (1000.0, "place", "n1") and log.events[0][1] == "place"
    assert not log.is_reset()  # nothing since the round
    log.note("drain")
    assert not log.is_reset()  # a drain alone is no reset
    log.note("failure")
    assert log.is_reset()
    with pytest.raises(ValueError, match="unknown event kind"):
        log.add("exploded")


def test_every_field_of_the_job_context_has_one_writer():
    """The elastic job's collaborators return what they decided to the loop; none sets a
    field of the shared `JobContext` that another module sets too (`ctx.needs_round` was
    written from four modules)."""
    import ast
    from pathlib import Path

    folder = Path(__file__).resolve().parents[2] / "raytrain_x" / "ray" / "elastic"
    writers: dict[str, set[str]] = {}
    for path in folder.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = (node.targets if isinstance(node, ast.Assign) else
                       [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            for target in targets:
                while isinstance(target, ast.Subscript):  # ctx.round_members[r] = ...
                    target = target.value
                if isinstance(target, ast.Attribute) and (
                        (isinstance(target.value, ast.Name) and target.value.id == "ctx") or
                        (isinstance(target.value, ast.Attribute) and target.value.attr == "ctx")):
                    writers.setdefault(target.attr, set()).add(path.name)
    assert writers, "no writes to the context found: the test no longer sees them"
    assert {f: w for f, w in writers.items() if len(w) > 1} == {}


def test_newcomers_started_together_join_in_one_round_within_the_window():
    """One added host with two slots cost two resets: its first worker to arrive asked the
    survivors over while the second was still starting."""
    # the second of the batch (asked at 10.2) still starting: hold
    assert holds_newcomers([10.0], [10.2], waiting_since=15.0, now=16.0)
    # ... but never past the window (the survivors are interrupted with who is there)
    assert not holds_newcomers([10.0], [10.2], waiting_since=15.0, now=25.0)
    # a start asked long before (a slow one, being hedged) is not of the batch
    assert not holds_newcomers([10.0], [2.0], waiting_since=15.0, now=16.0)
    # a later scale-up is not either: it joins at the round after
    assert not holds_newcomers([10.0], [14.0], waiting_since=15.0, now=16.0)
    # nobody waits: nothing to hold; everybody of the batch there: go
    assert not holds_newcomers([], [10.2], waiting_since=15.0, now=16.0)
    assert not holds_newcomers([10.0, 10.2], [], waiting_since=15.0, now=16.0)
    # how many of the batch the newcomers wait on: the driver is woken as they arrive
    assert batch_awaited([10.0], [10.2, 10.5, 2.0, 14.0], waiting_since=15.0, now=16.0) == 2
    assert batch_awaited([10.0], [10.2], waiting_since=15.0, now=25.0) == 0


def test_a_worker_that_failed_before_its_first_round_is_not_rank_minus_one():
    """A script's import error in an elastic job was reported as "rank -1 failed"."""
    from raytrain_x.common.errors import WorkerError

    assert str(WorkerError(-1, "ModuleNotFoundError: x")).startswith(
        "a worker (before it joined a round) failed:")
    assert str(WorkerError(3, "boom")).startswith("rank 3 failed:")
