"""Where workers can run: Ray's alive nodes and their free resources."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Mapping

import ray

from raytrain_x.common.errors import ConfigError
from raytrain_x.ray import internals
from raytrain_x.ray.elastic.discovery import slots_from_resources
from raytrain_x.ray.placement import resolve_hosts

__all__ = ["HostDiscovery", "RayDiscovery", "RayHostDiscovery", "TestDiscovery", "alive_nodes",
           "resolve_hosts"]
log = logging.getLogger("raytrain_x.elastic")


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


class HostDiscovery:
    """Horovod's discovery protocol for `ElasticRayExecutor` (`settings.discovery = ...`
    with `override_discovery=False`): `find_available_hosts_and_slots()` returns
    `{host: slots}`, the hosts being Ray nodes (IP address, hostname or node id), each
    with its total slots."""

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        raise NotImplementedError


class RayHostDiscovery(HostDiscovery):
    """Every alive Ray node (by node id) with the workers its resources hold.

    Args:
        use_gpu: a worker takes `gpus_per_slot` GPUs.
        cpus_per_slot: CPUs a worker takes.
        gpus_per_slot: GPUs a worker takes, with `use_gpu`.
    """

    def __init__(self, use_gpu: bool = False, cpus_per_slot: float = 1,
                 gpus_per_slot: float = 1) -> None:
        self.per_worker = {"CPU": cpus_per_slot, **({"GPU": gpus_per_slot} if use_gpu else {})}

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        return {node: n for node, res in alive_nodes().items()
                if (n := slots_from_resources(res, self.per_worker)) > 0}


class TestDiscovery(RayHostDiscovery):
    """Horovod's discovery for trying elastic training on a local cluster: Ray's nodes,
    less some it takes out of the job, one host added or removed every
    `change_frequency_s` (a removed host's workers leave at their next commit), keeping
    between `min_hosts` and `max_hosts`.

    Args:
        min_hosts: the fewest hosts reported.
        max_hosts: the most hosts reported.
        change_frequency_s: seconds between changes.
        use_gpu: a worker takes `gpus_per_slot` GPUs.
        cpus_per_slot: CPUs a worker takes.
        gpus_per_slot: GPUs a worker takes, with `use_gpu`.
        verbose: print the hosts at each look.
        _graceful: Horovod's; False (killing the removed node) is not done here: the host
            is removed from discovery, gracefully, with a warning.
        seed: the random choices' seed (None: unseeded, as Horovod's).
    """

    __test__ = False  # not a pytest class

    def __init__(self, min_hosts: int, max_hosts: int, change_frequency_s: float,
                 use_gpu: bool = False, cpus_per_slot: float = 1, gpus_per_slot: float = 1,
                 verbose: bool = True, _graceful: bool = True, seed: int | None = None) -> None:
        super().__init__(use_gpu, cpus_per_slot, gpus_per_slot)
        if not 0 <= min_hosts <= max_hosts:
            raise ConfigError(f"TestDiscovery needs 0 <= min_hosts <= max_hosts, got "
                              f"{min_hosts}, {max_hosts}")
        if not _graceful:
            log.warning("raytrain-x: TestDiscovery(_graceful=False) removes hosts from "
                        "discovery; it does not kill their nodes")
        self.min_hosts, self.max_hosts = min_hosts, max_hosts
        self.change_frequency_s = change_frequency_s
        self.verbose = verbose
        self.removed: set[str] = set()
        self._rng = random.Random(seed)
        self._last_change: float | None = None

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        hosts = super().find_available_hosts_and_slots()
        now = time.monotonic()
        if self._last_change is None:
            self._last_change = now
        if now - self._last_change >= self.change_frequency_s:
            self._change(hosts)
            self._last_change = now
        remaining = {h: n for h, n in hosts.items() if h not in self.removed}
        if self.verbose:
            print(f"TestDiscovery: {len(remaining)} of {len(hosts)} hosts: "
                  f"{sorted(remaining)}", flush=True)
        return remaining

    def _change(self, hosts: dict[str, int]) -> None:
        self.removed &= set(hosts)  # nodes that left the cluster are no longer held out
        current = len(hosts) - len(self.removed)
        if current <= self.min_hosts or (current < self.max_hosts
                                         and self._rng.random() < 0.5):
            if self.removed:
                self.removed.discard(self._rng.choice(sorted(self.removed)))
        else:
            kept = sorted(set(hosts) - self.removed)
            if kept:
                self.removed.add(self._rng.choice(kept))
