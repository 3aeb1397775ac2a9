"""Where workers can run: Ray's alive nodes and their free resources."""

from __future__ import annotations

from collections.abc import Mapping

import ray

from raytrain_x.ray import internals
from raytrain_x.ray.elastic.discovery import slots_from_resources


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


def resolve_hosts(reported: Mapping[str, int]) -> dict[str, int]:
    """Maps user host names (IP, hostname or node id) to alive Ray node ids."""
    by_name: dict[str, str] = {}
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        for key in (node["NodeID"], node.get("NodeManagerAddress"), node.get("NodeName"),
                    node.get("NodeManagerHostname")):
            if key:
                by_name[str(key)] = node["NodeID"]
    return {by_name[h]: slots for h, slots in reported.items() if h in by_name}
