"""The simulated world an elastic job runs in: one virtual clock, one seeded generator.

Nodes, worker processes, the rounds actor, the rendezvous store and the autoscaler are
plain objects; what takes time is an event on one queue. The real controller drives the
clock: whenever it waits (a poll with a timeout, a sleep) the world runs its events up to
the end of that wait. Nothing else advances time, so one seed is one history.

Workers follow the worker side's protocol (`protocol.WorkerSide`, World's base).

What Ray does with faults, with the delays measured on real clusters (docs/elastic.md):
a killed process's calls fail at once; a killed node's processes are gone at once (their
peers' connections close), but Ray reports their calls failed only when its health checks
declare the node dead; a raylet's workers exit within `RAYLET_EXIT_S`; a cut-off node's
calls are held until it heals, and it is declared dead if the cut lasts
`PARTITION_DEATH_S`; a drained node with a deadline is terminated at it, and one without
once it is idle.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Callable
from typing import Any

from raytrain_x.testing.simulation.model import RPC_S, Group, Node, SimWorker, WorldConfig
from raytrain_x.testing.simulation.protocol import WorkerSide
from raytrain_x.testing.simulation.rounds import SimRounds
from raytrain_x.testing.simulation.storage import SimStorage

NODE_DEATH_S = 16.0  # a killed node until Ray's health checks declare it dead
RAYLET_EXIT_S = 2.0  # a worker notices its raylet is gone (`exit_with_raylet`)
RAYLET_CALLS_FAIL_S = 2.5  # calls to a worker whose raylet died fail
PARTITION_DEATH_S = 30.0  # a cut-off node until Ray gives up on it
PROCESS_GONE_S = 0.3  # a killed process's calls fail (its raylet reports it)
IDLE_TERMINATE_S = 2.0  # a drained node without a deadline goes once idle
RESPAWN_S = (3.0, 10.0)  # without an autoscaler, a lost node's replacement joins
AUTOSCALER_PERIOD_S = 2.0  # how often the autoscaler reconciles the job's request


class DriverKilled(BaseException):
    """The driver process was killed (a fault): raised out of the job's loop, as the
    process's end is; the runner starts the same job again `restart_s` later (a
    BaseException: the controller's own error handling must not swallow it)."""

    def __init__(self, restart_s: float) -> None:
        super().__init__(f"the driver was killed; run again in {restart_s:.1f}s")
        self.restart_s = restart_s


