"""The comm layer: the `Group` interface and its backends (torch.distributed gloo/nccl,
shared memory), the groups of a rendezvous round, process-set groups, the rendezvous
store. Only this layer touches `torch.distributed`, and only inside the torch backend,
which is imported when a group is first created.
"""

from __future__ import annotations

from raytrain_x.comm.backend import Backend, Group, get_backend, register_backend
from raytrain_x.comm.groups import ProcessGroups, ProcessSetGroup
from raytrain_x.comm.rendezvous import Rendezvous, rendezvous_from_env

__all__ = [
    "Backend",
    "Group",
    "ProcessGroups",
    "ProcessSetGroup",
    "Rendezvous",
    "get_backend",
    "register_backend",
    "rendezvous_from_env",
]
