"""How a sharded `DistributedOptimizer` (`zero_stage` 1 or 2) lays its parameters out.

The parameters that need gradients go into buckets (one dtype and device each, in reverse
registration order: roughly the order backward produces their gradients, as DDP's). Each
parameter is owned, whole, by one rank of the process set, so that any torch optimizer
steps the parameters a rank owns exactly as it would step them unsharded. A bucket is one
flat buffer of `size * shard` elements: rank r's parameters, back to back, fill segment r,
padded to the longest rank's. So each bucket is shared out on its own (the largest
parameter first, each to the rank with the fewest elements in the bucket, ties to the one
with the fewest overall), and a bucket closes once it holds the cap and its shares are
within `SLACK` of even: whole parameters of a few sizes rarely split evenly at a fixed
cap (a GPT's buckets were padded to 1.36x-1.9x their parameters when ownership was
balanced over the whole model instead). So a reduce-scatter of the bucket's
gradients gives each rank the reduced gradients of its own parameters, and an allgather of
each rank's segment of the parameters puts every updated parameter in its place on every
rank. Stage 2 keeps only the reduced gradients of the parameters a rank owns, packed (the
padding is not kept).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# A bucket's padding (the longest share times the ranks, over its elements) at most this
# much over even; a bucket that cannot get there closes at STRETCH times the cap.
SLACK = 0.02
STRETCH = 4


def _shares(params: list[torch.Tensor], size: int,
            load: list[int]) -> tuple[dict[int, int], list[int]]:
    """Owners (by id) of one bucket's parameters, the largest first, each to the rank with
    the fewest elements in the bucket (ties: the fewest over the buckets before, `load`,
    then the lowest rank); and each rank's elements in the bucket."""
    mine = [0] * size
    owner: dict[int, int] = {}
    for p in sorted(params, key=lambda p: -p.numel()):
        rank = min(range(size), key=lambda r: (mine[r], load[r], r))
        owner[id(p)] = rank
        mine[rank] += p.numel()
    return owner, mine


def plan_buckets(params: list[torch.Tensor], cap_bytes: int,
                 size: int) -> list[tuple[list[torch.Tensor], dict[int, int]]]:
    """The buckets of `params` in backward order, each with its parameters' owners (see the
    module's docstring)."""
    load = [0] * size
    plans: list[tuple[list[torch.Tensor], dict[int, int]]] = []
    current: list[torch.Tensor] = []

    def close() -> None:
        owner, mine = _shares(current, size, load)
        for r in range(size):
            load[r] += mine[r]
        plans.append((list(current), owner))
        current.clear()

    for p in reversed(params):
        if current and (p.dtype != current[0].dtype or p.device != current[0].device):
            close()
        current.append(p)
        nbytes = sum(q.numel() for q in current) * p.element_size()
        if nbytes >= cap_bytes:
            total = nbytes // p.element_size()
            longest = max(_shares(current, size, load)[1])
            if longest * size - total <= SLACK * total or nbytes >= STRETCH * cap_bytes:
                close()
    if current:
        close()
    _merge_uneven_tail(plans, size)
    return plans


def _padding(params: list[torch.Tensor], size: int) -> float:
    total = sum(p.numel() for p in params)
    return max(_shares(params, size, [0] * size)[1]) * size / max(1, total) - 1


def _merge_uneven_tail(plans: list[tuple[list[torch.Tensor], dict[int, int]]],
                       size: int) -> None:
    """The last bucket (the first layers', often one embedding) closed short of the cap and
    cannot take more: joined to the bucket before when that pads less."""
    if len(plans) < 2 or _padding(plans[-1][0], size) <= SLACK:
        return
    (before, _), (last, _) = plans[-2], plans[-1]
    if before[0].dtype != last[0].dtype or before[0].device != last[0].device:
        return
    joined = before + last
    apart = sum(p.numel() for p in before) * _padding(before, size) + \
        sum(p.numel() for p in last) * _padding(last, size)
    if sum(p.numel() for p in joined) * _padding(joined, size) < apart:
        del plans[-2:]
        plans.append((joined, _shares(joined, size, _loads(plans, size))[0]))


def _loads(plans: list[tuple[list[torch.Tensor], dict[int, int]]], size: int) -> list[int]:
    load = [0] * size
    for group, owner in plans:
        for p in group:
            load[owner[id(p)]] += p.numel()
    return load


