"""Policies a user injects into an elastic job (`RayExecutor(policies=[...])`, the elastic
trainer's `policies=`): what they are shown of the job each look, and what they may decide.

A policy is any object with `decide(job: JobSnapshot) -> list[Leave]`. The driver shows it
the members of the current round as plain values (their work per step, measured by each
worker and carried by the heartbeat) every few seconds, and carries out what it returns: a
worker that must `Leave` goes at its next commit, as a worker on a draining node does
(nothing is restored or redone; the others form the next round without it), and its host
takes no new worker for the decision's cooldown. `SlowWorkers` (`slow_workers.py`) is one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class WorkerSample:
    """What a policy is shown of one member of the current round."""

    worker_id: str
    node: str
    rank: int
    # the median of its own work per step in this round (from the end of its last step to
    # its optimizer's step, where it waits for its peers), and over how many steps
    work_s: float
    work_steps: int


@dataclass(frozen=True)
class JobSnapshot:
    """One look at the job: the members of its current round that stay (none leaving),
    the job's `min_workers`, its round number and the driver's clock."""

    members: tuple[WorkerSample, ...]
    min_workers: int
    round: int
    now: float


@dataclass(frozen=True)
class Leave:
    """`worker_id` leaves the job at its next commit, for `reason` (logged, and recorded in
    the job's events); its host takes no new worker for `cooldown_s` seconds."""

    worker_id: str
    reason: str
    cooldown_s: float = 0.0


@runtime_checkable
class DriverPolicy(Protocol):
    """Decides, from one look at the job, which workers leave it."""

    def decide(self, job: JobSnapshot) -> list[Leave]:
        ...
