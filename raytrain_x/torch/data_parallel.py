"""DDP's face over raytrain-x's engine: a model whose gradients are averaged over the world
as it is now, so it follows an elastic run's changes of world where torch's
`DistributedDataParallel` (whose process group is fixed at construction) cannot.

`DataParallel(model)` is used as DDP is: the gradients are averaged by the end of
`loss.backward()`, so a plain torch optimizer steps on them; `model.module` is the model;
`no_sync()` accumulates locally; the state dict's keys start with `module.`. Underneath it
is the gradient-sync core every `DistributedOptimizer` has (`grad_sync`) with the default
allreduce reducer: gradients reduced in runs while backward produces them, fused by the
engine, moved by autotune. `WorldSampler` is `DistributedSampler` over the world as it is
at each pass over the data.

The elastic trainer gives these to a loop in place of DDP and `DistributedSampler` when it
calls `ray.train.torch.prepare_model` and `prepare_data_loader`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from raytrain_x.core import runtime
from raytrain_x.core.collectives import Average
from raytrain_x.core.process_sets import global_process_set
from raytrain_x.torch.allreduce_reducer import AllreduceReducer
from raytrain_x.torch.compression import Compression
from raytrain_x.torch.functions import broadcast_parameters
from raytrain_x.torch.grad_sync import GradientSync, wrap

__all__ = ["DataParallel", "WorldSampler", "stand_in_for_ddp"]


class _ModuleSync(GradientSync):
    """The gradient-sync core of a `DataParallel`: paused under `no_sync()`, and the
    reductions waited for at the end of each backward rather than at `step()`."""

    paused = False
    _queued = False

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if self.paused:
            return
        if not self._queued:  # the first gradient of this backward
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        super()._on_grad_ready(p)

    def _end_of_backward(self) -> None:
        self._queued = False
        self.synchronize()  # a failed world's error is raised out of backward()
        runtime.mark_step()


class DataParallel(torch.nn.Module):
    """`model` with its gradients averaged over every rank by the end of each backward.

    Takes DDP's keyword arguments: `bucket_cap_mb` (as `DistributedOptimizer`'s: fixed
    buckets of that size; None follows the fusion threshold knob) and `broadcast_buffers`
    (rank 0's buffers, such as BatchNorm's running statistics, copied to every rank before
    each forward); the rest (`device_ids`, `output_device`, `find_unused_parameters`, ...)
    are DDP's own matters and are accepted as they are. A parameter that gets no gradient in
    a backward counts as zeros. With `init_sync` (DDP's default), rank 0's parameters and
    buffers are copied to every rank here, a collective every rank must reach.
    """

    def __init__(self, module: torch.nn.Module, bucket_cap_mb: float | None = None,
                 broadcast_buffers: bool = True, init_sync: bool = True,
                 **_ddp_kwargs: Any) -> None:
        super().__init__()
        self.module = module
        self.broadcast_buffers = broadcast_buffers
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._sync: _ModuleSync | None = None
        if named:
            reducer = AllreduceReducer(Average, 1.0, Compression.none, bucket_cap_mb, None,
                                       False)
            # a torch optimizer that never steps: it carries the parameters for the core
            holder = torch.optim.SGD([p for _, p in named], lr=0.0)
            self._sync = wrap(holder, [(f"ddp.{n}", p) for n, p in named], reducer, 1,
                              global_process_set, core=_ModuleSync)
        if init_sync:
            broadcast_parameters(module.state_dict(), root_rank=0)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._sync is not None:  # a backward that raised never ran its callback
            self._sync._queued = False
        if self.broadcast_buffers and runtime.size() > 1:
            buffers = list(self.module.named_buffers())
            if buffers:
                broadcast_parameters(buffers, root_rank=0)
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate their gradients locally; the first backward
        after it averages what was accumulated (DDP's `no_sync`)."""
        if self._sync is None:
            yield
            return
        self._sync.paused = True
        try:
            yield
        finally:
            self._sync.paused = False


class WorldSampler(torch.utils.data.DistributedSampler):
    """`DistributedSampler` whose ranks are the world's as it is at each pass over the data
    (each `iter()` and `len()`), so that after an elastic change of world every rank takes
    its part of the new world. Without `num_replicas` and `rank`, it needs no torch process
    group."""

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False) -> None:
        super().__init__(dataset, num_replicas=runtime.size(), rank=runtime.rank(),
                         shuffle=shuffle, seed=seed, drop_last=drop_last)

    def _follow(self) -> None:
        if (self.num_replicas, self.rank) != (runtime.size(), runtime.rank()):
            epoch = self.epoch
            super().__init__(self.dataset, num_replicas=runtime.size(), rank=runtime.rank(),
                             shuffle=self.shuffle, seed=self.seed, drop_last=self.drop_last)
            self.epoch = epoch

    def __iter__(self) -> Iterator[Any]:
        self._follow()
        return super().__iter__()

    def __len__(self) -> int:
        self._follow()
        return self.num_samples


class _AnyDistributedSampler(type):
    """`isinstance(x, <the stand-in>)` answers as for torch's `DistributedSampler`, so a
    loader that has one already keeps it (Ray Train's `prepare_data_loader` asks)."""

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, torch.utils.data.DistributedSampler)


class _StandInSampler(WorldSampler, metaclass=_AnyDistributedSampler):
    pass


class _StandInModel(DataParallel):
    """`DataParallel` without the copy at construction: in an elastic run the model is
    built before `@rx.elastic.run`, where a worker joining a running job is alone (the
    others wait in their state's sync), and that sync gives every rank rank 0's weights."""

    def __init__(self, module: torch.nn.Module, **ddp_kwargs: Any) -> None:
        super().__init__(module, **{"init_sync": False, **ddp_kwargs})


def stand_in_for_ddp(module: Any) -> None:
    """Rebinds `module`'s `DistributedDataParallel` and `DistributedSampler` (those of Ray
    Train's `train_loop_utils`, which its `prepare_model` and `prepare_data_loader` build)
    to `DataParallel` and `WorldSampler`: in an elastic run, where the world changes in
    memory, those calls then give what follows it."""
    module.DistributedDataParallel = _StandInModel
    module.DistributedSampler = _StandInSampler
