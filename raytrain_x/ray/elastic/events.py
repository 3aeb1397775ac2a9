"""The elastic job's one event log (pure, no Ray): every placement, start, give-up,
failure, departure, drain and round, in order, with what each decided. The round history,
the hosts' cooldowns and the give-ups are views of it."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from raytrain_x.ray.elastic.history import RoundHistory

KINDS = ("place", "start", "gave_up", "failure", "lost_draining", "left", "drain",
         "abandoned", "scale_up", "round", "restore_storage", "checkpoint_asked",
         "asked_to_leave")


@dataclass(frozen=True)
class Event:
    time: float  # the clock's seconds (time.monotonic by default)
    kind: str  # one of KINDS
    host: str = ""  # the node it happened on ("" for the job as a whole)
    detail: dict[str, Any] = field(default_factory=dict)

    def __iter__(self) -> Iterator[Any]:  # (time, kind, host), as the log's old tuples
        return iter((self.time, self.kind, self.host))

    def __getitem__(self, i: int) -> Any:
        return (self.time, self.kind, self.host)[i]


class EventLog:
    """Appends events and keeps the round history they add up to.

    Args:
        clock: time source (tests pass a fake one).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.events: list[Event] = []
        self.rounds = RoundHistory(clock)
        self.listeners: list[Callable[[Event], None]] = []  # told of each event (metrics)

    def add(self, kind: str, host: str = "", **detail: Any) -> Event:
        if kind not in KINDS:
            raise ValueError(f"unknown event kind {kind!r}; one of {KINDS}")
        event = Event(self.clock(), kind, host, detail)
        self.events.append(event)
        for listener in self.listeners:
            listener(event)
        return event

    def of(self, kind: str) -> list[Event]:
        return [e for e in self.events if e.kind == kind]

    # --- the round history: what the next round answers, and one entry per round
    def note(self, reason: str, joined: int = 0, failed: int = 0, left: int = 0) -> None:
        self.rounds.note(reason, joined, failed, left)

    def is_reset(self) -> bool:
        return self.rounds.is_reset()

    def restoring(self, checkpoint: dict[str, Any]) -> None:
        """The next round restores from a durable checkpoint: no worker holds the state."""
        self.rounds.note("restore")
        self.rounds.restoring = checkpoint
        self.add("restore_storage", "", **checkpoint)

    def record_round(self, round_id: int, size: int, hosts: int, starting: int,
                     requested: int, draining_nodes: int) -> dict[str, Any]:
        reset = self.rounds.is_reset()
        entry = self.rounds.record(round_id, size, hosts, starting, requested, draining_nodes)
        self.add("round", "", **entry, reset=reset)
        return entry

    # --- views
    @property
    def history(self) -> list[dict[str, Any]]:
        """One entry per round: why it formed and the cluster's shape."""
        return self.rounds.entries

    @property
    def cooldowns(self) -> list[tuple[str, float, float]]:
        """(host, failed at, seconds blacklisted) per failure that blacklisted a host."""
        return [(e.host, e.time, e.detail["cooldown_s"]) for e in self.of("failure")]

    @property
    def gave_up(self) -> list[tuple[float, str, str]]:
        """(time, host, why) per worker given up on while it started."""
        return [(e.time, e.host, e.detail["why"]) for e in self.of("gave_up")]
