"""Where workers can run: Ray's alive nodes and their free resources."""

from __future__ import annotations

from collections.abc import Mapping

import ray

from raytrain_x.ray import internals
from raytrain_x.ray.elastic.discovery import slots_from_resources
from raytrain_x.ray.placement import resolve_hosts

__all__ = ["RayDiscovery", "alive_nodes", "resolve_hosts"]


def alive_nodes() -> dict[str, dict[str, float]]:
    """Ray's alive nodes: node id -> total resources."""
    return {n["NodeID"]: n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")}


class RayDiscovery:
    """Free worker slots on Ray's alive nodes, from their available resources."""

    def __init__(self, per_worker: Mapping[str, float]) -> None:
        self.per_worker = dict(per_worker)

    def hosts(self) -> dict[str, int]:
        alive = alive_nodes()
        per_node = internals.available_resources_per_node()
        return {node: slots_from_resources(res, self.per_worker)
                for node, res in per_node.items() if node in alive}
