"""What the elastic job's collaborators share: its settings, clock and parts, the event log,
the blacklist and what it knows of its rounds. One `JobContext` per job; the loop
(`job.ElasticJob`) and each collaborator (`member_watch`, `worker_starts`, `drain_watch`,
`round_forming`) read it; a collaborator returns what it decided to the loop rather than
setting a flag another reads (`needs_round`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from raytrain_x.common.errors import WorkerError
from raytrain_x.ray.elastic.blacklist import Blacklist
from raytrain_x.ray.elastic.events import EventLog
from raytrain_x.ray.elastic.parts import JobParts
from raytrain_x.ray.elastic.pool import Member, Pending
from raytrain_x.ray.elastic.settings import ElasticSettings


@dataclass
class JobContext:
    """One elastic job's shared state (everything but its policies' own)."""

    settings: ElasticSettings
    clock: Callable[[], float]
    parts: JobParts
    log: EventLog
    blacklist: Blacklist
    rounds: int = 0  # the rounds formed so far (the latest's id)
    # a change the next round must take in; the loop (`ElasticJob.run`) alone writes it,
    # from what each collaborator returns
    needs_round: bool = True
    last_failure: WorkerError | None = None
    draining: dict[str, float] = field(default_factory=dict)  # node -> deadline (wall clock)
    # why a node in `draining` is there, where Ray is not draining it ("left host discovery",
    # "is blacklisted")
    leave_reasons: dict[str, str] = field(default_factory=dict)
    round_newcomers: list[str] = field(default_factory=list)  # first round is the latest
    # each round's members, from the last that committed on
    round_members: dict[int, set[str]] = field(default_factory=dict)

    @property
    def pool(self) -> Any:
        return self.parts.pool

    @property
    def cluster(self) -> Any:
        return self.parts.cluster

    @property
    def rounds_client(self) -> Any:
        return self.parts.rounds

    @property
    def store(self) -> Any:
        return self.parts.store

    @property
    def members(self) -> dict[str, Member]:
        return self.pool.members

    @property
    def pending(self) -> dict[Any, Pending]:
        return self.pool.pending

    def staying(self) -> list[Member]:
        """The members whose node is not draining."""
        return self.pool.staying(set(self.draining))