class World(WorkerSide):
    """The clock, the queue, the cluster and the job's actors."""

    def __init__(self, seed: int, config: WorldConfig, trace: Callable[[str], None]) -> None:
        self.rng = random.Random(seed)
        self._late_rng = random.Random(seed + 1)
        self.config = config
        self.trace = trace
        self.now = 0.0
        self._queue: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._node_ids = itertools.count(1)
        self.worker_ids = itertools.count()  # the pools' (one per driver)
        self.nodes: dict[str, Node] = {}
        self.workers: list[SimWorker] = []
        self.groups: dict[int, Group] = {}
        self.rounds = SimRounds(self)
        self.store_abandoned: list[str] = []
        self.store_forgotten: list[str] = []
        self.store_free_at = 0.0  # when the store actor is next free
        self.rounds_free_at = 0.0  # when the rounds actor is next free
        self.store_dead = False
        self.store_epoch = 0  # the store actor of the control actors now (one per job)
        # workers the driver restarted while their join had reached the rounds actor:
        # (worker, the round it was given or None, when)
        self.restarted_joins: list[tuple[SimWorker, int | None, float]] = []
        self.launching = 0  # nodes the autoscaler is launching
        self.requested = 0  # the job's standing request, in workers
        self.next_start: tuple[str, float] | None = None  # a slow or stuck start fault
        # what the invariants read
        self.commits: list[tuple[float, int, int]] = []  # (time, round, step)
        self.chunks = None  # the last commit as an FSDP2 model's chunks
        self.chunks_lost = 0
        self.reshards = 0
        # durable checkpoints: complete ones (time, step), restores from them (time, step),
        # storage down until, a write under way, when the last one started
        self.durable: list[tuple[float, int]] = []
        self.storage_restores: list[tuple[float, int]] = []
        self.storage_down_until = -math.inf
        self.writing = False
        self.last_write = 0.0
        self.write_asked = False  # the driver asked; rank 0 writes after the write under way
        self.outages: list[tuple[float, float]] = []  # storage down (from, until)
        # the checkpoints themselves, through the real store over files in memory; its
        # faults (damaged writes, flaky listings, a killed driver's writer) drawn apart
        self.storage = SimStorage()
        self.orphans: set[str] = set()
        self.damaged_writes: list[float] = []
        self.next_damage: str | None = None  # a named scenario's: the next write lands so
        self.writer_outlives = False  # a named scenario's: a killed driver's writer goes on
        self.storage_rng = random.Random(seed + 5)
        # bit rot in completed checkpoints, ranks lost mid-write: drawn apart again, so
        # that the faults above fall as they did before these were modelled
        self.rot_rng = random.Random(seed + 11)
        self.lease = self.storage.new_run(lambda: self.now) \
            if config.checkpoint_every_s is not None else None
        self.discovery_down_until = -math.inf  # the discovery script fails until then
        self.undiscovered: dict[str, float] = {}  # node -> until when the script omits it
        # the discovery script's answers, each from when it first gave it: (time, hosts)
        self.script_answers: list[tuple[float, set[str]]] = []
        self.driver_up = True  # a driver process runs the job
        self.driver_kills: list[tuple[float, int]] = []  # (when, the job's step then)
        # whole-pool drains: (when, the job's step then, the deadline in seconds)
        self.pool_drains: list[tuple[float, int, float]] = []
        self.fault_times: list[float] = []  # every fault's firing, phase faults too
        self.violations: list[str] = []
        self.finish_after: float = math.inf  # workers finish at the first commit after it
        self.outcome_changes = 0
        self.phase_faults: list[tuple[str, Callable[[list[SimWorker]], None]]] = []
        self.driver_members: Callable[[], Any] = lambda: ()
        for _ in range(config.nodes):
            self.add_node()
        self.after(AUTOSCALER_PERIOD_S, self._autoscaler_loop)

    # ------------------------------------------------------------------ the clock
    def at(self, when: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._queue, (max(when, self.now), next(self._seq), fn))

    def after(self, delay: float, fn: Callable[[], None]) -> None:
        self.at(self.now + delay, fn)

    def advance(self, until: float, stop: Callable[[], bool] | None = None) -> None:
        """Runs every event up to `until` (or until `stop()` holds after one)."""
        while self._queue and self._queue[0][0] <= until:
            when, _, fn = heapq.heappop(self._queue)
            self.now = when
            fn()
            if stop is not None and stop():
                return
        self.now = max(self.now, until)

    def violation(self, text: str) -> None:
        self.violations.append(f"t={self.now:.2f}s: {text}")
        self.trace(f"VIOLATION {text}")

    def placed_delay(self) -> float:
        """How long the rounds actor's answer to a published join takes to reach its
        worker (`WorldConfig.late_placed_s`); drawn from its own generator, so a world
        with late answers meets the same other events as one without."""
        late = self.config.late_placed_s
        return RPC_S if late is None else self._late_rng.uniform(*late)

    # ------------------------------------------------------------------ nodes
    def add_node(self) -> Node:
        node = Node(f"n{next(self._node_ids)}", self.config.slots)
        self.nodes[node.node_id] = node
        self.trace(f"node {node.node_id} up")
        return node

    def alive_nodes(self) -> dict[str, Node]:
        """The nodes Ray lists as alive."""
        return {n: node for n, node in self.nodes.items() if not node.known_dead}

    def workers_on(self, node: Node) -> list[SimWorker]:
        return [w for w in self.workers if w.node is node and w.alive]

    def declare_dead(self, node: Node) -> None:
        if node.known_dead:
            return
        node.known_dead = True
        node.up = False
        self.trace(f"Ray declares node {node.node_id} dead")
        for w in [w for w in self.workers if w.node is node]:
            if w.alive:
                self.process_dies(w, visible_in=0.0)
            elif w.outcome is None:
                w.outcome = ("failed", "lost")
            self.outcome_due(w, min(w.outcome_at, self.now))

    def kill_node(self, node: Node, graceful: bool = False) -> None:
        """Every process on it ends now; Ray knows at once when the removal is graceful,
        else when its health checks give up."""
        if not node.up:
            return
        node.up = False
        self.trace(f"node {node.node_id} {'terminated' if graceful else 'killed'}")
        for w in self.workers_on(node):
            self.process_dies(w, visible_in=math.inf)
        if graceful:
            self.declare_dead(node)
        else:
            self.after(NODE_DEATH_S, lambda: self.declare_dead(node))
        if not self.config.autoscaler and self.config.respawn:  # a cluster manager's
            self.after(self.rng.uniform(*RESPAWN_S), self.add_node)

    def kill_raylet(self, node: Node) -> None:
        if not node.up or node.raylet_dead:
            return
        node.raylet_dead = True
        self.trace(f"raylet of {node.node_id} killed")
        for w in self.workers_on(node):
            self.after(RAYLET_EXIT_S, lambda w=w: self.process_dies(
                w, visible_in=RAYLET_CALLS_FAIL_S - RAYLET_EXIT_S))
        self.after(NODE_DEATH_S, lambda: self.declare_dead(node))

    def partition(self, node: Node, seconds: float) -> None:
        if not node.up:
            return
        node.cut_until = max(node.cut_until, self.now + seconds)
        self.trace(f"node {node.node_id} cut off for {seconds:.1f}s")
        if seconds >= PARTITION_DEATH_S:
            self.after(PARTITION_DEATH_S, lambda: self._cut_off_for_good(node))
        else:
            self.after(seconds, lambda: self._healed(node))
        for group in {id(w.group): w.group for w in self.workers_on(node) if w.group}.values():
            self._stall(group)

    def _cut_off_for_good(self, node: Node) -> None:
        if node.up:
            self.trace(f"node {node.node_id} stayed cut off: Ray gives up on it")
            for w in self.workers_on(node):
                self.process_dies(w, visible_in=0.0)
            node.up = False
        self.declare_dead(node)

    def _healed(self, node: Node) -> None:
        if node.cut(self.now) or not node.up:
            return
        self.trace(f"node {node.node_id} reachable again")
        for w in self.workers_on(node):
            if w.phase == "joining" and not w.join_arrived:
                # Ray may hold a call to an actor it lost touch with for a minute or more
                held = self.rng.choice([0.05, 0.05, self.rng.uniform(5.0, 60.0)])
                self.after(held, lambda w=w: self._held_join_arrives(w))
            if w.phase == "rendezvous" and w.group is not None \
                    and w.worker_id not in w.group.arrived:
                self._arrive(w, w.group)
        for group in list(self.groups.values()):
            self._unstall(group)

    def drain(self, node: Node, deadline_s: float | None) -> None:
        if not node.up or node.drain_deadline is not None:
            return
        node.drain_deadline = math.inf if deadline_s is None else self.now + deadline_s
        self.trace(f"node {node.node_id} draining "
                   f"({'no deadline' if deadline_s is None else f'deadline {deadline_s:.1f}s'})")
        if deadline_s is not None:
            self.after(deadline_s, lambda: self.kill_node(node, graceful=True))
        else:
            self._terminate_when_idle(node)

    def _terminate_when_idle(self, node: Node) -> None:
        if not node.up:
            return
        if self.workers_on(node):
            self.after(0.5, lambda: self._terminate_when_idle(node))
        else:
            self.after(IDLE_TERMINATE_S, lambda: self.kill_node(node, graceful=True))

    # ------------------------------------------------------------------ the autoscaler
    def request(self, bundles: int) -> None:
        """The job's standing request: nodes are launched until their slots cover it."""
        self.requested = bundles
        self._scale()

    def _scale(self) -> None:
        if not self.config.autoscaler:
            return
        usable = [n for n in self.nodes.values() if n.up and n.drain_deadline is None]
        have = sum(n.slots for n in usable) + self.launching * self.config.slots
        total = len([n for n in self.nodes.values() if n.up]) + self.launching
        while have < self.requested and total < self.config.max_nodes:
            self.launching += 1
            have += self.config.slots
            total += 1
            self.after(self.rng.uniform(*self.config.launch_s), self._launched)

    def _autoscaler_loop(self) -> None:
        """The autoscaler reconciles the standing request with the nodes there are."""
        self._scale()
        self.after(AUTOSCALER_PERIOD_S, self._autoscaler_loop)

    def _launched(self) -> None:
        self.launching -= 1
        self.add_node()

    # ------------------------------------------------------------------ processes
    def start_worker(self, node: Node) -> SimWorker:
        w = SimWorker(len(self.workers), node)
        self.workers.append(w)
        if self.next_start is not None:
            kind, seconds = self.next_start
            self.next_start = None
            if kind == "stuck":
                node.stuck_starts = True
            else:
                node.slow_starts = (seconds, seconds)
        if not node.up or node.stuck_starts:
            w.ready_at = None
        else:
            w.ready_at = self.now + self.rng.uniform(*(node.slow_starts or self.config.start_s))
        return w

    def storage_outage(self, seconds: float) -> None:
        """Storage refuses every write, and the driver's listings, for `seconds` (the
        server stopped)."""
        self.storage_down_until = max(self.storage_down_until, self.now + seconds)
        self.outages.append((self.now, self.now + seconds))
        self.trace(f"storage down for {seconds:.1f}s")

    def drain_pool(self, deadline_s: float) -> None:
        """Every node with a worker of the job drains at once (a spot notice for the whole
        pool), each with `deadline_s`."""
        nodes = {w.node.node_id: w.node for w in self.workers if w.alive}
        if nodes:
            self.pool_drains.append((self.now, self.job_step(), deadline_s))
        for node in nodes.values():
            self.drain(node, deadline_s)

    def discovery_outage(self, seconds: float) -> None:
        """Every run of the discovery script fails for `seconds`."""
        self.discovery_down_until = max(self.discovery_down_until, self.now + seconds)
        self.trace(f"discovery script failing for {seconds:.1f}s")

    def undiscover(self, node: Node, seconds: float) -> None:
        """The discovery script stops listing `node` for `seconds` (its host was taken out
        of the job; it comes back after)."""
        self.undiscovered[node.node_id] = max(self.undiscovered.get(node.node_id, -math.inf),
                                              self.now + seconds)
        self.trace(f"node {node.node_id} left discovery for {seconds:.1f}s")

    def listed(self, node_id: str) -> bool:
        """Whether the discovery script lists `node_id` now."""
        return self.now >= self.undiscovered.get(node_id, -math.inf)

    def kill_driver(self, restart_s: float) -> None:
        """The driver process is killed: Ray ends the actors it owns (every worker, the
        rounds and store actors) and the same command runs again `restart_s` later
        (`DriverKilled`, which the runner catches). Only once a durable checkpoint is
        complete: before it, a new run starts the job over, which is no resume."""
        if not self.driver_up or not self.durable:
            self.trace("no driver to kill, or no checkpoint to resume from: skipped")
            return
        self.trace("the driver process is killed")
        self.driver_up = False
        self.driver_kills.append((self.now, self.job_step()))
        self.orphans |= {w.worker_id for w in self.workers if w.alive}
        for w in [w for w in self.workers if w.alive]:
            self.process_dies(w, visible_in=0.0)
        raise DriverKilled(restart_s)

    def new_driver(self) -> None:
        """The same command again: a new driver with new rounds and store actors."""
        self.trace("a new driver starts the job again")
        self.driver_up = True
        if self.lease is not None:
            old = self.lease
            self.lease = self.storage.new_run(lambda: self.now)
            # the killed run's rank 0 goes on (its writer, its lease's renewal), or its
            # renewal was under way as it died
            if self.writer_outlives or self.storage_rng.random() < 0.5:
                self.trace("a renewal of the killed run's lease lands after the takeover")
                self.storage.stale_renewal(old)
        self.new_control()

    def kill_control(self, pick: float) -> None:
        """The rounds actor (`pick` < 0.5) or the store actor dies (the head's control
        actors: the driver learns at its next call to it, `ControlActorLost`)."""
        if not self.driver_up:
            return
        if pick < 0.5:
            self.trace("the rounds actor dies")
            self.rounds.dead = True
        else:
            self.trace("the store actor dies")
            self.store_dead = True

    def new_control(self) -> None:
        """New rounds and store actors (a new job of the same or a new driver)."""
        self.rounds = SimRounds(self)
        self.store_dead = False
        self.store_epoch += 1

    def lose_everything(self) -> None:
        """Every worker process of the job ends at once (a whole spot pool reclaimed)."""
        self.trace("every worker process lost")
        for w in [w for w in self.workers if w.alive]:
            self.process_dies(w, visible_in=0.3)

    def process_dies(self, w: SimWorker, visible_in: float) -> None:
        """`w`'s process ends; its driver sees the call fail `visible_in` later."""
        if not w.alive:
            return
        w.alive = False
        self.trace(f"{w} process gone")
        if w.outcome is None:
            w.outcome = ("failed", "lost")
            self.outcome_due(w, self.now + visible_in)
        self.rounds.gone(w)
        if w.group is not None:
            self._peer_gone(w.group, w)
