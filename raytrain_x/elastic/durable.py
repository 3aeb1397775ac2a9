"""Durable checkpoints from one rank's side, for any framework: when a commit is written,
the background writer of this rank's parts, the writer lease, and which checkpoint a round
restores. The commit manager (`raytrain_x.elastic.commits`) drives it; a framework gives
its format (`save`/`read` of a tree to a folder).

Each part of a checkpoint (`raytrain_x.elastic.checkpoints`) is written by one rank:
`common` (rank 0) and, with a sharded optimizer, `shard_<rank>`. In the background, the
checkpoint's last writer (rank 0) waits for every part in storage, then publishes the
manifest; a rank whose part failed says so in storage, and rank 0 gives the checkpoint up
at once. A failed or slow background write never stops training: a warning, a counter, the
next one later. `state.checkpoint()` instead writes in the foreground and raises when the
checkpoint cannot be completed.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from raytrain_x.comm.rendezvous import Rendezvous
from raytrain_x.common.checkpoint_config import CheckpointConfig
from raytrain_x.common.errors import CheckpointError, CheckpointLeaseHeld, StorageError
from raytrain_x.common.periodic import Every
from raytrain_x.common.process import PROCESS
from raytrain_x.common.settings import CHECKPOINT_DRIVER, CHECKPOINT_RUN
from raytrain_x.core import runtime
from raytrain_x.core.objects import allgather_object
from raytrain_x.elastic.checkpoints import CheckpointStore, Key, Manifest, probe_storage
from raytrain_x.elastic.checksums import PartFiles
from raytrain_x.elastic.lease import RENEW_S, WriterLease, new_owner

log = logging.getLogger("raytrain_x.elastic")

COMMON = "common"


def shard_part(rank: int) -> str:
    return f"shard_{rank:05d}"


def shard_rank(folder: str) -> int:
    """The rank whose `shard_<rank>` part a part's folder holds."""
    return int(part_kind(folder.rstrip("/").rsplit("/", 1)[-1]).split("_", 1)[1])


def part_name(part: str, write_id: int) -> str:
    """A part's folder in one write attempt: a commit's number can be written twice (after
    a restore from storage the job commits it again), and attempts never share files."""
    return f"{part}.{write_id}"


def part_kind(folder: str) -> str:
    """`common` or `shard_<rank>`: what a manifest's part folder holds."""
    return folder.split(".")[0]


def plain_values(values: dict[str, Any]) -> dict[str, Any]:
    """The attributes a manifest shows (step, epoch, ...): plain numbers and strings."""
    return {k: v for k, v in values.items()
            if isinstance(v, (int, float, str, bool)) and (not isinstance(v, str) or len(v) < 80)}


