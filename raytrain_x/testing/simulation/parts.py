"""The elastic controller's parts (`raytrain_x.ray.elastic.parts.JobParts`) over the
simulated world: the worker pool, the cluster view, the rounds and store clients, a sleep
that advances the virtual clock. The controller runs unchanged on them."""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Iterable
from typing import Any

from raytrain_x.common.errors import ConfigError, ControlActorLost, StorageError, WorkerError
from raytrain_x.ray.elastic.discovery import DiscoveryHealth
from raytrain_x.ray.elastic.parts import JobParts, control_lost_message
from raytrain_x.ray.elastic.pool import Member, Outcomes, Pending, WorkerPool, heartbeat_turn
from raytrain_x.ray.elastic.rounds import current_holders
from raytrain_x.ray.elastic.settings import ElasticSettings
from raytrain_x.ray.worker import Left
from raytrain_x.testing.simulation.model import SimWorker
from raytrain_x.testing.simulation.rounds import SimRounds
from raytrain_x.testing.simulation.world import World

LOST = ("the worker process exited (sys.exit, a crash or a killed node); its output is in "
        "the Ray logs")


class ActorDied(Exception):
    """What Ray raises for an actor whose process or node is gone."""


class SimPool(WorkerPool):
    """`WorkerPool` whose actors are simulated workers (the key and the ref of each is its
    `SimWorker`)."""

    def __init__(self, settings: ElasticSettings, world: World) -> None:
        super().__init__(settings, lambda: world.now)
        self.world = world
        self._ids = world.worker_ids  # unique across drivers, as the world keeps them all

    def start(self, node: str) -> None:
        """Ray places the worker; with a discovery script (slots the driver counts itself)
        a node whose slots the job's own workers there (members, starts under way) already
        fill is one too many: a start that waits for a slot the job itself holds. (A worker
        the driver gave up on and killed may hold its slot a while longer, out of reach on
        a cut-off node: a start there waits for that kill, as on Ray.)"""
        held = sum(1 for m in self.members.values() if m.node == node) + \
            sum(1 for p in self.pending.values() if p.node == node)
        if self.world.config.scripted_discovery and held >= self.world.nodes[node].slots:
            self.world.violation(f"a worker placed on {node}, which holds {held} of the "
                                 f"job's workers in {self.world.nodes[node].slots} slots")
        w = self.world.start_worker(self.world.nodes[node])
        self.pending[w] = Pending(w, node, w, self.world.now)

    def poll_pending(self, setup: Callable, fn: Callable, args: tuple, kwargs: dict
                     ) -> tuple[list[Member], list[tuple[Pending, Exception]]]:
        joined, died = [], []
        now = self.world.now
        for w, pending in list(self.pending.items()):
            if w.node.known_dead or (not w.alive and w.outcome_at <= now):
                died.append((pending, ActorDied("its node died")))
                continue
            if w.ready_at is None or now < w.ready_at or not w.reachable(now) \
                    or not w.node.up:
                continue
            del self.pending[w]
            w.worker_id = f"w{next(self._ids)}"
            member = Member(w.worker_id, w, pending.node, next(self._ages),
                            asked_at=pending.asked_at)
            member.ref = w
            self.members[w.worker_id] = member
            self.world.trace(f"{w} started")
            self.world.execute(w)
            joined.append(member)
        return joined, died

    def give_up(self, key: Any) -> Pending | None:
        pending = self.pending.pop(key, None)
        if pending is not None:
            self._kill(pending.actor)
        return pending

    def poll(self, timeout_s: float) -> Outcomes:
        world = self.world
        refs = [m.ref for m in self.members.values() if m.ref is not None]
        if refs:
            # stops once a member's outcome is visible: the earliest, looked up again only
            # when an outcome was made or moved (a scan after every event was O(N) each)
            seen, due = [-1], [math.inf]

            def visible() -> bool:
                if world.outcome_changes != seen[0]:
                    seen[0] = world.outcome_changes
                    due[0] = min(w.outcome_at for w in refs)
                return due[0] <= world.now
            world.advance(world.now + timeout_s, stop=visible)
        else:
            world.advance(world.now + timeout_s)
        out = Outcomes({}, [], [])
        for member in list(self.members.values()):
            w = member.ref
            if w is None or w.outcome is None or w.outcome_at > world.now:
                continue
            kind, value = w.outcome
            if kind == "finished":
                out.finished[member.worker_id] = value
            elif kind == "left":
                out.left.append((member, Left(value)))
            elif value == "lost":
                out.failed.append((member, WorkerError(member.rank, LOST, process_lost=True)))
            else:
                out.failed.append((member, WorkerError(member.rank, str(value))))
        return out

    def collect(self, finished: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        world = self.world
        deadline = world.now + timeout_s

        def waiting() -> list[Member]:
            return [m for m in self.members.values()
                    if m.finishes_with_the_job() and m.worker_id not in finished
                    and not (m.ref.outcome is not None and m.ref.outcome_at <= world.now)]

        while world.now < deadline and waiting():
            world.advance(min(deadline, world.now + 0.2))
        for m in self.members.values():
            w = m.ref
            if w is not None and w.outcome is not None and w.outcome[0] == "finished" \
                    and w.outcome_at <= world.now:
                finished.setdefault(m.worker_id, w.outcome[1])
        return finished

    def remove(self, member: Member) -> None:
        self.members.pop(member.worker_id, None)
        w: SimWorker = member.actor
        if w.alive and w.outcome is None and w.phase == "joining" and w.join_arrived \
                and w.node.cut_until < w.join_arrived_at:
            # its join reached the rounds actor and no partition has cut it off since:
            # nothing holds it back; checked once the job ends (`runner`), as a drain may
            # have given its round up
            self.world.restarted_joins.append((w, w.placed_in, self.world.now))
        self._kill(w)

    def ask(self, worker_ids: Iterable[str], method: str) -> dict[str, Any]:
        now = self.world.now
        return {w: f"simulated {self.members[w].actor.phase}" for w in worker_ids
                if w in self.members and self.members[w].actor.reachable(now)}

    def beat(self) -> tuple[dict[str, tuple[float, int]], set[str], list[str]]:
        now = self.world.now
        answers: dict[str, tuple[float, int]] = {}
        failed: set[str] = set()
        for m in self.members.values():
            if m.beat is None:
                continue
            w: SimWorker = m.actor
            if w.reachable(now) and m.beat < now:
                m.beat = None
                answers[m.worker_id] = (0.0 if w.joining_since is None
                                        else now - w.joining_since, w.state_round)
            elif not w.alive and w.outcome_at <= now:
                m.beat = None
                failed.add(m.worker_id)
        self.beat_polls += 1
        sent = []
        for m in heartbeat_turn((m for m in self.members.values() if m.beat is None),
                                self.beat_polls):
            m.beat = now  # the call went out now
            sent.append(m.worker_id)
        return answers, failed, sent

    def kill_all(self) -> None:
        for w in [m.actor for m in self.members.values()] + list(self.pending):
            self._kill(w)

    def _kill(self, w: SimWorker, deferred: bool = False) -> None:
        """`ray.kill`: goes through the worker's raylet, so a cut-off worker lives on until
        its node is back (or declared dead). The last holder of the state killed while it
        answered and ran is marked `restarted` (the invariants tell that from losing it
        to a fault)."""
        world = self.world
        if not w.alive or w.node.raylet_dead:
            return  # gone, or beyond the kill's reach: it exits with its raylet
        if w.node.cut(world.now):
            world.at(w.node.cut_until, lambda: self._kill(w, deferred=True))
            return
        if not deferred and w.outcome is None and w.holds:
            others = [o for o in world.workers if o is not w and o.alive and o.worker_id
                      and o.outcome is None and o.holds and o.saved >= w.saved]
            w.restarted = not others  # the last holder of its state
        world.process_dies(w, visible_in=0.0)


class SimCapacity:
    """The standing autoscaler request (`raytrain_x.ray.autoscaling.CapacityRequest`)."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.bundles = 0

    def ask(self, bundles: int) -> None:
        if bundles != self.bundles:
            self.bundles = bundles
            self.world.request(bundles)

    def clear(self) -> None:
        self.ask(0)


class SimScript:
    """A discovery script over the simulated nodes, read as `ScriptDiscovery` reads one
    (its `DiscoveryHealth`): it reports the nodes that are up with their total slots, and
    while discovery is down every run fails and the hosts of the last success stand."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.health = DiscoveryHealth()

    def hosts(self) -> dict[str, int]:
        world = self.world
        if world.now < world.discovery_down_until:
            self.health.failed(ConfigError("discovery script exited with 1"), world.now)
        else:
            hosts = {n: node.slots for n, node in world.alive_nodes().items()
                     if node.up and world.listed(n)}
            self.health.succeeded(hosts)
            if not world.script_answers or world.script_answers[-1][1] != set(hosts):
                world.script_answers.append((world.now, set(hosts)))
        return dict(self.health.last or {})


class SimCluster:
    """`ClusterView` over the simulated nodes."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.capacity = SimCapacity(world)
        self.scripted = world.config.scripted_discovery
        self.script = SimScript(world) if self.scripted else None
        self._discovered: set[str] | None = None

    def discovered(self) -> set[str] | None:
        return None if self._discovered is None else set(self._discovered)

    def nodes(self) -> dict[str, dict[str, float]]:
        return {n: {"CPU": float(node.slots)} for n, node in self.world.alive_nodes().items()}

    def free_slots(self, used: dict[str, int]) -> dict[str, int]:
        """Ray's available resources: a node it still lists but that is gone or cut off
        shows what it last reported. With a discovery script, its hosts that Ray lists,
        less the job's own workers there (as `ClusterView` counts them)."""
        if self.script is not None:
            listed = self.world.alive_nodes()
            hosts = {n: slots for n, slots in self.script.hosts().items() if n in listed}
            self._discovered = set(hosts)
            return {n: slots - used.get(n, 0) for n, slots in hosts.items()}
        free = {}
        held = collections.Counter(w.node.node_id for w in self.world.workers if w.alive)
        for n, node in self.world.alive_nodes().items():
            if not node.up or node.raylet_dead:
                free[n] = 0
                continue
            free[n] = max(0, node.slots - held[n])
        return free

    def addresses(self) -> dict[str, str]:
        return {n: f"10.0.0.{i}" for i, n in enumerate(self.world.nodes, 1)}

    def draining(self) -> dict[str, float]:
        return {n: node.drain_deadline for n, node in self.world.alive_nodes().items()
                if node.drain_deadline is not None}

    def node_types(self) -> dict[str, dict[str, float]] | None:
        return {"worker": {"CPU": float(self.world.config.slots)}}

    @property
    def autoscaled(self) -> bool:
        return True

    def unusable_slots(self, unusable: set[str]) -> int:
        return sum(node.slots for n, node in self.world.alive_nodes().items() if n in unusable)


class SimRoundsClient:
    """`RoundsClient` over the simulated rounds actor; a call to it once it died raises
    `ControlActorLost`, as the real client does."""

    actor = None

    def __init__(self, world: World) -> None:
        self.world = world
        self.rounds = world.rounds

    def _actor(self) -> SimRounds:
        world = self.world
        if not self.rounds.dead and world.rounds_free_at > world.now:
            # the actor serves calls in arrival order: the driver's is answered once the
            # joins that reached it first are listed (so a join it does not list has not
            # reached it: `held_joins`)
            world.advance(world.rounds_free_at)
        if self.rounds.dead:
            raise ControlActorLost(control_lost_message("rounds", "killed by a fault"))
        return self.rounds

    def waiting(self) -> list[str]:
        return list(self._actor().waiting)

    def watch_joins(self, at_least: int, wake: Callable[[], None]) -> None:
        """Not modelled: the simulated driver hears of a join at its next look, every 0.1
        virtual seconds while a round waits (the real one as the join lands). The
        decisions the simulator checks are the same; only that latency is not."""

    def committed_round(self) -> int:
        return self._actor().committed_round

    def committed(self) -> bool:
        return self._actor().committed_round > 0

    def holders(self) -> list[str]:
        return current_holders(self._actor().state_rounds, self._actor().committed_round)

    def hosts_version(self) -> int:
        return self._actor().version

    def publish(self, assignments: dict[str, dict[str, Any]]) -> None:
        self._actor().publish(assignments)

    def bump_hosts(self) -> int:
        self._actor().version += 1
        return self._actor().version

    def ask_checkpoint(self) -> None:
        self._actor().checkpoint_asked = True

    def fail(self, message: str) -> None:
        self._actor().fail(message)


class SimStoreClient:
    actor = None

    def __init__(self, world: World) -> None:
        self.world = world

    def abandon(self, prefix: str) -> None:
        if not self.world.store_dead:
            self.world.abandon(prefix)

    def forget(self, prefix: str) -> None:
        if not self.world.store_dead:
            self.world.forget(prefix)

    def check_alive(self) -> None:
        if self.world.store_dead:
            raise ControlActorLost(control_lost_message("store", "killed by a fault"))


def sim_parts(settings: ElasticSettings, world: World) -> JobParts:
    def latest_checkpoint() -> dict[str, Any]:
        # what the driver reads: the newest complete by size, through the real store; while
        # storage is down its listing fails, after the store's retries
        if world.now < world.storage_down_until:
            raise StorageError(f"listing memory://job failed 6 times: the server is down "
                               f"for {world.storage_down_until - world.now:.1f}s more")
        manifest = world.storage.store.latest(warn=False, verify=False)
        if manifest is None:
            return {"number": None}
        step = manifest.values["step"]
        return {"number": step, "key": list(manifest.key), "describe": f"checkpoint {step}",
                "values": {"step": step}}

    def control_lost() -> str | None:
        if world.rounds.dead:
            return control_lost_message("rounds", "killed by a fault")
        if world.store_dead:
            return control_lost_message("store", "killed by a fault")
        return None

    return JobParts(SimPool(settings, world), SimCluster(world), SimRoundsClient(world),
                    SimStoreClient(world), lambda s: world.advance(world.now + s),
                    lambda: world.now, lambda: None, latest_checkpoint, control_lost)
