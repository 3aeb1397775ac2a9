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
    """What a policy is shown of one member of the current round.

    Attributes:
        worker_id: the member's id (what a `Leave` names).
        node: the Ray node it runs on.
        rank: its rank in the current round.
        work_s: the median of its own work per step in this round: each step's duration
            less the time it waited for collectives (its peers).
        work_steps: how many steps `work_s` is of (0: none measured yet).
    """

    worker_id: str
    node: str
    rank: int
    work_s: float
    work_steps: int


@dataclass(frozen=True)
class JobSnapshot:
    """One look at the job.

    Attributes:
        members: the members of its current round that stay (none leaving), by rank.
        min_workers: the fewest workers the job trains with.
        round: the current round's number.
        now: the driver's clock (monotonic seconds).
    """

    members: tuple[WorkerSample, ...]
    min_workers: int
    round: int
    now: float


@dataclass(frozen=True)
class Leave:
    """A decision: a worker leaves the job at its next commit.

    Attributes:
        worker_id: the worker (`WorkerSample.worker_id`).
        reason: why, logged and recorded in the job's events (`asked_to_leave`).
        cooldown_s: its host takes no new worker for this long.
    """

    worker_id: str
    reason: str
    cooldown_s: float = 0.0


@runtime_checkable
class DriverPolicy(Protocol):
    """Decides, from one look at the job, which workers leave it."""

    def decide(self, job: JobSnapshot) -> list[Leave]:
        ...
