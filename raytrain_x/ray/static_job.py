"""A fixed set of workers: placed once, one world, functions run on all of them.

`RayExecutor` is a facade over this (`num_workers`/`num_hosts`) and the elastic job
(`min_workers`/`max_workers`, `raytrain_x.ray.elastic`); what it was asked for is checked
there, once, before either starts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raytrain_x.comm.store_actor import StoreActor, control_concurrency
from raytrain_x.common.errors import WorkerError
from raytrain_x.ray.failures import (
    node_addresses,
    root_cause,
    unreachable,
    unreachable_error,
    worker_error,
)
from raytrain_x.ray.placement import (
    Slot,
    assign_ranks,
    create_placement_group,
    pinned_nodes,
    stable_node_strategy,
)
from raytrain_x.ray.worker import Worker

log = logging.getLogger("raytrain_x.ray")


@dataclass(frozen=True)
class StaticShape:
    """Where a static job's workers go and what each reserves."""

    num_workers: int | None
    num_hosts: int | None
    num_workers_per_host: int
    cpus_per_worker: float
    gpus: float  # per worker, 0 without use_gpu
    resources_per_worker: dict[str, float]
    use_current_placement_group: bool
    placement_group_timeout_s: float
    hosts: dict[str, int] | None = None  # horovodrun's -H: host -> slots, filled in order

    @property
    def world_size(self) -> int:
        if self.num_hosts is not None:
            return self.num_hosts * self.num_workers_per_host
        return int(self.num_workers)


