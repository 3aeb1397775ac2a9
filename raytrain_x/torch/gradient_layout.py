"""Where a `DistributedOptimizer`'s gradients live: views into persistent flat buffers.

By default every gradient is a view into one flat buffer per dtype and device (an arena),
laid out in the order backward produces the gradients; each gradient goes to the engine on
its own, and a batch the engine fuses lies back to back, so it is reduced where it lies.
`bucket_cap_mb` or `groups` make fixed buckets instead (DDP's way): each bucket is one
collective when its last gradient is ready.
"""

from __future__ import annotations

from typing import Any

import torch

from raytrain_x.common.errors import ConfigError

_UNCAPPED = 2**62  # one buffer per run of a dtype and device


class GradientBuffer:
    """Parameters whose gradients are views into one persistent flat buffer (a bucket,
    reduced as one collective, or an arena, whose gradients go one by one)."""

    def __init__(self, index: int, params: list[torch.Tensor]) -> None:
        self.name = f"grad.bucket{index}"
        self.params = params
        first = params[0]
        numel = sum(p.numel() for p in params)
        # every view is overwritten by attach() when each parameter has a gradient already
        # (a rebuild); only a first build needs zeros
        fill = torch.empty if all(p.grad is not None for p in params) else torch.zeros
        self.flat = fill(numel, dtype=first.dtype, device=first.device)
        self.views: dict[torch.Tensor, torch.Tensor] = {}
        offset = 0
        for p in params:
            self.views[p] = self.flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        self.attach()  # copies each existing gradient into its view
        self.ready = 0  # gradients (times backward passes) ready since its last collective

    def release(self) -> None:
        """Drops the buffer (its parameters' gradients have moved elsewhere)."""
        self.views = {}
        self.flat = self.flat.new_empty(0)

    def attach(self) -> None:
        """Points every parameter's `.grad` at its view (autograd then accumulates in place)."""
        for p in self.views:
            self.attach_one(p)

    def attach_zeroed(self, p: torch.Tensor) -> None:
        """Points `p.grad` at its view, zeroed: backward is about to add its gradient."""
        view = self.views[p]
        view.zero_()
        p.grad = view

    def attach_one(self, p: torch.Tensor) -> None:
        """Points `p.grad` back at its view (after a `model.zero_grad()` set it to None
        and backward made a new tensor), keeping the gradient's value."""
        view = self.views[p]
        if p.grad is not view:
            if p.grad is not None:
                view.copy_(p.grad)
            p.grad = view


def bucket_groups(params: list[torch.Tensor], cap_bytes: int) -> list[list[torch.Tensor]]:
    """Parameters grouped into buckets in reverse registration order (roughly the order
    backward produces grads), one dtype and device each, up to `cap_bytes`."""
    groups: list[list[torch.Tensor]] = []
    current: list[torch.Tensor] = []
    size = 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if current and (size + nbytes > cap_bytes or p.dtype != current[0].dtype
                        or p.device != current[0].device):
            groups.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        groups.append(current)
    return groups


