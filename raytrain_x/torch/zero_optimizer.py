"""`DistributedOptimizer(..., zero_stage=1 | 2)`: optimizer state sharded across the ranks
(ZeRO stage 1), and the reduced gradients too (stage 2).

Each rank owns whole parameters (`zero_layout`): backward's gradients are reduce-scattered
bucket by bucket as they become ready (through the engine, fused and overlapped with
backward as the default path is), each rank steps a local instance of the user's optimizer
class (`zero_local`) on the parameters it owns, and the updated parameters are allgathered:
bucket by bucket, each bucket's step and allgather starting as soon as its reduction lands,
so that they overlap the reductions still under way. Stage 1 keeps every gradient in a flat
buffer (a parameter's `.grad` holds the reduced gradient on its owner, this rank's own
gradient elsewhere); stage 2 keeps only this rank's reduced segment, so the gradients of
the parameters it does not own are freed after each reduction.
`state_dict()` is consolidated (the full, unsharded state, as an unsharded optimizer's):
every rank of the process set must call it, as every rank calls a collective.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import torch

from raytrain_x.common.errors import ConfigError
from raytrain_x.core import runtime
from raytrain_x.core.collectives import Max, Sum, predivided, synchronize
from raytrain_x.core.objects import allgather_object
from raytrain_x.core.process_sets import ProcessSet
from raytrain_x.engine.messages import Handle
from raytrain_x.torch.async_ops import (
    allgather_into_async,
    allreduce_async_,
    reducescatter_async,
    reducescatter_into_async,
)
from raytrain_x.torch.grad_sync import GradientSync, Reducer
from raytrain_x.torch.zero_layout import PassBuffers, ShardedBucket, make_buckets
from raytrain_x.torch.zero_local import (
    IMPLEMENTATIONS,
    build_local,
    step_only,
    steps_each_parameter,
)

DEFAULT_BUCKET_MB = 25.0  # DDP's default bucket


class ZeroReducer(Reducer):
    """The sharding: buckets and owners, reduce-scatters, the local optimizer over this
    rank's parameters, allgathers. See `DistributedOptimizer(zero_stage=...)`.

    Args:
        stage: 1 or 2.
        op: `Average` or `Sum`.
        predivide: Horovod's `gradient_predivide_factor`.
        bucket_cap_mb: the buckets' size (25 MB by default).
    """

    kind = "zero"

    def __init__(self, stage: int, op: str, predivide: float,
                 bucket_cap_mb: float | None) -> None:
        self._stage = stage
        self.every_pass = stage == 2  # stage 2 reduces each backward pass on its own
        self._op = op
        self._predivide = predivide
        self._cap = int((bucket_cap_mb or DEFAULT_BUCKET_MB) * 2**20)
        self._handles: dict[ShardedBucket, Handle] = {}
        self._local: torch.optim.Optimizer | None = None

    def bind(self, core: GradientSync) -> None:
        super().bind(core)
        params = core.reduced_params
        self._prefix = core.gradient_names[params[0]] if params else ""
        self.lay_out()

    def lay_out(self) -> None:
        """Buckets and owners for the world as it is now (the parameters keep their values,
        in new flat buffers); gradients and reductions under way are dropped."""
        core = self.core
        pset = core.process_set
        core._member = pset.ranks is None or runtime.rank() in pset.ranks
        size = pset.size() if core._member else 1
        rank = pset.rank() if core._member else 0
        self._handles.clear()
        self._buckets = make_buckets(core.reduced_params, self._cap, size, rank,
                                     grads_in_place=self._stage == 1)
        self._bucket_of = {p: b for b in self._buckets for p in b.params}
        self.owned = {p for b in self._buckets for p in b.mine}
        self.owner = {p: r for b in self._buckets for r, ps in enumerate(b.owned_by)
                      for p in ps}
        if self._stage == 1:
            for bucket in self._buckets:
                bucket.attach_grads()
        self._pass_buffers = PassBuffers(self._buckets)
        for bucket in self._buckets:
            bucket.new_pass = self._pass_buffer
        self.forget()

    # ------------------------------------------------------------------ backward
    def ready(self, p: torch.Tensor) -> None:
        if p.grad is not None and p.grad.is_sparse:
            name = self.core.gradient_names[p]
            raise ConfigError(f"zero_stage={self._stage} needs dense gradients; {name!r} has a "
                              "sparse one (nn.Embedding(sparse=True)): use zero_stage=0, or a "
                              "dense embedding")
        bucket = self._bucket_of[p]
        bucket.ready += 1
        if self._stage == 1:
            bucket.attach_one(p)  # a model.zero_grad() may have made a new tensor
            if bucket.ready >= len(bucket.params):
                bucket.ready = 0
                self._handles[bucket] = self._reduce(bucket, bucket.flat_grads)
            return
        bucket.take_grad(p)
        if bucket.ready >= len(bucket.params):  # one backward pass of the whole bucket
            bucket.ready = 0
            flat = bucket.gathered_grads()  # this pass's gradients, theirs dropped
            self._finish_pending(bucket)
            self._handles[bucket] = self._reduce(bucket, flat)
            self._take_finished()

    def busy(self, p: torch.Tensor) -> bool:
        handle = self._handles.get(self._bucket_of[p])
        return handle is not None and not handle.done()

    def in_flight(self) -> bool:
        return bool(self._handles)

    def _reduce(self, bucket: ShardedBucket, flat: torch.Tensor) -> Handle:
        """Starts the reduce-scatter of a bucket's gradients. Stage 2 reduces each backward
        pass on its own and sums the passes' results into the shard: the same as reducing
        the accumulated gradients, the reduction being linear."""
        pset = self.core.process_set
        op, pre, post = predivided(self._op, self._predivide, pset.size())
        name = f"zero.{self._prefix}.rs{bucket.index}"
        # a bucket's reduction starts once the one before it has landed (none is in flight
        # here): with none landed this step, this is the first pass, straight into the shard
        if self._stage == 2 and bucket.reduced_passes == 0:
            return reducescatter_into_async(flat, bucket.shard_out, name, op, pset, pre, post)
        return reducescatter_async(flat, name=name, op=op, process_set=pset,
                                   prescale_factor=pre, postscale_factor=post)

    def _pass_buffer(self, bucket: ShardedBucket) -> torch.Tensor:
        """Stage 2: a buffer for this pass of `bucket`'s gradients; while every one is lent,
        the oldest reduction under way is waited for and gives its own back."""
        while (buffer := self._pass_buffers.take(bucket)) is None:
            waiting = [b for b, _, _ in self._pass_buffers.lent if b in self._handles]
            if not waiting:  # every buffer is filling (gradients out of bucket order)
                return self._pass_buffers.take(bucket, beyond_count=True)
            self._finish_pending(waiting[0])
        return buffer

    def _finish_pending(self, bucket: ShardedBucket) -> None:
        """Stage 2: a reduction of an earlier pass of this bucket, into its shard."""
        handle = self._handles.pop(bucket, None)
        if handle is not None:
            self._take(bucket, synchronize(handle))

    def _take_finished(self) -> None:
        """Stage 2: the reductions already done, into their shards, so that their pass
        buffers are freed during backward rather than all at `synchronize()`."""
        for bucket, handle in list(self._handles.items()):
            if handle.done():
                self._finish_pending(bucket)

    def _take(self, bucket: ShardedBucket, reduced: torch.Tensor) -> None:
        """This rank's reduced segment of a bucket, into the owned parameters' gradients."""
        if self._stage == 1:
            start = bucket.rank * bucket.shard
            bucket.flat_grads[start:start + bucket.shard].copy_(reduced)
            return
        owned = reduced[:bucket.owned_numel]  # the segment's padding is not kept
        if bucket.reduced_passes == 0:
            if reduced.data_ptr() != bucket.shard_out.data_ptr():  # another route
                bucket.shard_grads.copy_(owned)
        else:
            bucket.shard_grads.add_(owned)
        bucket.reduced_passes += 1
        self._pass_buffers.give_back(bucket)

    # ------------------------------------------------------------------ step
    def synchronize(self) -> None:
        """Waits for every bucket's reduction (starting those whose gradients did not all
        come: a parameter without a gradient counts as zeros, as in Horovod)."""
        self._start_remaining()
        for bucket, handle in list(self._handles.items()):
            self._take(bucket, synchronize(handle))
        if self._stage == 2:  # the owned gradients are the reduced ones now
            for bucket in self._buckets:
                bucket.point_owned_grads()

    def _start_remaining(self) -> None:
        """Every rank reduces every bucket every step (a gradient that did not come is
        zeros, as Horovod sends): the ranks' collectives must match."""
        for bucket in self._buckets:
            if bucket in self._handles:
                continue
            if self._stage == 1:
                bucket.attach_grads()
                self._handles[bucket] = self._reduce(bucket, bucket.flat_grads)
            elif bucket.ready or not bucket.reduced_passes:
                self._handles[bucket] = self._reduce(bucket, bucket.gathered_grads())

    def forget(self) -> None:
        self._handles.clear()
        self._pass_buffers.forget_lent()  # none, unless a reduction failed
        for bucket in self._buckets:
            bucket.ready = 0

    def step(self, closure: Callable[[], Any] | None, synchronize: bool) -> Any:
        loss = closure() if closure is not None else None
        core = self.core
        local = self.local_optimizer()
        if core._synchronized or not steps_each_parameter(type(local)):
            if not core._synchronized:
                core.synchronize()
            self._new_passes()
            local.step()
            gathers = [self._gather(b) for b in self._buckets]
        else:
            gathers = self._step_as_reductions_land(local)
        self._finish_gathers(gathers)
        return loss

    def _new_passes(self) -> None:
        for bucket in self._buckets:
            bucket.reduced_passes = 0  # the next step's first pass overwrites the shard

    def _step_as_reductions_land(self, local: torch.optim.Optimizer) -> list[Handle]:
        """Steps each bucket's own parameters as soon as its reduction lands and starts
        their allgather then, so that the step of one bucket and the allgather of another
        overlap the reductions still under way (for an optimizer that updates each
        parameter on its own: every one of torch's but LBFGS)."""
        gathers = []
        try:
            self._start_remaining()
            for bucket in self._buckets:  # the order their reductions started in
                handle = self._handles.pop(bucket, None)
                if handle is not None:
                    self._take(bucket, synchronize(handle))
                if self._stage == 2:
                    bucket.point_owned_grads()
                bucket.reduced_passes = 0
                step_only(local, bucket.mine)
                gathers.append(self._gather(bucket))
        finally:
            self.core._forget()
        return gathers

    def _gather(self, bucket: ShardedBucket) -> Handle:
        """Starts the allgather of a bucket's updated parameters straight into its flat
        buffer (no gathered copy)."""
        return allgather_into_async(bucket.my_params_segment(), bucket.flat_params,
                                    name=f"zero.{self._prefix}.ag{bucket.index}",
                                    process_set=self.core.process_set)

    def _finish_gathers(self, handles: list[Handle]) -> None:
        with torch.no_grad():
            for bucket, handle in zip(self._buckets, handles):
                gathered = synchronize(handle)
                if gathered.data_ptr() != bucket.flat_params.data_ptr():  # another route
                    bucket.flat_params.copy_(gathered)

    def local_optimizer(self) -> torch.optim.Optimizer:
        """An instance of the user's optimizer class over the parameters this rank owns,
        its groups' settings taken from the full groups (an lr scheduler changes those)."""
        core = self.core
        if self._local is None:
            groups = [{**settings, "params": [p for p in g["params"] if p in self.owned]}
                      for settings, g in zip(core.group_settings(), core.param_groups)]
            cls = next(c for c in type(core).__mro__
                       if issubclass(c, torch.optim.Optimizer)
                       and not issubclass(c, GradientSync))
            self._local = build_local(cls, groups, core.defaults)
            self._local.state.update({p: core.state.pop(p) for p in list(core.state)
                                      if p in self.owned})
            core.state.clear()
        for full, local in zip(core.param_groups, self._local.param_groups):
            for key, value in full.items():
                if key not in ("params", *IMPLEMENTATIONS):
                    local[key] = value
        return self._local

    def local_state(self) -> dict:
        """The optimizer state of this rank's parameters, wherever it is kept now."""
        return self._local.state if self._local is not None else self.core.state

    def zero_grad(self, set_to_none: bool) -> bool:
        for bucket in self._buckets:
            if not set_to_none:  # zeros in place, as torch's zero_grad(set_to_none=False)
                (bucket.flat_grads if self._stage == 1 else bucket.shard_grads).zero_()
            if self._stage == 1 and not set_to_none:
                bucket.attach_grads()
                continue
            # no gradients: backward's first one of each parameter is copied into its
            # place (stage 1) or its pass's buffer (stage 2), not added to zeros there
            for p in bucket.params:
                p.grad = None
        return True


