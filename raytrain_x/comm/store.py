"""The client of the rendezvous store actor (`raytrain_x.comm.store_actor`). No server to
start and no torch: backends adapt `ActorStore` to their own store type. Ray is imported
only when the store is used, so a process launched without Ray never loads it."""

from __future__ import annotations

import time
from typing import Any

from raytrain_x.common.errors import InternalError, RendezvousTimeout
from raytrain_x.common.settings import TIMEOUT_S

ABANDONED = "abandoned"  # the store actor's answer for a key of an abandoned round


def call_actor(method, *args, attempts: int = 20, pause_s: float = 0.5):
    """`ray.get(method.remote(*args))`, retried while Ray reports the actor as temporarily
    unavailable (its node was just lost and the cluster is re-checking its members)."""
    import ray
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
        actor: handle of a `StoreActor` (`raytrain_x.comm.store_actor`) every worker shares.
        timeout_s: how long `get`/`wait` block before raising `RendezvousTimeout`.
    """

    def __init__(self, actor: Any, timeout_s: float = TIMEOUT_S.default) -> None:
        self.actor = actor
        self.timeout_s = timeout_s

    def __reduce__(self):
        return (ActorStore, (self.actor, self.timeout_s))

    def set(self, key: str, value) -> None:
        call_actor(self.actor.set, key, _as_bytes(value))

    def get(self, key: str) -> bytes:
        start = time.monotonic()
        value = call_actor(self.actor.get, key, self.timeout_s)
        if value == ABANDONED:
            raise InternalError(_ABANDONED_ERROR.format(key=key))
        if value is None:
            raise RendezvousTimeout(
                f"rendezvous key {key!r} did not appear within {self.timeout_s:.0f}s "
                f"(waited {time.monotonic() - start:.1f}s); a worker did not start or died"
            )
        return value

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """Every key's value, once all are set, in one call."""
        start = time.monotonic()
        values = call_actor(self.actor.multi_get, list(keys), self.timeout_s)
        if values == ABANDONED:
            raise InternalError(_ABANDONED_ERROR.format(key=keys[0]))
        if values is None:
            raise RendezvousTimeout(
                f"rendezvous keys {keys[0]!r} ... {keys[-1]!r} did not all appear within "
                f"{self.timeout_s:.0f}s (waited {time.monotonic() - start:.1f}s); a worker "
                "did not start or died")
        return values

    def add(self, key: str, amount: int) -> int:
        return call_actor(self.actor.add, key, int(amount))

    def compare_set(self, key: str, expected, desired) -> bytes:
        return call_actor(self.actor.compare_set, key, _as_bytes(expected), _as_bytes(desired))

    def wait(self, keys: list[str], timeout_s: float | None = None) -> None:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        found = call_actor(self.actor.wait, list(keys), timeout_s)
        if found == ABANDONED:
            raise InternalError(_ABANDONED_ERROR.format(key=keys[0]))
        if not found:
            raise RendezvousTimeout(f"rendezvous keys {list(keys)} did not all appear within "
                                    f"{timeout_s:.0f}s; a worker did not start or died")

    def check(self, keys: list[str]) -> bool:
        return call_actor(self.actor.check, list(keys))

    def delete_key(self, key: str) -> bool:
        return call_actor(self.actor.delete_key, key)

    def num_keys(self) -> int:
        return call_actor(self.actor.num_keys)


_ABANDONED_ERROR = ("rendezvous key {key!r} belongs to a round the elastic driver abandoned: a "
                    "peer died, or its node started draining, while the round formed; the "
                    "next round forms without it")


def _as_bytes(value) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)