class ShardedBucket:
    """One bucket: its parameters' data and gradients as views into two flat buffers laid
    out rank by rank (see the module's docstring)."""

    def __init__(self, index: int, params: list[torch.Tensor], size: int, rank: int,
                 grads_in_place: bool, owner: dict[int, int]) -> None:
        self.index = index
        self.params = params
        self.owned_by = [[p for p in params if owner[id(p)] == r] for r in range(size)]
        self.mine = self.owned_by[rank]
        self.shard = max(1, max(sum(p.numel() for p in ps) for ps in self.owned_by))
        self.size, self.rank = size, rank
        first = params[0]
        self.offsets: dict[torch.Tensor, int] = {}
        # each segment's tail past its parameters (segments are padded to the longest)
        self.padding: list[tuple[int, int]] = []
        for r, ps in enumerate(self.owned_by):
            offset = r * self.shard
            for p in ps:
                self.offsets[p] = offset
                offset += p.numel()
            self.padding.append((offset, (r + 1) * self.shard))
        # the parameters' data lives in the flat buffer from now on (their values kept)
        self.flat_params = torch.zeros(size * self.shard, dtype=first.dtype,
                                       device=first.device)
        with torch.no_grad():
            for p in params:
                view = self.view(self.flat_params, p)
                view.copy_(p.detach())
                p.data = view
        # stage 1 keeps every gradient in a flat buffer of the same layout; stage 2 keeps
        # only this rank's segment (the reduced gradients of its own parameters)
        self.flat_grads = (torch.zeros_like(self.flat_params) if grads_in_place else None)
        self.owned_numel = sum(p.numel() for p in self.mine)
        # stage 2: this rank's reduced segment, padding and all, so that a reduce-scatter
        # writes the first pass of a step straight into it; the owned part is the gradient
        self.shard_out = (None if grads_in_place else
                          torch.zeros(self.shard, dtype=first.dtype, device=first.device))
        self.shard_grads = (None if grads_in_place else self.shard_out[:self.owned_numel])
        self.pass_grads: torch.Tensor | None = None  # stage 2: this pass's, until reduced
        # stage 2: a buffer for a pass (`PassBuffers.take`, set by the optimizer)
        self.new_pass: Callable[[ShardedBucket], torch.Tensor] = \
            lambda bucket: torch.empty_like(bucket.flat_params)
        self.unfilled: set[torch.Tensor] = set()  # stage 2: not yet in this pass's buffer
        self.ready = 0  # gradients (times backward passes) ready since the last reduction
        self.reduced_passes = 0  # stage 2: passes already reduced into shard_grads

    def view(self, flat: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """`p`'s place in a buffer of the bucket's layout."""
        offset = self.offsets[p]
        return flat[offset:offset + p.numel()].view_as(p)

    def shard_view(self, p: torch.Tensor) -> torch.Tensor:
        """An owned parameter's place in this rank's segment."""
        offset = self.offsets[p] - self.rank * self.shard
        return self.shard_grads[offset:offset + p.numel()].view_as(p)

    def my_params_segment(self) -> torch.Tensor:
        return self.flat_params[self.rank * self.shard:(self.rank + 1) * self.shard]

    def attach_grads(self) -> None:
        """Stage 1: every parameter's `.grad` is its view of the flat gradient buffer
        (autograd then accumulates in place)."""
        for p in self.params:
            self.attach_one(p)

    def attach_one(self, p: torch.Tensor) -> None:
        """Stage 1: `p.grad` back to its view (after a `model.zero_grad()` set it to None
        and backward made a new tensor), keeping the gradient's value; no gradient at all
        this step is zeros, as Horovod sends."""
        grad = p.grad
        view = self.view(self.flat_grads, p)  # a new tensor object each call: compare memory
        if grad is not None and grad.data_ptr() == view.data_ptr() and grad.shape == p.shape:
            return  # already its view
        if grad is not None:
            view.copy_(grad)
        else:
            view.zero_()
        p.grad = view

    def take_grad(self, p: torch.Tensor) -> None:
        """Stage 2: `p`'s gradient of this backward pass, copied into the bucket's buffer for
        the pass as soon as it is ready and dropped, so that a pass holds one bucket's
        gradients at a time, not every parameter's."""
        if self.pass_grads is None:
            self._begin_pass()
        if p.grad is not None:
            self.view(self.pass_grads, p).copy_(p.grad)
            self.unfilled.discard(p)
            p.grad = None

    def gathered_grads(self) -> torch.Tensor:
        """Stage 2: this pass's buffer, handed over (zeros for a parameter without a
        gradient), with any gradient still on a parameter copied in and dropped."""
        for p in self.params:
            if p.grad is not None:
                self.take_grad(p)
        if self.pass_grads is None:
            self._begin_pass()
        flat = self.pass_grads
        for p in self.unfilled:  # no gradient this pass: zeros, as Horovod sends
            self.view(flat, p).zero_()
        for lo, hi in self.padding:
            flat[lo:hi].zero_()
        self.pass_grads, self.unfilled = None, set()
        return flat

    def _begin_pass(self) -> None:
        # not zeroed: every gradient overwrites its place, and `gathered_grads` zeroes the
        # rest (a fresh zeroed buffer each pass cost a stage 2 step 4% on a CPU)
        self.pass_grads = self.new_pass(self)
        self.unfilled = set(self.params)

    def point_owned_grads(self) -> None:
        """Each owned parameter's `.grad` is its view of this rank's reduced segment."""
        for p in self.mine:
            p.grad = self.shard_view(p)


class PassBuffers:
    """Stage 2's buffers for one backward pass of a bucket's gradients, from its first
    gradient until its reduction lands: `count` of them for each dtype and device, each as
    large as the largest bucket, kept from step to step (one filling while another is
    reduced, as DeepSpeed's double-buffered reduction), in host memory: there a fresh
    buffer for every bucket and pass left the memory freed behind them resident, so that
    stage 2 peaked as high as stage 0. On a GPU torch's caching allocator reuses freed
    blocks without that cost, and kept buffers would outlive backward: each pass takes a
    fresh one there."""

    def __init__(self, buckets: list[ShardedBucket], count: int = 2) -> None:
        self.count = count
        self.numel: dict[tuple, int] = {}
        for b in buckets:
            key = _key(b)
            self.numel[key] = max(self.numel.get(key, 0), b.flat_params.numel())
        self.free: dict[tuple, list[torch.Tensor]] = {key: [] for key in self.numel}
        # (bucket, buffer, kept), the oldest first; an extra one is not kept
        self.lent: list[tuple[ShardedBucket, torch.Tensor, bool]] = []

    def take(self, bucket: ShardedBucket, beyond_count: bool = False) -> torch.Tensor | None:
        """A buffer for `bucket` (its first `flat_params.numel()` elements), or None while
        `count` are lent (unless `beyond_count`: then one more, not kept)."""
        key = _key(bucket)
        if key[1].type != "cpu":
            return torch.empty(bucket.flat_params.numel(), dtype=key[0], device=key[1])
        kept = len(self.free[key]) + sum(1 for b, _, k in self.lent if k and _key(b) == key)
        if self.free[key]:
            base, keep = self.free[key].pop(), True
        elif kept < self.count or beyond_count:
            base = torch.empty(self.numel[key], dtype=key[0], device=key[1])
            keep = kept < self.count
        else:
            return None
        self.lent.append((bucket, base, keep))
        return base[:bucket.flat_params.numel()]

    def give_back(self, bucket: ShardedBucket) -> None:
        """The oldest buffer lent to `bucket`, once its reduction has landed."""
        for i, (b, base, keep) in enumerate(self.lent):
            if b is bucket:
                del self.lent[i]
                if keep:
                    self.free[_key(b)].append(base)
                return

    def forget_lent(self) -> None:
        """After reductions were dropped (an error, an elastic reset): their buffers are
        left to them (new ones are made in their place)."""
        self.lent.clear()


def _key(bucket: ShardedBucket) -> tuple:
    return bucket.flat_params.dtype, bucket.flat_params.device


def make_buckets(params: list[torch.Tensor], cap_bytes: int, size: int, rank: int,
                 grads_in_place: bool) -> list[ShardedBucket]:
    """The buckets of `params` as `plan_buckets` lays them out."""
    return [ShardedBucket(i, group, size, rank, grads_in_place, owner)
            for i, (group, owner) in enumerate(plan_buckets(params, cap_bytes, size))]
