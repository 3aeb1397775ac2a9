"""The elastic driver's side of Ray's autoscaler: asking for capacity, seeing drains.

Capacity: `ray.autoscaler.sdk.request_resources(bundles=...)` tells the autoscaler (v1 or
v2) that the cluster must be able to fit these bundles; it counts every node's total
resources, busy or not, and bypasses `upscaling_speed`. The request persists until it is
replaced, so the driver replaces it with an empty one when the job is full or ends.

Drains: before a node is removed (autoscaler scale-down, `ray drain-node`, a cloud's
preemption notice), the GCS lists it as draining, with a deadline.
"""

from __future__ import annotations

import logging
import math
import os
import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raytrain_x.common.procs import processes
from raytrain_x.ray import internals
from raytrain_x.ray.placement import head_node_id

log = logging.getLogger("raytrain_x.elastic")


def request_bundles(max_workers: int, unusable_slots: int) -> int:
    """How many worker bundles to ask the autoscaler for.

    `request_resources` counts capacity the job cannot use too: a blacklisted node's and a
    draining node's slots would satisfy part of the request, and the autoscaler would add
    nothing in their place. They are asked for on top of the job's `max_workers`.
    """
    return max_workers + max(0, unusable_slots)


class CapacityRequest:
    """The job's standing request to the autoscaler; sends only changes."""

    def __init__(self, per_worker: dict[str, float]) -> None:
        self.per_worker = {k: v for k, v in per_worker.items() if v > 0}
        self.bundles = 0  # what is asked for now
        self.requests: list[tuple[float, int]] = []  # (time.time(), bundles) per change

    def ask(self, bundles: int) -> None:
        if bundles == self.bundles:
            return
        from ray.autoscaler.sdk import request_resources

        request_resources(bundles=[dict(self.per_worker)] * bundles)
        log.debug("raytrain-x elastic: asked the autoscaler (if any) for room for %d "
                  "workers of %s", bundles, self.per_worker)
        self.bundles = bundles
        self.requests.append((time.time(), bundles))

    def clear(self) -> None:
        """Withdraws the request, so the autoscaler may scale down idle nodes."""
        try:
            self.ask(0)
        except Exception as exc:  # noqa: BLE001 - the job's own outcome matters more
            log.warning("raytrain-x elastic: could not clear the autoscaler request: %s", exc)


def draining_nodes() -> dict[str, float]:
    """Node id -> drain deadline (seconds since the epoch, inf without one) of the nodes
    Ray is draining."""
    try:
        raw = internals.draining_nodes_ms()
    except Exception as exc:  # noqa: BLE001 - a GCS hiccup must not stop training
        log.debug("raytrain-x elastic: could not read draining nodes: %s", exc)
        return {}
    return {node: (deadline_ms / 1000.0 if deadline_ms else math.inf)
            for node, deadline_ms in raw.items()}


def node_types() -> dict[str, dict[str, float]] | None:
    """The autoscaler's node types (name -> resources of one node), or None where the
    cluster has no autoscaler or does not say.

    Autoscaler v2 (KubeRay) publishes its cluster config in the GCS. Autoscaler v1 (`ray
    up`, `ray start --autoscaling-config`) publishes none: its monitor process on the head
    reads a config file, which is read here the same way (on the head, by a task there
    when this driver runs elsewhere).
    """
    try:
        config = internals.cluster_config()
    except Exception:  # noqa: BLE001 - an older GCS
        config = None
    if config is not None and config.node_group_configs:
        return {group.name: dict(group.resources) for group in config.node_group_configs
                if group.max_count != 0}
    context = ray.get_runtime_context()
    head = head_node_id()
    if head is None:
        return None
    if context.get_node_id() == head:
        return monitor_node_types(context.gcs_address)
    task = ray.remote(num_cpus=0)(monitor_node_types).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(head, soft=False))
    try:
        return ray.get(task.remote(context.gcs_address), timeout=60)
    except Exception as exc:  # noqa: BLE001 - unknown is a valid answer
        log.debug("raytrain-x elastic: could not read the autoscaler's node types: %s", exc)
        return None


def monitor_node_types(gcs_address: str) -> dict[str, dict[str, float]] | None:
    """The node types in the config file of the v1 autoscaler monitor of the cluster at
    `gcs_address`, run on this machine; None without one, or when a type does not state
    its resources (a cloud type the autoscaler sizes itself)."""
    import yaml

    for _, cmdline in processes().values():
        if "autoscaler/_private/monitor.py" not in cmdline \
                or f"--gcs-address={gcs_address} " not in cmdline + " ":
            continue
        path = next((arg.split("=", 1)[1] for arg in cmdline.split()
                     if arg.startswith("--autoscaling-config=")), None)
        if path is None:
            return None
        try:
            with open(os.path.expanduser(path)) as f:
                config = yaml.safe_load(f) or {}
        except (OSError, yaml.YAMLError):
            return None
        types = config.get("available_node_types") or {}
        if not types or any("resources" not in t for t in types.values()):
            return None
        head = config.get("head_node_type")
        return {name: {k: float(v) for k, v in t["resources"].items()}
                for name, t in types.items() if t.get("max_workers", 1) != 0 or name == head}
    return None
