"""The rendezvous store as a `torch.distributed.Store`, for torch's gloo and nccl groups."""

from __future__ import annotations

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
