"""The rendezvous store: a Ray actor holding keys, with blocking waits (plain Ray, no torch).
Workers reach it through `raytrain_x.comm.store.ActorStore`.

A wait parks on the one key it misses, so a write wakes only the calls waiting for that
key (not every parked call, which made each write cost O(waiting calls)). The actor and
the elastic rounds actor take as many calls at once as `control_concurrency` says for the
job's size: with Ray's default for async actors (1,000) the thousand-and-first parked call
queued behind the others, and so did every write that would have answered them.
"""

from __future__ import annotations

import asyncio
from collections import Counter, defaultdict

import ray

from raytrain_x.comm.key_table import compare_set_answer
from raytrain_x.comm.store import ABANDONED

# Ray's default `max_concurrency` for an async actor
RAY_ASYNC_CONCURRENCY = 1_000


# the most: what 25,000 workers ask (Ray takes an int32; an elastic job without a
# `max_workers` has no bound of its own)
MOST_CONTROL_CONCURRENCY = 100_064


def control_concurrency(workers: int) -> int:
    """How many calls a job's control actor (the store, the rounds) takes at once: every
    worker may park a call from each of its threads that talks to it (the face's and the
    engine's, and a join) and the driver adds its own, so 4 per worker and 64 more; never
    fewer than Ray's default, nor more than `MOST_CONTROL_CONCURRENCY`. A parked call is a
    coroutine of a few KB."""
    return min(max(RAY_ASYNC_CONCURRENCY, 4 * workers + 64), MOST_CONTROL_CONCURRENCY)


@ray.remote(num_cpus=0)
class StoreActor:
    """Key-value store with blocking waits, served by asyncio so waiters never block setters."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        # key -> the parked calls waiting for it (each waits for one key at a time)
        self._waiters: dict[str, set[asyncio.Future]] = defaultdict(set)
        self._abandoned: set[str] = set()  # key prefixes no one will complete
        self._calls: Counter[str] = Counter()  # calls taken, by method (`calls()`)

    def _wake(self, key: str) -> None:
        for future in self._waiters.pop(key, ()):
            if not future.done():
                future.set_result(None)

    async def abandon(self, prefix: str) -> None:
        """Keys under `prefix` will never all be set (a peer of that rendezvous round died,
        or the driver gave the round up because a member's node drains): their waiters are
        answered `ABANDONED` at once, not at their timeout."""
        self._abandoned.add(prefix)
        for key in [k for k in self._waiters if k.startswith(prefix)]:
            self._wake(key)

    async def delete_prefix(self, prefix: str) -> int:
        """Deletes every key under `prefix` (a round that ended: its keys would otherwise
        stay for the job's life) and forgets that it was abandoned; returns how many keys.
        A wait parked on one of them keeps waiting for it."""
        doomed = [k for k in self._data if k.startswith(prefix)]
        for key in doomed:
            del self._data[key]
        self._abandoned = {p for p in self._abandoned if not p.startswith(prefix)}
        return len(doomed)

    def _is_abandoned(self, key: str) -> bool:
        return any(key.startswith(p) for p in self._abandoned)

    async def set(self, key: str, value: bytes) -> None:
        self._calls["set"] += 1
        self._data[key] = value
        self._wake(key)

    async def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        self._calls["compare_set"] += 1
        store, answer = compare_set_answer(self._data.get(key), expected, desired)
        if store:
            self._data[key] = desired
            self._wake(key)
        return answer

    async def add(self, key: str, amount: int) -> int:
        self._calls["add"] += 1
        value = int(self._data.get(key, b"0")) + amount
        self._data[key] = str(value).encode()
        self._wake(key)
        return value

    async def wait(self, keys: list[str], timeout_s: float) -> bool | str:
        """True once every key is set; False at the timeout; `ABANDONED` when a key's
        round was abandoned first."""
        self._calls["wait"] += 1
        return await self._wait(keys, timeout_s)

    async def _wait(self, keys: list[str], timeout_s: float) -> bool | str:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        found = 0  # keys[:found] were there when last looked at
        while True:
            while found < len(keys) and keys[found] in self._data:
                found += 1
            if found == len(keys):
                if all(k in self._data for k in keys):  # none deleted meanwhile
                    return True
                found = 0
                continue
            missing = keys[found]
            if self._is_abandoned(missing):
                return ABANDONED
            left = deadline - loop.time()
            if left <= 0:
                return False
            future = loop.create_future()
            parked = self._waiters[missing]
            parked.add(future)
            try:
                await asyncio.wait_for(future, left)
            except asyncio.TimeoutError:
                return False
            finally:
                parked.discard(future)
                if not parked and self._waiters.get(missing) is parked:
                    del self._waiters[missing]

    async def get(self, key: str, timeout_s: float) -> bytes | str | None:
        self._calls["get"] += 1
        found = await self._wait([key], timeout_s)
        if found is not True:
            return None if found is False else ABANDONED
        return self._data[key]

    async def multi_get(self, keys: list[str], timeout_s: float) -> list[bytes] | str | None:
        """Every key's value once all are set, in one call (a group's full mesh reads every
        rank's address: one call a rank, where a get per key made N)."""
        self._calls["multi_get"] += 1
        found = await self._wait(keys, timeout_s)
        if found is not True:
            return None if found is False else ABANDONED
        return [self._data[k] for k in keys]

    async def check(self, keys: list[str]) -> bool:
        return all(k in self._data for k in keys)

    async def delete_key(self, key: str) -> bool:
        return self._data.pop(key, None) is not None

    async def num_keys(self) -> int:
        return len(self._data)

    async def calls(self) -> dict[str, int]:
        """The calls taken so far, by method."""
        return dict(self._calls)

    async def parked(self) -> int:
        """How many calls wait for a key now."""
        return sum(len(p) for p in self._waiters.values())
