"""The elastic job in the deterministic simulator: the real controller and policies against
simulated nodes, workers, rounds, store and autoscaler on a virtual clock
(`raytrain_x.testing.simulation`). Each named scenario is a fault pattern a real cluster
or the simulator found; each fix the simulator led to fails its scenario when the old
behaviour is put back (`elastic_reverts`)."""

from __future__ import annotations

import os
import re
import sys
from dataclasses import replace

import pytest

from raytrain_x.ray.elastic import round_forming
from raytrain_x.testing import simulate
from raytrain_x.testing.simulation import (
    Fault,
    Schedule,
    WorldConfig,
    random_schedule,
    run_schedule,
    scenarios,
)
from raytrain_x.testing.simulation.shrink import shrink
from tests import background
from tests.conftest import REPO
from tests.unit.elastic_reverts import REVERTS

SUITE_SEED = 1_000_000  # the suite's seeds: SUITE_SEED .. SUITE_SEED + SUITE_SCHEDULES
SUITE_SCHEDULES = 300


@pytest.mark.parametrize("name", sorted(scenarios()))
def test_every_named_scenario_holds_every_invariant(name):
    outcome = run_schedule(scenarios()[name])
    assert outcome.ok, outcome.violations
    assert outcome.stop in ("finished", "ElasticStateLost", "ControlActorLost"), outcome.stop


def test_the_driver_reads_joins_in_the_order_the_rounds_actor_serves_them(monkeypatch):
    """The rounds actor lists one join at a time (`WorldConfig.join_call_s`) and answers
    the driver's calls in arrival order, so a join the driver does not see listed has not
    reached the actor. Were the driver's calls answered ahead of the queued joins, its
    held-join rule (3 s in a join, unlisted) would restart workers whose joins were only
    queued: the slow-actor scenario then fails."""
    from raytrain_x.testing.simulation import parts

    schedule = scenarios()["joins-queued-at-a-slow-rounds-actor"]
    assert run_schedule(schedule).ok

    def ahead_of_the_joins(self):
        if self.rounds.dead:
            raise parts.ControlActorLost("killed")
        return self.rounds
    monkeypatch.setattr(parts.SimRoundsClient, "_actor", ahead_of_the_joins)
    outcome = run_schedule(schedule)
    assert any("whose join the rounds actor had received" in v for v in outcome.violations)


def test_losing_every_holder_stops_the_job_naming_it():
    outcome = run_schedule(scenarios()["3-every-holder-dies"])
    assert outcome.ok and outcome.stop == "ElasticStateLost"


def test_the_drain_then_kill_pattern_recovers_within_the_timeout():
    """The hang of real runs: a drain, then rank 0's node killed as the drain's round
    connected. The survivor's connect to the dead peer fails within the job's timeout
    (30 s here, as in the real test), and the job re-forms and ends."""
    outcome = run_schedule(scenarios()["drain-then-kill"], keep_trace=True)
    assert outcome.ok and outcome.stop == "finished", outcome.violations
    trace = "\n".join(outcome.trace)
    assert "draining" in trace and "killed" in trace and "refused the connect" in trace
    (recovery,) = outcome.recoveries["node_kill_in_connect"]
    assert recovery < scenarios()["drain-then-kill"].config.timeout_s + 5


def test_with_torchs_own_connect_tries_the_drain_then_kill_pattern_hangs():
    """torch tries a gloo connect 5 times, each with the group's timeout: modelled so, the
    same schedule holds the survivor 150 s, and the watchdog reports the hang the real
    test showed (no round for 120 s and more)."""
    schedule = scenarios()["drain-then-kill"]
    config = replace(schedule.config, connect_wait_s=5 * schedule.config.timeout_s)
    outcome = run_schedule(replace(schedule, config=config))
    assert outcome.stop == "hang"
    assert any("liveness: no commit" in v for v in outcome.violations), outcome.violations


def test_a_round_that_fails_for_every_member_at_once_forms_again():
    """Every member times out of its round together (a partition longer than the
    collective timeout stalls the round for all): with no member absent from the
    rendezvous the driver still forms the next round, and the job commits again."""
    config = WorldConfig(nodes=3, max_nodes=3, autoscaler=False, respawn=False,
                         timeout_s=5.0)
    outcome = run_schedule(Schedule(3, config, (Fault(6.0, "partition", 0.0, 8.0),)),
                           keep_trace=True)
    assert outcome.ok and outcome.stop == "finished", outcome.violations
    timed_out = [line for line in outcome.trace if "collective timed out" in line]
    assert len(timed_out) == 3, outcome.trace  # every member at once
    at = float(timed_out[0].split()[0])
    rounds = [line for line in outcome.trace if "driver: " in line and " round " in line]
    assert any(float(line.split(" at ")[1].split("s:")[0]) > at for line in rounds), rounds


