"""The communicators of one rendezvous round: world, per-host (local), across hosts (cross)
and process sets, all from one backend (`raytrain_x.comm.backend`)."""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from dataclasses import dataclass

from raytrain_x.comm.backend import DEFAULT_BACKEND, Group, get_backend
from raytrain_x.comm.rendezvous import Rendezvous
from raytrain_x.common.errors import ConfigError


@dataclass
class ProcessSetGroup:
    """The communicator of a process set (a subset of ranks that runs collectives among
    themselves); the user-facing handle is `raytrain_x.core.ProcessSet`.

    Attributes:
        process_set_id: 0 is the global set.
        ranks: global ranks of the members, sorted.
    """

    process_set_id: int
    ranks: list[int]
    group: Group | None = None  # None on non-members

    def included(self) -> bool:
        return self.group is not None

    def size(self) -> int:
        return len(self.ranks)

    def rank(self) -> int:
        """This process's rank inside the set (-1 when not a member)."""
        return self.group.rank if self.group is not None else -1


def round_prefix(round_id: int) -> str:
    """The store keys of one rendezvous round start with this (its groups' keys)."""
    return f"rtx/round{round_id}/"


class ProcessGroups:
    """All communicators of one rendezvous round: global, local, cross and process sets."""

    def __init__(self, rdv: Rendezvous, backend: str = DEFAULT_BACKEND) -> None:
        self.rdv = rdv
        self.backend = get_backend(backend)
        self._prefix = round_prefix(rdv.round).rstrip("/")
        self.world = self._subgroup("world", list(range(rdv.size)))
        layout = self.world.allgather_bytes(pickle.dumps((rdv.local_rank, rdv.cross_rank)))
        self.layout: list[tuple[int, int]] = [pickle.loads(x) for x in layout]
        self._local: Group | None = None
        self._cross: Group | None = None
        # the registered process sets by id (read them; `add_process_set` and
        # `remove_process_set` change them), and a number that changes with them
        self.sets: dict[int, ProcessSetGroup] = {
            0: ProcessSetGroup(0, list(range(rdv.size)), self.world)}
        self.sets_version = 0
        self._next_set_id = 1

    @property
    def local(self) -> Group:
        """Group of the ranks on this host (built on first use, collectively)."""
        if self._local is None:
            ranks = [r for r, (_, cross) in enumerate(self.layout) if cross == self.rdv.cross_rank]
            self._local = self._subgroup(f"local{self.rdv.cross_rank}", ranks)
        return self._local

    @property
    def cross(self) -> Group:
        """Group of the ranks with this local rank on every host."""
        if self._cross is None:
            ranks = [r for r, (local, _) in enumerate(self.layout) if local == self.rdv.local_rank]
            self._cross = self._subgroup(f"cross{self.rdv.local_rank}", ranks)
        return self._cross

    def homogeneous(self) -> bool:
        """True when every host runs the same number of workers (hierarchical ops need it)."""
        per_host: dict[int, int] = {}
        for _, cross in self.layout:
            per_host[cross] = per_host.get(cross, 0) + 1
        return len(set(per_host.values())) == 1

    def _subgroup(self, name: str, ranks: list[int]) -> Group:
        return self.backend.create_group(self.rdv.store, f"{self._prefix}/{name}",
                                         ranks.index(self.rdv.rank), len(ranks), ranks,
                                         self.rdv.timeout_s, self.rdv.address)

    def close(self, abort: bool = False) -> None:
        """Releases every communicator of this round (the store last); `abort`: a peer or
        this rank failed (`Group.close`)."""
        for ps in self.sets.values():
            if ps.group is not None and ps.group is not self.world:
                ps.group.close(abort)
        for group in (self._local, self._cross, self.world):
            if group is not None:
                group.close(abort)
        self.sets.clear()
        self._local = self._cross = None

    def add_process_set(self, ranks: Sequence[int]) -> ProcessSetGroup:
        """Registers a process set; every rank must call it with the same ranks, in the same
        order of calls. Returns the set (with a group only on members)."""
        (members,) = self.check_new_sets([ranks])
        set_id = self._next_set_id
        self._next_set_id += 1
        group = self._subgroup(f"set{set_id}", members) if self.rdv.rank in members else None
        ps = ProcessSetGroup(set_id, members, group)
        self.sets[set_id] = ps
        self.sets_version += 1
        return ps

    def check_new_sets(self, rank_lists: Sequence[Sequence[int]]) -> list[list[int]]:
        """Each set's sorted members, once every set of `rank_lists` could be registered
        after the others (ranks in the world, none twice, no set twice, none registered
        already): `init(process_sets=...)` registers all of its sets or none.

        Raises:
            ConfigError: naming the set that cannot be registered.
        """
        out: list[list[int]] = []
        taken = {tuple(existing.ranks): existing.process_set_id
                 for existing in self.sets.values()}
        for ranks in rank_lists:
            members = sorted(set(int(r) for r in ranks))
            if not members or members[0] < 0 or members[-1] >= self.rdv.size:
                raise ConfigError(f"process set ranks {list(ranks)} must be within "
                                  f"0..{self.rdv.size - 1}")
            if len(members) != len(list(ranks)):
                raise ConfigError(f"process set ranks {list(ranks)} contain duplicates")
            if tuple(members) in taken:
                where = taken[tuple(members)]
                raise ConfigError(f"a process set with ranks {members} already exists "
                                  + (f"(id {where})" if where is not None else
                                     "earlier in the same list"))
            taken[tuple(members)] = None
            out.append(members)
        return out

    def remove_process_set(self, process_set_id: int) -> None:
        if process_set_id == 0:
            raise ConfigError("the global process set (id 0) cannot be removed")
        if self.sets.pop(process_set_id, None) is None:
            raise ConfigError(f"no process set with id {process_set_id}")
        self.sets_version += 1

    def process_set_ids(self) -> frozenset[int]:
        """The ids of the registered process sets."""
        return frozenset(self.sets)

    def process_set(self, process_set_id: int) -> ProcessSetGroup:
        try:
            return self.sets[process_set_id]
        except KeyError:
            raise ConfigError(f"no process set with id {process_set_id}; create it with "
                              "add_process_set on every rank first") from None