class ShardedOptimizer(GradientSync):
    """`DistributedOptimizer(zero_stage=1 | 2)`: the gradient-sync core with `ZeroReducer`,
    the full state in `state_dict()`, and what elastic training re-shards through
    (`raytrain_x.torch.zero_elastic`)."""

    _reducer: ZeroReducer

    @property
    def zero_stage(self) -> int:
        """1 (the optimizer state sharded) or 2 (the reduced gradients too)."""
        return self._reducer._stage

    # ------------------------------------------------------------------ elastic
    def _indexed(self) -> list[torch.Tensor]:
        """The parameters in `state_dict()`'s order (its state's keys are these indices)."""
        return [p for g in self.param_groups for p in g["params"]]

    def parameter_name(self, index: int) -> str:
        """The name (`named_parameters`) of the parameter at `index` in `state_dict()`."""
        return self.gradient_names[self._indexed()[index]]

    def group_settings(self) -> list[dict[str, Any]]:
        """Each parameter group's settings (lr, betas, ...), without its parameters."""
        return [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]

    def shard_state(self) -> dict[int, dict[str, Any]]:
        """This rank's optimizer state, by parameter index, copied to host memory."""
        local = self._reducer.local_state()
        owned = self._reducer.owned
        return {i: {k: (v.detach().to("cpu", copy=True) if torch.is_tensor(v)
                        else copy.deepcopy(v)) for k, v in local[p].items()}
                for i, p in enumerate(self._indexed()) if p in owned and p in local}

    def owners_by_index(self) -> dict[int, int]:
        """Which rank of the process set owns each parameter (by index) in this layout."""
        owner = self._reducer.owner
        return {i: owner[p] for i, p in enumerate(self._indexed()) if p in owner}

    def reshard(self) -> None:
        """After an elastic reset: the layout for the new world, with no optimizer state
        until `load_shard_state` gives this rank its own."""
        self._reducer.lay_out()
        self._reducer._local = None
        self.state.clear()
        self._forget()

    def load_shard_state(self, states: dict[int, dict[str, Any]]) -> None:
        """`states` (by parameter index: those of the parameters this rank owns in this
        layout) as this rank's optimizer state."""
        owned = self._reducer.owned
        for i, p in enumerate(self._indexed()):
            if i in states and p in owned:
                self.state[p] = {k: (v.to(p.device) if torch.is_tensor(v) and k != "step"
                                     else v) for k, v in states[i].items()}

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The full, unsharded state (every rank of the process set calls it)."""
        index = {p: i for i, p in enumerate(self._indexed())}
        mine = {index[p]: {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in s.items()}
                for p, s in self._reducer.local_state().items() if p in index}
        every = (allgather_object(mine, name=f"zero.{self._reducer._prefix}.state",
                                  process_set=self.process_set)
                 if self._member else [mine])
        state: dict[int, Any] = {}
        for part in every:
            state.update(part)
        groups = [{**settings, "params": [index[p] for p in g["params"]]}
                  for settings, g in zip(self.group_settings(), self.param_groups)]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Takes a full state (an unsharded optimizer's, or `state_dict()`'s); this rank
        keeps the state of the parameters it owns."""
        super().load_state_dict(state_dict)  # the groups' settings, and every state
        owned = self._reducer.owned
        local = self._reducer._local
        if local is not None:
            owned_state = {p: s for p, s in self.state.items() if p in owned}
            local.state.clear()
            local.state.update(owned_state)
            self.state.clear()
        else:
            for p in [p for p in self.state if p not in owned]:
                del self.state[p]

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips the reduced gradients by their total norm over every parameter, as
        `torch.nn.utils.clip_grad_norm_` would on unsharded ones (each rank holds only its
        own parameters' reduced gradients, so the norm is summed across the set). Call it
        after `synchronize()`, inside `with optimizer.skip_synchronize():`.

        Args:
            max_norm: the largest total norm allowed.
            norm_type: the p of the p-norm (`inf` for the largest absolute value).
        """
        grads = [p.grad for p in self._reducer.owned if p.grad is not None]
        return clip_by_total_norm(grads, max_norm, norm_type,
                                  f"zero.{self._reducer._prefix}.norm", self.process_set)


def clip_by_total_norm(grads: list[torch.Tensor], max_norm: float, norm_type: float,
                       name: str, process_set: ProcessSet) -> torch.Tensor:
    """Scales `grads` (this rank's share of all the gradients) so that the norm over every
    rank's share is at most `max_norm`; returns that total norm."""
    if norm_type == math.inf:
        local = max((float(g.abs().max()) for g in grads), default=0.0)
        total = synchronize(allreduce_async_(torch.tensor([local], dtype=torch.float64),
                                             name=name, op=Max, process_set=process_set))[0]
    else:
        local = sum(float((g.double().abs() ** norm_type).sum()) for g in grads)
        summed = synchronize(allreduce_async_(torch.tensor([local], dtype=torch.float64),
                                              name=name, op=Sum, process_set=process_set))[0]
        total = summed ** (1.0 / norm_type)
    scale = max_norm / (float(total) + 1e-6)
    if scale < 1.0:
        for g in grads:
            g.mul_(scale)
    return torch.tensor(float(total))
