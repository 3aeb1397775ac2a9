"""The default reducer: gradients allreduced in units while backward runs, and the units
themselves (the face's one bucketing authority: what crosses the wire as one collective).

Where the gradients live: by default every gradient is a view into one flat buffer per
dtype and device (an arena), in reverse registration order (roughly the order backward
produces them). The arena is cut into runs of neighbouring gradients (`arena_runs`, as DDP
cuts its buckets, up to the fusion threshold knob): each run is a unit. `bucket_cap_mb` or
`groups` make fixed buckets instead (DDP's way): each bucket has its own buffer and is one
unit. Either way a gradient's unit is the same on every rank: it follows from the
parameters' registration order and agreed knobs.

How they go: a gradient's hook counts it ready in its unit; the unit goes to the engine
the moment its last gradient is ready, so communication starts with the first gradients
and keeps pace with backward, and crosses the wire as it is (the engine agrees on its
readiness and its route, and fuses or cuts nothing the face formed). Autotune moves the
threshold; every rank cuts its runs again at the same step, by the knobs in effect when
that rank's last unit was agreed (`Engine.knobs_at`). A unit's first request in a world is
checked and described as any allreduce's; its next ones reuse that description and go
straight to the engine. Sparse gradients (`nn.Embedding(sparse=True)`) leave their unit at
their first arrival and go on their own.
"""

from __future__ import annotations

from typing import Any

import torch

from raytrain_x.common.errors import ConfigError
from raytrain_x.common.knobs import Knobs
from raytrain_x.core import runtime
from raytrain_x.core.collectives import predivided
from raytrain_x.engine.engine import Engine
from raytrain_x.engine.messages import Handle, Meta, Request
from raytrain_x.torch.async_ops import (
    CompositeHandle,
    allreduce_async_,
    allreduce_request,
    sparse_allreduce_async,
)
from raytrain_x.torch.compression import Compressor
from raytrain_x.torch.grad_sync import GradientSync, Reducer

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


