"""Durable checkpoints of a `TorchState`: its committed host snapshot written to storage by
a background thread, in `torch.distributed.checkpoint` (DCP) format, and read back.

Each part of a checkpoint (`raytrain_x.elastic.storage`) is a DCP checkpoint written by one
rank: `common` (models, unsharded optimizers, samplers, plain attributes; rank 0) and, with
a sharded optimizer, `shard_<rank>` (that rank's optimizer shard, by parameter index).
Plain torch reads a part with `torch.distributed.checkpoint.format_utils.dcp_to_torch_save`:
its tensors and values under `state`, nested as in `state_dict()`s.
The checkpoint's last writer (rank 0) waits for every part, then writes the manifest.
A failed or slow write never stops training: a warning, a counter, the next one later.
"""

from __future__ import annotations

import logging
import os
import pickle
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from raytrain_x.common.checkpoint_config import CheckpointConfig
from raytrain_x.core import runtime, status
from raytrain_x.core.objects import allgather_object
from raytrain_x.elastic.storage import CheckpointStore, Manifest
from raytrain_x.torch.snapshot import map_paths

log = logging.getLogger("raytrain_x.elastic")

COMMON = "common"

# DCP warns on every save and load outside a torch.distributed world: each part is written
# by one process on purpose
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or "
                        "uninitialized", category=UserWarning)


def shard_part(rank: int) -> str:
    return f"shard_{rank:05d}"


def part_name(part: str, write_id: int) -> str:
    """A part's folder in one write attempt: a commit's number can be written twice (after
    a restore from storage the job commits it again), and attempts never share files."""
    return f"{part}.{write_id}"


def part_kind(folder: str) -> str:
    """`common` or `shard_<rank>`: what a manifest's part folder holds."""
    return folder.split(".")[0]


class DurableCheckpoints:
    """A job's durable checkpoints, from one rank's side."""

    def __init__(self, config: CheckpointConfig,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
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
                    save(tree(), local)
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
            return load(self.store.download(manifest, part, tmp))


_AT = "__raytrain_x_tensor_at__"  # a skeleton's placeholder: where the tensor sits


def _skeleton(tree: Any) -> Any:
    """The tree with each tensor replaced by its path: the tree's exact shape, which DCP
    does not keep (it drops empty containers and turns keys into strings)."""
    return map_paths(tree, (), lambda path, _: {_AT: list(path)})


def _filled(skeleton: Any, saved: Any) -> Any:
    if isinstance(skeleton, dict) and set(skeleton) == {_AT}:
        value = saved
        for key in skeleton[_AT]:
            value = value[str(key)] if isinstance(value, dict) and key not in value \
                else value[key]
        return value
    if isinstance(skeleton, dict):
        return {k: _filled(v, saved) for k, v in skeleton.items()}
    if type(skeleton) in (list, tuple):
        return type(skeleton)(_filled(v, saved) for v in skeleton)
    return skeleton


def save(tree: Any, folder: str) -> None:
    """Writes `tree` (nested dicts of tensors and values) as a DCP checkpoint: its tensors
    under `state` (as the tree nests them), and the tree's exact shape under `skeleton`."""
    import torch.distributed.checkpoint as dcp

    skeleton = pickle.dumps(_skeleton(tree))  # one object: DCP would flatten a dict
    dcp.save({"state": tree, "skeleton": skeleton}, checkpoint_id=folder, no_dist=True)


def load(folder: str) -> Any:
    """Reads a DCP checkpoint `save` wrote back into the tree that was saved."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = os.path.join(folder, "..", os.path.basename(folder) + ".pt")
    dcp_to_torch_save(folder, path)
    try:
        saved = torch.load(path, weights_only=False)
    finally:
        os.remove(path)
    return _filled(pickle.loads(saved["skeleton"]), saved["state"])


def _plain_values(values: dict[str, Any]) -> dict[str, Any]:
    """The attributes a manifest shows (step, epoch, ...): plain numbers and strings."""
    return {k: v for k, v in values.items()
            if isinstance(v, (int, float, str, bool)) and (not isinstance(v, str) or len(v) < 80)}


def write_parts(durable: DurableCheckpoints, state: Any, write_id: int) -> None:
    """Starts writing this rank's parts of `state`'s commit just taken (a `TorchState`):
    rank 0 the common part (and the manifest, last), and with sharded optimizers each rank
    its own shard. The snapshot is held by the writer, so later commits do not reuse its
    buffers while it is written."""
    rank, size = runtime.rank(), runtime.size()
    snap = state.committed()
    parts: dict[str, Callable[[], Any]] = {}
    every = [part_name(COMMON, write_id)]
    if rank == 0:
        parts[part_name(COMMON, write_id)] = snap.tree
    commits = state._commits
    if commits is not None:
        owners = {(name, i): r for name, opt in commits.optimizers.items()
                  for i, r in opt.owners_by_index().items()}
        own: dict[str, dict[int, Any]] = {}
        for (name, index), shard in commits.taken.shards.items():
            if owners.get((name, index)) == rank:
                own.setdefault(name, {})[index] = shard
        parts[part_name(shard_part(rank), write_id)] = lambda: {"rank": rank, "shards": own}
        every += [part_name(shard_part(r), write_id) for r in range(size)]
    if not parts:
        return
    layout = "sharded" if commits is not None else "unsharded"
    durable.write(parts, last_writer=rank == 0, every_part=every, world_size=size,
                  values=_plain_values(state._values()), info={"layout": layout})


def restore_from_storage(durable: DurableCheckpoints, state: Any, force: bool = False) -> bool:
    """At a sync where no rank holds the state in memory (all holders lost: the driver says
    so; or a new job with the same storage): loads the latest complete checkpoint, rank 0
    the common part and every rank the optimizer shards it owns in this world's layout.
    Returns False (and loads nothing) when some rank holds the state (unless `force`: part
    of a sharded state was lost with every copy) or there is no checkpoint."""
    from raytrain_x.elastic.state import holds_state
    from raytrain_x.torch.functions import broadcast_object
    from raytrain_x.torch.zero_elastic import Generation

    # the driver says so when no worker holds the latest commit (a survivor may hold an
    # older one); without a driver, or at a new job's start, no rank holding any state
    told = runtime.rendezvous().restore_from_storage
    if not (force or told) and any(allgather_object(holds_state(),
                                                    name="elastic.durable.holders")):
        return False
    rank = runtime.rank()
    manifest = broadcast_object(durable.latest() if rank == 0 else None, 0,
                                name="elastic.durable.latest")
    if manifest is None:
        return False
    began = time.perf_counter()
    if rank == 0:
        common = next(p for p in manifest.parts if part_kind(p) == COMMON)
        state._load_tree(durable.load(manifest, common))
    commits = state._commits
    if commits is not None:
        shards: dict[str, dict[int, Any]] = {}
        for part in sorted(p for p in manifest.parts if part_kind(p) != COMMON):
            for name, states in durable.load(manifest, part)["shards"].items():
                shards.setdefault(name, {}).update(states)
        for name, opt in commits.optimizers.items():
            opt.reshard()
            opt.load_shard_state(shards.get(name, {}))
        commits.taken = Generation(0, commits._own(), None, None)
        commits.staged = None
    durable.number = manifest.number
    seconds = time.perf_counter() - began
    status.checkpoints.restored(manifest.number, seconds)
    if rank == 0:
        log.warning("raytrain-x checkpoint: no worker held the job's state in memory; "
                    "restored %s from %s in %.1fs", manifest.describe(),
                    durable.store.where(manifest.number), seconds)
    state.restored_from = manifest
    return True
