"""The simulator's rounds actor answers every message as the real `ElasticRounds` does.

Every call a worker or the driver makes to the rounds actor (a worker's `join` and
`commit`; the driver's `waiting`, `publish`, `bump_hosts`, `hosts_version`,
`ask_checkpoint`, `fail`, `committed_round`, `committed`, `holders`) is made, in the same
random order, to the real actor's class (run on an asyncio loop, without Ray) and to the
simulator's (`raytrain_x.testing.simulation.rounds.SimRounds`, through what its driver
client does). After every call the two must agree on its answer, on who waits, and on how
each join ended (its place in a round, sent away, or the job's error)."""

from __future__ import annotations

import asyncio
import random
from typing import Any

from raytrain_x.common.errors import ElasticJobStopped
from raytrain_x.ray.elastic.rounds import ElasticRounds, current_holders
from raytrain_x.testing.simulation.model import SimWorker
from raytrain_x.testing.simulation.rounds import SimRounds

WORKERS = [f"w{i}" for i in range(6)]


class _World:
    """What the simulated actor calls on its world: its answers land at once."""

    store_epoch = 0

    def __init__(self) -> None:
        self.ended: dict[str, Any] = {}
        self.violations: list[str] = []

    def after(self, delay: float, fn) -> None:
        fn()

    def violation(self, text: str) -> None:
        self.violations.append(text)

    def placed_delay(self) -> float:
        return 0.0

    def placed(self, w: SimWorker, place: dict[str, Any]) -> None:
        self.ended[w.worker_id] = ("error", place["error"]) if "error" in place else \
            ("place", place)

    def sent_away(self, w: SimWorker, leaving: set[str]) -> None:
        pass

    def rendezvous_published(self, group: Any) -> None:
        pass


class _Both:
    """The real actor and the simulated one, called alike."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.real = ElasticRounds.__ray_metadata__.modified_class()
        self.world = _World()
        self.sim = SimRounds(self.world)
        self.joins: dict[str, asyncio.Task] = {}  # the real joins, as tasks
        self.real_ended: dict[str, Any] = {}

    def close(self) -> None:
        for task in self.joins.values():
            task.cancel()
        self.loop.run_until_complete(asyncio.sleep(0))
        self.loop.close()

    def call(self, method: str, *args: Any) -> Any:
        result = self.loop.run_until_complete(getattr(self.real, method)(*args))
        self._settle()
        return result

    def _settle(self) -> None:
        self.loop.run_until_complete(asyncio.sleep(0))
        for worker_id, task in list(self.joins.items()):
            if task.done():
                del self.joins[worker_id]
                exc = task.exception()
                self.real_ended[worker_id] = (("error", str(exc))
                                              if isinstance(exc, ElasticJobStopped)
                                              else ("place", task.result()))

    # ---------------------------------------------------------------- the messages
    def join(self, worker_id: str, state_round: int) -> None:
        self.joins[worker_id] = self.loop.create_task(self.real.join(worker_id, state_round))
        self._settle()
        w = SimWorker(0, None)
        w.worker_id, w.state_round = worker_id, state_round
        self.sim.join(w)

    def commit(self, round_id: int) -> tuple[Any, Any]:
        return self.call("commit", round_id), self.sim.commit(round_id)

    def publish(self, assignments: dict[str, dict[str, Any]]) -> None:
        self.call("publish", assignments)
        self.sim.publish(assignments)

    def bump_hosts(self) -> tuple[Any, Any]:
        self.sim.version += 1  # what the simulated driver's client does
        return self.call("bump_hosts"), self.sim.version

    def ask_checkpoint(self) -> None:
        self.call("ask_checkpoint")
        self.sim.checkpoint_asked = True

    def fail(self, message: str) -> None:
        self.call("fail", message)
        self.sim.fail(message)

    def views(self) -> tuple[Any, Any]:
        """What the driver reads, from each."""
        real = (sorted(self.call("waiting")), self.call("hosts_version"),
                self.call("committed_round"), self.call("committed"), self.call("holders"))
        sim = (sorted(self.sim.waiting), self.sim.version, self.sim.committed_round,
               self.sim.committed_round > 0,
               current_holders(self.sim.state_rounds, self.sim.committed_round))
        return real, sim


def _step(both: _Both, rng: random.Random, next_round: list[int]) -> str:
    """One random message; returns what it was."""
    waiting = sorted(both.sim.waiting)
    kind = rng.choice(["join", "join", "join", "publish", "publish", "commit", "bump",
                       "ask", "fail" if rng.random() < 0.05 else "join"])
    if kind == "join":
        idle = [w for w in WORKERS if w not in both.sim.waiting]
        if not idle:
            return "none"
        worker_id = rng.choice(idle)
        both.join(worker_id, rng.choice([0, max(0, next_round[0] - 1), next_round[0]]))
        return f"join {worker_id}"
    if kind == "publish" and waiting:
        placed = rng.sample(waiting, rng.randint(1, len(waiting)))
        leave = [w for w in placed if rng.random() < 0.2]
        ranks = [w for w in placed if w not in leave]
        round_id = next_round[0]
        next_round[0] += 1
        assignments: dict[str, dict[str, Any]] = {w: {"leave": True, "reason": "drain"}
                                                  for w in leave}
        for rank, w in enumerate(ranks):
            assignments[w] = {"round": round_id, "rank": rank, "size": len(ranks),
                              "hosts_version": both.sim.version}
        both.publish(assignments)
        return f"publish {assignments}"
    if kind == "commit":
        real, sim = both.commit(rng.randint(0, next_round[0]))
        assert real == sim, f"commit answered {real} by the actor, {sim} by the simulator"
        return "commit"
    if kind == "bump":
        real, sim = both.bump_hosts()
        assert real == sim
        return "bump_hosts"
    if kind == "ask":
        both.ask_checkpoint()
        return "ask_checkpoint"
    if kind == "fail":
        both.fail("the elastic job stopped: a test")
        return "fail"
    return "none"


def test_the_simulated_rounds_actor_answers_every_message_as_the_real_one():
    for seed in range(200):
        rng = random.Random(seed)
        both = _Both()
        next_round = [1]
        done: list[str] = []
        try:
            for _ in range(40):
                done.append(_step(both, rng, next_round))
                real, sim = both.views()
                assert real == sim, f"seed {seed} after {done[-3:]}: actor {real}, sim {sim}"
                assert both.real_ended == both.world.ended, \
                    f"seed {seed} after {done[-3:]}: joins ended {both.real_ended} (actor), " \
                    f"{both.world.ended} (sim)"
                assert both.world.violations == [], both.world.violations
        finally:
            both.close()
