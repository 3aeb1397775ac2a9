"""torch.distributed's default process group on a raytrain-x world, for loops written for
Ray Train's `TorchTrainer`: `ray.train.torch.prepare_model` wraps the model in
`DistributedDataParallel`, which needs the default group that `TorchTrainer`'s backend makes.
`RaytrainXTrainer` makes the same on its workers."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

ADDRESS_KEY = "torch-default-group/address"  # rank 0's TCPStore, in the world's store


def init_default_group(store: Any, rank: int, size: int, timeout_s: float,
                       rank0_host: str) -> str:
    """Joins torch's default process group of `size` ranks; every rank calls it at once.
    Rank 0 serves a torch `TCPStore` on `rank0_host`, as `TorchTrainer`'s backend does, and
    tells the others where through `store` (a rendezvous store client every rank shares).
    NCCL where this worker has a GPU, else gloo, as `TorchTrainer` chooses.

    Returns:
        The backend of the group ("" where one was made already).
    """
    if dist.is_initialized():
        return ""
    timeout = timedelta(seconds=timeout_s)
    if rank == 0:
        tcp = dist.TCPStore(rank0_host, 0, size, is_master=True, timeout=timeout,
                            wait_for_workers=False)
        store.set(ADDRESS_KEY, f"{rank0_host}:{tcp.port}".encode())
    else:
        host, port = store.get(ADDRESS_KEY).decode().rsplit(":", 1)
        tcp = dist.TCPStore(host, int(port), size, is_master=False, timeout=timeout)
    backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    dist.init_process_group(backend, store=tcp, rank=rank, world_size=size, timeout=timeout)
    return backend


def destroy_default_group() -> None:
    """Leaves the default group, where this process has one."""
    if dist.is_initialized():
        dist.destroy_process_group()