def explicit_groups(groups: Any, params: list[torch.Tensor]) -> list[list[torch.Tensor]] | None:
    """Horovod's `groups=`: an int k (k buckets of about equal parameter count, in reverse
    registration order) or lists of parameters (one bucket each; the others alone)."""
    if groups is None or groups == 0:
        return None
    ordered = list(reversed(params))
    if isinstance(groups, int):
        if groups < 0:
            raise ConfigError(f"groups must be >= 0, got {groups}")
        k = min(groups, len(ordered)) or 1
        per = -(-len(ordered) // k)
        return [ordered[i:i + per] for i in range(0, len(ordered), per)]
    chosen: list[list[torch.Tensor]] = []
    seen: set[int] = set()
    wanted = {id(p) for p in params}
    for group in groups:
        group = list(group)
        if not all(isinstance(p, torch.Tensor) and id(p) in wanted for p in group):
            raise ConfigError("groups= lists must hold the optimizer's parameters "
                              "(that require gradients)")
        if any(id(p) in seen for p in group):
            raise ConfigError("a parameter appears in two groups= lists")
        seen.update(id(p) for p in group)
        chosen.append(group)
    return chosen + [[p] for p in ordered if id(p) not in seen]


class GradientLayout:
    """The buffers of one optimizer's dense gradients: fixed buckets (`groups`, or a
    `cap_bytes` > 0) or arenas, laid out again in the order backward really produces the
    gradients once the first steps have shown it."""

    def __init__(self, params: list[torch.Tensor],
                 groups: list[list[torch.Tensor]] | None) -> None:
        self.params = params  # those that require gradients, in registration order
        self.groups = groups
        self.sparse: set[torch.Tensor] = set()  # parameters whose gradients come sparse
        self.buckets: list[GradientBuffer] = []
        self.bucket_of: dict[torch.Tensor, GradientBuffer] = {}
        self.arenas: list[GradientBuffer] = []
        self.arena_of: dict[torch.Tensor, GradientBuffer] = {}
        self.order: list[torch.Tensor] = []  # gradients in the order their hooks ran
        self.relaid = False  # the arenas follow the order backward produced them in
        self.cap_bytes = -1

    @property
    def fixed(self) -> bool:
        """The user fixed the buckets (`groups`, or `bucket_cap_mb` > 0)."""
        return self.groups is not None or self.cap_bytes > 0

    def buffers(self) -> tuple[GradientBuffer, ...]:
        return (*self.buckets, *self.arenas)

    def holds_all(self) -> bool:
        """Every gradient is a view of a buffer (none is sparse)."""
        return len(self.bucket_of) + len(self.arena_of) == len(self.params)

    def build(self, cap_bytes: int, order: list[torch.Tensor] | None = None) -> None:
        """Lays the gradients out in buckets of `cap_bytes` (0: in arenas, in `order` or
        in reverse registration order), keeping their values. Old buffers are freed as soon
        as their last gradient has moved, so a rebuild holds at most about one old and one
        new buffer beyond the gradients themselves."""
        old_of = {**self.bucket_of, **self.arena_of}
        left = {b: len(b.params) for b in self.buffers()}
        dense = [p for p in self.params if p not in self.sparse]
        arenas: list[list[torch.Tensor]] = []
        if self.groups is not None:
            groups = [g for group in self.groups
                      for g in bucket_groups([p for p in group if p not in self.sparse],
                                             _UNCAPPED)]
        elif cap_bytes > 0:
            groups = bucket_groups(dense, cap_bytes)
        else:
            groups = []
            if order is not None:  # the observed order first, anything it missed after
                seen = set(order)
                kept = set(dense)
                dense = [*(p for p in reversed(dense) if p not in seen),
                         *reversed([p for p in order if p in kept])]
            arenas = bucket_groups(dense, _UNCAPPED)
        self.buckets, self.bucket_of = [], {}
        self.arenas, self.arena_of = [], {}
        for layout, of, params_lists in ((self.buckets, self.bucket_of, groups),
                                         (self.arenas, self.arena_of, arenas)):
            for params in params_lists:
                buffer = GradientBuffer(len(layout), params)  # copies each gradient in
                layout.append(buffer)
                for p in params:
                    of[p] = buffer
                    _moved(p, old_of, left)
        for p in self.params:  # out of every buffer (sparse): owns its gradient
            if p not in self.bucket_of and p not in self.arena_of and p in old_of:
                if p.grad is not None:
                    p.grad = p.grad.clone()
                _moved(p, old_of, left)
        self.cap_bytes = cap_bytes

    def note_ready(self, p: torch.Tensor) -> None:
        """A gradient came (its first backward pass of a step): remembered in order until
        the arenas have been laid out again."""
        if not self.relaid:
            self.order.append(p)

    def relay_after_step(self, steps: int) -> None:
        """After the first step whose gradients all came from backward (or the third step,
        if some parameter never gets one): lays the arenas out in the order the hooks ran,
        so the batches the engine fuses lie back to back."""
        order, self.order = self.order, []
        if (self.relaid or not self.arenas or not order
                or (len(order) < len(self.arena_of) and steps < 3)):
            return
        self.relaid = True
        laid = [id(p) for arena in self.arenas for p in arena.params]
        if [id(p) for p in order if p in self.arena_of] != laid:
            self.build(0, order)

    def make_sparse(self, p: torch.Tensor) -> None:
        """`p`'s gradients come sparse: out of its buffer, where its slot stays as a hole
        of zeros (the other gradients keep their views; some may be in flight already)."""
        self.sparse.add(p)
        holder = self.bucket_of.pop(p, None) or self.arena_of.pop(p, None)
        if holder is not None:
            holder.params.remove(p)
            del holder.views[p]
            p.grad = None

    def zero(self, set_to_none: bool) -> None:
        """Zeroes every bucket; the gradients stay its views. Arenas too, or with
        `set_to_none` their gradients become None and each view is zeroed just before
        backward adds the next gradient to it (`attach_zeroed`): no pass over every
        gradient's memory before the step's first gradient can go out."""
        for buffer in self.buckets:
            buffer.flat.zero_()
            buffer.attach()
        for buffer in self.arenas:
            if set_to_none:
                for p in buffer.views:
                    p.grad = None
            else:
                buffer.flat.zero_()
                buffer.attach()


def _moved(p: torch.Tensor, old_of: dict, left: dict) -> None:
    """Counts `p` out of its old buffer; frees that buffer once all its gradients moved."""
    old = old_of.get(p)
    if old is not None:
        left[old] -= 1
        if left[old] == 0:
            old.release()