def _cause(exc: BaseException) -> str:
    """One line of why: for torch DCP's `CheckpointException` (its `failures`: rank ->
    (exception, trace)), the exception inside it."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        if isinstance(inner, tuple) and inner and isinstance(inner[0], BaseException):
            return f"torch.distributed.checkpoint: {_cause(inner[0])}"
    text = str(exc).strip().splitlines()
    return (text[0][:300] if text else "") or type(exc).__name__


@dataclass
class WriteResult:
    """What this rank's last write did: its parts' files, or why it failed."""

    key: Key
    files: dict[str, dict[str, list[Any]]] = field(default_factory=dict)
    error: str | None = None


class DurableCheckpoints:
    """A job's durable checkpoints, from one rank's side: when to write, the background
    writer, the writer lease, and reading parts back (in the framework's format: `save`,
    `load`)."""

    def __init__(self, config: CheckpointConfig, save: Callable[[Any, str], Any],
                 load: Callable[[str], Any],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._save, self._load = save, load  # a framework's format: a tree to a folder
        self.store = CheckpointStore(config)
        self._clock = clock
        self._thread: threading.Thread | None = None
        self._last_start = clock()  # the first checkpoint comes every_s after the start
        self.generation = 0  # this run's, from its writer lease (synced)
        self.owner = CHECKPOINT_RUN.read() or ""  # this run's token (synced)
        self._asked = False  # the driver asked for one (a drain of every holder)
        self.last: WriteResult | None = None
        self._lease: WriterLease | None = None  # rank 0 holds it
        self._renewal: Every | None = None
        self.fenced: CheckpointLeaseHeld | None = None
        self._probed = False
        self._writing: list[str] = []  # this rank's parts of the write under way
        # rank 0's wait for every part: the parts the new world's ranks still write (set
        # at a sync after the world changed); a part neither recorded nor among them will
        # never come
        self._still_written: frozenset[str] | None = None
        self._write_id = 0  # of this rank's write under way
        self.failed_write = 0  # the id of this rank's last write whose part failed
        self._failed_elsewhere = 0  # rank 0: a rank said its part of this write failed

    # ------------------------------------------------------------------ the lease
    def hold_lease(self) -> None:
        """On rank 0 at a sync: takes or keeps this run's writer lease (the first time,
        the start's probe of storage: a write and a read back) and renews it from now on.

        Raises:
            CheckpointLeaseHeld: another run holds the job's lease.
            StorageError: storage cannot be written or read.
        """
        if self.fenced is not None:
            raise self.fenced
        self.owner = self.owner or new_owner()
        if self._lease is None or self._lease.owner != self.owner:
            self._lease = WriterLease(self.store, self.owner, driver=CHECKPOINT_DRIVER.read())
        self.generation = self._lease.acquire(self.config.takeover)
        if not self._probed:
            probe_storage(self.store.storage, self.store.root)
            self._probed = True
        if self._renewal is None:
            self._renewal = Every(RENEW_S, self._renew, "raytrain-x-lease").start()

    def release_lease(self) -> None:
        """This process no longer renews the lease (it is not rank 0 any more)."""
        if self._renewal is not None:
            self._renewal.stop()
            self._renewal = None

    def end_lease(self) -> None:
        """Rank 0, its training returned: renewals stop and the lease is marked released,
        so that the next run takes it at once (on any machine); this run's own checks
        (a write still under way, `state.checkpoint()` after training) still pass until
        another run takes it. Best effort: a lease left unreleased expires."""
        if self._renewal is None or self._lease is None:
            return
        self.release_lease()
        try:
            self._lease.release()
        except Exception as exc:  # noqa: BLE001 - it expires instead
            log.info("raytrain-x checkpoint: could not release the writer lease: %s", exc)

    def _renew(self) -> None:
        try:
            assert self._lease is not None
            self._lease.renew()
        except CheckpointLeaseHeld as exc:
            self.fenced = exc
            log.error("raytrain-x checkpoint: %s", exc)
            if self._renewal is not None:
                self._renewal.stop()  # from its own thread: it ends after this call
        except Exception as exc:  # noqa: BLE001 - storage may come back before the lease ends
            log.warning("raytrain-x checkpoint: renewing the writer lease failed: %s", exc)

    def check_lease(self) -> None:
        """Before a manifest or a prune: this run still holds the lease (rank 0)."""
        if self.fenced is not None:
            raise self.fenced
        if self._lease is not None:
            self._lease.check()

    # ------------------------------------------------------------------ when
    def busy(self) -> bool:
        """A write of this rank is still under way."""
        return self._thread is not None and self._thread.is_alive()

    def due(self) -> bool:
        """Whether the commit being taken should be written (rank 0 decides for all)."""
        return not self.busy() and (
            self._asked or self._clock() - self._last_start >= self.config.every_s)

    def ask(self) -> None:
        """Makes the next commit due, or the first one after the write under way."""
        self._asked = True

    # ------------------------------------------------------------------ writing
    def write(self, parts: dict[str, Callable[[], Any]], manifest: Manifest,
              every_part: list[str] | None, write_id: int = 0) -> None:
        """Writes this rank's `parts` (each a function returning the tree to save) of
        `manifest`'s checkpoint on a background thread. With `every_part` (rank 0 in the
        background), the thread then waits for every part and completes the checkpoint.
        A write of this rank still under way is waited for first: every rank writes its
        part of every checkpoint rank 0 asked for."""
        if self.busy():
            log.info("raytrain-x checkpoint: waiting for this rank's write before "
                     "checkpoint %d", manifest.number)
            self.wait()
        self._last_start, self._asked = self._clock(), False
        self._writing, self._still_written = list(parts), None
        self._write_id, self._failed_elsewhere = write_id, 0
        self.last = WriteResult(manifest.key)
        self.store.checksum_s = self.store.verify_s = 0.0
        self._thread = threading.Thread(target=self._write,
                                        args=(manifest, parts, every_part, self.last),
                                        name="raytrain-x-checkpoint", daemon=True)
        self._thread.start()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Waits for this rank's write under way, if any; False when it is still under
        way after `timeout_s`."""
        if self._thread is not None:
            self._thread.join(timeout_s)
        return not self.busy()

    def _write(self, manifest: Manifest, parts: dict[str, Callable[[], Any]],
               every_part: list[str] | None, result: WriteResult) -> None:
        began = time.perf_counter()
        key = manifest.key
        part, publishing = "", False
        try:
            with tempfile.TemporaryDirectory(prefix="raytrain-x-checkpoint-") as tmp:
                for part, tree in parts.items():
                    # a folder on this machine is written in place; object stores from a
                    # local copy
                    local = self.store.local_folder(key, part) or os.path.join(tmp, part)
                    hashed = self._save(tree(), local)  # a format may hash as it writes
                    result.files[part] = self.store.upload(
                        key, part, local, hashed if isinstance(hashed, dict) else None)
            part = ""
            if every_part is not None:
                manifest.parts = self.store.wait_for_parts(key, every_part,
                                                           self.config.write_timeout_s,
                                                           lambda: self._still_written,
                                                           self._failed_there)
                publishing = True
                self.complete(manifest, began)
        # BaseException: torch DCP's CheckpointException derives from it
        except BaseException as exc:  # noqa: BLE001 - training goes on; the next may succeed
            result.error = _cause(exc)
            if part:
                self.failed_write = self._write_id  # said to rank 0 at the next commit
                self.store.part_failed(key, part, result.error)
                self.store.discard(key, part)  # its files would fill a full disk again
            if every_part is not None and not publishing:
                self.store.discard(key)  # given up: no manifest will make it a checkpoint
            PROCESS.checkpoints.failed(manifest.number)
            log.warning("raytrain-x checkpoint: writing checkpoint %d to %s failed (%s); "
                        "training goes on, the next checkpoint is tried in %gs",
                        manifest.number, self.store.where(key), result.error,
                        self.config.every_s)

    def writing(self) -> list[str]:
        """The parts this rank's write under way is writing ([] when none is)."""
        return list(self._writing) if self.busy() else []

    def failed_elsewhere(self, write_id: int) -> None:
        """Rank 0: a rank said (at a commit) that its part of write `write_id` failed; the
        write under way gives up at once if it is that one."""
        if write_id and write_id == self._write_id:
            self._failed_elsewhere = write_id

    def _failed_there(self) -> bool:
        return bool(self._failed_elsewhere)

    def world_changed(self, still_written: set[str]) -> None:
        """Rank 0 at a sync after the world changed: `still_written` are the parts the
        new world's ranks are still writing. A write under way that waits for a part that
        is neither recorded nor among them (its rank was lost mid-write) is given up at
        once, so the next checkpoint starts from the new world."""
        self._still_written = frozenset(still_written)

    def complete(self, manifest: Manifest, began: float) -> None:
        """Rank 0, once every part is durable and read back by its writer: the lease
        checked, the manifest published, older checkpoints pruned
        (`CheckpointStore.finish`)."""
        manifest.written_at = time.time()
        self.store.finish(manifest, self.config.keep, self.check_lease)
        seconds = time.perf_counter() - began
        PROCESS.checkpoints.written(manifest.number, seconds, self.store.checksum_s,
                                   self.store.verify_s)
        log.info("raytrain-x checkpoint: %s written to %s in %.1fs", manifest.describe(),
                 self.store.where(manifest.key), seconds)

    # ------------------------------------------------------------------ reading
    def latest(self) -> Manifest | None:
        """The newest complete checkpoint (every file at its size); incomplete ones after
        it, and ones found damaged before, are skipped with a warning naming the file. Its
        bytes are checked as the ranks read them (`load`, `part`): a rank that finds one
        damaged makes the restore take the one before (`CommitManager`)."""
        return self.store.latest(warn=True, verify=False)

    def named(self, key: Key) -> Manifest | None:
        """The checkpoint a round restores whose driver named `key`: the newest complete
        one (`latest`). That is the named one, or one this job's writer completed after the
        driver decided (a holder's background write that ended as the holders were lost:
        restoring the named one would lose its steps), or, where the named one was found
        damaged, the newest before it (each skipped one logged, naming the file)."""
        manifest = self.store.latest(warn=True, verify=False)
        if manifest is not None and manifest.key > tuple(key):
            log.info("raytrain-x checkpoint: %s was completed after the driver named "
                     "checkpoint %s: restoring it", manifest.describe(), key)
        return manifest

    def load(self, manifest: Manifest, part: str) -> Any:
        """A part of `manifest`'s checkpoint, as the tree that was saved (host tensors),
        its bytes checked as they are read.

        Raises:
            CheckpointDamaged: a file of it is not what the manifest records.
        """
        return self._load(self.store.part(manifest, part))

    def part(self, manifest: Manifest, part: str) -> PartFiles:
        """A part of `manifest`'s checkpoint to read, checked as it is read."""
        return self.store.part(manifest, part)

    def set_aside(self, manifest: Manifest, why: str) -> None:
        """Rank 0: a rank found `manifest`'s checkpoint damaged as it read it (`why`):
        marked, so that the restore, and every later reader, takes the one before."""
        log.warning("raytrain-x checkpoint: %s is damaged (%s); restoring the one before",
                    self.store.where(manifest.key), why)
        self.store.mark_damaged(manifest.key, why)


