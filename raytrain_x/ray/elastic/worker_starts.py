"""Starting the elastic job's workers: where to start them, the autoscaler's standing
request, the starting workers' progress, give-ups and `min_workers` over time."""

from __future__ import annotations

import logging
from typing import Any

from raytrain_x.common.logs import progress_logger
from raytrain_x.common.settings import PROGRESS_EVERY_S, short_node
from raytrain_x.ray.elastic.context import JobContext
from raytrain_x.ray.elastic.policies import (
    MinimumWatch,
    NewcomersWaiting,
    ScalingPolicy,
    elastic_timeout_error,
    last_resort_nodes,
)
from raytrain_x.ray.elastic.settings import GAVE_UP_WARNING_AT

log = logging.getLogger("raytrain_x.elastic")
progress = progress_logger("raytrain_x.elastic.progress")


class WorkerStarts:
    """Carries out what `ScalingPolicy` and `MinimumWatch` decide."""

    def __init__(self, ctx: JobContext) -> None:
        self.ctx = ctx
        self.scaling = ScalingPolicy(ctx.settings)
        self.minimum = MinimumWatch(ctx.settings)
        self._progress_at = 0.0
        self._gave_up_warned = False

    def check_feasible(self) -> None:
        """Stops a job no node type of the cluster can hold a worker of (before waiting)."""
        cluster = self.ctx.cluster
        if not cluster.scripted:
            self.scaling.check_feasible(cluster.nodes(), cluster.node_types())

    def _used_slots(self) -> dict[str, int]:
        """The job's workers on each node, those still starting included: a discovery
        script reports total slots, and a start under way already takes one (counted only
        once it answered, the next look asked for a second worker on the same slot, which
        never started)."""
        used: dict[str, int] = {}
        for node in [m.node for m in self.ctx.members.values()] + \
                [p.node for p in self.ctx.pending.values()]:
            used[node] = used.get(node, 0) + 1
        return used

    def scale_up(self) -> None:
        """Asks for workers on free slots up to max_workers, and up to min_workers staying
        ones (`ScalingPolicy.starts`). They join when they answer (`poll_pending`), however
        long their start takes."""
        ctx = self.ctx
        usable = self.scaling.usable_slots(ctx.cluster.free_slots(self._used_slots()),
                                           ctx.draining, ctx.blacklist)
        slow = last_resort_nodes(ctx.log.gave_up, [(e.time, e.host) for e in ctx.log.of("start")])
        starting = {p.node for p in ctx.pending.values()}
        proven = {e.host for e in ctx.log.of("start")}
        stale = self.scaling.stale([p.view() for p in ctx.pending.values()], ctx.clock())
        for node in self.scaling.starts(usable, len(ctx.members), len(ctx.pending), slow,
                                        staying=len(ctx.staying()), starting=starting,
                                        proven=proven, stale=len(stale)):
            ctx.log.add("place", node)
            ctx.pool.start(node)

    def update_request(self) -> None:
        """The standing autoscaler request (none with a discovery script: it decides)."""
        ctx = self.ctx
        if ctx.cluster.scripted:
            return
        staying, starting = len(ctx.staying()), len(ctx.pending)
        unusable = 0
        if ctx.settings.max_workers - staying - starting > 0:
            unusable = ctx.cluster.unusable_slots(
                set(ctx.draining) | set(ctx.blacklist.blacklisted()))
        ctx.cluster.capacity.ask(self.scaling.bundles(staying, starting, unusable))

    def poll_pending(self, fn: Any, args: tuple, kwargs: dict) -> list[NewcomersWaiting]:
        """Turns workers that answered into members (they run `fn(*args, **kwargs)`);
        returns them as the change a round must take in (none: none did)."""
        ctx = self.ctx
        settings = ctx.settings

        def setup(actor: Any, worker_id: str) -> Any:
            return actor.setup_elastic.remote(worker_id, ctx.rounds_client.actor,
                                              ctx.store.actor,
                                              settings.timeout_s, settings.env or {},
                                              settings.autotune_actor)

        joined, died = ctx.pool.poll_pending(setup, fn, args, kwargs)
        for pending, exc in died:
            gone = pending.node not in ctx.cluster.nodes()
            self.give_up(pending.ref, "its node left the cluster" if gone
                         else f"its actor died while starting: {_first_line(exc)}")
        for member in joined:
            ctx.log.add("start", member.node)
        # a hedged start and the one it hedged may both join: the later ones past
        # max_workers go
        for member in joined[::-1][:max(0, len(ctx.staying()) - settings.max_workers)]:
            log.info("raytrain-x elastic: a worker on %s started past max_workers=%d (a "
                     "hedged start and the one it hedged both did); it leaves",
                     short_node(member.node), settings.max_workers)
            ctx.pool.remove(member)
        return [NewcomersWaiting(len(joined))] if joined else []

    def check_pending(self) -> None:
        """Gives up on starting workers that cannot start (`ScalingPolicy.give_ups`) and
        shows progress on the others every few seconds."""
        ctx = self.ctx
        if not ctx.pending:
            return
        now = ctx.clock()
        verdicts = self.scaling.give_ups([p.view() for p in ctx.pending.values()],
                                         ctx.cluster.nodes(), now)
        for key, why in verdicts:
            self.give_up(key, why)
        for p in self.scaling.surplus([p.view() for p in ctx.pending.values()],
                                      len(ctx.staying()), now):
            self.give_up(p.key, "a hedged start took its place")
        if ctx.pending and now - self._progress_at >= PROGRESS_EVERY_S:
            self._progress_at = now
            oldest = max(now - p.asked_at for p in ctx.pending.values())
            progress.info("raytrain-x elastic: waiting for %d workers to start (%.0f s)",
                          len(ctx.pending), oldest)

    def give_up(self, key: Any, why: str) -> None:
        ctx = self.ctx
        pending = ctx.pool.give_up(key)
        if pending is None:
            return
        ctx.log.add("gave_up", pending.node, why=why)
        log.warning("raytrain-x elastic: gave up on a worker for %s after %.0f s: %s",
                    short_node(pending.node), ctx.clock() - pending.asked_at, why)
        gave_up = ctx.log.gave_up
        if len(gave_up) >= GAVE_UP_WARNING_AT and not self._gave_up_warned:
            self._gave_up_warned = True
            causes = sorted({w for _, _, w in gave_up})
            log.warning("raytrain-x elastic: this job keeps giving up on starting workers "
                        "(%d so far): %s", len(gave_up), "; ".join(causes))

    def check_minimum(self) -> None:
        """Warns when fewer than `min_workers` stay; stops the job past `elastic_timeout`."""
        ctx = self.ctx
        staying = len(ctx.staying())
        verdict = self.minimum.observe(staying, ctx.clock(), len(ctx.pending))
        if verdict == "below":
            log.warning("raytrain-x elastic: %d workers, fewer than min_workers=%d; waiting up "
                        "to %.0fs for capacity", staying, ctx.settings.min_workers,
                        ctx.settings.elastic_timeout)
        elif verdict == "timeout":
            raise elastic_timeout_error(ctx.settings, staying, len(ctx.pending),
                                        ctx.cluster.capacity.bundles
                                        if ctx.cluster.autoscaled else 0,
                                        ctx.blacklist.blacklisted())


def _first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type's name if it has none)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
