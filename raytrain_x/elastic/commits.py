"""The commit manager: one per elastic state, the only writer of its commit state.

What survives a failure is what was last committed, and one object owns all of it (as
torchft's `Manager` alone owns a process's step, quorum and errors):

- the commit number, and the generation of the run that committed it (its writer lease);
- the committed host copy of the state, and with a sharded optimizer who holds which shards
  and replicas (`Shards`);
- the durable checkpoints: when one is due, this rank's background writer and its result
  (`raytrain_x.elastic.durable`), the restore from storage;
- the process's record: the round of the state it holds (what the driver reads at each
  join) and how many times it rolled back.

A framework's state gives a `Format` (its tree of tensors and values, how to take a host
copy of it, load one, sync it from a rank, save and read a part) and, for a sharded
optimizer, `Shards`; the manager reaches into nothing else. The states (`ObjectState`,
`TorchState`, the TensorFlow and Keras states) are thin faces over it.

Whether a round restores from memory or from storage is the driver's decision: the round's
rendezvous says so and names the checkpoint (`Rendezvous.restore_checkpoint`); the workers
carry it out. Where no elastic driver forms rounds (a fixed world: `RayExecutor(num_workers=)`,
`raytrain-x run -np`, a launcher of one's own) the job's start is the only place a restore
can happen, and rank 0 names the checkpoint for every rank at the process's first sync. The
one thing the workers find out themselves is whether their copies of a sharded state cover
every shard (`ElasticStateLost`): every rank finds the same from the same allgather, and
then they restore the latest checkpoint.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from raytrain_x.common.checkpoint_config import CheckpointConfig
from raytrain_x.common.errors import ElasticStateLost
from raytrain_x.common.process import PROCESS
from raytrain_x.core import runtime
from raytrain_x.core.objects import allgather_object
from raytrain_x.elastic.checkpoints import Manifest
from raytrain_x.elastic.checksums import CheckpointDamaged, PartFiles
from raytrain_x.elastic.durable import (
    COMMON,
    DurableCheckpoints,
    checkpoint_to_restore,
    part_kind,
    part_name,
    plain_values,
    restored,
    shard_part,
    write_now,
)

log = logging.getLogger("raytrain_x.elastic")

BroadcastObject = Callable[..., Any]  # (obj, root_rank, name=...) -> root's obj


class Committed(Protocol):
    """A committed host copy of a state's tree (a torch `Snapshot`, a deep copy)."""

    def tree(self) -> Any:
        """The host tree, once every copy has landed (read it, do not modify it)."""

    def copy(self) -> Any:
        """A fresh copy of the tree, for a restore to load (it may keep what it gets)."""


class Format(Protocol):
    """What a framework's state gives its commit manager.

    Attributes:
        layout: the manifest's name for how the parts are laid out ("unsharded",
            "sharded", "tensorflow", "objects").
        info: more of the manifest's `info` (the part's encoding).
    """

    layout: str
    info: dict[str, Any]

    def take(self) -> Committed:
        """A host copy of the live state's tree (models, optimizers, attributes)."""

    def load(self, tree: Any) -> None:
        """Loads a tree of `take`'s shape (a fresh copy) into the live state."""

    def sync_from(self, root: int) -> None:
        """Makes every rank's live state rank `root`'s (a collective)."""

    def values(self) -> dict[str, Any]:
        """The live plain attributes (a manifest shows the plain numbers among them)."""

    def signature(self) -> dict[str, Any]:
        """What the state is (names, shapes, dtypes): a restore refuses another."""

    def save(self, tree: Any, folder: str) -> dict[str, list[Any]] | None:
        """Writes a part's tree to a local folder; may return each file's [bytes,
        xxh3-128 checksum], hashed as it was written (not read again)."""

    def read(self, part: PartFiles) -> Any:
        """Reads back what `save` wrote, from a checkpoint's part in storage (checked as
        it is read: `CheckpointDamaged` where it is not what was written)."""


class Shards(Protocol):
    """A sharded optimizer's commits: each rank holds its own shard and replicas of its
    peers' (`raytrain_x.torch.zero_elastic.ShardedCommits`)."""

    def commit(self, copies: Committed) -> None:
        """Commits this rank's shard to its replica holders with the rest of the state's
        `copies` (a collective)."""

    def keep(self, copies: Committed) -> None:
        """The rest of the state as this rank holds it now (the initial state)."""

    def settle(self) -> None:
        """Takes up the commit whose copies are under way, once they landed everywhere (a
        collective; nothing where `commit` returns with them landed)."""

    def committed(self) -> Committed:
        """The rest of the state as committed with the generation this rank took up."""

    def restore(self) -> int:
        """At a new round: the newest whole generation re-sharded over the new world from
        the survivors' copies; returns the rank holding the rest of its state.

        Raises:
            ElasticStateLost: every copy of some shard was lost (on every rank alike).
        """

    def own_part(self) -> Any:
        """This rank's own shard, as its checkpoint part's tree."""

    def restore_from(self, parts: Iterable[PartFiles]) -> None:
        """From storage: re-shards for this world and reads only this rank's shards from
        the checkpoint's shard parts (each checked as it is read)."""


