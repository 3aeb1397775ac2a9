"""What the elastic job's policies are shown of its workers (plain, frozen data)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PendingView:
    """A worker asked for and not answering yet."""

    key: object
    node: str
    asked_at: float


@dataclass(frozen=True)
class MemberView:
    worker_id: str
    node: str
    leaving: bool = False
    in_round: bool = False  # it was given a place in a round (not a newcomer still starting)
    # its node drains and a round formed without it: its state is behind that round's
    departed: bool = False
    # a driver policy asked it to leave (`Leave`): it goes as if its node drained
    asked_to_leave: bool = False

    def drains(self, draining: set[str]) -> bool:
        """It goes at its next commit: its node is `draining`, or a policy asked it to."""
        return self.asked_to_leave or self.node in draining
