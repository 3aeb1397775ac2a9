"""What an elastic job is asked to do (pure data, no Ray)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from raytrain_x.common.checkpoint_config import CheckpointConfig
from raytrain_x.common.settings import DRAIN_POLL_S, START_TIMEOUT_S, STRAGGLER_POLL_S

__all__ = ["DRAIN_POLL_S", "EVERY_FREE_SLOT", "STRAGGLER_POLL_S", "ElasticSettings"]
GAVE_UP_WARNING_AT = 3  # give-ups after which the job warns once that it keeps giving up
# `max_workers` of a job given none (Horovod's `max_np=None`): every free slot the cluster
# has; the autoscaler is asked for `min_workers` only
EVERY_FREE_SLOT = 2**31 - 1


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
    hosts: dict[str, int] | None = None  # a fixed host list (horovodrun's -H), as discovered
    discovery: Any = None  # a discovery object of Horovod's protocol (ElasticRayExecutor's)
    slots_per_host: int | None = None  # the slots of a discovered host named without them
    discovery_interval_s: float = 1.0
    env: dict[str, str] | None = None
    autotune_actor: Any = None
    # How long a worker actor may take to start (its process, imports, runtime_env, an
    # image pull) before it is given up on. Measured on a 2-core machine
    # (benchmarks/worker_start.py, docs/elastic.md): 2-2.5 s alone, 7.7 s for three at once
    # with one core busy, and no start within minutes with both cores saturated; 300 s
    # leaves room for loaded nodes, large runtime_envs and image pulls.
    start_timeout_s: float = START_TIMEOUT_S.default
    # durable checkpoints: with every holder of the state lost, the next round restores
    # from storage instead of the job stopping with ElasticStateLost
    checkpoint: CheckpointConfig | None = None
    # worker failures the job survives, counted as Ray Train counts them: the failures that
    # one reset recovers from are one (None: no limit; drains are not failures)
    max_failures: int | None = None
    # driver policies (`policies.DriverPolicy`: `decide(JobSnapshot) -> list[Leave]`) the
    # job asks at every straggler poll; their decisions are carried out by `PolicyWatch`
    policies: tuple[Any, ...] = ()

    @property
    def bounded(self) -> bool:
        """Whether `max_workers` caps the job (else it takes every free slot)."""
        return self.max_workers < EVERY_FREE_SLOT

    @property
    def per_worker(self) -> dict[str, float]:
        """The resources one worker takes, as Ray names them."""
        out = {"CPU": self.cpus_per_worker, **self.resources_per_worker}
        if self.gpus_per_worker:
            out["GPU"] = self.gpus_per_worker
        return out
