"""The rendezvous store: a Ray actor holding keys, and its client. No server to start, no
torch: backends adapt `ActorStore` to their own store type."""

from __future__ import annotations

import asyncio
import time

import ray

from raytrain_x.common.errors import RendezvousTimeout


@ray.remote(num_cpus=0)
class StoreActor:
    """Key-value store with blocking waits, served by asyncio so waiters never block setters."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._changed = asyncio.Condition()

    async def set(self, key: str, value: bytes) -> None:
        async with self._changed:
            self._data[key] = value
            self._changed.notify_all()

    async def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        async with self._changed:
            current = self._data.get(key)
            if (current is None and expected == b"") or current == expected:
                self._data[key] = desired
                self._changed.notify_all()
                return desired
            return current if current is not None else expected

    async def add(self, key: str, amount: int) -> int:
        async with self._changed:
            value = int(self._data.get(key, b"0")) + amount
            self._data[key] = str(value).encode()
            self._changed.notify_all()
            return value

    async def wait(self, keys: list[str], timeout_s: float) -> bool:
        async with self._changed:
            try:
                await asyncio.wait_for(
                    self._changed.wait_for(lambda: all(k in self._data for k in keys)), timeout_s
                )
                return True
            except asyncio.TimeoutError:
                return False

    async def get(self, key: str, timeout_s: float) -> bytes | None:
        if not await self.wait([key], timeout_s):
            return None
        return self._data[key]

    async def check(self, keys: list[str]) -> bool:
        return all(k in self._data for k in keys)

    async def delete_key(self, key: str) -> bool:
        async with self._changed:
            return self._data.pop(key, None) is not None

    async def num_keys(self) -> int:
        return len(self._data)


def call_actor(method, *args, attempts: int = 20, pause_s: float = 0.5):
    """`ray.get(method.remote(*args))`, retried while Ray reports the actor as temporarily
    unavailable (its node was just lost and the cluster is re-checking its members)."""
    for attempt in range(attempts):
        try:
            return ray.get(method.remote(*args))
        except ray.exceptions.ActorUnavailableError:
            if attempt == attempts - 1:
                raise
            time.sleep(pause_s)


class ActorStore:
    """A client of a `StoreActor`: the rendezvous store of one job, plain Ray (no torch).

    Backends adapt it to their own store type (`raytrain_x.comm.torch_store.RayStore`).

    Args:
        actor: handle of a `StoreActor` every worker shares.
        timeout_s: how long `get`/`wait` block before raising `RendezvousTimeout`.
    """

    def __init__(self, actor: ray.actor.ActorHandle, timeout_s: float = 30.0) -> None:
        self.actor = actor
        self.timeout_s = timeout_s

    def __reduce__(self):
        return (ActorStore, (self.actor, self.timeout_s))

    def set(self, key: str, value) -> None:
        call_actor(self.actor.set, key, _as_bytes(value))

    def get(self, key: str) -> bytes:
        start = time.monotonic()
        value = call_actor(self.actor.get, key, self.timeout_s)
        if value is None:
            raise RendezvousTimeout(
                f"rendezvous key {key!r} did not appear within {self.timeout_s:.0f}s "
                f"(waited {time.monotonic() - start:.1f}s); a worker did not start or died"
            )
        return value

    def add(self, key: str, amount: int) -> int:
        return call_actor(self.actor.add, key, int(amount))

    def compare_set(self, key: str, expected, desired) -> bytes:
        return call_actor(self.actor.compare_set, key, _as_bytes(expected), _as_bytes(desired))

    def wait(self, keys: list[str], timeout_s: float | None = None) -> None:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        if not call_actor(self.actor.wait, list(keys), timeout_s):
            raise RendezvousTimeout(f"rendezvous keys {list(keys)} did not all appear within "
                                    f"{timeout_s:.0f}s; a worker did not start or died")

    def check(self, keys: list[str]) -> bool:
        return call_actor(self.actor.check, list(keys))

    def delete_key(self, key: str) -> bool:
        return call_actor(self.actor.delete_key, key)

    def num_keys(self) -> int:
        return call_actor(self.actor.num_keys)


def _as_bytes(value) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)
