"""What an executor starts from: its timeouts (`create_settings`), the Ray it connects to,
and the job's name."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, NamedTuple

import ray

from raytrain_x.common.errors import ConfigError
from raytrain_x.common.process import next_number
from raytrain_x.common.settings import JOB_NAME, TIMEOUT_S, check_seconds

log = logging.getLogger("raytrain_x")


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
    verbose: int = 0  # Horovod's: 1 logs the job's progress (INFO), 2 its details (DEBUG)


# Horovod's create_settings arguments for ssh and network interfaces: Ray starts and
# connects the workers itself, so they are taken and not used
NOT_USED_ON_RAY = ("ssh_identity_file", "ssh_str", "nics")


def make_settings(timeout_s: float = TIMEOUT_S.default,
                  placement_group_timeout_s: float = 100.0, verbose: Any = None,
                  **others: Any) -> Settings:
    """`RayExecutor.create_settings`: Horovod's arguments, checked at the call."""
    unknown = sorted(set(others) - set(NOT_USED_ON_RAY))
    if unknown:
        raise ConfigError(f"create_settings does not take {unknown}; it takes timeout_s, "
                          "placement_group_timeout_s, verbose and Horovod's "
                          f"{', '.join(NOT_USED_ON_RAY)}")
    ignored = sorted(k for k, v in others.items() if v is not None)
    if ignored:
        log.warning("raytrain-x: create_settings(%s): not used; Ray places and connects the "
                    "workers itself", ", ".join(ignored))
    if verbose is None or verbose is False:
        level = 0
    elif verbose is True or (isinstance(verbose, int) and not isinstance(verbose, bool)
                             and verbose >= 0):
        level = int(verbose)
    else:
        raise ConfigError(f"verbose must be a bool or an int >= 0, got {verbose!r}")
    return Settings(check_seconds("timeout_s", timeout_s),
                    check_seconds("placement_group_timeout_s", placement_group_timeout_s),
                    level)


def apply_verbose(level: int) -> None:
    """Horovod's `verbose`: the job's loggers at INFO (1) or DEBUG (2 and more)."""
    if level:
        logging.getLogger("raytrain_x").setLevel(logging.INFO if level == 1 else logging.DEBUG)


class Connected(NamedTuple):
    """What `ensure_ray` did: a line for the user, and whether it started a Ray of this
    process's own (which cannot grow: `check_fits_local`)."""

    line: str
    started: bool


def ensure_ray(address: str | None = None, **init_kwargs: Any) -> Connected:
    """Connects to Ray: `address`, else `RAY_ADDRESS`, else a new local Ray of this process's
    own. A cluster that merely runs on the machine (another terminal's job, a neighbour's
    `ray start`) is never joined unasked: name it with `address="auto"` or its address.

    Args:
        address: a Ray address (`auto`, `ray://...`, `host:port`, `local`); None reads
            `RAY_ADDRESS`, then starts a local Ray.

    Returns:
        What this process is connected to: "joined ...", "started ..." or "already
        connected ...", and whether it started the Ray.
    """
    if ray.is_initialized():
        return Connected("already connected to Ray", False)
    named = address or os.environ.get("RAY_ADDRESS") or None
    ray.init(address=named or "local", **init_kwargs)
    if named:
        return Connected(f"joined the Ray cluster at {named} ({_cpus()} CPUs)", False)
    return Connected(f"started a local Ray of {_cpus()} CPUs for this job (--address or "
                     "RAY_ADDRESS joins a running cluster)", True)


def _cpus() -> str:
    cpus = ray.cluster_resources().get("CPU", 0)
    return f"{cpus:g}"


def check_fits_local(workers: int, cpus_per_worker: float, gpus_per_worker: float) -> None:
    """A Ray this process started cannot grow: more workers than it can place fail at once,
    with the arithmetic, instead of waiting out the placement timeout.

    Raises:
        ConfigError: the workers need more CPUs or GPUs than the local Ray has.
    """
    have = ray.cluster_resources()
    for kind, per in (("CPU", cpus_per_worker), ("GPU", gpus_per_worker)):
        need = workers * per
        if per and need > have.get(kind, 0) + 1e-9:
            fit = int(have.get(kind, 0) // per)
            raise ConfigError(
                f"{workers} workers need {need:g} {kind}s ({per:g} each) and the local Ray "
                f"this job started has {have.get(kind, 0):g}: give -np {fit} or fewer"
                + (", a smaller --cpus-per-worker" if kind == "CPU" else "")
                + ", or --address of a cluster with room")


def job_name() -> str:
    """`RAYTRAIN_X_JOB_NAME`, else the Ray job's id and this executor's number in it
    (`02000000.1`): distinct for every executor a driver (or a Tune trial) starts."""
    number = next_number("executor") + 1  # this process's executors, from 1
    return JOB_NAME.read() or f"{ray.get_runtime_context().get_job_id()}.{number}"


def horovod_shape(num_workers: Any, min_workers: Any, num_workers_per_host: Any,
                  cpus_per_worker: Any, gpus_per_worker: Any, cpus_per_slot: Any,
                  gpus_per_slot: Any) -> tuple[int, float, float | None]:
    """`RayExecutor`'s shape with Horovod's spellings: `None` for `num_workers_per_host`
    (one), `cpus_per_slot`/`gpus_per_slot` (older names of `cpus_per_worker`/
    `gpus_per_worker`). Both `num_workers` and `min_workers` is a `ConfigError` (a
    `ValueError`, as Horovod's): a job is fixed or elastic."""
    if num_workers is not None and min_workers is not None:
        raise ConfigError("Both `min_workers` and `num_workers` provided. Give num_workers "
                          "for a fixed-size job or min_workers/max_workers for an elastic "
                          "one, not both")
    for new, old, value, alias in (("cpus_per_worker", "cpus_per_slot", cpus_per_worker,
                                    cpus_per_slot),
                                   ("gpus_per_worker", "gpus_per_slot", gpus_per_worker,
                                    gpus_per_slot)):
        if value is not None and alias is not None:
            raise ConfigError(f"give {new} or {old} (Horovod's older name), not both")
    cpus = cpus_per_slot if cpus_per_slot is not None else cpus_per_worker
    gpus = gpus_per_slot if gpus_per_slot is not None else gpus_per_worker
    return (1 if num_workers_per_host is None else num_workers_per_host,
            1 if cpus is None else cpus, gpus)