class _Copy:
    """A committed deep copy (`Committed`) of plain values."""

    def __init__(self, tree: Any, copier: Callable[[Any], Any]) -> None:
        self._tree, self._copier = tree, copier

    def tree(self) -> Any:
        return self._tree

    def copy(self) -> Any:
        return self._copier(self._tree)


def copied(tree: Any, copier: Callable[[Any], Any]) -> Committed:
    """`tree` (already a copy of its own) as a commit; `copier` copies it for a restore."""
    return _Copy(tree, copier)


class CommitManager:
    """One elastic state's commits, in memory and in storage (see the module).

    Args:
        fmt: the state's format.
        bcast_object: how rank 0's objects reach every rank (the face's).
        config: durable checkpoints (None: in memory only).
        shards: a sharded optimizer's commits, where the state has one.
    """

    def __init__(self, fmt: Format, bcast_object: BroadcastObject,
                 config: CheckpointConfig | None = None, shards: Shards | None = None) -> None:
        self.format = fmt
        self.shards = shards
        self._bcast = bcast_object
        self.number = 0  # the job's commits, counted over its whole life (synced)
        self.durable = DurableCheckpoints(config, fmt.save, fmt.read) if config else None
        self.restored_from: Manifest | None = None
        self._committed: Committed | None = None

    # ------------------------------------------------------------------ in memory
    @property
    def generation(self) -> int:
        """The generation of the run writing this job's checkpoints (0: none yet)."""
        return self.durable.generation if self.durable is not None else 0

    def committed(self) -> Committed:
        """The last commit (a sharded optimizer's shards are `Shards`')."""
        if self.shards is not None:
            return self.shards.committed()
        assert self._committed is not None, "take() the initial state first"
        return self._committed

    def take(self) -> None:
        """Takes the live state as committed without counting a commit (the initial
        state, before the first sync)."""
        self._hold(self.format.take(), exchange=False)

    def commit(self) -> None:
        """Copies the live state to host memory (with a sharded optimizer, its replicas
        exchanged: a collective) and counts a commit."""
        self.number += 1
        self._hold(self.format.take(), exchange=True)

    def settle(self) -> None:
        """Before the ranks leave for a new round they agreed on: the commit whose copies
        went out in the background is taken up (a collective)."""
        if self.shards is not None:
            self.shards.settle()

    def _hold(self, copies: Committed, exchange: bool) -> None:
        if self.shards is None:
            self._committed = copies
        elif exchange:
            self.shards.commit(copies)
        else:
            self.shards.keep(copies)

    def rollback(self) -> None:
        """Loads the last commit into the live state (a sharded optimizer's shards come
        back at the next round's sync)."""
        self.format.load(self.committed().copy())

    @staticmethod
    def note_synced() -> None:
        """This process holds the state of the current round (the driver reads it)."""
        if runtime.is_initialized():
            PROCESS.state_round = max(1, runtime.rendezvous().round)

    @staticmethod
    def note_rollback() -> None:
        PROCESS.restores += 1

    def sync(self) -> None:
        """At a new round: carries out the driver's decision (restore the checkpoint it
        named from storage, or keep what the survivors hold), makes every rank's state
        the holder's, and commits. A collective."""
        root = 0
        self._settle_writes()
        if not self._restore_from_storage():
            if self.shards is not None:
                try:
                    root = self.shards.restore()
                    if runtime.rank() == root:
                        self.rollback()
                except ElasticStateLost as exc:  # every rank finds the same: storage, or lost
                    if self.durable is not None and runtime.rank() == 0:
                        log.warning("raytrain-x elastic: %s; restoring the latest durable "
                                    "checkpoint", exc)
                    if not self._restore_from_storage(lost=True):
                        raise
        self.number = self._bcast(self.number, root, name="elastic.commits.number")
        self.format.sync_from(root)
        self.commit()

    # ------------------------------------------------------------------ durable
    def due(self) -> bool | None:
        """Whether the commit being taken is due to be written (asked on rank 0); None
        when there are no durable checkpoints."""
        return None if self.durable is None else self.durable.due()

    def ask(self) -> None:
        """The driver asks for a checkpoint of this commit (every holder is draining)."""
        if self.durable is not None:
            self.durable.ask()

    def failed_write(self) -> int:
        """The id of this rank's last write whose part failed (0: none)."""
        return 0 if self.durable is None else self.durable.failed_write

    def failed_elsewhere(self, write_id: int) -> None:
        """Rank 0: a rank said its part of write `write_id` failed."""
        if self.durable is not None:
            self.durable.failed_elsewhere(write_id)

    def ended(self) -> None:
        """Training returned: rank 0 releases the job's writer lease."""
        if self.durable is not None:
            self.durable.end_lease()

    def finish_writes(self) -> None:
        """Waits for this rank's write under way, up to the checkpoint's timeout."""
        if self.durable is not None:
            self.durable.wait(self.durable.config.write_timeout_s)

    def write(self, write_id: int, background: bool = True) -> Manifest | None:
        """Starts writing this rank's parts of the last commit: rank 0 the common part,
        with a sharded optimizer each rank its own shard (`write_id`: rank 0's, naming
        this attempt's parts). In the background rank 0 then completes the checkpoint;
        else rank 0 gets the manifest back, to complete. The commit is held by the writer,
        so later commits do not reuse its buffers while it is written."""
        if self.durable is None:
            return None
        rank, size = runtime.rank(), runtime.size()
        committed = self.committed()
        parts: dict[str, Callable[[], Any]] = {}
        every = [part_name(COMMON, write_id)]
        if rank == 0:
            parts[every[0]] = committed.tree
        if self.shards is not None:
            own = self.shards.own_part()
            parts[part_name(shard_part(rank), write_id)] = lambda: own
            every += [part_name(shard_part(r), write_id) for r in range(size)]
        info = {"layout": self.format.layout, **self.format.info}
        manifest = Manifest(self.number, {}, size, plain_values(self.format.values()), 0.0,
                            info, self.durable.generation, self.format.signature())
        if parts:
            self.durable.write(parts, manifest, every if background and rank == 0 else None,
                               write_id)
        return manifest if rank == 0 else None

    def checkpoint(self, timeout_s: float | None) -> None:
        """`state.checkpoint()`: the last commit written in the foreground; returns once it
        is complete, raises `CheckpointError` on every rank when it cannot be."""
        assert self.durable is not None
        write_id = self._bcast(time.time_ns(), 0, name="elastic.durable.id")
        write_now(self.durable, self.number,
                  lambda background: self.write(write_id, background), self._bcast, timeout_s)

    def _settle_writes(self) -> None:
        """At a new round: every rank says which parts its write under way (of the world
        before) is still writing; rank 0 gives up at once a write of its that waits for a
        part no rank of this world writes (its rank was lost mid-write). A collective."""
        if self.durable is None:
            return
        writing = allgather_object(self.durable.writing(), name="elastic.durable.writing")
        if runtime.rank() == 0:
            self.durable.world_changed({part for parts in writing for part in parts})

    def _restore_from_storage(self, lost: bool = False) -> bool:
        """Loads the checkpoint the driver named (with `lost`, the latest: a sharded
        state's shards were lost with every copy): rank 0 the common part, every rank only
        its own optimizer shards in this world's layout, each checking the bytes it reads.
        Where a rank finds the checkpoint damaged, every rank takes the one before. False
        when there is nothing to restore."""
        if self.durable is None:
            return False
        while True:
            manifest = checkpoint_to_restore(self.durable, self._bcast,
                                             self.format.signature(), latest=lost)
            if manifest is None:
                return False
            began = time.perf_counter()
            try:
                self._load_checkpoint(manifest)
                damaged = None
            except CheckpointDamaged as exc:
                damaged = str(exc)
            found = [why for why in allgather_object(damaged, name="elastic.durable.read")
                     if why]
            if not found:
                break
            if runtime.rank() == 0:  # marked: the next pick passes it over
                self.durable.set_aside(manifest, found[0])
        self.number = manifest.number
        self.restored_from = manifest
        restored(self.durable, manifest, began)
        return True

    def _load_checkpoint(self, manifest: Manifest) -> None:
        """This rank's share of `manifest`'s checkpoint loaded into the live state."""
        assert self.durable is not None
        if runtime.rank() == 0:
            common = next(p for p in manifest.parts if part_kind(p) == COMMON)
            self.format.load(self.durable.load(manifest, common))
        if self.shards is not None:
            self.shards.restore_from(self.durable.part(manifest, p)
                                     for p in sorted(manifest.parts) if part_kind(p) != COMMON)
