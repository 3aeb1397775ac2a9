"""The elastic job's worker actors: starting ones (pending) and members, and every Ray call
made on them (start, poll, give up, kill, probe). Decisions are the policies'."""

from __future__ import annotations

import heapq
import itertools
import logging
import queue
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import (
    ActorUnschedulableError,
    GetTimeoutError,
    RayActorError,
    RayTaskError,
)
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raytrain_x.common.errors import WorkerError
from raytrain_x.common.settings import short_node
from raytrain_x.ray.elastic.policies import MemberView, PendingView
from raytrain_x.ray.elastic.settings import ElasticSettings
from raytrain_x.ray.failures import ask, worker_error
from raytrain_x.ray.worker import Left, Worker

log = logging.getLogger("raytrain_x.elastic")

# how long a started worker's setup call may take (it sets its environment and returns);
# past it, the worker counts as died while starting
SETUP_TIMEOUT_S = 60.0

# the most heartbeat calls the driver sends in one poll (`heartbeat_turn`)
HEARTBEATS_PER_POLL = 128
# put in the queue of landed calls to end a poll early (`WorkerPool.wake`)
_WAKE = object()
# what a starting worker's calls raise when it will never run: it died while starting, or
# Ray cannot place it (its node left before the actor was scheduled there)
START_FAILED = (RayActorError, RayTaskError, ActorUnschedulableError)


@dataclass
class Member:
    worker_id: str
    actor: Any
    node: str
    age: int  # start order: the oldest survivor becomes rank 0
    ref: Any = None  # its `execute` call
    rank: int = -1
    leaving: bool = False  # told to leave (its node drains); gone when its call returns
    # its node drains and a round formed without it: sent away when it reaches the rendezvous
    departed: bool = False
    beat: Any = None  # its heartbeat call out now (`WorkerActor.heartbeat`)
    beat_turn: int = 0  # the heartbeat poll that last sent it a call (`heartbeat_turn`)
    asked_at: float = 0.0  # when its start was asked for (the driver's clock)
    # why a driver policy asked it to leave (None: none did): it goes as if its node drained
    asked_to_leave: str | None = None

    def view(self) -> MemberView:
        return MemberView(self.worker_id, self.node, self.leaving, in_round=self.rank >= 0,
                          departed=self.departed, asked_to_leave=self.asked_to_leave is not None)

    def finishes_with_the_job(self) -> bool:
        """Whether the job's end waits for this member's result: it runs the function in a
        round and is not leaving. A newcomer still on its way to its first round never
        finishes (no round forms once the job is done): it is stopped with the job."""
        return self.ref is not None and self.rank >= 0 and not self.leaving


def heartbeat_turn(idle: Iterable[Member], poll: int, most: int | None = None) -> list[Member]:
    """The members without a heartbeat call out that get one in poll `poll` (counted from
    1): every one in a job of up to `most` members (`HEARTBEATS_PER_POLL`), else the `most`
    asked longest ago. The driver's calls a second so stay bounded whatever the job's size,
    and each member of a larger job is asked once every N / `most` polls: a member with no
    call out is not silent (`Heartbeats`), so such a job hears that long later of a member
    that hangs; of one that dies it hears from Ray at once (its `execute` call fails)."""
    most = HEARTBEATS_PER_POLL if most is None else most
    idle = list(idle)
    chosen = idle if len(idle) <= most else \
        heapq.nsmallest(most, idle, key=lambda m: m.beat_turn)
    for member in chosen:
        member.beat_turn = poll
    return chosen


@dataclass
class Pending:
    """A worker actor asked for but not answering yet: its process may still be starting."""

    actor: Any
    node: str
    ref: Any  # its first call (node_id): ready once the actor is up
    asked_at: float

    def view(self) -> PendingView:
        return PendingView(self.ref, self.node, self.asked_at)


@dataclass
class Outcomes:
    """What the members' `execute` calls returned at one poll."""

    finished: dict[str, Any]
    failed: list[tuple[Member, WorkerError]]
    left: list[tuple[Member, Left]]


