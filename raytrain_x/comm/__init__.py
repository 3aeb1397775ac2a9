"""The comm layer: process groups over torch.distributed, process sets, rendezvous stores.

Only this layer touches `torch.distributed`.
"""

from __future__ import annotations

from raytrain_x.comm.groups import Group, ProcessGroups, ProcessSet, nccl_available
from raytrain_x.comm.rendezvous import (
    Rendezvous,
    next_rendezvous,
    rendezvous_from_env,
    set_rendezvous_provider,
)

__all__ = [
    "Group",
    "ProcessGroups",
    "ProcessSet",
    "Rendezvous",
    "nccl_available",
    "next_rendezvous",
    "rendezvous_from_env",
    "set_rendezvous_provider",
]
