"""A job's durable checkpoints in storage: their folders, parts and the manifest that makes
one complete, the order they are taken in, and pruning (no framework, no Ray).

A job's checkpoints live under `storage_path/name/`, through a `Storage`
(`raytrain_x.elastic.storage`):

    lease/000000000003.json           the writer lease: a file per run that took the job,
                                      created only where none was; the highest writes
                                      (lease.py)
    checkpoint_000003_0000000042/     run generation 3, commit 42
      common.<id>/                    a part: files of one writer (a torch DCP checkpoint)
      shard_00001.<id>/
      common.<id>.json, ...           each part's files: size and checksum, once durable
      manifest.json                   published last, atomically: the checkpoint is complete

The contract, each clause held by a test (docs/elastic.md, "Durable checkpoints"):

- a checkpoint is complete only when its manifest lists every file with its size and an
  xxh3-128 checksum, published after the files are durable and read back intact by the
  rank that wrote them (a part that landed damaged fails the write); a reader skips one
  that is incomplete or damaged (a file missing, of another size, or of another checksum)
  with a warning naming the file, and takes the newest intact one before it;
- a listing or read error is retried, then raised (`StorageError`): never "no checkpoint";
- checkpoints are ordered by (generation, commit): a later run of the job is never pruned
  in favour of an older one, and pruning never deletes the newest complete checkpoint;
- no state is silently abandoned: where checkpoints were completed (a manifest published)
  and none of them can be taken, a reader raises `CheckpointError` listing each and why,
  never "no checkpoint"; a checkpoint found damaged is marked and set aside, and pruning
  never deletes it.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from raytrain_x.common.checkpoint_config import CheckpointConfig
from raytrain_x.common.errors import CheckpointError, StorageError
from raytrain_x.common.settings import STORAGE_FAULTS
from raytrain_x.elastic.checksums import (
    CHECKSUM,
    CheckpointDamaged,
    PartFiles,
    file_checksum,
)
from raytrain_x.elastic.storage import RetryingStorage, Storage
from raytrain_x.elastic.storage_faults import FaultyStorage
from raytrain_x.elastic.storage_schemes import open_backend

log = logging.getLogger("raytrain_x.elastic")

_PREFIX = "checkpoint_"
MANIFEST = "manifest.json"
FAILED = ".failed"  # beside a part's record: that rank's write failed, and why
DAMAGED = "damaged"  # in a checkpoint's folder: a reader found a file's checksum wrong
# why a folder is passed over where it is a write that did not finish or that its writer
# found damaged as it finished (a failed write, never a checkpoint); every other reason is
# a checkpoint's, completed and then found damaged
NO_MANIFEST = "no manifest (the write did not finish)"
LANDED_DAMAGED = "landed damaged"
DAMAGED_BEFORE = "found damaged before"


def never_completed(why: str) -> bool:
    """Whether a folder passed over for `why` is a write that failed, not a checkpoint."""
    return why == NO_MANIFEST or why.startswith(f"{DAMAGED_BEFORE}: {LANDED_DAMAGED}")

Key = tuple[int, int]  # (generation, commit number): the order of checkpoints


@dataclass
class Manifest:
    """A complete checkpoint, as its manifest describes it."""

    number: int  # the commit it holds (the job's commits, counted over its whole life)
    parts: dict[str, dict[str, list[Any]]]  # part -> {file: [bytes, checksum or None]}
    world_size: int
    values: dict[str, Any] = field(default_factory=dict)  # plain attributes (step, epoch)
    written_at: float = 0.0  # the writer's wall clock when the manifest was written
    info: dict[str, Any] = field(default_factory=dict)  # the framework's own (layout)
    generation: int = 0  # the run of the job that wrote it (its writer lease)
    signature: dict[str, Any] = field(default_factory=dict)  # what the state is

    @property
    def key(self) -> Key:
        return self.generation, self.number

    @property
    def folder(self) -> str:
        return checkpoint_folder(self.generation, self.number)

    def describe(self) -> str:
        shown = ", ".join(f"{k}={v}" for k, v in self.values.items()) or "no attributes"
        return f"checkpoint {self.number} ({shown}, {self.world_size} workers)"

    def to_json(self) -> dict[str, Any]:
        return {"format": 2, "number": self.number, "generation": self.generation,
                "parts": self.parts, "world_size": self.world_size, "values": self.values,
                "written_at": self.written_at, "info": self.info,
                "signature": self.signature, "checksum": CHECKSUM}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Manifest:
        parts = {part: {file: (list(v) if isinstance(v, (list, tuple)) else [int(v), None])
                        for file, v in files.items()}
                 for part, files in dict(raw["parts"]).items()}
        for files in parts.values():
            for entry in files.values():
                entry[0] = int(entry[0])
        return cls(int(raw["number"]), parts, int(raw["world_size"]),
                   dict(raw.get("values", {})), float(raw.get("written_at", 0.0)),
                   dict(raw.get("info", {})), int(raw.get("generation", 0)),
                   dict(raw.get("signature", {})))


def checkpoint_folder(generation: int, number: int) -> str:
    return f"{_PREFIX}{generation:06d}_{number:010d}"


def parse_folder(name: str) -> Key | None:
    """The (generation, commit) of a checkpoint folder's name (the older single-number
    names are generation 0); None for anything else."""
    if not name.startswith(_PREFIX):
        return None
    fields = name[len(_PREFIX):].split("_")
    try:
        if len(fields) == 1:
            return 0, int(fields[0])
        if len(fields) == 2:
            return int(fields[0]), int(fields[1])
    except ValueError:
        return None
    return None


def open_storage(storage_path: str, sleep: Callable[[float], None] = time.sleep) -> Storage:
    """The storage of a `CheckpointConfig.storage_path` (by its scheme: `open_backend`),
    with retries (and the injected faults of `RAYTRAIN_X_STORAGE_FAULTS`, where a test set
    it, under them)."""
    storage: Storage = open_backend(storage_path)
    plan = STORAGE_FAULTS.read()
    if plan:
        storage = FaultyStorage(storage, plan, sleep=sleep)
    return RetryingStorage(storage, sleep=sleep)


def probe(config: CheckpointConfig) -> None:
    """Writes a file in the job's folder, reads it back and deletes it: a path that cannot
    be written fails here, before any training, naming the path and the cause.

    Raises:
        StorageError: it could not be written, read back or deleted.
    """
    assert config.name is not None
    probe_storage(open_storage(config.storage_path), config.name)


def probe_storage(storage: Storage, folder: str) -> None:
    """`probe` of `folder` in `storage`."""
    path = f"{folder}/.probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        storage.publish(path, b"raytrain-x")
        back = storage.read(path)
        storage.delete_file(path)
    except StorageError as exc:
        raise StorageError(f"durable checkpoints cannot be written at "
                           f"{storage.describe(folder)}: {exc}. Give a path or bucket "
                           "this job can write (--checkpoint-path on the command line, "
                           "CheckpointConfig(storage_path=...) in Python)") from None
    if back != b"raytrain-x":
        raise StorageError(f"{storage.describe(path)} did not read back what was written")


def latest_checkpoint(config: CheckpointConfig) -> dict[str, Any]:
    """What the driver says of the checkpoint a restore will take: its number, attributes
    and description (number None when none is complete).

    Raises:
        StorageError: storage could not be listed or read after retries.
    """
    manifest = CheckpointStore(config).latest(warn=False, verify=False)
    if manifest is None:
        return {"number": None, "describe": "none found"}
    return {"number": manifest.number, "key": list(manifest.key),
            "describe": manifest.describe(), "values": manifest.values}


class CheckpointStore:
    """One job's checkpoint folders in storage (`CheckpointConfig.storage_path/name`)."""

    def __init__(self, config: CheckpointConfig, storage: Storage | None = None,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if config.name is None:
            raise ValueError("CheckpointConfig.named() settles the name first")
        self.config = config
        self.storage = storage or open_storage(config.storage_path, sleep=sleep)
        self.root = config.name
        self._sleep = sleep
        # seconds the last write on this rank spent on checksums, and reading back
        self.checksum_s = 0.0
        self.verify_s = 0.0

    def where(self, key: Key | None = None, part: str = "") -> str:
        """The full path or URI of the job's folder, a checkpoint's, or a part's."""
        return self.storage.describe(self._path(key, part))

    def _path(self, key: Key | None = None, part: str = "") -> str:
        path = self.root if key is None else f"{self.root}/{checkpoint_folder(*key)}"
        return f"{path}/{part}" if part else path

    # ------------------------------------------------------------------ writing
    def local_folder(self, key: Key, part: str) -> str | None:
        """Where a part can be written in place: storage on this machine's file system (a
        local or shared folder); None for object stores, which take `upload`."""
        return self.storage.local(self._path(key, part))

    def upload(self, key: Key, part: str, local_dir: str,
               hashed: dict[str, list[Any]] | None = None) -> dict[str, list[Any]]:
        """Checksums the part's files in `local_dir` (those in `hashed`, {file: [bytes,
        checksum]} taken as they were written, at their size, are not read again), copies
        them to storage (unless it is the part's own folder, written in place), makes them
        durable, reads them back (`read_back`), then records them (`part.json`); returns
        {file: [bytes, checksum]}.

        Raises:
            CheckpointError: the part landed damaged; StorageError: storage failed.
        """
        files: dict[str, list[Any]] = {}
        hashed = hashed or {}
        began = time.perf_counter()
        for folder, _, names in os.walk(local_dir):
            for file in names:
                path = os.path.join(folder, file)
                name, size = os.path.relpath(path, local_dir), os.path.getsize(path)
                known = hashed.get(name)
                files[name] = list(known) if known and known[0] == size \
                    else [size, file_checksum(path)]
        self.checksum_s += time.perf_counter() - began
        self.storage.upload(local_dir, self._path(key, part))
        began = time.perf_counter()
        why = self.read_back(key, part, files)
        self.verify_s += time.perf_counter() - began
        if why:
            raise CheckpointError(f"{self.where(key, part)} {LANDED_DAMAGED}: {why}")
        self.record(key, part, files)
        return files

    def read_back(self, key: Key, part: str, files: dict[str, list[Any]]) -> str:
        """'' when the part's files, as they landed in storage, are what was written (each
        read back once against its checksum, by the rank that wrote it), else which one
        is not: a part that landed damaged fails its write, and is never recorded."""
        landed = PartFiles(self.storage, self._path(key, part), files)
        try:
            for file in landed.names():
                for _ in landed.chunks(file):
                    pass
        except CheckpointDamaged as exc:
            return str(exc)
        return ""

    def record(self, key: Key, part: str, files: dict[str, list[Any]]) -> None:
        """Records a part's durable files ({file: [bytes, checksum]}): the part is done."""
        self.storage.publish(f"{self._path(key)}/{part}.json", json.dumps(files).encode())

    def part_failed(self, key: Key, part: str, cause: str) -> None:
        """Records that this rank's part will not come (so that the last writer gives the
        checkpoint up at once, not after its timeout); best effort, tried once."""
        try:
            self.storage.once().publish(f"{self._path(key)}/{part}{FAILED}", cause.encode())
        except Exception:  # noqa: BLE001 - storage that failed the part may fail this too
            pass

    def discard(self, key: Key, part: str = "") -> None:
        """Deletes what a failed attempt wrote: one part's folder, or (`part` empty) the
        whole checkpoint's, which its last writer gave up before publishing a manifest.
        Best effort, tried once: the next complete checkpoint prunes what is left."""
        try:
            self.storage.once().delete(self._path(key, part))
        except Exception as exc:  # noqa: BLE001 - storage that failed the write may fail this
            log.info("raytrain-x checkpoint: could not delete the failed attempt %s: %s",
                     self.where(key, part), exc)

    def parts_done(self, key: Key, parts: list[str]) -> dict[str, dict[str, list[Any]]]:
        """The parts among `parts` whose upload has been recorded.

        Raises:
            CheckpointError: a rank recorded that its part failed.
        """
        done = {}
        for part in parts:
            raw = self.storage.read(f"{self._path(key)}/{part}.json")
            if raw is not None:
                done[part] = {f: list(v) for f, v in json.loads(raw.decode()).items()}
                continue
            failed = self.storage.read(f"{self._path(key)}/{part}{FAILED}")
            if failed is not None:
                raise CheckpointError(f"the part {part} failed on its rank: "
                                      f"{failed.decode()[:300]}")
        return done

    def wait_for_parts(self, key: Key, parts: list[str], timeout_s: float,
                       still_written: Callable[[], frozenset[str] | None] = lambda: None,
                       failed_there: Callable[[], bool] = lambda: False,
                       ) -> dict[str, dict[str, list[Any]]]:
        """Every part's file list once all are recorded. `still_written()`: once the world
        changed, the parts its ranks are still writing (None while it has not);
        `failed_there()`: a rank said its part failed (at a commit, not through storage).

        Raises:
            CheckpointError: a part failed, its rank left the world before recording it,
                or not all arrived within `timeout_s`.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            writing = still_written()  # read before the records: a part is one or the other
            done = self.parts_done(key, parts)
            if len(done) == len(parts):
                return done
            if failed_there():
                raise CheckpointError("a rank's part failed on its rank (it said so at the "
                                      "next commit; its note in storage could not be "
                                      "written: see that rank's log for the cause)")
            lost = [] if writing is None else sorted(set(parts) - set(done) - writing)
            if lost:
                raise CheckpointError(
                    f"the world changed while it was written: no rank of the new world "
                    f"writes {', '.join(p.split('.')[0] for p in lost[:4])} (the rank of "
                    "the world that began it was lost mid-write); given up, the next "
                    "checkpoint is written from the new world")
            if time.monotonic() > deadline:
                missing = sorted(set(parts) - set(done))
                raise CheckpointError(f"not every rank's part arrived within {timeout_s:g}s "
                                      f"(missing {missing[:4]})")
            self._sleep(0.2)

    def complete(self, manifest: Manifest) -> None:
        """Publishes the manifest: from now on the checkpoint is visible to readers. (A
        damaged mark left by an earlier write of the same number goes first: it was of
        that write's files.)"""
        if self._damaged(manifest.key) is not None:
            self.storage.delete_file(f"{self._path(manifest.key)}/{DAMAGED}")
        self.storage.publish(f"{self._path(manifest.key)}/{MANIFEST}",
                             json.dumps(manifest.to_json()).encode())

    def finish(self, manifest: Manifest, keep: int, fence: Callable[[], None]) -> None:
        """The last writer's end of a checkpoint whose parts are all recorded (each read
        back intact by its writer): `fence()` (the writer lease still held), the manifest
        published, `fence()` again, then older checkpoints pruned. Once the manifest is
        published the checkpoint is complete: a fence or a pruning that fails after that is
        a warning (the next checkpoint prunes again; a fenced run's next write is
        refused), not a failed checkpoint.

        Raises:
            CheckpointLeaseHeld: this run was fenced before it published.
        """
        fence()
        self.complete(manifest)
        try:
            fence()  # fenced in between: prune nothing of the newer run's
            self.prune(keep, manifest.generation)
        except (CheckpointError, StorageError) as exc:  # CheckpointLeaseHeld included
            log.warning("raytrain-x checkpoint: %s is complete; older checkpoints were not "
                        "pruned: %s", self.where(manifest.key), exc)

    def prune(self, keep: int, generation: int) -> list[Key]:
        """Deletes complete checkpoints beyond the newest `keep`, and incomplete ones older
        than the newest complete one (writes given up); never one of a later generation
        than `generation` (the writer's own), never the newest complete one, never one
        completed and then found damaged (a file changed, missing or marked: set aside,
        what is left of a state for its owner to look at; it takes none of the `keep`
        places). Returns the keys deleted."""
        keys = self._keys()
        refused: list[tuple[Key, str]] = []
        complete = [m.key for m in self._complete(keys, False, False, refused)]
        if not complete:
            return []
        kept = set(complete[:max(1, keep)])
        kept |= {key for key, why in refused if not never_completed(why)}
        doomed = [k for k in keys if k not in kept and k < complete[0]
                  and k[0] <= generation]
        for key in doomed:
            self.storage.delete(self._path(key))
        return doomed

    # ------------------------------------------------------------------ reading
    def checkpoints(self, warn: bool = False) -> list[Manifest]:
        """The complete checkpoints (every file at its size), newest first. With `warn`,
        each folder skipped is logged."""
        return list(self._complete(self._keys(), warn, verify=False))

    def latest(self, warn: bool = True, verify: bool = True) -> Manifest | None:
        """The newest complete checkpoint; with `verify`, the newest whose every file has
        its checksum too (each skipped one logged, with `warn`, naming the file). None
        only where no checkpoint was ever completed here (writes that did not finish).

        Raises:
            CheckpointError: checkpoints were completed here and none can be taken (each
                named with why, and how to start afresh); StorageError: storage could
                not be listed or read, after retries.
        """
        refused: list[tuple[Key, str]] = []
        manifest = next(self._complete(self._keys(), warn, verify, refused), None)
        taken_once = [(key, why) for key, why in refused if not never_completed(why)]
        if manifest is None and taken_once:
            listed = "; ".join(f"{self.where(key)}: {why}" for key, why in taken_once[:5])
            more = f" (and {len(taken_once) - 5} more)" if len(taken_once) > 5 else ""
            raise CheckpointError(
                f"no checkpoint of this job can be restored, though {len(taken_once)} "
                f"{'was' if len(taken_once) == 1 else 'were'} completed: {listed}{more}. "
                "Nothing was deleted. To start the job afresh on purpose, give it another "
                f"CheckpointConfig(name=...), or move {self.where()} aside")
        return manifest

    def generations(self) -> list[int]:
        """The generations that wrote a checkpoint folder here."""
        return sorted({k[0] for k in self._keys()})

    def _complete(self, keys: list[Key], warn: bool, verify: bool,
                  refused: list[tuple[Key, str]] | None = None) -> Iterator[Manifest]:
        """The complete checkpoints among `keys`, newest first; each one passed over goes
        into `refused` with why."""
        for key in sorted(keys, reverse=True):
            manifest, why = self._check(key)
            if manifest is not None and verify:
                why = self.verify(manifest)
                if why:  # readers and pruning skip it from now on: it is incomplete
                    manifest = None
                    self._mark_damaged(key, why)
            if manifest is not None:
                yield manifest
                continue
            if refused is not None:
                refused.append((key, why))
            if warn:
                log.warning("raytrain-x checkpoint: skipping %s: %s; trying the one before",
                            self.where(key), why)

    def verify(self, manifest: Manifest) -> str:
        """'' when every file of `manifest` has its checksum, else which one does not."""
        for part, files in manifest.parts.items():
            why = self.read_back(manifest.key, part, files)
            if why:
                return why
        return ""

    def part(self, manifest: Manifest, part: str) -> PartFiles:
        """A part of `manifest`'s checkpoint, read through storage and checked as it is
        read (`PartFiles`)."""
        return PartFiles(self.storage, self._path(manifest.key, part), manifest.parts[part])

    def mark_damaged(self, key: Key, why: str) -> None:
        """Sets the checkpoint `key` aside: a reader found one of its files damaged
        (`why`). Readers pass it over from now on, and pruning never deletes it."""
        self._mark_damaged(key, why)

    def _damaged(self, key: Key) -> str | None:
        """Why the checkpoint `key` was marked damaged (None: it was not)."""
        mark = self.storage.read(f"{self._path(key)}/{DAMAGED}")
        return None if mark is None else mark.decode(errors="replace")[:300]

    def _mark_damaged(self, key: Key, why: str) -> None:
        try:
            self.storage.publish(f"{self._path(key)}/{DAMAGED}", why.encode())
        except StorageError as exc:  # a reader that cannot write still skips it
            log.warning("raytrain-x checkpoint: cannot mark %s damaged: %s", self.where(key),
                        exc)

    def _keys(self) -> list[Key]:
        """Every checkpoint folder's key. A listing error is retried, then raised."""
        keys = []
        for entry in self.storage.list(self.root):
            key = parse_folder(entry.name) if entry.is_dir else None
            if key is not None:
                keys.append(key)
        return keys

    def _check(self, key: Key) -> tuple[Manifest | None, str]:
        try:
            raw = self.storage.read(f"{self._path(key)}/{MANIFEST}")
        except StorageError as exc:
            raise StorageError(f"{exc} (reading the manifest of {self.where(key)})") from exc
        if raw is None:
            return None, NO_MANIFEST
        damaged = self._damaged(key)
        if damaged is not None:
            return None, f"{DAMAGED_BEFORE}: {damaged}"
        try:
            manifest = Manifest.from_json(json.loads(raw.decode()))
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
            return None, f"its manifest is not valid ({exc!r})"
        if manifest.key != key and manifest.generation != 0:
            return None, f"its manifest is of checkpoint {manifest.key}, not {key}"
        manifest.generation = key[0]
        paths = [f"{self._path(key, part)}/{file}"
                 for part, files in manifest.parts.items() for file in files]
        sizes = [entry[0] for files in manifest.parts.values() for entry in files.values()]
        for path, size, found in zip(paths, sizes, self.storage.sizes(paths)):
            if found != size:
                return None, f"{self.storage.describe(path)} is missing or not {size} bytes"
        return manifest, ""
