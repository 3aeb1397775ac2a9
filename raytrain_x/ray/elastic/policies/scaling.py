"""Scaling: how many workers to start and where, what to ask the autoscaler for, when a
starting worker is given up on, and `min_workers` over time."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from raytrain_x.common.errors import (
    ConfigError,
    ElasticTimeout,
)
from raytrain_x.common.settings import short_node
from raytrain_x.ray.elastic.blacklist import Blacklist
from raytrain_x.ray.elastic.discovery import slots_from_resources
from raytrain_x.ray.elastic.policies.views import PendingView
from raytrain_x.ray.elastic.settings import ElasticSettings


def shape(resources: Mapping[str, float]) -> str:
    """Resources as a user reads them: `{CPU: 1, GPU: 1}`."""
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(resources.items())
                           if v and not k.startswith("node:")
                           and k not in ("memory", "object_store_memory")) + "}"


class ScalingPolicy:
    """How many workers to start and where, what to ask the autoscaler for, and when a
    worker that is starting is given up on."""

    def __init__(self, settings: ElasticSettings) -> None:
        self.settings = settings
        self.per_worker = settings.per_worker

    def usable_slots(self, free: Mapping[str, int], draining: Iterable[str],
                     blacklist: Blacklist) -> dict[str, int]:
        """The free worker slots the job may use: not on a draining or blacklisted host."""
        draining = set(draining)
        return {h: n for h, n in free.items() if n > 0 and h not in draining
                and not blacklist.is_blacklisted(h)}

    def starts(self, usable: Mapping[str, int], members: int, pending: int,
               last_resort: Iterable[str] | Mapping[str, float] = (),
               staying: int | None = None,
               starting: Iterable[str] = (), proven: Iterable[str] = (),
               stale: int = 0) -> list[str]:
        """The nodes to start workers on (one entry per worker), up to `max_workers`
        counting those running and starting, and up to `min_workers` counting only the
        members that stay (`staying`; those on draining nodes leave, though they may stay
        a while holding the state: with `max_workers` all on draining nodes, nothing would
        start to take it over). Nodes in id order, each filled in turn; after them those
        where a worker is still starting (`starting`), and after every
        other the `last_resort` ones (a worker lately did not start there; given as node ->
        the last give-up's time, the oldest first: a node whose only failure was long ago
        is not starved by two that keep failing). A node that
        cannot start workers is found out only when a start there times out: it would
        otherwise take every start, one after the other, while others idle. For the same
        reason, once some node is `proven` (a worker of the job started there), a node
        where none has takes one start before any node takes a second: its other slots
        come after every node's first (a job's first placement still packs nodes).

        Below `min_workers`, the `stale` starts (waiting past `hedge_after_s`) do not count
        toward it: one more starts beside each, on another node when one has room (a
        hedge; `surplus` gives up on the stale one once enough have joined). Without it, a
        node whose starts hang holds the job's whole room until `start_timeout_s`, while a
        node that could start one idles and the job runs out its `elastic_timeout`."""
        room = self.settings.max_workers - members - pending
        if staying is not None:
            room = max(room, self.settings.min_workers - staying - (pending - stale))
        if room <= 0:
            return []
        last = dict(last_resort) if isinstance(last_resort, Mapping) else \
            dict.fromkeys(last_resort, 0.0)
        busy, known = set(starting), set(proven)
        order = sorted(usable.items(), key=lambda item: (
            item[0] in last, item[0] in busy, last.get(item[0], 0.0), item[0]))
        if not known:
            return [node for node, slots in order for _ in range(slots)][:room]
        first = [node for node, slots in order
                 for _ in range(slots if node in known else min(slots, 1))]
        rest = [node for node, slots in order if node not in known
                for _ in range(slots - 1)]
        return (first + rest)[:room]

    @property
    def hedge_after_s(self) -> float:
        """How long a start may wait before a job below `min_workers` hedges it."""
        return self.settings.start_timeout_s / 2

    def stale(self, pending: Iterable[PendingView], now: float) -> list[PendingView]:
        """The starts waiting past `hedge_after_s`, the oldest first."""
        return sorted((p for p in pending if now - p.asked_at > self.hedge_after_s),
                      key=lambda p: p.asked_at)

    def surplus(self, pending: Iterable[PendingView], staying: int,
                now: float) -> list[PendingView]:
        """The stale starts to give up on because hedges took their place: once the job
        has `min_workers` again (the hedges joined: none is given up before, however many
        are starting, since a slow start may still be the first to arrive), those that
        would take it past `max_workers`, the oldest first."""
        pending = list(pending)
        if staying < self.settings.min_workers:
            return []
        excess = staying + len(pending) - self.settings.max_workers
        return self.stale(pending, now)[:max(0, excess)]

    def bundles(self, staying: int, pending: int, unusable_slots: int) -> int:
        """How many worker bundles to ask the autoscaler for: room for `max_workers` while
        the job has fewer (running or starting), 0 once it has them; a job without a
        `max_workers` (every free slot) asks for `min_workers`. Ray counts the capacity of
        blacklisted and draining nodes too, so their slots are asked for on top, or the
        autoscaler would add nothing in their place."""
        target = self.settings.max_workers if self.settings.bounded else \
            self.settings.min_workers
        if target - staying - pending <= 0:
            return 0
        return target + max(0, unusable_slots)

    def give_ups(self, pending: Iterable[PendingView],
                 node_totals: Mapping[str, Mapping[str, float]],
                 now: float) -> list[tuple[object, str]]:
        """The starting workers to give up on, with why: their node left, it can no longer
        fit a worker even when empty, or they did not start within `start_timeout_s`. A
        worker that is merely slow is waited for: Ray cannot tell a slow start (a
        runtime_env being set up holds the slot with no process yet) from an unplaceable
        one."""
        out = []
        for p in pending:
            if p.node not in node_totals:
                out.append((p.key, "its node left the cluster"))
            elif slots_from_resources(node_totals[p.node], self.per_worker) < 1:
                out.append((p.key, "its node can no longer fit a worker"))
            elif now - p.asked_at > self.settings.start_timeout_s:
                out.append((p.key, f"it did not start within start_timeout_s="
                                   f"{self.settings.start_timeout_s:g}s"))
        return out

    def check_feasible(self, nodes: Mapping[str, Mapping[str, float]],
                       node_types: Mapping[str, Mapping[str, float]] | None) -> None:
        """A `ConfigError` when no node, and no node type the autoscaler publishes, can fit
        one worker (an autoscaler that publishes none may still have one)."""
        if any(slots_from_resources(res, self.per_worker) >= 1 for res in nodes.values()):
            return
        if node_types is None or any(slots_from_resources(res, self.per_worker) >= 1
                                     for res in node_types.values()):
            return
        offered = sorted({shape(res) for res in [*nodes.values(), *node_types.values()]})
        raise ConfigError(
            f"a worker needs {shape(self.per_worker)}, which no node of this cluster and no "
            f"node type of its autoscaler offers (they offer: {'; '.join(offered)}). Lower "
            "cpus_per_worker/gpus_per_worker/resources_per_worker, or add a node type that "
            "has them to the cluster config.")


def last_resort_nodes(gave_up: Iterable[tuple[float, str, str]],
                      started: Iterable[tuple[float, str]]) -> dict[str, float]:
    """The nodes to start workers on only after every other (`ScalingPolicy.starts`): those
    where the driver gave up on a starting worker (`gave_up`: time, node, why) since a
    worker last started there (`started`: time, node). A node whose workers never start
    within `start_timeout_s` stays one until one does: forgotten after a while, it would
    take every start again, each costing the timeout, while a node that can start them
    idles. Each with the time of its last give-up: among them, the one given up on
    longest ago goes first, so every one gets its turn."""
    last_start: dict[str, float] = {}
    for at, node in started:
        last_start[node] = max(at, last_start.get(node, at))
    out: dict[str, float] = {}
    for at, node, why in gave_up:
        if "start" in why and at > last_start.get(node, float("-inf")):
            out[node] = max(at, out.get(node, at))
    return out


class MinimumWatch:
    """`min_workers` over time: fewer staying workers than that are waited for up to
    `elastic_timeout`, then the job fails (`elastic_timeout_error`)."""

    def __init__(self, settings: ElasticSettings) -> None:
        self.settings = settings
        self.below_since: float | None = None
        self.warned = False

    def observe(self, staying: int, now: float, starting: int = 0) -> str:
        """'ok'; 'below' once per stretch below the minimum, at the first poll at which the
        workers starting cannot make it up either (warn once: a job's start, with every
        worker on its way, is not short of capacity); 'waiting' otherwise; 'timeout' once
        below for longer than `elastic_timeout`, starting workers or not."""
        if staying >= self.settings.min_workers:
            self.below_since, self.warned = None, False
            return "ok"
        if self.below_since is None:
            self.below_since = now
        if now - self.below_since > self.settings.elastic_timeout:
            return "timeout"
        if not self.warned and staying + starting < self.settings.min_workers:
            self.warned = True
            return "below"
        return "waiting"


def elastic_timeout_error(settings: ElasticSettings, staying: int, starting: int,
                          bundles: int, blacklisted: list[str]) -> ElasticTimeout:
    """The error of a job that stayed below `min_workers` past `elastic_timeout`, with
    what it was waiting for and what to change."""
    waiting = f" ({starting} still starting)" if starting else ""
    asked = (f"; asked the autoscaler for room for {bundles} workers of "
             f"{shape(settings.per_worker)} and none came") if bundles else ""
    return ElasticTimeout(
        f"only {staying} workers{waiting} for {settings.elastic_timeout:.0f}s, fewer than "
        f"min_workers={settings.min_workers}{asked}; blacklisted hosts: "
        f"{[short_node(h) for h in blacklisted]}. Add capacity (or node types that fit a "
        "worker), "
        "lower min_workers or raise elastic_timeout.")
