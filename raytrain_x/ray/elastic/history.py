"""The elastic driver's round history: why each round formed and the cluster's shape."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

REASONS = ("start", "scale_up", "failure", "drain", "policy", "restore")


class RoundHistory:
    """Collects what happened since the last round (why a new one is needed, who joined,
    failed or left) and records one entry per round.

    Args:
        clock: time source (tests pass a fake one).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.started = clock()
        self.entries: list[dict[str, Any]] = []
        self.reasons: set[str] = {"start"}
        self.since_round = {"joined": 0, "failed": 0, "left": 0}
        # the durable checkpoint the next round restores from (no worker holds the state)
        self.restoring: dict[str, Any] | None = None

    def note(self, reason: str, joined: int = 0, failed: int = 0, left: int = 0) -> None:
        """Something the next round answers: `reason` is one of REASONS."""
        self.reasons.add(reason)
        self.since_round["joined"] += joined
        self.since_round["failed"] += failed
        self.since_round["left"] += left

    def is_reset(self) -> bool:
        """Whether the next round counts against `reset_limit`: any round after the first,
        unless only drains or a driver policy's leaves led to it (their workers left at a
        commit, nothing failed)."""
        return bool(self.entries) and bool(self.reasons - {"drain", "policy", "start"})

    def record(self, round_id: int, size: int, hosts: int, starting: int, requested: int,
               draining_nodes: int) -> dict[str, Any]:
        """Appends the round's entry and starts collecting for the next one."""
        entry = {
            "round": round_id,
            "time_s": round(self.clock() - self.started, 3),
            "size": size,
            "hosts": hosts,
            "reason": "+".join(sorted(self.reasons)),
            **self.since_round,
            "starting": starting,
            "requested": requested,
            "draining_nodes": draining_nodes,
            "restored_from": self.restoring,
        }
        self.entries.append(entry)
        self.reasons = set()
        self.since_round = {"joined": 0, "failed": 0, "left": 0}
        self.restoring = None
        return entry


def round_line(entry: dict[str, Any]) -> str:
    """The progress line a round prints."""
    asked = (f", asking the autoscaler for room for {entry['requested']}"
             if entry["requested"] else "")
    return (f"round {entry['round']} at {entry['time_s']:.1f}s: {entry['size']} workers on "
            f"{entry['hosts']} host(s) ({entry['reason']}); {entry['starting']} "
            f"starting{asked}{_restored(entry.get('restored_from'))}")


def _restored(checkpoint: dict[str, Any] | None) -> str:
    if checkpoint is None:
        return ""
    return (f"; no worker holds the state: restoring from durable checkpoint "
            f"{checkpoint['number']} ({checkpoint['describe']})")
