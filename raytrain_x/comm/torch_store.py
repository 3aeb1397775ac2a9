"""The rendezvous store as a `torch.distributed.Store`, for torch's gloo and nccl groups."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from raytrain_x.comm.job_store import JobStoreClient, open_job_store
from raytrain_x.comm.rendezvous import TcpStoreAddress
from raytrain_x.comm.store import ActorStore


class RayStore(dist.Store):
    """`torch.distributed.Store` over a rendezvous store client: an `ActorStore` (data in a
    Ray actor) or a `JobStoreClient` (a launched job's secret-checking TCP store)."""

    def __init__(self, store: ActorStore | JobStoreClient) -> None:
        super().__init__()
        self._store = store

    def __reduce__(self):
        return (RayStore, (self._store,))

    def set_timeout(self, timeout: timedelta) -> None:
        """Kept at the job's timeout: a gloo group sets the store's timeout to its own,
        which is a fraction of the job's (`torch_backend.GLOO_CONNECT_TRIES`), and a peer
        slower to the rendezvous than that is no failure."""

    def set(self, key: str, value) -> None:
        self._store.set(key, value)

    def get(self, key: str) -> bytes:
        return self._store.get(key)

    def add(self, key: str, amount: int) -> int:
        return self._store.add(key, amount)

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self._store.compare_set(key, expected, desired)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Waits the job's timeout whatever `timeout` a group passes (`set_timeout`)."""
        self._store.wait(keys)

    def check(self, keys: list[str]) -> bool:
        return self._store.check(keys)

    def delete_key(self, key: str) -> bool:
        return self._store.delete_key(key)

    def num_keys(self) -> int:
        return self._store.num_keys()


# a key of a gloo group, as the group's store sees it: `<context>/<rank>` (each of the
# group's gloo contexts keeps every rank's address under its index)
_PEER_KEY = re.compile(r"^(\d+)/(\d+)$")


class PeerStore(dist.Store):
    """One group's keys (under `prefix`) in a rendezvous store actor, each peer's address
    read in one call. gloo connects a group's pairs lazily (`torch_backend.lazy_gloo_group`):
    a rank sets its own address once and, when a collective first needs a peer, waits for
    and gets that peer's key. The wait fetches the value (one call to the actor, not a wait
    and a get) and the get is served from memory. A rank so makes one call per peer it
    ever talks to (2 for a ring, log2 N for a tree), not 2N as gloo's full mesh did, and
    reads 154 bytes a peer (a full mesh's address carries a sequence number per peer)."""

    def __init__(self, store: ActorStore, prefix: str) -> None:
        super().__init__()
        self._store = store
        self._prefix = f"{prefix}/"
        self._fetched: dict[str, bytes] = {}  # peer key -> value not read yet

    def __reduce__(self):
        return (PeerStore, (self._store, self._prefix[:-1]))

    def set_timeout(self, timeout: timedelta) -> None:
        """Kept at the job's timeout (`RayStore.set_timeout`)."""

    def set(self, key: str, value) -> None:
        self._store.set(self._prefix + key, value)

    def get(self, key: str) -> bytes:
        value = self._fetched.pop(key, None)
        return value if value is not None else self._store.get(self._prefix + key)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if all(_PEER_KEY.match(k) for k in keys):
            unread = [k for k in keys if k not in self._fetched]
            if unread:
                values = self._store.multi_get([self._prefix + k for k in unread])
                self._fetched.update(zip(unread, values))
            return
        self._store.wait([self._prefix + k for k in keys])

    def add(self, key: str, amount: int) -> int:
        return self._store.add(self._prefix + key, amount)

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self._store.compare_set(self._prefix + key, expected, desired)

    def check(self, keys: list[str]) -> bool:
        return self._store.check([self._prefix + k for k in keys])

    def delete_key(self, key: str) -> bool:
        return self._store.delete_key(self._prefix + key)

    def num_keys(self) -> int:
        return self._store.num_keys()


def group_store(store: Any, prefix: str) -> dist.Store:
    """The torch Store of one group whose keys live under `prefix`."""
    if isinstance(store, ActorStore):
        return PeerStore(store, prefix)
    base = as_torch_store(store) if store is not None else dist.HashStore()
    return dist.PrefixStore(prefix, base)


def as_torch_store(store: Any) -> dist.Store:
    """A torch Store for a rendezvous store: torch's own pass through, an `ActorStore` is
    wrapped, a `TcpStoreAddress` is opened (once per process; rank 0 serves it)."""
    if isinstance(store, dist.Store):
        return store
    if isinstance(store, (ActorStore, JobStoreClient)):
        return RayStore(store)
    if isinstance(store, TcpStoreAddress):
        if store.opened is None:
            store.opened = RayStore(open_job_store(store.host, store.port, store.secret,
                                                   store.timeout_s, serve=store.is_server))
        return store.opened
    raise TypeError(f"cannot use {type(store).__name__} as a rendezvous store")
