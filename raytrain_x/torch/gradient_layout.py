"""How a face's dense gradients lie in memory, and the units each crossing the wire as one
collective: the torch face's one bucketing authority, shared by the reducers that reduce
gradients as backward produces them (allreduce, PowerSGD).

By default every gradient is a view into one flat buffer per dtype and device (an arena),
in reverse registration order (roughly the order backward produces them), cut into runs of
neighbouring gradients as DDP cuts its buckets (`arena_runs`). `bucket_cap_mb` or `groups`
make fixed buckets instead, each with a buffer of its own (`bucket_groups`,
`explicit_groups`). Either way a gradient's unit is the same on every rank: it follows from
the parameters' registration order and agreed knobs.
"""

from __future__ import annotations

from typing import Any

import torch

from raytrain_x.common.errors import ConfigError

_UNCAPPED = 2**62  # one buffer per run of a dtype and device

# Runs are cut as DDP cuts buckets: the first (the last layers', whose gradients come
# first) at DDP's first bucket size so that communication starts early, the others at the
# fusion threshold, and into at least `MIN_RUNS` so that most of it can cross while backward
# runs: over a slow link a run's bytes wait for its last gradient (ResNet-50's shapes on an
# emulated 1 Gbit/s link: runs of a quarter of the arena took 1.11x DDP's best bucket's
# step, a sixteenth 0.95x).
FIRST_RUN_BYTES = 1 << 20
MIN_RUNS = 16


class GradientBuffer:
    """Parameters whose gradients are views into one persistent flat buffer (a bucket,
    reduced as one collective, or an arena, whose runs go one by one)."""

    def __init__(self, index: int, params: list[torch.Tensor]) -> None:
        self.name = f"grad.bucket{index}"
        self.params = params
        first = params[0]
        numel = sum(p.numel() for p in params)
        self.flat = torch.zeros(numel, dtype=first.dtype, device=first.device)
        self.views: dict[torch.Tensor, torch.Tensor] = {}
        offset = 0
        for p in params:
            self.views[p] = self.flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        self.attach()  # copies each existing gradient into its view
        self.ready = 0  # gradients (times backward passes) ready since its last collective

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


class GradientRun:
    """Neighbouring gradients of an arena that go to the engine as one request (`flat`, a
    view of the arena) once the last of them is ready: the unit of the default layout, as a
    bucket is of the fixed one."""

    def __init__(self, arena: GradientBuffer, params: list[torch.Tensor], name: str) -> None:
        self.arena = arena
        self.params = params
        self.name = name
        self._start = arena.views[params[0]].storage_offset() - arena.flat.storage_offset()
        self._stop = self._start + sum(p.numel() for p in params)
        self.ready = 0  # gradients (times backward passes) ready since its last request

    @property
    def flat(self) -> torch.Tensor:
        """The run's stretch of the arena (gradients that left it, sparse ones, stay in it
        as zeros)."""
        return self.arena.flat[self._start:self._stop]

    def attach(self) -> None:
        """Points every gradient of the run at its view; one that did not come this step
        is zeros there."""
        for p in self.params:
            if p.grad is None:
                self.arena.attach_zeroed(p)
            else:
                self.arena.attach_one(p)


