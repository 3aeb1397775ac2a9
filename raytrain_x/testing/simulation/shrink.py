"""Shrinking a failing schedule to a minimal one with Hypothesis.

Hypothesis searches the subsets of the schedule's faults (one boolean per fault: kept or
dropped) for ones that still fail, and shrinks the one it finds towards fewer faults, as
it shrinks any example; a fault names its target by a fraction of the candidates when it
fires, so a subset is a meaningful schedule on its own."""

from __future__ import annotations

from raytrain_x.testing.simulation.runner import run_schedule
from raytrain_x.testing.simulation.schedules import Schedule


def shrink(schedule: Schedule, max_examples: int = 300) -> Schedule:
    """The smallest subset of `schedule`'s faults Hypothesis finds that still violates an
    invariant (the schedule itself when it finds none smaller)."""
    try:
        from hypothesis import HealthCheck, Phase, find, settings
        from hypothesis import strategies as st
        from hypothesis.errors import NoSuchExample
    except ImportError:  # the `dev` extra brings it
        print("(install hypothesis to shrink failing schedules: pip install hypothesis)")
        return schedule
    outcome = run_schedule(schedule)
    if not schedule.faults or outcome.ok:
        return schedule
    # Faults after the first violation could not have caused it; without them the run is
    # the same up to there (a fault draws nothing before it fires), which this checks.
    before = [f.at <= outcome.first_violation_at for f in schedule.faults]
    if not all(before) and not run_schedule(schedule.without(before)).ok:
        schedule = schedule.without(before)
    n = len(schedule.faults)

    def fails(keep: list[bool]) -> bool:
        return not run_schedule(schedule.without(keep)).ok

    try:
        keep = find(st.lists(st.booleans(), min_size=n, max_size=n), fails,
                    settings=settings(max_examples=max_examples, database=None,
                                      derandomize=True, deadline=None,
                                      phases=[Phase.generate, Phase.shrink],
                                      suppress_health_check=list(HealthCheck)))
    except NoSuchExample:
        return schedule
    return schedule.without(keep)
