"""Horovod's `horovod.run(func, np=...)`: a function run on N Ray workers, its results
returned in rank order (`raytrain_x.run`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from raytrain_x.common.errors import ConfigError
from raytrain_x.ray.connect import ensure_ray
from raytrain_x.ray.executor import RayExecutor

log = logging.getLogger("raytrain_x")

# horovod.run's arguments for ssh and network interfaces: Ray places and connects the workers
_IGNORED = ("ssh_port", "ssh_identity_file", "network_interface", "disable_cache")
# ... and those that would change what runs: refused rather than silently dropped
_REFUSED = {"hostfile": "give hosts='host:slots,...'",
            "mpi_args": "there is no MPI (gloo, and NCCL on GPUs, carry the collectives)",
            "executable": "the workers run the driver's Python",
            "output_filename": "the workers' output comes to this process (verbose=2)"}


def run(func: Callable[..., Any], args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
        np: int = 1, min_np: int | None = None, max_np: int | None = None,
        slots: int | None = None, reset_limit: int | None = None,
        hosts: str | None = None, start_timeout: float | None = None,
        verbose: int | None = None, use_gloo: bool | None = None, use_mpi: bool | None = None,
        address: str | None = None, **unsupported: Any) -> list[Any]:
    """Runs `func(*args, **kwargs)` on `np` workers joined into one world and returns each
    rank's result, in rank order, as `horovod.run` does.

    Args:
        func: the training function; it calls `init()` itself, as under horovodrun.
        args, kwargs: its arguments.
        np: the number of workers (an elastic job's starting size).
        min_np, max_np: an elastic job's bounds (Horovod's elastic `run`); `func` then
            uses `elastic.run` and a state, and the results are the last round's.
        slots: workers per host of `hosts` where a host gives no count.
        reset_limit: an elastic job's most resets.
        hosts: `host:slots,...`: the Ray nodes to run on (by address or hostname).
        start_timeout: seconds the workers may take to start.
        verbose: Horovod's verbosity (2 prints the workers' log lines).
        use_gloo: accepted: gloo is the transport. use_mpi: True is refused (no MPI).
        address: a Ray cluster to join (default: `RAY_ADDRESS`, else a new local one).

    Raises:
        ConfigError: an argument that has no meaning here (MPI, ssh, a host file).
        WorkerError: a rank raised; names the rank and its traceback.
    """
    if use_mpi:
        raise ConfigError("run(use_mpi=True): raytrain-x has no MPI; drop use_mpi (gloo, "
                          "and NCCL on GPUs, carry the collectives)")
    unknown = sorted(set(unsupported) - set(_IGNORED) - set(_REFUSED))
    if unknown:
        raise TypeError(f"run() got unexpected keyword arguments {unknown}")
    for name, why in _REFUSED.items():
        if unsupported.get(name) not in (None, False):
            raise ConfigError(f"run({name}=...): not used on Ray: {why}")
    ignored = sorted(k for k in _IGNORED if unsupported.get(k) not in (None, False))
    if ignored:
        log.warning("raytrain-x: run(%s): not used; Ray places and connects the workers",
                    ", ".join(ignored))
    if not isinstance(np, int) or isinstance(np, bool) or np < 1:
        raise ConfigError(f"run(np=...) must be an int >= 1, got {np!r}")
    ensure_ray(address, log_to_driver=bool(verbose and verbose >= 2))
    settings = RayExecutor.create_settings(verbose=verbose)
    elastic = min_np is not None or max_np is not None
    shape: dict[str, Any] = dict(min_workers=min_np or 1, max_workers=max_np or np,
                                 reset_limit=reset_limit) if elastic else dict(num_workers=np)
    executor = RayExecutor(settings, hosts=hosts, slots_per_host=slots,
                           start_timeout_s=start_timeout, **shape)
    executor.start()
    try:
        return executor.run(func, list(args), dict(kwargs or {}))
    finally:
        executor.shutdown()
