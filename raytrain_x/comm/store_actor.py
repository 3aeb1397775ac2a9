"""The rendezvous store: a Ray actor holding keys, with blocking waits (plain Ray, no torch).
Workers reach it through `raytrain_x.comm.store.ActorStore`."""

from __future__ import annotations

import asyncio

import ray

from raytrain_x.comm.key_table import compare_set_answer
from raytrain_x.comm.store import ABANDONED


@ray.remote(num_cpus=0)
class StoreActor:
    """Key-value store with blocking waits, served by asyncio so waiters never block setters."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._changed = asyncio.Condition()
        self._abandoned: list[str] = []  # key prefixes no one will complete

    async def abandon(self, prefix: str) -> None:
        """Keys under `prefix` will never all be set (a peer of that rendezvous round died,
        or the driver gave the round up because a member's node drains): their waiters are
        answered `ABANDONED` at once, not at their timeout."""
        async with self._changed:
            self._abandoned.append(prefix)
            self._changed.notify_all()

    def _is_abandoned(self, keys: list[str]) -> bool:
        return any(k.startswith(p) for p in self._abandoned for k in keys)

    async def set(self, key: str, value: bytes) -> None:
        async with self._changed:
            self._data[key] = value
            self._changed.notify_all()

    async def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        async with self._changed:
            store, answer = compare_set_answer(self._data.get(key), expected, desired)
            if store:
                self._data[key] = desired
                self._changed.notify_all()
            return answer

    async def add(self, key: str, amount: int) -> int:
        async with self._changed:
            value = int(self._data.get(key, b"0")) + amount
            self._data[key] = str(value).encode()
            self._changed.notify_all()
            return value

    async def wait(self, keys: list[str], timeout_s: float) -> bool | str:
        """True once every key is set; False at the timeout; `ABANDONED` when a key's
        round was abandoned first."""
        def present() -> bool:
            return all(k in self._data for k in keys)

        async with self._changed:
            try:
                await asyncio.wait_for(
                    self._changed.wait_for(lambda: present() or self._is_abandoned(keys)),
                    timeout_s)
            except asyncio.TimeoutError:
                return False
            return True if present() else ABANDONED

    async def get(self, key: str, timeout_s: float) -> bytes | str | None:
        found = await self.wait([key], timeout_s)
        if found is not True:
            return None if found is False else ABANDONED
        return self._data[key]

    async def check(self, keys: list[str]) -> bool:
        return all(k in self._data for k in keys)

    async def delete_key(self, key: str) -> bool:
        async with self._changed:
            return self._data.pop(key, None) is not None

    async def num_keys(self) -> int:
        return len(self._data)
