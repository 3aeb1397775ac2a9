"""`rx.elastic`: elastic training for PyTorch (Horovod's `hvd.elastic`)."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from typing import Any

import torch

from raytrain_x.common.checkpoint_config import CheckpointConfig, from_env
from raytrain_x.common.errors import ConfigError, ElasticStateLost
from raytrain_x.core.objects import allgather_object
from raytrain_x.core.process_sets import global_process_set
from raytrain_x.core.runtime import rank, size
from raytrain_x.elastic.state import ObjectState, State, restore_count, run
from raytrain_x.torch.durable import open_checkpoints, restore_from_storage, write_parts
from raytrain_x.torch.functions import (
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from raytrain_x.torch.global_batch import GlobalBatch
from raytrain_x.torch.snapshot import Snapshot, Snapshots
from raytrain_x.torch.zero_elastic import ShardedCommits
from raytrain_x.torch.zero_optimizer import ShardedOptimizer


class ElasticSampler(torch.utils.data.Sampler):
    """Shards a dataset over the current workers and remembers what was processed in this
    epoch, so that an elastic reset re-shards only what is left (Horovod's sampler).

    Put it in a `TorchState` (any keyword) and record each batch with `record_batch`; a
    commit then keeps the epoch's progress, a restore goes back to the committed progress,
    and after a reset the remaining samples are re-shared among the new set of workers.

    As with `DistributedSampler`, each rank's shard is padded (with samples from the start
    of what remains) to an equal length, so that every rank runs the same number of steps.

    Args:
        dataset: anything with `len()`.
        shuffle: shuffle the remaining indices with `seed + epoch` (the same on every rank).
        seed: base of the shuffle's seed.
    """

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_indices: set[int] = set()
        # record_indices was used: each rank holds only its own records, combined at a sync
        self.rank_local_records = False
        self.num_replicas = 1
        self.rank = 0
        self.remaining_indices: list[int] = []
        self.num_samples = 0
        self.total_size = 0
        self._padded: list[int] = []
        self.indices: list[int] = []
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Starts epoch `epoch`: nothing processed yet, a new shuffle."""
        self.epoch = epoch
        self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Records batch `batch_idx` (counted from the start of this iteration) as done on
        every rank: data-parallel ranks step together, so each rank records the others'
        rows of the same batch too, and a commit holds the whole world's progress with no
        communication (a failed rank's committed batches are not done again)."""
        start = batch_idx * batch_size
        for replica in range(self.num_replicas):
            shard = self._padded[replica:self.total_size:self.num_replicas]
            self.processed_indices.update(shard[start:start + batch_size])

    def record_indices(self, indices: Any) -> None:
        """Records dataset indices processed by this rank only; after a reset the survivors'
        records are combined (a failed rank's are lost, as in Horovod)."""
        self.rank_local_records = True
        self.processed_indices.update(int(i) for i in indices)

    def get_indices(self, batch_idx: int, batch_size: int) -> list[int]:
        """This rank's dataset indices of batch `batch_idx`."""
        start = batch_idx * batch_size
        return self.indices[start:min(start + batch_size, len(self.indices))]

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "processed_indices": set(self.processed_indices)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.epoch = state_dict["epoch"]
        self.processed_indices = set(state_dict["processed_indices"])
        self.reset()

    def reset(self) -> None:
        """Re-shards what is left of the epoch over the current world."""
        self.num_replicas, self.rank = size(), rank()
        remaining = [i for i in range(len(self.dataset)) if i not in self.processed_indices]
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(remaining)
        self.remaining_indices = remaining
        self.num_samples = math.ceil(len(remaining) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas
        padded = list(remaining)
        while remaining and len(padded) < self.total_size:
            padded += remaining[:self.total_size - len(padded)]
        self._padded = padded
        self.indices = padded[self.rank:self.total_size:self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        self.indices = self._padded[self.rank:self.total_size:self.num_replicas]
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples


def _kind(value: Any) -> str:
    if isinstance(value, torch.nn.Module):
        return "model"
    if isinstance(value, torch.optim.Optimizer):
        return "optimizer"
    if isinstance(value, ElasticSampler):
        return "sampler"
    return ""


class TorchState(ObjectState):
    """Models, optimizers, `ElasticSampler`s and plain attributes, committed to host memory.

    A commit copies the models' and optimizers' tensors into host buffers that later
    commits reuse (`raytrain_x.torch.snapshot`): no device memory, no allocation once warm.
    CUDA tensors go to pinned memory on a side stream and the step does not wait: the next
    forward and backward run beside the copy, and the next `optimizer.step()` (and, for a
    model with buffers, the next forward) is queued after it.

    A sharded optimizer (`DistributedOptimizer(..., zero_stage=1 | 2)`) is committed as
    shards: each rank keeps its own and copies of `replicas` peers' (on other nodes first),
    and at a new round the state is rebuilt from the survivors' copies and re-sharded for
    the new world, in memory (`raytrain_x.torch.zero_elastic`).

    Args:
        model: the module whose `state_dict` is committed and synced.
        optimizer: the optimizer whose state is committed and synced.
        replicas: how many peers keep a copy of each rank's optimizer shard (sharded
            optimizers only): the job survives the loss of that many workers at once, or
            of a node's workers when the copies sit on other nodes.
        checkpoint: durable checkpoints of the commits (`CheckpointConfig`): written in the
            background, restored from when no worker holds the state in memory (every
            holder lost, or the job started again). Default: the executor's
            (`RayExecutor(checkpoint=...)`, `raytrain-x run --checkpoint-path`), else none.
        overlap_commits: let a CUDA commit's copy run beside the next forward and
            backward (ordered before the next `optimizer.step()`). Set False when the
            parameters or the optimizer state are changed outside `optimizer.step()` between
            a commit and the next step (a weight average by hand): each commit's copy is
            then ordered before any later work on the device.
        **kwargs: more modules, optimizers or samplers (by any name: a GAN's two models),
            and plain attributes (epoch, batch, ...), as in `ObjectState`.
    """

    def __init__(self, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, replicas: int = 1,
                 checkpoint: CheckpointConfig | None = None, overlap_commits: bool = True,
                 **kwargs: Any) -> None:
        self.model = model
        self.optimizer = optimizer
        handled = {"model": model, "optimizer": optimizer,
                   **{k: v for k, v in kwargs.items() if _kind(v)}}
        self._handled = {k: v for k, v in handled.items() if v is not None}
        for name, value in self._handled.items():
            setattr(self, name, value)
        sharded = {k: v for k, v in self._handled.items() if isinstance(v, ShardedOptimizer)}
        self._commits: ShardedCommits | None = None
        if sharded:
            if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1:
                raise ConfigError(f"replicas must be an int >= 1 (copies of each rank's "
                                  f"optimizer shard), got {replicas!r}")
            for name, opt in sharded.items():
                if opt._process_set is not global_process_set:
                    raise ConfigError(f"elastic training re-shards {name!r} over the whole "
                                      "world: build it without a process_set")
            self._commits = ShardedCommits(sharded, replicas)
        config = checkpoint.named(None) if checkpoint else from_env()
        self._durable = open_checkpoints(config) if config is not None else None
        self._snapshots = Snapshots()
        self._committed: Snapshot | None = None
        self._unordered: Snapshot | None = None  # copies not yet ordered before a change
        # a sharded optimizer steps buckets as their reductions land, during backward
        self._overlap = bool(overlap_commits) and not sharded and self._hook_modifications()
        super().__init__(bcast_object=broadcast_object, get_rank=rank,
                         **{k: v for k, v in kwargs.items() if k not in self._handled})
        self._save_handled()

    def syncs_after_every_reset(self) -> bool:
        return self._commits is not None

    def _hook_modifications(self) -> bool:
        """Orders a pending commit's copy before the handled tensors' next change: every
        optimizer's step and, for a model with buffers (changed by forward), its forward.
        False (no overlap) when there is no optimizer to hook."""
        optimizers = [v for v in self._handled.values() if _kind(v) == "optimizer"]
        if not optimizers:
            return False
        for opt in optimizers:
            opt.register_step_pre_hook(lambda *_: self._order_pending())
        for module in (v for v in self._handled.values() if _kind(v) == "model"):
            params = {name for name, _ in module.named_parameters(remove_duplicate=False)}
            if any(name not in params for name in module.state_dict()):  # committed buffers
                module.register_forward_pre_hook(lambda *_: self._order_pending())
        return True

    def _order_pending(self) -> None:
        if self._unordered is not None:
            self._unordered.order_before_modification()
            self._unordered = None

    def _tree(self) -> dict[str, Any]:
        """The state to commit: the modules', unsharded optimizers' and samplers' state
        dicts, the sharded optimizers' param groups (their settings: an lr scheduler
        changes them), the plain attributes."""
        handled = {}
        for name, value in self._handled.items():
            if isinstance(value, ShardedOptimizer):
                handled[name] = value.group_settings()
            else:
                handled[name] = value.state_dict()
        return {"handled": handled, "attributes": self._values()}

    def _snapshot(self) -> Snapshot:
        self._order_pending()
        snap = self._snapshots.take(self._tree(), order=not self._overlap)
        if self._overlap:
            self._unordered = snap
        return snap

    def _load(self, snap: Snapshot) -> None:
        self._order_pending()
        self._load_tree(snap.copy())

    def _load_tree(self, copies: dict[str, Any]) -> None:
        """Loads a tree of `_tree`'s shape (a fresh copy: it may be kept)."""
        for name, value in self._handled.items():
            saved = copies["handled"].get(name)
            if saved is None:
                continue
            if isinstance(value, ShardedOptimizer):
                for group, settings in zip(value.param_groups, saved):
                    group.update(settings)
            else:
                value.load_state_dict(saved)
        for name, value in copies["attributes"].items():
            setattr(self, name, value)

    def committed(self) -> Snapshot:
        """The last commit as a host snapshot (models, optimizers, samplers, attributes;
        a sharded optimizer's own shard is kept by `ShardedCommits`)."""
        if self._commits is not None:
            return self._commits.taken.copies
        assert self._committed is not None
        return self._committed

    def _save_handled(self) -> None:
        if self._commits is not None:
            self._commits.taken.copies = self._snapshot()
            return
        self._committed = self._snapshot()

    def write_checkpoint(self, write_id: int, background: bool = True) -> Any:
        if self._durable is not None:
            return write_parts(self._durable, self, write_id, background)
        return None

    def save(self) -> None:
        if self._durable is not None:
            self._durable.number += 1
        if self._commits is not None:
            self._commits.commit(self._snapshot())
            return
        self._save_handled()

    def restore(self) -> None:
        # a sharded optimizer's shards come back at the next round's sync
        self._load(self.committed())

    def sync(self) -> None:
        """Everything from one rank, then a commit: rank 0 (the oldest survivor); with
        sharded optimizers, the lowest rank holding the newest whole generation, once the
        optimizers are re-sharded from the survivors' copies (whose commit in the new world
        then places the copies anew)."""
        root = 0
        self._order_pending()
        if self._durable is not None and restore_from_storage(self._durable, self):
            pass  # no worker held the state: rank 0 loaded it, and each rank its shards
        elif self._commits is not None:
            try:
                root = self._commits.restore().root
                if rank() == root:
                    self._load(self._commits.taken.copies)
            except ElasticStateLost:  # every rank finds the same: fall back to storage
                if self._durable is None or not restore_from_storage(self._durable, self,
                                                                     force=True):
                    raise
        if self._durable is not None:
            self._durable.number = broadcast_object(self._durable.number, root,
                                                    name="elastic.durable.number")
        for name, value in self._handled.items():
            kind = _kind(value)
            if kind == "model":
                broadcast_parameters(value.state_dict(), root_rank=root)
            elif isinstance(value, ShardedOptimizer):
                settings = broadcast_object(value.group_settings(), root,
                                            name=f"elastic.{name}.groups")
                for group, chosen in zip(value.param_groups, settings):
                    group.update(chosen)
            elif kind == "optimizer":
                broadcast_optimizer_state(value, root_rank=root)
            else:
                self._sync_sampler(name, value, root)
        self._sync_attributes(root)
        self.save()

    def _sync_sampler(self, name: str, value: ElasticSampler, root: int) -> None:
        """The root's epoch and progress. `record_batch` records the whole world's rows on
        every rank, so the root's committed set is complete and matches the rest of its
        state. Survivors may have committed one step more than the root (a peer died
        between their commits); a union would mark that step's samples done while the
        root's model never saw them (found by tools/chaos.py: an epoch missed samples).
        Only records each rank kept alone (`record_indices`, Horovod's way) are combined."""
        seen = allgather_object((value.processed_indices, value.rank_local_records),
                                name=f"elastic.{name}")
        state = value.state_dict()
        if any(local for _, local in seen):
            state["processed_indices"] = set().union(*(p for p, _ in seen))
        value.load_state_dict(broadcast_object(state, root, name=f"elastic.{name}"))


__all__ = ["CheckpointConfig", "ElasticSampler", "GlobalBatch", "ObjectState", "State",
           "TorchState", "restore_count", "run"]
