"""Process sets: subsets of ranks that run collectives among themselves (Horovod's
`ProcessSet`). The communicator behind each is a `raytrain_x.comm.ProcessSetGroup`."""

from __future__ import annotations

from collections.abc import Sequence

from raytrain_x.comm.groups import ProcessSetGroup
from raytrain_x.common.errors import ConfigError
from raytrain_x.core.runtime import engine


class ProcessSet:
    """A subset of ranks for collectives.

    Create with the member ranks, register on every rank with `add_process_set` (or pass
    to `init(process_sets=...)`), then give it to any collective as `process_set=`.

    Args:
        ranks: the global ranks of the set; None is the global set.
    """

    def __init__(self, ranks: Sequence[int] | None = None) -> None:
        self.ranks = sorted(int(r) for r in ranks) if ranks is not None else None
        self.process_set_id: int | None = 0 if ranks is None else None

    def _resolved(self) -> ProcessSetGroup:
        return engine().groups.process_set(registered_id(self))

    def size(self) -> int:
        return self._resolved().size()

    def rank(self) -> int:
        """This process's rank within the set, -1 when not a member."""
        return self._resolved().rank()

    def included(self) -> bool:
        return self._resolved().included()

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet()


def registered_id(process_set: ProcessSet) -> int:
    """The id of a registered set; a clear error for one not registered yet."""
    if process_set.process_set_id is None:
        raise ConfigError(f"process set {process_set.ranks} is not registered; call "
                          "add_process_set on every rank first")
    return process_set.process_set_id


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Registers a process set; call on every rank in the same order.

    Args:
        process_set: a `ProcessSet`, or the list of its global ranks.
    """
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.ranks is None:
        raise ConfigError("the global process set is always registered")
    created = engine().add_process_set(ps.ranks)
    ps.process_set_id = created.process_set_id
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregisters a process set on this rank (call on every rank).

    Args:
        process_set: a set `add_process_set` registered.
    """
    if process_set.process_set_id in (None, 0):
        return False
    engine().remove_process_set(process_set.process_set_id)
    process_set.process_set_id = None
    return True
