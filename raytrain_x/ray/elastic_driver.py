"""The elastic driver: keeps a job running while workers come and go.

Each worker actor runs the user function once; its `rx.init()` (and every reset inside
`elastic.run`) waits in the `ElasticRounds` actor until the driver forms a round from all
live workers. Dead workers are dropped and their hosts blacklisted; discovered capacity
starts new workers, and survivors meet them at their next `commit()`.

On an autoscaling cluster the driver asks the autoscaler for the workers it lacks
(`raytrain_x.ray.autoscaling`), and a node Ray drains (scale-down, `ray drain-node`, a
spot preemption notice) has its workers leave at the next commit: nothing is restored or
redone, and the host is not blacklisted. Every round is recorded in `history`.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raytrain_x.comm.store_actor import StoreActor
from raytrain_x.common.errors import ConfigError, ElasticTimeout, ResetLimitExceeded, WorkerError
from raytrain_x.elastic.blacklist import Blacklist
from raytrain_x.elastic.discovery import ScriptDiscovery, slots_from_resources
from raytrain_x.elastic.history import RoundHistory, round_line
from raytrain_x.ray.autoscaling import CapacityRequest, draining_nodes, node_types, request_bundles
from raytrain_x.ray.discovery import RayDiscovery, alive_nodes, resolve_hosts
from raytrain_x.ray.elastic_rounds import ElasticRounds, plan_round
from raytrain_x.ray.failures import unreachable, unreachable_error, worker_error
from raytrain_x.ray.placement import stable_node_strategy
from raytrain_x.ray.worker import Left, Worker

log = logging.getLogger("raytrain_x.elastic")
DRAIN_POLL_S = 0.2  # how often the driver asks the GCS for draining nodes (one small RPC)
STRAGGLER_POLL_S = 1.0  # how often the driver looks for workers missing from a rendezvous


@dataclass
class _Member:
    worker_id: str
    actor: Any
    node: str
    age: int  # start order: the oldest survivor becomes rank 0
    ref: Any = None
    rank: int = -1
    leaving: bool = False  # told to leave (its node drains); gone when its call returns


@dataclass
class _Pending:
    """A worker actor asked for but not answering yet: its process may still be starting."""

    actor: Any
    node: str
    ref: Any  # its first call (node_id): ready once the actor is up
    asked_at: float


@dataclass
class ElasticSettings:
    min_workers: int
    max_workers: int
    cpus_per_worker: float
    gpus_per_worker: float
    resources_per_worker: dict[str, float]
    reset_limit: int | None
    cooldown_range: tuple[float, float] | None
    elastic_timeout: float
    timeout_s: float
    discovery_script: str | None = None
    discovery_interval_s: float = 1.0
    env: dict[str, str] | None = None
    autotune_actor: Any = None
    # How long a worker actor may take to start (its process, imports, runtime_env, an
    # image pull) before it is given up on. Measured on a 2-core machine
    # (benchmarks/worker_start.py, docs/elastic.md): 2-2.5 s alone, 7.7 s for three at once
    # with one core busy, and no start within minutes with both cores saturated; 300 s
    # leaves room for loaded nodes, large runtime_envs and image pulls.
    start_timeout_s: float = 300.0


class ElasticJob:
    """Runs `fn` elastically and returns the results of the workers that finished it."""

    def __init__(self, settings: ElasticSettings, fn: Callable, args: tuple, kwargs: dict):
        self.settings = settings
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.blacklist = Blacklist(settings.cooldown_range)
        per_worker = {"CPU": settings.cpus_per_worker, **settings.resources_per_worker}
        if settings.gpus_per_worker:
            per_worker["GPU"] = settings.gpus_per_worker
        self.per_worker = per_worker
        self.discovery = (ScriptDiscovery(settings.discovery_script)
                          if settings.discovery_script else RayDiscovery(per_worker))
        self.members: dict[str, _Member] = {}
        self.resets = 0  # rounds after the first, drains aside
        self.rounds = 0
        self.events: list[tuple[float, str, str]] = []  # (time, what, host) for tests/logs
        self.cooldowns: list[tuple[str, float, float]] = []  # (host, failed at, seconds out)
        self.pending: dict[Any, _Pending] = {}  # first-call ref -> a worker still starting
        self.gave_up: list[tuple[float, str, str]] = []  # (time, host, why) per worker
        self._gave_up_warned = False
        self._progress_at = 0.0
        self._ids = itertools.count()
        self._ages = itertools.count()
        # The job's own actors live on the head node: worker nodes may vanish at any time.
        here = stable_node_strategy()
        self.rounds_actor = ElasticRounds.options(scheduling_strategy=here).remote()
        self.store = StoreActor.options(scheduling_strategy=here).remote()
        self._needs_round = True
        self._below_min_since: float | None = None
        self._absent_since: float | None = None  # workers missing from a rendezvous since
        self.last_failure: WorkerError | None = None
        # autoscaling clusters: the standing request, the nodes Ray drains (node -> deadline,
        # time.time() seconds) and every node ever seen draining
        self.capacity = CapacityRequest(per_worker)
        self.draining: dict[str, float] = {}
        self.drained_nodes: set[str] = set()
        # one entry per round: why it formed and the cluster's shape
        self.rounds_history = RoundHistory()

    # ------------------------------------------------------------------ main loop
    def run(self) -> list[Any]:
        try:
            self._check_feasible()
            self._check_drains()
            self._scale_up()
            self._update_request()
            next_discovery = time.monotonic() + self.settings.discovery_interval_s
            next_drain_check = time.monotonic() + DRAIN_POLL_S
            next_straggler_check = time.monotonic() + STRAGGLER_POLL_S
            while True:
                finished = self._poll_workers()
                if finished:
                    return self._finish(finished)
                if not self.members and self.last_failure is not None:
                    raise self.last_failure  # every worker failed: the job fails
                if self._poll_pending() and self.rounds:
                    ray.get(self.rounds_actor.bump_hosts.remote())
                    self.events.append((time.monotonic(), "scale_up", ""))
                if time.monotonic() >= next_drain_check:  # a notice may give seconds
                    self._check_drains()
                    next_drain_check = time.monotonic() + DRAIN_POLL_S
                if time.monotonic() >= next_discovery:
                    self._scale_up()
                    self._check_pending()
                    self._update_request()
                    next_discovery = time.monotonic() + self.settings.discovery_interval_s
                if time.monotonic() >= next_straggler_check:
                    self._check_stragglers()
                    next_straggler_check = time.monotonic() + STRAGGLER_POLL_S
                self._check_minimum()
                self._maybe_form_round()
        except BaseException as exc:
            try:
                ray.get(self.rounds_actor.fail.remote(f"the elastic job stopped: {exc}"),
                        timeout=5)
            except Exception:  # noqa: BLE001 - the original error matters more
                pass
            raise
        finally:
            self.capacity.clear()
            self._kill_all()

    def _poll_workers(self) -> dict[str, Any]:
        refs = {m.ref: m for m in self.members.values() if m.ref is not None}
        if not refs:
            time.sleep(0.1)
            return {}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0.1)
        finished = {}
        for ref in ready:
            member = refs[ref]
            try:
                result = ray.get(ref)
            except (RayActorError, RayTaskError) as exc:
                self._on_failure(member, exc)
                continue
            if isinstance(result, Left):
                self._on_left(member, result)
            else:
                finished[member.worker_id] = result
        return finished

    def _check_stragglers(self) -> None:
        """Workers whose peers wait at the rendezvous without them. A worker on a host cut
        off by a partition is alive to Ray (until Ray's own health checks give up on the
        node) but its peers lost it at their last collective; it would hold the next round
        forever. Absent for a poll, it is pinged; silent, it fails like a dead worker (its
        host is blacklisted for the cooldown)."""
        waiting = set(ray.get(self.rounds_actor.waiting.remote()))
        present = {w: m for w, m in self.members.items() if not m.leaving}
        absent = [m for w, m in present.items() if w not in waiting]
        if not absent or not waiting & set(present):
            self._absent_since = None
            return
        self._needs_round = True  # a worker reset by itself: it lost a peer
        if self._absent_since is None:
            self._absent_since = time.monotonic()
            return
        self._absent_since = None
        lost = unreachable({m.worker_id: m.actor for m in absent})
        if not lost:
            return
        ranks = sorted(self.members[w].rank for w in lost)
        errors = unreachable_error(ranks, [self.members[w].node for w in lost],
                                   "while their peers waited for them at the rendezvous")
        for worker_id in lost:
            member = self.members[worker_id]
            self._on_failure(member, errors[member.rank])

    def _on_left(self, member: _Member, left: Left) -> None:
        """A worker left at a commit, as asked: no failure, no blacklist, no reset."""
        del self.members[member.worker_id]
        self.events.append((time.monotonic(), "left", member.node))
        log.info("raytrain-x elastic: worker %s left the job (%s)", member.worker_id,
                 left.reason)
        try:
            ray.kill(member.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass

    def _on_failure(self, member: _Member, exc: Exception) -> None:
        del self.members[member.worker_id]
        self.rounds_history.note("failure", failed=1)
        self.last_failure = worker_error(member.rank, exc)
        self._needs_round = True
        if member.node in self.drained_nodes:
            # its node was draining and went before the worker reached a commit: the node
            # is gone for good, nothing to blacklist
            self.events.append((time.monotonic(), "lost_draining", member.node))
            log.warning("raytrain-x elastic: worker %s (rank %d) was lost with its draining "
                        "node %s before its next commit; the others restore the last commit",
                        member.worker_id, member.rank, member.node[:8])
        else:
            wait = self.blacklist.record_failure(member.node)
            self.events.append((time.monotonic(), "failure", member.node))
            self.cooldowns.append((member.node, time.monotonic(), wait))
            log.warning("raytrain-x elastic: worker %s (rank %d) on node %s failed; host "
                        "blacklisted for %s", member.worker_id, member.rank, member.node[:8],
                        "good" if wait == float("inf") else f"{wait:.1f}s")
        try:
            ray.kill(member.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already dead
            pass

    def _finish(self, finished: dict[str, Any]) -> list[Any]:
        """A worker finished: the job is done. Others get `timeout_s` to finish too."""
        deadline = time.monotonic() + self.settings.timeout_s
        while time.monotonic() < deadline:
            pending = [m for m in self.members.values() if m.ref is not None
                       and m.worker_id not in finished and not m.leaving]
            if not pending:
                break
            ready, _ = ray.wait([m.ref for m in pending], num_returns=len(pending),
                                timeout=0.2)
            for m in pending:
                if m.ref in ready:
                    try:
                        result = ray.get(m.ref)
                    except (RayActorError, RayTaskError):
                        continue
                    if not isinstance(result, Left):
                        finished[m.worker_id] = result
        order = sorted(finished, key=lambda w: self.members[w].rank
                       if w in self.members else 1 << 30)
        return [finished[w] for w in order]

    # ------------------------------------------------------------------ capacity
    def _free_slots(self) -> dict[str, int]:
        reported = self.discovery.hosts()
        if isinstance(self.discovery, ScriptDiscovery):
            reported = resolve_hosts(reported)
            used: dict[str, int] = {}
            for m in self.members.values():
                used[m.node] = used.get(m.node, 0) + 1
            reported = {h: n - used.get(h, 0) for h, n in reported.items()}
        return {h: n for h, n in reported.items() if n > 0 and h not in self.draining
                and not self.blacklist.is_blacklisted(h)}

    def _staying(self) -> list[_Member]:
        """Members that stay in the job: not leaving, not on a draining node."""
        return [m for m in self.members.values()
                if not m.leaving and m.node not in self.draining]

    def _update_request(self) -> None:
        """Asks the autoscaler for room for `max_workers` while the job has fewer (running
        or starting); withdraws the request once it has them. Nodes the job cannot use
        (blacklisted, draining) are asked for on top, since Ray counts their capacity."""
        if isinstance(self.discovery, ScriptDiscovery):
            return  # the user's script decides the hosts
        short = self.settings.max_workers - len(self._staying()) - len(self.pending)
        if short <= 0:
            self.capacity.ask(0)
            return
        totals = alive_nodes()
        unusable = sum(slots_from_resources(totals[n], self.per_worker) for n in totals
                       if n in self.draining or self.blacklist.is_blacklisted(n))
        self.capacity.ask(request_bundles(self.settings.max_workers, unusable))

    def _check_feasible(self) -> None:
        """Fails before any worker starts when no node, and no node type the autoscaler
        publishes, can fit one worker."""
        if isinstance(self.discovery, ScriptDiscovery):
            return
        nodes = alive_nodes()
        if any(slots_from_resources(res, self.per_worker) >= 1 for res in nodes.values()):
            return
        types = node_types()
        if types is None or any(slots_from_resources(res, self.per_worker) >= 1
                                for res in types.values()):
            return  # an autoscaler that publishes no node types may still have one
        offered = sorted({_shape(res) for res in [*nodes.values(), *types.values()]})
        raise ConfigError(
            f"a worker needs {_shape(self.per_worker)}, which no node of this cluster and no "
            f"node type of its autoscaler offers (they offer: {'; '.join(offered)}). Lower "
            "cpus_per_worker/gpus_per_worker/resources_per_worker, or add a node type that "
            "has them to the cluster config.")

    def _check_drains(self) -> None:
        """Notices nodes Ray is draining: their starting workers are given up, their
        members leave at the next commit (every rank is interrupted there, as for new
        hosts), and their capacity is no longer used."""
        now = time.monotonic()
        draining = draining_nodes()
        new = {n: d for n, d in draining.items() if n not in self.draining}
        self.draining = draining
        interrupt = False
        for node, deadline in sorted(new.items()):
            self.drained_nodes.add(node)
            self.events.append((now, "drain", node))
            for pending in [p for p in self.pending.values() if p.node == node]:
                self._give_up(pending, "its node is draining")
            ours = [m for m in self.members.values() if m.node == node]
            if not ours:
                continue
            interrupt = True
            left_s = deadline - time.time()
            when = "no deadline" if left_s == float("inf") else f"deadline in {left_s:.0f} s"
            _progress(f"node {node[:8]} is draining ({when}); its {len(ours)} worker(s) leave "
                      "the job at the next commit")
        if interrupt:
            self.rounds_history.note("drain")
            self._needs_round = True
            ray.get(self.rounds_actor.bump_hosts.remote())

    def _scale_up(self) -> int:
        """Asks for workers on free slots up to max_workers; returns how many were asked for.
        They join when they answer (`_poll_pending`), however long their start takes."""
        room = self.settings.max_workers - len(self.members) - len(self.pending)
        if room <= 0:
            return 0
        nodes = [node for node, slots in sorted(self._free_slots().items())
                 for _ in range(slots)][:room]
        resources = {k: v for k, v in self.per_worker.items() if k not in ("CPU", "GPU")}
        now = time.monotonic()
        for node in nodes:
            self.events.append((now, "place", node))
            actor = Worker.options(
                num_cpus=self.settings.cpus_per_worker, num_gpus=self.settings.gpus_per_worker,
                resources=resources or None,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
            ref = actor.node_id.remote()
            self.pending[ref] = _Pending(actor, node, ref, now)
        return len(nodes)

    def _poll_pending(self) -> int:
        """Turns workers that answered into members; returns how many joined."""
        if not self.pending:
            return 0
        ready, _ = ray.wait(list(self.pending), num_returns=len(self.pending), timeout=0)
        joined = 0
        for ref in ready:
            pending = self.pending.pop(ref)
            try:
                ray.get(ref)
            except (RayActorError, RayTaskError) as exc:
                self._give_up(pending, "its node left the cluster"
                              if pending.node not in alive_nodes()
                              else f"its actor died while starting: {_first_line(exc)}")
                continue
            worker_id = f"w{next(self._ids)}"
            settings = self.settings
            try:  # its node may go between its answer and this call
                ray.get(pending.actor.setup_elastic.remote(
                    worker_id, self.rounds_actor, self.store, settings.timeout_s,
                    settings.env or {}, settings.autotune_actor))
            except (RayActorError, RayTaskError) as exc:
                self._give_up(pending, f"its actor died while starting: {_first_line(exc)}")
                continue
            member = _Member(worker_id, pending.actor, pending.node, next(self._ages))
            member.ref = pending.actor.execute.remote(self.fn, self.args, self.kwargs)
            self.members[worker_id] = member
            self._needs_round = True
            self.rounds_history.note("scale_up" if self.rounds else "start", joined=1)
            self.events.append((time.monotonic(), "start", pending.node))
            log.info("raytrain-x elastic: a worker on %s started after %.1fs", pending.node[:8],
                     time.monotonic() - pending.asked_at)
            joined += 1
        return joined

    def _check_pending(self) -> None:
        """Gives up on a pending worker only when it cannot start: its node left, the node
        can no longer fit a worker even when empty, or it did not start within
        `start_timeout_s` (its death while starting is seen by `_poll_pending`). A worker
        that is merely slow is waited for. Ray's actor table cannot tell a slow start from
        an unplaceable actor: during a `runtime_env` setup the lease already holds the
        slot while no worker process exists, just as when another job holds it."""
        if not self.pending:
            return
        now = time.monotonic()
        totals = alive_nodes()
        for pending in list(self.pending.values()):
            if pending.node not in totals:
                self._give_up(pending, "its node left the cluster")
            elif slots_from_resources(totals[pending.node], self.per_worker) < 1:
                self._give_up(pending, "its node can no longer fit a worker")
            elif now - pending.asked_at > self.settings.start_timeout_s:
                self._give_up(pending, f"it did not start within start_timeout_s="
                                       f"{self.settings.start_timeout_s:g}s")
        if self.pending and now - self._progress_at >= 5.0:
            self._progress_at = now
            oldest = max(now - p.asked_at for p in self.pending.values())
            line = (f"raytrain-x elastic: waiting for {len(self.pending)} workers to start "
                    f"({oldest:.0f} s)")
            log.info(line)
            print(line, flush=True)

    def _give_up(self, pending: _Pending, why: str) -> None:
        self.pending.pop(pending.ref, None)
        try:
            ray.kill(pending.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - it may be gone already
            pass
        now = time.monotonic()
        self.gave_up.append((now, pending.node, why))
        self.events.append((now, "gave_up", pending.node))
        log.warning("raytrain-x elastic: gave up on a worker for %s after %.0f s: %s",
                    pending.node[:8], now - pending.asked_at, why)
        if len(self.gave_up) >= 3 and not self._gave_up_warned:
            self._gave_up_warned = True
            causes = sorted({w for _, _, w in self.gave_up})
            log.warning("raytrain-x elastic: this job keeps giving up on starting workers "
                        "(%d so far): %s", len(self.gave_up), "; ".join(causes))

    def _check_minimum(self) -> None:
        staying = len(self._staying())
        if staying >= self.settings.min_workers:
            self._below_min_since = None
            return
        now = time.monotonic()
        if self._below_min_since is None:
            self._below_min_since = now
            log.warning("raytrain-x elastic: %d workers, fewer than min_workers=%d; waiting up "
                        "to %.0fs for capacity", staying, self.settings.min_workers,
                        self.settings.elastic_timeout)
        elif now - self._below_min_since > self.settings.elastic_timeout:
            starting = f" ({len(self.pending)} still starting)" if self.pending else ""
            asked = (f"; asked the autoscaler for room for {self.capacity.bundles} workers of "
                     f"{_shape(self.per_worker)} and none came"
                     if self.capacity.bundles else "")
            raise ElasticTimeout(
                f"only {staying} workers{starting} for "
                f"{self.settings.elastic_timeout:.0f}s, "
                "fewer than "
                f"min_workers={self.settings.min_workers}{asked}; blacklisted hosts: "
                f"{[h[:8] for h in self.blacklist.blacklisted()]}. Add capacity (or node "
                "types that fit a worker), lower min_workers or raise elastic_timeout.")

    # ------------------------------------------------------------------ rounds
    def _maybe_form_round(self) -> None:
        if not self._needs_round:
            return
        waiting = set(ray.get(self.rounds_actor.waiting.remote()))
        leaving = {w: {"leave": True, "reason": f"node {self.members[w].node[:8]} is draining"}
                   for w in waiting if w in self.members and not self.members[w].leaving
                   and self.members[w].node in self.draining}
        if leaving:  # they return from `execute` with `Left`; `_poll_workers` drops them
            ray.get(self.rounds_actor.publish.remote(leaving))
            for worker_id in leaving:
                self.members[worker_id].leaving = True
            self.rounds_history.note("drain", left=len(leaving))
        staying = {m.worker_id: m for m in self._staying()}
        if len(staying) < self.settings.min_workers:
            return
        if not staying or not set(staying) <= waiting:
            return  # survivors are still on their way to the rendezvous
        if self.rounds_history.is_reset():
            self.resets += 1
        if self.settings.reset_limit is not None and self.resets > self.settings.reset_limit:
            raise ResetLimitExceeded(
                f"the job reset {self.resets} times, more than reset_limit="
                f"{self.settings.reset_limit}; the last failure: {self.last_failure or ''}")
        version = ray.get(self.rounds_actor.hosts_version.remote())
        self.rounds += 1
        assignments = plan_round({m.worker_id: (m.node, m.age) for m in staying.values()},
                                 self.rounds, version)
        for worker_id, place in assignments.items():
            self.members[worker_id].rank = place["rank"]
        ray.get(self.rounds_actor.publish.remote(assignments))
        self._needs_round = False
        self.events.append((time.monotonic(), "round", str(len(assignments))))
        self._record_round(staying)

    def _record_round(self, staying: dict[str, _Member]) -> None:
        """Adds the round to the history and prints its progress line."""
        entry = self.rounds_history.record(
            self.rounds, len(staying), len({m.node for m in staying.values()}),
            len(self.pending), self.capacity.bundles, len(self.draining))
        _progress(round_line(entry))

    @property
    def history(self) -> list[dict[str, Any]]:
        return self.rounds_history.entries

    def _kill_all(self) -> None:
        for m in [*self.members.values(), *self.pending.values()]:
            try:
                ray.kill(m.actor, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        for actor in (self.rounds_actor, self.store):
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001
                pass


def _progress(line: str) -> None:
    """A line for the driver's user: logged, and printed (a notebook shows no log)."""
    log.info("raytrain-x elastic: %s", line)
    print(f"raytrain-x elastic: {line}", flush=True)


def _shape(resources: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(resources.items())
                           if v and not k.startswith("node:")
                           and k not in ("memory", "object_store_memory")) + "}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__