class StaticJob:
    """The workers of a fixed world, in rank order, and the calls that run on them."""

    def __init__(self, shape: StaticShape, timeout_s: float) -> None:
        self.shape = shape
        self.timeout_s = timeout_s
        self.workers: list[Any] = []
        self.slots: list[Slot] = []
        self._pg = None
        self._owns_pg = False
        self._store = None
        self._round = 0

    # ------------------------------------------------------------------ lifecycle
    def start(self, env: dict[str, str], autotune_actor: Any = None) -> None:
        """Places the workers, assigns ranks by node and sets up each one's rendezvous."""
        shape = self.shape
        current = ray.util.get_current_placement_group()
        if shape.use_current_placement_group and current is not None:
            self._pg, self._owns_pg = current, False
            offset = 1 if len(current.bundle_specs) > shape.world_size else 0
            indexes = [i + offset for i in range(shape.world_size)]
        else:
            pinned = None if shape.hosts is None else \
                pinned_nodes(shape.hosts, shape.world_size)
            self._pg, indexes = create_placement_group(
                shape.num_workers if shape.num_hosts is None else None, shape.num_hosts,
                shape.num_workers_per_host, shape.cpus_per_worker, shape.gpus,
                shape.placement_group_timeout_s, shape.resources_per_worker, pinned)
            self._owns_pg = True
        self.workers = workers = [  # held at once: a failed start kills what it started
            Worker.options(
                num_cpus=shape.cpus_per_worker, num_gpus=shape.gpus,
                resources=shape.resources_per_worker or None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, index),
            ).remote()
            for index in indexes
        ]
        node_ids = ray.get([w.node_id.remote() for w in workers])
        slots = assign_ranks(node_ids)
        order = sorted(range(len(workers)), key=lambda i: slots[i].rank)
        self.workers = [workers[i] for i in order]
        self.slots = [slots[i] for i in order]
        self._store = StoreActor.options(
            scheduling_strategy=stable_node_strategy(),
            max_concurrency=control_concurrency(len(workers))).remote()
        env_per_node = self._cuda_visible_devices() if shape.gpus else {}
        ray.get([
            w.setup.remote(self._rendezvous_args(slot), self._store,
                           {**env, **env_per_node.get(slot.node_id, {})},
                           autotune_actor if slot.rank == 0 else None)
            for w, slot in zip(self.workers, self.slots)
        ])

    def create_executables(self, cls: type, args: Sequence, kwargs: dict) -> None:
        """Builds `cls(*args, **kwargs)` on every worker; the first failure, as the
        `WorkerError` of its rank."""
        refs = [w.create_executable.remote(cls, tuple(args), dict(kwargs))
                for w in self.workers]
        for rank, ref in enumerate(refs):
            try:
                ray.get(ref)
            except (RayActorError, RayTaskError) as exc:
                raise worker_error(rank, exc) from None

    def _rendezvous_args(self, slot: Slot) -> dict[str, Any]:
        return {"rank": slot.rank, "size": len(self.slots), "local_rank": slot.local_rank,
                "local_size": slot.local_size, "cross_rank": slot.cross_rank,
                "cross_size": slot.cross_size, "timeout_s": self.timeout_s,
                "hosts": [s.node_id for s in self.slots]}

    def _cuda_visible_devices(self) -> dict[str, dict[str, str]]:
        ids = ray.get([w.gpu_ids.remote() for w in self.workers])
        per_node: dict[str, set[str]] = {}
        for slot, gpu_ids in zip(self.slots, ids):
            per_node.setdefault(slot.node_id, set()).update(gpu_ids)
        return {node: {"CUDA_VISIBLE_DEVICES": ",".join(sorted(g, key=int))}
                for node, g in per_node.items()}

    def shutdown(self) -> None:
        """Kills the workers and frees their placement group."""
        for w in self.workers:
            ray.kill(w, no_restart=True)
        if self._store is not None:
            ray.kill(self._store, no_restart=True)
        if self._pg is not None and self._owns_pg:
            ray.util.remove_placement_group(self._pg)
        self.workers, self.slots, self._store, self._pg = [], [], None, None

    # ------------------------------------------------------------------ running
    def run_remote(self, fn: Callable, args: Sequence | None,
                   kwargs: dict | None) -> list[ray.ObjectRef]:
        self._round += 1
        return [w.execute.remote(fn, tuple(args or ()), dict(kwargs or {}),
                                 round_id=self._round)
                for w in self.workers]

    def execute_remote(self, fn: Callable[[Any], Any], ranks: Sequence[int]) -> list[Any]:
        self._round += 1
        return [self.workers[r].execute.remote(fn, with_executable=True, round_id=self._round)
                for r in ranks]

    def collect(self, refs: list[ray.ObjectRef]) -> list[Any]:
        """Waits for per-rank ObjectRefs; returns results in rank order.

        Raises:
            WorkerError: the root-cause failure; ranks still running `timeout_s` after it
                are killed, and ranks that do not answer a probe are named unreachable.
        """
        pending = {ref: rank for rank, ref in enumerate(refs)}
        results: dict[int, Any] = {}
        errors: dict[int, WorkerError] = {}
        deadline = float("inf")
        probed = False
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=0.5)
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    results[rank] = ray.get(ref)
                except (RayTaskError, RayActorError) as exc:
                    errors[rank] = worker_error(rank, exc)
                    deadline = min(deadline, time.monotonic() + self.timeout_s)
            if errors and pending and not probed:
                # Ranks whose node is cut off never report: find them now, by name.
                probed = True
                lost = unreachable({ref: self.workers[r] for ref, r in pending.items()})
                ranks = sorted(pending[ref] for ref in lost)
                errors.update(unreachable_error(
                    ranks, [self.slots[r].node_id for r in ranks],
                    f"after rank {min(errors)} failed", node_addresses()))
                for ref in lost:
                    ray.kill(self.workers[pending.pop(ref)], no_restart=True)
            if errors and pending and time.monotonic() > deadline:
                stuck = sorted(pending.values())
                log.warning("ranks %s did not stop %.0fs after rank %d failed; killing them",
                            stuck, self.timeout_s, min(errors))
                for rank in stuck:
                    ray.kill(self.workers[rank], no_restart=True)
                break
        if errors:
            raise root_cause(errors)
        return [results[r] for r in range(len(refs))]