@pytest.mark.parametrize("name", sorted(n for n in REVERTS if n in scenarios()))
def test_each_fix_fails_its_scenario_with_the_old_behaviour(name, monkeypatch):
    REVERTS[name](monkeypatch)
    outcome = run_schedule(scenarios()[name])
    assert not outcome.ok, f"{name} passed with the old behaviour put back"


def test_one_seed_is_one_history():
    first = run_schedule(random_schedule(SUITE_SEED + 7), keep_trace=True)
    again = run_schedule(random_schedule(SUITE_SEED + 7), keep_trace=True)
    assert first.trace == again.trace and first.commits == again.commits
    assert len(first.trace) > 20


def test_random_schedules_have_at_least_the_faults_asked_for():
    for seed in range(20):
        schedule = random_schedule(seed, faults=20)
        assert len(schedule.faults) >= 20
        assert [f.at for f in schedule.faults] == sorted(f.at for f in schedule.faults)


def test_the_watchdog_reports_a_job_that_stops_forming_rounds(monkeypatch):
    """A planted hang: after its second round the driver never forms another. The
    liveness check names it, and the run ends instead of spinning."""
    decide = round_forming.decide_round

    def stuck(waiting, members, *args, **kwargs):
        decision = decide(waiting, members, *args, **kwargs)
        if stuck.rounds >= 2 and decision.form:
            return decision.__class__(decision.leave, False, [])
        stuck.rounds += decision.form
        return decision
    stuck.rounds = 0
    monkeypatch.setattr(round_forming, "decide_round", stuck)
    config = WorldConfig(nodes=3, max_nodes=3, autoscaler=False)
    outcome = run_schedule(Schedule(5, config, (Fault(8.0, "kill_worker", 0.0),)))
    assert outcome.stop == "hang"
    assert any("liveness: no commit" in v for v in outcome.violations), outcome.violations


def test_a_failing_schedule_shrinks_to_the_faults_that_matter(monkeypatch):
    """With an old behaviour put back, a random schedule that fails shrinks (Hypothesis)
    to a few faults that still fail."""
    REVERTS["drained-holder-kept"](monkeypatch)
    failing = next(s for s in (random_schedule(seed) for seed in range(200))
                   if not run_schedule(s).ok)
    small = shrink(failing, max_examples=150)
    assert len(small.faults) < len(failing.faults) / 2, small.describe()
    assert not run_schedule(small).ok


def test_the_command_prints_the_shrunk_schedule_and_exits_1(monkeypatch, capsys):
    REVERTS["drained-holder-kept"](monkeypatch)
    monkeypatch.setenv("PYTHONHASHSEED", "0")  # run in this process (no re-exec)
    code = simulate.main(["--schedules", "5", "--seed", "30", "--jobs", "1",
                          "--no-scenarios"])  # seed 34 fails so
    out = capsys.readouterr().out
    assert code == 1
    assert "shrunk from" in out and "--only '" in out, out[-2000:]
    assert re.search(r"^simulated 5 schedules \(\d+ faults, [\d.]+ virtual hours\) in \d+ s: "
                     r"[1-9]\d* violations$", out.strip().splitlines()[-1]), out[-500:]


background.register(
    "simulation-share",
    [sys.executable, "-m", "raytrain_x.testing.simulate", "--schedules", str(SUITE_SCHEDULES),
     "--seed", str(SUITE_SEED), "--jobs", "1"],
    cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})


@pytest.mark.timeout(300)
@pytest.mark.background("simulation-share")
def test_the_suites_share_of_random_schedules_holds_every_invariant():
    """A fixed set of seeds, through the command as a user runs it (its own process, hash
    seed fixed), run beside the other tests from the start of the session
    (tests/background.py). The full soak is `make soak-sim`."""
    out = background.result("simulation-share", work_s=60)
    last = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert re.fullmatch(r"simulated \d+ schedules \(\d+ faults, [\d.]+ virtual hours\) in \d+ "
                        r"s: 0 violations", last), last
    faults = int(re.search(r"\((\d+) faults", last).group(1))
    assert faults >= 10 * SUITE_SCHEDULES  # those that met a running job


def test_the_jobs_end_does_not_wait_for_a_newcomer_on_its_way_to_a_round():
    """A worker that started and waits for its first round when the job finishes never
    finishes (no round forms after the end): the job's end waited `timeout_s` for it (26 s
    here, against 16 s now). It is stopped with the job."""
    config = WorldConfig(nodes=2, max_nodes=3, max_workers=3, commit_s=5.0,
                         start_s=(0.5, 0.5), autoscaler=False, respawn=False)
    outcome = run_schedule(Schedule(0, config, (Fault(12.0, "add_node"),), tail_s=0.5),
                           keep_trace=True)
    assert outcome.ok and outcome.stop == "finished", outcome.violations
    started = [line for line in outcome.trace if "w2@n3 started" in line]
    assert started and float(started[0].split()[0]) < 15.0, outcome.trace  # before the end
    assert outcome.virtual_s < 16.0 + config.timeout_s / 2, outcome.virtual_s
