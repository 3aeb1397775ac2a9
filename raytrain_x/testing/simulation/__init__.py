"""A deterministic simulation of the elastic job: the real controller, policies, event log
and round planning against simulated nodes, workers, rounds, store and autoscaler, on one
virtual clock with one seeded generator (`python -m raytrain_x.testing.simulate`)."""

from raytrain_x.testing.simulation.model import WorldConfig
from raytrain_x.testing.simulation.runner import Outcome, recovery_bound, run_schedule
from raytrain_x.testing.simulation.scenarios import scenarios
from raytrain_x.testing.simulation.schedules import Fault, Schedule, random_schedule
from raytrain_x.testing.simulation.world import World

__all__ = ["Fault", "Outcome", "Schedule", "World", "WorldConfig", "random_schedule",
           "recovery_bound", "run_schedule", "scenarios"]