def write_now(durable: DurableCheckpoints, number: int,
              write: Callable[[bool], Manifest | None],
              bcast_object: Callable[..., Any], timeout_s: float | None) -> None:
    """`state.checkpoint()`: every rank writes its parts of the last commit in the
    foreground (`write(background=False)` starts them and returns the manifest on rank 0),
    the ranks' results are gathered, rank 0 completes the checkpoint, and every rank
    returns only once it is complete. A collective.

    Raises:
        CheckpointError: a part could not be written or the checkpoint not completed
            (naming the path and the cause), on every rank alike.
    """
    began = time.perf_counter()
    if not durable.wait(timeout_s):
        raise CheckpointError(f"this rank's previous checkpoint write to "
                              f"{durable.store.where()} is still under way after "
                              f"{timeout_s:g}s")
    manifest = write(False)
    done = durable.wait(timeout_s)
    last = durable.last
    mine = ("still under way" if not done else last.error if last else None,
            last.files if last and done else {})
    results = allgather_object(mine, name="elastic.durable.parts")
    verdict = None
    failed = [(r, why) for r, (why, _) in enumerate(results) if why]
    if failed:
        verdict = "; ".join(f"rank {r}: {why}" for r, why in failed[:4])
        if runtime.rank() == 0 and manifest is not None:
            durable.store.discard(manifest.key)  # given up before any manifest
    elif runtime.rank() == 0 and manifest is not None:
        manifest.parts = {p: f for _, files in results for p, f in files.items()}
        try:
            durable.complete(manifest, began)
        except BaseException as exc:  # noqa: BLE001 - every rank raises it below
            PROCESS.checkpoints.failed(manifest.number)
            verdict = f"rank 0: {_cause(exc)}"
    verdict = bcast_object(verdict, 0, name="elastic.durable.written")
    if verdict:
        raise CheckpointError(f"the checkpoint of commit {number} to "
                              f"{durable.store.where()} failed: {verdict}")


