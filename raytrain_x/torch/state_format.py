"""What a `TorchState` commits, as its commit manager sees it (`raytrain_x.elastic.commits`):
its tree (the models', unsharded optimizers' and samplers' state dicts, the sharded
optimizers' param groups, the plain attributes), a host snapshot of it, loading one back,
syncing the live objects from one rank, its signature, and its parts in DCP format
(`raytrain_x.torch.durable`).

A commit copies the tensors into host buffers that later commits reuse
(`raytrain_x.torch.snapshot`). CUDA tensors go to pinned memory on a side stream and the step
does not wait: the copy is ordered before the next `optimizer.step()` (and, for a model with
buffers, the next forward), where the committed tensors next change.
"""

from __future__ import annotations

from typing import Any

import torch

from raytrain_x.core.objects import allgather_object
from raytrain_x.elastic.checksums import PartFiles
from raytrain_x.elastic.positions import Position
from raytrain_x.elastic.state import Attributes
from raytrain_x.torch import durable
from raytrain_x.torch.elastic_sampler import ElasticSampler
from raytrain_x.torch.functions import (
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from raytrain_x.torch.snapshot import Snapshot, Snapshots
from raytrain_x.torch.zero_optimizer import ShardedOptimizer


def kind_of(value: Any) -> str:
    """"model", "optimizer", "sampler", "position" (a data stream's, such as the elastic
    trainer's Ray Data shard), or "" (a plain attribute)."""
    if isinstance(value, torch.nn.Module):
        return "model"
    if isinstance(value, torch.optim.Optimizer):
        return "optimizer"
    if isinstance(value, ElasticSampler):
        return "sampler"
    if isinstance(value, Position):
        return "position"
    return ""


class TorchFormat:
    """The format of a `TorchState` (`raytrain_x.elastic.commits.Format`).

    Args:
        owner: the state whose plain attributes (`names`) are committed beside `handled`.
        handled: models, optimizers, samplers and data positions by name.
        names: the plain attributes' names.
        overlap: let a CUDA commit's copy run beside the next forward and backward.
        sharded: the names of an FSDP2 model and its optimizer, whose sharded tensors are
            committed as chunks (`raytrain_x.torch.fsdp_elastic`): the tree keeps the
            model's other tensors (buffers) and the optimizer's group settings.
    """

    info = {"skeleton": durable.SKELETON_FORMAT}

    def __init__(self, owner: Any, handled: dict[str, Any], names: list[str],
                 overlap: bool, sharded: frozenset[str] = frozenset()) -> None:
        self.handled = handled
        self.names = names
        self.attributes = Attributes(owner, names, broadcast_object)
        self.fsdp = sharded
        zero = any(isinstance(v, ShardedOptimizer) for v in handled.values())
        self.layout = "fsdp" if sharded else "sharded" if zero else "unsharded"
        self._snapshots = Snapshots()
        self._unordered: Snapshot | None = None  # copies not yet ordered before a change
        # a sharded optimizer steps buckets as their reductions land, during backward
        # (an FSDP2 model's chunks are copied at the commit itself)
        self.overlap = bool(overlap) and not (sharded or zero) and self._hook_modifications()

    def _hook_modifications(self) -> bool:
        """Orders a pending commit's copy before the handled tensors' next change: every
        optimizer's step and, for a model with buffers (changed by forward), its forward.
        False (no overlap) when there is no optimizer to hook."""
        optimizers = [v for v in self.handled.values() if kind_of(v) == "optimizer"]
        if not optimizers:
            return False
        for opt in optimizers:
            opt.register_step_pre_hook(lambda *_: self.order_pending())
        for module in (v for v in self.handled.values() if kind_of(v) == "model"):
            params = {name for name, _ in module.named_parameters(remove_duplicate=False)}
            if any(name not in params for name in module.state_dict()):  # committed buffers
                module.register_forward_pre_hook(lambda *_: self.order_pending())
        return True

    def order_pending(self) -> None:
        """Makes the device wait for a commit's copy still under way (CUDA)."""
        if self._unordered is not None:
            self._unordered.order_before_modification()
            self._unordered = None

    def values(self) -> dict[str, Any]:
        return self.attributes.values()

    def tree(self) -> dict[str, Any]:
        """The live state: the modules', unsharded optimizers' and samplers' state dicts,
        the sharded optimizers' param groups (their settings: an lr scheduler changes
        them), the plain attributes."""
        handled = {}
        for name, value in self.handled.items():
            if isinstance(value, ShardedOptimizer) or name in self.fsdp and \
                    kind_of(value) == "optimizer":
                handled[name] = _group_settings(value)
            elif name in self.fsdp:
                handled[name] = _unsharded(value)
            else:
                handled[name] = value.state_dict()
        return {"handled": handled, "attributes": self.values()}

    def take(self) -> Snapshot:
        self.order_pending()
        snap = self._snapshots.take(self.tree(), order=not self.overlap)
        if self.overlap:
            self._unordered = snap
        return snap

    def load(self, tree: dict[str, Any]) -> None:
        self.order_pending()
        for name, value in self.handled.items():
            saved = tree["handled"].get(name)
            if saved is None:
                continue
            if isinstance(value, ShardedOptimizer) or name in self.fsdp and \
                    kind_of(value) == "optimizer":
                for group, settings in zip(value.param_groups, saved):
                    group.update(settings)
            elif name in self.fsdp:
                live = _unsharded(value)
                for key, tensor in saved.items():
                    live[key].copy_(tensor)
            else:
                value.load_state_dict(saved)
        self.attributes.load(tree["attributes"])

    def sync_from(self, root: int) -> None:
        self.order_pending()
        # parameters a LocalSGD or DiLoCo optimizer keeps per rank between its exchanges:
        # not broadcast with their model; each rank's reducer decides (`sync_params`)
        local = {p.data_ptr() for opt in self.handled.values() if _keeps_local(opt)
                 for p in opt._requires_update if p.numel()}
        for name, value in self.handled.items():
            kind = kind_of(value)
            if name in self.fsdp and kind == "model":  # its shards came with the re-shard
                broadcast_parameters(_unsharded(value), root_rank=root)
            elif name in self.fsdp or isinstance(value, ShardedOptimizer):
                settings = broadcast_object(_group_settings(value), root,
                                            name=f"elastic.{name}.groups")
                for group, chosen in zip(value.param_groups, settings):
                    group.update(chosen)
            elif kind == "model":
                broadcast_parameters({k: t for k, t in value.state_dict().items()
                                      if not (torch.is_tensor(t) and t.data_ptr() in local)},
                                     root_rank=root)
            elif _keeps_local(value):
                lineage = value._reducer.lineage()
                broadcast_optimizer_state(value, root_rank=root)
                if value._reducer.sync_params(lineage):  # no anchor yet: the root's
                    broadcast_parameters([(f"elastic.{name}.{i}", p) for i, p
                                          in enumerate(value._requires_update)], root)
            elif kind == "optimizer":
                broadcast_optimizer_state(value, root_rank=root)
            elif kind == "position":  # the same on every rank: the root's stands
                value.load_state_dict(broadcast_object(value.state_dict(), root,
                                                       name=f"elastic.{name}"))
            else:
                _sync_sampler(name, value, root)
        self.attributes.sync_from(root)

    def signature(self) -> dict[str, Any]:
        """Each model tensor's shape and dtype by its name, the optimizers' parameter
        counts, the attributes' names: a restore refuses a checkpoint of another. And the
        optimizer state's layout (ZeRO's shards or whole), which `check_signature` reads
        against the checkpoint's parts."""
        out: dict[str, Any] = {"layout": "fsdp" if self.fsdp else "sharded" if any(
            isinstance(v, ShardedOptimizer) for v in self.handled.values()) else "whole"}
        for name, value in self.handled.items():
            if isinstance(value, torch.nn.Module):
                for key, tensor in value.state_dict().items():
                    if isinstance(tensor, torch.Tensor):
                        out[f"{name}.{key}"] = [list(tensor.shape), str(tensor.dtype)]
            elif isinstance(value, torch.optim.Optimizer):
                out[name] = [sum(len(g["params"]) for g in value.param_groups), "parameters"]
        return {**out, **self.attributes.signature()}

    def save(self, tree: Any, folder: str) -> dict[str, list[Any]]:
        return durable.save(tree, folder)

    def read(self, part: PartFiles) -> Any:
        return durable.load(part)


def _group_settings(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each parameter group's settings (lr, betas, ...), without its parameters."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def _unsharded(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The entries of an FSDP2 model's `state_dict` that `fully_shard` does not cut (its
    buffers, parameters it left whole)."""
    from torch.distributed.tensor import DTensor

    return {k: v for k, v in model.state_dict().items()
            if torch.is_tensor(v) and not isinstance(v, DTensor)}


def _keeps_local(value: Any) -> bool:
    """A `DistributedOptimizer` whose reducer lets each rank's parameters differ between
    exchanges (LocalSGD, DiLoCo)."""
    reducer = getattr(value, "_reducer", None)
    return isinstance(value, torch.optim.Optimizer) and bool(getattr(reducer, "local_params",
                                                                       False))


def _sync_sampler(name: str, value: ElasticSampler, root: int) -> None:
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
