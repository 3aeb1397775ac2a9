"""What an executor starts from: its timeouts (`create_settings`), the Ray it connects to,
and the job's name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray

from raytrain_x.common.settings import JOB_NAME, TIMEOUT_S


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
    """Connects to Ray: `address`, else a running cluster (`auto`), else a local one.

    Args:
        address: a Ray address (`auto`, `ray://...`, `host:port`, `local`); None tries a running
            cluster, then starts a local one.
    """
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, **init_kwargs)
        return
    try:
        ray.init(address="auto", **init_kwargs)
    except ConnectionError:
        ray.init(**init_kwargs)


_executors_started = 0  # in this process: numbers the default job names


def job_name() -> str:
    """`RAYTRAIN_X_JOB_NAME`, else the Ray job's id and this executor's number in it
    (`02000000.1`): distinct for every executor a driver (or a Tune trial) starts."""
    global _executors_started
    _executors_started += 1
    return JOB_NAME.read() or f"{ray.get_runtime_context().get_job_id()}.{_executors_started}"
