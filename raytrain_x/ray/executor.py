"""`RayExecutor`: Ray actors that form raytrain-x worlds (horovod.ray's API)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raytrain_x.comm.store_actor import StoreActor
from raytrain_x.common.autotune_config import AutotuneConfig
from raytrain_x.common.errors import ConfigError, WorkerError
from raytrain_x.common.knobs import Knobs, load_knobs
from raytrain_x.common.settings import START_TIMEOUT_S, TIMEOUT_S
from raytrain_x.ray.autotune_actor import start_controller_actor
from raytrain_x.ray.elastic import ElasticJob, ElasticSettings
from raytrain_x.ray.failures import root_cause, unreachable, unreachable_error, worker_error
from raytrain_x.ray.placement import (
    Slot,
    assign_ranks,
    create_placement_group,
    stable_node_strategy,
    validate_shape,
)
from raytrain_x.ray.worker import Worker

log = logging.getLogger("raytrain_x.ray")


@dataclass
class Settings:
    """Executor timeouts.

    Attributes:
        timeout_s: rendezvous and collective timeout; after one rank fails, the others are
            given this long to stop before they are killed.
        placement_group_timeout_s: how long to wait for the cluster to fit the workers.
    """

    timeout_s: float = TIMEOUT_S.default
    placement_group_timeout_s: float = 100.0


def ensure_ray(address: str | None = None, **init_kwargs: Any) -> None:
    """Connects to Ray: `address`, else a running cluster (`auto`), else a local one."""
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, **init_kwargs)
        return
    try:
        ray.init(address="auto", **init_kwargs)
    except ConnectionError:
        ray.init(**init_kwargs)


class RayExecutor:
    """Starts one Ray actor per worker and runs functions on all of them.

    Args:
        settings: from `RayExecutor.create_settings`.
        num_workers: workers, packed onto as few nodes as fit (PACK placement).
        num_hosts: alternatively, hosts to spread over (STRICT_SPREAD) with
            `num_workers_per_host` workers each.
        num_workers_per_host: workers per host with `num_hosts`.
        cpus_per_worker: CPUs reserved per worker.
        use_gpu: reserve GPUs; CUDA_VISIBLE_DEVICES is shared by the workers of a node.
        gpus_per_worker: GPUs per worker (default 1 with `use_gpu`).
        use_current_placement_group: run inside the caller's placement group (Tune trials).
        min_workers, max_workers, reset_limit, cooldown_range, elastic_timeout: elastic
            training (validated here).
        start_timeout_s: elastic: how long a new worker may take to start (process,
            imports, runtime_env, an image pull) before it is given up on; a worker that is
            slow but placeable is waited for, one that cannot be placed is given up at once.
        knobs: communication knobs for every worker, all held fixed (defaults: env and
            config file).
        autotune: an `AutotuneConfig` (or True): tune the free knobs while training; the
            controller runs as a Ray actor, rank 0 reports each sample to it.
        resources_per_worker: extra Ray resources each worker reserves.
        host_discovery_script: elastic: an executable printing `host:slots` lines (default:
            Ray's alive nodes and their free resources).

    With `min_workers`/`max_workers` the executor is elastic: `run` keeps the job going
    while workers fail or hosts come and go (see docs/elastic.md).
    """

    @staticmethod
    def create_settings(timeout_s: float = TIMEOUT_S.default,
                        placement_group_timeout_s: float = 100.0,
                        **unsupported: Any) -> Settings:
        """Executor settings; Horovod's ssh/nics arguments do not apply on Ray."""
        if unsupported:
            raise ConfigError(f"create_settings does not take {sorted(unsupported)}: Ray places "
                              "and connects the workers itself")
        if timeout_s <= 0 or placement_group_timeout_s <= 0:
            raise ConfigError("timeouts must be positive numbers of seconds")
        return Settings(float(timeout_s), float(placement_group_timeout_s))

    def __init__(
        self,
        settings: Settings | None = None,
        num_workers: int | None = None,
        num_hosts: int | None = None,
        num_workers_per_host: int = 1,
        cpus_per_worker: float = 1,
        use_gpu: bool = False,
        gpus_per_worker: float | None = None,
        use_current_placement_group: bool = True,
        min_workers: int | None = None,
        max_workers: int | None = None,
        reset_limit: int | None = None,
        cooldown_range: tuple[float, float] | None = None,
        elastic_timeout: float = 600,
        start_timeout_s: float | None = None,
        knobs: Knobs | None = None,
        autotune: Any = None,
        resources_per_worker: dict[str, float] | None = None,
        host_discovery_script: str | None = None,
    ) -> None:
        elastic = min_workers is not None or max_workers is not None
        if elastic:
            num_workers = num_workers if num_workers is not None else (min_workers or 1)
        validate_shape(num_workers, num_hosts, num_workers_per_host, cpus_per_worker,
                       gpus_per_worker, use_gpu)
        if min_workers is not None and (min_workers < 1 or (max_workers is not None
                                                            and max_workers < min_workers)):
            raise ConfigError(f"need 1 <= min_workers <= max_workers, got {min_workers}, "
                              f"{max_workers}")
        if reset_limit is not None and reset_limit < 0:
            raise ConfigError(f"reset_limit must be >= 0, got {reset_limit}")
        if cooldown_range is not None:
            if len(cooldown_range) != 2 or not 0 < cooldown_range[0] <= cooldown_range[1]:
                raise ConfigError(f"cooldown_range must be (lo, hi) with 0 < lo <= hi, got "
                                  f"{cooldown_range}")
        if elastic_timeout <= 0:
            raise ConfigError(f"elastic_timeout must be positive, got {elastic_timeout}")
        if start_timeout_s is None:
            start_timeout_s = START_TIMEOUT_S.read()
        if start_timeout_s <= 0:
            raise ConfigError(f"start_timeout_s must be positive, got {start_timeout_s}")
        if knobs is not None and not isinstance(knobs, Knobs):
            raise ConfigError(f"knobs must be a raytrain_x.Knobs, got {type(knobs).__name__}")
        if autotune is True:
            autotune = AutotuneConfig()
        if autotune is not None and not isinstance(autotune, AutotuneConfig):
            raise ConfigError("autotune must be an AutotuneConfig (or True for the defaults), "
                              f"got {type(autotune).__name__}")
        self.settings = settings or Settings()
        self.num_workers = num_workers
        self.num_hosts = num_hosts
        self.num_workers_per_host = num_workers_per_host
        self.cpus_per_worker = cpus_per_worker
        self.use_gpu = use_gpu
        self.gpus_per_worker = (gpus_per_worker if gpus_per_worker is not None
                                else (1 if use_gpu else 0))
        self.use_current_placement_group = use_current_placement_group
        self.min_workers, self.max_workers = min_workers, max_workers
        self.reset_limit, self.cooldown_range = reset_limit, cooldown_range
        self.elastic_timeout = elastic_timeout
        self.start_timeout_s = start_timeout_s
        self.knobs = knobs
        self.autotune = autotune
        self.elastic = elastic
        if elastic:
            self.min_workers = min_workers or 1
            self.max_workers = max_workers or max(self.min_workers, num_workers or 1)
        if resources_per_worker is not None and any(
                not isinstance(v, (int, float)) or v < 0 for v in resources_per_worker.values()):
            raise ConfigError(f"resources_per_worker needs non-negative numbers, got "
                              f"{resources_per_worker}")
        self.resources_per_worker = dict(resources_per_worker or {})
        self.host_discovery_script = host_discovery_script
        if host_discovery_script is not None:
            from raytrain_x.elastic.discovery import ScriptDiscovery

            ScriptDiscovery(host_discovery_script)  # validates it now, not mid-job
        self.last_elastic_job = None
        self._elastic_env: dict[str, str] | None = None
        self.workers: list[Any] = []
        self.slots: list[Slot] = []
        self._pg = None
        self._owns_pg = False
        self._store = None
        self._round = 0
        self.autotune_controller = None

    # ------------------------------------------------------------------ lifecycle
    @property
    def world_size(self) -> int:
        if self.num_hosts is not None:
            return self.num_hosts * self.num_workers_per_host
        return int(self.num_workers)

    def start(self, executable_cls: type | None = None, executable_args: Sequence | None = None,
              executable_kwargs: dict | None = None,
              extra_env_vars: dict[str, str] | None = None) -> None:
        """Places the workers, forms the world's rendezvous and builds the executables."""
        if self.workers or self._elastic_env is not None:
            raise ConfigError("this executor is already started; call shutdown() first")
        ensure_ray()
        if self.elastic:  # workers are started by each run(), as capacity allows
            if executable_cls is not None:
                raise ConfigError("elastic executors run functions; executable_cls needs a "
                                  "fixed set of workers (drop min_workers/max_workers)")
            self._elastic_env = {**(extra_env_vars or {}),
                                 "RAYTRAIN_X_TIMEOUT": str(self.settings.timeout_s),
                                 **(knob_env(self.knobs) if self.knobs else {})}
            if self.autotune is not None:
                self._elastic_env.update(self._start_autotune())
            return
        self._start_workers(extra_env_vars or {})
        if executable_cls is not None:
            ray.get([w.create_executable.remote(executable_cls, tuple(executable_args or ()),
                                                dict(executable_kwargs or {}))
                     for w in self.workers])

    def _start_workers(self, extra_env: dict[str, str]) -> None:
        current = ray.util.get_current_placement_group()
        gpus = self.gpus_per_worker if self.use_gpu else 0
        if self.use_current_placement_group and current is not None:
            self._pg, self._owns_pg = current, False
            offset = 1 if len(current.bundle_specs) > self.world_size else 0
            indexes = [i + offset for i in range(self.world_size)]
        else:
            self._pg, indexes = create_placement_group(
                self.num_workers if self.num_hosts is None else None, self.num_hosts,
                self.num_workers_per_host, self.cpus_per_worker, gpus,
                self.settings.placement_group_timeout_s, self.resources_per_worker)
            self._owns_pg = True
        workers = [
            Worker.options(
                num_cpus=self.cpus_per_worker, num_gpus=gpus,
                resources=self.resources_per_worker or None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, index),
            ).remote()
            for index in indexes
        ]
        node_ids = ray.get([w.node_id.remote() for w in workers])
        slots = assign_ranks(node_ids)
        order = sorted(range(len(workers)), key=lambda i: slots[i].rank)
        self.workers = [workers[i] for i in order]
        self.slots = [slots[i] for i in order]
        self._store = StoreActor.options(scheduling_strategy=stable_node_strategy()).remote()
        env = dict(extra_env)
        env["RAYTRAIN_X_TIMEOUT"] = str(self.settings.timeout_s)
        if self.knobs is not None:
            env.update(knob_env(self.knobs))
        if self.autotune is not None and self.autotune_controller is None:
            env.update(self._start_autotune())
        if self.use_gpu:
            env_per_node = self._cuda_visible_devices()
        else:
            env_per_node = {}
        ray.get([
            w.setup.remote(self._rendezvous_args(slot), self._store,
                           {**env, **env_per_node.get(slot.node_id, {})},
                           self.autotune_controller if slot.rank == 0 else None)
            for w, slot in zip(self.workers, self.slots)
        ])

    def _start_autotune(self) -> dict[str, str]:
        """Starts the controller actor; returns the env that gives every worker the same
        starting knobs and autotune settings."""
        config = self.autotune
        if self.knobs is not None:
            base, fixed = self.knobs, frozenset(Knobs.specs())
        else:
            base, fixed = load_knobs(config_file=os.environ.get("RAYTRAIN_X_CONFIG_FILE"))
        start = base
        if config.initial_knobs is not None:
            start = config.initial_knobs.replace(**{n: getattr(base, n) for n in fixed})
        if config.resume_from:  # workers read the resume file themselves
            return {**config.to_env(), **(knob_env(self.knobs) if self.knobs else {})}
        self.autotune_controller = start_controller_actor(config, start, fixed)
        return {**config.to_env(), **knob_env(start)}

    def _rendezvous_args(self, slot: Slot) -> dict[str, Any]:
        return {"rank": slot.rank, "size": len(self.slots), "local_rank": slot.local_rank,
                "local_size": slot.local_size, "cross_rank": slot.cross_rank,
                "cross_size": slot.cross_size, "timeout_s": self.settings.timeout_s,
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
        self._elastic_env = None
        for w in self.workers:
            ray.kill(w, no_restart=True)
        if self._store is not None:
            ray.kill(self._store, no_restart=True)
        if self.autotune_controller is not None:
            ray.kill(self.autotune_controller, no_restart=True)
            self.autotune_controller = None
        if self._pg is not None and self._owns_pg:
            ray.util.remove_placement_group(self._pg)
        self.workers, self.slots, self._store, self._pg = [], [], None, None

    def __enter__(self) -> RayExecutor:
        if not self.workers:
            self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ running
    def _require_started(self) -> None:
        if not self.workers and self._elastic_env is None:
            raise ConfigError("the executor is not started; call start() first")

    def _run_elastic(self, fn: Callable, args: Sequence | None, kwargs: dict | None) -> list:
        settings = ElasticSettings(
            min_workers=self.min_workers, max_workers=self.max_workers,
            cpus_per_worker=self.cpus_per_worker,
            gpus_per_worker=self.gpus_per_worker if self.use_gpu else 0,
            resources_per_worker=self.resources_per_worker, reset_limit=self.reset_limit,
            cooldown_range=self.cooldown_range, elastic_timeout=self.elastic_timeout,
            timeout_s=self.settings.timeout_s, discovery_script=self.host_discovery_script,
            env=self._elastic_env, autotune_actor=self.autotune_controller,
            start_timeout_s=self.start_timeout_s)
        self.last_elastic_job = ElasticJob(settings, fn, tuple(args or ()), dict(kwargs or {}))
        return self.last_elastic_job.run()

    @property
    def elastic_history(self) -> list[dict[str, Any]]:
        """The last elastic run's rounds, one dict each: `round`, `time_s` (since the run
        began), `size`, `hosts`, `reason` (`start`, `scale_up`, `failure`, `drain`, joined
        by `+` when one round had several), how many workers `joined`, `failed` and `left`
        since the round before, how many were still `starting`, how many worker bundles the
        job was `requested` of the autoscaler and how many nodes were draining."""
        job = self.last_elastic_job
        return [dict(entry) for entry in job.history] if job is not None else []

    def run_remote(self, fn: Callable, args: Sequence | None = None,
                   kwargs: dict | None = None) -> list[ray.ObjectRef]:
        """Starts `fn(*args, **kwargs)` on every worker; returns ObjectRefs in rank order."""
        self._require_started()
        if not callable(fn):
            raise ConfigError(f"run needs a function, got {type(fn).__name__}")
        self._round += 1
        return [w.execute.remote(fn, tuple(args or ()), dict(kwargs or {}),
                                 round_id=self._round)
                for w in self.workers]

    def run(self, fn: Callable, args: Sequence | None = None, kwargs: dict | None = None,
            callbacks: Sequence[Callable[[Any], None]] | None = None) -> list[Any]:
        """Runs `fn` on every worker and returns the results in rank order.

        Args:
            callbacks: called on the driver with `(rank, result)` as each rank finishes.

        Raises:
            WorkerError: a rank raised or exited; names the rank and its traceback. The
                other ranks are released (their engines stop) within `timeout_s`.
        """
        if self.elastic:
            self._require_started()
            results = self._run_elastic(fn, args, kwargs)
            for rank, result in enumerate(results):
                for cb in callbacks or ():
                    cb((rank, result))
            return results
        return self.collect(self.run_remote(fn, args, kwargs), callbacks)

    def execute(self, fn: Callable[[Any], Any],
                callbacks: Sequence[Callable[[Any], None]] | None = None) -> list[Any]:
        """Runs `fn(executable)` on every worker's executable; results in rank order."""
        self._require_started()
        self._round += 1
        refs = [w.execute.remote(fn, with_executable=True, round_id=self._round)
                for w in self.workers]
        return self.collect(refs, callbacks)

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """Runs `fn(executable)` on rank 0 only."""
        self._require_started()
        self._round += 1
        return self.collect([self.workers[0].execute.remote(fn, with_executable=True,
                                                            round_id=self._round)],
                             None)[0]

    def collect(self, refs: list[ray.ObjectRef],
                 callbacks: Sequence[Callable[[Any], None]] | None) -> list[Any]:
        """Waits for per-rank ObjectRefs from `run_remote`; returns results in rank order.

        Raises:
            WorkerError: the root-cause failure; ranks still running `timeout_s` after it
                are killed.
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
                    for cb in callbacks or ():
                        cb((rank, results[rank]))
                except (RayTaskError, RayActorError) as exc:
                    errors[rank] = worker_error(rank, exc)
                    deadline = min(deadline, time.monotonic() + self.settings.timeout_s)
            if errors and pending and not probed:
                # Ranks whose node is cut off never report: find them now, by name.
                probed = True
                lost = unreachable({ref: self.workers[r] for ref, r in pending.items()})
                ranks = sorted(pending[ref] for ref in lost)
                errors.update(unreachable_error(
                    ranks, [self.slots[r].node_id for r in ranks],
                    f"after rank {min(errors)} failed"))
                for ref in lost:
                    ray.kill(self.workers[pending.pop(ref)], no_restart=True)
            if errors and pending and time.monotonic() > deadline:
                stuck = sorted(pending.values())
                log.warning("ranks %s did not stop %.0fs after rank %d failed; killing them",
                            stuck, self.settings.timeout_s, min(errors))
                for rank in stuck:
                    ray.kill(self.workers[rank], no_restart=True)
                break
        if errors:
            raise root_cause(errors)
        return [results[r] for r in range(len(refs))]


def fixed_knob_env(knobs: Knobs, fixed: frozenset[str]) -> dict[str, str]:
    """Env for the knobs the user fixed only, so launched ranks see the same fixed set."""
    specs = Knobs.specs()
    return {specs[name].env: value for name, value in
            zip(specs, knob_env(knobs).values()) if name in fixed}


def knob_env(knobs: Knobs) -> dict[str, str]:
    """Environment variables that set every knob to its value in `knobs`."""
    return {spec.env: str(int(value) if isinstance(value, bool) else value)
            for (name, spec), value in zip(Knobs.specs().items(), knobs.to_dict().values())}
