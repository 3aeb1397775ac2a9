"""Durable checkpoints of a `TorchState`: its committed host snapshot written to storage by
a background thread, in `torch.distributed.checkpoint` (DCP) format, and read back.

Each part of a checkpoint (`raytrain_x.elastic.storage`) is a DCP checkpoint written by one
rank: `common` (models, unsharded optimizers, samplers, plain attributes; rank 0) and, with
a sharded optimizer, `shard_<rank>` (that rank's optimizer shard, by parameter index).
Plain torch reads a part with `torch.distributed.checkpoint.format_utils.dcp_to_torch_save`:
its tensors and values under `state`, nested as in `state_dict()`s.
The writer, the manifest and the restore decision are `raytrain_x.elastic.durable`'s.
"""

from __future__ import annotations

import os
import pickle
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from raytrain_x.common.checkpoint_config import CheckpointConfig
from raytrain_x.core import runtime
from raytrain_x.elastic.durable import (
    COMMON,
    DurableCheckpoints,
    checkpoint_to_restore,
    part_kind,
    part_name,
    plain_values,
    restored,
    shard_part,
)
from raytrain_x.torch.snapshot import map_paths

# DCP warns on every save and load outside a torch.distributed world: each part is written
# by one process on purpose
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or "
                        "uninitialized", category=UserWarning)


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
                  values=plain_values(state._values()), info={"layout": layout})


def open_checkpoints(config: CheckpointConfig) -> DurableCheckpoints:
    """A `TorchState`'s durable checkpoints: parts in DCP format."""
    return DurableCheckpoints(config, save, load)


def restore_from_storage(durable: DurableCheckpoints, state: Any, force: bool = False) -> bool:
    """At a sync where no rank holds the state in memory (all holders lost: the driver says
    so; or a new job with the same storage): loads the latest complete checkpoint, rank 0
    the common part and every rank the optimizer shards it owns in this world's layout.
    Returns False (and loads nothing) when some rank holds the state (unless `force`: part
    of a sharded state was lost with every copy) or there is no checkpoint."""
    from raytrain_x.torch.functions import broadcast_object
    from raytrain_x.torch.zero_elastic import Generation

    manifest = checkpoint_to_restore(durable, broadcast_object, force)
    if manifest is None:
        return False
    began = time.perf_counter()
    if runtime.rank() == 0:
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
    restored(durable, state, manifest, began)
    return True