def checkpoint_to_restore(durable: DurableCheckpoints, bcast_object: Callable[..., Any],
                          signature: dict[str, Any], latest: bool = False) -> Manifest | None:
    """At a sync: rank 0 takes or keeps the run's writer lease (probing storage the first
    time), then names the checkpoint every rank restores, as the driver decided
    (`restore_decision`); with `latest`, the latest (a sharded state's shards were lost
    with every copy). None: the round keeps what the survivors hold. A collective.

    Raises:
        CheckpointError: storage holds another state than this one (`signature`), or the
            run cannot hold the lease (`CheckpointLeaseHeld`); StorageError: storage
            cannot be read or written. On every rank alike.
    """
    answer: Any = None
    if runtime.rank() == 0:
        try:
            wanted = "latest" if latest else restore_decision(runtime.rendezvous(),
                                                                PROCESS.state_round)
            try:
                durable.hold_lease()
            except StorageError as exc:
                if wanted is not None or durable.generation == 0:
                    raise
                # a round that restores nothing trains on while storage is away: its
                # writes check the lease, and fail, until storage is back
                log.warning("raytrain-x checkpoint: cannot renew the writer lease at this "
                            "round (%s); training goes on", exc)
            manifest = None if wanted is None else durable.latest() if wanted == "latest" \
                else durable.named(wanted)
            if manifest is not None:
                check_signature(durable, manifest, signature)
            answer = ("ok", durable.owner, durable.generation, manifest)
        except (CheckpointError, StorageError) as exc:
            answer = ("error", type(exc).__name__, str(exc))
    else:
        durable.release_lease()
    answer = bcast_object(answer, 0, name="elastic.durable.latest")
    if answer[0] == "error":
        kind = {"StorageError": StorageError, "CheckpointLeaseHeld": CheckpointLeaseHeld
                }.get(answer[1], CheckpointError)
        raise kind(answer[2])
    _, durable.owner, durable.generation, manifest = answer
    return manifest


