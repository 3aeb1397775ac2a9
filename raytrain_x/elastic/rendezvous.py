"""The elastic coordinator actor: workers wait in it for the driver to form each round."""

from __future__ import annotations

import asyncio
from typing import Any

import ray


@ray.remote(num_cpus=0)
class ElasticCoordinator:
    """Rendezvous rounds and the host-set version (asyncio: many workers wait at once)."""

    def __init__(self) -> None:
        self._waiting: dict[str, asyncio.Future] = {}
        self._hosts_version = 0
        self._error: str | None = None

    async def join(self, worker_id: str) -> dict[str, Any]:
        """Blocks until the driver puts this worker in a round; returns its place."""
        if self._error:
            raise RuntimeError(self._error)
        future = asyncio.get_running_loop().create_future()
        self._waiting[worker_id] = future
        return await future

    async def waiting(self) -> list[str]:
        return list(self._waiting)

    async def publish(self, assignments: dict[str, dict[str, Any]]) -> None:
        for worker_id, place in assignments.items():
            future = self._waiting.pop(worker_id, None)
            if future is not None and not future.done():
                future.set_result(place)

    async def fail(self, message: str) -> None:
        """Ends the job: every waiting and future join raises `message`."""
        self._error = message
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(RuntimeError(message))
        self._waiting.clear()

    async def bump_hosts(self) -> int:
        self._hosts_version += 1
        return self._hosts_version

    async def hosts_version(self) -> int:
        return self._hosts_version
