"""The simulated `ElasticRounds` actor: a worker's join waits there until the driver
publishes its place in a round (or sends it away)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from raytrain_x.testing.simulation.model import RPC_S, Group, SimWorker


class RoundsWorld(Protocol):
    """What the rounds actor calls on the world (`World` through its `WorkerSide`)."""

    def after(self, delay: float, fn: Callable[[], None]) -> None: ...
    def violation(self, text: str) -> None: ...
    def placed_delay(self) -> float: ...
    def placed(self, w: SimWorker, place: dict[str, Any]) -> None: ...
    def sent_away(self, w: SimWorker, leaving: set[str]) -> None: ...
    def rendezvous_published(self, group: Group) -> None: ...


class SimRounds:
    """The `ElasticRounds` actor: joins wait until the driver publishes their place."""

    def __init__(self, world: RoundsWorld) -> None:
        self.world = world
        self.waiting: dict[str, SimWorker] = {}
        self.version = 0
        self.error: str | None = None
        self.committed_round = 0
        self.state_rounds: dict[str, int] = {}  # as workers report them at their joins
        self.checkpoint_asked = False  # the driver asked for a durable checkpoint
        self.dead = False  # the actor died (a fault): nothing it is asked is answered

    def join(self, w: SimWorker) -> None:
        if self.dead:
            return  # the call fails; the driver ends the worker when it learns
        if self.error:
            self.world.after(RPC_S, lambda: self.world.placed(w, {"error": self.error}))
            return
        self.state_rounds[w.worker_id] = w.state_round
        self.waiting[w.worker_id] = w  # a dead worker's join stays, as with a real actor

    def gone(self, w: SimWorker) -> None:
        """A process ended: nothing to do (the real actor does not know either)."""

    def publish(self, assignments: dict[str, dict[str, Any]]) -> None:
        world = self.world
        rounds = {p["round"] for p in assignments.values() if "round" in p}
        for round_id in rounds:
            ranks = {w: p["rank"] for w, p in assignments.items() if p.get("round") == round_id}
            sizes = {p["size"] for p in assignments.values() if p.get("round") == round_id}
            if sorted(ranks.values()) != list(range(len(ranks))) or sizes != {len(ranks)}:
                world.violation(f"round {round_id} ranks {sorted(ranks.values())}, sizes "
                                f"{sorted(sizes)}: not 0..n-1 of n")
            version = next(p["hosts_version"] for p in assignments.values()
                           if p.get("round") == round_id)
            places = [p for p in assignments.values() if p.get("round") == round_id]
            restore = any(p.get("restore_from_storage") for p in places)
            named = {tuple(p["restore_checkpoint"]) for p in places
                     if p.get("restore_checkpoint") is not None}
            if len(named) > 1:
                world.violation(f"round {round_id}'s members were told to restore different "
                                f"checkpoints: {sorted(named)}")
            world.rendezvous_published(Group(round_id, ranks, version,
                                             restore_from_storage=restore,
                                             restore_checkpoint=min(named, default=None),
                                             store=world.store_epoch))
        leaving = {w for w, p in assignments.items() if p.get("leave")}
        for worker_id, place in assignments.items():
            w = self.waiting.pop(worker_id, None)
            if w is not None and place.get("leave"):
                world.sent_away(w, leaving)
            if w is None:
                if "round" in place:
                    world.violation(f"{worker_id} given a place in round {place['round']} "
                                    "without waiting for one")
                continue
            w.placed_in = place.get("round")
            world.after(world.placed_delay(), lambda w=w, p=place: world.placed(w, p))

    def fail(self, message: str) -> None:
        self.error = message
        for w in self.waiting.values():
            self.world.after(RPC_S, lambda w=w: self.world.placed(w, {"error": message}))
        self.waiting.clear()

    def commit(self, round_id: int) -> tuple[int, bool]:
        self.committed_round = max(self.committed_round, round_id)
        asked, self.checkpoint_asked = self.checkpoint_asked, False
        return self.version, asked
