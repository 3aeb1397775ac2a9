"""The simulated job's durable storage: the real `CheckpointStore`, writer lease, retries and
fault injection (`raytrain_x.elastic`) over files held in memory, on the virtual clock.

What a worker's writer does in production (`raytrain_x.elastic.durable`) is done here in
the same order through the same store: each part's files are written, read back and
recorded with their checksums, the lease is checked, the manifest published, the lease
checked again and older checkpoints pruned. Faults come from the schedule: transient
listing errors (503 SlowDown, retried), reads cut off midway (resumed from the byte
reached), a full disk while storage is down, writes that land damaged (torn, a byte
flipped at the same size, a zero-filled `.metadata`), a rank lost while it writes its part
(the write given up at once, never completed without it), a killed driver's writer that
goes on after the next run took the lease (which fencing must refuse), its lease's renewal
landing after the takeover (which must not undo it), and bit rot in completed checkpoints,
which a restore finds as it reads them (taking the newest intact one; with every one
damaged, stopping with each named, never starting from 0).

The ground truth the invariants read is the world's: which checkpoints were completed
intact, by which run, and which the store gives back.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from raytrain_x.common.checkpoint_config import CheckpointConfig
from raytrain_x.common.errors import CheckpointError, CheckpointLeaseHeld, StorageError
from raytrain_x.elastic.checkpoints import (
    CheckpointStore,
    Key,
    Manifest,
    checkpoint_folder,
    parse_folder,
)
from raytrain_x.elastic.checksums import CheckpointDamaged, bytes_checksum
from raytrain_x.elastic.lease import WriterLease
from raytrain_x.elastic.storage import RetryingStorage
from raytrain_x.elastic.storage_faults import FaultyStorage, MemoryPlan
from raytrain_x.elastic.storage_schemes import MemoryStorage

DAMAGES = ("torn", "flip", "zero_metadata")


class SimStorage:
    """The job's checkpoints in memory through the real store, and what happened to them."""

    def __init__(self, keep: int = 2) -> None:
        self.memory = MemoryStorage()
        self.plan = MemoryPlan()
        faulty = FaultyStorage(self.memory, self.plan, sleep=lambda _: None)
        self.store = CheckpointStore(CheckpointConfig("memory://", name="job", keep=keep),
                                     storage=RetryingStorage(faulty, sleep=lambda _: None),
                                     sleep=lambda _: None)
        self.keep = keep
        self.runs = 0
        self.lease: WriterLease | None = None
        # ground truth: every checkpoint completed intact (key -> step), and every key a
        # writer of each generation completed
        self.intact: dict[Key, int] = {}
        self.rotten: dict[Key, int] = {}  # completed intact, damaged since (bit rot)
        self.violations: list[str] = []

    def new_run(self, clock: Callable[[], float]) -> WriterLease:
        """A driver starts the job (again): its rank 0 takes the lease at the first sync.
        The run before is dead, so its lease is taken over (the wait for an expired lease
        is the lease's unit test's)."""
        self.runs += 1
        self.lease = WriterLease(self.store, f"run-{self.runs}", clock=clock)
        self.lease.acquire(takeover=True)
        return self.lease

    def stale_renewal(self, old: WriterLease) -> None:
        """A renewal of a run that was taken over, whose check passed before the takeover,
        lands after it (a slow lease write): the run holding the lease must still hold
        it."""
        old.write_renewal()
        current = self.lease
        try:
            if current is not None:
                current.check()
        except CheckpointLeaseHeld:
            self.violations.append(f"a late renewal of generation {old.generation} undid "
                                   f"generation {current.generation}'s takeover")

    def write(self, lease: WriterLease, number: int, step: int, damage: str | None,
              full_disk: bool, rank_lost: bool = False) -> str:
        """Writes checkpoint `number` (step `step`) as rank 0's writer does; returns what
        came of it: "complete", "damaged", "failed: ...", "lost: ..." or "fenced". With
        `rank_lost`,
        another rank writes a part too and is lost before it records it: the world
        changes while rank 0 waits for it."""
        key = (lease.generation, number)
        part = f"common.{number}.{len(self.memory.files)}"
        data = json.dumps({"step": step}).encode() + b" " * 64
        files = {"data": data, ".metadata": b"m" * 32}
        self.plan.faults["full_disk"] = full_disk
        try:
            folder = f"{self.store.root}/{checkpoint_folder(*key)}/{part}"
            for name, body in files.items():
                self.store.storage.publish(f"{folder}/{name}", body)
            record = {n: [len(b), bytes_checksum(b)] for n, b in files.items()}
            if damage:
                self._damage(folder, damage)
            why = self.store.read_back(key, part, record)  # as `upload` does, then records
            if why:
                self.store.discard(key)
                return f"damaged: {why}"
            self.store.record(key, part, record)
            if rank_lost:
                return self._wait_for_a_lost_part(key, part)
            newer = {k for k in self.store_keys() if k[0] > lease.generation}
            manifest = Manifest(number, {part: record}, 1, {"step": step}, 0.0, {},
                                lease.generation)
            self.store.finish(manifest, self.keep, lease.check)
            if newer - set(self.store_keys()):
                self.violations.append(f"generation {lease.generation}'s prune deleted "
                                       f"the later generation's {sorted(newer)}")
        except CheckpointLeaseHeld:
            return "fenced"
        except CheckpointError as exc:
            return f"damaged: {exc}"
        except StorageError as exc:
            return f"failed: {exc}"
        finally:
            self.plan.faults["full_disk"] = False
        if damage:
            self.violations.append(f"checkpoint {key} landed {damage}, and was taken as "
                                   "complete")
        self.intact[key] = step
        return "complete"

    def _wait_for_a_lost_part(self, key: Key, part: str) -> str:
        """Rank 0's wait for the parts (the real `wait_for_parts`) while the rank writing
        the other one is lost: the world changes at the third look, and the wait must
        give up at that look (not at its timeout), the attempt discarded."""
        looks: list[int] = []

        def still_written() -> frozenset[str] | None:
            looks.append(len(looks))
            return None if len(looks) < 3 else frozenset()

        shard = f"shard_00001.{key[1]}.{len(self.memory.files)}"
        try:
            self.store.wait_for_parts(key, [part, shard], 600.0, still_written)
        except CheckpointError as exc:
            if len(looks) != 3:
                self.violations.append(f"checkpoint {key} waited {len(looks) - 3} more "
                                       "looks for a part whose rank was lost")
            self.store.discard(key)
            return f"lost: {exc}"
        self.violations.append(f"checkpoint {key} completed without its lost rank's part")
        return "complete"

    def _damage(self, folder: str, damage: str) -> None:
        path = f"{folder}/.metadata" if damage == "zero_metadata" else f"{folder}/data"
        data = bytearray(self.memory.files[path])
        if damage == "torn":
            data = data[:len(data) // 2]
        elif damage == "flip":
            data[len(data) // 2] ^= 0x40
        else:
            data = bytearray(len(data))
        self.memory.files[path] = bytes(data)

    def store_keys(self) -> list[Key]:
        return [k for k in (parse_folder(e.name) for e in self.memory.list(self.store.root)
                            if e.is_dir) if k is not None]

    def latest(self) -> Manifest | None:
        """What a restore takes, as the ranks take it (`CommitManager`): the newest
        complete checkpoint by its sizes, every part read and checked as it is read
        (`PartFiles`); one found damaged is set aside and the one before it taken."""
        while True:
            manifest = self.store.latest(warn=False, verify=False)
            if manifest is None:
                return None
            try:
                for part in manifest.parts:
                    files = self.store.part(manifest, part)
                    for name in files.names():
                        files.read(name)
                return manifest
            except CheckpointDamaged as exc:
                self.store.mark_damaged(manifest.key, str(exc))

    def _flip(self, key: Key, at: float) -> None:
        """A byte flipped in every part's data of checkpoint `key`, at its size (`at`: where,
        as a share of the file; two flips of one byte would mend it)."""
        folder = f"{self.store.root}/{checkpoint_folder(*key)}"
        for entry in self.memory.list(folder):
            path = f"{folder}/{entry.name}/data"
            if entry.is_dir and path in self.memory.files:
                data = bytearray(self.memory.files[path])
                data[int(len(data) * at)] ^= 0x08
                self.memory.files[path] = bytes(data)

    def rot(self, pick: Callable[[list[Key]], list[Key]]) -> int:
        """Bit rot: the checkpoints `pick` chooses among the intact ones still kept are
        damaged, long after they were written and checked; they are intact no more.
        Returns how many."""
        kept = set(self.store_keys())
        chosen = pick(sorted(k for k in self.intact if k in kept))
        for key in chosen:
            self._flip(key, 1 / 3)
            self.rotten[key] = self.intact.pop(key)
        return len(chosen)

    def every_checkpoint_damaged_stops(self) -> None:
        """Were every completed checkpoint damaged now, a restore would stop naming them
        (never "nothing to restore": a silent start from 0): tried on storage as it is,
        which is then put back as it was."""
        saved = dict(self.memory.files)
        completed = [k for k in self.store_keys()
                     if f"{self.store.root}/{checkpoint_folder(*k)}/manifest.json" in saved]
        if not completed:
            return
        try:
            for key in completed:
                self._flip(key, 0.0)
            try:
                taken = self.latest()
            except CheckpointError as exc:
                if "no checkpoint of this job can be restored" not in str(exc):
                    self.violations.append(f"every checkpoint damaged, a restore failed "
                                           f"otherwise than naming them: {exc}")
                return
            self.violations.append(f"every checkpoint damaged, a restore took "
                                   f"{None if taken is None else taken.key} instead of "
                                   "stopping")
        finally:
            self.memory.files = saved

    def expected_latest(self) -> tuple[Key, int] | None:
        """The newest checkpoint completed intact that pruning may not have deleted: the
        one a restore must take."""
        kept = set(self.store_keys())
        alive = {k: s for k, s in self.intact.items() if k in kept}
        if not alive:
            return None
        key = max(alive)
        return key, alive[key]

    def check_kept(self) -> None:
        """Pruning never deleted the newest intact checkpoint."""
        if self.intact:
            newest = max(self.intact)
            if newest not in set(self.store_keys()):
                self.violations.append(f"the newest intact checkpoint {newest} was pruned")

    def cut_reads(self, count: int) -> None:
        """The next `count` reads of a file's chunks are cut off after their first chunk
        (a connection reset midway), fewer than the retries."""
        self.plan.faults["midway"] = self.plan.faults.get("midway", 0) + count

    def flaky_listings(self, count: int) -> None:
        """The next `count` listings fail (S3's 503 SlowDown), fewer than the retries."""
        self.plan.faults["list"] = self.plan.faults.get("list", 0) + count