class WorkerPool:
    """Worker actors of one elastic job."""

    def __init__(self, settings: ElasticSettings, clock: Callable[[], float]) -> None:
        self.settings = settings
        self.clock = clock
        self.members: dict[str, Member] = {}
        self.pending: dict[Any, Pending] = {}  # first-call ref -> a worker still starting
        self._ids = itertools.count()
        self._ages = itertools.count()
        self.beat_polls = 0  # heartbeat polls so far (`beat`)
        # members' `execute` calls out (ref -> member), and those that returned, put in
        # the queue by Ray's thread as each lands: a poll costs what landed, not N refs
        self._running: dict[Any, Member] = {}
        self._landed: queue.SimpleQueue = queue.SimpleQueue()

    # ------------------------------------------------------------------ starting
    def start(self, node: str) -> None:
        """Asks for a worker on `node`; it joins when it answers (`poll_pending`)."""
        settings = self.settings
        resources = {k: v for k, v in settings.per_worker.items() if k not in ("CPU", "GPU")}
        actor = Worker.options(
            num_cpus=settings.cpus_per_worker, num_gpus=settings.gpus_per_worker,
            resources=resources or None,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
        ref = actor.node_id.remote()
        self.pending[ref] = Pending(actor, node, ref, self.clock())

    def poll_pending(self, setup: Callable[[Any, str], Any], fn: Callable, args: tuple,
                     kwargs: dict) -> tuple[list[Member], list[tuple[Pending, Exception]]]:
        """Workers that answered become members (set up, then running `fn`); returns those
        and the ones that died while starting."""
        if not self.pending:
            return [], []
        ready, _ = ray.wait(list(self.pending), num_returns=len(self.pending), timeout=0)
        joined, died = [], []
        set_up = []  # every ready worker's setup goes out before any is waited for
        for ref in ready:
            pending = self.pending[ref]
            worker_id = f"w{next(self._ids)}"
            try:
                ray.get(ref)  # ready: answers at once
            except START_FAILED as exc:
                died.append((pending, exc))  # still pending: the caller gives it up
                continue
            set_up.append((ref, pending, worker_id, setup(pending.actor, worker_id)))
        for ref, pending, worker_id, call in set_up:
            try:
                ray.get(call, timeout=SETUP_TIMEOUT_S)  # its node may go meanwhile
            except (*START_FAILED, GetTimeoutError) as exc:
                died.append((pending, exc))
                continue
            del self.pending[ref]
            member = Member(worker_id, pending.actor, pending.node, next(self._ages),
                            asked_at=pending.asked_at)
            self.run(member, pending.actor.execute.remote(fn, args, kwargs))
            self.members[worker_id] = member
            joined.append(member)
            log.info("raytrain-x elastic: a worker on %s started after %.1fs",
                     short_node(pending.node), self.clock() - pending.asked_at)
        return joined, died

    def give_up(self, key: Any) -> Pending | None:
        """Stops waiting for a starting worker and kills it."""
        pending = self.pending.pop(key, None)
        if pending is not None:
            _kill(pending.actor)
        return pending

    # ------------------------------------------------------------------ members
    def run(self, member: Member, ref: Any) -> None:
        """`ref` is `member`'s `execute` call; `poll` reports it once it returns."""
        member.ref = ref
        self._running[ref] = member
        ref.future().add_done_callback(lambda _: self._landed.put(ref))

    def poll(self, timeout_s: float) -> Outcomes:
        """The members whose `execute` returned within `timeout_s`, each reported once.
        Ray puts each call that lands in a queue (a ray.wait over every member's call
        each poll cost the driver 0.05 CPU-s a second at 4,096 members)."""
        out = Outcomes({}, [], [])
        deadline = time.monotonic() + timeout_s
        woken = False
        while not (out.finished or out.failed or out.left or woken):
            try:
                landed = [self._landed.get(timeout=max(0.0, deadline - time.monotonic()))]
            except queue.Empty:
                return out
            while not self._landed.empty():
                landed.append(self._landed.get_nowait())
            for ref in landed:
                if ref is _WAKE:
                    woken = True
                else:
                    self._outcome(ref, out)
        return out

    def wake(self) -> None:
        """Ends the poll under way now, or the next one, at once (from any thread): the
        driver has something to look at besides outcomes (a join landed)."""
        self._landed.put(_WAKE)

    def _outcome(self, ref: Any, out: Outcomes) -> None:
        """Adds what the call `ref` returned to `out`, unless its member was removed."""
        member = self._running.pop(ref, None)
        if member is None or member.ref is not ref or \
                self.members.get(member.worker_id) is not member:
            return
        try:
            result = ray.get(ref)
        except (RayActorError, RayTaskError) as exc:
            out.failed.append((member, worker_error(member.rank, exc)))
            return
        if isinstance(result, Left):
            out.left.append((member, result))
        else:
            out.finished[member.worker_id] = result

    def collect(self, finished: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Once one worker finished, the others' results as they finish within
        `timeout_s` (failures and departures are not waited for)."""
        deadline = self.clock() + timeout_s
        while self.clock() < deadline:
            waiting = [m for m in self.members.values()
                       if m.finishes_with_the_job() and m.worker_id not in finished]
            if not waiting:
                break
            ready, _ = ray.wait([m.ref for m in waiting], num_returns=len(waiting),
                                timeout=0.2)
            for m in waiting:
                if m.ref in ready:
                    try:
                        result = ray.get(m.ref)
                    except (RayActorError, RayTaskError):
                        continue
                    if not isinstance(result, Left):
                        finished[m.worker_id] = result
        return finished

    def remove(self, member: Member) -> None:
        """Drops a member that failed or left, and kills its actor."""
        self.members.pop(member.worker_id, None)
        self._running.pop(member.ref, None)
        _kill(member.actor)

    def ask(self, worker_ids: Iterable[str], method: str) -> dict[str, Any]:
        """The answers of the members among `worker_ids` to a probe-thread `method`
        (`failures.ask`); those left out did not answer: cut off, lost, or gone."""
        answers, _ = ask({w: self.members[w].actor for w in worker_ids if w in self.members},
                         method)
        return answers

    def beat(self) -> tuple[dict[str, tuple], set[str], list[str]]:
        """The driver's heartbeat: collects the members' answered `heartbeat` calls (seconds
        in a join, the round of the state held, the work per step) and sends one to the
        members without one out whose turn it is (`heartbeat_turn`). Returns (the answers,
        the members whose call failed, the members a call went out to); never waits."""
        answers: dict[str, tuple] = {}
        failed: set[str] = set()
        out = {m.beat: m for m in self.members.values() if m.beat is not None}
        ready, _ = ray.wait(list(out), num_returns=len(out), timeout=0) if out else ([], [])
        for ref in ready:
            member = out[ref]
            member.beat = None
            try:
                answers[member.worker_id] = tuple(ray.get(ref))
            except Exception:  # noqa: BLE001 - any error: no answer from this member
                failed.add(member.worker_id)
        self.beat_polls += 1
        sent = []
        idle = (m for m in self.members.values() if m.beat is None)
        for member in heartbeat_turn(idle, self.beat_polls):
            member.beat = member.actor.heartbeat.remote()
            sent.append(member.worker_id)
        return answers, failed, sent

    def staying(self, draining: set[str]) -> list[Member]:
        """Members that stay in the job: not leaving, not on a draining node, not asked to
        leave by a policy."""
        return [m for m in self.members.values() if not m.leaving and m.node not in draining
                and m.asked_to_leave is None]

    def kill_all(self) -> None:
        for actor in [m.actor for m in self.members.values()] + \
                [p.actor for p in self.pending.values()]:
            _kill(actor)


def _kill(actor: Any) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # noqa: BLE001 - it may be gone already
        pass