class AllreduceReducer(Reducer):
    """Allreduce (`op` Average or Sum) of each unit as its last gradient is ready.

    Args:
        op: `Average` or `Sum`.
        predivide: Horovod's `gradient_predivide_factor`.
        compression: the wire's compressor.
        bucket_cap_mb: fixed buckets of this size (None or 0: runs of the arena).
        groups: Horovod's `groups` (an int, or lists of parameters).
        sparse_as_dense: sparse gradients reduced dense.
    """

    arrivals = True
    warns_unskipped = True

    def __init__(self, op: str, predivide: float, compression: type[Compressor],
                 bucket_cap_mb: float | None, groups: Any, sparse_as_dense: bool) -> None:
        self._op = op
        self._predivide = predivide
        self._compression = compression
        self._cap_mb = bucket_cap_mb
        self._groups = groups
        self._sparse_as_dense = sparse_as_dense
        self._handles: dict[Unit | torch.Tensor, Handle] = {}  # by unit, or sparse parameter
        # the engine this world's units go to, and each unit's agreed description there
        self._engine: Engine | None = None
        self._described: dict[Unit, tuple[str, Meta]] = {}
        self._scaled = ("", 1.0, 1.0)  # (op, prescale, postscale) in this world
        self._step_began = False
        self._agreed_cycle = -1  # the cycle the last step's last unit was agreed in

    def bind(self, core: GradientSync) -> None:
        super().bind(core)
        params = core._requires_update
        self._unprobed = set(params)  # a first gradient tells whether it is sparse
        cap = int(self._cap_mb * 2**20) if self._cap_mb else 0
        self.layout = GradientLayout(params, core.gradient_names,
                                     explicit_groups(self._groups, params))
        # cut at the knobs at hand (asking nothing of an engine, which may have failed
        # already: its error belongs to the step), and again at the first step at the
        # engine's first knobs, the same on every rank
        knobs = runtime.last_knobs() or Knobs()
        self.layout.build(cap, knobs.fusion_threshold_bytes)
        runtime.note_gradient_batching(self.layout.fixed)

    @property
    def cap_bytes(self) -> int:
        return self.layout.cap_bytes

    def _world(self) -> Engine:
        """The engine of this world (a new one after an elastic reset, or init() again,
        and with it the units' descriptions and scaling made again)."""
        engine = self._engine
        if engine is None or engine.stopped:
            engine = self._engine = runtime.engine()
            self._described.clear()
            self._scaled = predivided(self._op, self._predivide, self.core._process_set.size())
            self._agreed_cycle = -1  # this engine's first knobs
        return engine

    def _begin_step(self) -> None:
        """A step's first unit is about to form: the runs are cut at the fusion threshold
        in effect when the last step's last unit was agreed (on every rank the same)."""
        self._step_began = True
        threshold = self._world().knobs_at(self._agreed_cycle).fusion_threshold_bytes
        if not self.layout.fixed and threshold != self.layout.unit_bytes:
            self.layout.cut(threshold)
            self._described.clear()

    # ------------------------------------------------------------------ backward
    def arriving(self, p: torch.Tensor, grad: torch.Tensor) -> None:
        """A parameter's first gradient leaves the flat buffers if it is sparse (its unit
        goes now if it was waiting for this gradient alone); an arena gradient set to None
        by `zero_grad()` gets its view back, zeroed, so it accumulates there in place."""
        if p in self._unprobed:
            self._unprobed.discard(p)
            if grad.is_sparse:
                unit = self.layout.make_sparse(p)
                if unit is not None and unit.params and unit not in self._handles:
                    self._send_if_complete(unit)
        if p.grad is None:
            unit = self.layout.unit_of.get(p)
            if isinstance(unit, GradientRun):
                unit.arena.attach_zeroed(p)

    def ready(self, p: torch.Tensor) -> None:
        if not self._step_began:
            self._begin_step()
        unit = self.layout.unit_of.get(p)
        if unit is None:
            self._handles[p] = self._allreduce_grad(p)
            return
        unit.ready += 1
        self._send_if_complete(unit)

    def _send_if_complete(self, unit: Unit) -> None:
        if unit.ready >= len(unit.params):
            unit.ready = 0
            self._handles[unit] = self._allreduce_unit(unit)

    def busy(self, p: torch.Tensor) -> bool:
        handle = self._handles.get(self.layout.unit_of.get(p, p))
        return handle is not None and not handle.done()

    def in_flight(self) -> bool:
        for key in [k for k, h in self._handles.items() if h.done()]:
            del self._handles[key]  # a failed world's, after an elastic reset
        return bool(self._handles)

    def forget(self) -> None:
        self._handles.clear()
        for unit in self.layout.units:
            unit.ready = 0
        self._step_began = False

    # ------------------------------------------------------------------ reductions
    def _allreduce_unit(self, unit: Unit) -> Handle:
        """A bucket or a run of the arena, its gradients pointed at their views first: one
        request the engine reduces as it is. Its first in a world goes through
        `allreduce_async_`'s checks; the next ones reuse the description."""
        unit.attach()
        engine = self._world()  # a new one if the world ended within this step
        described = self._described.get(unit)
        if described is None:
            op, pre, post = self._scaled
            request, handle = allreduce_request(unit.flat, None, unit.name, op, pre, post,
                                                self.core._process_set, self._compression,
                                                fuse=False)
            if handle is request.handle:  # not one a compressor's handle decompresses
                self._described[unit] = (request.name, request.meta)
        else:
            name, meta = described
            flat = unit.flat
            request = Request(name, meta, flat, Handle(name), flat, contiguous=True)
            handle = request.handle
        engine.enqueue(request)
        return handle

    def _allreduce_grad(self, p: torch.Tensor) -> Handle:
        """A gradient outside every unit: a sparse one, or zeros where none came."""
        if p.grad is None:  # no gradient this step: zeros, as Horovod sends
            p.grad = torch.zeros_like(p)
        name = f"grad.{self.core.gradient_names[p]}"
        op, pre, post = self._scaled
        pset = self.core._process_set
        if not p.grad.is_sparse:
            return allreduce_async_(p.grad, name=name, op=op, prescale_factor=pre,
                                    postscale_factor=post, process_set=pset,
                                    compression=self._compression)
        if self._sparse_as_dense:  # densified, reduced, and made sparse again
            inner = allreduce_async_(p.grad.to_dense(), name=name, op=op, prescale_factor=pre,
                                     postscale_factor=post, process_set=pset,
                                     compression=self._compression)
            handle = CompositeHandle(name, [inner], lambda out: out[0].to_sparse())
        else:  # as Horovod: an allgather of indices and values whose duplicates sum up
            handle = sparse_allreduce_async(p.grad, name, self._op, pset)
        return _Replacing(handle, p)

    def synchronize(self) -> None:
        if not self._step_began:
            self._begin_step()
        for p in self.core._requires_update:  # outside every unit (sparse), no hook fired
            if p not in self._handles and p not in self.layout.unit_of:
                self._handles[p] = self._allreduce_grad(p)
        for unit in self.layout.units:  # units some of whose gradients never came
            if unit not in self._handles:
                self._handles[unit] = self._allreduce_unit(unit)
        for handle in list(self._handles.values()):
            handle.wait()
        self._agreed_cycle = max((h.cycle for h in self._handles.values()), default=-1)

    def zero_grad(self, set_to_none: bool) -> bool:
        """Gradients in fixed buckets stay views of their buffers (zeroed, never None), as
        with DDP's gradient_as_bucket_view; the others find their place in the arena again
        when backward brings the next one, zeroed there just before it is added."""
        self.layout.zero(set_to_none)
        return self.layout.holds_all()


class _Replacing(Handle):
    """Waits for a gradient's reduction and puts the result in `p.grad` (sparse paths,
    whose result is a new tensor rather than the gradient reduced in place)."""

    __slots__ = ("_inner", "_param")

    def __init__(self, inner: Handle, param: torch.Tensor) -> None:
        super().__init__(inner.name)
        self._inner, self._param = inner, param

    def done(self) -> bool:
        return self._inner.done()

    @property
    def cycle(self) -> int:  # type: ignore[override]
        return getattr(self._inner, "cycle", -1)

    @cycle.setter
    def cycle(self, value: int) -> None:
        pass

    def wait(self, timeout: float | None = None) -> Any:
        result = self._inner.wait(timeout)
        self._param.grad = result
        return result
