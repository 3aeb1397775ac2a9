"""The elastic job's view of the cluster: alive nodes and their resources, free worker
slots, draining nodes, the autoscaler's node types and the standing capacity request. The
controller reads the cluster only through it."""

from __future__ import annotations

from typing import Any

from raytrain_x.ray.autoscaling import CapacityRequest, draining_nodes, node_types
from raytrain_x.ray.elastic.discovery import (
    ObjectDiscovery,
    ScriptDiscovery,
    StaticDiscovery,
    slots_from_resources,
)
from raytrain_x.ray.elastic.ray_nodes import RayDiscovery, alive_nodes, resolve_hosts
from raytrain_x.ray.elastic.settings import ElasticSettings
from raytrain_x.ray.failures import node_addresses


class ClusterView:
    def __init__(self, settings: ElasticSettings) -> None:
        self.per_worker = settings.per_worker
        self.scripted = (settings.discovery_script is not None or settings.hosts is not None
                         or settings.discovery is not None)
        if settings.discovery is not None:
            self.discovery: Any = ObjectDiscovery(settings.discovery)
        elif settings.hosts is not None:
            self.discovery = StaticDiscovery(settings.hosts)
        elif settings.discovery_script is not None:
            self.discovery = ScriptDiscovery(settings.discovery_script,
                                             default_slots=settings.slots_per_host)
        else:
            self.discovery = RayDiscovery(self.per_worker)
        self.capacity = CapacityRequest(self.per_worker)
        self._discovered: set[str] | None = None
        self._types: dict[str, dict[str, float]] | None = None
        self._types_read = False

    def nodes(self) -> dict[str, dict[str, float]]:
        """Alive node id -> total resources."""
        return alive_nodes()

    def free_slots(self, used: dict[str, int]) -> dict[str, int]:
        """Node id -> worker slots free now. A discovery script reports host names and
        total slots: they are resolved to nodes and the job's own `used` slots deducted."""
        reported = self.discovery.hosts()
        if self.scripted:
            reported = resolve_hosts(reported)
            self._discovered = set(reported)
            reported = {h: n - used.get(h, 0) for h, n in reported.items()}
        return reported

    def discovered(self) -> set[str] | None:
        """The nodes the discovery script (or host list) listed at its latest look; None
        without one (Ray's nodes are the hosts) or before its first."""
        return None if self._discovered is None else set(self._discovered)

    def addresses(self) -> dict[str, str]:
        """Node id -> address, for messages that name a node."""
        return node_addresses()

    def draining(self) -> dict[str, float]:
        """Draining node id -> deadline (time.time() seconds, inf without one)."""
        return draining_nodes()

    def node_types(self) -> dict[str, dict[str, float]] | None:
        """The autoscaler's node types, read once (None: no autoscaler, or it does not say)."""
        if not self._types_read:
            self._types, self._types_read = node_types(), True
        return self._types

    @property
    def autoscaled(self) -> bool:
        """Whether an autoscaler serves the cluster: what the job asks it for is only worth
        saying where one does (the request itself is harmless without one)."""
        return self.node_types() is not None

    def unusable_slots(self, unusable: set[str]) -> int:
        """The worker slots of the `unusable` alive nodes (blacklisted, draining)."""
        totals = self.nodes()
        return sum(slots_from_resources(totals[n], self.per_worker) for n in totals
                   if n in unusable)
