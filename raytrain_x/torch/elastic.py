"""`rx.elastic`: elastic training for PyTorch (Horovod's `hvd.elastic`)."""

from __future__ import annotations

import sys
from typing import Any

import torch

from raytrain_x.common.checkpoint_config import CheckpointConfig, from_env
from raytrain_x.common.errors import ConfigError
from raytrain_x.core.process_sets import global_process_set
from raytrain_x.core.runtime import rank
from raytrain_x.elastic.commits import CommitManager
from raytrain_x.elastic.state import (
    ObjectState,
    State,
    check_attribute_names,
    restore_count,
    run,
)
from raytrain_x.torch import elastic_sampler as sampler
from raytrain_x.torch import fsdp
from raytrain_x.torch.elastic_sampler import ElasticSampler
from raytrain_x.torch.fsdp_elastic import FSDPCommits
from raytrain_x.torch.functions import broadcast_object
from raytrain_x.torch.global_batch import GlobalBatch
from raytrain_x.torch.mesh import is_peer_failure
from raytrain_x.torch.state_format import TorchFormat, kind_of
from raytrain_x.torch.zero_elastic import ShardedCommits
from raytrain_x.torch.zero_optimizer import ShardedOptimizer


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
        commit_in_background: with a model sharded by `fully_shard`, each commit's
            copies travel to their peers while training goes on, and the commit is taken
            up at the next one: `commit()` returns after the copy to host memory, and a
            worker lost before the next commit may take the job back to the commit
            before it (where its copies had not landed). Off by default: a commit is
            kept by its peers when `commit()` returns.
        **kwargs: more modules, optimizers, samplers or data positions (by any name: a
            GAN's two models; the elastic trainer's `ray.train.get_dataset_shard(...)`), and
            plain attributes (epoch, batch, ...), as in `ObjectState`.
    """

    def __init__(self, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, replicas: int = 1,
                 checkpoint: CheckpointConfig | None = None, overlap_commits: bool = True,
                 commit_in_background: bool = False, **kwargs: Any) -> None:
        check_attribute_names(type(self), kwargs)
        self.model = model
        self.optimizer = optimizer
        handled = {"model": model, "optimizer": optimizer,
                   **{k: v for k, v in kwargs.items() if kind_of(v)}}
        handled = {k: v for k, v in handled.items() if v is not None}
        for name, value in handled.items():
            setattr(self, name, value)
        sharded = {k: v for k, v in handled.items() if isinstance(v, ShardedOptimizer)}
        self._shards: ShardedCommits | FSDPCommits | None = None
        fsdp_names = _fsdp_pair(handled, sharded)
        if fsdp_names:
            _check_replicas(replicas, minimum=0)
            model_name, *opt_name = sorted(fsdp_names, key=lambda n: kind_of(handled[n]))
            self._shards = FSDPCommits(handled[model_name],
                                       handled[opt_name[0]] if opt_name else None, replicas,
                                       background=bool(commit_in_background))
        elif commit_in_background:
            raise ConfigError("commit_in_background applies to a model sharded by "
                              "fully_shard (FSDP2); this TorchState holds none: leave it "
                              "out")
        elif sharded:
            _check_replicas(replicas, minimum=1)
            for name, opt in sharded.items():
                if opt.process_set is not global_process_set:
                    raise ConfigError(f"elastic training re-shards {name!r} over the whole "
                                      "world: build it without a process_set")
            self._shards = ShardedCommits(sharded, replicas)
        self._config = checkpoint.named(None) if checkpoint else from_env()
        plain = {k: v for k, v in kwargs.items() if k not in handled}
        self._format = TorchFormat(self, handled, list(plain), overlap_commits,
                                   frozenset(fsdp_names))
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **plain)

    def _commit_manager(self) -> CommitManager:
        return CommitManager(self._format, broadcast_object, self._config, self._shards)

    def peer_failed(self, exc: BaseException) -> bool:
        """A lost peer as torch's process group reports it, under an FSDP2 model."""
        return isinstance(self._shards, FSDPCommits) and is_peer_failure(exc)


def _check_replicas(replicas: Any, minimum: int) -> None:
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < minimum:
        raise ConfigError(f"replicas must be an int >= {minimum} (peers keeping a copy of "
                          f"each rank's shard), got {replicas!r}")


def _fsdp_pair(handled: dict[str, Any], zero: dict[str, Any]) -> set[str]:
    """The names of the model sharded by `fully_shard` and of the optimizer of its
    parameters (where one is given); empty without such a model.

    Raises:
        ConfigError: more than one FSDP2 model or optimizer of it, or a ZeRO optimizer
            beside it.
    """
    models = [k for k, v in handled.items() if kind_of(v) == "model" and fsdp.is_sharded(v)]
    if not models:
        return set()
    if len(models) > 1:
        raise ConfigError(f"TorchState holds one model sharded by fully_shard; got {models}: "
                          "wrap them in one module, or give each its own state")
    if zero:
        raise ConfigError(f"{sorted(zero)} shard the optimizer state of a model that "
                          "fully_shard shards already: give the FSDP2 model a plain torch "
                          "optimizer (AdamW, ...), not DistributedOptimizer(zero_stage=...)")
    params = {id(p) for p in handled[models[0]].parameters()}
    optimizers = [k for k, v in handled.items() if kind_of(v) == "optimizer" and any(
        id(p) in params for g in v.param_groups for p in g["params"])]
    if len(optimizers) > 1:
        raise ConfigError(f"{optimizers} both step the FSDP2 model's parameters; give "
                          "TorchState the one optimizer of them")
    return {models[0], *optimizers}


__all__ = ["CheckpointConfig", "ElasticSampler", "GlobalBatch", "ObjectState", "State",
           "TorchState", "restore_count", "run"]

# Horovod's module path `horovod.torch.elastic.sampler` (this module is not a package)
sys.modules[__name__ + ".sampler"] = sampler
