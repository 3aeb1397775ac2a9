"""`ElasticRayExecutor`: Horovod's earlier elastic Ray class (deprecated there in favour of
`RayExecutor(min_workers=..., max_workers=...)`), kept so the scripts that use it run; it
is a `RayExecutor` with Horovod's spellings."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from raytrain_x.common.errors import ConfigError
from raytrain_x.ray.connect import Settings, make_settings
from raytrain_x.ray.executor import RayExecutor


@dataclass
class ElasticExecutorSettings:
    """What `ElasticRayExecutor.create_settings` returns: the executor's settings and the
    job's elastic bounds (Horovod's `min_np`/`max_np`)."""

    settings: Settings
    min_np: int = 1
    max_np: int | None = None
    reset_limit: int | None = None
    elastic_timeout: float = 600.0
    # Horovod's `settings.discovery = ...`: a HostDiscovery (`find_available_hosts_and_slots`)
    # the job uses when `override_discovery=False`
    discovery: Any = None


class ElasticRayExecutor:
    """Horovod's deprecated elastic executor: `create_settings(min_np, max_np, ...)`, then
    `ElasticRayExecutor(settings, use_gpu, cpus_per_slot, gpus_per_slot, env_vars)`,
    `start()` and `run(worker_fn)`. Use `RayExecutor(settings, min_workers=...,
    max_workers=...)` in new code.

    Args:
        settings: from `ElasticRayExecutor.create_settings`.
        use_gpu: a GPU per worker (`gpus_per_slot` of them).
        cpus_per_slot: CPUs per worker.
        gpus_per_slot: GPUs per worker, with `use_gpu`.
        env_vars: environment variables for every worker (strings).
        override_discovery: Horovod's: True (the default) discovers Ray's nodes; False uses
            the `settings.discovery` object set before (a `HostDiscovery`, such as
            `TestDiscovery`).
    """

    @staticmethod
    def create_settings(min_np: int = 1, max_np: int | None = None,
                        reset_limit: int | None = None, elastic_timeout: float = 600,
                        timeout_s: float = 30, ssh_identity_file: str | None = None,
                        nics: Any = None, min_num_proc: int | None = None,
                        max_num_proc: int | None = None, verbose: Any = None,
                        **others: Any) -> ElasticExecutorSettings:
        """Horovod's arguments; `min_num_proc`/`max_num_proc` are its other names of
        `min_np`/`max_np`."""
        min_np = min_num_proc if min_num_proc is not None else min_np
        max_np = max_num_proc if max_num_proc is not None else max_np
        settings = make_settings(timeout_s, verbose=verbose,
                                 ssh_identity_file=ssh_identity_file, nics=nics, **others)
        return ElasticExecutorSettings(settings, min_np, max_np, reset_limit,
                                       elastic_timeout)

    def __init__(self, settings: ElasticExecutorSettings, use_gpu: bool = False,
                 cpus_per_slot: float = 1, gpus_per_slot: float | None = None,
                 env_vars: dict[str, str] | None = None,
                 override_discovery: bool = True) -> None:
        warnings.warn("ElasticRayExecutor is deprecated, as in Horovod: use "
                      "RayExecutor(settings, min_workers=..., max_workers=...)",
                      DeprecationWarning, stacklevel=2)
        if not isinstance(settings, ElasticExecutorSettings):
            raise ConfigError("settings must come from ElasticRayExecutor.create_settings(...), "
                              f"got {type(settings).__name__}")
        self.executor = RayExecutor(
            settings.settings, min_workers=settings.min_np, max_workers=settings.max_np,
            reset_limit=settings.reset_limit, elastic_timeout=settings.elastic_timeout,
            use_gpu=use_gpu, cpus_per_slot=cpus_per_slot,
            gpus_per_slot=gpus_per_slot if use_gpu else None,
            override_discovery=override_discovery)
        if not override_discovery:
            if settings.discovery is None:
                raise ConfigError("override_discovery=False uses settings.discovery: set it "
                                  "to a HostDiscovery (for example TestDiscovery) first")
            self.executor.host_discovery = settings.discovery
        self.env_vars = dict(env_vars or {})

    def start(self) -> None:
        self.executor.start(extra_env_vars=self.env_vars)

    def run(self, worker_fn: Callable[[], Any],
            callbacks: Sequence[Callable[[Any], None]] | None = None) -> list[Any]:
        """Runs `worker_fn` elastically; its results, one per worker that finished."""
        return self.executor.run(worker_fn, callbacks=callbacks)

    def shutdown(self) -> None:
        self.executor.shutdown()
