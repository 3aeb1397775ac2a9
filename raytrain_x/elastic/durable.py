"""Durable checkpoints from one rank's side, for any framework: when a commit is written,
the background writer of this rank's parts, and the restore at a sync where no rank holds
the state. A framework gives its format (`save`/`load` of a tree to a folder) and which
parts each rank writes (`raytrain_x.torch.durable`, `raytrain_x.tensorflow.durable`).

Each part of a checkpoint (`raytrain_x.elastic.storage`) is written by one rank: `common`
(rank 0) and, with a sharded optimizer, `shard_<rank>`. The checkpoint's last writer (rank
0) waits for every part, then writes the manifest. A failed or slow write never stops
training: a warning, a counter, the next one later.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from raytrain_x.common.checkpoint_config import CheckpointConfig
from raytrain_x.core import runtime, status
from raytrain_x.core.objects import allgather_object
from raytrain_x.elastic.storage import CheckpointStore, Manifest

log = logging.getLogger("raytrain_x.elastic")

COMMON = "common"


def shard_part(rank: int) -> str:
    return f"shard_{rank:05d}"


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


class DurableCheckpoints:
    """A job's durable checkpoints, from one rank's side: when to write, the background
    writer, and reading parts back (in the framework's format: `save`, `load`)."""

    def __init__(self, config: CheckpointConfig, save: Callable[[Any, str], None],
                 load: Callable[[str], Any],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._save, self._load = save, load  # a framework's format: a tree to a folder
        self.store = CheckpointStore(config)
        self._clock = clock
        self._thread: threading.Thread | None = None
        self._last_start = clock()  # the first checkpoint comes every_s after the start
        self.number = 0  # the job's commits, counted over its whole life (synced)
        self._asked = False  # the driver asked for one (a drain of every holder)

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

    def write(self, parts: dict[str, Callable[[], Any]], last_writer: bool,
              every_part: list[str], world_size: int, values: dict[str, Any],
              info: dict[str, Any]) -> None:
        """Writes this rank's `parts` (each a function returning the tree to save) of
        checkpoint `self.number` on a background thread; `last_writer` then waits for
        `every_part` and completes the checkpoint."""
        if self.busy():
            log.warning("raytrain-x checkpoint: the write before checkpoint %d is still "
                        "under way on this rank; skipping this one", self.number)
            return
        self._last_start, self._asked = self._clock(), False
        manifest = Manifest(self.number, {}, world_size, values, 0.0, info)
        self._thread = threading.Thread(target=self._write,
                                        args=(manifest, parts, last_writer, every_part),
                                        name="raytrain-x-checkpoint", daemon=True)
        self._thread.start()

    def wait(self, timeout_s: float | None = None) -> None:
        """Waits for this rank's write under way, if any (tests, a drain, shutdown)."""
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _write(self, manifest: Manifest, parts: dict[str, Callable[[], Any]],
               last_writer: bool, every_part: list[str]) -> None:
        began = time.perf_counter()
        number = manifest.number
        try:
            with tempfile.TemporaryDirectory(prefix="raytrain-x-checkpoint-") as tmp:
                for part, tree in parts.items():
                    # a folder on this machine is written in place; object stores from a
                    # local copy
                    local = self.store.local_folder(number, part) or os.path.join(tmp, part)
                    self._save(tree(), local)
                    self.store.upload(number, part, local)
            if last_writer:
                files = self.store.wait_for_parts(number, every_part,
                                                  self.config.write_timeout_s)
                if files is None:
                    raise TimeoutError(f"not every rank's part arrived within "
                                       f"{self.config.write_timeout_s:g}s")
                manifest.parts = files
                manifest.written_at = time.time()
                self.store.complete(manifest)
                self.store.prune(self.config.keep)
                seconds = time.perf_counter() - began
                status.checkpoints.written(number, seconds)
                log.info("raytrain-x checkpoint: %s written to %s in %.1fs",
                         manifest.describe(), self.store.where(number), seconds)
        except Exception as exc:  # noqa: BLE001 - training goes on; the next one may succeed
            status.checkpoints.failed(number)
            log.warning("raytrain-x checkpoint: writing checkpoint %d to %s failed (%s); "
                        "training goes on, the next checkpoint is tried in %gs", number,
                        self.store.where(number), str(exc).splitlines()[0][:300],
                        self.config.every_s)

    def latest(self) -> Manifest | None:
        """The newest complete checkpoint; incomplete or damaged ones after it are skipped
        with a warning."""
        return self.store.latest(warn=True)

    def load(self, manifest: Manifest, part: str) -> Any:
        """A part of `manifest`'s checkpoint, as the tree that was saved (host tensors)."""
        with tempfile.TemporaryDirectory(prefix="raytrain-x-restore-") as tmp:
            return self._load(self.store.download(manifest, part, tmp))


def checkpoint_to_restore(durable: DurableCheckpoints, bcast_object: Callable[..., Any],
                          force: bool = False) -> Manifest | None:
    """At a sync: the checkpoint every rank restores, or None when some rank holds the
    state in memory (unless `force`: part of a sharded state was lost with every copy) or
    there is no complete checkpoint. The driver says when no worker holds the latest
    commit (a survivor may hold an older one); without a driver, or at a new job's start,
    no rank holding any state means the same. A collective."""
    from raytrain_x.elastic.state import holds_state

    told = runtime.rendezvous().restore_from_storage
    if not (force or told) and any(allgather_object(holds_state(),
                                                    name="elastic.durable.holders")):
        return None
    return bcast_object(durable.latest() if runtime.rank() == 0 else None, 0,
                        name="elastic.durable.latest")


def restored(durable: DurableCheckpoints, state: Any, manifest: Manifest,
             began: float) -> None:
    """Counts and logs a restore from `manifest` that began at `began` (perf_counter)."""
    durable.number = manifest.number
    seconds = time.perf_counter() - began
    status.checkpoints.restored(manifest.number, seconds)
    if runtime.rank() == 0:
        log.warning("raytrain-x checkpoint: no worker held the job's state in memory; "
                    "restored %s from %s in %.1fs", manifest.describe(),
                    durable.store.where(manifest.number), seconds)
    state.restored_from = manifest