def arena_runs(params: list[torch.Tensor], unit_bytes: int) -> list[list[torch.Tensor]]:
    """An arena's parameters, in order, as runs cut the way DDP cuts its buckets: a run
    closes once it holds its limit, `FIRST_RUN_BYTES` for the first and a sixteenth of the
    arena for the others (at least `FIRST_RUN_BYTES`), never past `unit_bytes` (the
    fusion threshold; 0: every gradient alone)."""
    if unit_bytes <= 0:
        return [[p] for p in params]
    total = sum(p.numel() * p.element_size() for p in params)
    limit = min(unit_bytes, max(FIRST_RUN_BYTES, total // MIN_RUNS))
    first = min(FIRST_RUN_BYTES, limit)
    runs: list[list[torch.Tensor]] = []
    current: list[torch.Tensor] = []
    size = 0
    for p in params:
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= (limit if runs else first):
            runs.append(current)
            current, size = [], 0
    if current:
        runs.append(current)
    return runs


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
    """The buffers of one optimizer's dense gradients, and the units each reduced by one
    request: fixed buckets (`groups`, or a `cap_bytes` > 0) or the runs of arenas."""

    def __init__(self, params: list[torch.Tensor], names: dict[torch.Tensor, str],
                 groups: list[list[torch.Tensor]] | None) -> None:
        self.params = params  # those that require gradients, in registration order
        self.names = names
        self.groups = groups
        self.buckets: list[GradientBuffer] = []
        self.arenas: list[GradientBuffer] = []
        self.units: list[GradientBuffer | GradientRun] = []  # the buckets, or the runs
        self.unit_of: dict[torch.Tensor, GradientBuffer | GradientRun] = {}
        self.cap_bytes = -1
        self.unit_bytes = -1  # the fusion threshold the runs were cut at

    @property
    def fixed(self) -> bool:
        """The user fixed the buckets (`groups`, or `bucket_cap_mb` > 0)."""
        return self.groups is not None or self.cap_bytes > 0

    def holds_all(self) -> bool:
        """Every gradient is a view of a buffer (none is sparse)."""
        return len(self.unit_of) == len(self.params)

    def build(self, cap_bytes: int, unit_bytes: int) -> None:
        """Lays the gradients out, once: in buckets of `cap_bytes` (or the user's groups),
        else in arenas cut in runs of up to `unit_bytes`; a gradient that exists already is
        copied in."""
        if self.groups is not None:
            groups = [g for group in self.groups for g in bucket_groups(group, _UNCAPPED)]
        elif cap_bytes > 0:
            groups = bucket_groups(self.params, cap_bytes)
        else:
            groups = []
            self.arenas = [GradientBuffer(i, params) for i, params in
                           enumerate(bucket_groups(self.params, _UNCAPPED))]
        self.buckets = [GradientBuffer(i, params) for i, params in enumerate(groups)]
        self.cap_bytes = cap_bytes
        self.cut(unit_bytes)

    def cut(self, unit_bytes: int) -> None:
        """Cuts the arenas in runs of up to `unit_bytes` (again: the runs are views, so
        nothing moves); only between steps, with no unit in flight or half ready."""
        self.units = [*self.buckets, *(
            GradientRun(arena, run, self._run_name(run))
            for arena in self.arenas for run in arena_runs(arena.params, unit_bytes))]
        self.unit_of = {p: unit for unit in self.units for p in unit.params}
        self.unit_bytes = unit_bytes

    def _run_name(self, run: list[torch.Tensor]) -> str:
        """A run's collective: its gradient's name (Horovod's `grad.<parameter>`), or its
        first and last gradients' names."""
        first, last = self.names[run[0]], self.names[run[-1]]
        return f"grad.{first}" if len(run) == 1 else f"grad.{first}..{last}"

    def make_sparse(self, p: torch.Tensor) -> GradientBuffer | GradientRun | None:
        """`p`'s gradients come sparse: out of its unit and buffer, where its slot stays as
        a hole of zeros (the other gradients keep their views; some may be in flight
        already). Returns the unit it left."""
        unit = self.unit_of.pop(p, None)
        if unit is None:
            return None
        unit.params = _without(unit.params, p)
        if not unit.params:  # nothing of it is left to reduce
            self.units = _without(self.units, unit)
        buffer = unit if isinstance(unit, GradientBuffer) else unit.arena
        buffer.params = _without(buffer.params, p)
        del buffer.views[p]
        p.grad = None
        return unit

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


def _without(items: list, item: Any) -> list:
    """`items` but `item` (by identity: tensors compare by value)."""
    return [x for x in items if x is not item]


Unit = GradientBuffer | GradientRun