def restore_decision(rdv: Rendezvous, state_round: int) -> Key | str | None:
    """What a round restores from storage, as rank 0 reads it from the round's rendezvous
    (`state_round`: the round of the state rank 0 holds, 0 for none): the checkpoint the
    elastic driver named (its key); "latest" where the driver asked for a restore without
    naming one, or, in a fixed world (no driver forms its rounds), at the job's start (rank
    0 holds no state yet); None where the survivors hold the state."""
    if rdv.restore_from_storage and rdv.restore_checkpoint is not None:
        generation, number = rdv.restore_checkpoint
        return (int(generation), int(number))
    if rdv.restore_from_storage or (not rdv.elastic and state_round == 0):
        return "latest"
    return None


def check_signature(durable: DurableCheckpoints, manifest: Manifest,
                    signature: dict[str, Any]) -> None:
    """Refuses a checkpoint of another state than this one (other tensor names, shapes or
    dtypes, other optimizers). Plain attributes are not refused: one this state has and
    the checkpoint lacks keeps the value given; one only the checkpoint has is dropped
    (`Attributes.load` loads only this state's own), each said in the log.

    Raises:
        CheckpointError: naming both and how to start afresh.
    """
    theirs, mine = dict(manifest.signature or {}), dict(signature or {})
    saved, here = set(theirs.pop("attributes", [])), set(mine.pop("attributes", []))
    theirs.pop("layout", None)
    layout = mine.pop("layout", None)
    written = "sharded" if any(part_kind(p) != "common" for p in manifest.parts) else "whole"
    if "fsdp" in (layout, manifest.info.get("layout")):  # a model sharded by fully_shard
        written = str(manifest.info.get("layout"))
        if layout != written:
            was = "" if written == "fsdp" else "not "
            raise CheckpointError(
                f"{durable.store.where(manifest.key)} was written by a model {was}sharded "
                f"by fully_shard, and this job's model is {'' if was else 'not '}: resume it "
                "with the model wrapped as it was written, or start afresh under another "
                "CheckpointConfig(name=...)")
    elif layout is not None and layout != written:
        raise CheckpointError(
            f"{durable.store.where(manifest.key)} was written with the optimizer state "
            f"{'sharded (ZeRO stage 1 or 2)' if written == 'sharded' else 'whole (no ZeRO)'}"
            f", and this job's DistributedOptimizer has it "
            f"{'sharded' if layout == 'sharded' else 'whole'}: resume it with the "
            f"zero_stage it was written with ({'1 or 2' if written == 'sharded' else '0'}"
            "; stages 1 and 2 restore into each other), or start afresh under another "
            "CheckpointConfig(name=...)")
    if theirs and mine and theirs != mine:
        differ = sorted(k for k in set(theirs) | set(mine) if theirs.get(k) != mine.get(k))
        shown = "; ".join(f"{k}: saved {theirs.get(k, 'absent')}, here {mine.get(k, 'absent')}"
                          for k in differ[:3])
        raise CheckpointError(
            f"{durable.store.where(manifest.key)} holds another job's state, not this one's "
            f"({len(differ)} entries differ: {shown}). Give this job its own "
            "CheckpointConfig(name=...), or delete "
            f"{durable.store.where()} to start it afresh")
    if here - saved:
        log.info("raytrain-x checkpoint: %s has no %s: %s the value given", manifest.describe(),
                 ", ".join(sorted(here - saved)),
                 "it keeps" if len(here - saved) == 1 else "they keep")
    if saved - here:
        log.warning("raytrain-x checkpoint: %s has attributes this state no longer has "
                    "(%s): dropped", manifest.describe(), ", ".join(sorted(saved - here)))


def restored(durable: DurableCheckpoints, manifest: Manifest, began: float) -> None:
    """Counts and logs a restore from `manifest` that began at `began` (perf_counter)."""
    seconds = time.perf_counter() - began
    PROCESS.checkpoints.restored(manifest.number, seconds)
    if runtime.rank() == 0:
        log.warning("raytrain-x checkpoint: no worker held the job's state in memory; "
                    "restored %s from %s in %.1fs", manifest.describe(),
                    durable.store.where(manifest.key), seconds)
