"""Placement groups and the rank layout that follows from where actors landed."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group

from raytrain_x.common.errors import ConfigError, PlacementTimeout


@dataclass(frozen=True)
class Slot:
    """Where one worker runs and its place in the world."""

    rank: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    node_id: str


def assign_ranks(node_ids: list[str]) -> list[Slot]:
    """Ranks for workers given the node each landed on (in actor creation order).

    Workers on one node get consecutive ranks; nodes are ordered by their first worker, so
    rank 0 stays on the first worker's node. Returns slots indexed like `node_ids`.
    """
    per_node: dict[str, list[int]] = {}  # in the order of each node's first worker
    for index, node in enumerate(node_ids):
        per_node.setdefault(node, []).append(index)
    slots: list[Slot | None] = [None] * len(node_ids)
    rank = 0
    for cross_rank, (node, members) in enumerate(per_node.items()):
        for local_rank, index in enumerate(members):
            slots[index] = Slot(rank, local_rank, len(members), cross_rank, len(per_node),
                                node)
            rank += 1
    return [s for s in slots if s is not None]


LOCAL_NAMES = ("localhost", "127.0.0.1")  # the driver's node, as horovodrun's -H means it


def resolve_hosts(reported: Mapping[str, int]) -> dict[str, int]:
    """Maps user host names (IP, hostname, node id, or `localhost` for the driver's node)
    to alive Ray node ids; names that match no alive node are left out."""
    by_name: dict[str, str] = {}
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        for key in (node["NodeID"], node.get("NodeManagerAddress"), node.get("NodeName"),
                    node.get("NodeManagerHostname")):
            if key:
                by_name[str(key)] = node["NodeID"]
    here = ray.get_runtime_context().get_node_id()
    for name in LOCAL_NAMES:
        by_name.setdefault(name, here)
    out: dict[str, int] = {}
    for host, slots in reported.items():
        if host in by_name:
            node = by_name[host]
            out[node] = out.get(node, 0) + slots
    return out


def pinned_nodes(hosts: Mapping[str, int], num_workers: int) -> list[str]:
    """The node of each of `num_workers` workers on the hosts of horovodrun's `-H` (in its
    order, each filled before the next).

    Raises:
        ConfigError: a host is not a Ray node, or the hosts hold fewer slots.
    """
    order: list[str] = []
    for host, slots in hosts.items():
        node = resolve_hosts({host: slots})
        if not node:
            raise ConfigError(f"host {host!r} of -H/--hosts is not an alive Ray node (give "
                              "its IP address, hostname or node id, or localhost)")
        order += [next(iter(node))] * slots
    if len(order) < num_workers:
        raise ConfigError(f"-H/--hosts lists {len(order)} slots for {num_workers} workers; "
                          "give more hosts or slots, or a smaller -np")
    return order[:num_workers]


def create_placement_group(
    num_workers: int | None,
    num_hosts: int | None,
    num_workers_per_host: int,
    cpus_per_worker: float,
    gpus_per_worker: float,
    timeout_s: float,
    resources_per_worker: dict[str, float] | None = None,
    pinned: list[str] | None = None,
) -> tuple[PlacementGroup, list[int]]:
    """A placement group for the workers and the bundle index of each worker.

    `num_workers` packs one bundle per worker (PACK); `num_hosts` spreads one bundle per
    host holding `num_workers_per_host` workers (STRICT_SPREAD); `pinned` puts each
    worker's bundle on the node it names (horovodrun's `-H`).
    """
    def bundle(workers: int) -> dict[str, float]:
        b = {"CPU": cpus_per_worker * workers}
        if gpus_per_worker:
            b["GPU"] = gpus_per_worker * workers
        for name, amount in (resources_per_worker or {}).items():
            b[name] = amount * workers
        return b

    if num_hosts is not None:
        bundles = [bundle(num_workers_per_host) for _ in range(num_hosts)]
        strategy = "STRICT_SPREAD"
        indexes = [h for h in range(num_hosts) for _ in range(num_workers_per_host)]
    else:
        bundles = [bundle(1) for _ in range(num_workers or 0)]
        strategy = "PACK"
        indexes = list(range(num_workers or 0))
    selectors = None
    if pinned is not None:
        from ray.util.placement_group import NODE_ID_LABEL_KEY

        selectors = [{NODE_ID_LABEL_KEY: node} for node in pinned]
    pg = placement_group(bundles, strategy=strategy, bundle_label_selector=selectors)
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        ray.util.remove_placement_group(pg)
        total = {k: sum(b.get(k, 0) for b in bundles) for k in ("CPU", "GPU")}
        raise PlacementTimeout(
            f"the cluster could not place {len(indexes)} workers ({strategy}, needs "
            f"{total['CPU']:g} CPU, {total['GPU']:g} GPU) within {timeout_s:g}s; available: "
            f"{ray.available_resources()}. Lower num_workers/cpus_per_worker or add nodes.")
    return pg, indexes


def head_node_id() -> str | None:
    """The alive head node's id (None if Ray lists none)."""
    return next((info["NodeID"] for info in ray.nodes() if info.get("Alive")
                 and "node:__internal_head__" in info.get("Resources", {})), None)


def stable_node_strategy():
    """Scheduling for a job's control actors (store, coordinator, autotune controller): the
    head node, which autoscalers and spot reclaims never take away (else the driver's node).
    Hard affinity: soft affinity was seen to spill them onto worker nodes, and they need no
    resources, so the node always fits them."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = head_node_id() or ray.get_runtime_context().get_node_id()
    return NodeAffinitySchedulingStrategy(node, soft=False)


def validate_shape(num_workers, num_hosts, num_workers_per_host, cpus_per_worker,
                   gpus_per_worker, use_gpu) -> None:
    """Raises ConfigError for impossible executor arguments."""
    if (num_workers is None) == (num_hosts is None):
        raise ConfigError("give exactly one of num_workers or num_hosts "
                          "(with num_workers_per_host)")
    if num_workers is not None and num_workers < 1:
        raise ConfigError(f"num_workers must be >= 1, got {num_workers}")
    if num_hosts is not None and num_hosts < 1:
        raise ConfigError(f"num_hosts must be >= 1, got {num_hosts}")
    if num_workers_per_host < 1:
        raise ConfigError(f"num_workers_per_host must be >= 1, got {num_workers_per_host}")
    if cpus_per_worker <= 0:
        raise ConfigError(f"cpus_per_worker must be > 0, got {cpus_per_worker}")
    if gpus_per_worker is not None and gpus_per_worker < 0:
        raise ConfigError(f"gpus_per_worker must be >= 0, got {gpus_per_worker}")
    if gpus_per_worker and not use_gpu:
        raise ConfigError("gpus_per_worker needs use_gpu=True")
